/* native/copy.c: moving bytes: take and put (gather and scatter of elements at int64 indices)
 * and join (b"".join into memory advised for transparent huge pages).
 *
 * Guarantee: put checks every index before the first write and saves what it overwrites; join
 * copies with the GIL released and releases every buffer it took, on every path.
 * A fragment of _native.c, included after common.h and args.h.
 */

static int check_idx(const int64_t *idx, int64_t n_idx, int64_t n) {
    int64_t bad = -1;
    Py_BEGIN_ALLOW_THREADS /* O(n) scans run without the GIL, like the passes they guard */
    for (int64_t i = 0; i < n_idx; i++) {
        if ((uint64_t)idx[i] >= (uint64_t)n) {
            bad = i;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_IndexError, "index %lld at %lld, expected 0 <= index < %lld", (long long)idx[bad], (long long)bad, (long long)n);
        return -1;
    }
    return 0;
}

#define COPY_LOOP(W, DST_EXPR, SRC_EXPR) \
    for (int64_t i = 0; i < ni; i++) memcpy(DST_EXPR, SRC_EXPR, W)

static PyObject *py_take(PyObject *self, PyObject *args) {
    Py_buffer src, ib, outb;
    int w;
    if (!PyArg_ParseTuple(args, "y*iy*w*", &src, &w, &ib, &outb)) return NULL;
    PyObject *res = NULL;
    int64_t n = src.len / (w > 0 ? w : 1), ni = ib.len / 8;
    if (check_width(w) < 0) goto done;
    if (src.len % w || ib.len % 8 || outb.len != ni * w) {
        PyErr_SetString(PyExc_ValueError, "take: src, idx or out has the wrong size");
        goto done;
    }
    const int64_t *idx = ib.buf;
    if (check_idx(idx, ni, n) < 0) goto done;
    const uint8_t *sp = src.buf;
    uint8_t *op = outb.buf;
    Py_BEGIN_ALLOW_THREADS
#define CALL(W) COPY_LOOP(W, op + i * W, sp + idx[i] * W)
    DISPATCH_WIDTH(w, CALL)
#undef CALL
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    RELEASE(&src, &ib, &outb);
    return res;
}

static PyObject *py_put(PyObject *self, PyObject *args) {
    Py_buffer dst, ib, vb, oldb;
    int w;
    if (!PyArg_ParseTuple(args, "w*iy*y*w*", &dst, &w, &ib, &vb, &oldb)) return NULL;
    PyObject *res = NULL;
    int64_t n = dst.len / (w > 0 ? w : 1), ni = ib.len / 8;
    if (check_width(w) < 0) goto done;
    if (dst.len % w || ib.len % 8 || vb.len != ni * w || (oldb.len && oldb.len != ni * w)) {
        PyErr_SetString(PyExc_ValueError, "put: dst, idx, values or old has the wrong size");
        goto done;
    }
    const int64_t *idx = ib.buf;
    if (check_idx(idx, ni, n) < 0) goto done;
    uint8_t *dp = dst.buf, *op = oldb.buf;
    const uint8_t *vp = vb.buf;
    int keep = oldb.len > 0;
    Py_BEGIN_ALLOW_THREADS
    if (keep) { /* one pass: each element's old bits are read where they are overwritten */
#define CALL(W) for (int64_t i = 0; i < ni; i++) { memcpy(op + i * W, dp + idx[i] * W, W); memcpy(dp + idx[i] * W, vp + i * W, W); }
        DISPATCH_WIDTH(w, CALL)
#undef CALL
    } else {
#define CALL(W) COPY_LOOP(W, dp + idx[i] * W, vp + i * W)
        DISPATCH_WIDTH(w, CALL)
#undef CALL
    }
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    RELEASE(&dst, &ib, &vb, &oldb);
    return res;
}

static PyObject *py_join(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "join: expected a list of bytes-like objects");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), total = 0, got = 0;
    PyObject *res = NULL;
    Py_buffer *bufs = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    if (!bufs) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &bufs[got], PyBUF_C_CONTIGUOUS) < 0) goto done;
        if (bufs[got].len > PY_SSIZE_T_MAX - total) {
            got++;
            PyErr_SetString(PyExc_OverflowError, "join: the pieces are too large together");
            goto done;
        }
        total += bufs[got].len;
    }
    res = PyBytes_FromStringAndSize(NULL, total);
    if (!res) goto done;
    char *dst = PyBytes_AS_STRING(res);
    Py_BEGIN_ALLOW_THREADS
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (total >= (4 << 20)) { /* the whole 2 MiB pages inside the output; advice only, failure is harmless */
        uintptr_t lo = ((uintptr_t)dst + (2u << 20) - 1) & ~(uintptr_t)((2u << 20) - 1), hi = ((uintptr_t)dst + (uintptr_t)total) & ~(uintptr_t)((2u << 20) - 1);
        if (hi > lo) madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
    }
#endif
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(dst, bufs[i].buf, (size_t)bufs[i].len);
        dst += bufs[i].len;
    }
    Py_END_ALLOW_THREADS
done:
    if (bufs) {
        for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
        PyMem_Free(bufs);
    }
    Py_DECREF(seq);
    return res;
}
