/* sparsesync.codec._native: the codec's passes over whole tensors and over every changed
 * element, in C.
 *
 * Guarantee: each function computes exactly what its numpy definition in
 * tests/codec/test_native.py computes (the tests compare them on every element width); it
 * never reads or writes outside the buffers it is given (every length and index is checked
 * here, whatever the caller passed, before the first write), and it releases the GIL while it
 * runs, so the codec's threads overlap on several cores. Buffers come in through the buffer
 * protocol (numpy arrays, bytes); nothing here allocates Python objects in the hot loops.
 * Built by setup.py (the definition is in _build.py).
 *
 *   diff_into(a, b, width, start, offset, out_idx, out_a, out_b[, hw]) -> (count, next)
 *       Bitwise compare of two element arrays (`width` bytes per element). Writes the flat
 *       indices plus `offset` (int64) and both sides' bits of changed elements from element
 *       `start` on, in order, until the outputs are full; returns how many it wrote and where
 *       to resume.
 *   class_ranks(base, width, thresholds, idx, offsets, out_rank[, hw]) -> None
 *       For sorted changed indices `idx`: the rank of each among the members of its class of
 *       the base magnitude (see docs/format.md, "Classes of the base magnitude"), written
 *       grouped by class (class c from offsets[c] on, in index order).
 *   class_select(base, width, thresholds, ranks, offsets, out_idx[, hw[, out_bits]]) -> int
 *       The inverse: ranks grouped by class (strictly increasing inside a class) to the sorted
 *       flat indices, and with `out_bits` the base's bits at them (read in the same pass).
 *       Returns -1 on success, else the class whose rank exceeds its members.
 *   hw_levels() -> list[int]
 *       The instruction levels this CPU runs: 0 portable, 1 BMI2's pdep (where it is fast: not
 *       AMD Zen 1/2), 2 AVX2 class masks and 2-byte diff, 3 AVX-512BW class masks. class_ranks and class_select take `hw` (-1, the
 *       default: the best level); every level gives the same result (the tests run them all).
 *   rans_encode(symbols, segment_offsets, counts, count_offsets) -> bytes
 *   rans_decode(data, counts, count_offsets, segment_offsets, out) -> status
 *       The entropy coder of format 2 (docs/format.md, "Entropy coding": rANS, 4 interleaved
 *       states, 14-bit frequencies quantized from each segment's integer counts). The decoder
 *       reads only inside `data`, writes only `out`, and returns 0, or the reason the stream
 *       is invalid (wrong length, bad state, too short, data left, no model).
 *   escape_costs(hists, raw_bits, out_bits, out_e) -> None
 *       Per row of `hists` (int64, rows x 65: counts of values 0..63 and of values >= 64):
 *       the alphabet size E in {1, 2, 4, ..., 64} minimizing entropy + raw escapes + header
 *       bits, and those bits (`_encodings._escape_costs`; its numpy definition is in the tests).
 *   classes(bits, width, thresholds, out) -> None
 *       The class (uint8) of each element: how many thresholds its magnitude key reaches.
 *   key_hist(base, width, starts, block, out) -> None
 *       Histogram (int64[128]) of the magnitude keys of the elements in [s, s + block) for s in starts.
 *   thresholds_dp(tot, chg, max_classes, min_gain) -> list[int]
 *       The class thresholds of `_select.choose_thresholds` from its two key histograms (float64[128]).
 *   varints(data, pos, count, hi) -> (list[int] | None, pos, value, status)
 *       `count` LEB128 varints from byte `pos` (at most 9 bytes each, no overlong forms, each
 *       at most `hi`): (values, the byte after the last, 0, 0), or (None, where reading
 *       stopped, the value read, status): 1 the data ends, 2 overlong, 3 over `hi`, 4 longer
 *       than 9 bytes. varints_put(out, values, count) appends values[:count] to a bytearray.
 *   section_members(data, pos, count, max_name, max_ndim, dim_hi) -> (names, shapes, numels, pos, status, member, field, value)
 *       The prefix-coded names and the shapes of a group section's members (native/section.c).
 *   take(src, width, idx, out) / put(dst, width, idx, values, old) -> None
 *       Gather and scatter of elements at int64 indices; put checks every index before the
 *       first write, and saves the overwritten elements into `old` (if not empty).
 *       The low k bits of int64 values, least significant first, as a little-endian bit stream.
 *   gap_khist(ranks, step, k0, hists) / gap_symbols(ranks, k, e, sym, esc, hist, low, low_offset) -> n_escaped
 *   gap_ranks(sym, e, esc, esc_offset, k, low, low_offset, numel, out) -> (status, next escape)
 *       Encoder and decoder of one class's gaps (docs/format.md, "gaps"; gap i = ranks[i] -
 *       ranks[i - 1] - 1): quotient g >> k as a symbol (escaped raw at >= e), remainder as k raw
 *       bits; the decoder turns them back into ranks and checks escapes, quotients and the
 *       running rank against the tensor's size. gap_khist counts every step-th gap's quotient
 *       for each candidate k0, k0 + 1, ... (clipped at 64).
 *   delta_hist(base, target, width, thresholds, hist[, step]) / delta_symbols(base, target, width, thresholds, es, offsets, sym, esc, hist) -> n_escaped per class
 *   delta_values(base, width, cls, K, sym, offsets, es, esc, out) -> status
 *       Encoder and decoder of the `delta` values: zigzag of the wrapped bit-pattern difference,
 *       grouped by class (position order inside a class), symbols >= e escaped raw (width bytes).
 *       The encoder passes take each element's class from its base bits and the thresholds;
 *       delta_hist counts every step-th value (clipped at 64) per class; delta_symbols writes
 *       the symbols, class c's escapes from esc[offsets[c]] on, and the symbols' histogram.
 *   block_digests(data, out[, threads[, hw]]) -> None
 *       XXH3-64 of each 65536-byte block of `data` (the last zero-padded), into uint64 `out`:
 *       the blocks of the tensor digest "xxh3b" (docs/format.md, "Digests"; native/blocks.c).
 *   members_blocks(bufs, out) -> None
 *       block_digests of each buffer of a list, end to end (native/members.c).
 *   members_take(ptrs, width, offsets, idx, out) / members_copy(ptrs, width, offsets, out) -> None
 *   members_put(ptrs, width, idx, offsets, values, old, before, after) -> None
 *       A group's members given by address: the base bits at positions of their concatenation,
 *       the whole concatenation, and a group's writes into its members, each member's blocks
 *       hashed before and after its writes (native/members.c).
 *   members_diff(base, members, width, member, elem, out_idx, out_a, out_b, counts[, hw]) -> (count, member, elem)
 *       diff_into of a group's flat copy against its members, each a buffer of its own: flat
 *       indices, both sides' bits, each member's count of changes; resumable (native/members_diff.c).
 *   join(pieces) -> bytes
 *       b"".join(pieces) for a list of bytes-like objects, copied with the GIL released into
 *       memory advised for transparent huge pages (as numpy does for its large arrays): a patch
 *       of tens of MB costs tens of page faults to build instead of thousands.
 *
 * Layout (python-zstandard style: one translation unit, one file per concept, each starting with
 * what it owns and guarantees; they are included below, in dependency order, and compiled only
 * through this file):
 *   native/common.h      headers, HW levels, limits, bit and element-width helpers
 *   native/args.h        argument checks and buffer release shared by the entry points
 *   native/classes.c     magnitude keys, class masks (portable, AVX2, AVX-512), classes()
 *   native/ranks.c       class_ranks
 *   native/select.c      class_select
 *   native/diff.c        diff_into
 *   native/thresholds.c  key_hist, thresholds_dp
 *   native/escapes.c     escape_costs
 *   native/rans.c        rans_encode, rans_decode
 *   native/copy.c        take, put, join
 *   native/varints.c     varints, varints_put
 *   native/section.c     section_members (the members of a group section)
 *   native/gaps.c        gap_khist, gap_symbols, gap_ranks
 *   native/deltas.c      delta_hist, delta_symbols, delta_values
 *   native/blocks.c      block_digests (the blocks of the tensor digest "xxh3b")
 *   native/members.c     members_blocks, members_take, members_copy, members_put (a group's small
 *                        tensors in one call each)
 *   native/members_diff.c members_diff (a group's members diffed against its flat copy in one call)
 * This file holds the module itself: hw_levels, the method table and module init.
 */

#include "native/common.h"
#include "native/args.h"
#include "native/classes.c"
#include "native/ranks.c"
#include "native/select.c"
#include "native/diff.c"
#include "native/thresholds.c"
#include "native/escapes.c"
#include "native/rans.c"
#include "native/copy.c"
#include "native/varints.c"
#include "native/section.c"
#include "native/gaps.c"
#include "native/deltas.c"
#include "native/blocks.c"
#include "native/members.c"
#include "native/members_diff.c"

static PyObject *py_hw_levels(PyObject *self, PyObject *args) {
    PyObject *out = PyList_New(HW_BEST + 1);
    for (int i = 0; out && i <= HW_BEST; i++) PyList_SET_ITEM(out, i, PyLong_FromLong(i));
    return out;
}

static PyMethodDef methods[] = {
    {"hw_levels", py_hw_levels, METH_NOARGS, "hw_levels() -> the HW levels this CPU runs (0 portable, 1 BMI2, 2 AVX2, 3 AVX-512)"},
    {"diff_into", py_diff_into, METH_VARARGS, "diff_into(a, b, width, start, offset, out_idx, out_a, out_b[, hw]) -> (count, next)"},
    {"class_ranks", py_class_ranks, METH_VARARGS, "class_ranks(base, width, thresholds, idx, offsets, out_rank[, hw]) -> None"},
    {"class_select", py_class_select, METH_VARARGS, "class_select(base, width, thresholds, ranks, offsets, out_idx[, hw[, out_bits]]) -> -1 or the failing class"},
    {"classes", py_classes, METH_VARARGS, "classes(bits, width, thresholds, out) -> None"},
    {"key_hist", py_key_hist, METH_VARARGS, "key_hist(base, width, starts, block, out) -> None"},
    {"rans_encode", py_rans_encode, METH_VARARGS, "rans_encode(symbols, segment_offsets, counts, count_offsets) -> bytes"},
    {"rans_decode", py_rans_decode, METH_VARARGS, "rans_decode(data, counts, count_offsets, segment_offsets, out) -> status"},
    {"escape_costs", py_escape_costs, METH_VARARGS, "escape_costs(hists, raw_bits, out_bits, out_e) -> None"},
    {"thresholds_dp", py_thresholds_dp, METH_VARARGS, "thresholds_dp(tot, chg, max_classes, min_gain) -> list[int]"},
    {"take", py_take, METH_VARARGS, "take(src, width, idx, out) -> None"},
    {"varints", py_varints, METH_VARARGS, "varints(data, pos, count, hi) -> (values or None, pos, value, status)"},
    {"section_members", py_section_members, METH_VARARGS, "section_members(data, pos, count, max_name, max_ndim, dim_hi) -> (names, shapes, numels, pos, status, member, field, value)"},
    {"varints_put", py_varints_put, METH_VARARGS, "varints_put(out, values, count) -> None"},
    {"members_blocks", py_members_blocks, METH_VARARGS, "members_blocks(bufs, out) -> None"},
    {"members_take", py_members_take, METH_VARARGS, "members_take(ptrs, width, offsets, idx, out) -> None"},
    {"members_copy", py_members_copy, METH_VARARGS, "members_copy(ptrs, width, offsets, out) -> None"},
    {"members_put", py_members_put, METH_VARARGS, "members_put(ptrs, width, idx, offsets, values, old, before, after) -> None"},
    {"members_diff", py_members_diff, METH_VARARGS, "members_diff(base, members, width, member, elem, out_idx, out_a, out_b, counts[, hw]) -> (count, member, elem)"},
    {"put", py_put, METH_VARARGS, "put(dst, width, idx, values, old) -> None"},
    {"gap_khist", py_gap_khist, METH_VARARGS, "gap_khist(ranks, step, k0, hists) -> None"},
    {"gap_symbols", py_gap_symbols, METH_VARARGS, "gap_symbols(ranks, k, e, sym, esc, hist, low, low_offset) -> n_escaped"},
    {"gap_ranks", py_gap_ranks, METH_VARARGS, "gap_ranks(sym, e, esc, esc_offset, k, low, low_offset, numel, out) -> (status, next escape)"},
    {"delta_hist", py_delta_hist, METH_VARARGS, "delta_hist(base, target, width, thresholds, hist[, step]) -> None"},
    {"delta_symbols", py_delta_symbols, METH_VARARGS, "delta_symbols(base, target, width, thresholds, es, offsets, sym, esc, hist) -> list[int]"},
    {"delta_values", py_delta_values, METH_VARARGS, "delta_values(base, width, cls, K, sym, offsets, es, esc, out) -> -1 or a status"},
    {"block_digests", py_block_digests, METH_VARARGS, "block_digests(data, out[, threads[, hw]]) -> None"},
    {"join", py_join, METH_O, "join(pieces) -> bytes (b\"\".join, the GIL released, into huge-page-advised memory)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "The codec's full-tensor passes in C (see the file's header).", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    for (int v = 0; v < 256; v++) {
        int k = 0;
        for (int b = 0; b < 8; b++)
            if (v >> b & 1) SEL8[v][k++] = (uint8_t)b;
        for (int j = 0; j < 8; j++) SHUF16[v][2 * j] = (uint8_t)(2 * SEL8[v][j]), SHUF16[v][2 * j + 1] = (uint8_t)(2 * SEL8[v][j] + 1);
    }
#ifdef SS_X86
    __builtin_cpu_init();
    /* pdep is microcoded (hundreds of cycles) on AMD before Zen 3: the portable path is faster there */
    if (__builtin_cpu_supports("bmi2") && !__builtin_cpu_is("znver1") && !__builtin_cpu_is("znver2")) {
        HW_BEST = HW_BMI2;
        if (__builtin_cpu_supports("avx2")) {
            HW_BEST = HW_AVX2;
            if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
                HW_BEST = HW_AVX512;
        }
    }
#endif
    return PyModule_Create(&module);
}
