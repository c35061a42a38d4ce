/* native/gaps.c: the `gaps` encoding of one class's ranks (docs/format.md, "gaps"): quotient
 * symbols (escaped raw at >= e) and k-bit remainders; gap_khist, gap_symbols (encoder) and
 * gap_ranks (decoder).
 *
 * Guarantee: the decoder checks escapes, quotients and the running rank against the tensor's size.
 * A fragment of _native.c, included after common.h and args.h.
 */

static inline uint64_t get_low(const uint8_t *d, long long bit, uint64_t mask) {
    uint64_t word;
    memcpy(&word, d + (bit >> 3), 8);
    return (word >> (bit & 7)) & mask;
}

/* gap i of a class: ranks[i] - ranks[i - 1] - 1, with ranks[-1] = -1 */
static inline uint64_t gap_at(const int64_t *r, int64_t i) { return (uint64_t)(r[i] - (i ? r[i - 1] : -1) - 1); }

/* gap_khist(ranks, step, k0, out): for every step-th gap g and j in 0..rows-1 (out is int64
 * rows x (ALPHA + 1), rows <= 4), out[j][min(g >> (k0 + j), ALPHA)] += 1: the quotient histograms of every
 * candidate remainder width k0, k0 + 1, ... in one pass. */
static PyObject *py_gap_khist(PyObject *self, PyObject *args) {
    Py_buffer rb, hb;
    long long step;
    int k0;
    if (!PyArg_ParseTuple(args, "y*Liw*", &rb, &step, &k0, &hb)) return NULL;
    PyObject *res = NULL;
    int64_t n = rb.len / 8, rows = hb.len / (8 * (ALPHA + 1));
    if (rb.len % 8 || step < 1 || k0 < 0 || rows < 1 || rows > 4 || k0 + rows - 1 > 63 || hb.len != rows * 8 * (ALPHA + 1)) {
        PyErr_SetString(PyExc_ValueError, "gap_khist: bad sizes, step or k0");
        goto done;
    }
    const int64_t *r = rb.buf;
    int64_t *hist = hb.buf;
    Py_BEGIN_ALLOW_THREADS
    /* one fine histogram of g >> k0 (clipped at ALPHA << (rows - 1)), then merged per row */
    const uint64_t top = (uint64_t)ALPHA << (rows - 1);
    int64_t fine[(ALPHA << 3) + 1];
    memset(fine, 0, (top + 1) * 8);
    for (int64_t i = 0; i < n; i += step) {
        uint64_t g = gap_at(r, i) >> k0;
        fine[g < top ? g : top]++;
    }
    memset(hist, 0, rows * (ALPHA + 1) * 8);
    for (int64_t j = 0; j < rows; j++)
        for (uint64_t q = 0; q <= top; q++) hist[j * (ALPHA + 1) + ((q >> j) < ALPHA ? (q >> j) : ALPHA)] += fine[q];
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    RELEASE(&rb, &hb);
    return res;
}

static PyObject *py_gap_symbols(PyObject *self, PyObject *args) {
    Py_buffer gb, sb, eb, hb, lb;
    int k, e;
    long long loff;
    if (!PyArg_ParseTuple(args, "y*iiw*w*w*w*L", &gb, &k, &e, &sb, &eb, &hb, &lb, &loff)) return NULL;
    PyObject *res = NULL;
    int64_t n = gb.len / 8;
    if (gb.len % 8 || k < 0 || k > 56 || e < 1 || e > 64 || sb.len != n * 4 || eb.len != n * 8 || hb.len != (e + 1) * 8) {
        PyErr_SetString(PyExc_ValueError, "gap_symbols: bad sizes, k or e");
        goto done;
    }
    if (k && (loff < 0 || (loff + (long long)n * k + 7) / 8 + 8 > lb.len)) {
        PyErr_SetString(PyExc_ValueError, "gap_symbols: the low-bit stream is too short (it needs 8 bytes of padding)");
        goto done;
    }
    const int64_t *r = gb.buf;
    int32_t *sym = sb.buf;
    uint64_t *esc = eb.buf;
    int64_t *hist = hb.buf, ne = 0;
    uint8_t *low = lb.buf;
    const uint64_t mask = k ? (1ULL << k) - 1 : 0;
    Py_BEGIN_ALLOW_THREADS
    /* four histograms break the store-to-load chain of repeated symbols; the low bits gather
     * in a 64-bit register that goes out whole when it fills (the register's only chain is an
     * or and an add per gap) */
    int64_t h4[4][ALPHA + 1] = {{0}};
    uint8_t *o = low + (loff >> 3);
    int nb = (int)(loff & 7);
    uint64_t acc = k ? o[0] & ((1u << nb) - 1) : 0; /* the previous class's bits in the first byte */
    for (int64_t i = 0; i < n; i++) {
        uint64_t v = gap_at(r, i), q = v >> k;
        int s = q < (uint64_t)e ? (int)q : e;
        sym[i] = s;
        h4[i & 3][s]++;
        if (s == e) esc[ne++] = q;
        if (k) {
            uint64_t bits = v & mask;
            acc |= bits << nb; /* nb < 64 */
            nb += k;
            if (nb >= 64) { /* full: out it goes; the bits that did not fit start the next word */
                memcpy(o, &acc, 8);
                o += 8;
                nb -= 64;
                acc = bits >> (k - nb); /* k <= 56 < 64; nb == 0 leaves nothing (bits < 2^k) */
            }
        }
    }
    if (k) memcpy(o, &acc, 8); /* the last, partial word (the stream has 8 bytes of padding) */
    for (int j = 0; j <= e; j++) hist[j] = h4[0][j] + h4[1][j] + h4[2][j] + h4[3][j];
    Py_END_ALLOW_THREADS
    res = PyLong_FromLongLong(ne);
done:
    RELEASE(&gb, &sb, &eb, &hb, &lb);
    return res;
}

/* -> (status, next escape): status 0 ok, 1 the escape stream ran out, 2 an escaped value below e,
 * 3 a quotient past the tensor, 4 ranks run past the tensor. Escapes are read from esc[esc_off:]. */
static PyObject *py_gap_ranks(PyObject *self, PyObject *args) {
    Py_buffer sb, eb, lb, ob;
    int e, k;
    long long eoff, loff, numel;
    if (!PyArg_ParseTuple(args, "y*iy*Liy*LLw*", &sb, &e, &eb, &eoff, &k, &lb, &loff, &numel, &ob)) return NULL;
    PyObject *res = NULL;
    int64_t n = sb.len / 4, n_esc = eb.len / 8;
    if (sb.len % 4 || eb.len % 8 || ob.len != n * 8 || k < 0 || k > 56 || e < 1 || numel < 0 || eoff < 0 || eoff > n_esc) {
        PyErr_SetString(PyExc_ValueError, "gap_ranks: bad sizes, offsets, k or e");
        goto done;
    }
    if (k && (loff < 0 || (loff + (long long)n * k + 7) / 8 + 8 > lb.len)) {
        PyErr_SetString(PyExc_ValueError, "gap_ranks: the low-bit stream is too short (it needs 8 bytes of padding)");
        goto done;
    }
    const int32_t *sym = sb.buf;
    const uint64_t *esc = eb.buf;
    const uint8_t *low = lb.buf;
    int64_t *out = ob.buf;
    const uint64_t mask = k ? (1ULL << k) - 1 : 0, qmax = (uint64_t)numel >> k;
    int status = 0;
    int64_t j = eoff;
    Py_BEGIN_ALLOW_THREADS
    int64_t r = -1;
    for (int64_t i = 0; i < n; i++) {
        uint64_t q = (uint64_t)sym[i];
        if (sym[i] == e) {
            if (j >= n_esc) { status = 1; break; }
            q = esc[j++];
            if (q < (uint64_t)e) { status = 2; break; }
        }
        if (q > qmax) { status = 3; break; }
        uint64_t g = (q << k) | (k ? get_low(low, loff + (long long)i * k, mask) : 0);
        r += (int64_t)g + 1; /* q <= numel >> k keeps g < 2 * numel: no overflow */
        if (r >= numel) { status = 4; break; }
        out[i] = r;
    }
    Py_END_ALLOW_THREADS
    res = Py_BuildValue("iL", status, (long long)j);
done:
    RELEASE(&sb, &eb, &lb, &ob);
    return res;
}
