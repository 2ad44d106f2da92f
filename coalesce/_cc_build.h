/* Building the result events: a __copy__ of each changed event's source
 * with its per-block lists concatenated, or (compact_window(wire=True))
 * written as their msgpack encoding.
 *
 * Part of coalesce/_ccompact.c, which includes it once (a single
 * translation unit, so that the rules inline): not a header of its own. */

/* ---- building the events -------------------------------------------------- */

/* Elements in an item's per-block field: its segments' blocks, times block_size
 * for token ids (0 for a source without them). */
static Py_ssize_t concat_len(const Window *w, const SegVec *segs, const Item *it, int tokens) {
    Py_ssize_t total = 0;
    for (Py_ssize_t q = 0; q < it->nseg; q++) {
        Seg g = segs->v[it->seg0 + q];
        total += (g.end - g.start) * per_block_k(&w->src[g.src], tokens);
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
        Py_ssize_t k = per_block_k(&w->src[g.src], tokens);
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
    PyObject *obj = PyObject_CallMethodNoArgs(base->ev, w->reg->s_copy);
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

/* Elements below which a list is built all the same: a bytes object and a Raw
 * cost more than a short list and its encoding. */
#define WIRE_MIN 32

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
    unsigned char *p = put_header(d, MP_ARRAY, (size_t)total);
    Py_ssize_t left = total;
    for (Py_ssize_t q = 0; q < it->nseg; q++) {
        Seg g = segs->v[it->seg0 + q];
        Py_ssize_t k = per_block_k(&w->src[g.src], tokens);
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
            p = put_header(d + at, MP_BIN, n);
            memcpy(p, PyBytes_AS_STRING(x), n);
            p += n;
        }
    }
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)d, (Py_ssize_t)(p - d));
    if (bytes == NULL) return NULL;
    PyObject *raw = PyObject_CallOneArg(w->reg->raw_type, bytes);
    Py_DECREF(bytes);
    return raw;
}
