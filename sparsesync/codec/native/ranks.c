/* native/ranks.c: class_ranks, the encoder's pass from sorted changed indices to their ranks
 * among the members of their class, at each HW level (ranks_sse, ranks_avx2, ranks_512).
 *
 * Guarantee: every level gives the same ranks; an index out of range or order, or offsets that
 * do not match the classes, is reported (ValueError) instead of written past.
 * A fragment of _native.c, included after classes.c.
 */

/* In chunks of RANK_BLOCKS blocks of 64 elements: first each block's class masks and each
 * class's count before the block, in L1; then the chunk's changed
 * elements in one pass without data-dependent branches. (Walking blocks and changes together
 * mispredicted the end of every block's changes: 4.7 ns a change at 10% density, against 3.0 now)
 * Returns RANKS_OK; RANKS_OFFSETS if a class holds more changed elements than its offsets give
 * it, or fewer; or the position of the first index out of range or order (checked on the way). */
#define RANK_BLOCKS 128
#define RANKS_OK (-1)
#define RANKS_OFFSETS (-2)
static inline __attribute__((always_inline)) int64_t ranks_w(const uint8_t *restrict p, int w, int64_t n, const int *thr, int nt, const int64_t *restrict idx, int64_t nidx, const int64_t *off, int64_t *restrict out, masks_fn masks) {
    const int K = nt + 1;
    int64_t cum[MAXC] = {0}, wr[MAXC], lim[MAXC], C[RANK_BLOCKS * MAXC];
    uint64_t M[RANK_BLOCKS * MAXC];
    uint8_t cls[128]; /* class of each key */
    class_lut(thr, nt, cls);
    for (int c = 0; c < K; c++) wr[c] = off[c], lim[c] = off[c + 1];
    int64_t i = 0, prev = -1;
    for (int64_t start = 0; start < n && i < nidx; start += 64 * RANK_BLOCKS) {
        int64_t span = n - start < 64 * RANK_BLOCKS ? n - start : 64 * RANK_BLOCKS;
        int nb = (int)((span + 63) / 64);
        for (int b = 0; b < nb; b++) {
            int64_t s0 = start + 64 * (int64_t)b;
            int cnt = n - s0 < 64 ? (int)(n - s0) : 64;
            __builtin_prefetch(p + (s0 + 1024) * w); /* as in select_w */
            __builtin_prefetch(p + (s0 + 1024) * w + 64);
            masks(p, w, s0, cnt, thr, nt, M + b * K);
            for (int c = 0; c < K; c++) {
                C[b * K + c] = cum[c];
                cum[c] += popc(M[b * K + c]);
            }
        }
        const int64_t end = start + span;
        for (; i < nidx && idx[i] < end; i++) {
            int64_t x = idx[i], rel = x - start;
            if (x <= prev) return i; /* negative, repeated or out of order */
            prev = x;
            int b = (int)(rel >> 6);
            int c = cls[p[x * w + (w - 1)] & 0x7f];
            uint64_t below = (1ULL << (rel & 63)) - 1;
            int64_t pos = wr[c];
            if (pos >= lim[c]) return RANKS_OFFSETS;
            out[pos] = C[b * K + c] + popc(M[b * K + c] & below);
            wr[c] = pos + 1;
        }
    }
    if (i < nidx) return i; /* past the end */
    for (int c = 0; c < K; c++)
        if (wr[c] != lim[c]) return RANKS_OFFSETS;
    return RANKS_OK;
}

static int64_t ranks_sse(const uint8_t *p, int w, int64_t n, const int *thr, int nt, const int64_t *idx, int64_t nidx, const int64_t *off, int64_t *out) {
#define CALL(W) return ranks_w(p, W, n, thr, nt, idx, nidx, off, out, class_masks)
    DISPATCH_WIDTH(w, CALL)
#undef CALL
    return RANKS_OFFSETS; /* not reached: every width is dispatched */
}

#ifdef SS_X86
T256 static int64_t ranks_avx2(const uint8_t *p, int w, int64_t n, const int *thr, int nt, const int64_t *idx, int64_t nidx, const int64_t *off, int64_t *out) {
#define CALL(W)                                                                                \
    switch (nt) { /* nt as a constant for the usual 1-3, as in select_avx2 */                    \
    case 1: return ranks_w(p, W, n, thr, 1, idx, nidx, off, out, class_masks_avx2);          \
    case 2: return ranks_w(p, W, n, thr, 2, idx, nidx, off, out, class_masks_avx2);          \
    case 3: return ranks_w(p, W, n, thr, 3, idx, nidx, off, out, class_masks_avx2);          \
    default: return ranks_w(p, W, n, thr, nt, idx, nidx, off, out, class_masks_avx2);        \
    }
    DISPATCH_WIDTH(w, CALL)
#undef CALL
    return RANKS_OFFSETS; /* not reached: every width is dispatched */
}

T512 static int64_t ranks_512(const uint8_t *p, int w, int64_t n, const int *thr, int nt, const int64_t *idx, int64_t nidx, const int64_t *off, int64_t *out) {
#define CALL(W) return ranks_w(p, W, n, thr, nt, idx, nidx, off, out, class_masks_512)
    DISPATCH_WIDTH(w, CALL)
#undef CALL
    return RANKS_OFFSETS; /* not reached: every width is dispatched */
}
#endif

static PyObject *py_class_ranks(PyObject *self, PyObject *args) {
    Py_buffer base, tb, ib, ob, outb;
    int w, hw = -1;
    if (!PyArg_ParseTuple(args, "y*iy*y*y*w*|i", &base, &w, &tb, &ib, &ob, &outb, &hw)) return NULL;
    PyObject *res = NULL;
    int thr[MAXC] = {0}, nt;
    int64_t off[MAXC + 1];
    if (check_class_args("class_ranks", &base, w, &tb, &ib, &ob, &outb, thr, &nt, off, &hw) < 0) goto done;
    int64_t n = base.len / w, nidx = ib.len / 8;
    const int64_t *idx = ib.buf;
    int64_t st = RANKS_OK;
    Py_BEGIN_ALLOW_THREADS
#ifdef SS_X86
    if (hw == HW_AVX512)
        st = ranks_512(base.buf, w, n, thr, nt, idx, nidx, off, outb.buf);
    else if (hw == HW_AVX2)
        st = ranks_avx2(base.buf, w, n, thr, nt, idx, nidx, off, outb.buf);
    else
#endif
        st = ranks_sse(base.buf, w, n, thr, nt, idx, nidx, off, outb.buf);
    Py_END_ALLOW_THREADS
    if (st >= 0) {
        PyErr_Format(PyExc_ValueError, "class_ranks: index %lld at %lld out of range or order", (long long)idx[st], (long long)st);
        goto done;
    }
    if (st == RANKS_OFFSETS) { /* a class held more or fewer changed elements than the offsets gave it */
        PyErr_SetString(PyExc_ValueError, "class_ranks: offsets do not match the classes of the changed elements");
        goto done;
    }
    res = Py_None;
    Py_INCREF(res);
done:
    RELEASE(&base, &tb, &ib, &ob, &outb);
    return res;
}
