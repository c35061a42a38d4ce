/* native/deltas.c: the `delta` encoding of changed values: zigzag of the wrapped bit-pattern
 * difference grouped by class, symbols >= e escaped raw; delta_hist, delta_symbols (encoder)
 * and delta_values (decoder).
 *
 * Guarantee: sizes, classes and escape counts are checked before the passes write.
 * A fragment of _native.c, included after classes.c.
 */

/* zigzag of (t - b) mod 2^(8w) read as a signed w-byte integer */
static inline uint64_t zigzag_w(uint64_t b, uint64_t t, int w) {
    int bits = 8 * w;
    uint64_t m = bits == 64 ? ~0ULL : (1ULL << bits) - 1;
    uint64_t d = (t - b) & m;
    uint64_t sign = (d >> (bits - 1)) & 1;
    return ((d << 1) & m) ^ (sign ? m : 0);
}

static inline uint64_t unzigzag_add_w(uint64_t b, uint64_t z, int w) {
    int bits = 8 * w;
    uint64_t m = bits == 64 ? ~0ULL : (1ULL << bits) - 1;
    uint64_t d = (z >> 1) ^ (0 - (z & 1));
    return (b + d) & m;
}

static int delta_common(Py_buffer *bb, Py_buffer *cb, int w, int K, int64_t *n) {
    if (check_width(w) < 0) return -1;
    if (K < 1 || K > MAXC || bb->len % w) {
        PyErr_SetString(PyExc_ValueError, "delta: bad width, class count or base size");
        return -1;
    }
    *n = bb->len / w;
    if (cb->len != (K > 1 ? *n : 0)) {
        PyErr_SetString(PyExc_ValueError, "delta: classes must hold one byte per element (none for one class)");
        return -1;
    }
    const uint8_t *cls = cb->buf;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < cb->len && !bad; i++) bad = cls[i] >= K;
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "delta: class index out of range");
        return -1;
    }
    return 0;
}

/* the class of each element from its base bits: key = top byte & 0x7f */
#define DELTA_CLASS(bv, W) lut[((bv) >> (8 * (W) - 8)) & 0x7f]

/* What the encoder's delta passes share: base and target of `w`-byte elements, alike in size,
 * and the thresholds, turned into the class count K, the element count n and the class of
 * every magnitude key (lut). */
static int delta_enc_args(const char *fn, Py_buffer *bb, Py_buffer *tb, int w, Py_buffer *thb, int *K, int64_t *n, uint8_t *lut) {
    int thr[MAXC] = {0}, nt;
    if (check_width(w) < 0 || parse_thresholds(thb, thr, &nt) < 0) return -1;
    if (bb->len % w || tb->len != bb->len) {
        PyErr_Format(PyExc_ValueError, "%s: base and target must hold the same whole number of elements", fn);
        return -1;
    }
    *K = nt + 1;
    *n = bb->len / w;
    class_lut(thr, nt, lut);
    return 0;
}

static PyObject *py_delta_hist(PyObject *self, PyObject *args) {
    Py_buffer bb, tb, thb, hb;
    int w;
    long long step = 1;
    if (!PyArg_ParseTuple(args, "y*y*iy*w*|L", &bb, &tb, &w, &thb, &hb, &step)) return NULL;
    PyObject *res = NULL;
    int K;
    int64_t n;
    uint8_t lut[128];
    if (delta_enc_args("delta_hist", &bb, &tb, w, &thb, &K, &n, lut) < 0) goto done;
    if (hb.len != K * 65 * 8 || step < 1) {
        PyErr_SetString(PyExc_ValueError, "delta_hist: hist has the wrong size, or step < 1");
        goto done;
    }
    const uint8_t *b = bb.buf, *t = tb.buf;
    int64_t *hist = hb.buf;
    Py_BEGIN_ALLOW_THREADS
    memset(hist, 0, K * 65 * 8);
#define CALL(W)                                                                    \
    for (int64_t i = 0; i < n; i += step) {                                        \
        uint64_t bv = load_w(b, W, i), z = zigzag_w(bv, load_w(t, W, i), W);       \
        hist[DELTA_CLASS(bv, W) * 65 + (z < 64 ? z : 64)]++;                       \
    }
    DISPATCH_WIDTH(w, CALL)
#undef CALL
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    RELEASE(&bb, &tb, &thb, &hb);
    return res;
}

static int parse_es(Py_buffer *eb, int K, int64_t *es) {
    if (eb->len != K * 8) {
        PyErr_SetString(PyExc_ValueError, "delta: one alphabet size per class expected");
        return -1;
    }
    memcpy(es, eb->buf, K * 8);
    for (int c = 0; c < K; c++)
        if (es[c] < 1 || es[c] > 64) {
            PyErr_SetString(PyExc_ValueError, "delta: alphabet sizes must be in 1..64");
            return -1;
        }
    return 0;
}

static PyObject *py_delta_symbols(PyObject *self, PyObject *args) {
    Py_buffer bb, tb, thb, eb, ob, sb, zb, hb;
    int w;
    if (!PyArg_ParseTuple(args, "y*y*iy*y*y*w*w*w*", &bb, &tb, &w, &thb, &eb, &ob, &sb, &zb, &hb)) return NULL;
    PyObject *res = NULL;
    int K;
    int64_t n, es[MAXC], off[MAXC + 1];
    uint8_t lut[128];
    if (delta_enc_args("delta_symbols", &bb, &tb, w, &thb, &K, &n, lut) < 0 || parse_es(&eb, K, es) < 0) goto done;
    if (sb.len != n * 4 || parse_offsets(&ob, K - 1, n, off) < 0 || zb.len != n * w || hb.len != K * 65 * 8) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "delta_symbols: offsets, sym, esc or hist has the wrong size");
        goto done;
    }
    const uint8_t *b = bb.buf, *t = tb.buf;
    int32_t *sym = sb.buf;
    uint8_t *esc = zb.buf;
    int64_t *hist = hb.buf, so[MAXC], eo[MAXC];
    memcpy(so, off, K * 8);
    memcpy(eo, off, K * 8);
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    memset(hist, 0, K * 65 * 8);
#define CALL(W)                                                                   \
    for (int64_t i = 0; i < n; i++) {                                             \
        uint64_t bv = load_w(b, W, i), z = zigzag_w(bv, load_w(t, W, i), W);      \
        int c = DELTA_CLASS(bv, W);                                               \
        if (so[c] >= off[c + 1]) { ok = 0; break; }                               \
        int s = z < (uint64_t)es[c] ? (int)z : (int)es[c];                        \
        if (s == es[c]) store_w(esc, W, eo[c]++, z);                              \
        sym[so[c]++] = s;                                                         \
        hist[c * 65 + s]++;                                                       \
    }
    DISPATCH_WIDTH(w, CALL)
#undef CALL
    for (int c = 0; c < K; c++) ok &= so[c] == off[c + 1];
    Py_END_ALLOW_THREADS
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "delta_symbols: offsets do not match the classes");
        goto done;
    }
    res = PyList_New(K);
    for (int c = 0; res && c < K; c++) {
        PyObject *v = PyLong_FromLongLong(eo[c] - off[c]);
        if (!v) Py_CLEAR(res);
        else PyList_SET_ITEM(res, c, v);
    }
done:
    RELEASE(&bb, &tb, &thb, &eb, &ob, &sb, &zb, &hb);
    return res;
}

/* status: -1 ok, 100: the escape symbols do not match the escape stream's length, 200 + c: class c escapes a value below e */
static PyObject *py_delta_values(PyObject *self, PyObject *args) {
    Py_buffer bb, cb, sb, ob, eb, zb, outb;
    int w, K;
    if (!PyArg_ParseTuple(args, "y*iy*iy*y*y*y*w*", &bb, &w, &cb, &K, &sb, &ob, &eb, &zb, &outb)) return NULL;
    PyObject *res = NULL;
    int64_t n, es[MAXC], off[MAXC + 1];
    if (delta_common(&bb, &cb, w, K, &n) < 0 || parse_es(&eb, K, es) < 0) goto done;
    if (sb.len != n * 4 || outb.len != bb.len || parse_offsets(&ob, K - 1, n, off) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "delta_values: sym or out has the wrong size");
        goto done;
    }
    const uint8_t *b = bb.buf, *cls = cb.buf, *esc = zb.buf;
    const int32_t *sym = sb.buf;
    uint8_t *out = outb.buf;
    int64_t n_esc = zb.len / w, so[MAXC], eo[MAXC];
    int status = -1;
    Py_BEGIN_ALLOW_THREADS
    /* where each class's escapes start: classes come in order, each escape once per escape symbol */
    int64_t acc = 0;
    for (int c = 0; c < K; c++) {
        eo[c] = acc;
        for (int64_t i = off[c]; i < off[c + 1]; i++) acc += sym[i] == es[c];
        so[c] = off[c];
    }
    if (acc != n_esc || zb.len % w) status = 100;
    if (status < 0) {
#define CALL(W)                                                                   \
        for (int64_t i = 0; i < n; i++) {                                         \
            int c = K > 1 ? cls[i] : 0;                                           \
            uint64_t z = (uint64_t)sym[so[c]++];                                  \
            if (z == (uint64_t)es[c]) {                                           \
                z = load_w(esc, W, eo[c]++);                                      \
                if (z < (uint64_t)es[c]) { status = 200 + c; break; }             \
            }                                                                     \
            store_w(out, W, i, unzigzag_add_w(load_w(b, W, i), z, W));            \
        }
        DISPATCH_WIDTH(w, CALL)
#undef CALL
    }
    Py_END_ALLOW_THREADS
    res = PyLong_FromLong(status);
done:
    RELEASE(&bb, &cb, &sb, &ob, &eb, &zb, &outb);
    return res;
}
