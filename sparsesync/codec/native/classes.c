/* native/classes.c: the classes of the base magnitude (docs/format.md, "Classes of the base
 * magnitude"): the 7-bit magnitude key of each element, the class lookup table (class_lut), the
 * per-block class membership masks in portable/SSE2, AVX2 and AVX-512BW forms (used by
 * ranks.c and select.c), and the entry point classes().
 *
 * Guarantee: every masks form gives the same masks for the same block; classes() reads only
 * `bits` and writes only `out`, after checking their sizes.
 * A fragment of _native.c, included after common.h and args.h.
 */

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
