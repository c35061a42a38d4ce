/* native/args.h: the Python side every entry point shares: releasing the buffers it took
 * (RELEASE), and the checks of its arguments (element width, HW level, thresholds, class
 * offsets, and check_class_args for class_ranks and class_select).
 *
 * Guarantee: each check either fills its outputs from a valid argument or sets a ValueError and
 * returns -1; entry points call them before their first write.
 * A fragment of _native.c, included after common.h.
 */

static void release(Py_buffer **bufs, size_t n) {
    for (size_t i = 0; i < n; i++) PyBuffer_Release(bufs[i]);
}
#define RELEASE(...)                                          \
    do {                                                      \
        Py_buffer *bufs_[] = {__VA_ARGS__};                   \
        release(bufs_, sizeof bufs_ / sizeof bufs_[0]);       \
    } while (0)

static int check_width(int w) {
    if (w != 1 && w != 2 && w != 4 && w != 8) {
        PyErr_Format(PyExc_ValueError, "element width %d, expected 1, 2, 4 or 8", w);
        return -1;
    }
    return 0;
}

/* hw: -1 for the best level this CPU has, else a level it has */
static int parse_hw(int hw) {
    if (hw == -1) return HW_BEST;
    if (hw < 0 || hw > HW_BEST) {
        PyErr_Format(PyExc_ValueError, "hw level %d, expected -1 or 0..%d (what this CPU has)", hw, HW_BEST);
        return -1;
    }
    return hw;
}

static int parse_thresholds(Py_buffer *tb, int *thr, int *nt) {
    if (tb->len >= MAXC) {
        PyErr_Format(PyExc_ValueError, "%zd thresholds, expected fewer than %d", tb->len, MAXC);
        return -1;
    }
    const uint8_t *t = tb->buf;
    for (Py_ssize_t i = 0; i < tb->len; i++) {
        if (t[i] < 1 || t[i] > 127 || (i && t[i] <= t[i - 1])) {
            PyErr_SetString(PyExc_ValueError, "thresholds must be increasing integers in [1, 127]");
            return -1;
        }
        thr[i] = t[i];
    }
    *nt = (int)tb->len;
    return 0;
}

/* offsets: int64[nt + 2], non-decreasing from 0 to total (class c owns [offsets[c], offsets[c+1])) */
static int parse_offsets(Py_buffer *ob, int nt, int64_t total, int64_t *off) {
    if (ob->len != (Py_ssize_t)sizeof(int64_t) * (nt + 2)) {
        PyErr_Format(PyExc_ValueError, "offsets hold %zd bytes, expected %d int64", ob->len, nt + 2);
        return -1;
    }
    memcpy(off, ob->buf, sizeof(int64_t) * (nt + 2));
    if (off[0] != 0 || off[nt + 1] != total) goto bad;
    for (int c = 0; c <= nt; c++)
        if (off[c + 1] < off[c]) goto bad;
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "offsets must rise from 0 to the number of elements");
    return -1;
}

/* What class_ranks and class_select share: base bits of `w` bytes, thresholds, an int64 array
 * `vals` grouped by class at `off`, an int64 output as long as `vals`, and the HW level. */
static int check_class_args(const char *fn, Py_buffer *base, int w, Py_buffer *tb, Py_buffer *vals, Py_buffer *ob, Py_buffer *outb, int *thr, int *nt, int64_t *off, int *hw) {
    if (check_width(w) < 0 || parse_thresholds(tb, thr, nt) < 0 || (*hw = parse_hw(*hw)) < 0) return -1;
    if (base->len % w || vals->len % 8 || outb->len != vals->len) {
        PyErr_Format(PyExc_ValueError, "%s: base, indices or out has the wrong size", fn);
        return -1;
    }
    return parse_offsets(ob, *nt, vals->len / 8, off);
}
