/* native/rans.c: the entropy coder of format 2 (docs/format.md, "Entropy coding"): rANS with 4
 * interleaved 64-bit states and 14-bit frequencies quantized from integer counts, and its entry
 * points rans_encode and rans_decode.
 *
 * Guarantee: the decoder reads only inside `data`, writes only `out`, and returns 0 or the reason
 * the stream is invalid; models and segment offsets are checked before either pass.
 * A fragment of _native.c, included after common.h and args.h.
 */

/* Range ANS with a 64-bit state in [RANS_L, RANS_L << 32), 32-bit words, PROB_BITS-bit
 * frequencies quantized from integer counts (docs/format.md, "Entropy coding"). The stream is
 * the final state (u64) and then the words in the order the decoder reads them; empty when
 * nothing was pushed (no symbols, or only certain ones). */
#define PROB_BITS 14
#define PROB_M (1u << PROB_BITS)
#define RANS_L (1ULL << 31)
#define MAX_SYMS (ALPHA + 1) /* symbols of a model: direct values and the escape */

/* freq[s] = 0 where counts[s] = 0, else max(1, counts[s] * M / total) rounded down; then the
 * first largest frequency takes up the difference to M. Returns -1 if no count is positive. */
static int quantize(const int64_t *counts, int n, uint32_t *freq, uint32_t *start) {
    uint64_t total = 0;
    for (int s = 0; s < n; s++) total += (uint64_t)counts[s];
    if (total == 0) return -1;
    int64_t sum = 0;
    int big = 0;
    for (int s = 0; s < n; s++) {
        uint64_t f = counts[s] ? (uint64_t)counts[s] * PROB_M / total : 0; /* counts < 2^40: no overflow */
        freq[s] = counts[s] && f == 0 ? 1 : (uint32_t)f;
        sum += freq[s];
        if (freq[s] > freq[big]) big = s;
    }
    freq[big] = (uint32_t)((int64_t)freq[big] + (int64_t)PROB_M - sum);
    uint32_t c = 0;
    for (int s = 0; s < n; s++) {
        start[s] = c;
        c += freq[s];
    }
    return 0;
}

/* Models of a stream's segments: counts_all (int64, concatenated), cofs (int64[n_seg + 1]). */
static int check_models(const int64_t *counts_all, Py_ssize_t n_counts, const int64_t *cofs, Py_ssize_t n_seg) {
    if (cofs[0] != 0 || cofs[n_seg] != n_counts) return -1;
    for (Py_ssize_t g = 0; g < n_seg; g++) {
        int64_t k = cofs[g + 1] - cofs[g];
        if (k < 1 || k > MAX_SYMS) return -1;
    }
    for (Py_ssize_t i = 0; i < n_counts; i++)
        if (counts_all[i] < 0 || counts_all[i] >= (1LL << 40)) return -1;
    return 0;
}

/* Symbol i of a stream (counted across its segments) is coded by state i % RANS_WAYS, so
 * that a decoder keeps RANS_WAYS independent chains in flight. The encoder runs backwards:
 * segment n_seg-1 down to 0, each backwards, writing words downwards from `end`; then the
 * states, so that the decoder reads states 0..WAYS-1 first and every word in the order it
 * needs them. Returns the first byte of the stream (`end` if empty), or NULL if a symbol is
 * outside its model or has a zero count. */
#define RANS_WAYS 4

/* One symbol's encoding step without a division: x -> (x / f) * M + x % f + start equals
 * x + bias + q * (M - f) with q = x / f taken as the high half of x * rcp, shifted (exact for
 * every state x < 2^63, which rANS keeps; f = 1 uses rcp = 2^64 - 1, q = x - 1 and a bias
 * of start + M - 1). The same arithmetic as ryg's public-domain rans64.h. 32 bytes (bias <
 * 2^15 and M - f < 2^14 fit 32 bits): a table entry is found with one shift. */
typedef struct {
    uint64_t x_max, rcp;
    uint32_t bias, cmpl;
    uint32_t shift, invalid; /* invalid: a symbol the model cannot code (zero count, or the sentinel past it) */
} EncSym;

static void enc_sym_init(EncSym *e, uint32_t start, uint32_t freq) {
    e->invalid = freq == 0;
    e->x_max = ((RANS_L >> PROB_BITS) << 32) * freq;
    e->cmpl = PROB_M - freq;
    if (freq < 2) { /* freq 0 is never coded (the caller rejects it); 1 as above */
        e->rcp = ~0ULL;
        e->shift = 0;
        e->bias = start + PROB_M - 1;
        return;
    }
    int shift = 0;
    while (freq > (1u << shift)) shift++;
    /* rcp = ceil(2^(shift + 63) / freq), by long division in two 32-bit halves */
    uint64_t x1 = 1ULL << (shift + 31), x0 = freq - 1, t1 = x1 / freq;
    x0 += (x1 % freq) << 32;
    e->rcp = (x0 / freq) + (t1 << 32);
    e->shift = shift - 1;
    e->bias = start;
}

static uint8_t *rans_encode_all(const int32_t *sym, const int64_t *sofs, Py_ssize_t n_seg, const int64_t *counts_all, const int64_t *cofs, uint8_t *end) {
    uint64_t x[RANS_WAYS];
    for (int j = 0; j < RANS_WAYS; j++) x[j] = RANS_L;
    uint32_t *w = (uint32_t *)end;
    for (Py_ssize_t g = n_seg - 1; g >= 0; g--) {
        uint32_t freq[MAX_SYMS], start[MAX_SYMS];
        EncSym es[MAX_SYMS + 1];
        int k = (int)(cofs[g + 1] - cofs[g]);
        if (sofs[g + 1] == sofs[g]) continue;
        if (quantize(counts_all + cofs[g], k, freq, start) < 0) return NULL;
        for (int s = 0; s < k; s++) enc_sym_init(&es[s], start[s], freq[s]);
        enc_sym_init(&es[k], 0, 1);
        es[k].invalid = 1;
        int64_t i = sofs[g + 1] - 1, lo = sofs[g];
        uint64_t x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3];
        int bad = 0;
#define ENC_STEP(X, I)                                                                  \
    do {                                                                                \
        uint32_t s_ = (uint32_t)sym[I];                                                 \
        s_ = s_ < (uint32_t)k ? s_ : (uint32_t)k; /* out of the model: the sentinel */  \
        const EncSym *e_ = &es[s_];                                                     \
        bad |= e_->invalid;                                                             \
        int r_ = X >= e_->x_max;                                                        \
        w[-1] = (uint32_t)X;                                                            \
        w -= r_;                                                                        \
        X = r_ ? X >> 32 : X;                                                           \
        X += (uint64_t)e_->bias + ((uint64_t)(((unsigned __int128)X * e_->rcp) >> 64) >> e_->shift) * (uint64_t)e_->cmpl; \
    } while (0)
        for (; i >= lo && (i & 3) != 3; i--) {
            switch (i & 3) {
            case 0: ENC_STEP(x0, i); break;
            case 1: ENC_STEP(x1, i); break;
            default: ENC_STEP(x2, i); break;
            }
        }
        for (; i - 3 >= lo; i -= 4) {
            ENC_STEP(x3, i);
            ENC_STEP(x2, i - 1);
            ENC_STEP(x1, i - 2);
            ENC_STEP(x0, i - 3);
        }
        for (; i >= lo; i--) {
            switch (i & 3) {
            case 3: ENC_STEP(x3, i); break;
            case 2: ENC_STEP(x2, i); break;
            default: ENC_STEP(x1, i); break;
            }
        }
#undef ENC_STEP
        x[0] = x0, x[1] = x1, x[2] = x2, x[3] = x3;
        if (bad) return NULL; /* a symbol outside its model or with a zero count: its step was garbage */
    }
    int untouched = w == (uint32_t *)end;
    for (int j = 0; j < RANS_WAYS; j++) untouched &= x[j] == RANS_L;
    if (untouched) return end;
    for (int j = RANS_WAYS - 1; j >= 0; j--) {
        w -= 2;
        memcpy(w, &x[j], 8);
    }
    return (uint8_t *)w;
}

/* 0 ok; 1 length not 0 or 8 * WAYS + 4m; 2 a bad initial state; 3 words run out; 4 words left
 * or a state other than the initial one after the last symbol; 5 a segment with symbols has no
 * positive count. */
static int rans_decode_all(const uint8_t *data, Py_ssize_t len, const int64_t *counts_all, const int64_t *cofs, const int64_t *sofs, Py_ssize_t n_seg, int32_t *out) {
    uint64_t x0 = RANS_L, x1 = RANS_L, x2 = RANS_L, x3 = RANS_L;
    const uint8_t *p = data, *end = data + len;
    if (len) {
        if (len < 8 * RANS_WAYS || (len - 8 * RANS_WAYS) % 4) return 1;
        memcpy(&x0, p, 8);
        memcpy(&x1, p + 8, 8);
        memcpy(&x2, p + 16, 8);
        memcpy(&x3, p + 24, 8);
        p += 32;
        if (x0 < RANS_L || x1 < RANS_L || x2 < RANS_L || x3 < RANS_L || (x0 | x1 | x2 | x3) >= (RANS_L << 32)) return 2;
    }
    static __thread uint8_t table[PROB_M];
    for (Py_ssize_t g = 0; g < n_seg; g++) {
        int64_t i = sofs[g], n_end = sofs[g + 1];
        if (i == n_end) continue;
        uint32_t freq[MAX_SYMS], start[MAX_SYMS];
        int k = (int)(cofs[g + 1] - cofs[g]);
        if (quantize(counts_all + cofs[g], k, freq, start) < 0) return 5;
        for (int s = 0; s < k; s++)
            if (freq[s]) memset(table + start[s], s, freq[s]);
        /* one step of state X: decode symbol i, then refill X from the stream if it fell below L
         * (without a branch on the refill itself: it happens at random) */
#define STEP(X)                                                                  \
    do {                                                                         \
        uint32_t slot = (uint32_t)X & (PROB_M - 1);                              \
        int s = table[slot];                                                     \
        X = (uint64_t)freq[s] * (X >> PROB_BITS) + slot - start[s];              \
        out[i++] = s;                                                            \
        uint64_t need = X < RANS_L;                                              \
        if (__builtin_expect(need && end - p < 4, 0)) return 3;                  \
        uint32_t v = 0;                                                          \
        if (end - p >= 4) memcpy(&v, p, 4);                                      \
        X = need ? (X << 32) | v : X;                                            \
        p += 4 * need;                                                           \
    } while (0)
        while (i < n_end && (i & 3)) { /* up to the next index that state 0 codes */
            switch (i & 3) {
            case 1: STEP(x1); break;
            case 2: STEP(x2); break;
            default: STEP(x3); break;
            }
        }
        while (n_end - i >= 4) {
            STEP(x0);
            STEP(x1);
            STEP(x2);
            STEP(x3);
        }
        while (i < n_end) {
            switch (i & 3) {
            case 0: STEP(x0); break;
            case 1: STEP(x1); break;
            default: STEP(x2); break;
            }
        }
#undef STEP
    }
    return (p != end || x0 != RANS_L || x1 != RANS_L || x2 != RANS_L || x3 != RANS_L) ? 4 : 0;
}

/* segment offsets: int64[n_seg + 1] rising from 0 to `total` */
static int parse_segments(Py_buffer *b, Py_ssize_t n_seg, int64_t total) {
    const int64_t *o = b->buf;
    if (b->len != (Py_ssize_t)sizeof(int64_t) * (n_seg + 1) || o[0] != 0 || o[n_seg] != total) return -1;
    for (Py_ssize_t g = 0; g < n_seg; g++)
        if (o[g + 1] < o[g]) return -1;
    return 0;
}

static PyObject *py_rans_encode(PyObject *self, PyObject *args) {
    Py_buffer sb, sob, cb, cob;
    if (!PyArg_ParseTuple(args, "y*y*y*y*", &sb, &sob, &cb, &cob)) return NULL;
    PyObject *res = NULL;
    Py_ssize_t n_seg = cob.len / 8 - 1, n = sb.len / 4;
    if (sb.len % 4 || cb.len % 8 || cob.len % 8 || n_seg < 0 || parse_segments(&sob, n_seg, n) < 0 ||
        check_models(cb.buf, cb.len / 8, cob.buf, n_seg) < 0) {
        PyErr_SetString(PyExc_ValueError, "rans_encode: symbols, segment offsets or models are malformed");
        goto done;
    }
    Py_ssize_t cap = 4 * n + 8 * RANS_WAYS; /* at most one word per symbol, plus the states */
    res = PyBytes_FromStringAndSize(NULL, cap);
    if (!res) goto done;
    uint8_t *buf = (uint8_t *)PyBytes_AS_STRING(res), *first;
    Py_BEGIN_ALLOW_THREADS
    first = rans_encode_all(sb.buf, sob.buf, n_seg, cb.buf, cob.buf, buf + cap);
    if (first) memmove(buf, first, (size_t)(buf + cap - first));
    Py_END_ALLOW_THREADS
    if (!first) {
        Py_CLEAR(res);
        PyErr_SetString(PyExc_ValueError, "rans_encode: a symbol is outside its model or has a zero count");
        goto done;
    }
    _PyBytes_Resize(&res, buf + cap - first);
done:
    RELEASE(&sb, &sob, &cb, &cob);
    return res;
}

static PyObject *py_rans_decode(PyObject *self, PyObject *args) {
    Py_buffer db, cb, cob, sob, ob;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*", &db, &cb, &cob, &sob, &ob)) return NULL;
    PyObject *res = NULL;
    Py_ssize_t n_seg = cob.len / 8 - 1;
    if (ob.len % 4 || cb.len % 8 || cob.len % 8 || n_seg < 0 || parse_segments(&sob, n_seg, ob.len / 4) < 0 ||
        check_models(cb.buf, cb.len / 8, cob.buf, n_seg) < 0) {
        PyErr_SetString(PyExc_ValueError, "rans_decode: models, segment offsets or out are malformed");
        goto done;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = rans_decode_all(db.buf, db.len, cb.buf, cob.buf, sob.buf, n_seg, ob.buf);
    Py_END_ALLOW_THREADS
    res = PyLong_FromLong(status);
done:
    RELEASE(&db, &cb, &cob, &sob, &ob);
    return res;
}
