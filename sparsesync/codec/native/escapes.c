/* native/escapes.c: choosing an escape alphabet: escape_costs, per histogram row the alphabet size
 * E in {1, 2, ..., 64} minimizing entropy + raw escapes + header bits (_encodings._escape_costs).
 *
 * Guarantee: counts are checked to lie in [0, 2^52) (exact in a double) before any cost is computed.
 * A fragment of _native.c, included after common.h and args.h.
 */

static const int ESC_CHOICES[] = {1, 2, 4, 8, 16, 32, 64};
#define N_ESC_CHOICES 7

static void escape_costs_row(const int64_t *h, double raw_bits, double *out_bits, int64_t *out_e) {
    double cum_clogc[ALPHA + 2], tail[ALPHA + 2], n = 0, cum = 0;
    for (int j = 0; j <= ALPHA; j++) n += (double)h[j]; /* integers below 2^53: exact in any order */
    cum_clogc[0] = 0;
    tail[0] = n;
    for (int j = 0; j <= ALPHA; j++) {
        double c = (double)h[j];
        cum_clogc[j + 1] = cum_clogc[j] + c * log2(c > 1.0 ? c : 1.0);
        cum += c;
        tail[j + 1] = n - cum;
    }
    double best = INFINITY;
    int best_i = 0;
    for (int i = 0; i < N_ESC_CHOICES; i++) {
        int e = ESC_CHOICES[i];
        double esc = tail[e] > 0 ? tail[e] : 0.0;
        double ent = n > 0 ? n * log2(n > 1.0 ? n : 1.0) - cum_clogc[e] - esc * log2(esc > 1.0 ? esc : 1.0) : 0.0;
        double bits = ent + esc * raw_bits + 24.0 * (e + 1);
        if (bits < best) {
            best = bits;
            best_i = i;
        }
        if (esc == 0) break; /* larger alphabets than the first without escapes cannot help */
    }
    *out_bits = best;
    *out_e = ESC_CHOICES[best_i];
}

static PyObject *py_escape_costs(PyObject *self, PyObject *args) {
    Py_buffer hb, bb, eb;
    double raw_bits;
    if (!PyArg_ParseTuple(args, "y*dw*w*", &hb, &raw_bits, &bb, &eb)) return NULL;
    PyObject *res = NULL;
    Py_ssize_t rows = hb.len / (8 * (ALPHA + 1));
    if (hb.len != rows * 8 * (ALPHA + 1) || bb.len != rows * 8 || eb.len != rows * 8) {
        PyErr_SetString(PyExc_ValueError, "escape_costs: hists must be int64 rows of 65 and both outputs one value per row");
        goto done;
    }
    const int64_t *h = hb.buf;
    for (Py_ssize_t i = 0; i < rows * (ALPHA + 1); i++) {
        if (h[i] < 0 || h[i] >= (1LL << 52)) {
            PyErr_SetString(PyExc_ValueError, "escape_costs: counts must be in [0, 2^52)");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++) escape_costs_row(h + r * (ALPHA + 1), raw_bits, (double *)bb.buf + r, (int64_t *)eb.buf + r);
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    RELEASE(&hb, &bb, &eb);
    return res;
}
