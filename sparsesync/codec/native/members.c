/* native/members.c: the tensors of a group (many small ones) in one call each, not one per
 * tensor (issue 51: per-tensor Python costs more than the work on a small tensor).
 *
 *   members_blocks(bufs, out) -> None
 *       The "xxh3b" blocks of every buffer in the list `bufs`, laid end to end in uint64 `out`
 *       (block_digests of bufs[0], then of bufs[1], ...: ceil(len / 65536) each).
 *   members_put(dsts, width, idx, offsets, values, old, before, after) -> None
 *       The writes of a group's changes into its members: dsts[i] (writable) holds elements
 *       [offsets[i], offsets[i + 1]) of the members' concatenation, `idx` (int64) are positions in
 *       that concatenation, `values` their new bits (`width` bytes each); the overwritten bits go
 *       to `old` (as long as `values`). `before` / `after`: uint64 laid out as members_blocks'
 *       `out`, or empty: each member's blocks hashed just before / just after its writes.
 *
 * Guarantee: every argument is checked before the first write (ValueError for sizes and
 * offsets, IndexError for an index out of range or not strictly increasing): a failed call
 * writes nothing. Every buffer taken is released on every path; no Python object is touched
 * while the GIL is released. A fragment of _native.c, included after blocks.c.
 */

static int xh_hw(void) { /* block_digests' default level (AVX2 over AVX-512, nothing uses BMI2) */
    int hw = HW_BEST;
    if (hw == HW_AVX512) hw = HW_AVX2;
    if (hw == HW_BMI2) hw = HW_PORTABLE;
    return hw;
}

static void release_list(Py_buffer *bufs, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
}

/* The buffers of the list `lst` (C-contiguous; writable with `flags`), into *out (n of them);
 * -1 with an exception set (and nothing held) on failure. */
static int take_list(PyObject *lst, const char *fn, int flags, Py_buffer **out, Py_ssize_t *n) {
    if (!PyList_Check(lst)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a list of buffers", fn);
        return -1;
    }
    Py_ssize_t m = PyList_GET_SIZE(lst), got = 0;
    Py_buffer *bufs = PyMem_Calloc(m ? (size_t)m : 1, sizeof(Py_buffer));
    if (!bufs) {
        PyErr_NoMemory();
        return -1;
    }
    for (; got < m; got++)
        if (PyObject_GetBuffer(PyList_GET_ITEM(lst, got), &bufs[got], PyBUF_C_CONTIGUOUS | flags) < 0) {
            release_list(bufs, got);
            return -1;
        }
    *out = bufs;
    *n = m;
    return 0;
}

static int64_t list_blocks(const Py_buffer *bufs, Py_ssize_t n) {
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) total += ((int64_t)bufs[i].len + BLK - 1) / BLK;
    return total;
}

static PyObject *py_members_blocks(PyObject *self, PyObject *args) {
    PyObject *lst;
    Py_buffer ob;
    if (!PyArg_ParseTuple(args, "Ow*", &lst, &ob)) return NULL;
    Py_buffer *bufs = NULL;
    Py_ssize_t n = 0;
    PyObject *res = NULL;
    if (take_list(lst, "members_blocks", 0, &bufs, &n) < 0) goto done;
    int64_t total = list_blocks(bufs, n);
    if (ob.len != total * 8) {
        PyErr_Format(PyExc_ValueError, "members_blocks: out holds %zd bytes, expected %lld (8 per 65536-byte block of each buffer)", ob.len, (long long)total * 8);
        goto done;
    }
    int hw = xh_hw();
    Py_BEGIN_ALLOW_THREADS
    int64_t at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t nb = ((int64_t)bufs[i].len + BLK - 1) / BLK;
        xh_job j = {bufs[i].buf, bufs[i].len, 0, nb, (uint64_t *)ob.buf + at, hw};
        xh_run(&j);
        at += nb;
    }
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    if (bufs) release_list(bufs, n);
    PyBuffer_Release(&ob);
    return res;
}

static PyObject *py_members_put(PyObject *self, PyObject *args) {
    PyObject *lst;
    int w;
    Py_buffer ib, offb, vb, oldb, bb, ab;
    if (!PyArg_ParseTuple(args, "Oiy*y*y*w*w*w*", &lst, &w, &ib, &offb, &vb, &oldb, &bb, &ab)) return NULL;
    Py_buffer *bufs = NULL;
    Py_ssize_t n = 0;
    PyObject *res = NULL;
    if (check_width(w) < 0 || take_list(lst, "members_put", PyBUF_WRITABLE, &bufs, &n) < 0) goto done;
    const int64_t *off = offb.buf, *idx = ib.buf;
    int64_t ni = ib.len / 8, total = list_blocks(bufs, n);
    if (offb.len != (Py_ssize_t)(n + 1) * 8 || ib.len % 8 || vb.len != ni * w || oldb.len != ni * w ||
        (bb.len && bb.len != total * 8) || (ab.len && ab.len != total * 8)) {
        PyErr_SetString(PyExc_ValueError, "members_put: offsets, idx, values, old, before or after has the wrong size");
        goto done;
    }
    if (off[0] != 0) goto bad_offsets;
    for (Py_ssize_t i = 0; i < n; i++)
        if (off[i + 1] < off[i] || bufs[i].len != (off[i + 1] - off[i]) * w) goto bad_offsets;
    for (int64_t k = 0; k < ni; k++)
        if (idx[k] < 0 || idx[k] >= off[n] || (k && idx[k] <= idx[k - 1])) {
            PyErr_Format(PyExc_IndexError, "members_put: index %lld at %lld, expected strictly increasing in [0, %lld)", (long long)idx[k], (long long)k, (long long)off[n]);
            goto done;
        }
    int hw = xh_hw();
    uint8_t *op = oldb.buf;
    const uint8_t *vp = vb.buf;
    Py_BEGIN_ALLOW_THREADS
    int64_t k = 0, at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t *dp = bufs[i].buf;
        int64_t nb = ((int64_t)bufs[i].len + BLK - 1) / BLK, lo = off[i], hi = off[i + 1];
        if (bb.len) {
            xh_job j = {dp, bufs[i].len, 0, nb, (uint64_t *)bb.buf + at, hw};
            xh_run(&j);
        }
        int64_t k0 = k;
        while (k < ni && idx[k] < hi) k++; /* [k0, k): this member's (idx[k0] >= lo: the previous member stopped there) */
#define CALL(W) for (int64_t q = k0; q < k; q++) { uint8_t *e = dp + (idx[q] - lo) * W; memcpy(op + q * W, e, W); memcpy(e, vp + q * W, W); }
        DISPATCH_WIDTH(w, CALL)
#undef CALL
        if (ab.len) {
            xh_job j = {dp, bufs[i].len, 0, nb, (uint64_t *)ab.buf + at, hw};
            xh_run(&j);
        }
        at += nb;
    }
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
    goto done;
bad_offsets:
    PyErr_SetString(PyExc_ValueError, "members_put: offsets must rise from 0, member i holding offsets[i + 1] - offsets[i] elements");
done:
    if (bufs) release_list(bufs, n);
    RELEASE(&ib, &offb, &vb, &oldb, &bb, &ab);
    return res;
}
