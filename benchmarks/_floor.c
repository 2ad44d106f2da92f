/* bench_realstream's read floor: the least any pass of the compaction rules
 * does per event.  It reads each event's class, the value of each of its block
 * hashes and of its parent, its medium and group, its token list's length, its
 * block size and the class of every other field; it keeps nothing, indexes
 * nothing and writes nothing.  A benchmark tool, compiled by the benchmark
 * when it runs (with the flags setup.py gives the accelerators); not part of
 * the library. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>

#include "_cstruct.h" /* member_offset(): a slot's offset, as the accelerators find it */

#define MAX_TYPES 16
#define MAX_OTHER 16

typedef struct {
    PyTypeObject *type;
    Py_ssize_t hashes, parent, medium, group, tokens, block_size;
    Py_ssize_t other[MAX_OTHER];
    int nother;
} Layout;

static Layout layouts[MAX_TYPES];
static int nlayouts;

/* register(cls, fields): learn a msgspec struct class's field offsets. */
static PyObject *floor_register(PyObject *self, PyObject *args) {
    PyObject *type, *fields;
    if (!PyArg_ParseTuple(args, "O!O!", &PyType_Type, &type, &PyTuple_Type, &fields)) return NULL;
    if (nlayouts == MAX_TYPES) {
        PyErr_SetString(PyExc_ValueError, "too many classes");
        return NULL;
    }
    Layout *l = &layouts[nlayouts];
    memset(l, 0, sizeof(*l));
    l->type = (PyTypeObject *)type;
    Py_ssize_t *roles[] = {&l->hashes, &l->parent, &l->medium, &l->group, &l->tokens, &l->block_size};
    const char *names[] = {"block_hashes", "parent_block_hash", "medium",
                           "group_idx",    "token_ids",         "block_size"};
    for (int r = 0; r < 6; r++) *roles[r] = -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(fields); i++) {
        PyObject *name = PyTuple_GET_ITEM(fields, i);
        Py_ssize_t off = member_offset(l->type, name);
        if (off < 0) continue;
        int role = -1;
        for (int r = 0; r < 6; r++)
            if (PyUnicode_CompareWithASCIIString(name, names[r]) == 0) role = r;
        if (role >= 0) *roles[role] = off;
        else if (l->nother < MAX_OTHER) l->other[l->nother++] = off;
    }
    Py_INCREF(type);
    nlayouts++;
    Py_RETURN_NONE;
}

/* An int's value (its low 64 bits), or the object's address for anything else. */
static inline uint64_t value_of(PyObject *x) {
    if (!PyLong_CheckExact(x)) return (uint64_t)(uintptr_t)x;
    uint64_t v = 0;
#if PY_VERSION_HEX < 0x030C0000
    Py_ssize_t size = Py_SIZE(x);
    if (size < 0) size = -size;
    const digit *d = ((PyLongObject *)x)->ob_digit;
    for (Py_ssize_t i = size - 1; i >= 0; i--) v = (v << PyLong_SHIFT) | d[i];
#else
    v = (uint64_t)PyLong_AsUnsignedLongLongMask(x);
#endif
    return v;
}

/* read(batches): read every event of every batch as above; a checksum. */
static PyObject *floor_read(PyObject *self, PyObject *batches) {
    if (!PyList_Check(batches)) {
        PyErr_SetString(PyExc_TypeError, "a list of batches");
        return NULL;
    }
    uint64_t sum = 0;
    for (Py_ssize_t b = 0; b < PyList_GET_SIZE(batches); b++) {
        PyObject *events = PyObject_GetAttrString(PyList_GET_ITEM(batches, b), "events");
        if (events == NULL) return NULL;
        if (!PyList_Check(events)) {
            Py_DECREF(events);
            continue;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
            PyObject *ev = PyList_GET_ITEM(events, i);
            const Layout *l = NULL;
            for (int k = 0; k < nlayouts; k++)
                if (layouts[k].type == Py_TYPE(ev)) l = &layouts[k];
            if (l == NULL) continue;
            PyObject *x;
            if (l->hashes >= 0 && (x = FIELD(ev, l->hashes)) != NULL && PyList_CheckExact(x))
                for (Py_ssize_t j = 0; j < PyList_GET_SIZE(x); j++)
                    sum += value_of(PyList_GET_ITEM(x, j));
            if (l->parent >= 0 && (x = FIELD(ev, l->parent)) != NULL) sum += value_of(x);
            if (l->tokens >= 0 && (x = FIELD(ev, l->tokens)) != NULL && PyList_CheckExact(x))
                sum += (uint64_t)PyList_GET_SIZE(x);
            if (l->block_size >= 0 && (x = FIELD(ev, l->block_size)) != NULL) sum += value_of(x);
            if (l->medium >= 0 && (x = FIELD(ev, l->medium)) != NULL)
                sum += (uint64_t)(uintptr_t)Py_TYPE(x);
            if (l->group >= 0 && (x = FIELD(ev, l->group)) != NULL)
                sum += (uint64_t)(uintptr_t)Py_TYPE(x);
            for (int a = 0; a < l->nother; a++)
                if ((x = FIELD(ev, l->other[a])) != NULL) sum += (uint64_t)(uintptr_t)Py_TYPE(x);
        }
        Py_DECREF(events);
    }
    return PyLong_FromUnsignedLongLong(sum);
}

static PyMethodDef methods[] = {
    {"register", floor_register, METH_VARARGS, "register(cls, fields): learn a class's fields"},
    {"read", floor_read, METH_O, "read(batches): read every event's fields; a checksum"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_floor", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__floor(void) { return PyModule_Create(&module); }
