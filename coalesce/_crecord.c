/* The snapshot recorder's state and loop in C (coalesce/_recorder.py holds
 * the semantics, the pure-Python recorder that is this one's fallback and
 * oracle, and the docs).
 *
 * State (a State object; nothing in it is a Python object but the recorded
 * events, the scope tuples and the interned hashes):
 * - keys: an open-addressing table (_cr_table.h) of (scope id, 64-bit hash)
 *   -> count and the source naming it;
 * - scopes: (medium, group_idx, locality, ownership) tuples interned to small
 *   ids, in the order a store first used them (the Python recorder's `live`);
 * - hashes that are not ints in [-2**63, 2**64) (bytes, str, bigger ints)
 *   interned to ids, held while a kept source stores them (a negative int is
 *   keyed by its two's complement, flagged apart: SGLang's signed hashes);
 * - sources: a C array of slots (freed slots reused) linked in recorded
 *   order; each holds its store event whole for the program: the bytes
 *   encode_record() wrote for it (Enc: no Python object), or a strong
 *   reference to the event from record() (its hash and token lists of ints
 *   untracked by the cyclic GC); its hashes as keys, its dependencies and
 *   its refs (keys naming it + dependants).  A source is dropped as soon as
 *   its refs fall to 0 (the Python recorder collects at the end of the batch: the same
 *   state, since nothing can reach a source no key names).
 *
 * State.record(events, i) applies events[i:] in three phases: under the GIL
 * each event's fields are read at their msgspec slot offsets (the classes
 * registered with register(); coalesce/_layout.py checks at import that
 * they are read right) into a buffer of operations, hashes as keys; then the
 * operations are applied to the table (pure C, the GIL released when there
 * are many); then, under the GIL again, the events of dropped sources are
 * released.  It returns the index of the first event it did not apply (and
 * sets `stopped`): len(events), or an event of a class not registered (1:
 * register it and call again), a BlockMoved (2: the caller applies it as
 * its store and removal), or an event it cannot read (3: a field unset or of
 * a type it does not take, a hash neither an int, bytes nor str: the caller
 * moves the state to the Python recorder, which applies it or raises).
 * AllBlocksCleared is applied here.
 *
 * State.encode_record(batch, max_blocks): the batch encoded as msgspec's
 * Encoder() encodes it (_cr_encode.h: the shapes and values it writes) and
 * its events read into ops as record() reads them, each event read once for
 * both, a store kept as the bytes written for it; then the ops applied as
 * above.  It declines (None, nothing recorded, not even a scope interned)
 * where record() would stop, or at a class or value it does not write.
 *
 * State.walk(...) -> Walk: the replay program, a chunk per next() (the
 * Python recorder's chunks(), the same events in the same chunks; a store
 * kept as its bytes is a msgspec.Raw of them: the same wire).
 * State.export() -> (live, sources, refs, n): the state in the Python
 * recorder's form, source ids renumbered in recorded order (for the fall
 * back, check() and the differential tests; a store kept as its bytes is
 * (its class, a msgspec.Raw of them)). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_cstruct.h"
#include "_kinds.h"
#include "_cr_table.h"

/* Event kinds are _kinds.h's; UNREADABLE marks a registered class the loop cannot read. */
enum { UNREADABLE = K_MOVED + 1 };
enum { STOP_DONE = 0, STOP_UNKNOWN = 1, STOP_MOVE = 2, STOP_PYTHON = 3 };
enum { F_HASHES, F_PARENT, F_TOKENS, F_MEDIUM, F_GROUP, F_LOCALITY, F_OWNERSHIP, NF };

#define MAX_TYPES 64
#define AHEAD 4 /* prefetch distance, in events */
#define NCACHE 8 /* scopes remembered by value (a stream alternates between a few) */
static Py_ssize_t g_nogil_from = 128; /* hashes in a call from which the table is updated
                                       without the GIL (set_nogil_from) */
#define MAX_SCOPES 0x7ffffff0u
static Py_ssize_t g_encoded_max = UINT32_MAX; /* the largest store (its Enc) encode_record()
                                          keeps as its encoding (set_encoded_max) */

typedef struct {
    PyTypeObject *type; /* strong reference, kept for the process's life */
    int kind;
    Py_ssize_t off[NF]; /* -1: the class has no such field (read as None) */
} TypeInfo;

static TypeInfo g_types[MAX_TYPES];
static int g_ntypes = 0;
static CStructState *g_cs; /* the module's state (gil_releases), set at init */
static const char *const FIELD_NAMES[NF] = {"block_hashes", "parent_block_hash", "token_ids",
                                             "medium", "group_idx", "locality", "ownership"};

static TypeInfo *find_type(PyTypeObject *tp) {
    for (int i = 0; i < g_ntypes; i++)
        if (g_types[i].type == tp) return &g_types[i];
    return NULL;
}

#include "_cr_encode.h"

/* ---- the state ------------------------------------------------------------ */

/* A store kept as its encoding (encode_record() writes it anyway): one block
 * of Python's small-object allocator (PyObject_Malloc: the GIL held to make or
 * free it), so dropping it is one free, not the release of an event of a score
 * of Python objects long out of the caches.  The walk hands it out as a
 * msgspec.Raw: the same wire. */
typedef struct {
    uint32_t len;
    uint16_t type; /* its class, an index in g_types */
    unsigned char b[];
} Enc;

typedef struct {
    PyObject *ev;   /* strong; NULL: encoded (enc), or a free slot (enc NULL too) */
    Enc *enc;
    uint64_t *hs;   /* its hashes as keys (size > 1), else h1 */
    uint64_t h1;
    uint8_t *ifl;   /* per hash: its hash_key flag (1 interned, 3 negative); NULL: all 0 */
    uint32_t *deps; /* ndeps > 1, else d1 */
    uint32_t d1, ndeps;
    uint32_t scope, size, refs, prev, next;
    Py_ssize_t ntok;
    uint8_t tokens, repeats;
} Src;

static inline const uint64_t *src_hashes(const Src *s) { return s->size == 1 ? &s->h1 : s->hs; }
static inline const uint32_t *src_deps(const Src *s) { return s->ndeps == 1 ? &s->d1 : s->deps; }
static inline uint32_t src_sk(const Src *s, uint32_t j) {
    return s->scope | (s->ifl != NULL ? kflag(s->ifl[j]) : 0);
}

typedef struct {
    PyObject *v[4];
    uint32_t id;
    int valid;
} ScopeCache;

static void cache_clear(ScopeCache *c) {
    for (int k = 0; k < 4; k++) Py_CLEAR(c->v[k]);
    c->valid = 0;
}

/* One event read under the GIL, applied later. */
typedef struct {
    int kind; /* K_STORED or K_REMOVED */
    uint32_t scope;
    PyObject *ev; /* a store's: a new reference, handed to its source */
    Enc *enc;     /* or its encoding (encode_record()), handed to its source */
    size_t h0;
    uint32_t n;
    uint8_t parent; /* 0 none (None, or an interned kind never seen), 1 a key */
    uint8_t tokens;
    uint32_t parent_sk;
    uint64_t parent_h;
    Py_ssize_t ntok;
} Op;

typedef struct {
    PyObject_HEAD
    Tab keys;
    Src *src;
    uint32_t nsrc_cap, free_head, head, tail, nsources;
    long long held, counts, kept; /* keys held, the counts' sum, kept sources' hashes */
    PyObject *scope_ids;          /* {scope tuple: id} */
    PyObject **scopes;            /* id -> scope tuple (strong) */
    uint32_t nscopes, scopes_cap;
    PyObject *intern_ids; /* {hash object: id} */
    PyObject **iobj;      /* id -> hash object (strong), NULL: free */
    uint32_t *iref;       /* id -> occurrences in kept sources */
    uint32_t niobj, iobj_cap;
    Vec ifree;   /* uint32: free interned ids */
    Vec izero;   /* uint32: interned ids that may have fallen to 0 */
    Vec ops;     /* Op */
    Vec hb;      /* uint64: the ops' hashes */
    Vec hf;      /* uint8: the ops' hashes' flags (1 interned, 2 absent: skip, 3 negative) */
    Vec dead;    /* PyObject *: events of dropped sources, released under the GIL */
    Vec freed;   /* Enc *: encodings of dropped sources, freed under the GIL */
    Vec grave;   /* Grave: a forgotten state's events, released a slice a call */
    Vec stack;   /* uint32: sources to release (dependencies, iteratively) */
    Vec depbuf;  /* uint32 */
    int oom;
    int busy;
    unsigned long long gen; /* changes with every update (a walk checks it) */
    /* counters as of the end of the last call (read while the table is busy) */
    long long pub_held, pub_counts, pub_kept, pub_sources;
    int stopped;
    ScopeCache cache[NCACHE]; /* the last scopes looked up (cleared with the scopes) */
    int cache_next, cache_last; /* the slot replaced next (never the last hit); the last hit */
    size_t store_ops, store_hashes; /* in the ops gathered (a table that will grow) */
    long long nbatches, nevents;   /* given to record_batch() or taken by encode_record() */
    long long nencoded;            /* batches encode_record() took */
    PyObject *declined;            /* the class encode_record() last declined, or NULL */
    Py_ssize_t at;                 /* the batch record_batches() was at */
    Out out;                       /* encode_record()'s bytes */
} State;

static PyTypeObject State_Type;

/* An event of a forgotten state (an AllBlocksCleared, a clear()), waiting to be
 * released: its cost, in objects its release frees (the event, its tokens and
 * hashes).  Releasing a large state at once would hold the GIL for O(state);
 * instead each finish() releases up to max(GRAVE_SLICE, twice the work of the
 * update it ends), so the graveyard drains at least as fast as a stream can
 * fill it and no update holds the GIL long for it. */
typedef struct {
    PyObject *ev; /* or NULL, and */
    Enc *enc;     /* a source's encoding */
    Py_ssize_t cost;
} Grave;
#define GRAVE_SLICE ((Py_ssize_t)1 << 15)

static void publish(State *st) {
    st->pub_held = st->held;
    st->pub_counts = st->counts;
    st->pub_kept = st->kept;
    st->pub_sources = st->nsources;
}

/* msgspec.Raw (set_raw_type()): compact_for_wire() writes a merged event's
 * hash and token lists as a Raw holding the list's msgpack encoding, and a
 * walk hands out an encoded source (Enc) as a Raw of it. */
static PyTypeObject *g_raw_type = NULL;

/* The event source s stores, a new reference: the event kept, or its
 * encoding as a msgspec.Raw (NULL: an exception set). */
static PyObject *src_event(const Src *s) {
    if (s->enc == NULL) return Py_NewRef(s->ev);
    PyObject *b = PyBytes_FromStringAndSize((const char *)s->enc->b, (Py_ssize_t)s->enc->len);
    if (b == NULL) return NULL;
    PyObject *raw = PyObject_CallOneArg((PyObject *)g_raw_type, b);
    Py_DECREF(b);
    return raw;
}

/* -- sources (no Python API: may run without the GIL) -- */

static uint32_t src_alloc(State *st) {
    if (st->free_head == NIL) {
        uint32_t cap = st->nsrc_cap ? st->nsrc_cap * 2 : 256;
        if (cap >= NIL || cap < st->nsrc_cap) return NIL;
        Src *v = (Src *)realloc(st->src, (size_t)cap * sizeof(Src));
        if (v == NULL) return NIL;
        st->src = v;
        for (uint32_t i = st->nsrc_cap; i < cap; i++) {
            v[i].ev = NULL;
            v[i].enc = NULL;
            v[i].next = i + 1 < cap ? i + 1 : NIL;
        }
        st->free_head = st->nsrc_cap;
        st->nsrc_cap = cap;
    }
    uint32_t id = st->free_head;
    st->free_head = st->src[id].next;
    return id;
}

/* The source `id` loses a reference; at 0 it is dropped, and its dependencies
 * lose theirs (iteratively: a chain of parents may be long).  0 on OOM. */
static int src_release_slow(State *st, uint32_t id);

static inline int src_release(State *st, uint32_t id) {
    if (st->src[id].refs > 1) { /* the usual case: still kept */
        st->src[id].refs--;
        return 1;
    }
    return src_release_slow(st, id);
}

static int src_release_slow(State *st, uint32_t id) {
    st->stack.n = 0;
    uint32_t *top = (uint32_t *)vec_push(&st->stack);
    if (top == NULL) return 0;
    *top = id;
    while (st->stack.n > 0) {
        uint32_t sid = VEC_AT(&st->stack, uint32_t, --st->stack.n);
        Src *s = &st->src[sid];
        if (--s->refs > 0) continue;
        if (s->enc != NULL) {
            Enc **d = (Enc **)vec_push(&st->freed);
            if (d == NULL) return 0;
            *d = s->enc;
            s->enc = NULL;
        } else {
            PyObject **d = (PyObject **)vec_push(&st->dead);
            if (d == NULL) return 0;
            *d = s->ev;
            s->ev = NULL;
        }
        st->kept -= s->size;
        st->nsources--;
        if (s->ifl != NULL) {
            const uint64_t *hs = src_hashes(s);
            for (uint32_t j = 0; j < s->size; j++) {
                if (s->ifl[j] != 1) continue; /* (not interned) */
                uint32_t iid = (uint32_t)hs[j];
                if (--st->iref[iid] == 0) {
                    uint32_t *z = (uint32_t *)vec_push(&st->izero);
                    if (z == NULL) return 0;
                    *z = iid;
                }
            }
        }
        const uint32_t *deps = src_deps(s);
        for (uint32_t k = 0; k < s->ndeps; k++) {
            uint32_t *p = (uint32_t *)vec_push(&st->stack);
            if (p == NULL) return 0;
            *p = deps[k];
            s = &st->src[sid]; /* (no realloc of src here, but keep it simple) */
        }
        if (s->size > 1) free(s->hs);
        if (s->ndeps > 1) free(s->deps);
        free(s->ifl);
        s->hs = NULL;
        s->ifl = NULL;
        s->deps = NULL;
        /* unlink from the recorded order, and free the slot */
        if (s->prev != NIL) st->src[s->prev].next = s->next;
        else st->head = s->next;
        if (s->next != NIL) st->src[s->next].prev = s->prev;
        else st->tail = s->prev;
        s->next = st->free_head;
        st->free_head = sid;
    }
    return 1;
}

/* A held key's source in scope `sk` (its KFLAGS the hash's), else in any scope
 * in their order; NIL when none holds it. */
static uint32_t held_anywhere(State *st, uint64_t h, uint32_t sk) {
    Ent *e = tab_find(&st->keys, h, sk);
    if (e != NULL) return e->src;
    uint32_t flag = sk & KFLAGS;
    for (uint32_t s = 0; s < st->nscopes; s++) {
        if ((s | flag) == sk) continue; /* (looked at first) */
        e = tab_find(&st->keys, h, s | flag);
        if (e != NULL) return e->src;
    }
    return NIL;
}

static int apply_store(State *st, Op *op) {
    const uint64_t *hb = &VEC_AT(&st->hb, uint64_t, op->h0);
    const uint8_t *hf = &VEC_AT(&st->hf, uint8_t, op->h0);
    uint32_t n = op->n, scope = op->scope;
    st->depbuf.n = 0;
    if (op->parent) {
        uint32_t held = held_anywhere(st, op->parent_h, op->parent_sk | scope);
        if (held != NIL) {
            uint32_t *p = (uint32_t *)vec_push(&st->depbuf);
            if (p == NULL) return 0;
            *p = held;
        }
    }
    if (!op->tokens) {
        for (uint32_t j = 0; j < n; j++) {
            uint32_t flag = kflag(hf[j]);
            for (uint32_t s = 0; s < st->nscopes; s++) {
                Ent *e = tab_find(&st->keys, hb[j], s | flag);
                if (e == NULL || !st->src[e->src].tokens) continue;
                int there = 0;
                for (size_t k = 0; k < st->depbuf.n; k++)
                    there |= VEC_AT(&st->depbuf, uint32_t, k) == e->src;
                if (!there) {
                    uint32_t *p = (uint32_t *)vec_push(&st->depbuf);
                    if (p == NULL) return 0;
                    *p = e->src;
                }
                break;
            }
        }
    }
    uint32_t sid = src_alloc(st);
    if (sid == NIL) return 0;
    Src *s = &st->src[sid];
    /* (every field set one by one: cheaper than a memset of the slot) */
    s->ev = op->ev;
    s->enc = op->enc;
    op->ev = NULL; /* (the source owns it now) */
    op->enc = NULL;
    s->hs = NULL;
    s->h1 = 0;
    s->ifl = NULL;
    s->deps = NULL;
    s->d1 = 0;
    s->scope = scope;
    s->size = n;
    s->tokens = op->tokens;
    s->repeats = 0;
    s->ntok = op->ntok;
    int any_interned = 0;
    for (uint32_t j = 0; j < n; j++) any_interned |= hf[j];
    if (n == 1) {
        s->h1 = hb[0];
    } else {
        s->hs = (uint64_t *)malloc((size_t)n * sizeof(uint64_t));
        if (s->hs == NULL) goto oom;
        memcpy(s->hs, hb, (size_t)n * sizeof(uint64_t));
    }
    if (any_interned) {
        s->ifl = (uint8_t *)malloc(n);
        if (s->ifl == NULL) goto oom;
        memcpy(s->ifl, hf, n);
        for (uint32_t j = 0; j < n; j++)
            if (hf[j] == 1) st->iref[(uint32_t)hb[j]]++;
    }
    s->ndeps = (uint32_t)st->depbuf.n;
    if (s->ndeps == 1) {
        s->d1 = VEC_AT(&st->depbuf, uint32_t, 0);
    } else if (s->ndeps > 1) {
        s->deps = (uint32_t *)malloc(st->depbuf.n * sizeof(uint32_t));
        if (s->deps == NULL) goto oom;
        memcpy(s->deps, st->depbuf.p, st->depbuf.n * sizeof(uint32_t));
    }
    const uint32_t *deps = src_deps(s);
    for (uint32_t k = 0; k < s->ndeps; k++) st->src[deps[k]].refs++;
    /* link it last in the recorded order */
    s->next = NIL;
    s->prev = st->tail;
    if (st->tail != NIL) st->src[st->tail].next = sid;
    else st->head = sid;
    st->tail = sid;
    st->nsources++;
    st->kept += n;
    s->refs = 1; /* held for the loop below: a release cannot drop it */
    uint32_t added = 0, names = 0;
    for (uint32_t j = 0; j < n; j++) {
        int made;
        Ent *e = tab_put(&st->keys, hb[j], scope | kflag(hf[j]), &made);
        if (e == NULL) return 0;
        uint32_t old = e->src;
        e->src = sid;
        e->count++;
        if (made) {
            added++;
        } else if (old != sid) {
            names++;
            if (!src_release(st, old)) return 0;
        } else {
            st->src[sid].repeats = 1; /* a hash repeated in this event */
        }
    }
    st->src[sid].refs += added + names - 1;
    st->held += added;
    st->counts += n;
    return 1;
oom:
    /* a half-made source: the caller forgets the whole state */
    return 0;
}

static int apply_remove(State *st, const Op *op) {
    const uint64_t *hb = &VEC_AT(&st->hb, uint64_t, op->h0);
    const uint8_t *hf = &VEC_AT(&st->hf, uint8_t, op->h0);
    for (uint32_t j = 0; j < op->n; j++) {
        if (hf[j] == 2) continue; /* an interned kind never stored: not held */
        Ent *e = tab_find(&st->keys, hb[j], op->scope | kflag(hf[j]));
        if (e == NULL) continue; /* a removal of a key not held is a no-op */
        st->counts--;
        if (e->count > 1) {
            e->count--;
            continue;
        }
        uint32_t sid = e->src;
        tab_del(&st->keys, e);
        st->held--;
        if (!src_release(st, sid)) return 0;
    }
    return 1;
}

/* Phase 2: the gathered ops, applied.  0 on OOM. */
static int apply_ops(State *st) {
    size_t nops = st->ops.n;
    for (size_t k = 0; k < nops; k++) {
        Op *op = &VEC_AT(&st->ops, Op, k);
        /* the table slot of a later op's first hash (the loop's cache miss), fetched ahead */
        if (k + 2 * AHEAD < nops && st->keys.cap > 0) {
            const Op *p = &VEC_AT(&st->ops, Op, k + 2 * AHEAD);
            __builtin_prefetch(&st->keys.e[tab_home(&st->keys, VEC_AT(&st->hb, uint64_t, p->h0))]);
            if (p->parent) __builtin_prefetch(&st->keys.e[tab_home(&st->keys, p->parent_h)]);
        }
        int ok = op->kind == K_STORED ? apply_store(st, op) : apply_remove(st, op);
        if (!ok) return 0;
    }
    return 1;
}

/* Release the graveyard's events, the last first, until `budget` is spent. */
static void sweep(State *st, Py_ssize_t budget) {
    while (st->grave.n > 0 && budget > 0) {
        Grave g = VEC_AT(&st->grave, Grave, --st->grave.n); /* (taken first: re-entrant) */
        budget -= g.cost;
        if (g.ev != NULL) Py_DECREF(g.ev);
        else PyObject_Free(g.enc);
    }
    if (st->grave.n == 0) vec_trim(&st->grave);
}

/* Phase 3 (the GIL held): release dropped events, and interned hashes no kept
 * source stores; drop ops not applied (after an error); a slice of the graveyard. */
static void finish(State *st) {
    Py_ssize_t work = (Py_ssize_t)st->hb.n;
    for (size_t k = 0; k < st->ops.n; k++) {
        Op *op = &VEC_AT(&st->ops, Op, k);
        work += op->ntok + 1;
        Py_XDECREF(op->ev);
        PyObject_Free(op->enc);
    }
    vec_trim(&st->ops);
    vec_trim(&st->hb);
    vec_trim(&st->hf);
    for (size_t k = 0; k < st->izero.n; k++) {
        uint32_t iid = VEC_AT(&st->izero, uint32_t, k);
        PyObject *o = st->iobj[iid];
        if (o == NULL || st->iref[iid] != 0) continue;
        if (PyDict_DelItem(st->intern_ids, o) < 0) PyErr_Clear();
        st->iobj[iid] = NULL;
        Py_DECREF(o);
        uint32_t *f = (uint32_t *)vec_push(&st->ifree);
        if (f != NULL) *f = iid;
    }
    vec_trim(&st->izero);
    for (size_t k = 0; k < st->freed.n; k++) PyObject_Free(VEC_AT(&st->freed, Enc *, k));
    st->freed.n = 0;
    vec_trim(&st->freed);
    /* (last: an event's release may run Python code) */
    size_t nd = st->dead.n;
    PyObject **dead = (PyObject **)st->dead.p;
    st->dead.p = NULL;
    st->dead.n = st->dead.cap = 0;
    for (size_t k = 0; k < nd; k++) Py_XDECREF(dead[k]);
    free(dead);
    if (st->grave.n > 0) sweep(st, GRAVE_SLICE > 2 * work ? GRAVE_SLICE : 2 * work);
}

/* Move the sources' events to the graveyard and free the sources and the
 * table.  No Python API when `room` (the graveyard has room for every source):
 * then it may run without the GIL. */
static void forget_sources(State *st, int room) {
    for (uint32_t i = 0; i < st->nsrc_cap; i++) {
        Src *s = &st->src[i];
        if (s->ev == NULL && s->enc == NULL) continue; /* a free slot */
        Grave *g = (Grave *)vec_push(&st->grave);
        if (g != NULL) {
            g->ev = s->ev;
            g->enc = s->enc;
            g->cost = s->enc != NULL ? 1 : 1 + s->ntok + (Py_ssize_t)s->size;
        } else if (!room) { /* (OOM: released now) */
            if (s->ev != NULL) Py_DECREF(s->ev);
            else PyObject_Free(s->enc);
        }
        s->ev = NULL;
        s->enc = NULL;
        if (s->size > 1) free(s->hs);
        if (s->ndeps > 1) free(s->deps);
        free(s->ifl);
    }
    free(st->src);
    st->src = NULL;
    st->nsrc_cap = 0;
    st->free_head = st->head = st->tail = NIL;
    st->nsources = 0;
    tab_free(&st->keys);
}

/* Forget everything (the GIL held; released while a large state's C memory is
 * freed).  The events and the interned hashes go to the graveyard. */
static void forget(State *st) {
    size_t want = st->grave.n + st->nsources;
    int room = want <= st->grave.cap;
    if (!room) {
        Grave *p = (Grave *)realloc(st->grave.p, want * sizeof(Grave));
        if (p != NULL) {
            st->grave.p = (char *)p;
            st->grave.cap = want;
            room = 1;
        }
    }
    if (room && (st->nsrc_cap >= (1u << 12) || st->keys.cap >= (1u << 13))) {
        st->busy = 1;
        g_cs->gil_releases++;
        Py_BEGIN_ALLOW_THREADS
        forget_sources(st, 1);
        Py_END_ALLOW_THREADS
        st->busy = 0;
    } else {
        forget_sources(st, room);
    }
    st->held = st->counts = st->kept = 0;
    for (uint32_t i = 0; i < st->nscopes; i++) Py_CLEAR(st->scopes[i]);
    st->nscopes = 0;
    for (int k = 0; k < NCACHE; k++) cache_clear(&st->cache[k]);
    if (st->scope_ids) PyDict_Clear(st->scope_ids);
    for (uint32_t i = 0; i < st->niobj; i++) {
        PyObject *o = st->iobj[i];
        if (o == NULL) continue;
        st->iobj[i] = NULL;
        Grave *g = (Grave *)vec_push(&st->grave);
        if (g != NULL) {
            g->ev = o;
            g->enc = NULL;
            g->cost = 1;
        } else {
            Py_DECREF(o);
        }
    }
    st->niobj = 0;
    if (st->intern_ids != NULL && PyDict_GET_SIZE(st->intern_ids) > 0) {
        /* a large dict is not cleared here: it goes to the graveyard whole */
        PyObject *fresh = PyDict_New();
        Grave *g = fresh == NULL ? NULL : (Grave *)vec_push(&st->grave);
        if (g != NULL) {
            g->ev = st->intern_ids;
            g->enc = NULL;
            g->cost = 2 * PyDict_GET_SIZE(st->intern_ids);
            st->intern_ids = fresh;
        } else {
            Py_XDECREF(fresh);
            PyErr_Clear();
            PyDict_Clear(st->intern_ids);
        }
    }
    vec_free(&st->ifree);
    st->izero.n = 0;
    st->gen++;
    finish(st);
    publish(st);
}

/* ---- phase 1: reading the events (the GIL held) ---------------------------- */

/* The last scope looked up: its four values (strong references, compared by
 * identity, then by value for str and int: decoded events hold equal strings
 * that are not the same object) and its id (NIL: not interned). */
static inline int same_value(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    if (PyUnicode_CheckExact(a) && PyUnicode_CheckExact(b)) {
        Py_ssize_t n = PyUnicode_GET_LENGTH(a);
        if (n != PyUnicode_GET_LENGTH(b) || PyUnicode_KIND(a) != PyUnicode_KIND(b)) return 0;
        const char *x = (const char *)PyUnicode_DATA(a), *y = (const char *)PyUnicode_DATA(b);
        size_t len = (size_t)n * PyUnicode_KIND(a);
        for (size_t i = 0; i < len; i++)
            if (x[i] != y[i]) return 0;
        return 1;
    }
    if (PyLong_CheckExact(a) && PyLong_CheckExact(b)) {
        int overflow_a = 0, overflow_b = 0;
        long long x = PyLong_AsLongLongAndOverflow(a, &overflow_a);
        long long y = PyLong_AsLongLongAndOverflow(b, &overflow_b);
        return !overflow_a && !overflow_b && x == y;
    }
    return 0;
}

static inline PyObject *field(PyObject *ev, const TypeInfo *ti, int f) {
    Py_ssize_t off = ti->off[f];
    return off < 0 ? Py_None : FIELD(ev, off);
}

/* The scope id of ev (NIL: none interned and !create); -1 on a Python error
 * (an unhashable value). */
static long long scope_of(State *st, PyObject *ev, const TypeInfo *ti, int create) {
    PyObject *v[4];
    for (int k = 0; k < 4; k++) {
        v[k] = field(ev, ti, F_MEDIUM + k);
        if (v[k] == NULL) return -2; /* unset */
    }
    for (int k = 0; k < NCACHE; k++) { /* by identity first: an engine's events share them */
        ScopeCache *c = &st->cache[k];
        if (c->valid && v[0] == c->v[0] && v[1] == c->v[1] && v[2] == c->v[2] && v[3] == c->v[3]) {
            st->cache_last = k;
            return c->id;
        }
    }
    for (int k = 0; k < NCACHE; k++) { /* the last hit first (entries stay in place) */
        int idx = (st->cache_last + k) % NCACHE;
        ScopeCache *c = &st->cache[idx];
        if (c->valid && same_value(v[0], c->v[0]) &&
            same_value(v[1], c->v[1]) && same_value(v[2], c->v[2]) && same_value(v[3], c->v[3])) {
            st->cache_last = idx;
            return c->id;
        }
    }
    if (st->cache_next == st->cache_last) st->cache_next = (st->cache_next + 1) % NCACHE;
    ScopeCache *c = &st->cache[st->cache_next];
    st->cache_last = st->cache_next;
    st->cache_next = (st->cache_next + 1) % NCACHE;
    PyObject *t = PyTuple_Pack(4, v[0], v[1], v[2], v[3]);
    if (t == NULL) return -1;
    PyObject *idobj = PyDict_GetItemWithError(st->scope_ids, t);
    uint32_t id;
    if (idobj != NULL) {
        id = (uint32_t)PyLong_AsUnsignedLong(idobj);
    } else if (PyErr_Occurred()) {
        Py_DECREF(t);
        return -1;
    } else if (!create) {
        Py_DECREF(t);
        return NIL; /* (not remembered: a store may intern it later in this call) */
    } else {
        if (st->nscopes >= MAX_SCOPES) {
            Py_DECREF(t);
            PyErr_SetString(PyExc_OverflowError, "too many scopes");
            return -1;
        }
        if (st->nscopes == st->scopes_cap) {
            uint32_t cap = st->scopes_cap ? st->scopes_cap * 2 : 8;
            PyObject **p = (PyObject **)realloc(st->scopes, cap * sizeof(PyObject *));
            if (p == NULL) {
                Py_DECREF(t);
                PyErr_NoMemory();
                return -1;
            }
            st->scopes = p;
            st->scopes_cap = cap;
        }
        PyObject *num = PyLong_FromUnsignedLong(st->nscopes);
        int err = num == NULL ? -1 : PyDict_SetItem(st->scope_ids, t, num);
        Py_XDECREF(num);
        if (err < 0) {
            Py_DECREF(t);
            return -1;
        }
        id = st->nscopes;
        st->scopes[st->nscopes++] = Py_NewRef(t);
    }
    Py_DECREF(t);
    cache_clear(c);
    for (int k = 0; k < 4; k++) c->v[k] = Py_NewRef(v[k]);
    c->id = id;
    c->valid = 1;
    return id;
}

/* A hash as a key: 1 read (*h, *flag: 0 an int in [0, 2**64), 3 a negative int
 * (its two's complement), 1 interned, 2 an interned kind not interned and
 * !create), 0 a kind it does not take, -1 a Python error. */
static int hash_key(State *st, PyObject *o, int create, uint64_t *h, uint8_t *flag) {
    if (PyLong_CheckExact(o)) {
        if (long_u64(o, h)) {
            *flag = 0;
            return 1;
        }
        int over = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &over);
        if (v < 0 && !over) { /* (-1 with an error: none is set for an exact int) */
            *h = (uint64_t)v;
            *flag = 3;
            return 1;
        }
        PyErr_Clear();
    }
    if (!PyLong_CheckExact(o) && !PyBytes_CheckExact(o) && !PyUnicode_CheckExact(o)) return 0;
    PyObject *idobj = PyDict_GetItemWithError(st->intern_ids, o);
    if (idobj != NULL) {
        *h = PyLong_AsUnsignedLong(idobj);
        *flag = 1;
        return 1;
    }
    if (PyErr_Occurred()) return -1;
    if (!create) {
        *h = 0;
        *flag = 2;
        return 1;
    }
    uint32_t iid;
    if (st->ifree.n > 0) {
        iid = VEC_AT(&st->ifree, uint32_t, --st->ifree.n);
    } else {
        if (st->niobj == st->iobj_cap) {
            uint32_t cap = st->iobj_cap ? st->iobj_cap * 2 : 64;
            PyObject **p = (PyObject **)realloc(st->iobj, cap * sizeof(PyObject *));
            if (p == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            st->iobj = p;
            uint32_t *r = (uint32_t *)realloc(st->iref, cap * sizeof(uint32_t));
            if (r == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            st->iref = r;
            st->iobj_cap = cap;
        }
        iid = st->niobj++;
    }
    PyObject *num = PyLong_FromUnsignedLong(iid);
    int err = num == NULL ? -1 : PyDict_SetItem(st->intern_ids, o, num);
    Py_XDECREF(num);
    uint32_t *z = err < 0 ? NULL : (uint32_t *)vec_push(&st->izero);
    if (z == NULL) {
        st->iobj[iid] = NULL;
        uint32_t *f = (uint32_t *)vec_push(&st->ifree);
        if (f != NULL) *f = iid;
        if (err == 0) {
            PyDict_DelItem(st->intern_ids, o);
            PyErr_NoMemory();
        }
        return -1;
    }
    *z = iid;
    st->iobj[iid] = Py_NewRef(o);
    st->iref[iid] = 0;
    *h = iid;
    *flag = 1;
    return 1;
}

/* The k-byte big-endian unsigned int at *q (k <= 8) in *u, *q moved past it;
 * 0 when fewer than k bytes are left before end. */
static int take_be(const unsigned char **q, const unsigned char *end, size_t k, uint64_t *u) {
    if ((size_t)(end - *q) < k) return 0;
    uint64_t v = 0;
    for (size_t i = 0; i < k; i++) v = v << 8 | (*q)[i];
    *q += k;
    *u = v;
    return 1;
}

/* A Raw holding a msgpack array: *p its first element, *end the end, *n its
 * length.  0 when o is not such a Raw.  (The bytes stay valid while o lives:
 * a Raw is immutable, and the event holding it is held by the caller.) */
static int raw_list(PyObject *o, const unsigned char **p, const unsigned char **end,
                    Py_ssize_t *n) {
    if (g_raw_type == NULL || Py_TYPE(o) != g_raw_type) return 0;
    Py_buffer view;
    if (PyObject_GetBuffer(o, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        return 0;
    }
    const unsigned char *q = (const unsigned char *)view.buf, *e = q + view.len;
    PyBuffer_Release(&view);
    if (q >= e) return 0;
    unsigned char b = *q++;
    uint64_t len;
    if ((b & 0xf0) == 0x90) {
        len = b & 0x0f;
    } else if (b != 0xdc && b != 0xdd) {
        return 0;
    } else if (!take_be(&q, e, b == 0xdc ? 2 : 4, &len)) {
        return 0;
    }
    *p = q;
    *end = e;
    *n = (Py_ssize_t)len;
    return 1;
}

/* The next element of a Raw hash list as a key (hash_key's results: 1, 0 an
 * element it does not take, -1 a Python error); *p moves past it.  Ints are
 * read as hash_key reads them (flag 0, or 3 when negative); bins (the hashes
 * the list path interns) are interned as the objects they decode to. */
static int raw_hash(State *st, const unsigned char **p, const unsigned char *end, int create,
                    uint64_t *h, uint8_t *flag) {
    const unsigned char *q = *p;
    if (q >= end) return 0;
    unsigned char b = *q++;
    uint64_t u = b, len = 0; /* len: a bin's bytes, after its header */
    PyObject *o;
    if (b < 0x80 || (b >= 0xcc && b <= 0xcf)) { /* positive fixint, uint 8/16/32/64 */
        if (b >= 0x80 && !take_be(&q, end, (size_t)1 << (b - 0xcc), &u)) return 0;
        *h = u;
        *flag = 0;
        *p = q;
        return 1;
    } else if (b >= 0xe0 || (b >= 0xd0 && b <= 0xd3)) { /* negative fixint, int 8-64 */
        if (b >= 0xe0) {
            u = (uint64_t)(int64_t)(int8_t)b;
        } else {
            size_t k = (size_t)1 << (b - 0xd0);
            if (!take_be(&q, end, k, &u)) return 0;
            if (k < 8 && (u >> (8 * k - 1)) & 1) u |= ~(uint64_t)0 << (8 * k); /* sign */
        }
        if ((int64_t)u < 0) { /* as hash_key keys a negative int */
            *h = u;
            *flag = 3;
            *p = q;
            return 1;
        }
        o = PyLong_FromLongLong((long long)u); /* (msgpack allows a signed form >= 0) */
    } else if (b >= 0xc4 && b <= 0xc6) { /* bin 8/16/32 */
        if (!take_be(&q, end, (size_t)1 << (b - 0xc4), &len) || (uint64_t)(end - q) < len)
            return 0;
        o = PyBytes_FromStringAndSize((const char *)q, (Py_ssize_t)len);
    } else {
        return 0;
    }
    if (o == NULL) return -1;
    int r = hash_key(st, o, create, h, flag);
    Py_DECREF(o);
    if (r == 1) *p = q + len;
    return r;
}

/* A list of exact ints, taken out of the cyclic GC's lists: a kept store's hash and
 * token lists would otherwise be walked by every full collection of the engine's
 * process (a million kept blocks: two million lists).  Such a list cannot be part
 * of a reference cycle while it holds only ints; a published event's lists are not
 * changed afterwards (were one given a container later, a cycle through it would
 * be leaked, never freed early).  Anything else is left as it is.  O(len). */
static void untrack_ints(PyObject *o) {
    if (o == NULL || !PyList_CheckExact(o) || !PyObject_GC_IsTracked(o)) return;
    Py_ssize_t n = PyList_GET_SIZE(o);
    PyObject **items = ((PyListObject *)o)->ob_item;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyLong_CheckExact(items[i])) return;
    PyObject_GC_UnTrack(o);
}

/* Read one store or removal into an op.  1 read (or nothing to do), 0 an event
 * it does not take, -1 a Python error.  `kept`: a store's event will be kept
 * (not its bytes): its lists of ints leave the cyclic GC. */
static int read_event(State *st, PyObject *ev, const TypeInfo *ti, int kept) {
    PyObject *hashes = FIELD(ev, ti->off[F_HASHES]);
    if (hashes == NULL) return 0;
    PyObject **items = NULL;
    const unsigned char *raw = NULL, *raw_end = NULL; /* a Raw list's elements */
    Py_ssize_t n;
    if (PyList_CheckExact(hashes) || PyTuple_CheckExact(hashes)) {
        items = PySequence_Fast_ITEMS(hashes);
        n = PySequence_Fast_GET_SIZE(hashes);
    } else if (!raw_list(hashes, &raw, &raw_end, &n)) {
        return 0;
    }
    if (n == 0) return 1; /* a store of none, a removal of none: nothing */
    if (n >= (Py_ssize_t)1 << 31) return 0;
    int store = ti->kind == K_STORED;
    long long scope = scope_of(st, ev, ti, store);
    if (scope == -2) return 0;
    if (scope == -1) return -1;
    if (scope == NIL) return 1; /* a removal in a scope never stored to: a no-op */
    /* the op, written in place (no copy of one built on the stack); taken back
     * on a failure */
    Op *op = (Op *)vec_push(&st->ops);
    if (op == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    op->kind = ti->kind;
    op->scope = (uint32_t)scope;
    op->ev = NULL;
    op->enc = NULL;
    op->n = (uint32_t)n;
    op->parent = 0;
    op->tokens = 0;
    op->parent_sk = 0;
    op->parent_h = 0;
    op->ntok = 0;
    PyObject *toks = NULL;
    if (store) {
        PyObject *parent = FIELD(ev, ti->off[F_PARENT]);
        if (parent == NULL) goto not_taken;
        if (parent != Py_None) {
            uint8_t flag;
            int r = hash_key(st, parent, 0, &op->parent_h, &flag);
            if (r <= 0) {
                st->ops.n--;
                return r;
            }
            op->parent = flag != 2;
            op->parent_sk = kflag(flag);
        }
        toks = field(ev, ti, F_TOKENS);
        if (toks == NULL) goto not_taken;
        if (toks == Py_None) {
            op->ntok = 0;
        } else if (PyList_CheckExact(toks) || PyTuple_CheckExact(toks)) {
            op->ntok = PySequence_Fast_GET_SIZE(toks);
        } else {
            const unsigned char *tp, *te;
            if (!raw_list(toks, &tp, &te, &op->ntok)) goto not_taken;
        }
        op->tokens = op->ntok > 0;
    }
    size_t h0 = st->hb.n;
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t *h = (uint64_t *)vec_push(&st->hb);
        uint8_t *f = (uint8_t *)vec_push(&st->hf);
        if (h == NULL || f == NULL) {
            st->hb.n = st->hf.n = h0;
            st->ops.n--;
            PyErr_NoMemory();
            return -1;
        }
        int r;
        if (items == NULL) {
            r = raw_hash(st, &raw, raw_end, store, h, f);
        } else {
            PyObject *o = items[j];
            if (PyLong_CheckExact(o) && long_u64(o, h)) {
                *f = 0;
                continue;
            }
            r = hash_key(st, o, store, h, f);
        }
        if (r <= 0) {
            st->hb.n = st->hf.n = h0;
            st->ops.n--;
            return r;
        }
    }
    op->h0 = h0;
    if (store) {
        op->ev = Py_NewRef(ev);
        if (kept) {
            untrack_ints(hashes);
            untrack_ints(toks);
        }
        st->store_ops++;
        st->store_hashes += n;
    }
    return 1;
not_taken:
    st->ops.n--;
    return 0;
}

/* Whether applying the ops gathered will grow the key table or the sources'
 * array (a rehash or a copy of the whole state: done without the GIL). */
static int will_grow(const State *st) {
    return (st->keys.cap >= (1u << 13) && (st->keys.n + st->store_hashes + 1) * 2 > st->keys.cap) ||
           (st->nsrc_cap >= (1u << 12) && (size_t)st->nsources + st->store_ops > st->nsrc_cap);
}

/* Whether the key table is to shrink (a rehash, likewise). */
static int will_shrink(const State *st) {
    return st->keys.cap > 1024 && st->keys.n * 8 <= st->keys.cap;
}

/* Whether a shrink is large enough to be done without the GIL. */
static int big_shrink(const State *st) { return st->keys.cap >= (1u << 13) && will_shrink(st); }

/* Phases 2 and 3 for the ops gathered.  The table is updated without the GIL
 * for a call of many hashes, or one that grows or shrinks the state's arrays
 * (so that no hold of the GIL copies the whole state).  0 on OOM (an
 * exception set). */
static int flush(State *st) {
    int ok = 1;
    if (st->ops.n > 0) {
        st->gen++;
        int nogil = g_nogil_from >= 0 && (st->hb.n >= (size_t)g_nogil_from || will_grow(st));
        if (nogil) {
            st->busy = 1;
            g_cs->gil_releases++;
            Py_BEGIN_ALLOW_THREADS
            ok = apply_ops(st);
            if (ok && will_shrink(st)) ok = tab_shrink(&st->keys);
            Py_END_ALLOW_THREADS
            st->busy = 0;
        } else {
            ok = apply_ops(st);
        }
    }
    if (ok && will_shrink(st) && !big_shrink(st)) ok = tab_shrink(&st->keys);
    if (ok && big_shrink(st)) {
        st->busy = 1;
        g_cs->gil_releases++;
        Py_BEGIN_ALLOW_THREADS
        ok = tab_shrink(&st->keys);
        Py_END_ALLOW_THREADS
        st->busy = 0;
    }
    st->store_ops = st->store_hashes = 0;
    finish(st);
    publish(st);
    if (!ok) PyErr_NoMemory();
    return ok;
}

static int check_free(State *st) {
    if (st->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the recorder's state is being updated");
        return 0;
    }
    return 1;
}

/* Whether the counts' sum or the kept hashes exceed max_blocks (-1: no budget). */
static int over_budget(const State *st, long long max_blocks) {
    return max_blocks >= 0 && (st->counts > max_blocks || st->kept > max_blocks);
}

PyDoc_STRVAR(record_doc,
             "record(events, i[, max_blocks]) -> int\n\n"
             "Apply events[i:] (a list); the index of the first event not applied, the\n"
             "reason in `stopped` (see the module source's header); -1 when all were\n"
             "applied and the counts' sum or the kept hashes exceed max_blocks.  On an\n"
             "error (out of memory) raises: the caller forgets the state.");

static PyObject *State_record(State *st, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "record(events: list, i: int[, max_blocks: int])");
        return NULL;
    }
    long long max_blocks = -1;
    if (nargs == 3) {
        max_blocks = PyLong_AsLongLong(args[2]);
        if (max_blocks == -1 && PyErr_Occurred()) return NULL;
    }
    if (!check_free(st)) return NULL;
    PyObject *events = args[0];
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0) i = 0;
    Py_INCREF(events);
    const TypeInfo *ti = NULL;
    st->stopped = STOP_DONE;
    st->ops.item = sizeof(Op);
    int failed = 0;
    Py_ssize_t nev = PyList_GET_SIZE(events);
    for (; i < nev; i++) {
        PyObject *ev = PyList_GET_ITEM(events, i);
        /* the objects the loop reads, fetched ahead: an event, then its lists, then
         * its first hash (only for events of the class of this one) */
        if (i + 3 * AHEAD < nev) __builtin_prefetch(PyList_GET_ITEM(events, i + 3 * AHEAD));
        if (ti != NULL && (ti->kind == K_STORED || ti->kind == K_REMOVED)) {
            if (i + 2 * AHEAD < nev) {
                PyObject *ahead = PyList_GET_ITEM(events, i + 2 * AHEAD);
                if (Py_TYPE(ahead) == ti->type) {
                    PyObject *hs = FIELD(ahead, ti->off[F_HASHES]);
                    if (hs != NULL) __builtin_prefetch(hs);
                    if (ti->off[F_TOKENS] >= 0) {
                        PyObject *tk = FIELD(ahead, ti->off[F_TOKENS]);
                        if (tk != NULL) __builtin_prefetch(tk);
                    }
                }
            }
            if (i + AHEAD < nev) {
                PyObject *ahead = PyList_GET_ITEM(events, i + AHEAD);
                if (Py_TYPE(ahead) == ti->type) {
                    PyObject *hs = FIELD(ahead, ti->off[F_HASHES]);
                    if (hs != NULL && PyList_CheckExact(hs) && PyList_GET_SIZE(hs) > 0)
                        __builtin_prefetch(PyList_GET_ITEM(hs, 0));
                }
            }
        }
        if (ti == NULL || ti->type != Py_TYPE(ev)) ti = find_type(Py_TYPE(ev));
        if (ti == NULL) {
            st->stopped = STOP_UNKNOWN;
            break;
        }
        if (ti->kind == K_OPAQUE) continue;
        if (ti->kind == K_MOVED) {
            st->stopped = STOP_MOVE;
            break;
        }
        if (ti->kind == K_CLEARED) {
            if (!flush(st)) {
                failed = 1;
                break;
            }
            forget(st);
            continue;
        }
        if (ti->kind == UNREADABLE) {
            st->stopped = STOP_PYTHON;
            break;
        }
        int r = read_event(st, ev, ti, 1);
        if (r < 0) {
            PyErr_Clear(); /* the Python recorder meets it again, and says what it is */
            r = 0;
        }
        if (r == 0) {
            st->stopped = STOP_PYTHON;
            break;
        }
    }
    if (!flush(st)) failed = 1;
    Py_DECREF(events);
    if (failed) return NULL;
    if (i == nev && over_budget(st, max_blocks))
        return PyLong_FromLong(-1); /* applied, and over the budget */
    return PyLong_FromSsize_t(i);
}

static PyObject *s_events = NULL;

PyDoc_STRVAR(record_batch_doc,
             "record_batch(batch, max_blocks) -> int\n\n"
             "record(batch.events, 0, max_blocks) for a batch whose events are a list,\n"
             "counted in `batches` and `events`: -2 when all were applied within the\n"
             "budget, -1 when over it, else the index where it stopped (`stopped`);\n"
             "-3, nothing done nor counted, when the events are not a list.");

static PyObject *State_record_batch(State *st, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "record_batch(batch, max_blocks)");
        return NULL;
    }
    PyObject *events = PyObject_GetAttr(args[0], s_events);
    if (events == NULL) return NULL;
    if (!PyList_CheckExact(events)) {
        Py_DECREF(events);
        return PyLong_FromLong(-3);
    }
    st->nbatches++;
    st->nevents += PyList_GET_SIZE(events);
    PyObject *zero = PyLong_FromLong(0);
    PyObject *call[3] = {events, zero, args[1]};
    PyObject *r = zero == NULL ? NULL : State_record(st, call, 3);
    Py_XDECREF(zero);
    Py_ssize_t n = PyList_GET_SIZE(events);
    Py_DECREF(events);
    if (r == NULL) return NULL;
    Py_ssize_t i = PyLong_AsSsize_t(r);
    Py_DECREF(r);
    if (i == n) return PyLong_FromLong(-2);
    return PyLong_FromSsize_t(i);
}

PyDoc_STRVAR(record_batches_doc,
             "record_batches(batches, j, max_blocks) -> (int, int)\n\n"
             "record_batch() for batches[j:] (a list), in one call: (len(batches), -2)\n"
             "when every one was applied within the budget, else the index of the first\n"
             "that was not, and record_batch()'s answer for it.  On an error raises, the\n"
             "failing batch's index in `at`.");

static PyObject *State_record_batches(State *st, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "record_batches(batches: list, j: int, max_blocks)");
        return NULL;
    }
    PyObject *batches = args[0];
    Py_ssize_t j = PyLong_AsSsize_t(args[1]);
    if (j == -1 && PyErr_Occurred()) return NULL;
    Py_INCREF(batches);
    long r = -2;
    for (; j < PyList_GET_SIZE(batches); j++) {
        PyObject *call[2] = {PyList_GET_ITEM(batches, j), args[2]};
        Py_INCREF(call[0]);
        st->at = j;
        PyObject *got = State_record_batch(st, call, 2);
        Py_DECREF(call[0]);
        if (got == NULL) {
            Py_DECREF(batches);
            return NULL;
        }
        r = PyLong_AsLong(got);
        Py_DECREF(got);
        if (r != -2) break;
    }
    if (j >= PyList_GET_SIZE(batches)) r = -2;
    Py_DECREF(batches);
    return Py_BuildValue("(nl)", j, r);
}

/* Forget the scopes interned from id `from` on (by a read whose ops were
 * dropped: no key or source names them). */
static void unintern_scopes(State *st, uint32_t from) {
    for (int k = 0; k < NCACHE; k++)
        if (st->cache[k].valid && st->cache[k].id >= from) cache_clear(&st->cache[k]);
    while (st->nscopes > from) {
        PyObject *t = st->scopes[--st->nscopes];
        if (PyDict_DelItem(st->scope_ids, t) < 0) PyErr_Clear();
        Py_DECREF(t);
    }
}

PyDoc_STRVAR(encode_record_doc,
             "encode_record(batch, max_blocks) -> bytes | (bytes,) | None\n\n"
             "The batch encoded as msgspec.msgpack.Encoder().encode(batch) encodes it\n"
             "(coalesce/_cr_encode.h says for which shapes), and its events recorded as\n"
             "record_batch() records them, in one pass over the events: the bytes, or\n"
             "(bytes,) when the counts' sum or the kept hashes then exceed max_blocks.\n"
             "None when it declines the batch (a class without a layout: `declined`;\n"
             "a value it does not write; an event record() stops at): then nothing was\n"
             "recorded nor counted, and the caller encodes and records it as before.");

static PyObject *State_encode_record(State *st, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "encode_record(batch, max_blocks)");
        return NULL;
    }
    long long max_blocks = PyLong_AsLongLong(args[1]);
    if (max_blocks == -1 && PyErr_Occurred()) return NULL;
    if (!check_free(st)) return NULL;
    PyObject *batch = args[0];
    Py_CLEAR(st->declined);
    const BatchLayout *bl = find_batch(Py_TYPE(batch));
    if (bl == NULL) {
        st->declined = Py_NewRef((PyObject *)Py_TYPE(batch));
        Py_RETURN_NONE;
    }
    PyObject *ts = FIELD(batch, bl->off[0]), *events = FIELD(batch, bl->off[1]);
    if (ts == NULL || events == NULL || !PyList_CheckExact(events)) Py_RETURN_NONE;
    Out *o = &st->out;
    o->n = 0;
    if (!out_room(o, 1)) return PyErr_NoMemory();
    o->p[o->n++] = 0x93; /* [ts, events, rank] */
    Py_ssize_t nev = PyList_GET_SIZE(events);
    if (!put_value(o, ts, 0) || !put_len(o, MP_ARRAY, (size_t)nev))
        Py_RETURN_NONE;
    Py_INCREF(events);
    st->ops.item = sizeof(Op);
    uint32_t nscopes = st->nscopes;
    const TypeInfo *ti = NULL;
    const EncInfo *e = NULL;
    int ok = 1;
    for (Py_ssize_t i = 0; i < nev; i++) {
        /* (reading an event may run Python code, which may change the list) */
        if (PyList_GET_SIZE(events) != nev) {
            ok = 0;
            break;
        }
        PyObject *ev = PyList_GET_ITEM(events, i);
        if (ti == NULL || ti->type != Py_TYPE(ev)) {
            ti = find_type(Py_TYPE(ev));
            e = ti == NULL ? NULL : &g_enc[ti - g_types];
        }
        if (e == NULL || !e->set) {
            st->declined = Py_NewRef((PyObject *)Py_TYPE(ev));
            ok = 0;
            break;
        }
        if (!put_event(o, ev, e)) {
            ok = 0;
            break;
        }
        if (ti->kind == K_OPAQUE) continue;
        if (ti->kind != K_STORED && ti->kind != K_REMOVED) { /* a clear, a move: record() */
            ok = 0;
            break;
        }
        size_t nops = st->ops.n, n = o->n - o->at;
        int encoded = g_raw_type != NULL && (Py_ssize_t)(sizeof(Enc) + n) <= g_encoded_max;
        int r = read_event(st, ev, ti, !encoded);
        if (r <= 0) {
            PyErr_Clear();
            ok = 0;
            break;
        }
        if (st->ops.n > nops && encoded) { /* a store: kept as the bytes just written */
            Op *op = &VEC_AT(&st->ops, Op, nops);
            if (op->ev != NULL) {
                op->enc = (Enc *)PyObject_Malloc(sizeof(Enc) + n);
                if (op->enc == NULL) {
                    ok = 0;
                    break;
                }
                op->enc->len = (uint32_t)n;
                op->enc->type = (uint16_t)(ti - g_types);
                memcpy(op->enc->b, o->p + o->at, n);
                Py_CLEAR(op->ev);
            }
        }
    }
    if (ok) { /* (read now: reading the events may have run Python code) */
        PyObject *rank = FIELD(batch, bl->off[2]);
        ok = rank != NULL && put_value(o, rank, 0);
    }
    if (!ok) {
        st->store_ops = st->store_hashes = 0;
        finish(st); /* the ops read so far dropped, not applied */
        unintern_scopes(st, nscopes);
        Py_DECREF(events);
        Py_RETURN_NONE;
    }
    st->nbatches++;
    st->nevents += nev;
    st->nencoded++;
    int applied = flush(st);
    Py_DECREF(events);
    if (!applied) return NULL;
    PyObject *bytes = out_take(o);
    if (bytes == NULL || !over_budget(st, max_blocks)) return bytes;
    PyObject *over = PyTuple_Pack(1, bytes);
    Py_DECREF(bytes);
    return over;
}

static PyObject *State_declined(State *st, void *closure) {
    return Py_NewRef(st->declined == NULL ? Py_None : st->declined);
}
static PyObject *State_encoded(State *st, void *closure) { return PyLong_FromLongLong(st->nencoded); }

static PyObject *State_clear(State *st, PyObject *unused) {
    if (!check_free(st)) return NULL;
    forget(st);
    Py_RETURN_NONE;
}

static PyObject *State_sweep(State *st, PyObject *arg) {
    Py_ssize_t budget = PyLong_AsSsize_t(arg);
    if (budget == -1 && PyErr_Occurred()) return NULL;
    sweep(st, budget < 0 ? PY_SSIZE_T_MAX : budget);
    return PyLong_FromSize_t(st->grave.n);
}

/* A key's hash as the Python object (a new reference). */
static PyObject *key_object(State *st, uint64_t h, uint32_t sk) {
    if (sk & IFLAG) return Py_NewRef(st->iobj[(uint32_t)h]);
    if (sk & NFLAG) return PyLong_FromLongLong((long long)h);
    return PyLong_FromUnsignedLongLong((unsigned long long)h);
}

PyDoc_STRVAR(export_doc,
             "export() -> (live, sources, refs, n)\n\n"
             "The state in the Python recorder's form, source ids renumbered 0.. in\n"
             "recorded order.  O(keys + sources).");

static PyObject *State_export(State *st, PyObject *unused) {
    if (!check_free(st)) return NULL;
    PyObject *live = NULL, *sources = NULL, *refs = NULL, *out = NULL;
    PyObject **tables = NULL;
    uint32_t *order = NULL;
    if (st->nsrc_cap > 0) {
        order = (uint32_t *)malloc((size_t)st->nsrc_cap * sizeof(uint32_t));
        if (order == NULL) return PyErr_NoMemory();
    }
    uint32_t k = 0;
    for (uint32_t sid = st->head; sid != NIL; sid = st->src[sid].next) order[sid] = k++;
    live = PyDict_New();
    sources = PyDict_New();
    refs = PyDict_New();
    tables = (PyObject **)calloc(st->nscopes + 1, sizeof(PyObject *));
    if (live == NULL || sources == NULL || refs == NULL || tables == NULL) goto done;
    for (uint32_t s = 0; s < st->nscopes; s++) {
        tables[s] = PyDict_New();
        if (tables[s] == NULL || PyDict_SetItem(live, st->scopes[s], tables[s]) < 0) goto done;
    }
    for (size_t j = 0; j < st->keys.cap; j++) {
        Ent *e = &st->keys.e[j];
        if (e->sk == EMPTY) continue;
        PyObject *h = key_object(st, e->h, e->sk);
        PyObject *v = PyLong_FromLongLong(((long long)order[e->src] << 32) | e->count);
        int err = h == NULL || v == NULL ? -1 : PyDict_SetItem(tables[e->sk & ~KFLAGS], h, v);
        Py_XDECREF(h);
        Py_XDECREF(v);
        if (err < 0) goto done;
    }
    for (uint32_t sid = st->head; sid != NIL; sid = st->src[sid].next) {
        Src *s = &st->src[sid];
        PyObject *deps = PyTuple_New(s->ndeps);
        if (deps == NULL) goto done;
        const uint32_t *d = src_deps(s);
        for (uint32_t j = 0; j < s->ndeps; j++) {
            PyObject *x = PyLong_FromUnsignedLong(order[d[j]]);
            if (x == NULL) {
                Py_DECREF(deps);
                goto done;
            }
            PyTuple_SET_ITEM(deps, j, x);
        }
        PyObject *id = PyLong_FromUnsignedLong(order[sid]);
        PyObject *ev = src_event(s);
        if (ev != NULL && s->enc != NULL) /* (its class with it: (cls, Raw)) */
            Py_SETREF(ev, PyTuple_Pack(2, (PyObject *)g_types[s->enc->type].type, ev));
        PyObject *tup = ev == NULL ? NULL
                                   : Py_BuildValue("(NONOI)", ev, st->scopes[s->scope], deps,
                                                   s->tokens ? Py_True : Py_False,
                                                   (unsigned int)s->size);
        if (ev == NULL) Py_DECREF(deps);
        PyObject *r = PyLong_FromUnsignedLong(s->refs);
        int err = id == NULL || tup == NULL || r == NULL ? -1 : PyDict_SetItem(sources, id, tup);
        if (err == 0) err = PyDict_SetItem(refs, id, r);
        Py_XDECREF(id);
        Py_XDECREF(tup);
        Py_XDECREF(r);
        if (err < 0) goto done;
    }
    out = Py_BuildValue("(OOO[ILLL])", live, sources, refs, (unsigned int)k, st->held,
                        st->counts, st->kept);
done:
    if (tables != NULL)
        for (uint32_t s = 0; s < st->nscopes; s++) Py_XDECREF(tables[s]);
    free(tables);
    free(order);
    Py_XDECREF(live);
    Py_XDECREF(sources);
    Py_XDECREF(refs);
    return out;
}

static PyObject *State_stopped(State *st, void *closure) { return PyLong_FromLong(st->stopped); }
static PyObject *State_at(State *st, void *closure) { return PyLong_FromSsize_t(st->at); }
static PyObject *State_batches(State *st, void *closure) {
    return PyLong_FromLongLong(st->nbatches);
}
static PyObject *State_events(State *st, void *closure) {
    return PyLong_FromLongLong(st->nevents);
}
static PyObject *State_held(State *st, void *closure) { return PyLong_FromLongLong(st->pub_held); }
static PyObject *State_counts(State *st, void *closure) {
    return PyLong_FromLongLong(st->pub_counts);
}
static PyObject *State_graveyard(State *st, void *closure) {
    return PyLong_FromSize_t(st->grave.n);
}
static PyObject *State_kept(State *st, void *closure) { return PyLong_FromLongLong(st->pub_kept); }
static PyObject *State_sources(State *st, void *closure) {
    return PyLong_FromLongLong(st->pub_sources);
}

static PyObject *State_nbytes(State *st, void *closure) {
    size_t b = st->keys.cap * sizeof(Ent) + (size_t)st->nsrc_cap * sizeof(Src);
    for (uint32_t sid = st->head; sid != NIL; sid = st->src[sid].next) {
        Src *s = &st->src[sid];
        if (s->size > 1) b += s->size * sizeof(uint64_t);
        if (s->ifl) b += s->size;
        if (s->ndeps > 1) b += s->ndeps * sizeof(uint32_t);
        if (s->enc != NULL) b += sizeof(Enc) + s->enc->len;
    }
    return PyLong_FromSize_t(b);
}

/* ---- the walk: the replay program ------------------------------------------ */

typedef struct {
    PyObject_HEAD
    State *st;
    unsigned long long gen;
    Py_ssize_t max_events, max_tokens, max_work, per_event;
    PyObject *make_removed; /* (hashes, medium, group_idx, locality, ownership) -> event */
    int phase, stage, ended;
    uint32_t cur;     /* phase 0: the next source */
    size_t mi;        /* phase 1: the index in multi */
    uint32_t msid;    /* phase 1: the source of multi[mi] */
    Tab foreign;      /* key -> stores of it by sources not naming it */
    Vec fkeys;        /* Ent: the foreign keys in their first order */
    Vec multi;        /* Ent: keys held more than once, as named */
    Tab again;        /* (sid, 0) -> times sent again */
    Vec again_order;  /* uint32 */
    Vec repeats;      /* uint32: sources that store a hash more than once */
    PyObject *removals; /* phase 2: a list of events */
    Py_ssize_t ri;
} Walk;

static PyTypeObject Walk_Type;

/* Occurrences of (h, sk) in source s. */
static uint32_t per_source(const Src *s, uint64_t h, uint32_t sk) {
    if (!s->repeats) return 1;
    const uint64_t *hs = src_hashes(s);
    uint32_t c = 0;
    for (uint32_t j = 0; j < s->size; j++) c += hs[j] == h && src_sk(s, j) == sk;
    return c;
}

/* One sending of source sid: its stores of keys it does not name to foreign;
 * the first time, keys it names held more than once to multi. 0 on OOM. */
static int scan(Walk *w, uint32_t sid, int first) {
    State *st = w->st;
    const Src *s = &st->src[sid];
    const uint64_t *hs = src_hashes(s);
    for (uint32_t j = 0; j < s->size; j++) {
        uint32_t sk = src_sk(s, j);
        Ent *e = tab_find(&st->keys, hs[j], sk);
        if (e == NULL || e->src != sid) {
            int made;
            Ent *f = tab_put(&w->foreign, hs[j], sk, &made);
            if (f == NULL) return 0;
            f->count++;
            if (made) {
                Ent *k = (Ent *)vec_push(&w->fkeys);
                if (k == NULL) return 0;
                *k = *f;
            }
        } else if (first && e->count > 1) {
            Ent *k = (Ent *)vec_push(&w->multi);
            if (k == NULL) return 0;
            *k = *e;
        }
    }
    if (first && s->repeats) {
        uint32_t *p = (uint32_t *)vec_push(&w->repeats);
        if (p == NULL) return 0;
        *p = sid;
    }
    return 1;
}

static uint32_t again_of(Walk *w, uint32_t sid) {
    Ent *e = tab_find(&w->again, sid, 0);
    return e == NULL ? 0 : e->count;
}

static uint32_t foreign_of(Walk *w, uint64_t h, uint32_t sk) {
    Ent *e = tab_find(&w->foreign, h, sk);
    return e == NULL ? 0 : e->count;
}

/* Phase 2's events: the stores too many, per scope, as removals. */
static PyObject *excess(Walk *w) {
    State *st = w->st;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    uint32_t ns = st->nscopes;
    uint32_t *rank = (uint32_t *)malloc((ns + 1) * sizeof(uint32_t));
    uint32_t *order = (uint32_t *)malloc((ns + 1) * sizeof(uint32_t));
    Vec srcs = {NULL, 0, 0, sizeof(uint32_t)};
    Tab seen = {NULL, 0, 0};
    PyObject *hashes = NULL;
    if (rank == NULL || order == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    uint32_t nord = 0;
    for (uint32_t s = 0; s < ns; s++) rank[s] = NIL;
    for (size_t k = 0; k < w->fkeys.n; k++) {
        uint32_t s = VEC_AT(&w->fkeys, Ent, k).sk & ~KFLAGS;
        if (rank[s] == NIL) rank[s] = nord, order[nord++] = s;
    }
    Vec *lists[2] = {&w->again_order, &w->repeats};
    for (int l = 0; l < 2; l++)
        for (size_t k = 0; k < lists[l]->n; k++) {
            uint32_t sid = VEC_AT(lists[l], uint32_t, k);
            uint32_t *p = (uint32_t *)vec_push(&srcs);
            if (p == NULL) {
                PyErr_NoMemory();
                goto fail;
            }
            *p = sid;
            uint32_t s = st->src[sid].scope;
            if (rank[s] == NIL) rank[s] = nord, order[nord++] = s;
        }
    for (uint32_t r = 0; r < nord; r++) {
        uint32_t scope = order[r];
        hashes = PyList_New(0);
        if (hashes == NULL) goto fail;
        /* the scope's keys: its foreign ones, then its again/repeats sources' hashes */
        size_t nf = w->fkeys.n;
        for (size_t k = 0; k < nf + srcs.n; k++) {
            const uint64_t *hs;
            const Src *s = NULL;
            uint32_t cnt;
            uint64_t one;
            uint32_t onesk;
            if (k < nf) {
                Ent *f = &VEC_AT(&w->fkeys, Ent, k);
                if ((f->sk & ~KFLAGS) != scope) continue;
                one = f->h;
                onesk = f->sk;
                hs = &one;
                cnt = 1;
            } else {
                s = &st->src[VEC_AT(&srcs, uint32_t, k - nf)];
                if (s->scope != scope) continue;
                hs = src_hashes(s);
                cnt = s->size;
                onesk = 0;
            }
            for (uint32_t j = 0; j < cnt; j++) {
                uint32_t sk = s == NULL ? onesk : src_sk(s, j);
                int made;
                Ent *x = tab_put(&seen, hs[j], sk, &made);
                if (x == NULL) {
                    PyErr_NoMemory();
                    goto fail;
                }
                if (!made) continue;
                long long stored = foreign_of(w, hs[j], sk);
                Ent *e = tab_find(&st->keys, hs[j], sk);
                if (e != NULL) {
                    const Src *named = &st->src[e->src];
                    stored += (long long)per_source(named, hs[j], sk) * (1 + again_of(w, e->src)) -
                              e->count;
                }
                if (stored <= 0) continue;
                PyObject *obj = key_object(st, hs[j], sk);
                if (obj == NULL) goto fail;
                for (long long c = 0; c < stored; c++)
                    if (PyList_Append(hashes, obj) < 0) {
                        Py_DECREF(obj);
                        goto fail;
                    }
                Py_DECREF(obj);
            }
        }
        PyObject *scope_t = st->scopes[scope];
        Py_ssize_t nh = PyList_GET_SIZE(hashes);
        for (Py_ssize_t a = 0; a < nh; a += w->per_event) {
            Py_ssize_t b = a + w->per_event < nh ? a + w->per_event : nh;
            PyObject *part = PyList_GetSlice(hashes, a, b);
            if (part == NULL) goto fail;
            PyObject *ev = PyObject_CallFunctionObjArgs(
                w->make_removed, part, PyTuple_GET_ITEM(scope_t, 0), PyTuple_GET_ITEM(scope_t, 1),
                PyTuple_GET_ITEM(scope_t, 2), PyTuple_GET_ITEM(scope_t, 3), NULL);
            Py_DECREF(part);
            if (ev == NULL) goto fail;
            int err = PyList_Append(out, ev);
            Py_DECREF(ev);
            if (err < 0) goto fail;
        }
        Py_CLEAR(hashes);
    }
    free(rank);
    free(order);
    vec_free(&srcs);
    tab_free(&seen);
    return out;
fail:
    Py_XDECREF(hashes);
    free(rank);
    free(order);
    vec_free(&srcs);
    tab_free(&seen);
    Py_DECREF(out);
    return NULL;
}

/* The program's next item: 1 an event (*ev a new reference, *ntok its tokens), 2 work
 * (*work hashes looked at), 0 the end, -1 an error. */
static int produce(Walk *w, PyObject **ev, Py_ssize_t *ntok, Py_ssize_t *work) {
    State *st = w->st;
    for (;;) {
        if (w->phase == 0) {
            if (w->cur == NIL) {
                w->phase = 1;
                w->stage = 0;
                w->mi = 0;
                continue;
            }
            Src *s = &st->src[w->cur];
            if (w->stage == 0) {
                w->stage = 1;
                *ev = src_event(s);
                *ntok = s->ntok;
                return *ev == NULL ? -1 : 1;
            }
            if (!scan(w, w->cur, 1)) goto oom;
            *work = s->size;
            w->cur = s->next;
            w->stage = 0;
            return 2;
        }
        if (w->phase == 1) {
            if (w->mi >= w->multi.n) {
                w->phase = 2;
                w->removals = excess(w);
                if (w->removals == NULL) return -1;
                w->ri = 0;
                continue;
            }
            Ent *k = &VEC_AT(&w->multi, Ent, w->mi);
            if (w->stage == 0) {
                w->stage = 1;
                if ((w->mi + 1) % 256 == 0) {
                    *work = 256;
                    return 2;
                }
            }
            if (w->stage == 1) {
                Ent *e = tab_find(&st->keys, k->h, k->sk);
                uint32_t sid = e->src;
                const Src *s = &st->src[sid];
                long long per = per_source(s, k->h, k->sk);
                if (per * (1 + again_of(w, sid)) + foreign_of(w, k->h, k->sk) < e->count) {
                    w->stage = 2;
                    w->msid = sid;
                    *ev = src_event(s);
                    *ntok = s->ntok;
                    return *ev == NULL ? -1 : 1;
                }
                w->mi++;
                w->stage = 0;
                continue;
            }
            /* stage 2: it was sent again */
            int made;
            Ent *a = tab_put(&w->again, w->msid, 0, &made);
            if (a == NULL) goto oom;
            if (a->count++ == 0) {
                uint32_t *p = (uint32_t *)vec_push(&w->again_order);
                if (p == NULL) goto oom;
                *p = w->msid;
            }
            if (!scan(w, w->msid, 0)) goto oom;
            *work = st->src[w->msid].size;
            w->stage = 1;
            return 2;
        }
        if (w->phase == 2) {
            if (w->ri >= PyList_GET_SIZE(w->removals)) {
                w->phase = 3;
                return 0;
            }
            *ev = Py_NewRef(PyList_GET_ITEM(w->removals, w->ri++));
            PyObject *toks = PyObject_GetAttrString(*ev, "token_ids");
            if (toks == NULL) {
                PyErr_Clear();
                *ntok = 0;
            } else {
                *ntok = toks == Py_None ? 0 : PyObject_Length(toks);
                Py_DECREF(toks);
                if (*ntok < 0) {
                    Py_CLEAR(*ev);
                    return -1;
                }
            }
            return 1;
        }
        return 0;
    }
oom:
    PyErr_NoMemory();
    return -1;
}

static void walk_release(Walk *w) {
    tab_free(&w->foreign);
    tab_free(&w->again);
    vec_free(&w->fkeys);
    vec_free(&w->multi);
    vec_free(&w->again_order);
    vec_free(&w->repeats);
    Py_CLEAR(w->removals);
    w->ended = 1;
}

PyDoc_STRVAR(walk_next_doc,
             "next() -> list | None\n\n"
             "The program's next chunk (a list of events, maybe empty), or None at its\n"
             "end.  Raises RuntimeError if the state changed since the walk began.");

static PyObject *Walk_next(Walk *w, PyObject *unused) {
    if (w->ended) Py_RETURN_NONE;
    if (w->st->gen != w->gen || w->st->busy) {
        walk_release(w);
        PyErr_SetString(PyExc_RuntimeError, "the recorder changed during the walk");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    Py_ssize_t tokens = 0, work = 0;
    for (;;) {
        PyObject *ev = NULL;
        Py_ssize_t ntok = 0, n = 0;
        int r = produce(w, &ev, &ntok, &n);
        if (r < 0) {
            Py_DECREF(out);
            walk_release(w);
            return NULL;
        }
        if (r == 0) {
            walk_release(w);
            if (PyList_GET_SIZE(out) > 0) return out;
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        if (r == 2) {
            work += n;
            if (work < w->max_work) continue;
        } else {
            int err = PyList_Append(out, ev);
            Py_DECREF(ev);
            if (err < 0) {
                Py_DECREF(out);
                return NULL;
            }
            tokens += ntok;
            if (PyList_GET_SIZE(out) < w->max_events && tokens < w->max_tokens) continue;
        }
        return out;
    }
}

static PyObject *Walk_close(Walk *w, PyObject *unused) {
    walk_release(w);
    Py_RETURN_NONE;
}

static void Walk_dealloc(Walk *w) {
    walk_release(w);
    Py_XDECREF(w->st);
    Py_XDECREF(w->make_removed);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyMethodDef Walk_methods[] = {
    {"next", (PyCFunction)Walk_next, METH_NOARGS, walk_next_doc},
    {"close", (PyCFunction)Walk_close, METH_NOARGS, "close() -> None: end the walk now."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject Walk_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "coalesce._crecord.Walk",
    .tp_basicsize = sizeof(Walk),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Walk_dealloc,
    .tp_methods = Walk_methods,
    .tp_doc = "A walk of the replay program (State.walk).",
};

PyDoc_STRVAR(walk_doc,
             "walk(max_events, max_tokens, max_work, per_event, make_removed) -> Walk\n\n"
             "The replay program, a chunk per Walk.next(), as Recorder.chunks() cuts it;\n"
             "make_removed(hashes, medium, group_idx, locality, ownership) builds a removal.");

static PyObject *State_walk(State *st, PyObject *args) {
    Py_ssize_t me, mt, mw, pe;
    PyObject *make;
    if (!PyArg_ParseTuple(args, "nnnnO", &me, &mt, &mw, &pe, &make)) return NULL;
    if (!check_free(st)) return NULL;
    if (pe < 1) {
        PyErr_SetString(PyExc_ValueError, "per_event must be positive");
        return NULL;
    }
    Walk *w = PyObject_New(Walk, &Walk_Type);
    if (w == NULL) return NULL;
    w->st = (State *)Py_NewRef(st);
    w->gen = st->gen;
    w->max_events = me;
    w->max_tokens = mt;
    w->max_work = mw;
    w->per_event = pe;
    w->make_removed = Py_NewRef(make);
    w->phase = w->stage = w->ended = 0;
    w->cur = st->head;
    w->mi = 0;
    w->msid = NIL;
    memset(&w->foreign, 0, sizeof(Tab));
    memset(&w->again, 0, sizeof(Tab));
    Vec ent = {NULL, 0, 0, sizeof(Ent)}, u32 = {NULL, 0, 0, sizeof(uint32_t)};
    w->fkeys = w->multi = ent;
    w->again_order = w->repeats = u32;
    w->removals = NULL;
    w->ri = 0;
    return (PyObject *)w;
}

/* ---- the State type ----------------------------------------------------------- */

static void state_init_fields(State *st) {
    memset(&st->keys, 0, sizeof(Tab));
    st->src = NULL;
    st->nsrc_cap = 0;
    st->free_head = st->head = st->tail = NIL;
    st->nsources = 0;
    st->held = st->counts = st->kept = 0;
    st->scopes = NULL;
    st->nscopes = st->scopes_cap = 0;
    st->iobj = NULL;
    st->iref = NULL;
    st->niobj = st->iobj_cap = 0;
    Vec u32 = {NULL, 0, 0, sizeof(uint32_t)};
    st->ifree = st->izero = st->stack = st->depbuf = u32;
    Vec ops = {NULL, 0, 0, sizeof(Op)}, u64 = {NULL, 0, 0, sizeof(uint64_t)};
    Vec u8 = {NULL, 0, 0, 1}, ptr = {NULL, 0, 0, sizeof(PyObject *)};
    st->ops = ops;
    st->hb = u64;
    st->hf = u8;
    st->dead = st->freed = ptr;
    Vec grave = {NULL, 0, 0, sizeof(Grave)};
    st->grave = grave;
    st->oom = st->busy = 0;
    st->gen = 0;
    st->stopped = 0;
    memset(&st->cache, 0, sizeof(st->cache));
    st->cache_next = st->cache_last = 0;
    st->store_ops = st->store_hashes = 0;
    st->nbatches = st->nevents = st->nencoded = 0;
    st->at = 0;
    st->declined = NULL;
    st->out.b = NULL;
    st->out.p = NULL;
    st->out.n = st->out.cap = st->out.hint = 0;
    publish(st);
}

static PyObject *State_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    State *st = (State *)type->tp_alloc(type, 0);
    if (st == NULL) return NULL;
    state_init_fields(st);
    st->scope_ids = PyDict_New();
    st->intern_ids = PyDict_New();
    if (st->scope_ids == NULL || st->intern_ids == NULL) {
        Py_DECREF(st);
        return NULL;
    }
    return (PyObject *)st;
}

static void State_dealloc(State *st) {
    forget(st);
    sweep(st, PY_SSIZE_T_MAX);
    free(st->scopes);
    free(st->iobj);
    free(st->iref);
    vec_free(&st->ifree);
    vec_free(&st->izero);
    vec_free(&st->ops);
    vec_free(&st->hb);
    vec_free(&st->hf);
    vec_free(&st->dead);
    vec_free(&st->freed);
    vec_free(&st->grave);
    vec_free(&st->stack);
    vec_free(&st->depbuf);
    Py_CLEAR(st->out.b);
    Py_XDECREF(st->declined);
    Py_XDECREF(st->scope_ids);
    Py_XDECREF(st->intern_ids);
    Py_TYPE(st)->tp_free((PyObject *)st);
}

static PyMethodDef State_methods[] = {
    {"record", (PyCFunction)(void (*)(void))State_record, METH_FASTCALL, record_doc},
    {"record_batch", (PyCFunction)(void (*)(void))State_record_batch, METH_FASTCALL,
     record_batch_doc},
    {"record_batches", (PyCFunction)(void (*)(void))State_record_batches, METH_FASTCALL,
     record_batches_doc},
    {"encode_record", (PyCFunction)(void (*)(void))State_encode_record, METH_FASTCALL,
     encode_record_doc},
    {"clear", (PyCFunction)State_clear, METH_NOARGS,
     "clear() -> None: forget everything (its events released a slice a later call)."},
    {"sweep", (PyCFunction)State_sweep, METH_O,
     "sweep(budget) -> int: release forgotten events until budget objects (-1: all);\n"
     "the events left to release."},
    {"export", (PyCFunction)State_export, METH_NOARGS, export_doc},
    {"walk", (PyCFunction)State_walk, METH_VARARGS, walk_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef State_getset[] = {
    {"stopped", (getter)State_stopped, NULL, "why the last record() stopped", NULL},
    {"declined", (getter)State_declined, NULL, "the class encode_record() last declined, or None", NULL},
    {"encoded", (getter)State_encoded, NULL, "batches encode_record() took", NULL},
    {"batches", (getter)State_batches, NULL, "batches given to record_batch()", NULL},
    {"at", (getter)State_at, NULL, "the batch record_batches() was at", NULL},
    {"events", (getter)State_events, NULL, "their events", NULL},
    {"held", (getter)State_held, NULL, "keys held", NULL},
    {"counts", (getter)State_counts, NULL, "the counts' sum", NULL},
    {"kept", (getter)State_kept, NULL, "the kept sources' hashes", NULL},
    {"sources", (getter)State_sources, NULL, "kept sources", NULL},
    {"nbytes", (getter)State_nbytes, NULL, "bytes of C memory (table, sources)", NULL},
    {"graveyard", (getter)State_graveyard, NULL, "forgotten events not yet released", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject State_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "coalesce._crecord.State",
    .tp_basicsize = sizeof(State),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = State_new,
    .tp_dealloc = (destructor)State_dealloc,
    .tp_methods = State_methods,
    .tp_getset = State_getset,
    .tp_doc = "The recorder's state in C (see coalesce/_crecord.c).",
};

/* ---- registration -------------------------------------------------------------- */

PyDoc_STRVAR(register_doc,
             "register(cls, kind) -> bool\n\n"
             "Record a class's kind and the slot offsets of the fields the loop reads.\n"
             "A store or removal class whose fields are not all slots it can read (a\n"
             "required one missing) is registered as UNREADABLE: the loop hands its\n"
             "events to the Python recorder.  False when the table of classes is full.");

static PyObject *cr_register(PyObject *self, PyObject *args) {
    PyObject *cls;
    int kind;
    if (!PyArg_ParseTuple(args, "O!i", &PyType_Type, &cls, &kind)) return NULL;
    PyTypeObject *tp = (PyTypeObject *)cls;
    if (find_type(tp) != NULL) Py_RETURN_TRUE;
    if (g_ntypes >= MAX_TYPES) Py_RETURN_FALSE;
    TypeInfo ti;
    memset(&ti, 0, sizeof(ti));
    ti.kind = kind < 0 || kind > UNREADABLE ? K_OPAQUE : kind;
    for (int f = 0; f < NF; f++) {
        ti.off[f] = -1;
        if (ti.kind != K_STORED && ti.kind != K_REMOVED) continue;
        PyObject *name = PyUnicode_InternFromString(FIELD_NAMES[f]);
        if (name == NULL) return NULL;
        int has = PyObject_HasAttr(cls, name);
        ti.off[f] = member_offset(tp, name);
        Py_DECREF(name);
        if (has && ti.off[f] < 0) ti.kind = UNREADABLE; /* a field, but not a slot */
    }
    if (ti.kind == K_STORED && (ti.off[F_HASHES] < 0 || ti.off[F_PARENT] < 0)) ti.kind = UNREADABLE;
    if (ti.kind == K_REMOVED && ti.off[F_HASHES] < 0) ti.kind = UNREADABLE;
    Py_INCREF(tp);
    ti.type = tp;
    g_types[g_ntypes++] = ti;
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(set_raw_type_doc,
             "set_raw_type(cls) -> None\n\n"
             "msgspec.Raw: the type whose lists (a msgpack array of ints or bins, as\n"
             "compact_for_wire() writes them) the loop reads as hash and token lists.");

static PyObject *cr_set_raw_type(PyObject *self, PyObject *cls) {
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "set_raw_type(cls: type)");
        return NULL;
    }
    Py_XSETREF(g_raw_type, (PyTypeObject *)Py_NewRef(cls));
    Py_RETURN_NONE;
}

static PyObject *cr_set_nogil_from(PyObject *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t was = g_nogil_from;
    g_nogil_from = n;
    return PyLong_FromSsize_t(was);
}

static PyObject *cr_set_encoded_max(PyObject *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n > (Py_ssize_t)UINT32_MAX) n = (Py_ssize_t)UINT32_MAX;
    Py_ssize_t was = g_encoded_max;
    g_encoded_max = n;
    return PyLong_FromSsize_t(was);
}

static PyMethodDef methods[] = {
    {"register", cr_register, METH_VARARGS, register_doc},
    {"set_layout", cr_set_layout, METH_VARARGS, set_layout_doc},
    {"register_batch", cr_register_batch, METH_O, register_batch_doc},
    {"set_raw_type", cr_set_raw_type, METH_O, set_raw_type_doc},
    {"set_nogil_from", cr_set_nogil_from, METH_O,
     "set_nogil_from(n) -> int: release the GIL for calls of n hashes or more (-1:\n"
     "never); the previous setting (for benchmarks)."},
    {"set_encoded_max", cr_set_encoded_max, METH_O,
     "set_encoded_max(n) -> int: encode_record() keeps a store whose encoding takes\n"
     "n bytes or fewer as that (0: none), else its event; the previous setting (for\n"
     "benchmarks and tests)."},
    CSTRUCT_METHODS{NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "coalesce._crecord",
    "The snapshot recorder's state and loop (coalesce/_recorder.py: the semantics and the "
    "oracle).",
    sizeof(CStructState), methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__crecord(void) {
    s_events = PyUnicode_InternFromString("events");
    if (s_events == NULL) return NULL;
    if (PyType_Ready(&State_Type) < 0 || PyType_Ready(&Walk_Type) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    g_cs = (CStructState *)PyModule_GetState(m);
    if (PyModule_AddObjectRef(m, "State", (PyObject *)&State_Type) < 0 ||
        PyModule_AddObjectRef(m, "Walk", (PyObject *)&Walk_Type) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
