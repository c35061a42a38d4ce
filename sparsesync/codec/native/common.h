/* native/common.h: what every pass of sparsesync.codec._native shares, below Python: the headers,
 * the target attributes (T256, T512) and HW levels (HW_BEST, set once by module init in
 * _native.c), the limits mirrored from _encodings.py (MAXC, ALPHA), the bit helpers (popc,
 * select64, the SEL8/SHUF16 tables filled by module init) and the element-width helpers
 * (DISPATCH_WIDTH, load_w, store_w).
 *
 * Guarantee: no function here touches Python objects or memory outside the pointers it is given;
 * the file refuses to compile on a big-endian target (the patch format is read with native loads).
 * A fragment of the one translation unit _native.c (included first), not a header of its own.
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
#define ALPHA 64 /* MAX_ALPHABET in _encodings.py: values >= ALPHA escape */

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
