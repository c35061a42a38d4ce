/* native/varints.c: the LEB128 varints of the format-3 table: varints (reader, at most 9 bytes
 * each, no overlong forms, each at most `hi`) and varints_put (writer).
 *
 * Guarantee: the reader never reads past `data` and reports where and why it stopped.
 * A fragment of _native.c, included after common.h and args.h.
 */

/* varints_put(out, values, count): append values[0 .. count-1] (ints in [0, 2^63)) to the
 * bytearray `out` as LEB128 varints, the writer's side of `varints`. */
static PyObject *py_varints_put(PyObject *self, PyObject *args) {
    PyObject *out, *seq;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "O!On", &PyByteArray_Type, &out, &seq, &count)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "varints_put: values must be a sequence");
    if (!fast) return NULL;
    PyObject *res = NULL;
    uint8_t *buf = NULL;
    if (count < 0 || count > PySequence_Fast_GET_SIZE(fast)) {
        PyErr_SetString(PyExc_ValueError, "varints_put: count out of range");
        goto done;
    }
    buf = PyMem_Malloc(count * 10 + 1);
    if (!buf) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) goto done;
        if (v < 0) {
            PyErr_SetString(PyExc_ValueError, "varints_put: values must be non-negative");
            goto done;
        }
        uint64_t u = (uint64_t)v;
        while (u >= 0x80) {
            buf[n++] = (uint8_t)((u & 0x7F) | 0x80);
            u >>= 7;
        }
        buf[n++] = (uint8_t)u;
    }
    Py_ssize_t old = PyByteArray_GET_SIZE(out);
    if (PyByteArray_Resize(out, old + n) < 0) goto done;
    memcpy(PyByteArray_AS_STRING(out) + old, buf, n);
    res = Py_None;
    Py_INCREF(res);
done:
    PyMem_Free(buf);
    Py_DECREF(fast);
    return res;
}

/* One varint of `p` (len bytes) at *pos, moved past it: 0 and *v, else the status varints
 * reports (1 ends inside, 2 overlong, 3 over hi, 4 longer than 9 bytes; *v what was read). */
static inline int read_varint(const uint8_t *p, Py_ssize_t len, Py_ssize_t *pos, uint64_t hi, uint64_t *v) {
    uint64_t x = 0;
    int shift = 0;
    for (int j = 0; j < 9; j++) {
        if (*pos >= len) {
            *v = x;
            return 1;
        }
        uint8_t b = p[(*pos)++];
        x |= (uint64_t)(b & 0x7F) << shift;
        shift += 7;
        if (!(b & 0x80)) {
            *v = x;
            if (b == 0 && shift > 7) return 2;
            return x > hi ? 3 : 0;
        }
    }
    *v = x;
    return 4;
}

static PyObject *py_varints(PyObject *self, PyObject *args) {
    Py_buffer d;
    Py_ssize_t pos, count;
    unsigned long long hi;
    if (!PyArg_ParseTuple(args, "y*nnK", &d, &pos, &count, &hi)) return NULL;
    PyObject *out = NULL, *res = NULL;
    if (pos < 0 || count < 0 || count > d.len) {
        PyErr_SetString(PyExc_ValueError, "varints: pos or count out of range");
        goto done;
    }
    out = PyList_New(count);
    if (!out) goto done;
    int status = 0;
    uint64_t v = 0;
    for (Py_ssize_t i = 0; i < count && !status; i++) {
        status = read_varint(d.buf, d.len, &pos, hi, &v);
        if (!status) {
            PyObject *x = PyLong_FromUnsignedLongLong(v);
            if (!x) goto done;
            PyList_SET_ITEM(out, i, x);
        }
    }
    if (status) res = Py_BuildValue("OnKi", Py_None, pos, (unsigned long long)v, status);
    else res = Py_BuildValue("OnKi", out, pos, 0ULL, 0);
done:
    Py_XDECREF(out);
    PyBuffer_Release(&d);
    return res;
}
