/* native/thresholds.c: choosing the class thresholds: key_hist (histogram of the magnitude keys
 * of sampled blocks) and thresholds_dp (the dynamic program of _select.choose_thresholds over
 * two such histograms, costed by xlogx_cost).
 *
 * Guarantee: key_hist checks every block against the tensor's size before reading it.
 * A fragment of _native.c, included after common.h and args.h.
 */

static double xlogx_cost(double t, double c) { /* bits to code c changes among t elements */
    t = t > c ? t : c;
    double p = t > 0 ? c / t : 0.0;
    double h = -((p > 0 ? p * log2(p) : 0.0) + (p < 1 ? (1 - p) * log2(1 - p) : 0.0));
    return t * h;
}

static PyObject *py_key_hist(PyObject *self, PyObject *args) {
    Py_buffer base, sb, outb;
    int w;
    long long block;
    if (!PyArg_ParseTuple(args, "y*iy*Lw*", &base, &w, &sb, &block, &outb)) return NULL;
    PyObject *res = NULL;
    if (check_width(w) < 0) goto done;
    int64_t n = base.len / w, ns = sb.len / 8;
    if (base.len % w || sb.len % 8 || outb.len != 128 * 8 || block < 0) {
        PyErr_SetString(PyExc_ValueError, "key_hist: base, starts, block or out has the wrong size");
        goto done;
    }
    const int64_t *st = sb.buf;
    for (int64_t i = 0; i < ns; i++) {
        if (st[i] < 0 || st[i] + block > n) {
            PyErr_Format(PyExc_ValueError, "key_hist: block at %lld runs past %lld elements", (long long)st[i], (long long)n);
            goto done;
        }
    }
    int64_t *h = outb.buf;
    Py_BEGIN_ALLOW_THREADS
    int64_t h4[4][128] = {{0}}; /* four counters break the store-to-load chain of repeated keys */
    const uint8_t *p = (const uint8_t *)base.buf + (w - 1);
    for (int64_t i = 0; i < ns; i++) {
        int64_t j = st[i], e = st[i] + block;
        for (; j + 4 <= e; j += 4) {
            h4[0][p[j * w] & 0x7f]++;
            h4[1][p[(j + 1) * w] & 0x7f]++;
            h4[2][p[(j + 2) * w] & 0x7f]++;
            h4[3][p[(j + 3) * w] & 0x7f]++;
        }
        for (; j < e; j++) h4[0][p[j * w] & 0x7f]++;
    }
    for (int k = 0; k < 128; k++) h[k] = h4[0][k] + h4[1][k] + h4[2][k] + h4[3][k];
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    RELEASE(&base, &sb, &outb);
    return res;
}

static PyObject *py_thresholds_dp(PyObject *self, PyObject *args) {
    Py_buffer tb, cb;
    int kmax;
    double min_gain;
    if (!PyArg_ParseTuple(args, "y*y*id", &tb, &cb, &kmax, &min_gain)) return NULL;
    PyObject *res = NULL;
    if (tb.len != 128 * 8 || cb.len != 128 * 8 || kmax < 1 || kmax > MAXC) {
        PyErr_SetString(PyExc_ValueError, "thresholds_dp: expected two float64[128] histograms and 1..8 classes");
        goto done;
    }
    const double *tot = tb.buf, *chg = cb.buf;
    int lo = -1, hi = -1;
    for (int i = 0; i < 128; i++)
        if (tot[i] + chg[i] != 0) {
            if (lo < 0) lo = i;
            hi = i + 1;
        }
    res = PyList_New(0);
    if (!res || lo < 0) goto done;
    int B = hi - lo;
    double ct[129], cc[129], dp[MAXC][129];
    int back[MAXC][129];
    double(*cost)[129] = PyMem_RawMalloc(sizeof(double) * 129 * 129);
    if (!cost) {
        Py_CLEAR(res);
        PyErr_NoMemory();
        goto done;
    }
    ct[0] = cc[0] = 0;
    for (int i = 0; i < B; i++) {
        ct[i + 1] = ct[i] + tot[lo + i];
        cc[i + 1] = cc[i] + chg[lo + i];
    }
    for (int a = 0; a <= B; a++)
        for (int b = 0; b <= B; b++) cost[a][b] = b > a ? xlogx_cost(ct[b] - ct[a], cc[b] - cc[a]) : INFINITY;
    for (int b = 0; b <= B; b++) dp[0][b] = cost[0][b];
    for (int k = 1; k < kmax; k++) {
        for (int b = 0; b <= B; b++) {
            double best = INFINITY;
            int arg = 0;
            for (int a = 0; a <= B; a++) {
                double v = dp[k - 1][a] + cost[a][b];
                if (v < best) {
                    best = v;
                    arg = a;
                }
            }
            dp[k][b] = best;
            back[k - 1][b] = arg;
        }
    }
    int best_k = 0;
    for (int k = 1; k < kmax; k++)
        if (dp[k][B] < dp[best_k][B] * (1 - min_gain)) best_k = k;
    PyMem_RawFree(cost);
    int cuts[MAXC], nc = 0, b = B;
    for (int k = best_k; k > 0; k--) {
        int a = back[k - 1][b];
        cuts[nc++] = lo + a;
        b = a;
    }
    for (int i = nc - 1; i >= 0; i--) { /* backtracking yields them in decreasing order */
        if (cuts[i] < 1 || cuts[i] > 127) continue;
        PyObject *v = PyLong_FromLong(cuts[i]);
        if (!v || PyList_Append(res, v) < 0) {
            Py_XDECREF(v);
            Py_CLEAR(res);
            goto done;
        }
        Py_DECREF(v);
    }
done:
    RELEASE(&tb, &cb);
    return res;
}
