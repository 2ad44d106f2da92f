/* The snapshot recorder's state in C: an optional accelerator.
 *
 * coalesce._recorder.Recorder (pure Python) is the specification and the
 * oracle; tests/test_recorder.py runs every property against both, and checks
 * the two against each other.  This file keeps the same state (a reference
 * count per key (medium, group_idx, block hash); per hash its parent, the
 * count of held keys and retained children, and the event and index that last
 * stored it) in native tables, and walks it in the same order rules to rebuild
 * it as chained stores a chunk at a time.
 *
 * How it is fast: the events' fields are read at their slot offsets (found
 * once per class from its member descriptors); hashes live in two
 * open-address tables (hash -> node, (node, medium and group) -> key) with
 * stable slab indices, so a block costs one or two probes and no Python
 * object.  The only references it holds are to the source events (for their
 * tokens and fields) and to bytes hashes.
 *
 * Domain (anything else makes record() return 1, "cannot interpret": the
 * caller forgets the state, as the Python recorder does on a value it cannot
 * handle): block hashes and parents that are exact ints in [0, 2**64) or
 * exact bytes; block_hashes a list; medium str or None; group_idx int or
 * None; at most 64 distinct (medium, group) pairs at a time (the pairs are
 * forgotten when the state is); at most 64 event classes per process (past
 * that, the caller passes a clear of a new class as one of its own and leaves
 * other tags out; a store or removal of a new class cannot be read).
 *
 * Cost: record() is O(blocks) (a table doubling is O(held) once in a while),
 * in two passes: the events are read into a flat array of ops and hash values
 * with the GIL held (no Python code runs, so nothing changes them), then the
 * tables are updated from the array without touching any Python object:
 * with the GIL released when the batch carries at least `release_at` hashes.
 * References the tables take meanwhile are counted, and the ones they drop
 * released, once it is held again.  Memory per block is a node (96 bytes), a
 * key (40 bytes) and a slot in each table (16 bytes, at load 1/4 to 1/2),
 * plus slab slack after doublings.  walk_next() is O(max_blocks) blocks per
 * call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_cstruct.h"

enum { K_IGNORE = 0, K_STORED = 1, K_REMOVED = 2, K_CLEARED = 3, K_MOVED = 4, K_BAD = 5 };
enum { REC_OK = 0, REC_UNREADABLE = 1, REC_TOO_MANY = 2 };

#define MAX_TYPES 64
#define MAX_MG 64

typedef struct {
    PyTypeObject *type; /* strong reference, kept for the process's life */
    int kind;
    Py_ssize_t off_hashes, off_parent, off_medium, off_from, off_group, off_tokens, off_bs;
} TypeInfo;

static TypeInfo g_types[MAX_TYPES];
static int g_ntypes = 0;

static TypeInfo *find_type(PyTypeObject *tp) {
    for (int i = 0; i < g_ntypes; i++)
        if (g_types[i].type == tp) return &g_types[i];
    return NULL;
}

/* ---- hash values ------------------------------------------------------------ */

enum { V_NONE = 0, V_INT = 1, V_BYTES = 2 };

typedef struct {
    uint64_t v;  /* the int's value, or the bytes' hash */
    PyObject *b; /* the bytes (a reference the holder owns), or NULL */
    uint8_t kind;
} HVal;

/* Read `o` as a hash value (None allowed when `none_ok`).  The bytes are borrowed. */
static inline int read_hval(PyObject *o, HVal *out, int none_ok) {
    if (PyLong_CheckExact(o)) {
        out->kind = V_INT;
        out->b = NULL;
        return long_u64(o, &out->v);
    }
    if (PyBytes_CheckExact(o)) {
        Py_hash_t hh = PyObject_Hash(o); /* cached in the object after the first time */
        if (hh == -1) {
            PyErr_Clear();
            return 0;
        }
        out->kind = V_BYTES;
        out->v = (uint64_t)hh;
        out->b = o;
        return 1;
    }
    if (none_ok && o == Py_None) {
        out->kind = V_NONE;
        out->v = 0;
        out->b = NULL;
        return 1;
    }
    return 0;
}

static inline int hval_eq(const HVal *a, const HVal *b) {
    if (a->kind != b->kind || a->v != b->v) return 0;
    if (a->kind != V_BYTES || a->b == b->b) return 1;
    Py_ssize_t n = PyBytes_GET_SIZE(a->b);
    return n == PyBytes_GET_SIZE(b->b) &&
           memcmp(PyBytes_AS_STRING(a->b), PyBytes_AS_STRING(b->b), (size_t)n) == 0;
}

static inline uint64_t hval_hash(const HVal *h) { return mix64(h->v ^ ((uint64_t)h->kind << 62)); }

static PyObject *hval_object(const HVal *h) {
    if (h->kind == V_INT) return PyLong_FromUnsignedLongLong(h->v);
    PyObject *o = h->kind == V_BYTES ? h->b : Py_None;
    Py_INCREF(o);
    return o;
}

/* ---- the state ---------------------------------------------------------------- */

typedef struct {
    HVal h;          /* the hash (h.b owned) */
    HVal parent;     /* the parent it was stored with (parent.b owned) */
    int32_t refs;    /* held keys with this hash + counted children; free slot: -1 */
    int32_t pnode;   /* the counted parent's node, or -1 */
    PyObject *src;   /* the event that last stored the hash (owned) */
    Py_ssize_t idx;  /* the block's position in it */
    uint32_t seen;   /* walk: the path that visited it */
    uint32_t done_gen;
    uint64_t done;   /* walk: (medium, group) pairs already emitted, when done_gen matches */
    int32_t next_free;
} Node;

typedef struct {
    int32_t node;   /* -1: a free slot */
    int32_t mg;
    int64_t count;
    PyObject *src;  /* the event that last stored the key (owned) */
    Py_ssize_t idx;
    int32_t next_free;
} Key;

typedef struct {
    uint64_t h;
    int32_t i; /* slab index, -1 empty */
} Slot;

typedef struct {
    Slot *s;
    size_t mask, used;
} Table;

typedef struct {
    int32_t mg;
    int32_t node;
} Ghost;

enum { OP_STORE = 0, OP_REMOVE = 1, OP_CLEAR = 2, OP_BAD = 3 };

/* One event read under the GIL: a store of hv[h0, h0 + n) chained from
 * `parent` (of source `ev`), a removal of them, a clear, or an event it
 * cannot interpret. */
typedef struct {
    int op;
    int32_t mg;
    PyObject *ev;
    HVal parent;
    Py_ssize_t h0, n;
} Op;

typedef struct {
    PyObject_HEAD
    Node *nodes;
    Py_ssize_t nodes_cap, nodes_len, nodes_live;
    int32_t nodes_free;
    Key *keys;
    Py_ssize_t keys_cap, keys_len, keys_live;
    int32_t keys_free;
    Table nt, kt;
    PyObject *mediums[MAX_MG]; /* per (medium, group) pair, owned */
    PyObject *groups[MAX_MG];
    int nmg;
    int valid;
    int busy;
    PyObject **trash; /* references to drop once the state is consistent again */
    Py_ssize_t trash_len, trash_cap;
    /* record(): the events are read into ops with the GIL held, then applied
     * (without it when there are enough); reference counts change only with it */
    Op *ops;
    Py_ssize_t ops_len, ops_cap;
    HVal *hv; /* the ops' hashes */
    Py_ssize_t hv_len, hv_cap;
    PyObject **temps; /* references held while the ops are applied */
    Py_ssize_t temps_len, temps_cap;
    PyObject **incs; /* references the tables took meanwhile (room reserved) */
    Py_ssize_t incs_len, incs_cap;
    int nogil;  /* applying without the GIL: trash() may not DECREF */
    /* the walk (chunks of a snapshot) */
    int walking;      /* 0: none, 1: keys, 2: ghosts, 3: done */
    uint32_t walk_gen, path_gen;
    Py_ssize_t cursor;
    int32_t *path;
    Py_ssize_t path_cap, path_len, path_pos;
    int32_t path_mg;
    Ghost *ghosts;
    Py_ssize_t ghosts_len, ghosts_cap, ghost_pos;
    /* the open chained store of the current chunk (borrowed from the chunk list) */
    PyObject *run_hashes;
    PyObject *run_src;
    Py_ssize_t run_idx;
    int32_t run_mg, run_node;
} State;

/* Room for `need` items of `size` bytes in *arr (capacity *cap, doubled).
 * Plain malloc: usable without the GIL.  0 if out of memory (*arr intact). */
static int grow(void **arr, Py_ssize_t *cap, Py_ssize_t need, size_t size) {
    if (need <= *cap) return 1;
    Py_ssize_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *a = realloc(*arr, (size_t)c * size);
    if (a == NULL) return 0;
    *arr = a;
    *cap = c;
    return 1;
}

static int trash(State *st, PyObject *o) {
    if (o == NULL) return 1;
    if (!grow((void **)&st->trash, &st->trash_cap, st->trash_len + 1, sizeof(PyObject *))) {
        /* the state stays consistent: only an owned reference goes (leaks
         * without the GIL, on a failed allocation only) */
        if (!st->nogil) Py_DECREF(o);
        return 0;
    }
    st->trash[st->trash_len++] = o;
    return 1;
}

static void empty_trash(State *st) {
    while (st->trash_len > 0) {
        PyObject *o = st->trash[--st->trash_len];
        Py_DECREF(o);
    }
    if (st->trash_cap > 4096) {
        free(st->trash);
        st->trash = NULL;
        st->trash_cap = 0;
    }
}

/* Tables: linear probing, load <= 1/2, deletion by backward shift. */

static int table_grow(Table *t) {
    size_t cap = t->s ? (t->mask + 1) * 2 : 64;
    Slot *s = (Slot *)malloc(cap * sizeof(Slot));
    if (s == NULL) return 0;
    for (size_t i = 0; i < cap; i++) s[i].i = -1;
    if (t->s != NULL) {
        for (size_t i = 0; i <= t->mask; i++) {
            if (t->s[i].i < 0) continue;
            size_t j = (size_t)t->s[i].h & (cap - 1);
            while (s[j].i >= 0) j = (j + 1) & (cap - 1);
            s[j] = t->s[i];
        }
        free(t->s);
    }
    t->s = s;
    t->mask = cap - 1;
    return 1;
}

static void table_free(Table *t) {
    free(t->s);
    t->s = NULL;
    t->mask = t->used = 0;
}

static void table_delete(Table *t, size_t i) {
    size_t j = i;
    for (;;) {
        j = (j + 1) & t->mask;
        if (t->s[j].i < 0) break;
        size_t home = (size_t)t->s[j].h & t->mask;
        /* move slot j back to i unless its home lies cyclically in (i, j] */
        if (i <= j ? (i < home && home <= j) : (i < home || home <= j)) continue;
        t->s[i] = t->s[j];
        i = j;
    }
    t->s[i].i = -1;
    t->used--;
}

/* Where a probe for hash `hh` starts (the prefetches ahead use it too). */
static inline size_t home(const Table *t, uint64_t hh) { return (size_t)hh & t->mask; }

/* The slot of node `h`, or of the empty slot where it would go (s[].i < 0). */
static inline size_t node_slot(State *st, const HVal *h, uint64_t hh) {
    Table *t = &st->nt;
    size_t i = home(t, hh);
    for (;;) {
        Slot *s = &t->s[i];
        if (s->i < 0) return i;
        if (s->h == hh && hval_eq(&st->nodes[s->i].h, h)) return i;
        i = (i + 1) & t->mask;
    }
}

/* The node of `h` (its hash `hh`), or -1. */
static inline int32_t node_find_hh(State *st, const HVal *h, uint64_t hh) {
    if (st->nt.s == NULL) return -1;
    return st->nt.s[node_slot(st, h, hh)].i;
}

static inline int32_t node_find(State *st, const HVal *h) { return node_find_hh(st, h, hval_hash(h)); }

/* A key's hash, from its node's hash (`nh`, hval_hash) and its pair: known
 * before the node is looked up, so that apply_ops can prefetch both slots. */
static inline uint64_t key_hash(uint64_t nh, int32_t mg) {
    return mix64(nh ^ ((uint64_t)(uint32_t)mg + 1) * 0x9e3779b97f4a7c15ULL);
}

static inline size_t key_slot(State *st, int32_t node, int32_t mg, uint64_t hh) {
    Table *t = &st->kt;
    size_t i = home(t, hh);
    for (;;) {
        Slot *s = &t->s[i];
        if (s->i < 0) return i;
        if (s->h == hh && st->keys[s->i].node == node && st->keys[s->i].mg == mg) return i;
        i = (i + 1) & t->mask;
    }
}

static inline int32_t key_find(State *st, int32_t node, int32_t mg) {
    if (st->kt.s == NULL) return -1;
    uint64_t kh = key_hash(hval_hash(&st->nodes[node].h), mg);
    return st->kt.s[key_slot(st, node, mg, kh)].i;
}

static int ensure_room(State *st) {
    if ((st->nt.used + 1) * 2 > st->nt.mask + 1 || st->nt.s == NULL)
        if (!table_grow(&st->nt)) return 0;
    if ((st->kt.used + 1) * 2 > st->kt.mask + 1 || st->kt.s == NULL)
        if (!table_grow(&st->kt)) return 0;
    if (st->nodes_free < 0 && st->nodes_len == st->nodes_cap) {
        Py_ssize_t cap = st->nodes_cap ? st->nodes_cap * 2 : 64;
        if (cap > INT32_MAX) return 0;
        Node *n = (Node *)realloc(st->nodes, (size_t)cap * sizeof(Node));
        if (n == NULL) return 0;
        st->nodes = n;
        st->nodes_cap = cap;
    }
    if (st->keys_free < 0 && st->keys_len == st->keys_cap) {
        Py_ssize_t cap = st->keys_cap ? st->keys_cap * 2 : 64;
        if (cap > INT32_MAX) return 0;
        Key *k = (Key *)realloc(st->keys, (size_t)cap * sizeof(Key));
        if (k == NULL) return 0;
        st->keys = k;
        st->keys_cap = cap;
    }
    return 1;
}

/* Forget the tables (the references go to the trash), not the (medium, group)
 * pairs: ops read before a clear name them.  Runs without the GIL.
 * O(held + retained). */
static void forget(State *st) {
    for (Py_ssize_t i = 0; i < st->nodes_len; i++) {
        Node *n = &st->nodes[i];
        if (n->refs < 0) continue;
        trash(st, n->src);
        if (n->h.b) trash(st, n->h.b);
        if (n->parent.b) trash(st, n->parent.b);
    }
    for (Py_ssize_t i = 0; i < st->keys_len; i++)
        if (st->keys[i].node >= 0) trash(st, st->keys[i].src);
    free(st->nodes);
    free(st->keys);
    st->nodes = NULL;
    st->keys = NULL;
    st->nodes_cap = st->nodes_len = st->nodes_live = 0;
    st->keys_cap = st->keys_len = st->keys_live = 0;
    st->nodes_free = st->keys_free = -1;
    table_free(&st->nt);
    table_free(&st->kt);
}

/* Forget the (medium, group) pairs.  With the GIL.  O(pairs). */
static void forget_pairs(State *st) {
    for (int i = 0; i < st->nmg; i++) {
        trash(st, st->mediums[i]);
        trash(st, st->groups[i]);
    }
    st->nmg = 0;
}

/* The index of the (medium, group) pair, adding it; -1 if it cannot be read. */
static int mg_id(State *st, PyObject *medium, PyObject *group) {
    if (!(medium == Py_None || PyUnicode_CheckExact(medium))) return -1;
    if (!(group == Py_None || PyLong_CheckExact(group))) return -1;
    for (int i = 0; i < st->nmg; i++)
        if (st->mediums[i] == medium && st->groups[i] == group) return i;
    for (int i = 0; i < st->nmg; i++) {
        /* str, int and None compare without running Python code */
        int a = PyObject_RichCompareBool(st->mediums[i], medium, Py_EQ);
        int b = a > 0 ? PyObject_RichCompareBool(st->groups[i], group, Py_EQ) : 0;
        if (a < 0 || b < 0) {
            PyErr_Clear();
            return -1;
        }
        if (a && b) return i;
    }
    if (st->nmg == MAX_MG) return -1;
    Py_INCREF(medium);
    Py_INCREF(group);
    st->mediums[st->nmg] = medium;
    st->groups[st->nmg] = group;
    return st->nmg++;
}

/* ---- reading the events (with the GIL) ------------------------------------------ */

static int hold(State *st, PyObject *o) {
    if (!grow((void **)&st->temps, &st->temps_cap, st->temps_len + 1, sizeof(PyObject *)))
        return -1;
    Py_INCREF(o);
    st->temps[st->temps_len++] = o;
    return 1;
}

static Op *new_op(State *st, int op) {
    if (!grow((void **)&st->ops, &st->ops_cap, st->ops_len + 1, sizeof(Op))) return NULL;
    Op *o = &st->ops[st->ops_len++];
    memset(o, 0, sizeof(Op));
    o->op = op;
    return o;
}

/* Read a hash list into hv (bytes held).  1, 0 cannot interpret, -1 no memory. */
static int read_hashes(State *st, PyObject *hashes, Py_ssize_t *h0, Py_ssize_t *n) {
    Py_ssize_t len = PyList_GET_SIZE(hashes);
    if (!grow((void **)&st->hv, &st->hv_cap, st->hv_len + len, sizeof(HVal))) return -1;
    HVal *out = &st->hv[st->hv_len];
    for (Py_ssize_t i = 0; i < len; i++) {
        if (!read_hval(PyList_GET_ITEM(hashes, i), &out[i], 0)) return 0;
        if (out[i].b != NULL && hold(st, out[i].b) < 0) return -1;
    }
    *h0 = st->hv_len;
    *n = len;
    st->hv_len += len;
    return 1;
}

/* One event into ops.  1, 0 cannot interpret, -1 no memory. */
static int read_event(State *st, PyObject *ev, TypeInfo *ti, Py_ssize_t *stored) {
    if (ti->kind == K_BAD) return 0;
    PyObject *hashes = FIELD(ev, ti->off_hashes);
    PyObject *medium = FIELD(ev, ti->off_medium);
    PyObject *group = ti->off_group >= 0 ? FIELD(ev, ti->off_group) : Py_None;
    if (hashes == NULL || medium == NULL || group == NULL || !PyList_CheckExact(hashes)) return 0;
    int mg = mg_id(st, medium, group);
    if (mg < 0) return 0;
    Py_ssize_t h0, n;
    int r = read_hashes(st, hashes, &h0, &n);
    if (r <= 0) return r;
    if (ti->kind == K_REMOVED) {
        Op *o = new_op(st, OP_REMOVE);
        if (o == NULL) return -1;
        o->mg = mg;
        o->h0 = h0;
        o->n = n;
        return 1;
    }
    PyObject *parent = FIELD(ev, ti->off_parent);
    HVal prev;
    if (parent == NULL || !read_hval(parent, &prev, 1)) return 0;
    int fmg = -1;
    if (ti->kind == K_MOVED) {
        PyObject *from = FIELD(ev, ti->off_from);
        if (from == NULL || (fmg = mg_id(st, from, group)) < 0) return 0;
    }
    if (hold(st, ev) < 0 || (prev.b != NULL && hold(st, prev.b) < 0)) return -1;
    Op *o = new_op(st, OP_STORE);
    if (o == NULL) return -1;
    o->mg = mg;
    o->ev = ev;
    o->parent = prev;
    o->h0 = h0;
    o->n = n;
    *stored += n;
    if (ti->kind == K_MOVED) {
        o = new_op(st, OP_REMOVE);
        if (o == NULL) return -1;
        o->mg = fmg;
        o->h0 = h0;
        o->n = n;
    }
    return 1;
}

/* ---- applying them (without the GIL when there are many) ------------------------ */

/* The tables are larger than the caches once they hold a few hundred thousand
 * blocks, and a store or a removal then waits on two cache misses (its node's
 * slot, its key's slot).  Both slots are known from the hash and the pair
 * alone, so the ops PREFETCH ahead have their slots fetched meanwhile (a
 * prefetch of a slot that a table growth has since moved is only wasted). */
#define PREFETCH 8

/* Macros, not functions: GCC finds a function that only prefetches pure and
 * drops its calls. */
#define PREFETCH_HASH(st, h, mg)                                                   \
    do {                                                                           \
        if ((st)->nt.s != NULL && (st)->kt.s != NULL) {                            \
            uint64_t nh_ = hval_hash(h);                                           \
            __builtin_prefetch(&(st)->nt.s[home(&(st)->nt, nh_)]);                 \
            __builtin_prefetch(&(st)->kt.s[home(&(st)->kt, key_hash(nh_, (mg)))]); \
        }                                                                          \
    } while (0)

/* The first hashes of the op PREFETCH ahead (a long op fetches its own). */
#define PREFETCH_OP(st, o)                                                         \
    do {                                                                           \
        const Op *op_ = (o);                                                       \
        if (op_->op == OP_STORE || op_->op == OP_REMOVE) {                         \
            Py_ssize_t n_ = op_->n < PREFETCH ? op_->n : PREFETCH;                 \
            for (Py_ssize_t j_ = 0; j_ < n_; j_++)                                 \
                PREFETCH_HASH(st, &(st)->hv[op_->h0 + j_], op_->mg);               \
        }                                                                          \
    } while (0)

/* A reference the tables take; counted once the GIL is held (room reserved). */
static inline void take(State *st, PyObject *o) { st->incs[st->incs_len++] = o; }

static inline void set_src(State *st, PyObject **slot, Py_ssize_t *idx, PyObject *ev,
                           Py_ssize_t i) {
    if (*slot != ev) {
        take(st, ev);
        trash(st, *slot);
        *slot = ev;
    }
    *idx = i;
}

/* Apply a store op.  1, or -1 out of memory. */
static int apply_store(State *st, const Op *op) {
    HVal prev = op->parent;
    PyObject *ev = op->ev;
    int32_t mg = op->mg;
    int32_t prev_node = -2; /* -2: look the parent up; -1: not retained */
    for (Py_ssize_t i = 0; i < op->n; i++) {
        if (i + PREFETCH < op->n) PREFETCH_HASH(st, &st->hv[op->h0 + i + PREFETCH], mg);
        HVal h = st->hv[op->h0 + i];
        if (!ensure_room(st)) return -1;
        uint64_t hh = hval_hash(&h);
        size_t ns = node_slot(st, &h, hh);
        int32_t node = st->nt.s[ns].i;
        int32_t key = -1;
        size_t ks = 0;
        uint64_t kh = 0;
        if (node >= 0) {
            kh = key_hash(hh, mg);
            ks = key_slot(st, node, mg, kh);
            key = st->kt.s[ks].i;
        }
        if (key >= 0) {
            Key *k = &st->keys[key];
            k->count++;
            set_src(st, &k->src, &k->idx, ev, i);
            Node *nd = &st->nodes[node];
            set_src(st, &nd->src, &nd->idx, ev, i);
        } else {
            if (node < 0) {
                int32_t pn = -1;
                if (prev.kind != V_NONE && !hval_eq(&prev, &h)) {
                    pn = prev_node == -2 ? node_find(st, &prev) : prev_node;
                    if (pn >= 0) st->nodes[pn].refs++;
                }
                if (st->nodes_free >= 0) {
                    node = st->nodes_free;
                    st->nodes_free = st->nodes[node].next_free;
                } else {
                    node = (int32_t)st->nodes_len++;
                }
                Node *nd = &st->nodes[node];
                nd->h = h;
                if (h.b) take(st, h.b);
                nd->parent = prev;
                if (prev.b) take(st, prev.b);
                nd->refs = 1;
                nd->pnode = pn;
                take(st, ev);
                nd->src = ev;
                nd->idx = i;
                nd->seen = 0;
                nd->done_gen = 0;
                nd->done = 0;
                st->nt.s[ns].h = hh;
                st->nt.s[ns].i = node;
                st->nt.used++;
                st->nodes_live++;
                kh = key_hash(hh, mg);
                ks = key_slot(st, node, mg, kh);
            } else {
                Node *nd = &st->nodes[node];
                nd->refs++;
                set_src(st, &nd->src, &nd->idx, ev, i);
            }
            if (st->keys_free >= 0) {
                key = st->keys_free;
                st->keys_free = st->keys[key].next_free;
            } else {
                key = (int32_t)st->keys_len++;
            }
            Key *k = &st->keys[key];
            k->node = node;
            k->mg = mg;
            k->count = 1;
            take(st, ev);
            k->src = ev;
            k->idx = i;
            st->kt.s[ks].h = kh;
            st->kt.s[ks].i = key;
            st->kt.used++;
            st->keys_live++;
        }
        prev = st->nodes[node].h; /* borrowed: the node holds it */
        prev_node = node;
    }
    return 1;
}

static void release_node(State *st, int32_t node) {
    for (;;) {
        Node *nd = &st->nodes[node];
        if (--nd->refs > 0) return;
        int32_t up = nd->pnode;
        uint64_t hh = hval_hash(&nd->h);
        size_t ns = node_slot(st, &nd->h, hh);
        table_delete(&st->nt, ns);
        trash(st, nd->src);
        if (nd->h.b) trash(st, nd->h.b);
        if (nd->parent.b) trash(st, nd->parent.b);
        nd->src = NULL;
        nd->refs = -1;
        nd->next_free = st->nodes_free;
        st->nodes_free = node;
        st->nodes_live--;
        if (up < 0) return;
        node = up;
    }
}

static void apply_remove(State *st, const Op *op) {
    for (Py_ssize_t i = 0; i < op->n; i++) {
        if (i + PREFETCH < op->n) PREFETCH_HASH(st, &st->hv[op->h0 + i + PREFETCH], op->mg);
        const HVal *h = &st->hv[op->h0 + i];
        uint64_t hh = hval_hash(h);
        int32_t node = node_find_hh(st, h, hh);
        if (node < 0) continue;
        uint64_t kh = key_hash(hh, op->mg);
        size_t ks = key_slot(st, node, op->mg, kh);
        int32_t key = st->kt.s[ks].i;
        if (key < 0) continue; /* a removal of a key not held is a no-op */
        Key *k = &st->keys[key];
        if (k->count > 1) {
            k->count--;
            continue;
        }
        table_delete(&st->kt, ks);
        trash(st, k->src);
        k->src = NULL;
        k->node = -1;
        k->next_free = st->keys_free;
        st->keys_free = key;
        st->keys_live--;
        release_node(st, node);
    }
}

/* Apply the ops in order.  REC_* or -1 (out of memory: forgotten, invalid).
 * Touches no Python object's reference count. */
static int apply_ops(State *st, Py_ssize_t max_blocks) {
    int result = REC_OK;
    Py_ssize_t n = st->ops_len < PREFETCH ? st->ops_len : PREFETCH;
    for (Py_ssize_t i = 0; i < n; i++) PREFETCH_OP(st, &st->ops[i]);
    for (Py_ssize_t i = 0; i < st->ops_len; i++) {
        const Op *op = &st->ops[i];
        if (i + PREFETCH < st->ops_len) PREFETCH_OP(st, &st->ops[i + PREFETCH]);
        if (op->op == OP_CLEAR) {
            forget(st);
            st->valid = 1;
        } else if (op->op == OP_BAD) {
            forget(st);
            st->valid = 0;
            return REC_UNREADABLE;
        } else if (op->op == OP_REMOVE) {
            apply_remove(st, op);
        } else if (apply_store(st, op) < 0) {
            forget(st);
            st->valid = 0;
            return -1;
        }
    }
    if (st->valid && (st->keys_live > max_blocks || st->nodes_live > max_blocks)) {
        forget(st);
        st->valid = 0;
        result = REC_TOO_MANY;
    }
    return result;
}

/* ---- the Python type ---------------------------------------------------------- */

static PyObject *State_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    State *st = (State *)type->tp_alloc(type, 0);
    if (st == NULL) return NULL;
    st->nodes_free = st->keys_free = -1;
    st->valid = 1;
    return (PyObject *)st;
}

static void State_dealloc(State *st) {
    forget(st);
    forget_pairs(st);
    empty_trash(st);
    free(st->trash);
    free(st->path);
    free(st->ghosts);
    free(st->ops);
    free(st->hv);
    free(st->temps);
    free(st->incs);
    Py_TYPE(st)->tp_free((PyObject *)st);
}

/* Count the references the tables took, drop what record() held, shrink its
 * buffers.  With the GIL.  Python code (a __del__) may run only at the end,
 * on a consistent state. */
static void end_record(State *st) {
    for (Py_ssize_t i = 0; i < st->incs_len; i++) Py_INCREF(st->incs[i]);
    st->incs_len = 0;
    if (!st->valid) forget_pairs(st);
    if (st->temps_len == 0) {
        /* nothing held */
    } else if (grow((void **)&st->trash, &st->trash_cap, st->trash_len + st->temps_len,
                    sizeof(PyObject *))) {
        memcpy(st->trash + st->trash_len, st->temps, (size_t)st->temps_len * sizeof(PyObject *));
        st->trash_len += st->temps_len;
    } else {
        while (st->temps_len > 0) Py_DECREF(st->temps[--st->temps_len]);
    }
    st->temps_len = st->ops_len = st->hv_len = 0;
    if (st->hv_cap > 65536) { /* one huge batch does not keep its buffers */
        free(st->hv);
        free(st->ops);
        free(st->temps);
        free(st->incs);
        st->hv = NULL;
        st->ops = NULL;
        st->temps = st->incs = NULL;
        st->hv_cap = st->ops_cap = st->temps_cap = st->incs_cap = 0;
    }
    st->busy = 0;
    empty_trash(st);
}

PyDoc_STRVAR(record_doc,
             "record(events, max_blocks, release_at=0) -> int | type\n\n"
             "Apply a list of events in order.  0: applied; 1: an event it cannot\n"
             "interpret (the state is forgotten, invalid); 2: more than max_blocks held\n"
             "or retained (forgotten, invalid); a class: not registered yet, nothing\n"
             "applied (register it and call again).  While invalid only a clear is looked\n"
             "for.  The events are read with the GIL held; when they carry at least\n"
             "release_at hashes (0: never), the tables are updated with it released.\n"
             "Raises RuntimeError while a walk is under way.  O(blocks).");

static PyObject *State_record(State *st, PyObject *args) {
    PyObject *events;
    Py_ssize_t max_blocks, release_at = 0;
    if (!PyArg_ParseTuple(args, "O!n|n", &PyList_Type, &events, &max_blocks, &release_at))
        return NULL;
    if (st->walking || st->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the recorder is being walked or is busy");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(events);
    PyTypeObject *last = NULL;
    for (Py_ssize_t i = 0; i < n; i++) { /* every class known before anything changes */
        PyTypeObject *tp = Py_TYPE(PyList_GET_ITEM(events, i));
        if (tp == last) continue;
        if (find_type(tp) == NULL) {
            Py_INCREF(tp);
            return (PyObject *)tp;
        }
        last = tp;
    }
    st->busy = 1;
    /* read: nothing here runs Python code, so the list cannot change meanwhile */
    int valid = st->valid, oom = 0;
    Py_ssize_t stored = 0;
    TypeInfo *ti = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ev = PyList_GET_ITEM(events, i);
        if (ti == NULL || ti->type != Py_TYPE(ev)) ti = find_type(Py_TYPE(ev));
        if (ti->kind == K_CLEARED) {
            forget_pairs(st); /* the ops before it keep their pairs' indices */
            if (new_op(st, OP_CLEAR) == NULL) oom = 1;
            valid = 1;
        } else if (valid && ti->kind != K_IGNORE) {
            int r = read_event(st, ev, ti, &stored);
            if (r == 0 && new_op(st, OP_BAD) == NULL) r = -1;
            if (r < 0) oom = 1;
            if (r <= 0) break; /* the state is forgotten there: the rest cannot matter */
        }
        if (oom) break;
    }
    /* room for every reference the tables may take: four per stored block */
    if (!oom && !grow((void **)&st->incs, &st->incs_cap, 4 * stored + 1, sizeof(PyObject *)))
        oom = 1;
    if (oom) { /* nothing applied: forget it all, as on any failure */
        forget(st);
        st->valid = 0;
        end_record(st);
        return PyErr_NoMemory();
    }
    int result;
    if (release_at > 0 && st->hv_len >= release_at) {
        st->nogil = 1;
        cs_gil_releases_count++;
        Py_BEGIN_ALLOW_THREADS
        result = apply_ops(st, max_blocks);
        Py_END_ALLOW_THREADS
        st->nogil = 0;
    } else {
        result = apply_ops(st, max_blocks);
    }
    end_record(st);
    if (result < 0) return PyErr_NoMemory();
    return PyLong_FromLong(result);
}

static PyObject *State_invalidate(State *st, PyObject *unused) {
    if (st->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the recorder is busy");
        return NULL;
    }
    st->busy = 1;
    st->walking = 0;
    forget(st);
    forget_pairs(st);
    st->valid = 0;
    st->busy = 0;
    empty_trash(st);
    Py_RETURN_NONE;
}

static int refuse_busy(State *st) {
    if (!st->busy) return 0;
    /* record() is updating the tables without the GIL, in another thread */
    PyErr_SetString(PyExc_RuntimeError, "the recorder is busy");
    return 1;
}

static PyObject *State_state(State *st, PyObject *unused) {
    if (refuse_busy(st)) return NULL;
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    for (Py_ssize_t i = 0; i < st->keys_len; i++) {
        Key *k = &st->keys[i];
        if (k->node < 0) continue;
        PyObject *h = hval_object(&st->nodes[k->node].h);
        PyObject *key = h ? PyTuple_Pack(3, st->mediums[k->mg], st->groups[k->mg], h) : NULL;
        Py_XDECREF(h);
        PyObject *c = key ? PyLong_FromLongLong(k->count) : NULL;
        int bad = c == NULL || PyDict_SetItem(d, key, c) < 0;
        Py_XDECREF(key);
        Py_XDECREF(c);
        if (bad) {
            Py_DECREF(d);
            return NULL;
        }
    }
    return d;
}

static PyObject *fail(const char *what) {
    PyErr_SetString(PyExc_AssertionError, what);
    return NULL;
}

/* The invariants, O(held + retained); raises AssertionError. */
static PyObject *State_check(State *st, PyObject *unused) {
    if (refuse_busy(st)) return NULL;
    Py_ssize_t nlive = 0, klive = 0;
    int32_t *refs = (int32_t *)calloc((size_t)st->nodes_len + 1, sizeof(int32_t));
    if (refs == NULL) return PyErr_NoMemory();
    PyObject *err = NULL;
    for (Py_ssize_t i = 0; i < st->keys_len && err == NULL; i++) {
        Key *k = &st->keys[i];
        if (k->node < 0) continue;
        klive++;
        if (k->count < 1) err = fail("a held key has a positive count");
        else if (k->node >= st->nodes_len || st->nodes[k->node].refs < 0)
            err = fail("a held key's hash is retained");
        else if (k->mg < 0 || k->mg >= st->nmg) err = fail("a held key's pair is known");
        else if (key_find(st, k->node, k->mg) != (int32_t)i) err = fail("a held key is indexed");
        else refs[k->node]++;
    }
    for (Py_ssize_t i = 0; i < st->nodes_len && err == NULL; i++) {
        Node *n = &st->nodes[i];
        if (n->refs < 0) continue;
        nlive++;
        if (node_find(st, &n->h) != (int32_t)i) err = fail("a retained hash is indexed");
        else if (n->src == NULL) err = fail("a retained hash has its source");
        else if (n->pnode >= 0) {
            if (n->pnode >= st->nodes_len || st->nodes[n->pnode].refs < 0)
                err = fail("a counted parent is retained");
            else if (!hval_eq(&st->nodes[n->pnode].h, &n->parent))
                err = fail("a counted parent is the parent");
            else refs[n->pnode]++;
        }
    }
    for (Py_ssize_t i = 0; i < st->nodes_len && err == NULL; i++) {
        Node *n = &st->nodes[i];
        if (n->refs >= 0 && (n->refs != refs[i] || n->refs < 1))
            err = fail("refs = held keys + counted children");
    }
    free(refs);
    if (err == NULL && (nlive != st->nodes_live || klive != st->keys_live ||
                        (size_t)nlive != st->nt.used || (size_t)klive != st->kt.used))
        err = fail("the counts match the tables");
    if (err == NULL && !st->valid && (nlive || klive)) err = fail("an invalid state is empty");
    if (err != NULL) return NULL;
    Py_RETURN_NONE;
}

/* ---- the walk ------------------------------------------------------------------- */

static int push_path(State *st, int32_t node) {
    if (!grow((void **)&st->path, &st->path_cap, st->path_len + 1, sizeof(int32_t))) return 0;
    st->path[st->path_len++] = node;
    return 1;
}

static int push_ghost(State *st, int32_t mg, int32_t node) {
    if (!grow((void **)&st->ghosts, &st->ghosts_cap, st->ghosts_len + 1, sizeof(Ghost))) return 0;
    st->ghosts[st->ghosts_len].mg = mg;
    st->ghosts[st->ghosts_len].node = node;
    st->ghosts_len++;
    return 1;
}

static inline int is_done(State *st, int32_t node, int32_t mg) {
    Node *n = &st->nodes[node];
    return n->done_gen == st->walk_gen && (n->done >> mg) & 1;
}

static inline void mark_done(State *st, int32_t node, int32_t mg) {
    Node *n = &st->nodes[node];
    if (n->done_gen != st->walk_gen) {
        n->done_gen = st->walk_gen;
        n->done = 0;
    }
    n->done |= (uint64_t)1 << mg;
}

/* Tokens block `i` of `src` carries (what a store rebuilt from it sends). */
static Py_ssize_t block_tokens(PyObject *src, Py_ssize_t i) {
    TypeInfo *ti = find_type(Py_TYPE(src));
    if (ti == NULL || ti->off_tokens < 0 || ti->off_bs < 0) return 0;
    PyObject *tok = FIELD(src, ti->off_tokens), *bs = FIELD(src, ti->off_bs);
    if (tok == NULL || bs == NULL || !PyList_CheckExact(tok) || !PyLong_CheckExact(bs)) return 0;
    Py_ssize_t size = PyLong_AsSsize_t(bs);
    if (size <= 0) {
        PyErr_Clear();
        return 0;
    }
    Py_ssize_t left = PyList_GET_SIZE(tok) - i * size;
    return left <= 0 ? 0 : left < size ? left : size;
}

PyDoc_STRVAR(walk_start_doc,
             "walk_start() -> None\n\n"
             "Begin rebuilding the state (record() raises until walk_end()).  O(1).");

static PyObject *State_walk_start(State *st, PyObject *unused) {
    if (st->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the recorder is busy");
        return NULL;
    }
    st->walking = st->valid ? 1 : 3;
    st->walk_gen++;
    if (st->walk_gen == 0) { /* wrapped: clear the marks for real */
        for (Py_ssize_t i = 0; i < st->nodes_len; i++) st->nodes[i].done_gen = 0;
        st->walk_gen = 1;
    }
    st->cursor = 0;
    st->path_len = st->path_pos = 0;
    st->ghosts_len = st->ghost_pos = 0;
    Py_RETURN_NONE;
}

static PyObject *State_walk_end(State *st, PyObject *unused) {
    st->walking = 0;
    st->path_len = st->path_pos = 0;
    st->ghosts_len = st->ghost_pos = 0;
    if (st->ghosts_cap > 4096) {
        free(st->ghosts);
        st->ghosts = NULL;
        st->ghosts_cap = 0;
    }
    Py_RETURN_NONE;
}

/* Append one block (its count copies) to the chunk list.  -1 on error. */
static int emit_block(State *st, PyObject *out, int32_t node, int32_t mg, int64_t count,
                      PyObject *src, Py_ssize_t idx) {
    Node *nd = &st->nodes[node];
    if (count == 1 && st->run_hashes != NULL && st->run_src == src && st->run_idx == idx - 1 &&
        st->run_mg == mg && hval_eq(&st->nodes[st->run_node].h, &nd->parent)) {
        PyObject *h = hval_object(&nd->h);
        if (h == NULL || PyList_Append(st->run_hashes, h) < 0) {
            Py_XDECREF(h);
            return -1;
        }
        Py_DECREF(h);
        st->run_idx = idx;
        st->run_node = node;
        return 0;
    }
    PyObject *hashes = PyList_New(1);
    if (hashes == NULL) return -1;
    PyObject *h = hval_object(&nd->h);
    if (h == NULL) {
        Py_DECREF(hashes);
        return -1;
    }
    PyList_SET_ITEM(hashes, 0, h);
    PyObject *parent = hval_object(&nd->parent);
    PyObject *item = parent ? Py_BuildValue("(OnONOOL)", src, idx, hashes, parent,
                                            st->mediums[mg], st->groups[mg], (long long)count)
                            : NULL;
    if (item == NULL) {
        Py_DECREF(hashes);
        return -1;
    }
    int r = PyList_Append(out, item);
    Py_DECREF(item);
    if (r < 0) {
        Py_DECREF(hashes);
        return -1;
    }
    if (count == 1) {
        st->run_hashes = hashes; /* borrowed: the item in `out` holds it */
        st->run_src = src;
        st->run_idx = idx;
        st->run_mg = mg;
        st->run_node = node;
    } else {
        st->run_hashes = NULL;
    }
    Py_DECREF(hashes);
    return 0;
}

static int cmp_ghost(const void *a, const void *b) {
    const Ghost *x = (const Ghost *)a, *y = (const Ghost *)b;
    if (x->mg != y->mg) return x->mg < y->mg ? -1 : 1;
    return 0;
}

PyDoc_STRVAR(walk_next_doc,
             "walk_next(max_blocks, max_tokens) -> list | None\n\n"
             "The next chunk's items, None when done.  A store item is (source event,\n"
             "index of its first block, hashes, parent, medium, group, count); a\n"
             "removal item is (medium, group, hashes).  Stores come parents first in\n"
             "their medium and group; ancestors no key holds there are stored, and\n"
             "removed again at the end.  O(max_blocks) blocks per call.");

static PyObject *State_walk_next(State *st, PyObject *args) {
    Py_ssize_t max_blocks, max_tokens;
    if (!PyArg_ParseTuple(args, "nn", &max_blocks, &max_tokens)) return NULL;
    if (st->walking == 0) {
        PyErr_SetString(PyExc_RuntimeError, "no walk under way");
        return NULL;
    }
    if (st->walking == 3) Py_RETURN_NONE;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    st->run_hashes = NULL;
    Py_ssize_t blocks = 0, tokens = 0;
    while (st->walking == 1) {
        if (st->path_pos == 0) { /* the next key not emitted yet: its path of ancestors */
            Key *k = NULL;
            while (st->cursor < st->keys_len) {
                k = &st->keys[st->cursor++];
                if (k->node >= 0 && !is_done(st, k->node, k->mg)) break;
                k = NULL;
            }
            if (k == NULL) {
                st->walking = 2;
                if (st->ghosts_len > 1)
                    qsort(st->ghosts, (size_t)st->ghosts_len, sizeof(Ghost), cmp_ghost);
                break;
            }
            int32_t mg = k->mg;
            st->path_len = 0;
            st->path_mg = mg;
            if (++st->path_gen == 0) {
                for (Py_ssize_t i = 0; i < st->nodes_len; i++) st->nodes[i].seen = 0;
                st->path_gen = 1;
            }
            int32_t node = k->node;
            for (;;) {
                if (!push_path(st, node)) goto nomem;
                st->nodes[node].seen = st->path_gen;
                const HVal *p = &st->nodes[node].parent;
                if (p->kind == V_NONE) break;
                int32_t up = node_find(st, p);
                if (up < 0) break; /* a parent the stream never stored: sent as it came */
                if (st->nodes[up].seen == st->path_gen || is_done(st, up, mg)) break;
                node = up;
            }
            st->path_pos = st->path_len;
        }
        int32_t mg = st->path_mg;
        int32_t node = st->path[--st->path_pos]; /* reversed: the oldest ancestor first */
        mark_done(st, node, mg);
        int32_t key = key_find(st, node, mg);
        PyObject *src;
        Py_ssize_t idx;
        int64_t count;
        if (key < 0) {
            if (!push_ghost(st, mg, node)) goto nomem;
            src = st->nodes[node].src;
            idx = st->nodes[node].idx;
            count = 1;
        } else {
            src = st->keys[key].src;
            idx = st->keys[key].idx;
            count = st->keys[key].count;
        }
        if (emit_block(st, out, node, mg, count, src, idx) < 0) goto error;
        blocks += count;
        tokens += count * block_tokens(src, idx);
        if (blocks >= max_blocks || tokens >= max_tokens) goto chunk;
    }
    while (st->walking == 2) {
        if (st->ghost_pos >= st->ghosts_len) {
            st->walking = 3;
            break;
        }
        int32_t mg = st->ghosts[st->ghost_pos].mg;
        Py_ssize_t room = max_blocks - blocks;
        PyObject *hashes = PyList_New(0);
        if (hashes == NULL) goto error;
        while (st->ghost_pos < st->ghosts_len && st->ghosts[st->ghost_pos].mg == mg &&
               PyList_GET_SIZE(hashes) < room) {
            PyObject *h = hval_object(&st->nodes[st->ghosts[st->ghost_pos].node].h);
            if (h == NULL || PyList_Append(hashes, h) < 0) {
                Py_XDECREF(h);
                Py_DECREF(hashes);
                goto error;
            }
            Py_DECREF(h);
            st->ghost_pos++;
        }
        blocks += PyList_GET_SIZE(hashes);
        PyObject *item = Py_BuildValue("(OON)", st->mediums[mg], st->groups[mg], hashes);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            goto error;
        }
        Py_DECREF(item);
        if (blocks >= max_blocks) goto chunk;
    }
chunk:
    st->run_hashes = NULL;
    if (PyList_GET_SIZE(out) == 0 && st->walking == 3) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
nomem:
    PyErr_NoMemory();
error:
    st->run_hashes = NULL;
    Py_DECREF(out);
    return NULL;
}

static PyObject *State_get_held(State *st, void *c) { return PyLong_FromSsize_t(st->keys_live); }
static PyObject *State_get_retained(State *st, void *c) {
    return PyLong_FromSsize_t(st->nodes_live);
}
static PyObject *State_get_valid(State *st, void *c) { return PyBool_FromLong(st->valid); }

static PyGetSetDef State_getset[] = {
    /* read from any thread without waiting: during a record() that released
     * the GIL they may describe a batch half applied */
    {"held", (getter)State_get_held, NULL, "Keys held.  O(1).", NULL},
    {"retained", (getter)State_get_retained, NULL, "Hashes retained.  O(1).", NULL},
    {"valid", (getter)State_get_valid, NULL, "False while unavailable.  O(1).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef State_methods[] = {
    {"record", (PyCFunction)State_record, METH_VARARGS, record_doc},
    {"invalidate", (PyCFunction)State_invalidate, METH_NOARGS, "Forget everything.  O(held)."},
    {"state", (PyCFunction)State_state, METH_NOARGS, "{(medium, group, hash): count}.  O(held)."},
    {"check", (PyCFunction)State_check, METH_NOARGS, "Assert the invariants.  O(held)."},
    {"walk_start", (PyCFunction)State_walk_start, METH_NOARGS, walk_start_doc},
    {"walk_next", (PyCFunction)State_walk_next, METH_VARARGS, walk_next_doc},
    {"walk_end", (PyCFunction)State_walk_end, METH_NOARGS, "End the walk.  O(1)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "coalesce._crecord.State",
    .tp_basicsize = sizeof(State),
    .tp_dealloc = (destructor)State_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The recorder's state (see the C source's header).",
    .tp_methods = State_methods,
    .tp_getset = State_getset,
    .tp_new = State_new,
};

/* ---- registration --------------------------------------------------------------- */

PyDoc_STRVAR(register_doc,
             "register(cls, kind, fields) -> bool\n\n"
             "Record a class's kind (0 ignore, 1 stored, 2 removed, 3 cleared, 4 moved,\n"
             "5 cannot interpret) and the slot offsets of the named fields it has.\n"
             "Returns False (and registers it as 5) if a field its kind needs cannot be\n"
             "read this way, None if the table is full (not registered).  O(fields).");

static PyObject *cr_register(PyObject *self, PyObject *args) {
    PyObject *cls, *names;
    int kind;
    if (!PyArg_ParseTuple(args, "O!iO!", &PyType_Type, &cls, &kind, &PyTuple_Type, &names))
        return NULL;
    PyTypeObject *tp = (PyTypeObject *)cls;
    if (find_type(tp) != NULL) Py_RETURN_TRUE;
    if (kind < K_IGNORE || kind > K_BAD) {
        PyErr_SetString(PyExc_ValueError, "unknown kind");
        return NULL;
    }
    if (g_ntypes >= MAX_TYPES) Py_RETURN_NONE; /* full: not registered */
    TypeInfo ti;
    memset(&ti, 0, sizeof(ti));
    ti.kind = kind;
    ti.off_hashes = ti.off_parent = ti.off_medium = ti.off_from = ti.off_group = -1;
    ti.off_tokens = ti.off_bs = -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        const char *s = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
        if (s == NULL) {
            PyErr_Clear();
            continue;
        }
        Py_ssize_t off = member_offset(tp, name);
        if (strcmp(s, "block_hashes") == 0) ti.off_hashes = off;
        else if (strcmp(s, "parent_block_hash") == 0) ti.off_parent = off;
        else if (strcmp(s, kind == K_MOVED ? "to_medium" : "medium") == 0) ti.off_medium = off;
        else if (strcmp(s, "from_medium") == 0) ti.off_from = off;
        else if (strcmp(s, "group_idx") == 0) ti.off_group = off;
        else if (strcmp(s, "token_ids") == 0) ti.off_tokens = off;
        else if (strcmp(s, "block_size") == 0) ti.off_bs = off;
    }
    int ok = 1;
    if (kind == K_STORED || kind == K_REMOVED || kind == K_MOVED)
        ok = ti.off_hashes >= 0 && ti.off_medium >= 0;
    if (ok && (kind == K_STORED || kind == K_MOVED)) ok = ti.off_parent >= 0;
    if (ok && kind == K_MOVED) ok = ti.off_from >= 0;
    if (!ok) ti.kind = K_BAD;
    Py_INCREF(tp);
    ti.type = tp;
    g_types[g_ntypes++] = ti;
    return PyBool_FromLong(ok);
}

static PyMethodDef cr_methods[] = {
    {"register", cr_register, METH_VARARGS, register_doc},
    CSTRUCT_METHODS
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef cr_module = {
    PyModuleDef_HEAD_INIT, "coalesce._crecord",
    "Optional C accelerator for coalesce._recorder (see the C source's header).", -1,
    cr_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__crecord(void) {
    if (PyType_Ready(&StateType) < 0) return NULL;
    PyObject *m = PyModule_Create(&cr_module);
    if (m == NULL) return NULL;
    Py_INCREF(&StateType);
    if (PyModule_AddObject(m, "State", (PyObject *)&StateType) < 0) {
        Py_DECREF(&StateType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
