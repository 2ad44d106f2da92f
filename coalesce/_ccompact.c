/* The compactor's rules 2, 3, 5a, 5 and 6 in C: an optional accelerator.
 *
 * coalesce._rules.compact_events is the specification and the oracle; this
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
 *
 * The file is one translation unit in five parts: _cc_ids.h (the id table),
 * _cc_read.h (reading the event objects), _cc_rules.h (the rules, no Python
 * API), _cc_build.h (building the result events), and this file (the module:
 * registration, the entry points, folding a whole window).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_cstruct.h"
#include "_kinds.h"

#define MAX_TYPES 32
#define MAX_ATTRS 32
#define MAX_IDS 250
#define MAX_DESCS 64
#define MAX_MG 64
#define MAX_WINDOW ((Py_ssize_t)1 << 28) /* events, and block hashes, per call */

typedef struct {
    PyTypeObject *type; /* strong reference, held by the module's state */
    int kind;
    Py_ssize_t off_hashes, off_parent, off_tokens, off_bs, off_medium;
    Py_ssize_t off_extra, off_look, off_group; /* -1: the class has no such field */
    int n_attr;
    Py_ssize_t attr_off[MAX_ATTRS]; /* the fields a merge requires equal, in order */
} TypeInfo;

/* A batch class: where its ts, events and data_parallel_rank are.  ok == 0:
 * windows that hold it are declined (the Python driver takes them). */
typedef struct {
    PyTypeObject *type; /* strong reference, held by the module's state */
    int ok;
    Py_ssize_t off_ts, off_events, off_rank;
} BatchInfo;

/* The classes register() and register_batch() recorded, and the names and
 * the class the calls use: part of the module's state (ModState). */
typedef struct {
    TypeInfo types[MAX_TYPES];
    int ntypes;
    BatchInfo btypes[MAX_TYPES];
    int nbtypes;
    PyObject *s_copy, *s_ts, *s_events, *s_rank; /* interned names */
    PyObject *raw_type; /* msgspec.Raw, imported on the first wire call */
} Registry;

#include "_cc_ids.h"
#include "_cc_read.h"
#include "_cc_rules.h"
#include "_cc_build.h"

/* ---- the results, by name ---------------------------------------------------- */

/* The rule counters a call returns, each named as the CompactionReport field
 * it fills (coalesce/compactor.py reads them by these names), in the order of
 * the counts[] arrays (C_superseded ...).  Each list below is written once:
 * the enums that index the results and the results' field names are both
 * made from it, so a reorder cannot swap two counters. */
#define RULE_COUNTERS(X) X(superseded) X(cancelled) X(merged)
/* compact_window's result (WindowResult) before the counters. */
#define WINDOW_FIELDS(X) \
    X(batches) X(batches_in) X(batches_out) X(events_in) X(events_out) X(folded)
/* compact_events' result (GroupResult) before the counters. */
#define GROUP_FIELDS(X) X(events)

#define AS_COUNTER(name) C_##name,
#define AS_WINDOW_INDEX(name) W_##name,
#define AS_GROUP_INDEX(name) G_##name,
#define AS_FIELD(name) {#name, NULL},
enum { RULE_COUNTERS(AS_COUNTER) N_COUNTERS };
enum { WINDOW_FIELDS(AS_WINDOW_INDEX) W_COUNTERS }; /* then N_COUNTERS counters */
enum { GROUP_FIELDS(AS_GROUP_INDEX) G_COUNTERS };

static PyStructSequence_Field window_fields[] = {
    WINDOW_FIELDS(AS_FIELD) RULE_COUNTERS(AS_FIELD){NULL, NULL}};
static PyStructSequence_Field group_fields[] = {
    GROUP_FIELDS(AS_FIELD) RULE_COUNTERS(AS_FIELD){NULL, NULL}};

static PyStructSequence_Desc window_desc = {
    "coalesce._ccompact.WindowResult",
    "compact_window()'s result: the batches to send, then the report's counts by name.",
    window_fields, W_COUNTERS + N_COUNTERS};
static PyStructSequence_Desc group_desc = {
    "coalesce._ccompact.GroupResult",
    "compact_events()'s result: the events, then the rule counts by name.", group_fields,
    G_COUNTERS + N_COUNTERS};

/* ---- the module's state ------------------------------------------------------ */

/* Everything the module keeps between calls (PyModule_GetState(module)): each
 * entry point looks it up once per call, from its `self`, and passes it down. */
typedef struct {
    CStructState cs; /* first: _cstruct.h's probes read it */
    Registry reg;
    State work; /* compact_group's buffers and table, kept between calls */
    PyTypeObject *window_result, *group_result; /* the structseq types above */
} ModState;

/* A new structseq of `type` holding `first` (a reference stolen) in its field
 * 0, the ints `ints` in fields 1 .. n_ints (ints[k] in field k + 1), then the
 * counters.  NULL on error. */
static PyObject *result_of(PyTypeObject *type, PyObject *first, const Py_ssize_t *ints, int n_ints,
                           const long *counts) {
    PyObject *r = PyStructSequence_New(type);
    if (r == NULL) {
        Py_DECREF(first);
        return NULL;
    }
    PyStructSequence_SET_ITEM(r, 0, first);
    for (int i = 0; i < n_ints + N_COUNTERS; i++) {
        PyObject *v =
            i < n_ints ? PyLong_FromSsize_t(ints[i]) : PyLong_FromLong(counts[i - n_ints]);
        if (v == NULL) {
            Py_DECREF(r); /* (its unset items are NULL: structseq_dealloc skips them) */
            return NULL;
        }
        PyStructSequence_SET_ITEM(r, 1 + i, v);
    }
    return r;
}

static inline ModState *get_state(PyObject *module) {
    return (ModState *)PyModule_GetState(module);
}

/* ---- entry points --------------------------------------------------------- */

static int is_per_block(int kind, const char *name) {
    if (strcmp(name, "block_hashes") == 0) return 1;
    if (kind != K_STORED) return 0;
    return strcmp(name, "parent_block_hash") == 0 || strcmp(name, "token_ids") == 0 ||
           strcmp(name, "extra_keys") == 0 || strcmp(name, "lookahead_token_ids") == 0;
}

PyDoc_STRVAR(register_doc,
             "register($module, cls, kind, fields, /)\n--\n\n"
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
    Registry *reg = &get_state(self)->reg;
    if (find_type(reg, tp) != NULL) Py_RETURN_TRUE;
    if (reg->ntypes >= MAX_TYPES) Py_RETURN_FALSE;
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
    reg->types[reg->ntypes++] = ti;
    return PyBool_FromLong(ok);
}

PyDoc_STRVAR(compact_doc,
             "compact_events($module, events, certain=False, /)\n--\n\n"
             "compact_events(events, certain=False) -> GroupResult | type | None\n\n"
             "Rules 2, 3, 5a, 5 and 6 of coalesce.compactor on one folded group's events (a\n"
             "list), exactly as _compact_events computes them without moves (certain: a\n"
             "chain starts only on a certainly held parent).  Returns a\n"
             "class that is not registered yet (register it and call again), or None\n"
             "for a window this accelerator declines.  A GroupResult is a named tuple\n"
             "(events, superseded, cancelled, merged).  O(events + block hashes).");

/* Rules 2 to 6 on one folded group's events (an exact list, held by the
 * caller): *out is a new list, counts[] the rules' counts added (indexed by
 * C_superseded, C_cancelled, C_merged).  1 on success; 0 to decline (*unknown
 * is set when a class not registered yet is why); -1 on error (an exception
 * is set). */
static int compact_group(ModState *ms, PyObject *events, PyObject **out_list, long *counts,
                         PyTypeObject **unknown, int wire, int certain) {
    State *st = &ms->work;
    if (st->busy) return 0;
    st->busy = 1;
    Window w;
    memset(&w, 0, sizeof(w));
    w.st = st;
    w.reg = &ms->reg;
    w.certain = certain;
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
    counts[C_superseded] += last_clear > 0 ? (long)last_clear : 0;
    counts[C_cancelled] += cancelled;
    counts[C_merged] += merged;
    status = 1;
done:
    st->segs_a = sa;
    st->segs_b = sb;
    trim_all(st);
    st->busy = 0;
    return status;
}

static PyObject *cc_compact_events(PyObject *self, PyObject *args) {
    PyObject *events;
    int certain = 0;
    if (!PyArg_ParseTuple(args, "O|p", &events, &certain)) return NULL;
    if (!PyList_CheckExact(events)) Py_RETURN_NONE;
    PyObject *out = NULL;
    PyTypeObject *unknown = NULL;
    long counts[N_COUNTERS] = {0};
    ModState *ms = get_state(self);
    int r = compact_group(ms, events, &out, counts, &unknown, 0, certain);
    if (r < 0) return NULL;
    if (r == 0) {
        if (unknown != NULL) {
            Py_INCREF(unknown);
            return (PyObject *)unknown;
        }
        Py_RETURN_NONE;
    }
    return result_of(ms->group_result, out, NULL, 0, counts);
}

PyDoc_STRVAR(all_known_doc,
             "all_known($module, events, /)\n--\n\n"
             "all_known(events) -> True | None\n\n"
             "True when every event of the list is of a class registered with a kind\n"
             "this accelerator handles; None otherwise (the caller decides).  O(events).");

/* 1 when every event of the exact list `events` is of a class registered with
 * a kind the rules handle; 0 otherwise, with *unknown set to the first class
 * not registered yet, if that is why.  O(events); allocates nothing. */
static int all_kv(const Registry *reg, PyObject *events, PyTypeObject **unknown) {
    PyTypeObject *last = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
        PyTypeObject *tp = Py_TYPE(PyList_GET_ITEM(events, i));
        if (tp == last) continue;
        const TypeInfo *ti = find_type(reg, tp);
        if (ti == NULL) *unknown = tp;
        if (ti == NULL || ti->kind == K_OPAQUE) return 0;
        last = tp;
    }
    return 1;
}

static PyObject *cc_all_known(PyObject *self, PyObject *events) {
    PyTypeObject *unknown = NULL;
    if (!PyList_CheckExact(events) || !all_kv(&get_state(self)->reg, events, &unknown))
        Py_RETURN_NONE;
    Py_RETURN_TRUE;
}

/* ---- a whole window: rule 1 (fold), then the rules on each group ----------- */

static const BatchInfo *find_btype(const Registry *reg, PyTypeObject *tp) {
    for (int i = 0; i < reg->nbtypes; i++)
        if (reg->btypes[i].type == tp) return &reg->btypes[i];
    return NULL;
}

PyDoc_STRVAR(register_batch_doc,
             "register_batch($module, cls, rebuildable, /)\n--\n\n"
             "register_batch(cls, rebuildable) -> bool\n\n"
             "Record a batch class and the slot offsets of its ts, events and\n"
             "data_parallel_rank fields.  rebuildable false, or a field that is not a\n"
             "slot, means: decline windows that hold it.  Returns whether windows of it are taken\n"
             "(False too when the table of batch classes is full).  O(1).");

static PyObject *cc_register_batch(PyObject *self, PyObject *args) {
    PyObject *cls;
    int ok; /* rebuildable */
    if (!PyArg_ParseTuple(args, "O!p", &PyType_Type, &cls, &ok)) return NULL;
    PyTypeObject *tp = (PyTypeObject *)cls;
    Registry *reg = &get_state(self)->reg;
    const BatchInfo *known = find_btype(reg, tp);
    if (known != NULL) return PyBool_FromLong(known->ok);
    if (reg->nbtypes >= MAX_TYPES) Py_RETURN_FALSE;
    BatchInfo bi;
    bi.off_ts = member_offset(tp, reg->s_ts);
    bi.off_events = member_offset(tp, reg->s_events);
    bi.off_rank = member_offset(tp, reg->s_rank);
    bi.ok = ok && bi.off_ts >= 0 && bi.off_events >= 0 && bi.off_rank >= 0;
    Py_INCREF(tp);
    bi.type = tp;
    reg->btypes[reg->nbtypes++] = bi;
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
static int check_batch(const Registry *reg, PyObject *b, const BatchInfo **bip, Ask *ask) {
    const BatchInfo *bi = find_btype(reg, Py_TYPE(b));
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
    if (!all_kv(reg, events, &ask->type)) return 0;
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
static PyObject *rebuild_batch(const Registry *reg, PyObject *first, const BatchInfo *bi,
                               PyObject *ts, PyObject *events) {
    PyObject *obj = PyObject_CallMethodNoArgs(first, reg->s_copy);
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
static PyObject *fold_events(const Registry *reg, PyObject *batches, Py_ssize_t i, Py_ssize_t j,
                             const BatchInfo *bi, Py_ssize_t total, int check, int *declined) {
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
    if (check && !all_kv(reg, evs, &unknown)) {
        Py_DECREF(evs);
        *declined = 1;
        return NULL;
    }
    return evs;
}

PyDoc_STRVAR(compact_window_doc,
             "compact_window($module, batches, fold_only, wire=False, certain=False, /)\n--\n\n"
             "compact_window(batches, fold_only, wire=False, certain=False)\n"
             "    -> WindowResult | (code, cls) | None\n\n"
             "coalesce.compactor.compact(batches, fold_only=fold_only) without moves, in\n"
             "one call: adjacent batches of one class and rank folded, then (unless\n"
             "fold_only) rules 2 to 6 on each group, the result the same objects where\n"
             "nothing changed.  Returns (0, cls) or (1, cls) for an event or batch class\n"
             "not registered yet (register it and call again), None for a window it\n"
             "declines: any batch or event of a class declined, events not a list, a\n"
             "rank other than None or an int.  With wire, a changed event's block hashes\n"
             "and token ids are msgspec.Raw, their encoding: batches only to encode.  A\n"
             "WindowResult is a named tuple (batches, batches_in, batches_out, events_in,\n"
             "events_out, folded, superseded, cancelled, merged), the counts named as\n"
             "CompactionReport's fields.  certain: as compact_events().\n"
             "O(batches + events + block hashes).");

static PyObject *cc_compact_window(PyObject *self, PyObject *args) {
    PyObject *given;
    int fold_only, wire = 0, certain = 0;
    if (!PyArg_ParseTuple(args, "O!p|pp", &PyList_Type, &given, &fold_only, &wire, &certain))
        return NULL;
    ModState *ms = get_state(self);
    Registry *reg = &ms->reg;
    if (wire && reg->raw_type == NULL) {
        PyObject *msgspec = PyImport_ImportModule("msgspec");
        if (msgspec == NULL) return NULL;
        PyObject *raw = PyObject_GetAttrString(msgspec, "Raw");
        Py_DECREF(msgspec);
        if (raw == NULL) return NULL;
        Py_XSETREF(reg->raw_type, raw); /* (the import may have run this call already) */
    }
    PyObject *batches = PyList_AsTuple(given); /* held: the caller's list may change */
    if (batches == NULL) return NULL;
    PyObject *out = PyList_New(0), *result = NULL;
    if (out == NULL) goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(batches), events_in = 0, events_out = 0, groups = 0;
    long counts[N_COUNTERS] = {0};
    Ask ask = {0, NULL};
    Py_ssize_t i = 0;
    while (i < n) {
        PyObject *first = PyTuple_GET_ITEM(batches, i);
        const BatchInfo *bi = NULL;
        if (!check_batch(reg, first, &bi, &ask)) goto decline;
        PyObject *rank = FIELD(first, bi->off_rank);
        Py_ssize_t total = PyList_GET_SIZE(FIELD(first, bi->off_events));
        Py_ssize_t j = i + 1;
        for (; j < n; j++) {
            PyObject *b = PyTuple_GET_ITEM(batches, j);
            const BatchInfo *bj = NULL;
            if (!check_batch(reg, b, &bj, &ask)) goto decline;
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
        PyObject *evs = fold_events(reg, batches, i, j, bi, total, fold_only, &declined);
        if (evs == NULL) {
            Py_DECREF(ts);
            if (declined) goto decline;
            goto done;
        }
        PyObject *new = evs;
        if (!fold_only) {
            int r = compact_group(ms, evs, &new, counts, &ask.type, wire, certain);
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
        PyObject *batch = rebuild_batch(reg, first, bi, ts, new);
        if (batch == NULL) goto done;
        int r = PyList_Append(out, batch);
        Py_DECREF(batch);
        if (r < 0) goto done;
        events_out += m;
        i = j;
    }
    Py_ssize_t ints[W_COUNTERS - 1]; /* the fields after W_batches (0) */
    ints[W_batches_in - 1] = n;
    ints[W_batches_out - 1] = PyList_GET_SIZE(out);
    ints[W_events_in - 1] = events_in;
    ints[W_events_out - 1] = events_out;
    ints[W_folded - 1] = n - groups;
    result = result_of(ms->window_result, out, ints, W_COUNTERS - 1, counts);
    out = NULL; /* (stolen) */
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
    {"compact_events", cc_compact_events, METH_VARARGS, compact_doc},
    {"register_batch", cc_register_batch, METH_VARARGS, register_batch_doc},
    {"compact_window", cc_compact_window, METH_VARARGS, compact_window_doc},
    {NULL, NULL, 0, NULL},
};

/* ---- the module: multi-phase init, its state freed with it ------------------ */

static int cc_exec(PyObject *module) {
    Registry *reg = &get_state(module)->reg;
    reg->s_copy = PyUnicode_InternFromString("__copy__");
    reg->s_ts = PyUnicode_InternFromString("ts");
    reg->s_events = PyUnicode_InternFromString("events");
    reg->s_rank = PyUnicode_InternFromString("data_parallel_rank");
    if (reg->s_copy == NULL || reg->s_ts == NULL || reg->s_events == NULL || reg->s_rank == NULL)
        return -1;
    ModState *ms = get_state(module);
    ms->window_result = PyStructSequence_NewType(&window_desc);
    ms->group_result = PyStructSequence_NewType(&group_desc);
    if (ms->window_result == NULL || ms->group_result == NULL) return -1;
    if (PyModule_AddObjectRef(module, "WindowResult", (PyObject *)ms->window_result) < 0 ||
        PyModule_AddObjectRef(module, "GroupResult", (PyObject *)ms->group_result) < 0)
        return -1;
    return 0;
}

static int cc_traverse(PyObject *module, visitproc visit, void *arg) {
    Registry *reg = &get_state(module)->reg;
    for (int i = 0; i < reg->ntypes; i++) Py_VISIT(reg->types[i].type);
    for (int i = 0; i < reg->nbtypes; i++) Py_VISIT(reg->btypes[i].type);
    Py_VISIT(reg->raw_type);
    Py_VISIT(get_state(module)->window_result);
    Py_VISIT(get_state(module)->group_result);
    return 0;
}

static int cc_clear(PyObject *module) {
    Registry *reg = &get_state(module)->reg;
    for (int i = 0; i < reg->ntypes; i++) Py_CLEAR(reg->types[i].type);
    for (int i = 0; i < reg->nbtypes; i++) Py_CLEAR(reg->btypes[i].type);
    reg->ntypes = reg->nbtypes = 0;
    Py_CLEAR(reg->raw_type);
    Py_CLEAR(reg->s_copy);
    Py_CLEAR(reg->s_ts);
    Py_CLEAR(reg->s_events);
    Py_CLEAR(reg->s_rank);
    Py_CLEAR(get_state(module)->window_result);
    Py_CLEAR(get_state(module)->group_result);
    return 0;
}

static void cc_free(void *module) {
    cc_clear((PyObject *)module);
    State *st = &get_state((PyObject *)module)->work;
    free(st->ids.s);
    Buf *bufs = (Buf *)&st->bufs;
    for (size_t i = 0; i < sizeof(st->bufs) / sizeof(Buf); i++) free(bufs[i].p);
    free(st->segs_a.v);
    free(st->segs_b.v);
    for (int j = 0; j < MAX_DESCS; j++) free(st->descs[j].segs.v);
    memset(st, 0, sizeof(*st));
}

static PyModuleDef_Slot cc_slots[] = {
    {Py_mod_exec, cc_exec},
    {0, NULL},
};

static struct PyModuleDef cc_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "coalesce._ccompact",
    .m_doc = "Optional C accelerator for coalesce.compactor (see the C source's header).",
    .m_size = sizeof(ModState),
    .m_methods = cc_methods,
    .m_slots = cc_slots,
    .m_traverse = cc_traverse,
    .m_clear = cc_clear,
    .m_free = cc_free,
};

PyMODINIT_FUNC PyInit__ccompact(void) { return PyModuleDef_Init(&cc_module); }
