/* The compactor's rules 2, 3, 5 and 6 in C: an optional accelerator.
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
 * What it accepts (anything else returns None before any output is built):
 * events of registered classes (register(): BlockStored, BlockRemoved,
 * AllBlocksCleared-like msgspec structs with no __post_init__); lists for the
 * per-block fields; block hashes and parents that are exact ints in [0, 2**64)
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
    PyObject *b; /* NULL for an int; the bytes object otherwise (borrowed) */
    int32_t id;
    uint32_t gen; /* the slot is in use when gen == the table's gen */
} Slot;

/* Lives across calls (static, guarded by g_busy): a fresh calloc per window
 * costs more in page faults than the rules themselves.  Emptied in O(1) by
 * bumping its generation. */
typedef struct {
    Slot *s;
    size_t mask;
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

/* Empty `t` and make room for n keys at load <= 1/2.  0 on memory error. */
static int table_init(Table *t, Py_ssize_t n) {
    size_t cap = 16;
    while (cap < (size_t)n * 2 + 16) cap <<= 1;
    if (t->s == NULL || t->mask + 1 < cap) {
        free(t->s);
        t->s = (Slot *)calloc(cap, sizeof(Slot));
        if (t->s == NULL) return 0;
        t->mask = cap - 1;
        t->gen = 1;
        return 1;
    }
    if (++t->gen == 0) { /* wrapped: clear for real, once per 2**32 calls */
        memset(t->s, 0, (t->mask + 1) * sizeof(Slot));
        t->gen = 1;
    }
    return 1;
}

static void table_trim(Table *t) {
    if ((t->mask + 1) * sizeof(Slot) > KEEP_BYTES) {
        free(t->s);
        t->s = NULL;
        t->mask = 0;
    }
}

/* The id of hash `h` (assigning the next one if new); -1 to decline the value. */
static inline int32_t hash_id(Table *t, PyObject *h, int32_t *next) {
    uint64_t v;
    PyObject *b = NULL;
    if (PyLong_CheckExact(h)) {
        if (!long_u64(h, &v)) return -1;
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
    size_t i = (size_t)mix64(v) & t->mask;
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
            if (b == NULL && s->b == NULL) return s->id;
            if (b != NULL && s->b != NULL &&
                (b == s->b || (PyBytes_GET_SIZE(b) == PyBytes_GET_SIZE(s->b) &&
                               memcmp(PyBytes_AS_STRING(b), PyBytes_AS_STRING(s->b),
                                      (size_t)PyBytes_GET_SIZE(b)) == 0)))
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

static Table g_ids;
static struct {
    Buf src, hids, op_idx, op_pos, op_prior, op_sure, alive, dead, items_a, items_b;
    Buf last_op, last_child, by_hash, by_key, removed;
} g_bufs;
static Desc g_descs[MAX_DESCS];
static SegVec g_segs_a, g_segs_b;
static int g_busy = 0; /* a call is under way (re-entered through GC, say): decline */

static void segvec_trim(SegVec *v) {
    if ((size_t)v->cap * sizeof(Seg) > KEEP_BYTES) {
        free(v->v);
        v->v = NULL;
        v->cap = 0;
    }
}

static void trim_all(void) {
    table_trim(&g_ids);
    Buf *bufs = (Buf *)&g_bufs;
    for (size_t i = 0; i < sizeof(g_bufs) / sizeof(Buf); i++) buf_trim(&bufs[i]);
    segvec_trim(&g_segs_a);
    segvec_trim(&g_segs_b);
    for (int j = 0; j < MAX_DESCS; j++) segvec_trim(&g_descs[j].segs);
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

/* Read every event of `events` into w.  1 on success, 0 to decline, -1 on error. */
static int read_window(PyObject *events, Window *w, PyTypeObject **unknown) {
    Py_ssize_t n = PyList_GET_SIZE(events);
    Py_ssize_t total = 0;
    w->nsrc = n;
    w->src = (Src *)buf_get(&g_bufs.src, (size_t)n * sizeof(Src));
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
    w->hids = (int32_t *)buf_get(&g_bufs.hids, (size_t)total * sizeof(int32_t));
    if (w->hids == NULL || !table_init(&g_ids, total)) return -1;
    w->nkeys = total;
    Py_ssize_t k = 0;
    int32_t next = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Src *s = &w->src[i];
        TypeInfo *ti = s->ti;
        if (s->kind == K_CLEARED) continue;
        PyObject *ev = s->ev;
        PyObject *hashes = FIELD(ev, ti->off_hashes);
        s->h0 = k;
        for (Py_ssize_t j = 0; j < s->n; j++) {
            int32_t id = hash_id(&g_ids, PyList_GET_ITEM(hashes, j), &next);
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
        uint32_t pair = ((uint32_t)mid << 8) | (uint32_t)gid;
        int mg = 0;
        while (mg < w->nmg && w->mgs[mg] != pair) mg++;
        if (mg == w->nmg) {
            if (w->nmg == MAX_MG) return 0;
            w->mgs[w->nmg++] = pair;
        }
        s->mg = mg;
        if (s->kind != K_STORED) continue;
        if (s->n == 0) return 0;
        PyObject *parent = FIELD(ev, ti->off_parent);
        if (parent == NULL) return 0;
        if (parent != Py_None) {
            s->parent = hash_id(&g_ids, parent, &next);
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
        for (int o = 0; o < 2; o++) {
            if (offs[o] < 0) continue;
            PyObject *per = FIELD(ev, offs[o]);
            if (per == NULL || !list_or_none(per)) return 0;
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

/* Fields a merge requires equal (identity, then ==; all atomic, so no Python code runs). */
static int attrs_equal(const Src *a, const Src *b) {
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

static inline int per_none(const Src *s, Py_ssize_t off) {
    return off < 0 || FIELD(s->ev, off) == Py_None;
}

/* ---- rule 3: cancel ------------------------------------------------------- */

/* Items for srcs [first, nsrc) after rule 3.  Returns 1, or -1 on memory error. */
static int rule_cancel(Window *w, Py_ssize_t first, Item *items, Py_ssize_t *nitems, SegVec *segs,
                       long *cancelled) {
    Py_ssize_t n = w->nsrc, H = w->nkeys, NK = (Py_ssize_t)w->nids * w->nmg;
    int32_t *op_idx = (int32_t *)buf_get(&g_bufs.op_idx, (size_t)H * sizeof(int32_t));
    int32_t *op_pos = (int32_t *)buf_get(&g_bufs.op_pos, (size_t)H * sizeof(int32_t));
    int64_t *op_prior = (int64_t *)buf_get(&g_bufs.op_prior, (size_t)H * sizeof(int64_t));
    char *op_sure = (char *)buf_get(&g_bufs.op_sure, (size_t)H);
    int32_t *alive = (int32_t *)buf_get(&g_bufs.alive, (size_t)n * sizeof(int32_t));
    char *dead = (char *)buf_get(&g_bufs.dead, (size_t)H);
    /* the latest op on each key: an op index, -2 for a removal, -1 for none */
    int64_t *last_op = (int64_t *)buf_get(&g_bufs.last_op, (size_t)NK * sizeof(int64_t));
    /* the latest store naming each hash as its parent, -1 for none */
    int32_t *last_child = (int32_t *)buf_get(&g_bufs.last_child, (size_t)w->nids * sizeof(int32_t));
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
    Desc *descs = g_descs;
    for (int j = 0; j < MAX_DESCS; j++) {
        descs[j].held = 0;
        descs[j].segs.n = 0;
    }
    Py_ssize_t NK = (Py_ssize_t)w->nids * w->nmg;
    Held h;
    h.by_hash = (uint64_t *)buf_get(&g_bufs.by_hash, (size_t)w->nids * sizeof(uint64_t));
    h.by_key = (uint64_t *)buf_get(&g_bufs.by_key, (size_t)NK * sizeof(uint64_t));
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
                if (attrs_equal(&w->src[descs[j].base], base)) {
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
        } else { /* a store: one segment (src, 0, keep) */
            uint64_t conflict = 0;
            const Seg g = insegs->v[it->seg0];
            if (held_mask) {
                if (base->parent >= 0) conflict |= h.by_hash[base->parent];
                const int32_t *hids = w->hids + base->h0;
                for (int32_t p = g.start; p < g.end; p++)
                    conflict |= h.by_key[KID(w, hids[p], base->mg)];
                conflict &= held_mask;
            }
            if (conflict) {
                if (flush_mask(w, descs, conflict, &h, in, out, nout, outsegs, merged) < 0)
                    return -1;
                held_mask &= ~conflict;
            }
            if (!put_item(&out[(*nout)++], it, &g, 1, outsegs)) return -1;
        }
    }
    return flush_mask(w, descs, held_mask, &h, in, out, nout, outsegs, merged);
}

/* ---- rule 6: chains ------------------------------------------------------- */

static int rule_chain(Window *w, const Item *in, Py_ssize_t nin, const SegVec *insegs, Item *out,
                      Py_ssize_t *nout, SegVec *outsegs, long *merged) {
    char *removed = (char *)buf_get(&g_bufs.removed, (size_t)w->nids);
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
            const Seg g = insegs->v[it->seg0];
            if (chain != NULL && chain_ok && s->ti == first->ti && s->parent >= 0 &&
                s->parent == last && s->tok_nonempty == first->tok_nonempty && s->splittable &&
                per_none(s, s->ti->off_extra) == per_none(first, first->ti->off_extra) &&
                per_none(s, s->ti->off_look) == per_none(first, first->ti->off_look) &&
                attrs_equal(first, s)) {
                if (!segvec_push(outsegs, g.src, g.start, g.end)) return -1;
                chain->nseg++;
                chain->changed = 1;
                last = w->hids[s->h0 + g.end - 1];
                (*merged)++;
                continue;
            }
            chain = &out[m++];
            if (!put_item(chain, it, &g, 1, outsegs)) return -1;
            first = s;
            last = w->hids[s->h0 + g.end - 1];
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

/* ---- building the events -------------------------------------------------- */

/* The concatenation of lst[start*k : end*k] over the item's segments, for the
 * list field at `off` of each segment's source. */
static PyObject *concat_field(Window *w, const SegVec *segs, const Item *it, Py_ssize_t off,
                              int tokens) {
    Py_ssize_t total = 0;
    for (Py_ssize_t q = 0; q < it->nseg; q++) {
        Seg g = segs->v[it->seg0 + q];
        Py_ssize_t k = tokens ? w->src[g.src].bs : 1;
        if (tokens && !w->src[g.src].tok_nonempty) k = 0;
        total += (g.end - g.start) * k;
    }
    PyObject *out = PyList_New(total);
    if (out == NULL) return NULL;
    Py_ssize_t at = 0;
    for (Py_ssize_t q = 0; q < it->nseg; q++) {
        Seg g = segs->v[it->seg0 + q];
        const Src *s = &w->src[g.src];
        Py_ssize_t k = tokens ? s->bs : 1;
        if (tokens && !s->tok_nonempty) continue;
        PyObject *lst = FIELD(s->ev, off);
        /* Checked again: allocations above may run a finalizer, which may run any code. */
        if (lst == NULL || !PyList_CheckExact(lst) || PyList_GET_SIZE(lst) < g.end * k) {
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

static PyObject *build_item(Window *w, const SegVec *segs, const Item *it) {
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
    if (set_field(obj, ti->off_hashes, concat_field(w, segs, it, ti->off_hashes, 0)) < 0)
        goto fail;
    if (it->kind == K_STORED) {
        if (base->tok_nonempty &&
            set_field(obj, ti->off_tokens, concat_field(w, segs, it, ti->off_tokens, 1)) < 0)
            goto fail;
        if (!per_none(base, ti->off_extra) &&
            set_field(obj, ti->off_extra, concat_field(w, segs, it, ti->off_extra, 0)) < 0)
            goto fail;
        if (!per_none(base, ti->off_look) &&
            set_field(obj, ti->off_look, concat_field(w, segs, it, ti->off_look, 0)) < 0)
            goto fail;
    }
    return obj;
fail:
    Py_DECREF(obj);
    return NULL;
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
             "Rules 2, 3, 5 and 6 of coalesce.compactor on one folded group's events (a\n"
             "list), exactly as _compact_events computes them without moves.  Returns a\n"
             "class that is not registered yet (register it and call again), or None\n"
             "for a window this accelerator declines.  O(events + block hashes).");

static PyObject *cc_compact_events(PyObject *self, PyObject *events) {
    if (!PyList_CheckExact(events) || g_busy) Py_RETURN_NONE;
    g_busy = 1;
    Window w;
    memset(&w, 0, sizeof(w));
    Item *a = NULL, *b = NULL;
    SegVec sa = g_segs_a, sb = g_segs_b;
    sa.n = sb.n = 0;
    PyObject *result = NULL;
    PyTypeObject *unknown = NULL;
    long cancelled = 0, merged = 0;
    int r = read_window(events, &w, &unknown);
    if (r < 0) {
        PyErr_NoMemory();
        goto done;
    }
    if (r == 0) {
        if (unknown != NULL) {
            Py_INCREF(unknown);
            result = (PyObject *)unknown;
        } else {
            Py_INCREF(Py_None);
            result = Py_None;
        }
        goto done;
    }
    Py_ssize_t n = w.nsrc, last_clear = -1;
    for (Py_ssize_t i = n - 1; i >= 0; i--)
        if (w.src[i].kind == K_CLEARED) {
            last_clear = i;
            break;
        }
    long superseded = last_clear > 0 ? (long)last_clear : 0;
    a = (Item *)buf_get(&g_bufs.items_a, (size_t)n * sizeof(Item));
    b = (Item *)buf_get(&g_bufs.items_b, (size_t)n * sizeof(Item));
    if (a == NULL || b == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t na = 0, nb = 0;
    if (rule_cancel(&w, last_clear + 1, a, &na, &sa, &cancelled) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    r = rule_sink(&w, a, na, &sa, b, &nb, &sb, &merged);
    if (r <= 0) {
        if (r < 0)
            PyErr_NoMemory();
        else {
            Py_INCREF(Py_None);
            result = Py_None;
        }
        goto done;
    }
    sa.n = 0;
    if (rule_chain(&w, b, nb, &sb, a, &na, &sa, &merged) < 0) {
        PyErr_NoMemory();
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
        PyObject *ev = build_item(&w, &sa, &a[i]);
        if (ev == NULL) {
            Py_DECREF(out);
            goto done;
        }
        PyList_SET_ITEM(out, head + i, ev);
    }
    result = Py_BuildValue("(Nlll)", out, superseded, cancelled, merged);
done:
    g_segs_a = sa;
    g_segs_b = sb;
    trim_all();
    g_busy = 0;
    return result;
}

PyDoc_STRVAR(all_known_doc,
             "all_known(events) -> True | None\n\n"
             "True when every event of the list is of a class registered with a kind\n"
             "this accelerator handles; None otherwise (the caller decides).  O(events).");

static PyObject *cc_all_known(PyObject *self, PyObject *events) {
    if (!PyList_CheckExact(events)) Py_RETURN_NONE;
    PyTypeObject *last = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
        PyTypeObject *tp = Py_TYPE(PyList_GET_ITEM(events, i));
        if (tp == last) continue;
        TypeInfo *ti = find_type(tp);
        if (ti == NULL || ti->kind == K_OPAQUE) Py_RETURN_NONE;
        last = tp;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef cc_methods[] = {
    {"all_known", cc_all_known, METH_O, all_known_doc},
    {"register", cc_register, METH_VARARGS, register_doc},
    {"compact_events", cc_compact_events, METH_O, compact_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef cc_module = {
    PyModuleDef_HEAD_INIT, "coalesce._ccompact",
    "Optional C accelerator for coalesce.compactor (see the C source's header).", -1,
    cc_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ccompact(void) {
    s_copy = PyUnicode_InternFromString("__copy__");
    if (s_copy == NULL) return NULL;
    return PyModule_Create(&cc_module);
}
