/* Block hashes become dense ids: the buffers kept between calls and the
 * open-address table every rule indexes by.
 *
 * Part of coalesce/_ccompact.c, which includes it once (a single
 * translation unit, so that the rules inline): not a header of its own. */

/* ---- block hashes become dense ids ----------------------------------------- */

/* Every distinct block hash of a window (parents included) gets an id 0..U-1
 * from one open-address table, once per occurrence; the rules then index
 * plain arrays by id (hash-keyed rules) or by id * nmg + mg (keys of medium,
 * group and hash), which stay in cache where a table per rule would not. */

typedef struct {
    uint64_t v;  /* the int's value, or the bytes' hash */
    PyObject *b; /* NULL for an int >= 0, NEG_MARK for one < 0, else the bytes (borrowed) */
    int32_t id;
    uint32_t gen; /* the slot is in use when gen == the table's gen */
} Slot;

/* Lives across calls (in a State, guarded by its busy flag): a fresh calloc per window
 * costs more in page faults than the rules themselves.  Emptied in O(1) by
 * bumping its generation. */
typedef struct {
    Slot *s;
    size_t mask, cap; /* the window's slots are s[0..mask]; cap were allocated */
    uint32_t gen;
} Table;

typedef struct {
    void *p;
    size_t size;
} Buf;

#define KEEP_BYTES ((size_t)8 << 20) /* buffers above this are freed after a call */

static void *buf_get(Buf *b, size_t bytes) {
    if (bytes == 0) bytes = 1;
    if (b->size < bytes) {
        size_t size = b->size ? b->size : 4096;
        while (size < bytes) size *= 2;
        void *p = realloc(b->p, size);
        if (p == NULL) return NULL;
        b->p = p;
        b->size = size;
    }
    return b->p;
}

static void buf_trim(Buf *b) {
    if (b->size > KEEP_BYTES) {
        free(b->p);
        b->p = NULL;
        b->size = 0;
    }
}

/* Make room for n keys at load <= 1/2 in an open-address array of `size`-byte
 * slots (*s, *mask), emptied in O(1) by bumping *gen (a slot whose own gen
 * differs is free).  The array is kept across calls (*cap slots), but each
 * call uses only the first slots its window needs: a table sized once for a
 * big window would spread a small one's lookups over memory that is no
 * longer in the caches.  0 on memory error. */
static int slots_init(void **s, size_t *mask, size_t *cap, uint32_t *gen, size_t size,
                      Py_ssize_t n) {
    size_t want = 16;
    while (want < (size_t)n * 2 + 16) want <<= 1;
    if (*s == NULL || *cap < want) {
        free(*s);
        *s = calloc(want, size);
        if (*s == NULL) {
            *cap = *mask = 0;
            return 0;
        }
        *cap = want;
        *mask = want - 1;
        *gen = 1;
        return 1;
    }
    if (++*gen == 0) { /* wrapped: clear for real, once per 2**32 calls */
        memset(*s, 0, *cap * size);
        *gen = 1;
    }
    *mask = want - 1; /* every slot of an earlier call has an older gen: free */
    return 1;
}

/* Empty `t` and make room for n keys at load <= 1/2.  0 on memory error. */
static int table_init(Table *t, Py_ssize_t n) {
    return slots_init((void **)&t->s, &t->mask, &t->cap, &t->gen, sizeof(Slot), n);
}

/* Free a slot array that grew past KEEP_BYTES (slots_init makes a new one). */
static void slots_trim(void **s, size_t *mask, size_t *cap, size_t size) {
    if (*cap * size > KEEP_BYTES) {
        free(*s);
        *s = NULL;
        *mask = *cap = 0;
    }
}

static void table_trim(Table *t) { slots_trim((void **)&t->s, &t->mask, &t->cap, sizeof(Slot)); }

/* Where a probe for the int or bytes hash `v` starts (the read's prefetches use it too). */
static inline size_t id_home(const Table *t, uint64_t v) { return (size_t)mix64(v) & t->mask; }

/* The mark a slot's `b` holds for a negative int hash (SGLang's are signed 64-bit):
 * it tells -1 from 2**64 - 1, which share the same 64 bits.  Never dereferenced. */
static char neg_mark_;
#define NEG_MARK ((PyObject *)&neg_mark_)

/* The id of hash `h` (assigning the next one if new); -1 to decline the value. */
static inline int32_t hash_id(Table *t, PyObject *h, int32_t *next) {
    uint64_t v;
    PyObject *b = NULL;
    if (PyLong_CheckExact(h)) {
        if (!long_u64(h, &v)) {
            long long x = PyLong_AsLongLong(h); /* a negative int down to -2**63 */
            if (x == -1 && PyErr_Occurred()) {
                PyErr_Clear();
                return -1;
            }
            v = (uint64_t)x;
            b = NEG_MARK;
        }
    } else if (PyBytes_CheckExact(h)) {
        Py_hash_t hh = PyObject_Hash(h);
        if (hh == -1) {
            PyErr_Clear();
            return -1;
        }
        v = (uint64_t)hh;
        b = h;
    } else {
        return -1;
    }
    size_t i = id_home(t, v);
    for (;;) {
        Slot *s = &t->s[i];
        if (s->gen != t->gen) {
            s->v = v;
            s->b = b;
            s->gen = t->gen;
            s->id = (*next)++;
            return s->id;
        }
        if (s->v == v) {
            /* both ints of one sign, or the very same bytes object */
            if (b == s->b) return s->id;
            if (b != NULL && b != NEG_MARK && s->b != NULL && s->b != NEG_MARK &&
                PyBytes_GET_SIZE(b) == PyBytes_GET_SIZE(s->b) &&
                memcmp(PyBytes_AS_STRING(b), PyBytes_AS_STRING(s->b),
                       (size_t)PyBytes_GET_SIZE(b)) == 0)
                return s->id;
        }
        i = (i + 1) & t->mask;
    }
}
