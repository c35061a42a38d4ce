/* native/section.c: the members of a patch's group section (docs/format.md, "Groups") read in
 * one call, not a dozen Python calls per member (issue 51: an adapter's hundreds of members).
 *
 *   section_members(data, pos, count, max_name, max_ndim, dim_hi)
 *       -> (names, shapes, numels, pos, status, member, field, value)
 *       From byte `pos` of `data`: `count` prefix-coded names (per name the varint length it
 *       shares with the previous name, at most that name's length, the varint length of the
 *       rest, at most max_name, and the rest's bytes; each name 1..max_name bytes of UTF-8),
 *       then `count` shapes (an ndim byte, at most max_ndim, and that many varint dims, each at
 *       most dim_hi). status 0: `names` (str), `shapes` (tuples of int) and `numels` (int64
 *       products, saturated at 2^62) of every member, `pos` after the last shape. Else `names`
 *       holds the names read before it stopped (all for fields 3 and 4), the other lists are
 *       None, and (pos, member, field, value) say where it stopped: field 0 shared prefix length,
 *       1 suffix length, 2 the name's bytes, 3 ndim, 4 a dim; status 1-4 as `varints` (ends
 *       inside, overlong, over its bound, longer than 9 bytes; value: what was read), 5 a name
 *       of `value` bytes, 6 a name that is not UTF-8, 7 an ndim of `value`.
 *
 * Guarantee: never reads past `data`; the varints are `varints`' (read_varint). A fragment of
 * _native.c, included after varints.c.
 */

#define SECTION_SAT ((int64_t)1 << 62)

/* The result of a call that stopped: the names read before (all of them for fields 3 and 4) */
static PyObject *section_fail(PyObject *names, Py_ssize_t named, Py_ssize_t pos, int status, Py_ssize_t member, int field, uint64_t value) {
    PyObject *some = PyList_GetSlice(names, 0, named);
    if (!some) return NULL;
    PyObject *res = Py_BuildValue("NOOniniK", some, Py_None, Py_None, pos, status, member, field, (unsigned long long)value);
    return res;
}

static PyObject *py_section_members(PyObject *self, PyObject *args) {
    Py_buffer d;
    Py_ssize_t pos, count, max_name;
    int max_ndim;
    unsigned long long dim_hi;
    if (!PyArg_ParseTuple(args, "y*nnniK", &d, &pos, &count, &max_name, &max_ndim, &dim_hi)) return NULL;
    PyObject *names = NULL, *shapes = NULL, *numels = NULL, *res = NULL;
    uint8_t *prev = NULL;
    if (pos < 0 || pos > d.len || count < 0 || max_name < 1 || max_name > (1 << 20) || max_ndim < 0 || max_ndim > 64) {
        PyErr_SetString(PyExc_ValueError, "section_members: pos, count, max_name or max_ndim out of range");
        goto done;
    }
    prev = PyMem_Malloc((size_t)max_name);
    names = PyList_New(0); /* appended to: a count the data cannot hold allocates nothing */
    shapes = PyList_New(0);
    numels = PyList_New(0);
    if (!prev || !names || !shapes || !numels) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    const uint8_t *p = d.buf;
    Py_ssize_t plen = 0;
    uint64_t v;
    int st;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t shared, rest;
        if ((st = read_varint(p, d.len, &pos, (uint64_t)plen, &shared))) { res = section_fail(names, i, pos, st, i, 0, shared); goto done; }
        if ((st = read_varint(p, d.len, &pos, (uint64_t)max_name, &rest))) { res = section_fail(names, i, pos, st, i, 1, rest); goto done; }
        if ((Py_ssize_t)rest > d.len - pos) { res = section_fail(names, i, pos, 1, i, 2, rest); goto done; }
        uint64_t n = shared + rest;
        if (n < 1 || n > (uint64_t)max_name) { res = section_fail(names, i, pos, 5, i, 2, n); goto done; }
        memcpy(prev + shared, p + pos, (size_t)rest);
        pos += (Py_ssize_t)rest;
        plen = (Py_ssize_t)n;
        PyObject *s = PyUnicode_DecodeUTF8((const char *)prev, plen, NULL);
        if (!s) {
            if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) goto done;
            PyErr_Clear();
            res = section_fail(names, i, pos, 6, i, 2, n);
            goto done;
        }
        int bad = PyList_Append(names, s);
        Py_DECREF(s);
        if (bad) goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (pos >= d.len) { res = section_fail(names, count, pos, 1, i, 3, 0); goto done; }
        int nd = p[pos++];
        if (nd > max_ndim) { res = section_fail(names, count, pos, 7, i, 3, (uint64_t)nd); goto done; }
        PyObject *shape = PyTuple_New(nd);
        if (!shape) goto done;
        int bad = PyList_Append(shapes, shape);
        Py_DECREF(shape); /* the list holds it; its items are filled below */
        if (bad) goto done;
        int64_t numel = 1;
        for (int k = 0; k < nd; k++) {
            if ((st = read_varint(p, d.len, &pos, (uint64_t)dim_hi, &v))) { res = section_fail(names, count, pos, st, i, 4, v); goto done; }
            PyObject *x = PyLong_FromUnsignedLongLong(v);
            if (!x) goto done;
            PyTuple_SET_ITEM(shape, k, x);
            numel = (v && numel > SECTION_SAT / (int64_t)v) ? SECTION_SAT : numel * (int64_t)v;
            if (numel > SECTION_SAT) numel = SECTION_SAT;
        }
        PyObject *x = PyLong_FromLongLong(numel);
        if (!x) goto done;
        bad = PyList_Append(numels, x);
        Py_DECREF(x);
        if (bad) goto done;
    }
    res = Py_BuildValue("OOOniniK", names, shapes, numels, pos, 0, (Py_ssize_t)0, 0, 0ULL);
done:
    Py_XDECREF(names);
    Py_XDECREF(shapes);
    Py_XDECREF(numels);
    PyMem_Free(prev);
    PyBuffer_Release(&d);
    return res;
}
