/* The recorder's key table and its growable vectors (for _crecord.c, which
 * includes it once): no Python API, so everything here may run with the GIL
 * released.
 *
 * A key is a scope id and a 64-bit hash, with IFLAG set in the scope word
 * when the 64 bits are an interned object's id rather than the hash's own
 * value (a hash that is not an int in [-2**63, 2**64): bytes, str, a bigger
 * int), and NFLAG when they are a negative int's two's complement (SGLang's
 * signed hashes, kept apart from the unsigned int of the same bits).  Open
 * addressing, linear probing, deletion by backward shift (no tombstones: a
 * table under churn stays as full as its keys). */
#ifndef COALESCE_CR_TABLE_H
#define COALESCE_CR_TABLE_H

#include <stdint.h>
#include "_cmix.h"
#include <stdlib.h>
#include <string.h>

#define IFLAG 0x80000000u
#define NFLAG 0x40000000u /* the 64 bits are a negative int's two's complement */
#define KFLAGS (IFLAG | NFLAG)
#define EMPTY 0xffffffffu
#define NIL 0xffffffffu

typedef struct {
    uint64_t h;
    uint32_t sk;    /* scope id | IFLAG; EMPTY: a free slot */
    uint32_t count; /* the key's count (the walk's counters: a count) */
    uint32_t src;   /* the source naming it (the walk's counters: unused) */
    uint32_t mix;   /* mix64(h)'s low 32 bits: its home, without mixing again */
} Ent;

typedef struct {
    Ent *e;
    size_t cap, n; /* cap: a power of 2, or 0 */
} Tab;


/* A key's flag bits from hash_key's flag (0 plain, 1 interned, 2 an interned kind
 * never stored, 3 a negative int). */
static inline uint32_t kflag(uint8_t f) { return f == 3 ? NFLAG : f ? IFLAG : 0; }

/* A key's home slot: its hash's alone, whatever its scope, so that a block's
 * keys in its tiers (a GPU store, the CPU store that offloads it, the GPU
 * removal between them) are neighbours: in a table past the caches, only the
 * first of them is a random access. */
static inline size_t tab_home(const Tab *t, uint64_t h) {
    return (size_t)mix64(h) & (t->cap - 1);
}

/* An entry's home (cap <= 2**32: the bits it keeps). */
static inline size_t ent_home(const Tab *t, const Ent *x) {
    return (size_t)x->mix & (t->cap - 1);
}

static inline Ent *tab_find(const Tab *t, uint64_t h, uint32_t sk) {
    if (t->cap == 0) return NULL;
    size_t m = t->cap - 1, i = tab_home(t, h);
    for (;;) {
        Ent *x = &t->e[i];
        if (x->sk == sk && x->h == h) return x;
        if (x->sk == EMPTY) return NULL;
        i = (i + 1) & m;
    }
}

static int tab_resize(Tab *t, size_t cap) {
    if ((uint64_t)cap > ((uint64_t)1 << 32)) return 0; /* (ent_home's bits) */
    Ent *e = (Ent *)malloc(cap * sizeof(Ent));
    if (e == NULL) return 0;
    for (size_t i = 0; i < cap; i++) e[i].sk = EMPTY;
    Tab nt = {e, cap, 0};
    for (size_t i = 0; i < t->cap; i++) {
        Ent *x = &t->e[i];
        if (x->sk == EMPTY) continue;
        size_t j = ent_home(&nt, x);
        while (e[j].sk != EMPTY) j = (j + 1) & (cap - 1);
        e[j] = *x;
        nt.n++;
    }
    free(t->e);
    *t = nt;
    return 1;
}

/* The entry of (h, sk), made (count 0, src NIL) if absent; *made says which.
 * NULL when out of memory. */
static inline Ent *tab_put(Tab *t, uint64_t h, uint32_t sk, int *made) {
    if ((t->n + 1) * 2 > t->cap && !tab_resize(t, t->cap ? t->cap * 2 : 64)) return NULL;
    uint64_t mixed = mix64(h);
    size_t m = t->cap - 1, i = (size_t)mixed & m;
    for (;;) {
        Ent *x = &t->e[i];
        if (x->sk == EMPTY) {
            x->h = h;
            x->mix = (uint32_t)mixed;
            x->sk = sk;
            x->count = 0;
            x->src = NIL;
            t->n++;
            *made = 1;
            return x;
        }
        if (x->sk == sk && x->h == h) {
            *made = 0;
            return x;
        }
        i = (i + 1) & m;
    }
}

/* Delete the entry x (a pointer from tab_find or tab_put): backward shift. */
static inline void tab_del(Tab *t, Ent *x) {
    size_t m = t->cap - 1, i = (size_t)(x - t->e), j = i;
    for (;;) {
        j = (j + 1) & m;
        Ent *y = &t->e[j];
        if (y->sk == EMPTY) break;
        size_t k = ent_home(t, y);
        /* y may move to i when its home is not in (i, j] (cyclically) */
        if ((j > i && (k <= i || k > j)) || (j < i && (k <= i && k > j))) {
            t->e[i] = *y;
            i = j;
        }
    }
    t->e[i].sk = EMPTY;
    t->n--;
}

static void tab_free(Tab *t) {
    free(t->e);
    t->e = NULL;
    t->cap = t->n = 0;
}

/* Halve a table that has become mostly empty (memory follows the keys held). */
static int tab_shrink(Tab *t) {
    if (t->cap <= 1024 || t->n * 8 > t->cap) return 1;
    size_t cap = t->cap;
    while (cap > 1024 && t->n * 8 < cap) cap /= 2;
    return tab_resize(t, cap);
}

/* A growable array of fixed-size items. */
typedef struct {
    char *p;
    size_t n, cap, item;
} Vec;

static inline void *vec_push(Vec *v) {
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        char *p = (char *)realloc(v->p, cap * v->item);
        if (p == NULL) return NULL;
        v->p = p;
        v->cap = cap;
    }
    return v->p + v->item * v->n++;
}

#define VEC_AT(v, T, i) (((T *)(v)->p)[i])

static void vec_free(Vec *v) {
    free(v->p);
    v->p = NULL;
    v->n = v->cap = 0;
}

/* Keep a vector's memory when small; give a large one back. */
static void vec_trim(Vec *v) {
    v->n = 0;
    if (v->cap * v->item > (1u << 20)) vec_free(v);
}

#endif
