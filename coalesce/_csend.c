/* One 3-frame message on a PUB socket, sent without releasing the GIL: an
 * optional accelerator of coalesce._wire.
 *
 * Why: pyzmq releases the GIL around every zmq_msg_send.  When the engine
 * thread is waiting for the GIL, each release hands it over, and the sender
 * thread then waits for it again until the engine lets go (its next GPU wait,
 * or CPython's forced switch, 5 ms later).  A sender that sends many messages
 * in a row under pressure therefore gets a few microseconds of work per 5 ms
 * and falls behind for good (docs/backpressure.md, "Sending without handing
 * the GIL over").  A send on a PUB socket never blocks (it drops at the high
 * water mark), so holding the GIL over it costs the engine only the send
 * itself: a copy of the payload and a wake-up of ZeroMQ's I/O thread.
 *
 * How: the libzmq that pyzmq has already loaded into this process is opened
 * again by path (RTLD_NOLOAD: never a second copy), and zmq_send is called on
 * the socket's native handle (pyzmq's Socket.underlying).  The Python side
 * (coalesce._wire.message_sender) checks the handle's socket type through the
 * same library before using it, and falls back to pyzmq's send when this
 * module is not built or the library cannot be found.
 *
 * Cost: O(payload bytes) (libzmq copies the frames), no Python object
 * allocated but the return value.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>

#define Z_SNDMORE 2
#define Z_DONTWAIT 1
#define Z_TYPE 16

typedef int (*send_fn)(void *, const void *, size_t, int);
typedef int (*errno_fn)(void);
typedef int (*getsockopt_fn)(void *, int, void *, size_t *);

/* The module's state: the bound library's functions (NULL before bind()).
 * Each entry point reads it once per call, from its `self`. */
typedef struct {
    send_fn z_send;
    errno_fn z_errno;
    getsockopt_fn z_getsockopt;
} SendState;

static inline SendState *get_state(PyObject *module) {
    return (SendState *)PyModule_GetState(module);
}

PyDoc_STRVAR(bind_doc,
             "bind($module, path, /)\n--\n\n"
             "bind(path) -> bool\n\n"
             "Resolve zmq_send, zmq_errno and zmq_getsockopt in the libzmq at `path`,\n"
             "only if that library is already loaded in this process.  True once\n"
             "resolved (later calls change nothing).  O(1).");

static PyObject *cs_bind(PyObject *self, PyObject *arg) {
    SendState *st = get_state(self);
    if (st->z_send != NULL) Py_RETURN_TRUE;
    PyObject *bytes = NULL;
    if (!PyUnicode_FSConverter(arg, &bytes)) return NULL;
    void *lib = dlopen(PyBytes_AS_STRING(bytes), RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(bytes);
    if (lib == NULL) Py_RETURN_FALSE;
    send_fn s = (send_fn)dlsym(lib, "zmq_send");
    errno_fn e = (errno_fn)dlsym(lib, "zmq_errno");
    getsockopt_fn g = (getsockopt_fn)dlsym(lib, "zmq_getsockopt");
    if (s == NULL || e == NULL || g == NULL) {
        dlclose(lib);
        Py_RETURN_FALSE;
    }
    /* the handle stays open: the library is pyzmq's and stays loaded anyway */
    st->z_send = s;
    st->z_errno = e;
    st->z_getsockopt = g;
    Py_RETURN_TRUE;
}

static void *handle_of(PyObject *arg) {
    void *h = PyLong_AsVoidPtr(arg);
    if (h == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a null socket handle");
    return h;
}

PyDoc_STRVAR(socket_type_doc,
             "socket_type($module, handle, /)\n--\n\n"
             "socket_type(handle) -> int\n\n"
             "ZMQ_TYPE of the socket at `handle` (pyzmq's Socket.underlying), read\n"
             "through the bound library; -1 on an error.  Only after bind().  O(1).");

static PyObject *cs_socket_type(PyObject *self, PyObject *arg) {
    const SendState *st = get_state(self);
    if (st->z_getsockopt == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "bind() first");
        return NULL;
    }
    void *h = handle_of(arg);
    if (h == NULL) return NULL;
    int type = -1;
    size_t size = sizeof(type);
    if (st->z_getsockopt(h, Z_TYPE, &type, &size) != 0) type = -1;
    return PyLong_FromLong(type);
}

/* One frame, retried on EINTR; 0 or the libzmq errno. */
static int send_frame(const SendState *st, void *h, const void *data, size_t n, int flags) {
    for (;;) {
        if (st->z_send(h, data, n, flags | Z_DONTWAIT) >= 0) return 0;
        int err = st->z_errno();
        if (err != EINTR) return err;
    }
}

PyDoc_STRVAR(send_doc,
             "send($module, handle, topic, seq, payload, tail=b'', /)\n--\n\n"
             "send(handle, topic, seq, payload[, tail]) -> int\n\n"
             "Send [topic, seq as 8 bytes big-endian + tail, payload] on the socket\n"
             "at `handle`, holding the GIL; 0, or the errno of the frame that failed\n"
             "(the caller raises).  `tail`: at most 16 bytes after the seq (the\n"
             "publisher id of a stream with snapshots on).  Non-blocking\n"
             "(ZMQ_DONTWAIT).  Only after bind().  O(len(payload)).");

static PyObject *cs_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "send() takes 4 or 5 arguments");
        return NULL;
    }
    const SendState *st = get_state(self);
    if (st->z_send == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "bind() first");
        return NULL;
    }
    void *h = handle_of(args[0]);
    if (h == NULL) return NULL;
    if (!PyBytes_CheckExact(args[1]) || !PyBytes_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "topic and payload must be bytes");
        return NULL;
    }
    unsigned long long seq = PyLong_AsUnsignedLongLong(args[2]);
    if (seq == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    unsigned char be[24];
    size_t seq_len = 8;
    if (nargs == 5) {
        if (!PyBytes_CheckExact(args[4]) || PyBytes_GET_SIZE(args[4]) > 16) {
            PyErr_SetString(PyExc_TypeError, "tail must be bytes of at most 16");
            return NULL;
        }
        memcpy(be + 8, PyBytes_AS_STRING(args[4]), (size_t)PyBytes_GET_SIZE(args[4]));
        seq_len += (size_t)PyBytes_GET_SIZE(args[4]);
    }
    for (int i = 7; i >= 0; i--) {
        be[i] = (unsigned char)(seq & 0xff);
        seq >>= 8;
    }
    int err = send_frame(st, h, PyBytes_AS_STRING(args[1]), (size_t)PyBytes_GET_SIZE(args[1]),
                         Z_SNDMORE);
    if (err == 0) err = send_frame(st, h, be, seq_len, Z_SNDMORE);
    if (err == 0)
        err = send_frame(st, h, PyBytes_AS_STRING(args[3]), (size_t)PyBytes_GET_SIZE(args[3]), 0);
    return PyLong_FromLong(err);
}

static PyMethodDef methods[] = {
    {"bind", cs_bind, METH_O, bind_doc},
    {"socket_type", cs_socket_type, METH_O, socket_type_doc},
    {"send", (PyCFunction)(void (*)(void))cs_send, METH_FASTCALL, send_doc},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot slots[] = {
    {0, NULL}, /* (multi-phase init: the state needs no exec step, it starts zeroed) */
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "coalesce._csend",
    .m_doc = "Sending a 3-frame message on a PUB socket without releasing the GIL.",
    .m_size = sizeof(SendState),
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC PyInit__csend(void) { return PyModuleDef_Init(&module); }
