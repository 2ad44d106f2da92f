/* Reading msgspec structs' fields at their slot offsets, block hashes as
 * 64-bit values, and ints and length headers written as msgspec writes them
 * (for _ccompact.c, _crecord.c and their parts).  Header-only (static
 * functions). */
#ifndef COALESCE_CSTRUCT_H
#define COALESCE_CSTRUCT_H

#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include "_cmix.h"

/* The field at slot offset `off` of a struct (NULL when unset). */
#define FIELD(ev, off) (*(PyObject **)((char *)(ev) + (off)))

/* The slot offset of a class's field `name` (a member descriptor), or -1. */
static inline Py_ssize_t member_offset(PyTypeObject *tp, PyObject *name) {
    PyObject *d = PyObject_GetAttr((PyObject *)tp, name);
    if (d == NULL) {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t off = -1;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == T_OBJECT_EX || m->type == T_OBJECT) off = m->offset;
    }
    Py_DECREF(d);
    return off;
}


/* An exact int in [0, 2**64) as a uint64; 0 if it is not one.  On CPython
 * before 3.12 the digits are read directly (PyLong_AsUnsignedLongLong takes a
 * slow byte-array path for every value above 2**30: most block hashes). */
static inline int long_u64(PyObject *h, uint64_t *out) {
#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
    Py_ssize_t size = Py_SIZE(h);
    const digit *d = ((PyLongObject *)h)->ob_digit;
    switch (size) {
    case 0:
        *out = 0;
        return 1;
    case 1:
        *out = (uint64_t)d[0];
        return 1;
    case 2:
        *out = (uint64_t)d[0] | ((uint64_t)d[1] << 30);
        return 1;
    case 3:
        if (d[2] >> 4) return 0; /* 2**64 or more */
        *out = (uint64_t)d[0] | ((uint64_t)d[1] << 30) | ((uint64_t)d[2] << 60);
        return 1;
    default:
        return 0; /* negative, or 2**90 and more */
    }
#else
    unsigned long long x = PyLong_AsUnsignedLongLong(h);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *out = (uint64_t)x;
    return 1;
#endif
}

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

/* The msgpack header of a length-n array, str or bin (MP_ARRAY, MP_STR, MP_BIN)
 * at p, which has room for 5 bytes: its fix form below its fix limit (array
 * 16, str 32; bin has none), its 8-bit form below 256 (str and bin; array has
 * none), else its 16- or 32-bit form (n below 2**32).  The end. */
typedef struct {
    unsigned char fix;
    size_t fixmax;
    unsigned char c8, c16, c32;
} MpHeader;
static const MpHeader MP_ARRAY = {0x90, 16, 0, 0xdc, 0xdd};
static const MpHeader MP_STR = {0xa0, 32, 0xd9, 0xda, 0xdb};
static const MpHeader MP_BIN = {0, 0, 0xc4, 0xc5, 0xc6};

static inline unsigned char *put_header(unsigned char *p, MpHeader h, size_t n) {
    if (n < h.fixmax) {
        *p++ = (unsigned char)(h.fix | n);
    } else if (h.c8 && n < 256) {
        *p++ = h.c8;
        *p++ = (unsigned char)n;
    } else if (n < 65536) {
        *p++ = h.c16;
        *p++ = (unsigned char)(n >> 8);
        *p++ = (unsigned char)n;
    } else {
        *p++ = h.c32;
        for (int i = 24; i >= 0; i -= 8) *p++ = (unsigned char)((uint64_t)n >> i);
    }
    return p;
}

/* Layout probes, exported by both modules for coalesce/_layout.py, which runs
 * them at import against objects whose fields it knows: if msgspec or CPython
 * ever lay these out differently, the accelerators are not used. */

/* fields_at(obj, names) -> tuple: each field as FIELD() reads it at the offset
 * member_offset() finds (None for an unset slot, NotImplemented for no offset). */
static PyObject *cs_fields_at(PyObject *self, PyObject *args) {
    PyObject *obj, *names;
    if (!PyArg_ParseTuple(args, "OO!", &obj, &PyTuple_Type, &names)) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    PyObject *out = PyTuple_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t off = member_offset(Py_TYPE(obj), PyTuple_GET_ITEM(names, i));
        PyObject *v = off < 0 ? Py_NotImplemented : FIELD(obj, off);
        if (v == NULL) v = Py_None;
        Py_INCREF(v);
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

/* u64(x) -> int | None: an exact int as long_u64() reads it (None: not one). */
static PyObject *cs_u64(PyObject *self, PyObject *x) {
    uint64_t v;
    if (!PyLong_CheckExact(x) || !long_u64(x, &v)) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong((unsigned long long)v);
}

/* What these probes keep in a module's state: a module that lists
 * CSTRUCT_METHODS puts a CStructState first in its state struct. */
typedef struct {
    /* How many times this module released the GIL (a deterministic view of it
     * for the tests: no thread scheduling to observe). */
    unsigned long long gil_releases;
} CStructState;

static PyObject *cs_gil_releases(PyObject *self, PyObject *unused) {
    const CStructState *cs = (const CStructState *)PyModule_GetState(self);
    return PyLong_FromUnsignedLongLong(cs->gil_releases);
}

/* (Each docstring starts with the signature inspect.signature() reads.) */
#define CSTRUCT_METHODS                                                                  \
    {"fields_at", cs_fields_at, METH_VARARGS,                                            \
     "fields_at($module, obj, names, /)\n--\n\n"                                         \
     "fields_at(obj, names) -> tuple: the fields as the C code reads them (layout "     \
     "probe)."},                                                                         \
        {"u64", cs_u64, METH_O,                                                          \
         "u64($module, x, /)\n--\n\n"                                                    \
         "u64(x) -> int | None: x as the C code reads a hash."},                         \
        {"gil_releases", cs_gil_releases, METH_NOARGS,                                   \
         "gil_releases($module, /)\n--\n\n"                                              \
         "gil_releases() -> int: how many times this module has released the GIL."},

#endif
