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
 *   join(pieces) -> bytes
 *       b"".join(pieces) for a list of bytes-like objects, copied with the GIL released into
 *       memory advised for transparent huge pages (as numpy does for its large arrays): a patch
 *       of tens of MB costs tens of page faults to build instead of thousands.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h> /* madvise(MADV_HUGEPAGE) in join */
#endif
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h> /* BMI2, AVX2 and AVX-512, used only where the CPU has them (see HW levels) */
#define SS_X86 1
#define T512 __attribute__((target("avx512f,avx512bw,bmi2,popcnt")))
#define T256 __attribute__((target("avx2,bmi2,popcnt")))
#endif

/* HW levels: which instructions a pass may use. Each level computes the same result; tests run
 * every level the CPU has (`hw_levels()`), and callers get the best one (hw=-1). */
enum { HW_PORTABLE = 0, HW_BMI2 = 1, HW_AVX2 = 2, HW_AVX512 = 3 };
static int HW_BEST = HW_PORTABLE;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the patch format is little-endian; this file reads it with native loads"
#endif

#define MAXC 8 /* classes (MAX_CLASSES in _encodings.py) */

static uint8_t SEL8[256][8]; /* SEL8[b][k]: position of the k-th set bit of byte b (0 past the last) */
static uint8_t SHUF16[256][16]; /* pshufb mask packing the 2-byte lanes set in b to the front */

static inline int popc(uint64_t x) { return __builtin_popcountll(x); }

static inline int select64(uint64_t w, int k) {
    int sh = 0;
    for (;;) {
        int pc = popc(w & 0xff);
        if (k < pc) break;
        k -= pc;
        w >>= 8;
        sh += 8;
    }
    return sh + SEL8[w & 0xff][k];
}

/* lut[key]: the class of magnitude key `key` (how many thresholds it reaches) */
static void class_lut(const int *thr, int nt, uint8_t *lut) {
    for (int key = 0, c = 0; key < 128; key++) {
        while (c < nt && key >= thr[c]) c++;
        lut[key] = (uint8_t)c;
    }
}

/* The 7-bit magnitude keys of up to 64 elements (the top byte of each, sign dropped). */
static inline __attribute__((always_inline)) void keys64(const uint8_t *p, int w, int64_t start, int cnt, uint8_t *keys) {
    const uint8_t *q = p + start * w + (w - 1);
#ifdef __SSE2__
    if (cnt == 64 && (w == 2 || w == 4)) {
        const __m128i low7 = _mm_set1_epi8(0x7f);
        const uint8_t *s = p + start * w;
        for (int j = 0; j < 64; j += 16) {
            __m128i k;
            if (w == 2) { /* 2 x 8 halfwords -> their high bytes */
                __m128i v0 = _mm_loadu_si128((const __m128i *)(s + 2 * j)), v1 = _mm_loadu_si128((const __m128i *)(s + 2 * j + 16));
                k = _mm_packus_epi16(_mm_srli_epi16(v0, 8), _mm_srli_epi16(v1, 8));
            } else { /* 4 x 4 words -> their top bytes */
                __m128i v0 = _mm_srli_epi32(_mm_loadu_si128((const __m128i *)(s + 4 * j)), 24);
                __m128i v1 = _mm_srli_epi32(_mm_loadu_si128((const __m128i *)(s + 4 * j + 16)), 24);
                __m128i v2 = _mm_srli_epi32(_mm_loadu_si128((const __m128i *)(s + 4 * j + 32)), 24);
                __m128i v3 = _mm_srli_epi32(_mm_loadu_si128((const __m128i *)(s + 4 * j + 48)), 24);
                k = _mm_packus_epi16(_mm_packs_epi32(v0, v1), _mm_packs_epi32(v2, v3));
            }
            _mm_storeu_si128((__m128i *)(keys + j), _mm_and_si128(k, low7));
        }
        return;
    }
#endif
    int j = 0;
    for (; j < cnt; j++) keys[j] = q[(int64_t)j * w] & 0x7f;
    for (; j < 64; j++) keys[j] = 0;
}

/* Bit j set iff keys[j] >= t (keys and t in 0..127). */
static inline uint64_t mask_ge(const uint8_t *keys, int t) {
#ifdef __SSE2__
    __m128i tv = _mm_set1_epi8((char)(t - 1));
    uint64_t m = 0;
    for (int q = 0; q < 4; q++) {
        __m128i k = _mm_loadu_si128((const __m128i *)(keys + 16 * q));
        m |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpgt_epi8(k, tv)) << (16 * q);
    }
    return m;
#else
    uint64_t m = 0;
    for (int j = 0; j < 64; j++) m |= (uint64_t)(keys[j] >= t) << j;
    return m;
#endif
}

/* Class membership masks of the block at `start` (cnt elements): m[c] for c in 0..nt. */
static inline __attribute__((always_inline)) void class_masks(const uint8_t *p, int w, int64_t start, int cnt, const int *thr, int nt, uint64_t *m) {
    uint8_t keys[64];
    keys64(p, w, start, cnt, keys);
    uint64_t valid = cnt == 64 ? ~0ULL : ((1ULL << cnt) - 1);
    uint64_t prev = valid; /* elements with key >= t_c (t_0 = 0) */
    for (int c = 0; c < nt; c++) {
        uint64_t ge = mask_ge(keys, thr[c]) & valid;
        m[c] = prev & ~ge;
        prev = ge;
    }
    m[nt] = prev;
}

typedef void (*masks_fn)(const uint8_t *, int, int64_t, int, const int *, int, uint64_t *);

#ifdef SS_X86
/* The same masks with AVX2 for full blocks of 2- and 4-byte elements (bf16, fp16, fp32): the
 * 64 keys in two vectors of 32, then one compare and movemask per vector and threshold. */
T256 static inline __attribute__((always_inline)) void class_masks_avx2(const uint8_t *p, int w, int64_t start, int cnt, const int *thr, int nt, uint64_t *m) {
    if (cnt != 64 || (w != 2 && w != 4)) {
        class_masks(p, w, start, cnt, thr, nt, m);
        return;
    }
    const __m256i *s = (const __m256i *)(p + start * w);
    const __m256i low7 = _mm256_set1_epi8(0x7f);
    __m256i k[2];
    for (int h = 0; h < 2; h++) {
        if (w == 2) { /* 2 x 16 halfwords -> their high bytes; packus interleaves 64-bit groups, the permute restores order */
            __m256i v0 = _mm256_srli_epi16(_mm256_loadu_si256(s + 2 * h), 8), v1 = _mm256_srli_epi16(_mm256_loadu_si256(s + 2 * h + 1), 8);
            k[h] = _mm256_permute4x64_epi64(_mm256_packus_epi16(v0, v1), 0xD8);
        } else { /* 4 x 8 words -> their top bytes; the two packs interleave 32-bit groups */
            __m256i v0 = _mm256_srli_epi32(_mm256_loadu_si256(s + 4 * h), 24), v1 = _mm256_srli_epi32(_mm256_loadu_si256(s + 4 * h + 1), 24);
            __m256i v2 = _mm256_srli_epi32(_mm256_loadu_si256(s + 4 * h + 2), 24), v3 = _mm256_srli_epi32(_mm256_loadu_si256(s + 4 * h + 3), 24);
            __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(v0, v1), _mm256_packs_epi32(v2, v3));
            k[h] = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        }
        k[h] = _mm256_and_si256(k[h], low7);
    }
    uint64_t prev = ~0ULL;
    for (int c = 0; c < nt; c++) {
        __m256i tv = _mm256_set1_epi8((char)(thr[c] - 1));
        uint64_t ge = (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpgt_epi8(k[0], tv)) | (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpgt_epi8(k[1], tv)) << 32;
        m[c] = prev & ~ge;
        prev = ge;
    }
    m[nt] = prev;
}

/* The same masks with AVX-512BW: compare (bits & magnitude) >= threshold << (8 * w - 8) on
 * whole lanes, 64 bytes at a time (a 64-element block is 1, 2, 4 or 8 vectors). */
T512 static inline __attribute__((always_inline)) void class_masks_512(const uint8_t *p, int w, int64_t start, int cnt, const int *thr, int nt, uint64_t *m) {
    if (cnt != 64) {
        class_masks(p, w, start, cnt, thr, nt, m);
        return;
    }
    const uint8_t *s = p + start * w;
    uint64_t prev = ~0ULL;
    switch (w) {
    case 1: {
        __m512i v = _mm512_and_si512(_mm512_loadu_si512(s), _mm512_set1_epi8(0x7f));
        for (int c = 0; c < nt; c++) {
            uint64_t ge = _mm512_cmpge_epu8_mask(v, _mm512_set1_epi8((char)thr[c]));
            m[c] = prev & ~ge;
            prev = ge;
        }
        break;
    }
    case 2: {
        const __m512i mag = _mm512_set1_epi16(0x7fff);
        __m512i v0 = _mm512_and_si512(_mm512_loadu_si512(s), mag), v1 = _mm512_and_si512(_mm512_loadu_si512(s + 64), mag);
        for (int c = 0; c < nt; c++) {
            __m512i t = _mm512_set1_epi16((short)(thr[c] << 8));
            uint64_t ge = (uint64_t)_mm512_cmpge_epu16_mask(v0, t) | (uint64_t)_mm512_cmpge_epu16_mask(v1, t) << 32;
            m[c] = prev & ~ge;
            prev = ge;
        }
        break;
    }
    case 4: {
        const __m512i mag = _mm512_set1_epi32(0x7fffffff);
        __m512i v[4];
        for (int j = 0; j < 4; j++) v[j] = _mm512_and_si512(_mm512_loadu_si512(s + 64 * j), mag);
        for (int c = 0; c < nt; c++) {
            __m512i t = _mm512_set1_epi32((int)((uint32_t)thr[c] << 24));
            uint64_t ge = 0;
            for (int j = 0; j < 4; j++) ge |= (uint64_t)_mm512_cmpge_epu32_mask(v[j], t) << (16 * j);
            m[c] = prev & ~ge;
            prev = ge;
        }
        break;
    }
    default: {
        const __m512i mag = _mm512_set1_epi64(0x7fffffffffffffffLL);
        __m512i v[8];
        for (int j = 0; j < 8; j++) v[j] = _mm512_and_si512(_mm512_loadu_si512(s + 64 * j), mag);
        for (int c = 0; c < nt; c++) {
            __m512i t = _mm512_set1_epi64((long long)((uint64_t)thr[c] << 56));
            uint64_t ge = 0;
            for (int j = 0; j < 8; j++) ge |= (uint64_t)_mm512_cmpge_epu64_mask(v[j], t) << (8 * j);
            m[c] = prev & ~ge;
            prev = ge;
        }
        break;
    }
    }
    m[nt] = prev;
}
#endif

#define DISPATCH_WIDTH(w, CALL) \
    switch (w) {                \
    case 1: CALL(1); break;     \
    case 2: CALL(2); break;     \
    case 4: CALL(4); break;     \
    default: CALL(8); break;    \
    }

/* One element of `w` bytes at index i (w a constant where these are inlined). */
static inline uint64_t load_w(const uint8_t *p, int w, int64_t i) {
    switch (w) {
    case 1: return p[i];
    case 2: { uint16_t v; memcpy(&v, p + 2 * i, 2); return v; }
    case 4: { uint32_t v; memcpy(&v, p + 4 * i, 4); return v; }
    default: { uint64_t v; memcpy(&v, p + 8 * i, 8); return v; }
    }
}

static inline void store_w(uint8_t *p, int w, int64_t i, uint64_t v) {
    switch (w) {
    case 1: p[i] = (uint8_t)v; break;
    case 2: { uint16_t x = (uint16_t)v; memcpy(p + 2 * i, &x, 2); break; }
    case 4: { uint32_t x = (uint32_t)v; memcpy(p + 4 * i, &x, 4); break; }
    default: memcpy(p + 8 * i, &v, 8); break;
    }
}


/* ------------------------------------------------------------------------ class_ranks */
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

/* ------------------------------------------------------------------------ class_select */
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

/* ------------------------------------------------------------------------ diff */
static inline __attribute__((always_inline)) int64_t diff_w(const uint8_t *a, const uint8_t *b, int w, int64_t n, int64_t start, int64_t base, int64_t cap, int64_t *oi, uint8_t *oa, uint8_t *ob, int64_t *next) {
    const int lanes = 8 / w;
    const int64_t nw_end = n / lanes * lanes; /* elements covered by whole 8-byte words */
    int64_t k = 0, e = start;
    while (e < n && k < cap) {
        if (e % lanes == 0 && e < nw_end && k + lanes <= cap) {
            /* scan words until one differs, then resolve its lanes */
            while (e < nw_end) {
                uint64_t x, y;
                memcpy(&x, a + e * w, 8);
                memcpy(&y, b + e * w, 8);
                if (x != y) break;
                e += lanes;
            }
            if (e < nw_end) { /* room for every lane: write each, keep the changed (no branches) */
                for (int l = 0; l < lanes; l++, e++) {
                    uint64_t x = load_w(a, w, e), y = load_w(b, w, e);
                    oi[k] = base + e;
                    store_w(oa, w, k, x);
                    store_w(ob, w, k, y);
                    k += x != y;
                }
            }
            continue;
        }
        if (memcmp(a + e * w, b + e * w, w)) { /* unaligned head, tail, or nearly full outputs */
            oi[k] = base + e;
            memcpy(oa + k * w, a + e * w, w);
            memcpy(ob + k * w, b + e * w, w);
            k++;
        }
        e++;
    }
    *next = e;
    return k;
}

#ifdef SS_X86
/* diff_w for 2-byte elements with AVX2: 16 elements compared per step, and only the changed
 * ones written (pext turns the byte mask into one bit per element); the tail, and the last
 * steps before the outputs fill, go through diff_w. Same outputs as diff_w, but slots past
 * the count (within `cap`) may be written as scratch.
 * Two ways to write a step's changed lanes, picked per 64 steps by how many of the previous 64
 * had a change: where few do (sparse), a loop over the set bits, skipped for unchanged steps;
 * where more than 20 do (dense, about 2.3% density and up), no branch at all: each half of 8
 * lanes is packed to the front with table lookups (SEL8 for the lane numbers, widened to
 * int64; SHUF16 to pack the 2-byte values) and stored whole, and k advances by the half's
 * count (slots past the count are scratch: k + 16 <= cap). At 6-10% density that is 0.36 ns
 * per element against 0.56 for a loop over the first four lanes (uniformly random changes). */
T256 static int64_t diff2_avx2(const uint8_t *a, const uint8_t *b, int64_t n, int64_t start, int64_t base, int64_t cap, int64_t *oi, uint8_t *oa, uint8_t *ob, int64_t *next) {
    const uint16_t *pa = (const uint16_t *)a, *pb = (const uint16_t *)b;
    uint16_t *qa = (uint16_t *)oa, *qb = (uint16_t *)ob;
    int64_t k = 0, e = start;
#define DIFF2_STEP_MASK                                                                                    \
    __m256i x = _mm256_loadu_si256((const __m256i *)(pa + e)), y = _mm256_loadu_si256((const __m256i *)(pb + e)); \
    uint32_t m = ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi16(x, y))
#define DIFF2_WRITE_LANE(T, J)       \
    do {                             \
        oi[k + (T)] = base + e + (J); \
        qa[k + (T)] = pa[e + (J)];    \
        qb[k + (T)] = pb[e + (J)];    \
    } while (0)
    int dense = 0;
    while (e + 16 <= n && k + 16 <= cap) {
        int changed_steps = 0;
        int64_t stop = e + 16 * 64 < n ? e + 16 * 64 : n;
        if (!dense) {
            for (; e + 16 <= stop && k + 16 <= cap; e += 16) {
                DIFF2_STEP_MASK;
                if (m) {
                    changed_steps++;
                    uint32_t bits = _pext_u32(m, 0x55555555u);
                    while (bits) {
                        DIFF2_WRITE_LANE(0, __builtin_ctz(bits));
                        k++;
                        bits &= bits - 1;
                    }
                }
            }
        } else {
            for (; e + 16 <= stop && k + 16 <= cap; e += 16) {
                DIFF2_STEP_MASK;
                changed_steps += m != 0;
                uint32_t bits = _pext_u32(m, 0x55555555u);
                const __m128i xs[2] = {_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)};
                const __m128i ys[2] = {_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1)};
                for (int h = 0; h < 2; h++) { /* each half of 8 lanes: its changed lanes packed to the front */
                    uint32_t b8 = bits >> (8 * h) & 0xff;
                    __m128i pos = _mm_loadl_epi64((const __m128i *)SEL8[b8]);
                    __m256i at = _mm256_set1_epi64x(base + e + 8 * h);
                    _mm256_storeu_si256((__m256i *)(oi + k), _mm256_add_epi64(_mm256_cvtepu8_epi64(pos), at));
                    _mm256_storeu_si256((__m256i *)(oi + k + 4), _mm256_add_epi64(_mm256_cvtepu8_epi64(_mm_srli_si128(pos, 4)), at));
                    __m128i sh = _mm_loadu_si128((const __m128i *)SHUF16[b8]);
                    _mm_storeu_si128((__m128i *)(qa + k), _mm_shuffle_epi8(xs[h], sh));
                    _mm_storeu_si128((__m128i *)(qb + k), _mm_shuffle_epi8(ys[h], sh));
                    k += __builtin_popcount(b8);
                }
            }
        }
        dense = changed_steps > 20;
    }
#undef DIFF2_STEP_MASK
#undef DIFF2_WRITE_LANE
    int64_t rest = e;
    k += diff_w(a, b, 2, n, e, base, cap - k, oi + k, oa + 2 * k, ob + 2 * k, &rest);
    *next = rest;
    return k;
}
#endif

/* ------------------------------------------------------------------------ thresholds */
static double xlogx_cost(double t, double c) { /* bits to code c changes among t elements */
    t = t > c ? t : c;
    double p = t > 0 ? c / t : 0.0;
    double h = -((p > 0 ? p * log2(p) : 0.0) + (p < 1 ? (1 - p) * log2(1 - p) : 0.0));
    return t * h;
}

/* ------------------------------------------------------------------------ escape costs */
#define ALPHA 64 /* MAX_ALPHABET in _encodings.py: values >= ALPHA escape */
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

/* ------------------------------------------------------------------------ rANS (format 2) */
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

/* ------------------------------------------------------------------------ Python glue */
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

static PyObject *py_diff_into(PyObject *self, PyObject *args) {
    Py_buffer a, b, oi, oa, ob;
    int w;
    long long start, base;
    int hw = -1;
    if (!PyArg_ParseTuple(args, "y*y*iLLw*w*w*|i", &a, &b, &w, &start, &base, &oi, &oa, &ob, &hw)) return NULL;
    PyObject *res = NULL;
    if (check_width(w) < 0 || (hw = parse_hw(hw)) < 0) goto done;
    if (a.len != b.len || a.len % w) {
        PyErr_Format(PyExc_ValueError, "sides hold %zd and %zd bytes, expected equal multiples of %d", a.len, b.len, w);
        goto done;
    }
    int64_t n = a.len / w;
    int64_t cap = oi.len / 8;
    if (oa.len / w < cap) cap = oa.len / w;
    if (ob.len / w < cap) cap = ob.len / w;
    if (start < 0 || start > n) {
        PyErr_Format(PyExc_ValueError, "start %lld outside 0..%lld", start, (long long)n);
        goto done;
    }
    int64_t k = 0, next = start;
    Py_BEGIN_ALLOW_THREADS
#ifdef SS_X86
    if (w == 2 && hw >= HW_AVX2)
        k = diff2_avx2(a.buf, b.buf, n, start, base, cap, oi.buf, oa.buf, ob.buf, &next);
    else
#endif
    {
#define CALL(W) k = diff_w(a.buf, b.buf, W, n, start, base, cap, oi.buf, oa.buf, ob.buf, &next)
        DISPATCH_WIDTH(w, CALL)
#undef CALL
    }
    Py_END_ALLOW_THREADS
    res = Py_BuildValue("LL", (long long)k, (long long)next);
done:
    RELEASE(&a, &b, &oi, &oa, &ob);
    return res;
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

static int check_idx(const int64_t *idx, int64_t n_idx, int64_t n) {
    int64_t bad = -1;
    Py_BEGIN_ALLOW_THREADS /* O(n) scans run without the GIL, like the passes they guard */
    for (int64_t i = 0; i < n_idx; i++) {
        if ((uint64_t)idx[i] >= (uint64_t)n) {
            bad = i;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_IndexError, "index %lld at %lld, expected 0 <= index < %lld", (long long)idx[bad], (long long)bad, (long long)n);
        return -1;
    }
    return 0;
}

#define COPY_LOOP(W, DST_EXPR, SRC_EXPR) \
    for (int64_t i = 0; i < ni; i++) memcpy(DST_EXPR, SRC_EXPR, W)

static PyObject *py_take(PyObject *self, PyObject *args) {
    Py_buffer src, ib, outb;
    int w;
    if (!PyArg_ParseTuple(args, "y*iy*w*", &src, &w, &ib, &outb)) return NULL;
    PyObject *res = NULL;
    int64_t n = src.len / (w > 0 ? w : 1), ni = ib.len / 8;
    if (check_width(w) < 0) goto done;
    if (src.len % w || ib.len % 8 || outb.len != ni * w) {
        PyErr_SetString(PyExc_ValueError, "take: src, idx or out has the wrong size");
        goto done;
    }
    const int64_t *idx = ib.buf;
    if (check_idx(idx, ni, n) < 0) goto done;
    const uint8_t *sp = src.buf;
    uint8_t *op = outb.buf;
    Py_BEGIN_ALLOW_THREADS
#define CALL(W) COPY_LOOP(W, op + i * W, sp + idx[i] * W)
    DISPATCH_WIDTH(w, CALL)
#undef CALL
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    RELEASE(&src, &ib, &outb);
    return res;
}

static PyObject *py_put(PyObject *self, PyObject *args) {
    Py_buffer dst, ib, vb, oldb;
    int w;
    if (!PyArg_ParseTuple(args, "w*iy*y*w*", &dst, &w, &ib, &vb, &oldb)) return NULL;
    PyObject *res = NULL;
    int64_t n = dst.len / (w > 0 ? w : 1), ni = ib.len / 8;
    if (check_width(w) < 0) goto done;
    if (dst.len % w || ib.len % 8 || vb.len != ni * w || (oldb.len && oldb.len != ni * w)) {
        PyErr_SetString(PyExc_ValueError, "put: dst, idx, values or old has the wrong size");
        goto done;
    }
    const int64_t *idx = ib.buf;
    if (check_idx(idx, ni, n) < 0) goto done;
    uint8_t *dp = dst.buf, *op = oldb.buf;
    const uint8_t *vp = vb.buf;
    int keep = oldb.len > 0;
    Py_BEGIN_ALLOW_THREADS
    if (keep) { /* one pass: each element's old bits are read where they are overwritten */
#define CALL(W) for (int64_t i = 0; i < ni; i++) { memcpy(op + i * W, dp + idx[i] * W, W); memcpy(dp + idx[i] * W, vp + i * W, W); }
        DISPATCH_WIDTH(w, CALL)
#undef CALL
    } else {
#define CALL(W) COPY_LOOP(W, dp + idx[i] * W, vp + i * W)
        DISPATCH_WIDTH(w, CALL)
#undef CALL
    }
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    RELEASE(&dst, &ib, &vb, &oldb);
    return res;
}

/* ------------------------------------------------------------------------ varints (the format-3 table) */
/* varints_put(out, values, count): append values[0 .. count-1] (ints in [0, 2^63)) to the
 * bytearray `out` as LEB128 varints, the writer's side of `varints`. */
static PyObject *py_varints_put(PyObject *self, PyObject *args) {
    PyObject *out, *seq;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "O!On", &PyByteArray_Type, &out, &seq, &count)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "varints_put: values must be a sequence");
    if (!fast) return NULL;
    PyObject *res = NULL;
    uint8_t *buf = NULL;
    if (count < 0 || count > PySequence_Fast_GET_SIZE(fast)) {
        PyErr_SetString(PyExc_ValueError, "varints_put: count out of range");
        goto done;
    }
    buf = PyMem_Malloc(count * 10 + 1);
    if (!buf) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) goto done;
        if (v < 0) {
            PyErr_SetString(PyExc_ValueError, "varints_put: values must be non-negative");
            goto done;
        }
        uint64_t u = (uint64_t)v;
        while (u >= 0x80) {
            buf[n++] = (uint8_t)((u & 0x7F) | 0x80);
            u >>= 7;
        }
        buf[n++] = (uint8_t)u;
    }
    Py_ssize_t old = PyByteArray_GET_SIZE(out);
    if (PyByteArray_Resize(out, old + n) < 0) goto done;
    memcpy(PyByteArray_AS_STRING(out) + old, buf, n);
    res = Py_None;
    Py_INCREF(res);
done:
    PyMem_Free(buf);
    Py_DECREF(fast);
    return res;
}

static PyObject *py_varints(PyObject *self, PyObject *args) {
    Py_buffer d;
    Py_ssize_t pos, count;
    unsigned long long hi;
    if (!PyArg_ParseTuple(args, "y*nnK", &d, &pos, &count, &hi)) return NULL;
    PyObject *out = NULL, *res = NULL;
    if (pos < 0 || count < 0 || count > d.len) {
        PyErr_SetString(PyExc_ValueError, "varints: pos or count out of range");
        goto done;
    }
    out = PyList_New(count);
    if (!out) goto done;
    const uint8_t *p = d.buf;
    int status = 0;
    uint64_t v = 0;
    for (Py_ssize_t i = 0; i < count && !status; i++) {
        v = 0;
        int shift = 0, end = 0;
        for (int j = 0; j < 9 && !end; j++) {
            if (pos >= d.len) {
                status = 1;
                break;
            }
            uint8_t b = p[pos++];
            v |= (uint64_t)(b & 0x7F) << shift;
            shift += 7;
            if (!(b & 0x80)) {
                end = 1;
                if (b == 0 && shift > 7) status = 2;
                else if (v > hi) status = 3;
            }
        }
        if (!status && !end) status = 4;
        if (!status) {
            PyObject *x = PyLong_FromUnsignedLongLong(v);
            if (!x) goto done;
            PyList_SET_ITEM(out, i, x);
        }
    }
    if (status) res = Py_BuildValue("OnKi", Py_None, pos, (unsigned long long)v, status);
    else res = Py_BuildValue("OnKi", out, pos, 0ULL, 0);
done:
    Py_XDECREF(out);
    PyBuffer_Release(&d);
    return res;
}

/* ------------------------------------------------------------------------ gaps and deltas */
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

static PyObject *py_classes(PyObject *self, PyObject *args) {
    Py_buffer bb, tb, ob;
    int w;
    if (!PyArg_ParseTuple(args, "y*iy*w*", &bb, &w, &tb, &ob)) return NULL;
    PyObject *res = NULL;
    int thr[MAXC] = {0}, nt;
    if (check_width(w) < 0 || parse_thresholds(&tb, thr, &nt) < 0) goto done;
    int64_t n = bb.len / w;
    if (bb.len % w || ob.len != n) {
        PyErr_SetString(PyExc_ValueError, "classes: bits or out has the wrong size");
        goto done;
    }
    uint8_t lut[128];
    class_lut(thr, nt, lut);
    const uint8_t *p = (const uint8_t *)bb.buf + (w - 1);
    uint8_t *o = ob.buf;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) o[i] = lut[p[i * w] & 0x7f];
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    RELEASE(&bb, &tb, &ob);
    return res;
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

static PyObject *py_join(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "join: expected a list of bytes-like objects");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), total = 0, got = 0;
    PyObject *res = NULL;
    Py_buffer *bufs = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    if (!bufs) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &bufs[got], PyBUF_C_CONTIGUOUS) < 0) goto done;
        if (bufs[got].len > PY_SSIZE_T_MAX - total) {
            got++;
            PyErr_SetString(PyExc_OverflowError, "join: the pieces are too large together");
            goto done;
        }
        total += bufs[got].len;
    }
    res = PyBytes_FromStringAndSize(NULL, total);
    if (!res) goto done;
    char *dst = PyBytes_AS_STRING(res);
    Py_BEGIN_ALLOW_THREADS
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (total >= (4 << 20)) { /* the whole 2 MiB pages inside the output; advice only, failure is harmless */
        uintptr_t lo = ((uintptr_t)dst + (2u << 20) - 1) & ~(uintptr_t)((2u << 20) - 1), hi = ((uintptr_t)dst + (uintptr_t)total) & ~(uintptr_t)((2u << 20) - 1);
        if (hi > lo) madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
    }
#endif
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(dst, bufs[i].buf, (size_t)bufs[i].len);
        dst += bufs[i].len;
    }
    Py_END_ALLOW_THREADS
done:
    if (bufs) {
        for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
        PyMem_Free(bufs);
    }
    Py_DECREF(seq);
    return res;
}

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
    {"varints_put", py_varints_put, METH_VARARGS, "varints_put(out, values, count) -> None"},
    {"put", py_put, METH_VARARGS, "put(dst, width, idx, values, old) -> None"},
    {"gap_khist", py_gap_khist, METH_VARARGS, "gap_khist(ranks, step, k0, hists) -> None"},
    {"gap_symbols", py_gap_symbols, METH_VARARGS, "gap_symbols(ranks, k, e, sym, esc, hist, low, low_offset) -> n_escaped"},
    {"gap_ranks", py_gap_ranks, METH_VARARGS, "gap_ranks(sym, e, esc, esc_offset, k, low, low_offset, numel, out) -> (status, next escape)"},
    {"delta_hist", py_delta_hist, METH_VARARGS, "delta_hist(base, target, width, thresholds, hist[, step]) -> None"},
    {"delta_symbols", py_delta_symbols, METH_VARARGS, "delta_symbols(base, target, width, thresholds, es, offsets, sym, esc, hist) -> list[int]"},
    {"delta_values", py_delta_values, METH_VARARGS, "delta_values(base, width, cls, K, sym, offsets, es, esc, out) -> -1 or a status"},
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
