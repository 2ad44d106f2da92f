/* The compactor's rules 2, 3, 5a, 5 and 6 in C: an optional accelerator.
 *
 * coalesce.compactor._compact_events is the specification and the oracle; this
 * file computes the same list of events (equal values, the same untouched
 * objects, the same rule counts) for the windows it accepts, and declines the
 * rest by returning None, in which case the caller runs the pure-Python rules.
 * tests/test_accel.py checks the two against each other.
 *
 * How it is fast: the events' fields are read at their slot offsets (msgspec
 * structs keep each field in a fixed slot, found once per class from its
 * member descriptors), each distinct block hash gets a dense id from one
 * open-address table (so the rules index plain arrays), and the rules run on
 * small records (an event = a list of block ranges of input events) so that
 * no Python object is built until the final events, and only for the events a
 * rule changed (a __copy__ of the original, with its per-block lists replaced).
 * Buffers and the table are kept between calls (a fresh allocation per window
 * cost more in page faults than the rules), guarded against re-entry, and
 * freed after a call that grew them past 8 MiB.
 *
 * compact_window() drives a whole window as coalesce.compactor._compact_py
 * does (its oracle): adjacent batches of one registered batch class and rank
 * folded into one list, the rules above on each group, each result batch a
 * __copy__ of the group's first with the last one's ts and the new events.
 * It declines (None) any window holding a batch or event it does not take,
 * and the Python driver takes those whole.
 *
 * What it accepts (anything else returns None before any output is built):
 * events of registered classes (register(): BlockStored, BlockRemoved,
 * AllBlocksCleared-like msgspec structs with no __post_init__); lists for the
 * per-block fields; block hashes and parents that are exact ints in [-2**63, 2**64)
 * or exact bytes; mediums str or None; group_idx int or None; every other
 * field None, str, int, float or bool (so that comparing them runs no Python
 * code); non-empty stores; at most 64 distinct removal groups, 250 mediums,
 * 250 groups and 64 (medium, group) pairs per window; at most 32 classes per
 * process.
 *
 * Cost: O(events + block hashes) time and memory per call, with the GIL held;
 * the caller bounds the window (max_events_per_step).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_cstruct.h"

enum { K_OPAQUE = 0, K_STORED = 1, K_REMOVED = 2, K_CLEARED = 3 };

#define MAX_TYPES 32
#define MAX_ATTRS 32
#define MAX_IDS 250
#define MAX_DESCS 64
#define MAX_MG 64
#define MAX_WINDOW ((Py_ssize_t)1 << 28) /* events, and block hashes, per call */

typedef struct {
    PyTypeObject *type; /* strong reference, kept for the process's life */
    int kind;
    Py_ssize_t off_hashes, off_parent, off_tokens, off_bs, off_medium;
    Py_ssize_t off_extra, off_look, off_group; /* -1: the class has no such field */
    int n_attr;
    Py_ssize_t attr_off[MAX_ATTRS]; /* the fields a merge requires equal, in order */
} TypeInfo;

static TypeInfo g_types[MAX_TYPES];
static int g_ntypes = 0;
static PyObject *s_copy = NULL; /* "__copy__" */

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

/* ---- the window, read once ------------------------------------------------ */

typedef struct {
    PyObject *ev; /* borrowed from the input list */
    TypeInfo *ti;
    int kind;
    int32_t mg;     /* dense index of its (medium, group) */
    int32_t parent; /* the parent's hash id, -1 for None */
    Py_ssize_t h0, n; /* its hashes' ids: hids[h0 .. h0+n) */
    Py_ssize_t bs;
    int splittable;
    int tok_nonempty;
    char extra_none, look_none; /* extra_keys / lookahead_token_ids None or absent */
} Src;

typedef struct {
    int32_t src, start, end;
} Seg;

typedef struct {
    int kind;
    int changed;  /* 0: the item is its source event as given */
    int32_t base; /* the source whose class and other fields the event keeps */
    Py_ssize_t seg0, nseg;
} Item;

typedef struct {
    Seg *v;
    Py_ssize_t n, cap;
} SegVec;

static int segvec_push(SegVec *sv, int32_t src, int32_t start, int32_t end) {
    if (sv->n == sv->cap) {
        Py_ssize_t cap = sv->cap ? sv->cap * 2 : 64;
        Seg *v = (Seg *)realloc(sv->v, (size_t)cap * sizeof(Seg));
        if (v == NULL) return 0;
        sv->v = v;
        sv->cap = cap;
    }
    sv->v[sv->n].src = src;
    sv->v[sv->n].start = start;
    sv->v[sv->n].end = end;
    sv->n++;
    return 1;
}

typedef struct {
    int32_t base; /* the src whose fields define the group */
    int held;
    uint64_t stamp; /* insertion order into `held` */
    Py_ssize_t first_item, n;
    SegVec segs;
} Desc;

/* Everything one call works in.  Kept across calls (a fresh allocation per
 * window cost more in page faults than the rules).  `busy` (read and set with
 * the GIL held) makes a call that finds its state in use decline. */
typedef struct {
    Table ids;
    struct {
        Buf src, hids, op_idx, op_pos, op_prior, op_sure, alive, dead, items_a, items_b;
        Buf last_op, last_child, by_hash, by_key, removed;
        Buf g_key_any, g_key_store, g_hash_any, g_parent_of, g_chain_end, g_groups, g_next;
        Buf wire; /* compact_window(wire=True): one per-block array's encoding */
    } bufs;
    Desc descs[MAX_DESCS];
    SegVec segs_a, segs_b;
    int busy;
} State;

static State g_obj; /* compact_events */

static void segvec_trim(SegVec *v) {
    if ((size_t)v->cap * sizeof(Seg) > KEEP_BYTES) {
        free(v->v);
        v->v = NULL;
        v->cap = 0;
    }
}

static void trim_all(State *st) {
    table_trim(&st->ids);
    Buf *bufs = (Buf *)&st->bufs;
    for (size_t i = 0; i < sizeof(st->bufs) / sizeof(Buf); i++) buf_trim(&bufs[i]);
    segvec_trim(&st->segs_a);
    segvec_trim(&st->segs_b);
    for (int j = 0; j < MAX_DESCS; j++) segvec_trim(&st->descs[j].segs);
}

enum { P_HASHES, P_TOKENS, P_EXTRA, P_LOOK };

/* Items per block in a per-block field of src s: 1, or block_size for tokens. */
static inline Py_ssize_t per_block_k(const Src *s, int slot) {
    if (slot != P_TOKENS) return 1;
    return s->tok_nonempty ? s->bs : 0;
}

typedef struct {
    Py_ssize_t nsrc, nkeys;
    int32_t nids; /* distinct hashes */
    int nmg;      /* distinct (medium, group) pairs */
    Src *src;
    int32_t *hids;
    PyObject *mediums[MAX_IDS];
    int nmediums;
    PyObject *groups[MAX_IDS];
    int ngroups;
    uint32_t mgs[MAX_MG];
    State *st;
} Window;

#define KID(w, hid, mg) ((Py_ssize_t)(hid) * (w)->nmg + (mg))

static TypeInfo *find_type(PyTypeObject *tp) {
    for (int i = 0; i < g_ntypes; i++)
        if (g_types[i].type == tp) return &g_types[i];
    return NULL;
}

/* An id for `o` among the window's distinct values (identity, then ==), or -1. */
static int intern_id(PyObject **table, int *n, PyObject *o) {
    for (int i = 0; i < *n; i++)
        if (table[i] == o) return i;
    for (int i = 0; i < *n; i++) {
        int eq = PyObject_RichCompareBool(table[i], o, Py_EQ);
        if (eq < 0) {
            PyErr_Clear();
            return -1;
        }
        if (eq) return i;
    }
    if (*n >= MAX_IDS) return -1;
    table[*n] = o;
    return (*n)++;
}

static inline int atomic(PyObject *o) {
    return o == Py_None || PyUnicode_CheckExact(o) || PyLong_CheckExact(o) ||
           PyFloat_CheckExact(o) || PyBool_Check(o);
}

static inline int list_or_none(PyObject *o) { return o == Py_None || PyList_CheckExact(o); }

/* The dense index of the (medium, group) pair of ids among the window's; -1 past MAX_MG. */
static int mg_id(Window *w, int mid, int gid) {
    uint32_t pair = ((uint32_t)mid << 8) | (uint32_t)gid;
    int mg = 0;
    while (mg < w->nmg && w->mgs[mg] != pair) mg++;
    if (mg == w->nmg) {
        if (w->nmg == MAX_MG) return -1;
        w->mgs[w->nmg++] = pair;
    }
    return mg;
}

/* The hash ints and their id slots are the read's cache misses.  Both are
 * fetched ahead: the int AHEAD * 2 hashes (or events) ahead, the slot of the
 * one AHEAD ahead (its int has arrived).  Macros: GCC drops the calls of a
 * function that only prefetches. */
#define AHEAD 4
#define PREFETCH_FIRST_HASH(src)                                                   \
    do {                                                                           \
        const Src *p_ = (src);                                                     \
        if (p_->kind != K_CLEARED && p_->n > 0)                                    \
            __builtin_prefetch(PyList_GET_ITEM(FIELD(p_->ev, p_->ti->off_hashes), 0)); \
    } while (0)
#define PREFETCH_FIRST_SLOT(t, src)                                                \
    do {                                                                           \
        const Src *p_ = (src);                                                     \
        uint64_t v_;                                                               \
        if (p_->kind != K_CLEARED && p_->n > 0) {                                  \
            PyObject *h_ = PyList_GET_ITEM(FIELD(p_->ev, p_->ti->off_hashes), 0);  \
            if (PyLong_CheckExact(h_) && long_u64(h_, &v_))                        \
                __builtin_prefetch(&(t)->s[id_home((t), v_)]);                     \
        }                                                                          \
    } while (0)

/* Read every event of `events` into w.  1 on success, 0 to decline, -1 on error. */
static int read_window(PyObject *events, Window *w, PyTypeObject **unknown) {
    Py_ssize_t n = PyList_GET_SIZE(events);
    Py_ssize_t total = 0;
    w->nsrc = n;
    w->src = (Src *)buf_get(&w->st->bufs.src, (size_t)n * sizeof(Src));
    if (w->src == NULL) return -1;
    memset(w->src, 0, (size_t)n * sizeof(Src));
    TypeInfo *ti = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ev = PyList_GET_ITEM(events, i);
        if (ti == NULL || ti->type != Py_TYPE(ev)) ti = find_type(Py_TYPE(ev));
        if (ti == NULL) {
            *unknown = Py_TYPE(ev);
            return 0;
        }
        if (ti->kind == K_OPAQUE) return 0;
        Src *s = &w->src[i];
        s->ev = ev;
        s->ti = ti;
        s->kind = ti->kind;
        s->parent = -1;
        if (ti->kind == K_CLEARED) continue;
        PyObject *hashes = FIELD(ev, ti->off_hashes);
        if (hashes == NULL || !PyList_CheckExact(hashes)) return 0;
        s->n = PyList_GET_SIZE(hashes);
        total += s->n + 1; /* and its parent */
        for (int a = 0; a < ti->n_attr; a++) {
            PyObject *v = FIELD(ev, ti->attr_off[a]);
            if (v == NULL || !atomic(v)) return 0;
        }
    }
    if (n > MAX_WINDOW || total > MAX_WINDOW) return 0; /* ids and positions are int32 */
    w->hids = (int32_t *)buf_get(&w->st->bufs.hids, (size_t)total * sizeof(int32_t));
    if (w->hids == NULL || !table_init(&w->st->ids, total)) return -1;
    w->nkeys = total;
    Py_ssize_t k = 0;
    int32_t next = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Src *s = &w->src[i];
        TypeInfo *ti = s->ti;
        /* the first hash of the events ahead: its int, then its id slot */
        if (i + 2 * AHEAD < n) PREFETCH_FIRST_HASH(&w->src[i + 2 * AHEAD]);
        if (i + AHEAD < n) PREFETCH_FIRST_SLOT(&w->st->ids, &w->src[i + AHEAD]);
        if (s->kind == K_CLEARED) continue;
        PyObject *ev = s->ev;
        PyObject *hashes = FIELD(ev, ti->off_hashes);
        s->h0 = k;
        for (Py_ssize_t j = 0; j < s->n; j++) {
            if (j + 2 * AHEAD < s->n) __builtin_prefetch(PyList_GET_ITEM(hashes, j + 2 * AHEAD));
            int32_t id = hash_id(&w->st->ids, PyList_GET_ITEM(hashes, j), &next);
            if (id < 0) return 0;
            w->hids[k++] = id;
        }
        PyObject *medium = FIELD(ev, ti->off_medium);
        if (medium == NULL || !(medium == Py_None || PyUnicode_CheckExact(medium))) return 0;
        PyObject *group = ti->off_group >= 0 ? FIELD(ev, ti->off_group) : Py_None;
        if (group == NULL || !(group == Py_None || PyLong_CheckExact(group))) return 0;
        int mid = intern_id(w->mediums, &w->nmediums, medium);
        int gid = intern_id(w->groups, &w->ngroups, group);
        if (mid < 0 || gid < 0) return 0;
        s->mg = mg_id(w, mid, gid);
        if (s->mg < 0) return 0;
        if (s->kind != K_STORED) continue;
        if (s->n == 0) return 0;
        PyObject *parent = FIELD(ev, ti->off_parent);
        if (parent == NULL) return 0;
        if (parent != Py_None) {
            s->parent = hash_id(&w->st->ids, parent, &next);
            if (s->parent < 0) return 0;
        }
        PyObject *tokens = FIELD(ev, ti->off_tokens);
        PyObject *bs = FIELD(ev, ti->off_bs);
        if (tokens == NULL || !PyList_CheckExact(tokens) || bs == NULL || !PyLong_CheckExact(bs))
            return 0;
        int overflow = 0;
        long long bsv = PyLong_AsLongLongAndOverflow(bs, &overflow);
        if (overflow || bsv < 0 || bsv > (1LL << 30)) return 0;
        s->bs = (Py_ssize_t)bsv;
        Py_ssize_t ntok = PyList_GET_SIZE(tokens);
        s->tok_nonempty = ntok > 0;
        int split = !(ntok && ntok != s->bs * s->n);
        Py_ssize_t offs[2] = {ti->off_extra, ti->off_look};
        char *nones[2] = {&s->extra_none, &s->look_none};
        for (int o = 0; o < 2; o++) {
            *nones[o] = 1;
            if (offs[o] < 0) continue;
            PyObject *per = FIELD(ev, offs[o]);
            if (per == NULL || !list_or_none(per)) return 0;
            *nones[o] = per == Py_None;
            if (per != Py_None && PyList_GET_SIZE(per) != s->n) split = 0;
        }
        s->splittable = split;
    }
    w->nids = next;
    if (w->nmg == 0) w->nmg = 1;
    /* keyed arrays are nids * nmg long: decline a window of many media and groups */
    if ((Py_ssize_t)w->nids * w->nmg > 16 * total + 65536) return 0;
    return 1;
}

/* Fields a merge requires equal: identity, then == (all atomic, so no Python
 * code runs). */
static int attrs_equal(const Window *w, const Src *a, const Src *b) {
    (void)w;
    if (a->ti != b->ti) return 0;
    for (int i = 0; i < a->ti->n_attr; i++) {
        PyObject *x = FIELD(a->ev, a->ti->attr_off[i]);
        PyObject *y = FIELD(b->ev, b->ti->attr_off[i]);
        if (x == y) continue;
        int eq = PyObject_RichCompareBool(x, y, Py_EQ);
        if (eq <= 0) {
            if (eq < 0) PyErr_Clear();
            return 0;
        }
    }
    return 1;
}

/* ---- rule 3: cancel ------------------------------------------------------- */

/* Items for srcs [first, nsrc) after rule 3.  Returns 1, or -1 on memory error. */
static int rule_cancel(Window *w, Py_ssize_t first, Item *items, Py_ssize_t *nitems, SegVec *segs,
                       long *cancelled) {
    Py_ssize_t n = w->nsrc, H = w->nkeys, NK = (Py_ssize_t)w->nids * w->nmg;
    int32_t *op_idx = (int32_t *)buf_get(&w->st->bufs.op_idx, (size_t)H * sizeof(int32_t));
    int32_t *op_pos = (int32_t *)buf_get(&w->st->bufs.op_pos, (size_t)H * sizeof(int32_t));
    int64_t *op_prior = (int64_t *)buf_get(&w->st->bufs.op_prior, (size_t)H * sizeof(int64_t));
    char *op_sure = (char *)buf_get(&w->st->bufs.op_sure, (size_t)H);
    int32_t *alive = (int32_t *)buf_get(&w->st->bufs.alive, (size_t)n * sizeof(int32_t));
    char *dead = (char *)buf_get(&w->st->bufs.dead, (size_t)H);
    /* the latest op on each key: an op index, -2 for a removal, -1 for none */
    int64_t *last_op = (int64_t *)buf_get(&w->st->bufs.last_op, (size_t)NK * sizeof(int64_t));
    /* the latest store naming each hash as its parent, -1 for none */
    int32_t *last_child = (int32_t *)buf_get(&w->st->bufs.last_child, (size_t)w->nids * sizeof(int32_t));
    if (!op_idx || !op_pos || !op_prior || !op_sure || !alive || !dead || !last_op || !last_child)
        return -1;
    memset(dead, 0, (size_t)H);
    memset(last_op, 0xff, (size_t)NK * sizeof(int64_t));
    memset(last_child, 0xff, (size_t)w->nids * sizeof(int32_t));
    Py_ssize_t nops = 0;
    int any_dead = 0;
    for (Py_ssize_t i = first; i < n; i++) {
        Src *s = &w->src[i];
        const int32_t *hids = w->hids + s->h0;
        if (s->kind == K_STORED) {
            int sure = 1;
            if (s->parent >= 0) {
                int64_t pop = last_op[KID(w, s->parent, s->mg)];
                sure = pop >= 0 && op_sure[pop];
                last_child[s->parent] = (int32_t)i;
            }
            for (Py_ssize_t p = 0; p < s->n; p++) {
                Py_ssize_t kid = KID(w, hids[p], s->mg);
                op_idx[nops] = (int32_t)i;
                op_pos[nops] = (int32_t)p;
                op_sure[nops] = (char)sure;
                op_prior[nops] = last_op[kid];
                last_op[kid] = (int64_t)nops;
                nops++;
            }
            alive[i] = (int32_t)s->n;
        } else { /* K_REMOVED */
            for (Py_ssize_t p = 0; p < s->n; p++) {
                Py_ssize_t kid = KID(w, hids[p], s->mg);
                int64_t op = last_op[kid];
                if (op >= 0 && op_prior[op] == -2 && op_sure[op] && w->src[op_idx[op]].splittable &&
                    alive[op_idx[op]] == op_pos[op] + 1 && last_child[hids[p]] < op_idx[op]) {
                    alive[op_idx[op]] = op_pos[op];
                    dead[s->h0 + p] = 1;
                    any_dead = 1;
                    last_op[kid] = op_prior[op];
                    (*cancelled)++;
                } else {
                    last_op[kid] = -2;
                }
            }
        }
    }
    Py_ssize_t m = 0;
    for (Py_ssize_t i = first; i < n; i++) {
        Src *s = &w->src[i];
        Item *it = &items[m];
        it->kind = s->kind;
        it->base = (int32_t)i;
        it->seg0 = segs->n;
        it->changed = 0;
        if (s->kind == K_STORED) {
            Py_ssize_t keep = any_dead ? alive[i] : s->n;
            if (keep == 0) continue;
            it->changed = keep != s->n;
            if (!segvec_push(segs, (int32_t)i, 0, (int32_t)keep)) return -1;
        } else {
            Py_ssize_t run = -1;
            int any = 0;
            for (Py_ssize_t p = 0; any_dead && p < s->n; p++) {
                if (dead[s->h0 + p]) {
                    any = 1;
                    if (run >= 0 && !segvec_push(segs, (int32_t)i, (int32_t)run, (int32_t)p))
                        return -1;
                    run = -1;
                } else if (run < 0) {
                    run = p;
                }
            }
            if (!any) {
                if (!segvec_push(segs, (int32_t)i, 0, (int32_t)s->n)) return -1;
            } else {
                if (run >= 0 && !segvec_push(segs, (int32_t)i, (int32_t)run, (int32_t)s->n))
                    return -1;
                it->changed = 1;
                if (segs->n == it->seg0) continue; /* every hash cancelled */
            }
        }
        it->nseg = segs->n - it->seg0;
        m++;
    }
    *nitems = m;
    return 1;
}

/* ---- rule 5a: gather ------------------------------------------------------ */

/* One output event of rule_gather: a removal and the removals merged into it,
 * or a chain of stores; its members are items of the input, in input order. */
typedef struct {
    int32_t first, last; /* member items: first, and last (next_item links them) */
    int32_t n;           /* members */
    int32_t tail;        /* a chain's last hash id */
    char chain_ok;
} Group;

static inline int32_t max32(int32_t a, int32_t b) { return a > b ? a : b; }

/* Item i joins group j (its last member so far). */
static inline void group_join(Group *groups, int32_t *next_item, int32_t j, Py_ssize_t i) {
    next_item[groups[j].last] = (int32_t)i;
    groups[j].last = (int32_t)i;
    groups[j].n++;
}

/* A new group holding item i alone; its index. */
static inline int32_t group_start(Group *groups, int32_t *ng, Py_ssize_t i) {
    int32_t j = (*ng)++;
    groups[j].first = groups[j].last = (int32_t)i;
    groups[j].n = 1;
    return j;
}

/* Rule 5a (coalesce.compactor._gather): each item joins the latest group it
 * may merge with when it commutes with every group after it (no shared key,
 * two removals excepted; neither names a hash of the other as parent), else
 * starts a group.  The maps hold, per key or hash, the latest group holding
 * it, so one lookup per key, hash and parent decides.  1, 0 to decline (too
 * many removal classes), -1 on memory error. */
static int rule_gather(Window *w, const Item *in, Py_ssize_t nin, const SegVec *insegs, Item *out,
                       Py_ssize_t *nout, SegVec *outsegs, long *merged) {
    Py_ssize_t NK = (Py_ssize_t)w->nids * w->nmg, U = w->nids;
    State *st = w->st;
    int32_t *key_any = (int32_t *)buf_get(&st->bufs.g_key_any, (size_t)NK * sizeof(int32_t));
    int32_t *key_store = (int32_t *)buf_get(&st->bufs.g_key_store, (size_t)NK * sizeof(int32_t));
    int32_t *chain_end = (int32_t *)buf_get(&st->bufs.g_chain_end, (size_t)NK * sizeof(int32_t));
    int32_t *hash_any = (int32_t *)buf_get(&st->bufs.g_hash_any, (size_t)U * sizeof(int32_t));
    int32_t *parent_of = (int32_t *)buf_get(&st->bufs.g_parent_of, (size_t)U * sizeof(int32_t));
    char *removed = (char *)buf_get(&st->bufs.removed, (size_t)U);
    Group *groups = (Group *)buf_get(&st->bufs.g_groups, (size_t)(nin ? nin : 1) * sizeof(Group));
    int32_t *next_item = (int32_t *)buf_get(&st->bufs.g_next, (size_t)(nin ? nin : 1) * sizeof(int32_t));
    if (!key_any || !key_store || !chain_end || !hash_any || !parent_of || !removed || !groups ||
        !next_item)
        return -1;
    memset(key_any, 0xff, (size_t)NK * sizeof(int32_t));
    memset(key_store, 0xff, (size_t)NK * sizeof(int32_t));
    memset(chain_end, 0xff, (size_t)NK * sizeof(int32_t));
    memset(hash_any, 0xff, (size_t)U * sizeof(int32_t));
    memset(parent_of, 0xff, (size_t)U * sizeof(int32_t));
    memset(removed, 0, (size_t)U);
    int32_t last_removal[MAX_DESCS];
    int32_t desc_base[MAX_DESCS];
    int ndescs = 0;
    int32_t ng = 0;
    for (Py_ssize_t i = 0; i < nin; i++) {
        const Item *it = &in[i];
        const Src *s = &w->src[it->base];
        const int32_t *hids = w->hids + s->h0;
        int32_t barrier = -1, j;
        next_item[i] = -1;
        if (it->kind == K_REMOVED) {
            for (Py_ssize_t q = 0; q < it->nseg; q++) {
                Seg g = insegs->v[it->seg0 + q];
                const int32_t *gh = w->hids + w->src[g.src].h0;
                for (int32_t p = g.start; p < g.end; p++) {
                    barrier = max32(barrier, key_store[KID(w, gh[p], s->mg)]);
                    barrier = max32(barrier, parent_of[gh[p]]);
                }
            }
            int d = -1;
            for (int k = 0; k < ndescs; k++)
                if (attrs_equal(w, &w->src[desc_base[k]], s)) {
                    d = k;
                    break;
                }
            if (d < 0) {
                if (ndescs == MAX_DESCS) return 0;
                d = ndescs++;
                desc_base[d] = it->base;
                last_removal[d] = -1;
            }
            j = last_removal[d];
            if (j > barrier) {
                group_join(groups, next_item, j, i);
            } else {
                j = group_start(groups, &ng, i);
                last_removal[d] = j;
            }
            for (Py_ssize_t q = 0; q < it->nseg; q++) {
                Seg g = insegs->v[it->seg0 + q];
                const int32_t *gh = w->hids + w->src[g.src].h0;
                for (int32_t p = g.start; p < g.end; p++) {
                    Py_ssize_t kid = KID(w, gh[p], s->mg);
                    key_any[kid] = max32(key_any[kid], j);
                    hash_any[gh[p]] = max32(hash_any[gh[p]], j);
                    removed[gh[p]] = 1;
                }
            }
            continue;
        }
        /* a store: one segment (src, 0, keep) */
        const Seg g = insegs->v[it->seg0];
        for (int32_t p = g.start; p < g.end; p++) {
            barrier = max32(barrier, key_any[KID(w, hids[p], s->mg)]);
            barrier = max32(barrier, parent_of[hids[p]]);
        }
        j = s->parent >= 0 ? chain_end[KID(w, s->parent, s->mg)] : -1;
        int join = 0;
        if (j > barrier && groups[j].chain_ok && hash_any[s->parent] <= j &&
            groups[j].tail == s->parent) {
            const Src *first = &w->src[in[groups[j].first].base];
            join = s->ti == first->ti && s->tok_nonempty == first->tok_nonempty &&
                   s->splittable && s->extra_none == first->extra_none &&
                   s->look_none == first->look_none && attrs_equal(w, first, s);
        }
        if (join) {
            group_join(groups, next_item, j, i);
        } else {
            j = group_start(groups, &ng, i);
            groups[j].chain_ok = (char)(s->splittable && !(s->parent >= 0 && removed[s->parent]));
        }
        for (int32_t p = g.start; p < g.end; p++) {
            Py_ssize_t kid = KID(w, hids[p], s->mg);
            key_any[kid] = max32(key_any[kid], j);
            key_store[kid] = max32(key_store[kid], j);
            hash_any[hids[p]] = max32(hash_any[hids[p]], j);
        }
        if (s->parent >= 0) parent_of[s->parent] = max32(parent_of[s->parent], j);
        groups[j].tail = hids[g.end - 1];
        chain_end[KID(w, groups[j].tail, s->mg)] = j;
    }
    for (int32_t k = 0; k < ng; k++) {
        Group *G = &groups[k];
        Item *o = &out[k];
        *o = in[G->first];
        o->seg0 = outsegs->n;
        for (int32_t m = G->first; m >= 0; m = next_item[m]) {
            const Item *it = &in[m];
            for (Py_ssize_t q = 0; q < it->nseg; q++) {
                Seg sg = insegs->v[it->seg0 + q];
                if (!segvec_push(outsegs, sg.src, sg.start, sg.end)) return -1;
            }
        }
        o->nseg = outsegs->n - o->seg0;
        if (G->n > 1) {
            o->changed = 1;
            *merged += (long)(G->n - 1);
        }
    }
    *nout = ng;
    return 1;
}

/* ---- rule 5: sink removals ------------------------------------------------ */

/* out = *it, its segments (nseg of them from segs) appended to outsegs.  0 on memory error. */
static int put_item(Item *out, const Item *it, const Seg *segs, Py_ssize_t nseg, SegVec *outsegs) {
    *out = *it;
    out->seg0 = outsegs->n;
    out->nseg = nseg;
    for (Py_ssize_t q = 0; q < nseg; q++)
        if (!segvec_push(outsegs, segs[q].src, segs[q].start, segs[q].end)) return 0;
    return 1;
}

typedef struct {
    uint64_t *by_hash; /* hash id -> held groups naming it */
    uint64_t *by_key;  /* key id -> held groups removing it */
} Held;

static int flush_desc(Window *w, Desc *d, int bit, Held *h, const Item *in, Item *out,
                      Py_ssize_t *nout, SegVec *outsegs, long *merged) {
    uint64_t clear = ~(1ULL << bit);
    int32_t mg = w->src[d->base].mg;
    for (Py_ssize_t q = 0; q < d->segs.n; q++) {
        Seg g = d->segs.v[q];
        const int32_t *hids = w->hids + w->src[g.src].h0;
        for (int32_t p = g.start; p < g.end; p++) {
            h->by_hash[hids[p]] &= clear;
            h->by_key[KID(w, hids[p], mg)] &= clear;
        }
    }
    /* the first removal held, carrying every merged removal's blocks */
    Item *it = &out[(*nout)++];
    if (!put_item(it, &in[d->first_item], d->segs.v, d->segs.n, outsegs)) return -1;
    if (d->n > 1) {
        *merged += (long)(d->n - 1);
        it->changed = 1;
    }
    d->held = 0;
    d->segs.n = 0;
    return 1;
}

/* Flush the held groups in `mask`, oldest first. */
static int flush_mask(Window *w, Desc *descs, uint64_t mask, Held *h, const Item *in, Item *out,
                      Py_ssize_t *nout, SegVec *outsegs, long *merged) {
    while (mask) {
        int best = -1;
        for (uint64_t m = mask; m; m &= m - 1) {
            int b = __builtin_ctzll(m);
            if (best < 0 || descs[b].stamp < descs[best].stamp) best = b;
        }
        mask &= ~(1ULL << best);
        if (flush_desc(w, &descs[best], best, h, in, out, nout, outsegs, merged) < 0) return -1;
    }
    return 1;
}

/* 1, 0 to decline (too many removal groups), -1 on memory error. */
static int rule_sink(Window *w, const Item *in, Py_ssize_t nin, const SegVec *insegs, Item *out,
                     Py_ssize_t *nout, SegVec *outsegs, long *merged) {
    int ndescs = 0;
    uint64_t held_mask = 0, stamp = 0;
    Desc *descs = w->st->descs;
    for (int j = 0; j < MAX_DESCS; j++) {
        descs[j].held = 0;
        descs[j].segs.n = 0;
    }
    Py_ssize_t NK = (Py_ssize_t)w->nids * w->nmg;
    Held h;
    h.by_hash = (uint64_t *)buf_get(&w->st->bufs.by_hash, (size_t)w->nids * sizeof(uint64_t));
    h.by_key = (uint64_t *)buf_get(&w->st->bufs.by_key, (size_t)NK * sizeof(uint64_t));
    if (h.by_hash == NULL || h.by_key == NULL) return -1;
    memset(h.by_hash, 0, (size_t)w->nids * sizeof(uint64_t));
    memset(h.by_key, 0, (size_t)NK * sizeof(uint64_t));
    *nout = 0;
    for (Py_ssize_t i = 0; i < nin; i++) {
        const Item *it = &in[i];
        const Src *base = &w->src[it->base];
        if (it->kind == K_REMOVED) {
            int d = -1;
            for (int j = 0; j < ndescs; j++)
                if (attrs_equal(w, &w->src[descs[j].base], base)) {
                    d = j;
                    break;
                }
            if (d < 0) {
                if (ndescs == MAX_DESCS) return 0;
                d = ndescs++;
            }
            Desc *D = &descs[d];
            if (!D->held) {
                D->held = 1;
                D->stamp = stamp++;
                D->first_item = i;
                D->n = 0;
                D->base = it->base;
                held_mask |= 1ULL << d;
            }
            D->n++;
            uint64_t bit = 1ULL << d;
            for (Py_ssize_t q = 0; q < it->nseg; q++) {
                Seg g = insegs->v[it->seg0 + q];
                if (!segvec_push(&D->segs, g.src, g.start, g.end)) return -1;
                const int32_t *hids = w->hids + w->src[g.src].h0;
                for (int32_t p = g.start; p < g.end; p++) {
                    h.by_hash[hids[p]] |= bit;
                    h.by_key[KID(w, hids[p], base->mg)] |= bit;
                }
            }
        } else { /* a store: one segment, or a chain's (rule 5a) */
            uint64_t conflict = 0;
            if (held_mask) {
                if (base->parent >= 0) conflict |= h.by_hash[base->parent];
                for (Py_ssize_t q = 0; q < it->nseg; q++) {
                    Seg g = insegs->v[it->seg0 + q];
                    const int32_t *hids = w->hids + w->src[g.src].h0;
                    for (int32_t p = g.start; p < g.end; p++)
                        conflict |= h.by_key[KID(w, hids[p], base->mg)];
                }
                conflict &= held_mask;
            }
            if (conflict) {
                if (flush_mask(w, descs, conflict, &h, in, out, nout, outsegs, merged) < 0)
                    return -1;
                held_mask &= ~conflict;
            }
            if (!put_item(&out[(*nout)++], it, &insegs->v[it->seg0], it->nseg, outsegs)) return -1;
        }
    }
    return flush_mask(w, descs, held_mask, &h, in, out, nout, outsegs, merged);
}

/* ---- rule 6: chains ------------------------------------------------------- */

static int rule_chain(Window *w, const Item *in, Py_ssize_t nin, const SegVec *insegs, Item *out,
                      Py_ssize_t *nout, SegVec *outsegs, long *merged) {
    char *removed = (char *)buf_get(&w->st->bufs.removed, (size_t)w->nids);
    if (removed == NULL) return -1;
    memset(removed, 0, (size_t)w->nids);
    Py_ssize_t m = 0;
    Item *chain = NULL; /* the item being built in out[] */
    int chain_ok = 0;
    int32_t last = -1; /* the chain's last hash id */
    const Src *first = NULL;
    for (Py_ssize_t i = 0; i < nin; i++) {
        const Item *it = &in[i];
        const Src *s = &w->src[it->base];
        if (it->kind == K_STORED) {
            const Seg *gs = &insegs->v[it->seg0];
            const Seg *g = &gs[it->nseg - 1]; /* a chain's (rule 5a) last segment */
            int32_t tail = w->hids[w->src[g->src].h0 + g->end - 1];
            if (chain != NULL && chain_ok && s->ti == first->ti && s->parent >= 0 &&
                s->parent == last && s->tok_nonempty == first->tok_nonempty && s->splittable &&
                s->extra_none == first->extra_none && s->look_none == first->look_none &&
                attrs_equal(w, first, s)) {
                for (Py_ssize_t q = 0; q < it->nseg; q++)
                    if (!segvec_push(outsegs, gs[q].src, gs[q].start, gs[q].end)) return -1;
                chain->nseg += it->nseg;
                chain->changed = 1;
                last = tail;
                (*merged)++;
                continue;
            }
            chain = &out[m++];
            if (!put_item(chain, it, gs, it->nseg, outsegs)) return -1;
            first = s;
            last = tail;
            chain_ok = s->splittable && !(s->parent >= 0 && removed[s->parent]);
            continue;
        }
        chain = NULL;
        if (!put_item(&out[m++], it, &insegs->v[it->seg0], it->nseg, outsegs)) return -1;
        for (Py_ssize_t q = 0; q < it->nseg; q++) {
            Seg g = insegs->v[it->seg0 + q];
            const int32_t *hids = w->hids + w->src[g.src].h0;
            for (int32_t p = g.start; p < g.end; p++) removed[hids[p]] = 1;
        }
    }
    *nout = m;
    return 1;
}

/* ---- the rules in order ----------------------------------------------------- */

/* Rules 3, 5a, 5 and 6 on srcs [first, nsrc), both entry points' pipeline.  The
 * result is in *res (items_a or items_b), *nres, *rsegs (sa or sb).  1, 0 to
 * decline, -1 on memory error. */
static int run_rules(Window *w, Py_ssize_t first, SegVec *sa, SegVec *sb, Item **res,
                     Py_ssize_t *nres, SegVec **rsegs, long *cancelled, long *merged) {
    Py_ssize_t n = w->nsrc, na = 0, nb = 0;
    Item *a = (Item *)buf_get(&w->st->bufs.items_a, (size_t)(n ? n : 1) * sizeof(Item));
    Item *b = (Item *)buf_get(&w->st->bufs.items_b, (size_t)(n ? n : 1) * sizeof(Item));
    if (a == NULL || b == NULL) return -1;
    sa->n = sb->n = 0;
    if (rule_cancel(w, first, a, &na, sa, cancelled) < 0) return -1;
    int r = rule_gather(w, a, na, sa, b, &nb, sb, merged);
    if (r <= 0) return r;
    sa->n = 0;
    r = rule_sink(w, b, nb, sb, a, &na, sa, merged);
    if (r <= 0) return r;
    sb->n = 0;
    if (rule_chain(w, a, na, sa, b, &nb, sb, merged) < 0) return -1;
    *res = b;
    *nres = nb;
    *rsegs = sb;
    return 1;
}

/* ---- building the events -------------------------------------------------- */

/* Elements in an item's per-block field: its segments' blocks, times block_size
 * for token ids (0 for a source without them). */
static Py_ssize_t concat_len(const Window *w, const SegVec *segs, const Item *it, int tokens) {
    Py_ssize_t total = 0;
    for (Py_ssize_t q = 0; q < it->nseg; q++) {
        Seg g = segs->v[it->seg0 + q];
        total += (g.end - g.start) * per_block_k(&w->src[g.src], tokens ? P_TOKENS : P_HASHES);
    }
    return total;
}

/* Segment g's source list at `off` if it still holds the segment's k items per
 * block, else NULL: an allocation since it was read may have run a finalizer,
 * which may run any code. */
static PyObject *seg_list(const Window *w, Seg g, Py_ssize_t off, Py_ssize_t k) {
    PyObject *lst = FIELD(w->src[g.src].ev, off);
    if (lst == NULL || !PyList_CheckExact(lst) || PyList_GET_SIZE(lst) < g.end * k) return NULL;
    return lst;
}

/* The concatenation of lst[start*k : end*k] over the item's segments, for the
 * list field at `off` of each segment's source. */
static PyObject *concat_field(Window *w, const SegVec *segs, const Item *it, Py_ssize_t off,
                              int tokens) {
    Py_ssize_t total = concat_len(w, segs, it, tokens);
    PyObject *out = PyList_New(total);
    if (out == NULL) return NULL;
    Py_ssize_t at = 0;
    for (Py_ssize_t q = 0; q < it->nseg; q++) {
        Seg g = segs->v[it->seg0 + q];
        Py_ssize_t k = per_block_k(&w->src[g.src], tokens ? P_TOKENS : P_HASHES);
        if (k == 0) continue;
        PyObject *lst = seg_list(w, g, off, k);
        if (lst == NULL) {
            Py_DECREF(out);
            PyErr_SetString(PyExc_RuntimeError, "an event changed while it was compacted");
            return NULL;
        }
        for (Py_ssize_t j = g.start * k; j < g.end * k; j++) {
            PyObject *x = PyList_GET_ITEM(lst, j);
            Py_INCREF(x);
            PyList_SET_ITEM(out, at++, x);
        }
    }
    return out;
}

static int set_field(PyObject *obj, Py_ssize_t off, PyObject *value) {
    if (value == NULL) return -1;
    PyObject *old = FIELD(obj, off);
    FIELD(obj, off) = value;
    Py_XDECREF(old);
    return 0;
}

static PyObject *concat_wire(Window *w, const SegVec *segs, const Item *it, Py_ssize_t off,
                             int tokens);

/* A result event: its source as given, or (changed) a __copy__ of its base with
 * the per-block lists concatenated from its segments.  With `wire`, the block
 * hashes and token ids are their msgpack encoding instead (msgspec.Raw), for a
 * caller that only encodes the result. */
static PyObject *build_item(Window *w, const SegVec *segs, const Item *it, int wire) {
    const Src *base = &w->src[it->base];
    if (!it->changed) {
        Py_INCREF(base->ev);
        return base->ev;
    }
    PyObject *obj = PyObject_CallMethodNoArgs(base->ev, s_copy);
    if (obj == NULL) return NULL;
    if (Py_TYPE(obj) != base->ti->type) {
        Py_DECREF(obj);
        PyErr_SetString(PyExc_TypeError, "__copy__ returned another type");
        return NULL;
    }
    const TypeInfo *ti = base->ti;
    PyObject *(*concat)(Window *, const SegVec *, const Item *, Py_ssize_t, int) =
        wire ? concat_wire : concat_field;
    if (set_field(obj, ti->off_hashes, concat(w, segs, it, ti->off_hashes, 0)) < 0) goto fail;
    if (it->kind == K_STORED) {
        if (base->tok_nonempty &&
            set_field(obj, ti->off_tokens, concat(w, segs, it, ti->off_tokens, 1)) < 0)
            goto fail;
        if (!base->extra_none &&
            set_field(obj, ti->off_extra, concat_field(w, segs, it, ti->off_extra, 0)) < 0)
            goto fail;
        if (!base->look_none &&
            set_field(obj, ti->off_look, concat_field(w, segs, it, ti->off_look, 0)) < 0)
            goto fail;
    }
    return obj;
fail:
    Py_DECREF(obj);
    return NULL;
}

/* ---- compact_window(wire=True): per-block arrays written as msgspec would ---- */

static PyObject *s_raw_type = NULL; /* msgspec.Raw, imported on first use */

/* Elements below which a list is built all the same: a bytes object and a Raw
 * cost more than a short list and its encoding. */
#define WIRE_MIN 32

/* An int as msgspec encodes it (the shortest uint form; for a negative one the
 * shortest int form) at p, which has room for 9 bytes: the end, or NULL for an
 * int msgspec refuses (past 64 bits) or that is not an exact int. */
static inline unsigned char *put_int(unsigned char *p, PyObject *x) {
    uint64_t u;
    if (long_u64(x, &u)) {
        if (u < 128) {
            *p++ = (unsigned char)u;
        } else if (u < 256) {
            *p++ = 0xcc;
            *p++ = (unsigned char)u;
        } else if (u < 65536) {
            *p++ = 0xcd;
            *p++ = (unsigned char)(u >> 8);
            *p++ = (unsigned char)u;
        } else if (u < ((uint64_t)1 << 32)) {
            *p++ = 0xce;
            for (int i = 24; i >= 0; i -= 8) *p++ = (unsigned char)(u >> i);
        } else {
            *p++ = 0xcf;
            for (int i = 56; i >= 0; i -= 8) *p++ = (unsigned char)(u >> i);
        }
        return p;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return NULL;
    }
    if (overflow || v >= 0) return NULL;
    uint64_t b = (uint64_t)v;
    if (v >= -32) {
        *p++ = (unsigned char)(0xe0 | (b & 0x1f));
    } else if (v >= -128) {
        *p++ = 0xd0;
        *p++ = (unsigned char)b;
    } else if (v >= -32768) {
        *p++ = 0xd1;
        *p++ = (unsigned char)(b >> 8);
        *p++ = (unsigned char)b;
    } else if (v >= -((long long)1 << 31)) {
        *p++ = 0xd2;
        for (int i = 24; i >= 0; i -= 8) *p++ = (unsigned char)(b >> i);
    } else {
        *p++ = 0xd3;
        for (int i = 56; i >= 0; i -= 8) *p++ = (unsigned char)(b >> i);
    }
    return p;
}

/* concat_field's list, written as its msgpack encoding and wrapped in a
 * msgspec.Raw (which msgspec writes as it is): no list is built, and no
 * element referenced.  Elements are exact ints (as msgspec writes them) or
 * exact bytes (bin); for any other element, concat_field's list instead.
 * NULL on error. */
static PyObject *concat_wire(Window *w, const SegVec *segs, const Item *it, Py_ssize_t off,
                             int tokens) {
    Py_ssize_t total = concat_len(w, segs, it, tokens);
    if (total < WIRE_MIN || (uint64_t)total >= ((uint64_t)1 << 32))
        return concat_field(w, segs, it, off, tokens);
    Buf *buf = &w->st->bufs.wire;
    /* room for the header and every element as the longest int; bins make more */
    unsigned char *d = (unsigned char *)buf_get(buf, 5 + (size_t)total * 9);
    if (d == NULL) return PyErr_NoMemory();
    unsigned char *p = d;
    if (total < 16) {
        *p++ = (unsigned char)(0x90 | total);
    } else if (total < 65536) {
        *p++ = 0xdc;
        *p++ = (unsigned char)(total >> 8);
        *p++ = (unsigned char)total;
    } else {
        *p++ = 0xdd;
        for (int i = 24; i >= 0; i -= 8) *p++ = (unsigned char)((uint64_t)total >> i);
    }
    Py_ssize_t left = total;
    for (Py_ssize_t q = 0; q < it->nseg; q++) {
        Seg g = segs->v[it->seg0 + q];
        Py_ssize_t k = per_block_k(&w->src[g.src], tokens ? P_TOKENS : P_HASHES);
        if (k == 0) continue;
        PyObject *lst = seg_list(w, g, off, k);
        if (lst == NULL) return concat_field(w, segs, it, off, tokens); /* (which raises) */
        PyObject **items = ((PyListObject *)lst)->ob_item;
        for (Py_ssize_t j = g.start * k; j < g.end * k; j++) {
            PyObject *x = items[j];
            left--;
            if (PyLong_CheckExact(x)) {
                p = put_int(p, x);
                if (p == NULL) return concat_field(w, segs, it, off, tokens);
                continue;
            }
            if (!PyBytes_CheckExact(x) || PyBytes_GET_SIZE(x) >= ((Py_ssize_t)1 << 31))
                return concat_field(w, segs, it, off, tokens);
            size_t n = (size_t)PyBytes_GET_SIZE(x), at = (size_t)(p - d);
            d = (unsigned char *)buf_get(buf, at + 5 + n + (size_t)left * 9);
            if (d == NULL) return PyErr_NoMemory();
            p = d + at;
            if (n < 256) {
                *p++ = 0xc4;
                *p++ = (unsigned char)n;
            } else if (n < 65536) {
                *p++ = 0xc5;
                *p++ = (unsigned char)(n >> 8);
                *p++ = (unsigned char)n;
            } else {
                *p++ = 0xc6;
                for (int i = 24; i >= 0; i -= 8) *p++ = (unsigned char)(n >> i);
            }
            memcpy(p, PyBytes_AS_STRING(x), n);
            p += n;
        }
    }
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)d, (Py_ssize_t)(p - d));
    if (bytes == NULL) return NULL;
    PyObject *raw = PyObject_CallOneArg(s_raw_type, bytes);
    Py_DECREF(bytes);
    return raw;
}

/* ---- entry points --------------------------------------------------------- */

static int is_per_block(int kind, const char *name) {
    if (strcmp(name, "block_hashes") == 0) return 1;
    if (kind != K_STORED) return 0;
    return strcmp(name, "parent_block_hash") == 0 || strcmp(name, "token_ids") == 0 ||
           strcmp(name, "extra_keys") == 0 || strcmp(name, "lookahead_token_ids") == 0;
}

PyDoc_STRVAR(register_doc,
             "register(cls, kind, fields) -> bool\n\n"
             "Record a class's kind and the slot offsets of its fields (a tuple of\n"
             "names, __struct_fields__ order).  kind 0 means: decline windows that hold\n"
             "it.  Returns False if the class cannot be read this way (it is then\n"
             "registered as kind 0).  O(fields).");

static PyObject *cc_register(PyObject *self, PyObject *args) {
    PyObject *cls, *names;
    int kind;
    if (!PyArg_ParseTuple(args, "O!iO!", &PyType_Type, &cls, &kind, &PyTuple_Type, &names))
        return NULL;
    PyTypeObject *tp = (PyTypeObject *)cls;
    if (find_type(tp) != NULL) Py_RETURN_TRUE;
    if (g_ntypes >= MAX_TYPES) Py_RETURN_FALSE;
    TypeInfo ti;
    memset(&ti, 0, sizeof(ti));
    ti.kind = kind;
    ti.off_hashes = ti.off_parent = ti.off_tokens = ti.off_bs = ti.off_medium = -1;
    ti.off_extra = ti.off_look = ti.off_group = -1;
    int ok = kind == K_STORED || kind == K_REMOVED || kind == K_CLEARED;
    Py_ssize_t nf = PyTuple_GET_SIZE(names);
    for (Py_ssize_t i = 0; ok && i < nf; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        const char *s = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
        if (s == NULL) {
            PyErr_Clear();
            ok = 0;
            break;
        }
        Py_ssize_t off = member_offset(tp, name);
        if (off < 0) {
            ok = 0;
            break;
        }
        if (strcmp(s, "block_hashes") == 0) ti.off_hashes = off;
        else if (strcmp(s, "parent_block_hash") == 0) ti.off_parent = off;
        else if (strcmp(s, "token_ids") == 0) ti.off_tokens = off;
        else if (strcmp(s, "block_size") == 0) ti.off_bs = off;
        else if (strcmp(s, "medium") == 0) ti.off_medium = off;
        else if (strcmp(s, "extra_keys") == 0) ti.off_extra = off;
        else if (strcmp(s, "lookahead_token_ids") == 0) ti.off_look = off;
        else if (strcmp(s, "group_idx") == 0) ti.off_group = off;
        if (!is_per_block(kind, s)) {
            if (ti.n_attr >= MAX_ATTRS) {
                ok = 0;
                break;
            }
            ti.attr_off[ti.n_attr++] = off;
        }
    }
    if (ok && kind == K_STORED)
        ok = ti.off_hashes >= 0 && ti.off_parent >= 0 && ti.off_tokens >= 0 && ti.off_bs >= 0 &&
             ti.off_medium >= 0;
    if (ok && kind == K_REMOVED) ok = ti.off_hashes >= 0 && ti.off_medium >= 0;
    if (!ok) ti.kind = K_OPAQUE;
    Py_INCREF(tp);
    ti.type = tp;
    g_types[g_ntypes++] = ti;
    return PyBool_FromLong(ok);
}

PyDoc_STRVAR(compact_doc,
             "compact_events(events) -> (events, superseded, cancelled, merged) | type | None\n\n"
             "Rules 2, 3, 5a, 5 and 6 of coalesce.compactor on one folded group's events (a\n"
             "list), exactly as _compact_events computes them without moves.  Returns a\n"
             "class that is not registered yet (register it and call again), or None\n"
             "for a window this accelerator declines.  O(events + block hashes).");

/* Rules 2 to 6 on one folded group's events (an exact list, held by the
 * caller): *out is a new list, counts[] the rules' (superseded, cancelled,
 * merged) added.  1 on success; 0 to decline (*unknown is set when a class not
 * registered yet is why); -1 on error (an exception is set). */
static int compact_group(PyObject *events, PyObject **out_list, long counts[3],
                         PyTypeObject **unknown, int wire) {
    State *st = &g_obj;
    if (st->busy) return 0;
    st->busy = 1;
    Window w;
    memset(&w, 0, sizeof(w));
    w.st = st;
    Item *a = NULL;
    SegVec sa = st->segs_a, sb = st->segs_b;
    sa.n = sb.n = 0;
    int status = -1;
    long cancelled = 0, merged = 0;
    int r = read_window(events, &w, unknown);
    if (r <= 0) {
        if (r < 0) PyErr_NoMemory();
        status = r;
        goto done;
    }
    Py_ssize_t n = w.nsrc, last_clear = -1;
    for (Py_ssize_t i = n - 1; i >= 0; i--)
        if (w.src[i].kind == K_CLEARED) {
            last_clear = i;
            break;
        }
    Py_ssize_t na = 0;
    SegVec *rs = NULL;
    r = run_rules(&w, last_clear + 1, &sa, &sb, &a, &na, &rs, &cancelled, &merged);
    if (r <= 0) {
        if (r < 0) PyErr_NoMemory();
        status = r;
        goto done;
    }
    Py_ssize_t head = last_clear >= 0 ? 1 : 0;
    PyObject *out = PyList_New(head + na);
    if (out == NULL) goto done;
    if (head) {
        PyObject *clear = w.src[last_clear].ev;
        Py_INCREF(clear);
        PyList_SET_ITEM(out, 0, clear);
    }
    for (Py_ssize_t i = 0; i < na; i++) {
        PyObject *ev = build_item(&w, rs, &a[i], wire);
        if (ev == NULL) {
            Py_DECREF(out);
            goto done;
        }
        PyList_SET_ITEM(out, head + i, ev);
    }
    *out_list = out;
    counts[0] += last_clear > 0 ? (long)last_clear : 0;
    counts[1] += cancelled;
    counts[2] += merged;
    status = 1;
done:
    st->segs_a = sa;
    st->segs_b = sb;
    trim_all(st);
    st->busy = 0;
    return status;
}

static PyObject *cc_compact_events(PyObject *self, PyObject *events) {
    if (!PyList_CheckExact(events)) Py_RETURN_NONE;
    PyObject *out = NULL;
    PyTypeObject *unknown = NULL;
    long counts[3] = {0, 0, 0};
    int r = compact_group(events, &out, counts, &unknown, 0);
    if (r < 0) return NULL;
    if (r == 0) {
        if (unknown != NULL) {
            Py_INCREF(unknown);
            return (PyObject *)unknown;
        }
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(Nlll)", out, counts[0], counts[1], counts[2]);
}

PyDoc_STRVAR(all_known_doc,
             "all_known(events) -> True | None\n\n"
             "True when every event of the list is of a class registered with a kind\n"
             "this accelerator handles; None otherwise (the caller decides).  O(events).");

/* 1 when every event of the exact list `events` is of a class registered with
 * a kind the rules handle; 0 otherwise, with *unknown set to the first class
 * not registered yet, if that is why.  O(events); allocates nothing. */
static int all_kv(PyObject *events, PyTypeObject **unknown) {
    PyTypeObject *last = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
        PyTypeObject *tp = Py_TYPE(PyList_GET_ITEM(events, i));
        if (tp == last) continue;
        TypeInfo *ti = find_type(tp);
        if (ti == NULL) *unknown = tp;
        if (ti == NULL || ti->kind == K_OPAQUE) return 0;
        last = tp;
    }
    return 1;
}

static PyObject *cc_all_known(PyObject *self, PyObject *events) {
    PyTypeObject *unknown = NULL;
    if (!PyList_CheckExact(events) || !all_kv(events, &unknown)) Py_RETURN_NONE;
    Py_RETURN_TRUE;
}

/* ---- a whole window: rule 1 (fold), then the rules on each group ----------- */

/* A batch class: where its ts, events and data_parallel_rank are.  ok == 0:
 * windows that hold it are declined (the Python driver takes them). */
typedef struct {
    PyTypeObject *type; /* strong reference, kept for the process's life */
    int ok;
    Py_ssize_t off_ts, off_events, off_rank;
} BatchInfo;

static BatchInfo g_btypes[MAX_TYPES];
static int g_nbtypes = 0;
static PyObject *s_ts = NULL, *s_events = NULL, *s_rank = NULL;

static BatchInfo *find_btype(PyTypeObject *tp) {
    for (int i = 0; i < g_nbtypes; i++)
        if (g_btypes[i].type == tp) return &g_btypes[i];
    return NULL;
}

PyDoc_STRVAR(register_batch_doc,
             "register_batch(cls, ok) -> bool\n\n"
             "Record a batch class and the slot offsets of its ts, events and\n"
             "data_parallel_rank fields.  ok false, or a field that is not a slot, means:\n"
             "decline windows that hold it.  Returns whether windows of it are taken\n"
             "(False too when the table of batch classes is full).  O(1).");

static PyObject *cc_register_batch(PyObject *self, PyObject *args) {
    PyObject *cls;
    int ok;
    if (!PyArg_ParseTuple(args, "O!p", &PyType_Type, &cls, &ok)) return NULL;
    PyTypeObject *tp = (PyTypeObject *)cls;
    BatchInfo *known = find_btype(tp);
    if (known != NULL) return PyBool_FromLong(known->ok);
    if (g_nbtypes >= MAX_TYPES) Py_RETURN_FALSE;
    BatchInfo bi;
    bi.off_ts = member_offset(tp, s_ts);
    bi.off_events = member_offset(tp, s_events);
    bi.off_rank = member_offset(tp, s_rank);
    bi.ok = ok && bi.off_ts >= 0 && bi.off_events >= 0 && bi.off_rank >= 0;
    Py_INCREF(tp);
    bi.type = tp;
    g_btypes[g_nbtypes++] = bi;
    return PyBool_FromLong(bi.ok);
}

/* Why check_batch declined: nothing to ask, or a class to register first. */
typedef struct {
    int code; /* 0: an event class, 1: a batch class */
    PyTypeObject *type;
} Ask;

/* 1 when the window call takes batch `b` (a registered batch class, an exact
 * list of events all of registered KV classes, a rank None or an exact int);
 * 0 otherwise, with ask->type set when an unregistered class is why.
 * Allocates nothing, so no Python code runs. */
static int check_batch(PyObject *b, BatchInfo **bip, Ask *ask) {
    BatchInfo *bi = find_btype(Py_TYPE(b));
    if (bi == NULL) {
        ask->code = 1;
        ask->type = Py_TYPE(b);
        return 0;
    }
    if (!bi->ok) return 0;
    PyObject *events = FIELD(b, bi->off_events);
    PyObject *rank = FIELD(b, bi->off_rank);
    if (events == NULL || !PyList_CheckExact(events) || FIELD(b, bi->off_ts) == NULL ||
        rank == NULL || !(rank == Py_None || PyLong_CheckExact(rank)))
        return 0;
    ask->code = 0;
    if (!all_kv(events, &ask->type)) return 0;
    *bip = bi;
    return 1;
}

/* Ranks already checked None or exact ints: comparing them runs no Python code. */
static int same_rank(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    if (a == Py_None || b == Py_None) return 0;
    return PyObject_RichCompareBool(a, b, Py_EQ) == 1;
}

/* A copy of `first` with `ts` and `events` (both references stolen), as
 * msgspec.structs.replace(first, ts=ts, events=events) builds it. */
static PyObject *rebuild_batch(PyObject *first, const BatchInfo *bi, PyObject *ts,
                               PyObject *events) {
    PyObject *obj = PyObject_CallMethodNoArgs(first, s_copy);
    if (obj != NULL && Py_TYPE(obj) != bi->type) {
        Py_DECREF(obj);
        obj = NULL;
        PyErr_SetString(PyExc_TypeError, "__copy__ returned another type");
    }
    if (obj == NULL) {
        Py_DECREF(ts);
        Py_DECREF(events);
        return NULL;
    }
    set_field(obj, bi->off_ts, ts);
    set_field(obj, bi->off_events, events);
    return obj;
}

/* The events of batches [i, j) in one new list (strong references); NULL with
 * *declined set when a batch changed since it was checked (an allocation may
 * run a finalizer, which may run any code), NULL alone on error.  With
 * `check`, the events' classes are checked again too (the rules' read does
 * that itself, so only the fold-only level asks). */
static PyObject *fold_events(PyObject *batches, Py_ssize_t i, Py_ssize_t j, const BatchInfo *bi,
                             Py_ssize_t total, int check, int *declined) {
    PyObject *evs = PyList_New(total);
    if (evs == NULL) return NULL;
    Py_ssize_t at = 0;
    for (Py_ssize_t k = i; k < j; k++) {
        PyObject *b = PyTuple_GET_ITEM(batches, k);
        PyObject *events = FIELD(b, bi->off_events);
        if (events == NULL || !PyList_CheckExact(events) ||
            PyList_GET_SIZE(events) > total - at) {
            Py_DECREF(evs); /* (its unset items are NULL: list_dealloc skips them) */
            *declined = 1;
            return NULL;
        }
        for (Py_ssize_t e = 0; e < PyList_GET_SIZE(events); e++) {
            PyObject *x = PyList_GET_ITEM(events, e);
            Py_INCREF(x);
            PyList_SET_ITEM(evs, at++, x);
        }
    }
    if (at != total) {
        Py_DECREF(evs);
        *declined = 1;
        return NULL;
    }
    PyTypeObject *unknown = NULL;
    if (check && !all_kv(evs, &unknown)) {
        Py_DECREF(evs);
        *declined = 1;
        return NULL;
    }
    return evs;
}

PyDoc_STRVAR(compact_window_doc,
             "compact_window(batches, fold_only, wire=False) -> (batches, events_in, events_out,\n"
             "    folded, superseded, cancelled, merged) | (code, cls) | None\n\n"
             "coalesce.compactor.compact(batches, fold_only=fold_only) without moves, in\n"
             "one call: adjacent batches of one class and rank folded, then (unless\n"
             "fold_only) rules 2 to 6 on each group, the result the same objects where\n"
             "nothing changed.  Returns (0, cls) or (1, cls) for an event or batch class\n"
             "not registered yet (register it and call again), None for a window it\n"
             "declines: any batch or event of a class declined, events not a list, a\n"
             "rank other than None or an int.  With wire, a changed event's block hashes\n"
             "and token ids are msgspec.Raw, their encoding: batches only to encode.\n"
             "O(batches + events + block hashes).");

static PyObject *cc_compact_window(PyObject *self, PyObject *args) {
    PyObject *given;
    int fold_only, wire = 0;
    if (!PyArg_ParseTuple(args, "O!p|p", &PyList_Type, &given, &fold_only, &wire)) return NULL;
    if (wire && s_raw_type == NULL) {
        PyObject *msgspec = PyImport_ImportModule("msgspec");
        if (msgspec == NULL) return NULL;
        s_raw_type = PyObject_GetAttrString(msgspec, "Raw"); /* kept for the process's life */
        Py_DECREF(msgspec);
        if (s_raw_type == NULL) return NULL;
    }
    PyObject *batches = PyList_AsTuple(given); /* held: the caller's list may change */
    if (batches == NULL) return NULL;
    PyObject *out = PyList_New(0), *result = NULL;
    if (out == NULL) goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(batches), events_in = 0, events_out = 0, groups = 0;
    long counts[3] = {0, 0, 0};
    Ask ask = {0, NULL};
    Py_ssize_t i = 0;
    while (i < n) {
        PyObject *first = PyTuple_GET_ITEM(batches, i);
        BatchInfo *bi = NULL;
        if (!check_batch(first, &bi, &ask)) goto decline;
        PyObject *rank = FIELD(first, bi->off_rank);
        Py_ssize_t total = PyList_GET_SIZE(FIELD(first, bi->off_events));
        Py_ssize_t j = i + 1;
        for (; j < n; j++) {
            PyObject *b = PyTuple_GET_ITEM(batches, j);
            BatchInfo *bj = NULL;
            if (!check_batch(b, &bj, &ask)) goto decline;
            if (bj != bi || !same_rank(FIELD(b, bi->off_rank), rank)) break;
            total += PyList_GET_SIZE(FIELD(b, bi->off_events));
        }
        events_in += total;
        groups++;
        if (fold_only && j == i + 1) { /* nothing to fold */
            if (PyList_Append(out, first) < 0) goto done;
            events_out += total;
            i = j;
            continue;
        }
        PyObject *last = PyTuple_GET_ITEM(batches, j - 1);
        PyObject *ts = FIELD(last, bi->off_ts);
        Py_INCREF(ts); /* before anything allocates */
        int declined = 0;
        PyObject *evs = fold_events(batches, i, j, bi, total, fold_only, &declined);
        if (evs == NULL) {
            Py_DECREF(ts);
            if (declined) goto decline;
            goto done;
        }
        PyObject *new = evs;
        if (!fold_only) {
            int r = compact_group(evs, &new, counts, &ask.type, wire);
            if (r <= 0) {
                Py_DECREF(ts);
                Py_DECREF(evs);
                if (r == 0) {
                    ask.code = 0;
                    goto decline;
                }
                goto done;
            }
            int same = j == i + 1 && PyList_GET_SIZE(new) == total;
            for (Py_ssize_t e = 0; same && e < total; e++)
                same = PyList_GET_ITEM(new, e) == PyList_GET_ITEM(evs, e);
            Py_DECREF(evs);
            if (same) { /* the rules changed nothing: the batch as given */
                Py_DECREF(new);
                Py_DECREF(ts);
                if (PyList_Append(out, first) < 0) goto done;
                events_out += total;
                i = j;
                continue;
            }
        }
        Py_ssize_t m = PyList_GET_SIZE(new);
        if (m == 0) { /* compacted to nothing: nothing to send */
            Py_DECREF(new);
            Py_DECREF(ts);
            i = j;
            continue;
        }
        PyObject *batch = rebuild_batch(first, bi, ts, new);
        if (batch == NULL) goto done;
        int r = PyList_Append(out, batch);
        Py_DECREF(batch);
        if (r < 0) goto done;
        events_out += m;
        i = j;
    }
    result = Py_BuildValue("(Onnnlll)", out, events_in, events_out, n - groups, counts[0],
                           counts[1], counts[2]);
    goto done;
decline:
    if (ask.type != NULL)
        result = Py_BuildValue("(iO)", ask.code, (PyObject *)ask.type);
    else {
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    Py_XDECREF(out);
    Py_DECREF(batches);
    return result;
}

static PyMethodDef cc_methods[] = {
    CSTRUCT_METHODS
    {"all_known", cc_all_known, METH_O, all_known_doc},
    {"register", cc_register, METH_VARARGS, register_doc},
    {"compact_events", cc_compact_events, METH_O, compact_doc},
    {"register_batch", cc_register_batch, METH_VARARGS, register_batch_doc},
    {"compact_window", cc_compact_window, METH_VARARGS, compact_window_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef cc_module = {
    PyModuleDef_HEAD_INIT, "coalesce._ccompact",
    "Optional C accelerator for coalesce.compactor (see the C source's header).", -1,
    cc_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ccompact(void) {
    s_copy = PyUnicode_InternFromString("__copy__");
    s_ts = PyUnicode_InternFromString("ts");
    s_events = PyUnicode_InternFromString("events");
    s_rank = PyUnicode_InternFromString("data_parallel_rank");
    if (s_copy == NULL || s_ts == NULL || s_events == NULL || s_rank == NULL) return NULL;
    return PyModule_Create(&cc_module);
}
