/* native/select.c: class_select, the decoder's inverse of class_ranks: ranks grouped by class
 * back to sorted flat indices (and the base's bits at them), with pdep (BMI2) or bit by bit.
 *
 * Guarantee: every level gives the same indices; ranks are checked (non-negative, increasing in
 * a class) before the pass, and a rank past its class's members is returned as that class.
 * A fragment of _native.c, included after classes.c.
 */

/* Each class's target ranks as a bitmap over the class's members (B[c], two zero words of
 * padding); per block, the bits for the block's members of class c are deposited onto the
 * block's mask of class c: with BMI2's pdep where the CPU has it, else bit by bit. */
static inline uint64_t window64(const uint64_t *b, int64_t bit) {
    int64_t wi = bit >> 6;
    int sh = (int)(bit & 63);
    return sh ? (b[wi] >> sh) | (b[wi + 1] << (64 - sh)) : b[wi];
}

static inline uint64_t deposit_sw(uint64_t bits, uint64_t m) {
    uint64_t r = 0;
    while (bits) {
        r |= 1ULL << select64(m, __builtin_ctzll(bits));
        bits &= bits - 1;
    }
    return r;
}

#ifdef SS_X86
__attribute__((target("bmi2"))) static inline uint64_t deposit_hw(uint64_t bits, uint64_t m) { return _pdep_u64(bits, m); }
#endif

static inline __attribute__((always_inline)) int select_w(const uint8_t *p, int w, int64_t n, const int *thr, int nt, uint64_t *const *B, const int64_t *lim, int64_t *out,
                                                          uint8_t *out_bits, int64_t n_out, uint64_t (*deposit)(uint64_t, uint64_t), masks_fn masks) {
    int64_t cum[MAXC] = {0};
    uint64_t m[MAXC];
    int64_t o = 0;
    int live = 0;
    for (int c = 0; c <= nt; c++) live += lim[c] > 0;
    for (int64_t start = 0; start < n && live; start += 64) {
        int cnt = n - start < 64 ? (int)(n - start) : 64;
        __builtin_prefetch(p + (start + 1024) * w); /* 16 blocks ahead: the masks are otherwise waiting on memory */
        __builtin_prefetch(p + (start + 1024) * w + 64);
        masks(p, w, start, cnt, thr, nt, m);
        uint64_t sel = 0;
        for (int c = 0; c <= nt; c++) {
            int pc = popc(m[c]);
            if (cum[c] < lim[c]) {
                uint64_t bits = window64(B[c], cum[c]);
                if (pc < 64) bits &= (1ULL << pc) - 1;
                sel |= deposit(bits, m[c]);
                live -= cum[c] + pc >= lim[c];
            }
            cum[c] += pc;
        }
        /* each selected index, and with `out_bits` its base bits, read from the block just loaded */
        if (o + 2 <= n_out) { /* the usual 0-2 selected elements per block, without branches */
            for (int u = 0; u < 2; u++) {
                int64_t i = start + __builtin_ctzll(sel | 1ULL << (cnt - 1)); /* overwritten later if sel is 0 */
                out[o] = i;
                if (out_bits) store_w(out_bits, w, o, load_w(p, w, i));
                o += sel != 0;
                sel &= sel - 1;
            }
        }
        while (sel && o < n_out) {
            int64_t i = start + __builtin_ctzll(sel);
            out[o] = i;
            if (out_bits) store_w(out_bits, w, o, load_w(p, w, i));
            o++;
            sel &= sel - 1;
        }
    }
    for (int c = 0; c <= nt; c++)
        if (cum[c] < lim[c]) return c;
    return -1;
}

/* nt (thresholds) as a constant for the usual 1-3: the per-class loop unrolls and its state
 * stays in registers */
#define SELECT_NT(W, DEPOSIT, MASKS)                                                                     \
    switch (nt) {                                                                                        \
    case 1: return select_w(p, W, n, thr, 1, B, lim, out, out_bits, n_out, DEPOSIT, MASKS);                        \
    case 2: return select_w(p, W, n, thr, 2, B, lim, out, out_bits, n_out, DEPOSIT, MASKS);                        \
    case 3: return select_w(p, W, n, thr, 3, B, lim, out, out_bits, n_out, DEPOSIT, MASKS);                        \
    default: return select_w(p, W, n, thr, nt, B, lim, out, out_bits, n_out, DEPOSIT, MASKS);                      \
    }
#define SELECT_ARGS const uint8_t *p, int w, int64_t n, const int *thr, int nt, uint64_t *const *B, const int64_t *lim, int64_t *out, uint8_t *out_bits, int64_t n_out

static int select_sw(SELECT_ARGS) {
#define CALL(W) SELECT_NT(W, deposit_sw, class_masks)
    DISPATCH_WIDTH(w, CALL)
#undef CALL
    return -1;
}

#ifdef SS_X86
__attribute__((target("bmi2"))) static int select_bmi2(SELECT_ARGS) {
#define CALL(W) SELECT_NT(W, deposit_hw, class_masks)
    DISPATCH_WIDTH(w, CALL)
#undef CALL
    return -1;
}

T256 static int select_avx2(SELECT_ARGS) {
#define CALL(W) SELECT_NT(W, deposit_hw, class_masks_avx2)
    DISPATCH_WIDTH(w, CALL)
#undef CALL
    return -1;
}

T512 static int select_512(SELECT_ARGS) {
#define CALL(W) SELECT_NT(W, deposit_hw, class_masks_512)
    DISPATCH_WIDTH(w, CALL)
#undef CALL
    return -1;
}
#endif

static PyObject *py_class_select(PyObject *self, PyObject *args) {
    Py_buffer base, tb, rb, ob, outb, bitsb = {0};
    int w, hw = -1;
    if (!PyArg_ParseTuple(args, "y*iy*y*y*w*|iw*", &base, &w, &tb, &rb, &ob, &outb, &hw, &bitsb)) return NULL;
    PyObject *res = NULL;
    int thr[MAXC] = {0}, nt;
    int64_t off[MAXC + 1];
    if (check_class_args("class_select", &base, w, &tb, &rb, &ob, &outb, thr, &nt, off, &hw) < 0) goto done;
    int64_t n = base.len / w, nr = rb.len / 8;
    uint8_t *bits = bitsb.obj ? bitsb.buf : NULL;
    if (bits && bitsb.len != nr * w) {
        PyErr_SetString(PyExc_ValueError, "class_select: out_bits must hold one element of `width` bytes per rank");
        goto done;
    }
    const int64_t *r = rb.buf;
    int64_t bad_at = -1;
    int bad_c = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int c = 0; c <= nt && bad_at < 0; c++) {
        for (int64_t i = off[c]; i < off[c + 1]; i++) {
            if (r[i] < 0 || (i > off[c] && r[i] <= r[i - 1])) {
                bad_at = i, bad_c = c;
                break;
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (bad_at >= 0) {
        PyErr_Format(PyExc_ValueError, "class_select: rank %lld in class %d is negative or not increasing", (long long)r[bad_at], bad_c);
        goto done;
    }
    uint64_t *B[MAXC] = {NULL};
    int64_t lim[MAXC];
    for (int c = 0; c <= nt; c++) {
        lim[c] = off[c + 1] > off[c] ? r[off[c + 1] - 1] + 1 : 0; /* ranks are increasing: the last is the largest */
        if (lim[c] > n) { /* more members than the tensor has elements: certainly past the class */
            res = PyLong_FromLong(c);
            goto free_b;
        }
        B[c] = PyMem_RawCalloc((size_t)((lim[c] + 63) >> 6) + 2, 8);
        if (!B[c]) {
            PyErr_NoMemory();
            goto free_b;
        }
        uint64_t *Bc = B[c];
        Py_BEGIN_ALLOW_THREADS
        for (int64_t i = off[c]; i < off[c + 1]; i++) Bc[r[i] >> 6] |= 1ULL << (r[i] & 63);
        Py_END_ALLOW_THREADS
    }
    int bad = -1;
    Py_BEGIN_ALLOW_THREADS
#ifdef SS_X86
    if (hw == HW_AVX512)
        bad = select_512(base.buf, w, n, thr, nt, B, lim, outb.buf, bits, nr);
    else if (hw == HW_AVX2)
        bad = select_avx2(base.buf, w, n, thr, nt, B, lim, outb.buf, bits, nr);
    else if (hw == HW_BMI2)
        bad = select_bmi2(base.buf, w, n, thr, nt, B, lim, outb.buf, bits, nr);
    else
#endif
        bad = select_sw(base.buf, w, n, thr, nt, B, lim, outb.buf, bits, nr);
    Py_END_ALLOW_THREADS
    res = PyLong_FromLong(bad);
free_b:
    for (int c = 0; c <= nt; c++) PyMem_RawFree(B[c]);
done:
    RELEASE(&base, &tb, &rb, &ob, &outb, &bitsb);
    return res;
}
