/* native/members.c: the tensors of a group (many small ones) in one call each, not one per
 * tensor (issue 51: per-tensor Python costs more than the work on a small tensor).
 *
 *   members_blocks(bufs, out) -> None
 *       The "xxh3b" blocks of every buffer in the list `bufs`, laid end to end in uint64 `out`
 *       (block_digests of bufs[0], then of bufs[1], ...: ceil(len / 65536) each).
 *
 * The calls below take a group's members as ADDRESSES: `ptrs` (int64, one per member: the
 * address of its first element, `Tensor.data_ptr()`) and `offsets` (int64, one more: member i
 * holds elements [offsets[i], offsets[i + 1]) of the members' concatenation, `width` bytes each).
 * Taking a buffer per member costs Python calls per member on every version (a numpy view of
 * each tensor); an address costs one attribute read. The CALLER guarantees that member i is
 * live, C-contiguous CPU memory of (offsets[i + 1] - offsets[i]) * width bytes, writable for
 * members_put (`_group_read.member_ptrs` gives that for tensors `apply._check_layout` checked);
 * these calls check everything else.
 *   members_take(ptrs, width, offsets, idx, out) -> None
 *       out[k] = element idx[k] of the concatenation (`width` bytes each): the base bits a
 *       decoder reads at the changed positions, gathered from the members, not from a copy.
 *   members_copy(ptrs, width, offsets, out) -> None
 *       The whole concatenation into `out` (for codings that read every base element).
 *   members_put(ptrs, width, idx, offsets, values, old, before, after) -> None
 *       The writes of a group's changes into its members: `idx` (int64) are positions in the
 *       concatenation, `values` their new bits; the overwritten bits go to `old` (as long as
 *       `values`). `before` / `after`: uint64 laid out as members_blocks' `out` (the blocks of
 *       each member's bytes), or empty: each member's blocks hashed just before / just after
 *       its writes.
 *
 * Guarantee: every argument is checked before the first read or write of a member (ValueError
 * for sizes, offsets and addresses, IndexError for an index out of range or not strictly
 * increasing): a failed call writes nothing. Every buffer taken is released on every path; no
 * Python object is touched while the GIL is released. A fragment of _native.c, included after
 * blocks.c.
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

static PyObject *py_members_blocks(PyObject *self, PyObject *args) {
    PyObject *lst;
    Py_buffer ob;
    if (!PyArg_ParseTuple(args, "Ow*", &lst, &ob)) return NULL;
    Py_buffer *bufs = NULL;
    Py_ssize_t n = 0;
    PyObject *res = NULL;
    if (take_list(lst, "members_blocks", 0, &bufs, &n) < 0) goto done;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) total += ((int64_t)bufs[i].len + BLK - 1) / BLK;
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

#define MEMBERS_MAX_ELEMENTS ((int64_t)1 << 56) /* a concatenation's elements: its bytes fit in int64 */

/* Members given by address (see the module comment): `pb` int64 addresses, `ob` int64 offsets
 * (one more), rising from 0, each member with a nonzero address unless it is empty; *n members,
 * *total elements. -1 with ValueError otherwise. */
static int check_members(const char *fn, int w, const Py_buffer *pb, const Py_buffer *ob, Py_ssize_t *n, int64_t *total) {
    if (check_width(w) < 0) return -1;
    if (pb->len % 8 || ob->len != pb->len + 8) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes of addresses and %zd of offsets, expected int64 addresses and one more offset", fn, pb->len, ob->len);
        return -1;
    }
    const int64_t *ptr = pb->buf, *off = ob->buf;
    Py_ssize_t m = pb->len / 8;
    if (off[0] != 0) goto bad;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (off[i + 1] < off[i] || off[i + 1] > MEMBERS_MAX_ELEMENTS) goto bad;
        if (off[i + 1] > off[i] && ptr[i] == 0) {
            PyErr_Format(PyExc_ValueError, "%s: member %zd has %lld elements at address 0", fn, i, (long long)(off[i + 1] - off[i]));
            return -1;
        }
    }
    *n = m;
    *total = off[m];
    return 0;
bad:
    PyErr_Format(PyExc_ValueError, "%s: offsets must rise from 0 (member i holding offsets[i + 1] - offsets[i] elements, at most 2^56 in all)", fn);
    return -1;
}

/* idx: strictly increasing int64 positions in [0, total); -1 with IndexError naming the first bad one */
static int check_positions(const char *fn, const int64_t *idx, int64_t ni, int64_t total) {
    for (int64_t k = 0; k < ni; k++)
        if (idx[k] < 0 || idx[k] >= total || (k && idx[k] <= idx[k - 1])) {
            PyErr_Format(PyExc_IndexError, "%s: index %lld at %lld, expected strictly increasing in [0, %lld)", fn, (long long)idx[k], (long long)k, (long long)total);
            return -1;
        }
    return 0;
}

static PyObject *py_members_take(PyObject *self, PyObject *args) {
    int w;
    Py_buffer pb, ob, ib, outb;
    if (!PyArg_ParseTuple(args, "y*iy*y*w*", &pb, &w, &ob, &ib, &outb)) return NULL;
    PyObject *res = NULL;
    Py_ssize_t n;
    int64_t total;
    if (check_members("members_take", w, &pb, &ob, &n, &total) < 0) goto done;
    const int64_t *idx = ib.buf, *off = ob.buf, *ptr = pb.buf;
    int64_t ni = ib.len / 8;
    if (ib.len % 8 || outb.len != ni * w) {
        PyErr_SetString(PyExc_ValueError, "members_take: idx must be int64 and out hold one element per index");
        goto done;
    }
    if (check_positions("members_take", idx, ni, total) < 0) goto done;
    uint8_t *op = outb.buf;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t m = 0;
    /* idx[k] < total: the walk stops at the member holding it; W a constant (memcpy inlined) */
#define CALL(W) for (int64_t k = 0; k < ni; k++) { while (idx[k] >= off[m + 1]) m++; memcpy(op + k * W, (const uint8_t *)(uintptr_t)ptr[m] + (idx[k] - off[m]) * W, W); }
    DISPATCH_WIDTH(w, CALL)
#undef CALL
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    RELEASE(&pb, &ob, &ib, &outb);
    return res;
}

static PyObject *py_members_copy(PyObject *self, PyObject *args) {
    int w;
    Py_buffer pb, ob, outb;
    if (!PyArg_ParseTuple(args, "y*iy*w*", &pb, &w, &ob, &outb)) return NULL;
    PyObject *res = NULL;
    Py_ssize_t n;
    int64_t total;
    if (check_members("members_copy", w, &pb, &ob, &n, &total) < 0) goto done;
    if (outb.len != total * w) {
        PyErr_Format(PyExc_ValueError, "members_copy: out holds %zd bytes, expected %lld (the members' elements)", outb.len, (long long)(total * w));
        goto done;
    }
    const int64_t *off = ob.buf, *ptr = pb.buf;
    uint8_t *op = outb.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        if (off[i + 1] > off[i]) memcpy(op + off[i] * w, (const void *)(uintptr_t)ptr[i], (size_t)((off[i + 1] - off[i]) * w));
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    RELEASE(&pb, &ob, &outb);
    return res;
}

static PyObject *py_members_put(PyObject *self, PyObject *args) {
    int w;
    Py_buffer pb, ib, ob, vb, oldb, bb, ab;
    if (!PyArg_ParseTuple(args, "y*iy*y*y*w*w*w*", &pb, &w, &ib, &ob, &vb, &oldb, &bb, &ab)) return NULL;
    PyObject *res = NULL;
    Py_ssize_t n;
    int64_t total;
    if (check_members("members_put", w, &pb, &ob, &n, &total) < 0) goto done;
    const int64_t *off = ob.buf, *idx = ib.buf, *ptr = pb.buf;
    int64_t ni = ib.len / 8, nblk = 0;
    for (Py_ssize_t i = 0; i < n; i++) nblk += ((off[i + 1] - off[i]) * w + BLK - 1) / BLK;
    if (ib.len % 8 || vb.len != ni * w || oldb.len != ni * w || (bb.len && bb.len != nblk * 8) || (ab.len && ab.len != nblk * 8)) {
        PyErr_SetString(PyExc_ValueError, "members_put: idx, values, old, before or after has the wrong size");
        goto done;
    }
    if (check_positions("members_put", idx, ni, total) < 0) goto done;
    int hw = xh_hw();
    uint8_t *op = oldb.buf;
    const uint8_t *vp = vb.buf;
    Py_BEGIN_ALLOW_THREADS
    int64_t k = 0, at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t *dp = (uint8_t *)(uintptr_t)ptr[i];
        int64_t lo = off[i], hi = off[i + 1], len = (hi - lo) * w, nb = (len + BLK - 1) / BLK;
        if (bb.len) {
            xh_job j = {dp, len, 0, nb, (uint64_t *)bb.buf + at, hw};
            xh_run(&j);
        }
        int64_t k0 = k;
        while (k < ni && idx[k] < hi) k++; /* [k0, k): this member's (idx[k0] >= lo: the previous member stopped there) */
#define CALL(W) for (int64_t q = k0; q < k; q++) { uint8_t *e = dp + (idx[q] - lo) * W; memcpy(op + q * W, e, W); memcpy(e, vp + q * W, W); }
        DISPATCH_WIDTH(w, CALL)
#undef CALL
        if (ab.len) {
            xh_job j = {dp, len, 0, nb, (uint64_t *)ab.buf + at, hw};
            xh_run(&j);
        }
        at += nb;
    }
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    RELEASE(&pb, &ib, &ob, &vb, &oldb, &bb, &ab);
    return res;
}
