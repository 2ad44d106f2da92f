/* Rules 3, 5a, 5 and 6 on the records read_window made: plain arrays and
 * ids, no Python API (fields compare through attrs_equal).
 *
 * Part of coalesce/_ccompact.c, which includes it once (a single
 * translation unit, so that the rules inline): not a header of its own. */

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
    char sure; /* a chain every model accepts: its first parent is certainly held */
} Group;

/* A store under `parent` (a hash id, -1 for none) in medium and group `mg` is
 * accepted by every model from every state: no parent, or a certain store of
 * the parent's key later than every removal of it (coalesce._rules._sure_parent). */
static inline int sure_parent(const Window *w, int32_t parent, int32_t mg, const int32_t *key_sure,
                              const int32_t *key_rem) {
    if (parent < 0) return 1;
    Py_ssize_t kid = KID(w, parent, mg);
    return key_sure[kid] > key_rem[kid];
}

/* Whether a chain may start on store s (`sure`: its parent certainly held; `removed`:
 * hashes removed earlier in the window): rules 5a and 6 alike
 * (coalesce._rules._chain_may_start). */
static inline int chain_may_start(const Window *w, const Src *s, int sure, const char *removed) {
    return s->splittable && (sure || (!w->certain && !(s->parent >= 0 && removed[s->parent])));
}

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

/* Rule 5a (coalesce._rules._gather): each item joins the latest group it
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
    int32_t *key_rem = (int32_t *)buf_get(&st->bufs.key_rem, (size_t)NK * sizeof(int32_t));
    int32_t *key_sure = (int32_t *)buf_get(&st->bufs.key_sure, (size_t)NK * sizeof(int32_t));
    Group *groups = (Group *)buf_get(&st->bufs.g_groups, (size_t)(nin ? nin : 1) * sizeof(Group));
    int32_t *next_item = (int32_t *)buf_get(&st->bufs.g_next, (size_t)(nin ? nin : 1) * sizeof(int32_t));
    if (!key_any || !key_store || !chain_end || !hash_any || !parent_of || !removed || !key_rem ||
        !key_sure || !groups || !next_item)
        return -1;
    memset(key_any, 0xff, (size_t)NK * sizeof(int32_t));
    memset(key_store, 0xff, (size_t)NK * sizeof(int32_t));
    memset(chain_end, 0xff, (size_t)NK * sizeof(int32_t));
    memset(hash_any, 0xff, (size_t)U * sizeof(int32_t));
    memset(parent_of, 0xff, (size_t)U * sizeof(int32_t));
    memset(removed, 0, (size_t)U);
    memset(key_rem, 0xff, (size_t)NK * sizeof(int32_t));
    memset(key_sure, 0xff, (size_t)NK * sizeof(int32_t));
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
                if (attrs_equal(&w->src[desc_base[k]], s)) {
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
                    key_rem[kid] = max32(key_rem[kid], j);
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
                   s->look_none == first->look_none && attrs_equal(first, s);
        }
        if (join) {
            group_join(groups, next_item, j, i);
        } else {
            j = group_start(groups, &ng, i);
            int sure = sure_parent(w, s->parent, s->mg, key_sure, key_rem);
            groups[j].sure = (char)sure;
            groups[j].chain_ok = (char)chain_may_start(w, s, sure, removed);
        }
        for (int32_t p = g.start; p < g.end; p++) {
            Py_ssize_t kid = KID(w, hids[p], s->mg);
            key_any[kid] = max32(key_any[kid], j);
            key_store[kid] = max32(key_store[kid], j);
            if (groups[j].sure) key_sure[kid] = j; /* j > key_any[kid] before this store */
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

/* Marks every block of item `it` (a store's, or a chain's of rule 5a) as certainly
 * stored at position `i`. */
static inline void mark_sure(const Window *w, const Item *it, const Seg *gs, int32_t *key_sure,
                             int32_t i) {
    int32_t mg = w->src[it->base].mg;
    for (Py_ssize_t q = 0; q < it->nseg; q++) {
        const int32_t *hids = w->hids + w->src[gs[q].src].h0;
        for (int32_t p = gs[q].start; p < gs[q].end; p++) key_sure[KID(w, hids[p], mg)] = i;
    }
}

static int rule_chain(Window *w, const Item *in, Py_ssize_t nin, const SegVec *insegs, Item *out,
                      Py_ssize_t *nout, SegVec *outsegs, long *merged) {
    Py_ssize_t NK = (Py_ssize_t)w->nids * w->nmg;
    char *removed = (char *)buf_get(&w->st->bufs.removed, (size_t)w->nids);
    int32_t *key_rem = (int32_t *)buf_get(&w->st->bufs.key_rem, (size_t)NK * sizeof(int32_t));
    int32_t *key_sure = (int32_t *)buf_get(&w->st->bufs.key_sure, (size_t)NK * sizeof(int32_t));
    if (removed == NULL || key_rem == NULL || key_sure == NULL) return -1;
    memset(removed, 0, (size_t)w->nids);
    memset(key_rem, 0xff, (size_t)NK * sizeof(int32_t));
    memset(key_sure, 0xff, (size_t)NK * sizeof(int32_t));
    Py_ssize_t m = 0;
    Item *chain = NULL; /* the item being built in out[] */
    int chain_ok = 0, chain_sure = 0;
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
                attrs_equal(first, s)) {
                for (Py_ssize_t q = 0; q < it->nseg; q++)
                    if (!segvec_push(outsegs, gs[q].src, gs[q].start, gs[q].end)) return -1;
                chain->nseg += it->nseg;
                chain->changed = 1;
                last = tail;
                (*merged)++;
                if (chain_sure) mark_sure(w, it, gs, key_sure, (int32_t)i);
                continue;
            }
            chain = &out[m++];
            if (!put_item(chain, it, gs, it->nseg, outsegs)) return -1;
            first = s;
            last = tail;
            chain_sure = sure_parent(w, s->parent, s->mg, key_sure, key_rem);
            chain_ok = chain_may_start(w, s, chain_sure, removed);
            if (chain_sure) mark_sure(w, it, gs, key_sure, (int32_t)i);
            continue;
        }
        chain = NULL;
        if (!put_item(&out[m++], it, &insegs->v[it->seg0], it->nseg, outsegs)) return -1;
        for (Py_ssize_t q = 0; q < it->nseg; q++) {
            Seg g = insegs->v[it->seg0 + q];
            const int32_t *hids = w->hids + w->src[g.src].h0;
            for (int32_t p = g.start; p < g.end; p++) {
                removed[hids[p]] = 1;
                key_rem[KID(w, hids[p], s->mg)] = (int32_t)i;
            }
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
