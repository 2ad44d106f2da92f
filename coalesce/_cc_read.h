/* The window, read once from the event objects: each event's fields at
 * their msgspec slot offsets, its hashes as ids; and the one comparison of
 * Python values the rules make (attrs_equal).
 *
 * Part of coalesce/_ccompact.c, which includes it once (a single
 * translation unit, so that the rules inline): not a header of its own. */

/* ---- the window, read once ------------------------------------------------ */

typedef struct {
    PyObject *ev; /* borrowed from the input list */
    const TypeInfo *ti;
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

/* Everything one call works in, in the module's state.  Kept across calls (a
 * fresh allocation per window cost more in page faults than the rules).
 * `busy` (read and set with the GIL held) makes a call that finds its state
 * in use decline. */
typedef struct {
    Table ids;
    struct {
        Buf src, hids, op_idx, op_pos, op_prior, op_sure, alive, dead, items_a, items_b;
        Buf last_op, last_child, by_hash, by_key, removed;
        Buf g_key_any, g_key_store, g_hash_any, g_parent_of, g_chain_end, g_groups, g_next;
        Buf key_rem, key_sure; /* rules 5a and 6: a key's latest removal, certain store */
        Buf wire; /* compact_window(wire=True): one per-block array's encoding */
    } bufs;
    Desc descs[MAX_DESCS];
    SegVec segs_a, segs_b;
    int busy;
} State;

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

/* Items per block in src s's block_hashes (1) or, with `tokens`, its token_ids
 * (block_size, or 0 for a source without them). */
static inline Py_ssize_t per_block_k(const Src *s, int tokens) {
    if (!tokens) return 1;
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
    State *st;           /* the module's buffers */
    const Registry *reg; /* the module's classes */
    int certain;         /* chains start only on a certainly held parent (parentless copies) */
} Window;

#define KID(w, hid, mg) ((Py_ssize_t)(hid) * (w)->nmg + (mg))

static const TypeInfo *find_type(const Registry *reg, PyTypeObject *tp) {
    for (int i = 0; i < reg->ntypes; i++)
        if (reg->types[i].type == tp) return &reg->types[i];
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
    const TypeInfo *ti = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ev = PyList_GET_ITEM(events, i);
        if (ti == NULL || ti->type != Py_TYPE(ev)) ti = find_type(w->reg, Py_TYPE(ev));
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
        const TypeInfo *ti = s->ti;
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
