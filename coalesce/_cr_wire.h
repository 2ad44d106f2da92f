/* A bounds-checked msgpack reader for the recorder's payload path
 * (coalesce/_crecord.c, State.record_payloads): just what reading back a
 * batch the sender encoded needs.  No Python API: it runs without the GIL.
 * Every read checks the bytes left; a malformed or truncated payload makes
 * a read return 0 (the caller then records the batch from its objects). */
#ifndef COALESCE_CR_WIRE_H
#define COALESCE_CR_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const unsigned char *p, *end;
} Rd;

static inline int rd_be(Rd *r, int n, uint64_t *v) {
    if (r->end - r->p < n) return 0;
    uint64_t x = 0;
    for (int i = 0; i < n; i++) x = (x << 8) | r->p[i];
    r->p += n;
    *v = x;
    return 1;
}

static inline int rd_advance(Rd *r, uint64_t n) {
    if ((uint64_t)(r->end - r->p) < n) return 0;
    r->p += n;
    return 1;
}

/* An array's length. */
static inline int rd_array(Rd *r, uint64_t *n) {
    if (r->p >= r->end) return 0;
    unsigned b = *r->p++;
    if ((b & 0xf0) == 0x90) {
        *n = b & 0x0f;
        return 1;
    }
    if (b == 0xdc) return rd_be(r, 2, n);
    if (b == 0xdd) return rd_be(r, 4, n);
    return 0;
}

/* A map's number of pairs. */
static inline int rd_map(Rd *r, uint64_t *n) {
    if (r->p >= r->end) return 0;
    unsigned b = *r->p++;
    if ((b & 0xf0) == 0x80) {
        *n = b & 0x0f;
        return 1;
    }
    if (b == 0xde) return rd_be(r, 2, n);
    if (b == 0xdf) return rd_be(r, 4, n);
    return 0;
}

/* A str: its bytes (*s, *len), not copied. */
static inline int rd_str(Rd *r, const unsigned char **s, uint64_t *len) {
    if (r->p >= r->end) return 0;
    unsigned b = *r->p++;
    uint64_t n;
    if ((b & 0xe0) == 0xa0) {
        n = b & 0x1f;
    } else if (b == 0xd9 || b == 0xda || b == 0xdb) {
        if (!rd_be(r, b == 0xd9 ? 1 : b == 0xda ? 2 : 4, &n)) return 0;
    } else {
        return 0;
    }
    *s = r->p;
    *len = n;
    return rd_advance(r, n);
}

/* Whether the next value is nil (consumed if so). */
static inline int rd_nil(Rd *r) {
    if (r->p < r->end && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

/* An int in [0, 2**64): 1 read, -1 a value of another kind or range (not
 * consumed), 0 truncated. */
static inline int rd_u64(Rd *r, uint64_t *v) {
    if (r->p >= r->end) return 0;
    unsigned b = *r->p;
    int n;
    if (b <= 0x7f) {
        r->p++;
        *v = b;
        return 1;
    }
    if (b >= 0xcc && b <= 0xcf) {
        n = 1 << (b - 0xcc);
    } else if (b >= 0xd0 && b <= 0xd3) { /* a signed form: only when not negative */
        n = 1 << (b - 0xd0);
        if (r->end - r->p < 1 + n) return 0;
        if (r->p[1] & 0x80) return -1;
    } else {
        return -1;
    }
    r->p++;
    return rd_be(r, n, v);
}

/* Skip one value (of any depth: a count of values still to skip, each at least
 * one byte, so the count never passes the bytes left). */
static inline int rd_skip(Rd *r) {
    uint64_t pending = 1, n;
    while (pending > 0) {
        pending--;
        if (r->p >= r->end) return 0;
        unsigned b = *r->p++;
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) continue;
        if ((b & 0xf0) == 0x80) {
            pending += 2 * (uint64_t)(b & 0x0f);
        } else if ((b & 0xf0) == 0x90) {
            pending += b & 0x0f;
        } else if ((b & 0xe0) == 0xa0) {
            if (!rd_advance(r, b & 0x1f)) return 0;
        } else {
            switch (b) {
            case 0xc4: case 0xc5: case 0xc6: /* bin 8/16/32 */
            case 0xd9: case 0xda: case 0xdb: /* str 8/16/32 */
                if (!rd_be(r, (b == 0xc4 || b == 0xd9) ? 1 : (b == 0xc5 || b == 0xda) ? 2 : 4, &n))
                    return 0;
                if (!rd_advance(r, n)) return 0;
                break;
            case 0xc7: case 0xc8: case 0xc9: /* ext 8/16/32: its length, its type */
                if (!rd_be(r, b == 0xc7 ? 1 : b == 0xc8 ? 2 : 4, &n)) return 0;
                if (!rd_advance(r, n + 1)) return 0;
                break;
            case 0xca: if (!rd_advance(r, 4)) return 0; break;
            case 0xcb: if (!rd_advance(r, 8)) return 0; break;
            case 0xcc: case 0xd0: if (!rd_advance(r, 1)) return 0; break;
            case 0xcd: case 0xd1: if (!rd_advance(r, 2)) return 0; break;
            case 0xce: case 0xd2: if (!rd_advance(r, 4)) return 0; break;
            case 0xcf: case 0xd3: if (!rd_advance(r, 8)) return 0; break;
            case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8: /* fixext 1..16 */
                if (!rd_advance(r, 1 + ((uint64_t)1 << (b - 0xd4)))) return 0;
                break;
            case 0xdc: case 0xdd:
                if (!rd_be(r, b == 0xdc ? 2 : 4, &n)) return 0;
                pending += n;
                break;
            case 0xde: case 0xdf:
                if (!rd_be(r, b == 0xde ? 2 : 4, &n)) return 0;
                pending += 2 * n;
                break;
            default: /* 0xc1: never used */
                return 0;
            }
        }
        if (pending > (uint64_t)(r->end - r->p)) return 0;
    }
    return 1;
}

static inline int str_is(const unsigned char *s, uint64_t len, const char *want, size_t wlen) {
    return want != NULL && len == wlen && memcmp(s, want, wlen) == 0;
}

#endif
