/* Encoding a batch as msgspec's msgpack Encoder() does, for State.encode_record:
 * the sender's encode and the recorder's read in one pass over the events.
 *
 * What it writes is what msgspec (the versions the package takes) writes for
 * these shapes, and only them:
 * - a batch class that is array_like, untagged, with the fields (ts, events,
 *   data_parallel_rank) in that order: [ts, [event, ...], rank];
 * - event classes encoded as maps (not array_like), tagged: the map's length
 *   header sized for every field and the tag (fixmap below 16, else map16),
 *   the tag pair first, then each field in order, with omit_defaults a field
 *   left out when it is its default (the same object) or an empty list made by
 *   a list default factory;
 * - values: None, bool, exact int (-2**63 .. 2**64-1), exact float (float64),
 *   exact str, exact bytes, exact list and tuple of those (nested at most
 *   ENC_DEPTH deep).
 * Anything else (a subclass, a dict, a nested struct, UNSET, another default
 * factory) declines the batch: encode_record returns None and nothing is
 * recorded, so the caller encodes it with msgspec and records it as before.
 * The layouts come from Python (coalesce/_fused.py reads msgspec's struct
 * metadata), the field offsets from the classes' member descriptors, as for
 * register(); coalesce/_fused.py compares the first batch of each batch class,
 * and the first with each event class learned at run time, with msgspec's
 * bytes.
 *
 * Part of coalesce/_crecord.c, which includes it once: not a header of its own. */

#define ENC_FIELDS 32 /* fields an event class may have */
#define ENC_DEPTH 8   /* list nesting */
#define MAX_BATCH_TYPES 8

typedef struct {
    int set;
    int nf;
    int map16;        /* the header is map16 (fields + tag >= 16), else fixmap */
    PyObject *tagkv;  /* bytes: the tag field and the tag value, encoded (strong) */
    PyObject *names[ENC_FIELDS]; /* bytes: each field's encoded name (strong) */
    Py_ssize_t offs[ENC_FIELDS];
    PyObject *dflt[ENC_FIELDS]; /* NULL: always written; else the default (strong) */
    uint8_t empty_list[ENC_FIELDS]; /* the default is a list factory: [] is omitted */
} EncInfo;

static EncInfo g_enc[MAX_TYPES]; /* by the index of the class in g_types */

typedef struct {
    PyTypeObject *type; /* strong */
    Py_ssize_t off[3];  /* ts, events, data_parallel_rank */
} BatchLayout;

static BatchLayout g_batches[MAX_BATCH_TYPES];
static int g_nbatches = 0;

/* The bytes being written: a bytes object of `cap` bytes (owned), handed to the
 * caller once the batch is written and cut to its length (no copy). */
typedef struct {
    PyObject *b;      /* NULL until the first write */
    unsigned char *p; /* b's buffer */
    size_t n, cap;
    size_t hint; /* the first size tried: the last batch's, with room to spare */
    size_t at;   /* where put_event() began the last event */
} Out;

#define OUT_HINT_MAX ((size_t)1 << 22) /* (a huge batch's size is not the next hint) */

static int out_grow(Out *o, size_t more) {
    size_t cap = o->cap ? o->cap : (o->hint > 4096 ? o->hint : 4096);
    while (cap < o->n + more) cap *= 2;
    if (cap > (size_t)PY_SSIZE_T_MAX) return 0;
    if (o->b == NULL)
        o->b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cap);
    else if (_PyBytes_Resize(&o->b, (Py_ssize_t)cap) < 0)
        o->b = NULL; /* (freed by it) */
    if (o->b == NULL) {
        PyErr_Clear(); /* (the batch is declined) */
        o->p = NULL;
        o->n = o->cap = 0;
        return 0;
    }
    o->p = (unsigned char *)PyBytes_AS_STRING(o->b);
    o->cap = cap;
    return 1;
}

/* Room for `more` bytes at the end of o.  0 on OOM. */
static inline int out_room(Out *o, size_t more) {
    return o->n + more <= o->cap ? 1 : out_grow(o, more);
}

/* The bytes written, as a bytes object of their length (NULL: an exception set);
 * the next call starts a new one. */
static PyObject *out_take(Out *o) {
    PyObject *b = o->b;
    size_t n = o->n;
    o->b = NULL;
    o->p = NULL;
    o->n = o->cap = 0;
    o->hint = n < OUT_HINT_MAX ? n + n / 8 + 64 : OUT_HINT_MAX;
    if (_PyBytes_Resize(&b, (Py_ssize_t)n) < 0) return NULL;
    return b;
}

static inline void out_bytes(Out *o, const void *src, size_t n) {
    memcpy(o->p + o->n, src, n);
    o->n += n;
}

/* A length header (put_header), with room made for it.  0 on OOM. */
static int put_len(Out *o, MpHeader h, size_t n) {
    if (!out_room(o, 5)) return 0;
    o->n = (size_t)(put_header(o->p + o->n, h, n) - o->p);
    return 1;
}

/* v's encoding.  1 written; 0 a value it does not take (or OOM, or a length
 * past 32 bits): the caller declines the batch. */
static int put_value(Out *o, PyObject *v, int depth) {
    if (!out_room(o, 9)) return 0;
    unsigned char *p = o->p + o->n;
    if (v == Py_None) {
        *p++ = 0xc0;
    } else if (v == Py_True || v == Py_False) {
        *p++ = v == Py_True ? 0xc3 : 0xc2;
    } else if (PyLong_CheckExact(v)) {
        p = put_int(p, v);
        if (p == NULL) return 0; /* past 64 bits */
    } else if (PyFloat_CheckExact(v)) {
        double d = PyFloat_AS_DOUBLE(v);
        uint64_t u;
        memcpy(&u, &d, sizeof(u));
        *p++ = 0xcb;
        for (int i = 56; i >= 0; i -= 8) *p++ = (unsigned char)(u >> i);
    } else if (PyUnicode_CheckExact(v)) {
        Py_ssize_t n;
        const char *s;
        if (PyUnicode_IS_COMPACT_ASCII(v)) {
            s = (const char *)PyUnicode_DATA(v);
            n = PyUnicode_GET_LENGTH(v);
        } else {
            s = PyUnicode_AsUTF8AndSize(v, &n); /* (cached on the str) */
            if (s == NULL) {
                PyErr_Clear();
                return 0;
            }
        }
        if ((uint64_t)n >= ((uint64_t)1 << 32) || !put_len(o, MP_STR, (size_t)n) ||
            !out_room(o, (size_t)n))
            return 0;
        out_bytes(o, s, (size_t)n);
        return 1;
    } else if (PyBytes_CheckExact(v)) {
        size_t n = (size_t)PyBytes_GET_SIZE(v);
        if ((uint64_t)n >= ((uint64_t)1 << 32) || !put_len(o, MP_BIN, n) || !out_room(o, n))
            return 0;
        out_bytes(o, PyBytes_AS_STRING(v), n);
        return 1;
    } else if (PyList_CheckExact(v) || PyTuple_CheckExact(v)) {
        if (depth >= ENC_DEPTH) return 0;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
        if ((uint64_t)n >= ((uint64_t)1 << 32) || !put_len(o, MP_ARRAY, (size_t)n)) return 0;
        /* (no element's encoding runs Python code: a list cannot change meanwhile) */
        PyObject **items = PySequence_Fast_ITEMS(v);
        /* A run of exact ints (hashes, token ids) in one loop, room made once. */
        if (!out_room(o, (size_t)n * 9)) return 0;
        unsigned char *q = o->p + o->n;
        Py_ssize_t i = 0;
        for (; i < n && PyLong_CheckExact(items[i]); i++) {
            q = put_int(q, items[i]);
            if (q == NULL) return 0; /* past 64 bits */
        }
        o->n = (size_t)(q - o->p);
        for (; i < n; i++)
            if (!put_value(o, items[i], depth + 1)) return 0;
        return 1;
    } else {
        return 0;
    }
    o->n = (size_t)(p - o->p);
    return 1;
}

/* One event as a map.  1 written; 0 declined. */
static int put_event(Out *o, PyObject *ev, const EncInfo *e) {
    size_t head = o->at = o->n, tl = (size_t)PyBytes_GET_SIZE(e->tagkv);
    if (!out_room(o, 3 + tl)) return 0;
    o->n += e->map16 ? 3 : 1;
    out_bytes(o, PyBytes_AS_STRING(e->tagkv), tl);
    unsigned count = 1;
    for (int i = 0; i < e->nf; i++) {
        PyObject *v = FIELD(ev, e->offs[i]);
        if (v == NULL) return 0; /* unset */
        PyObject *d = e->dflt[i];
        if (d != NULL &&
            (v == d || (e->empty_list[i] && PyList_CheckExact(v) && PyList_GET_SIZE(v) == 0)))
            continue;
        size_t nl = (size_t)PyBytes_GET_SIZE(e->names[i]);
        if (!out_room(o, nl)) return 0;
        out_bytes(o, PyBytes_AS_STRING(e->names[i]), nl);
        if (!put_value(o, v, 0)) return 0;
        count++;
    }
    if (e->map16) {
        o->p[head] = 0xde;
        o->p[head + 1] = (unsigned char)(count >> 8);
        o->p[head + 2] = (unsigned char)count;
    } else {
        o->p[head] = (unsigned char)(0x80 | count);
    }
    return 1;
}

static const BatchLayout *find_batch(PyTypeObject *tp) {
    for (int i = 0; i < g_nbatches; i++)
        if (g_batches[i].type == tp) return &g_batches[i];
    return NULL;
}

PyDoc_STRVAR(set_layout_doc,
             "set_layout(cls, tagkv, fields) -> bool\n\n"
             "How encode_record() writes events of cls (registered with register()):\n"
             "tagkv the encoded tag pair; fields, in order, (encoded name, attribute\n"
             "name, default or None, how): how 0 always written, 1 left out when it is\n"
             "the default object, 2 left out when an empty list (a list factory).\n"
             "False when cls is not registered, has too many fields, or a field is\n"
             "not a slot: its events then decline.");

static PyObject *cr_set_layout(PyObject *self, PyObject *args) {
    PyObject *cls, *tagkv, *fields;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyType_Type, &cls, &PyBytes_Type, &tagkv,
                          &PyTuple_Type, &fields))
        return NULL;
    TypeInfo *ti = find_type((PyTypeObject *)cls);
    Py_ssize_t nf = PyTuple_GET_SIZE(fields);
    if (ti == NULL || nf > ENC_FIELDS) Py_RETURN_FALSE;
    EncInfo e;
    memset(&e, 0, sizeof(e));
    for (Py_ssize_t i = 0; i < nf; i++) {
        PyObject *f = PyTuple_GET_ITEM(fields, i);
        long how;
        if (!PyTuple_Check(f) || PyTuple_GET_SIZE(f) != 4 ||
            !PyBytes_Check(PyTuple_GET_ITEM(f, 0)) || !PyUnicode_Check(PyTuple_GET_ITEM(f, 1)) ||
            (how = PyLong_AsLong(PyTuple_GET_ITEM(f, 3))) < 0 || how > 2) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "a field is (bytes, str, default, 0|1|2)");
            return NULL;
        }
        e.offs[i] = member_offset((PyTypeObject *)cls, PyTuple_GET_ITEM(f, 1));
        if (e.offs[i] < 0) Py_RETURN_FALSE;
        e.names[i] = PyTuple_GET_ITEM(f, 0);
        e.dflt[i] = how == 0 ? NULL : PyTuple_GET_ITEM(f, 2);
        e.empty_list[i] = how == 2;
    }
    EncInfo *dst = &g_enc[ti - g_types];
    if (dst->set) Py_RETURN_TRUE; /* (the first layout stays: one per class) */
    for (Py_ssize_t i = 0; i < nf; i++) {
        Py_INCREF(e.names[i]);
        Py_XINCREF(e.dflt[i]);
    }
    e.tagkv = Py_NewRef(tagkv);
    e.nf = (int)nf;
    e.map16 = nf + 1 >= 16;
    e.set = 1;
    *dst = e;
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(register_batch_doc,
             "register_batch(cls) -> bool\n\n"
             "A batch class encode_record() takes: array_like, untagged, its fields\n"
             "(ts, events, data_parallel_rank) in that order (the caller checks that).\n"
             "False when a field is not a slot or the table is full.");

static PyObject *cr_register_batch(PyObject *self, PyObject *cls) {
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "register_batch(cls: type)");
        return NULL;
    }
    PyTypeObject *tp = (PyTypeObject *)cls;
    if (find_batch(tp) != NULL) Py_RETURN_TRUE;
    if (g_nbatches >= MAX_BATCH_TYPES) Py_RETURN_FALSE;
    static const char *const names[3] = {"ts", "events", "data_parallel_rank"};
    BatchLayout b;
    for (int k = 0; k < 3; k++) {
        PyObject *name = PyUnicode_InternFromString(names[k]);
        if (name == NULL) return NULL;
        b.off[k] = member_offset(tp, name);
        Py_DECREF(name);
        if (b.off[k] < 0) Py_RETURN_FALSE;
    }
    b.type = (PyTypeObject *)Py_NewRef(cls);
    g_batches[g_nbatches++] = b;
    Py_RETURN_TRUE;
}
