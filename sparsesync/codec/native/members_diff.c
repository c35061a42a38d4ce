/* native/members_diff.c: the diff of a group's members (many small tensors, the caller's own)
 * against the group's flat copy, in one call, without first copying the members end to end
 * (issue 51: that copy was a group's whole size per version, and a Python call per member).
 *
 *   members_diff(base, members, width, member, elem, out_idx, out_a, out_b, counts[, hw]) -> (count, member, elem)
 *       `base` holds the members' concatenation (`width` bytes per element), members[i] the
 *       current bits of elements [offsets[i], offsets[i + 1]) of it (offsets: the running sum of
 *       the members' sizes). From element `elem` of member `member` on, writes the flat indices
 *       (positions in the concatenation, int64) and both sides' bits of the changed elements, in
 *       order, until the outputs are full; adds each member's count of changes written to
 *       counts[i] (int64, one per member); returns how many it wrote and where to resume (the
 *       member count and 0 when done).
 *
 * Guarantee: the same indices and bits, in the same order, as diff_into over the members'
 * concatenation (the same kernels, run member by member); every size is checked before the
 * first write (ValueError: the members' sizes must sum to the base's, each a multiple of
 * `width`; the resume point inside them); every buffer taken is released on every path; no
 * Python object is touched while the GIL is released. A fragment of _native.c, included after
 * diff.c and members.c (take_list).
 */

static int64_t diff_span(const uint8_t *a, const uint8_t *b, int w, int hw, int64_t n, int64_t start, int64_t base,
                         int64_t cap, int64_t *oi, uint8_t *oa, uint8_t *ob, int64_t *next) {
    int64_t k = 0;
#ifdef SS_X86
    if (w == 2 && hw >= HW_AVX2) return diff2_avx2(a, b, n, start, base, cap, oi, oa, ob, next);
#else
    (void)hw;
#endif
#define CALL(W) k = diff_w(a, b, W, n, start, base, cap, oi, oa, ob, next)
    DISPATCH_WIDTH(w, CALL)
#undef CALL
    return k;
}

static PyObject *py_members_diff(PyObject *self, PyObject *args) {
    PyObject *lst;
    Py_buffer base, oi, oa, ob, cb;
    int w, hw = -1;
    long long member, elem;
    if (!PyArg_ParseTuple(args, "y*OiLLw*w*w*w*|i", &base, &lst, &w, &member, &elem, &oi, &oa, &ob, &cb, &hw))
        return NULL;
    Py_buffer *bufs = NULL;
    Py_ssize_t m = 0;
    PyObject *res = NULL;
    if (check_width(w) < 0 || (hw = parse_hw(hw)) < 0) goto done;
    if (take_list(lst, "members_diff", 0, &bufs, &m) < 0) goto done;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (bufs[i].len % w) {
            PyErr_Format(PyExc_ValueError, "members_diff: member %zd holds %zd bytes, expected a multiple of %d", i, bufs[i].len, w);
            goto done;
        }
        total += bufs[i].len;
    }
    if (total != base.len) {
        PyErr_Format(PyExc_ValueError, "members_diff: the members hold %lld bytes, the base %zd", (long long)total, base.len);
        goto done;
    }
    if (cb.len != (Py_ssize_t)(8 * m)) {
        PyErr_Format(PyExc_ValueError, "members_diff: counts hold %zd bytes, expected %zd int64", cb.len, m);
        goto done;
    }
    if (member < 0 || member > m || elem < 0 || (member < m && elem > bufs[member].len / w) || (member == m && elem)) {
        PyErr_Format(PyExc_ValueError, "members_diff: resume at member %lld element %lld, outside the %zd members", member, elem, m);
        goto done;
    }
    int64_t cap = oi.len / 8;
    if (oa.len / w < cap) cap = oa.len / w;
    if (ob.len / w < cap) cap = ob.len / w;
    int64_t k = 0, at = 0, e = elem;
    Py_ssize_t i = 0;
    int64_t *counts = cb.buf;
    for (; i < member; i++) at += bufs[i].len / w;
    Py_BEGIN_ALLOW_THREADS
    for (; i < m; i++, e = 0) {
        int64_t n = bufs[i].len / w, next = e;
        int64_t got = diff_span((const uint8_t *)base.buf + at * w, bufs[i].buf, w, hw, n, e, at, cap - k, (int64_t *)oi.buf + k,
                                (uint8_t *)oa.buf + k * w, (uint8_t *)ob.buf + k * w, &next);
        counts[i] += got;
        k += got;
        if (next < n) { /* the outputs are full: resume here */
            e = next;
            break;
        }
        at += n;
    }
    Py_END_ALLOW_THREADS
    res = Py_BuildValue("LnL", (long long)k, i, (long long)(i < m ? e : 0));
done:
    if (bufs) release_list(bufs, m);
    RELEASE(&base, &oi, &oa, &ob, &cb);
    return res;
}
