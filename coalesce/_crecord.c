/* The snapshot recorder's loop in C: Recorder.record's steps for stores and
 * removals, on the recorder's own dicts and lists (coalesce/_recorder.py
 * holds the state, the Python loop that is this one's oracle, and the docs).
 *
 * record(events, i, kinds, live, sources, refs, unused, n) -> int
 *   events:  a list of event objects; applied from index i on.
 *   kinds:   {class: kind} (STORED 0, REMOVED 1, CLEARED 2, MOVED 3, OTHER 4).
 *   live:    {scope: {hash: source id << 32 | count}}, scope a 4-tuple.
 *   sources: {source id: (event, scope, deps, tokens, size)}.
 *   refs:    {source id: keys naming it + dependants}.
 *   unused:  the ids whose refs fell to 0 (collected by the caller).
 *   n:       [next id, keys held, counts' sum, kept sources' hashes].
 * Returns the index of the first event it did not apply: len(events) when
 * done, or an event of a class not in `kinds`, a clear or a move (the caller
 * applies that one and calls again), or a store when the next source id
 * reaches 2**31 (the caller renumbers the sources first).  OTHER events are skipped.  Raises what
 * the Python loop would raise for an event it cannot interpret (an
 * unhashable hash, a hash list that is not a sequence); the caller then
 * forgets the whole state, so a half-applied event is never used.
 *
 * collect(sources, refs, unused, n) -> None: Recorder._collect's loop.
 *
 * Fields are read by name (PyObject_GetAttr), never at slot offsets: nothing
 * here assumes a layout.  References taken from a container are held across
 * any call that could run Python code (a caller's attribute or __eq__).
 * O(hashes of the events), plus O(scopes) per parent or token lookup
 * outside the store's scope. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

enum { STORED = 0, REMOVED = 1, CLEARED = 2, MOVED = 3, OTHER = 4 };
enum { EVENT, SCOPE, DEPS, TOKENS, SIZE };
enum { NEXT, HELD, COUNTS, KEPT };
#define SHIFT 32
#define COUNT_MASK 0xffffffffLL
#define MAX_ID (1LL << 31)

static PyObject *s_medium, *s_group_idx, *s_locality, *s_ownership;
static PyObject *s_block_hashes, *s_parent_block_hash, *s_token_ids;

/* getattr(o, name, None): a new reference, or NULL on an error other than a
 * missing attribute. */
static PyObject *attr_or_none(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        v = Py_NewRef(Py_None);
    }
    return v;
}

/* The last scope looked up in one record() call: its four field values (compared
 * by identity: an event of the same scope usually holds the very same objects),
 * the scope tuple and its table (NULL: none yet).  All references owned.  A
 * table is never dropped from `live` during a call, so a cached one stays valid. */
typedef struct {
    PyObject *attrs[4], *scope, *table;
} Cache;

static void cache_clear(Cache *c) {
    for (int k = 0; k < 4; k++) Py_CLEAR(c->attrs[k]);
    Py_CLEAR(c->scope);
    Py_CLEAR(c->table);
}

/* The table of `ev`'s scope (a borrowed reference, owned by the cache), created
 * in `live` if `create`; NULL with no error when there is none.  *scope: the
 * scope tuple (borrowed, owned by the cache).  NULL with an error on failure. */
static PyObject *table_of(PyObject *ev, PyObject *live, Cache *c, int create,
                          PyObject **scope) {
    PyObject *names[4] = {s_medium, s_group_idx, s_locality, s_ownership};
    PyObject *a[4];
    int same = c->scope != NULL;
    for (int k = 0; k < 4; k++) {
        a[k] = attr_or_none(ev, names[k]);
        if (a[k] == NULL) {
            while (k--) Py_DECREF(a[k]);
            return NULL;
        }
        same = same && a[k] == c->attrs[k];
    }
    if (!same) {
        PyObject *t = PyTuple_New(4);
        if (t == NULL) {
            for (int k = 0; k < 4; k++) Py_DECREF(a[k]);
            return NULL;
        }
        for (int k = 0; k < 4; k++) PyTuple_SET_ITEM(t, k, Py_NewRef(a[k]));
        PyObject *table = PyDict_GetItemWithError(live, t);
        if (table == NULL && PyErr_Occurred()) {
            Py_DECREF(t);
            for (int k = 0; k < 4; k++) Py_DECREF(a[k]);
            return NULL;
        }
        cache_clear(c);
        for (int k = 0; k < 4; k++) c->attrs[k] = Py_NewRef(a[k]);
        c->scope = t;
        c->table = Py_XNewRef(table);
    }
    for (int k = 0; k < 4; k++) Py_DECREF(a[k]);
    if (c->table == NULL && create) {
        PyObject *table = PyDict_New();
        if (table == NULL) return NULL;
        if (PyDict_SetItem(live, c->scope, table) < 0) {
            Py_DECREF(table);
            return NULL;
        }
        c->table = table;
    }
    *scope = c->scope;
    return c->table;
}

/* refs[sid] += delta; the new value in *now.  -1 on an error (a missing id). */
static int add_refs(PyObject *refs, PyObject *sid, long long delta, long long *now) {
    PyObject *v = PyDict_GetItemWithError(refs, sid);
    if (v == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "a key names no kept source");
        return -1;
    }
    long long r = PyLong_AsLongLong(v);
    if (r == -1 && PyErr_Occurred()) return -1;
    r += delta;
    PyObject *nv = PyLong_FromLongLong(r);
    int err = nv == NULL ? -1 : PyDict_SetItem(refs, sid, nv);
    Py_XDECREF(nv);
    *now = r;
    return err;
}

/* The source `sid` loses a reference; at 0 its id goes to `unused`. */
static int release(PyObject *refs, PyObject *unused, PyObject *sid) {
    long long now;
    if (add_refs(refs, sid, -1, &now) < 0) return -1;
    return now == 0 ? PyList_Append(unused, sid) : 0;
}

/* The source id holding `h` in `table`, else in any table of `live`; -1 when
 * none holds it, -2 on an error. */
static long long held_anywhere(PyObject *live, PyObject *table, PyObject *h) {
    PyObject *v = PyDict_GetItemWithError(table, h);
    if (v == NULL && PyErr_Occurred()) return -2;
    Py_ssize_t pos = 0;
    PyObject *scope, *other;
    while (v == NULL && PyDict_Next(live, &pos, &scope, &other)) {
        v = PyDict_GetItemWithError(other, h);
        if (v == NULL && PyErr_Occurred()) return -2;
    }
    if (v == NULL) return -1;
    long long value = PyLong_AsLongLong(v);
    return value == -1 && PyErr_Occurred() ? -2 : value >> SHIFT;
}

/* The source `id` loses a reference (release() by a C id). */
static int release_id(PyObject *refs, PyObject *unused, long long id) {
    PyObject *sid = PyLong_FromLongLong(id);
    if (sid == NULL) return -1;
    int err = release(refs, unused, sid);
    Py_DECREF(sid);
    return err;
}

static int remove_event(PyObject *ev, PyObject *live, PyObject *refs, PyObject *unused,
                        long long *n, Cache *cache) {
    PyObject *scope;
    PyObject *table = table_of(ev, live, cache, 0, &scope);
    if (table == NULL) return PyErr_Occurred() ? -1 : 0;
    Py_INCREF(table);
    int rc = -1;
    PyObject *hashes = PyObject_GetAttr(ev, s_block_hashes), *seq = NULL;
    if (hashes == NULL) goto done;
    seq = PySequence_Fast(hashes, "block_hashes is not a sequence");
    if (seq == NULL) goto done;
    for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(seq); j++) {
        PyObject *h = PySequence_Fast_GET_ITEM(seq, j);
        PyObject *v = PyDict_GetItemWithError(table, h);
        if (v == NULL) {
            if (PyErr_Occurred()) goto done;
            continue; /* a removal of a key not held is a no-op */
        }
        long long value = PyLong_AsLongLong(v);
        if (value == -1 && PyErr_Occurred()) goto done;
        n[COUNTS] -= 1;
        if ((value & COUNT_MASK) > 1) {
            PyObject *less = PyLong_FromLongLong(value - 1);
            int err = less == NULL ? -1 : PyDict_SetItem(table, h, less);
            Py_XDECREF(less);
            if (err < 0) goto done;
            continue;
        }
        if (PyDict_DelItem(table, h) < 0) goto done;
        n[HELD] -= 1;
        if (release_id(refs, unused, value >> SHIFT) < 0) goto done;
    }
    rc = 0;
done:
    Py_XDECREF(seq);
    Py_XDECREF(hashes);
    Py_DECREF(table);
    return rc;
}

/* Append `sid` to `deps` unless there (==). */
static int add_dep(PyObject *deps, PyObject *sid) {
    int there = PySequence_Contains(deps, sid);
    if (there < 0) return -1;
    return there ? 0 : PyList_Append(deps, sid);
}

static int store_event(PyObject *ev, PyObject *live, PyObject *sources, PyObject *refs,
                       PyObject *unused, long long *n, Cache *cache) {
    int rc = -1;
    PyObject *hashes = NULL, *seq = NULL, *scope = NULL, *table = NULL, *deps = NULL;
    PyObject *parent = NULL, *toks = NULL, *sid = NULL, *source = NULL, *dep_tuple = NULL;
    hashes = PyObject_GetAttr(ev, s_block_hashes);
    if (hashes == NULL) goto done;
    Py_ssize_t size = PyObject_Length(hashes); /* (None raises, as len() does) */
    if (size < 0) goto done;
    if (size == 0) {
        rc = 0;
        goto done;
    }
    seq = PySequence_Fast(hashes, "block_hashes is not a sequence");
    if (seq == NULL) goto done;
    table = table_of(ev, live, cache, 1, &scope);
    if (table == NULL) goto done;
    Py_INCREF(table);
    Py_INCREF(scope);
    parent = PyObject_GetAttr(ev, s_parent_block_hash);
    if (parent == NULL) goto done;
    PyObject *parent_dep = NULL;
    if (parent != Py_None) {
        long long held = held_anywhere(live, table, parent);
        if (held == -2) goto done;
        if (held >= 0 && (parent_dep = PyLong_FromLongLong(held)) == NULL) goto done;
    }
    toks = attr_or_none(ev, s_token_ids);
    int tokens = toks == NULL ? -1 : PyObject_IsTrue(toks);
    if (tokens < 0) {
        Py_XDECREF(parent_dep);
        goto done;
    }
    if (tokens) { /* (the usual case: the parent's source at most) */
        dep_tuple = parent_dep == NULL ? PyTuple_New(0) : PyTuple_Pack(1, parent_dep);
        Py_XDECREF(parent_dep);
        if (dep_tuple == NULL) goto done;
    } else {
        deps = PyList_New(0);
        int err = deps == NULL ? -1 : parent_dep == NULL ? 0 : PyList_Append(deps, parent_dep);
        Py_XDECREF(parent_dep);
        if (err < 0) goto done;
        for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(seq); j++) {
            PyObject *h = PySequence_Fast_GET_ITEM(seq, j);
            Py_ssize_t pos = 0;
            PyObject *key, *other;
            while (PyDict_Next(live, &pos, &key, &other)) {
                PyObject *held = PyDict_GetItemWithError(other, h);
                if (held == NULL) {
                    if (PyErr_Occurred()) goto done;
                    continue;
                }
                long long value = PyLong_AsLongLong(held);
                PyObject *dep = value == -1 && PyErr_Occurred()
                                    ? NULL
                                    : PyLong_FromLongLong(value >> SHIFT);
                if (dep == NULL) goto done;
                PyObject *src = PyDict_GetItemWithError(sources, dep);
                int with = src == NULL || !PyTuple_Check(src) || PyTuple_GET_SIZE(src) != 5
                               ? -1
                               : PyObject_IsTrue(PyTuple_GET_ITEM(src, TOKENS));
                if (with < 0) {
                    if (!PyErr_Occurred())
                        PyErr_SetString(PyExc_KeyError, "a key names no kept source tuple");
                    Py_DECREF(dep);
                    goto done;
                }
                int err = with ? add_dep(deps, dep) : 0;
                Py_DECREF(dep);
                if (err < 0) goto done;
                if (with) break;
            }
        }
        dep_tuple = PyList_AsTuple(deps);
        if (dep_tuple == NULL) goto done;
    }
    sid = PyLong_FromLongLong(n[NEXT]);
    if (sid == NULL) goto done;
    n[NEXT] += 1;
    PyObject *size_obj = PyLong_FromSsize_t(size);
    if (size_obj == NULL) goto done;
    source = PyTuple_Pack(5, ev, scope, dep_tuple, tokens ? Py_True : Py_False, size_obj);
    Py_DECREF(size_obj);
    if (source == NULL) goto done;
    if (PyDict_SetItem(sources, sid, source) < 0) goto done;
    PyObject *zero = PyLong_FromLong(0);
    int zerr = zero == NULL ? -1 : PyDict_SetItem(refs, sid, zero);
    Py_XDECREF(zero);
    if (zerr < 0) goto done;
    n[KEPT] += size;
    for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(dep_tuple); d++) {
        long long now;
        if (add_refs(refs, PyTuple_GET_ITEM(dep_tuple, d), 1, &now) < 0) goto done;
    }
    long long names = 0, added = 0, id = n[NEXT] - 1, mine = id << SHIFT;
    for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(seq); j++) {
        PyObject *h = PySequence_Fast_GET_ITEM(seq, j);
        PyObject *v = PyDict_GetItemWithError(table, h);
        long long value = 0;
        if (v == NULL) {
            if (PyErr_Occurred()) goto done;
        } else {
            value = PyLong_AsLongLong(v);
            if (value == -1 && PyErr_Occurred()) goto done;
        }
        PyObject *now_v = PyLong_FromLongLong(mine | ((value & COUNT_MASK) + 1));
        int err = now_v == NULL ? -1 : PyDict_SetItem(table, h, now_v);
        Py_XDECREF(now_v);
        if (err < 0) goto done;
        if (v == NULL) {
            added += 1;
        } else if ((value >> SHIFT) != id) { /* (else: a hash repeated in this event) */
            names += 1;
            if (release_id(refs, unused, value >> SHIFT) < 0) goto done;
        }
    }
    long long now;
    if (add_refs(refs, sid, added + names, &now) < 0) goto done;
    n[HELD] += added;
    n[COUNTS] += size;
    rc = 0;
done:
    Py_XDECREF(hashes);
    Py_XDECREF(seq);
    Py_XDECREF(scope);
    Py_XDECREF(table);
    Py_XDECREF(deps);
    Py_XDECREF(parent);
    Py_XDECREF(toks);
    Py_XDECREF(sid);
    Py_XDECREF(source);
    Py_XDECREF(dep_tuple);
    return rc;
}

static int read_counters(PyObject *list, long long *n) {
    if (!PyList_CheckExact(list) || PyList_GET_SIZE(list) != 4) {
        PyErr_SetString(PyExc_TypeError, "n must be a list of 4 ints");
        return -1;
    }
    for (int k = 0; k < 4; k++) {
        n[k] = PyLong_AsLongLong(PyList_GET_ITEM(list, k));
        if (n[k] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static int write_counters(PyObject *list, const long long *n) {
    for (int k = 0; k < 4; k++) {
        PyObject *v = PyLong_FromLongLong(n[k]);
        if (v == NULL || PyList_SetItem(list, k, v) < 0) return -1;
    }
    return 0;
}

PyDoc_STRVAR(record_doc,
             "record(events, i, kinds, live, sources, refs, unused, n) -> int\n\n"
             "Apply events[i:] to the recorder's state; the index of the first event\n"
             "not applied (see the module source's header).");

static PyObject *cr_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "record() takes 8 arguments");
        return NULL;
    }
    PyObject *events = args[0], *kinds = args[2], *live = args[3], *sources = args[4];
    PyObject *refs = args[5], *unused = args[6], *counters = args[7];
    if (!PyList_CheckExact(events) || !PyDict_CheckExact(kinds) || !PyDict_CheckExact(live) ||
        !PyDict_CheckExact(sources) || !PyDict_CheckExact(refs) || !PyList_CheckExact(unused)) {
        PyErr_SetString(PyExc_TypeError, "record(list, int, dict, dict, dict, dict, list, list)");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    if (i == -1 && PyErr_Occurred()) return NULL;
    long long n[4];
    if (read_counters(counters, n) < 0) return NULL;
    Cache cache = {{NULL, NULL, NULL, NULL}, NULL, NULL};
    for (; i < PyList_GET_SIZE(events); i++) {
        PyObject *ev = PyList_GET_ITEM(events, i);
        PyObject *kind_obj = PyDict_GetItemWithError(kinds, (PyObject *)Py_TYPE(ev));
        if (kind_obj == NULL) {
            if (PyErr_Occurred()) goto fail;
            break; /* a class not looked up yet: the caller does */
        }
        long kind = PyLong_AsLong(kind_obj);
        if (kind == -1 && PyErr_Occurred()) goto fail;
        if (kind == OTHER) continue;
        if (kind != STORED && kind != REMOVED) break; /* a clear or a move: the caller */
        if (kind == STORED && n[NEXT] >= MAX_ID) break; /* ids to renumber: the caller */
        Py_INCREF(ev);
        int err = kind == REMOVED ? remove_event(ev, live, refs, unused, n, &cache)
                                  : store_event(ev, live, sources, refs, unused, n, &cache);
        Py_DECREF(ev);
        if (err < 0) goto fail;
    }
    cache_clear(&cache);
    if (write_counters(counters, n) < 0) return NULL;
    return PyLong_FromSsize_t(i);
fail:
    cache_clear(&cache);
    return NULL;
}

PyDoc_STRVAR(collect_doc,
             "collect(sources, refs, unused, n) -> None\n\n"
             "Drop the sources in `unused` that nothing keeps (Recorder._collect).");

static PyObject *cr_collect(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyDict_CheckExact(args[0]) || !PyDict_CheckExact(args[1]) ||
        !PyList_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "collect(dict, dict, list, list)");
        return NULL;
    }
    PyObject *sources = args[0], *refs = args[1], *unused = args[2];
    long long n[4];
    if (read_counters(args[3], n) < 0) return NULL;
    while (PyList_GET_SIZE(unused) > 0) {
        Py_ssize_t last = PyList_GET_SIZE(unused) - 1;
        PyObject *sid = Py_NewRef(PyList_GET_ITEM(unused, last));
        int err = PyList_SetSlice(unused, last, last + 1, NULL);
        PyObject *source = err < 0 ? NULL : PyDict_GetItemWithError(sources, sid);
        PyObject *r = source == NULL ? NULL : PyDict_GetItemWithError(refs, sid);
        if (r == NULL) {
            Py_DECREF(sid);
            if (PyErr_Occurred()) return NULL;
            continue; /* (collected already) */
        }
        long long left = PyLong_AsLongLong(r);
        if (left == -1 && PyErr_Occurred()) err = -1;
        if (err == 0 && left <= 0) {
            Py_INCREF(source);
            if (!PyTuple_Check(source) || PyTuple_GET_SIZE(source) != 5 ||
                !PyTuple_Check(PyTuple_GET_ITEM(source, DEPS))) {
                PyErr_SetString(PyExc_TypeError, "a source is not a 5-tuple");
                err = -1;
            }
            if (err == 0) err = PyDict_DelItem(sources, sid);
            if (err == 0) err = PyDict_DelItem(refs, sid);
            long long size = err < 0 ? 0 : PyLong_AsLongLong(PyTuple_GET_ITEM(source, SIZE));
            if (size == -1 && PyErr_Occurred()) err = -1;
            if (err == 0) {
                n[KEPT] -= size;
                PyObject *deps = PyTuple_GET_ITEM(source, DEPS);
                for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(deps) && err == 0; d++)
                    err = release(refs, unused, PyTuple_GET_ITEM(deps, d));
            }
            Py_DECREF(source);
        }
        Py_DECREF(sid);
        if (err < 0) return NULL;
    }
    if (write_counters(args[3], n) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"record", (PyCFunction)(void (*)(void))cr_record, METH_FASTCALL, record_doc},
    {"collect", (PyCFunction)(void (*)(void))cr_collect, METH_FASTCALL, collect_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "coalesce._crecord",
    "The snapshot recorder's loop (coalesce/_recorder.py holds the state and the oracle).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__crecord(void) {
    PyObject **slots[] = {&s_medium,       &s_group_idx,         &s_locality, &s_ownership,
                          &s_block_hashes, &s_parent_block_hash, &s_token_ids};
    const char *names[] = {"medium",       "group_idx",         "locality", "ownership",
                           "block_hashes", "parent_block_hash", "token_ids"};
    for (int k = 0; k < 7; k++) {
        *slots[k] = PyUnicode_InternFromString(names[k]);
        if (*slots[k] == NULL) return NULL;
    }
    return PyModule_Create(&module);
}
