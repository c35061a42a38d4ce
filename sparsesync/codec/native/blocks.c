/* native/blocks.c: the block digests of the tensor digest "xxh3b" (docs/format.md, "Digests"):
 * XXH3-64 (seed 0, default secret) of each 65536-byte block of a buffer, the last block padded
 * with zero bytes to 65536. Every block has the same length, so only XXH3's long-input path is
 * needed (hashLong_64b: 64 rounds of 16 stripes, a scramble after each 1024 bytes but the last,
 * the last stripe at secret offset 121, mergeAccs at offset 11 with 65536 * PRIME64_1).
 *
 *   block_digests(data, out[, threads[, hw]]) -> None
 *       out: uint64[ceil(len(data) / 65536)]. `threads` > 1 splits the blocks into that many
 *       contiguous ranges hashed at once (pthreads, the GIL released); hw 0 portable (SSE2 on
 *       x86-64), 2 AVX2, 3 AVX-512 (where the CPU has them), -1 AVX2 where the CPU has it (faster
 *       than AVX-512 where measured), else portable. Every level and thread count gives
 *       the same digests (the tests compare them with xxhash's XXH3-64 of each padded block);
 *       hw -2 is the plain scalar C, for the tests.
 *
 * Guarantee: reads only inside `data`, writes only `out`; no Python object is touched while the
 * GIL is released. A fragment of _native.c, included after common.h and args.h.
 */

#include <pthread.h>

#define BLK 65536
#define P32_1 0x9E3779B1ULL
#define P32_2 0x85EBCA77ULL
#define P32_3 0xC2B2AE3DULL
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL

static const uint8_t XSECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static uint64_t xh_fold(uint64_t a, uint64_t b) {
    __uint128_t m = (__uint128_t)a * b;
    return (uint64_t)m ^ (uint64_t)(m >> 64);
}

static uint64_t xh_finish(const uint64_t *acc) { /* mergeAccs + avalanche, for a 65536-byte input */
    uint64_t h = (uint64_t)BLK * P64_1;
    for (int i = 0; i < 4; i++) h += xh_fold(acc[2 * i] ^ rd64(XSECRET + 11 + 16 * i), acc[2 * i + 1] ^ rd64(XSECRET + 11 + 16 * i + 8));
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    return h ^ (h >> 32);
}

/* An empty asm that keeps each stripe's sum in its register, in order (as xxHash's
 * XXH_COMPILER_GUARD): without it the compiler reassociates the 16 stripes of a round into a
 * tree that spills registers, 20% slower. */
#define XH_GUARD(v, c) __asm__("" : c(v))

static const uint64_t XACC0[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};

/* One 64-byte stripe into the accumulators, and the scramble, in each instruction set. */
#define XH_BLOCK(ACC, SCR)                                                             \
    for (int r = 0; r < 63; r++) {                                                     \
        const uint8_t *q = p + r * 1024;                                               \
        _Pragma("GCC unroll 16") for (int s = 0; s < 16; s++) ACC(q + 64 * s, XSECRET + 8 * s); \
        SCR(XSECRET + 128);                                                            \
    }                                                                                  \
    for (int s = 0; s < 15; s++) ACC(p + 63 * 1024 + 64 * s, XSECRET + 8 * s);        \
    ACC(p + BLK - 64, XSECRET + 121)

static uint64_t xh_block_scalar(const uint8_t *p) {
    uint64_t acc[8];
    memcpy(acc, XACC0, sizeof acc);
#define ACC(d, k) for (int i = 0; i < 8; i++) { uint64_t v = rd64((d) + 8 * i), dk = v ^ rd64((k) + 8 * i); acc[i ^ 1] += v; acc[i] += (dk & 0xffffffffULL) * (dk >> 32); }
#define SCR(k) for (int i = 0; i < 8; i++) { uint64_t a = acc[i]; a ^= a >> 47; a ^= rd64((k) + 8 * i); acc[i] = a * P32_1; }
    XH_BLOCK(ACC, SCR);
#undef ACC
#undef SCR
    return xh_finish(acc);
}

#ifdef __SSE2__
static uint64_t xh_block_sse2(const uint8_t *p) {
    __m128i a[4];
    memcpy(a, XACC0, sizeof a);
    const __m128i prime = _mm_set1_epi32((int)P32_1);
#define ACC(d, k) for (int i = 0; i < 4; i++) { __m128i v = _mm_loadu_si128((const __m128i *)(d) + i), dk = _mm_xor_si128(v, _mm_loadu_si128((const __m128i *)(k) + i)); \
        a[i] = _mm_add_epi64(_mm_mul_epu32(dk, _mm_shuffle_epi32(dk, 0x31)), _mm_add_epi64(a[i], _mm_shuffle_epi32(v, 0x4e))); XH_GUARD(a[i], "+x"); }
#define SCR(k) for (int i = 0; i < 4; i++) { __m128i x = _mm_xor_si128(_mm_xor_si128(a[i], _mm_srli_epi64(a[i], 47)), _mm_loadu_si128((const __m128i *)(k) + i)); \
        a[i] = _mm_add_epi64(_mm_mul_epu32(x, prime), _mm_slli_epi64(_mm_mul_epu32(_mm_shuffle_epi32(x, 0x31), prime), 32)); }
    XH_BLOCK(ACC, SCR);
#undef ACC
#undef SCR
    uint64_t acc[8];
    memcpy(acc, a, sizeof acc);
    return xh_finish(acc);
}
#endif

#ifdef SS_X86
T256 static uint64_t xh_block_avx2(const uint8_t *p) {
    __m256i a[2];
    memcpy(a, XACC0, sizeof a);
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
#define ACC(d, k) for (int i = 0; i < 2; i++) { __m256i v = _mm256_loadu_si256((const __m256i *)(d) + i), dk = _mm256_xor_si256(v, _mm256_loadu_si256((const __m256i *)(k) + i)); \
        a[i] = _mm256_add_epi64(_mm256_mul_epu32(dk, _mm256_srli_epi64(dk, 32)), _mm256_add_epi64(a[i], _mm256_shuffle_epi32(v, 0x4e))); XH_GUARD(a[i], "+x"); }
#define SCR(k) for (int i = 0; i < 2; i++) { __m256i x = _mm256_xor_si256(_mm256_xor_si256(a[i], _mm256_srli_epi64(a[i], 47)), _mm256_loadu_si256((const __m256i *)(k) + i)); \
        a[i] = _mm256_add_epi64(_mm256_mul_epu32(x, prime), _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x, 32), prime), 32)); }
    XH_BLOCK(ACC, SCR);
#undef ACC
#undef SCR
    uint64_t acc[8];
    memcpy(acc, a, sizeof acc);
    return xh_finish(acc);
}

T512 static uint64_t xh_block_avx512(const uint8_t *p) {
    __m512i a;
    memcpy(&a, XACC0, sizeof a);
    const __m512i prime = _mm512_set1_epi32((int)P32_1);
#define ACC(d, k) { __m512i v = _mm512_loadu_si512((const void *)(d)), dk = _mm512_xor_si512(v, _mm512_loadu_si512((const void *)(k))); \
        a = _mm512_add_epi64(_mm512_mul_epu32(dk, _mm512_srli_epi64(dk, 32)), _mm512_add_epi64(a, _mm512_shuffle_epi32(v, (_MM_PERM_ENUM)0x4e))); XH_GUARD(a, "+v"); }
#define SCR(k) { __m512i x = _mm512_xor_si512(_mm512_xor_si512(a, _mm512_srli_epi64(a, 47)), _mm512_loadu_si512((const void *)(k))); \
        a = _mm512_add_epi64(_mm512_mul_epu32(x, prime), _mm512_slli_epi64(_mm512_mul_epu32(_mm512_srli_epi64(x, 32), prime), 32)); }
    XH_BLOCK(ACC, SCR);
#undef ACC
#undef SCR
    uint64_t acc[8];
    memcpy(acc, &a, sizeof acc);
    return xh_finish(acc);
}
#endif

typedef struct {
    const uint8_t *data;
    int64_t len, lo, hi; /* blocks [lo, hi) of data[0:len] */
    uint64_t *out;
    int hw;
} xh_job;

static void *xh_run(void *arg) {
    xh_job *j = arg;
    for (int64_t b = j->lo; b < j->hi; b++) {
        const uint8_t *p = j->data + b * BLK;
        uint8_t pad[BLK];
        if ((b + 1) * BLK > j->len) { /* the last, short block: zero-padded */
            memset(pad, 0, BLK);
            memcpy(pad, p, (size_t)(j->len - b * BLK));
            p = pad;
        }
#ifdef SS_X86
        if (j->hw >= HW_AVX512) { j->out[b] = xh_block_avx512(p); continue; }
        if (j->hw >= HW_AVX2) { j->out[b] = xh_block_avx2(p); continue; }
#endif
#ifdef __SSE2__
        j->out[b] = j->hw >= 0 ? xh_block_sse2(p) : xh_block_scalar(p);
#else
        j->out[b] = xh_block_scalar(p);
#endif
    }
    return NULL;
}

static PyObject *py_block_digests(PyObject *self, PyObject *args) {
    Py_buffer db, ob;
    int threads = 1, hw = -1;
    if (!PyArg_ParseTuple(args, "y*w*|ii", &db, &ob, &threads, &hw)) return NULL;
    PyObject *res = NULL;
    int64_t nb = ((int64_t)db.len + BLK - 1) / BLK;
    int scalar = hw == -2; /* the plain C definition, for the tests */
    int best = hw == -1;
    if (!scalar && (hw = parse_hw(hw)) < 0) goto done;
    if (best && hw == HW_AVX512) hw = HW_AVX2; /* measured on AMD Zen 4: AVX2 ~10% faster than AVX-512 here (double-pumped 512-bit ops) */
    if (scalar) hw = -1;
    else if (hw == HW_BMI2) hw = HW_PORTABLE; /* nothing here uses BMI2 */
    if (ob.len != nb * 8) {
        PyErr_Format(PyExc_ValueError, "block_digests: out holds %zd bytes, expected %lld (8 per 65536-byte block)", ob.len, (long long)nb * 8);
        goto done;
    }
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (threads > nb) threads = nb > 0 ? (int)nb : 1;
    xh_job jobs[64];
    pthread_t tid[64];
    int started[64] = {0};
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < threads; t++) {
        jobs[t] = (xh_job){db.buf, db.len, nb * t / threads, nb * (t + 1) / threads, ob.buf, hw};
        started[t] = t > 0 && pthread_create(&tid[t], NULL, xh_run, &jobs[t]) == 0;
        if (t > 0 && !started[t]) xh_run(&jobs[t]); /* no thread to be had: hash the range here */
    }
    xh_run(&jobs[0]);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tid[t], NULL);
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    RELEASE(&db, &ob);
    return res;
}
