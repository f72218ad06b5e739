/* Hot loops of the quantized matmul kernels (cython_kernels/qmatmul.pyx), with SIMD variants
 * chosen at RUN time.
 *
 * Variants (levels): 0 portable C, 1 AVX2+FMA, 2 AVX-512 (F/BW/VL), 3 NEON (AArch64).  The x86
 * variants are compiled per function with __attribute__((target(...))) on gcc/clang and picked
 * with __builtin_cpu_supports, so the extension is built for baseline x86-64 (never
 * -march=native) and still uses the wide units where they exist.  On AArch64 (gcc/clang) NEON is
 * part of the baseline: the NEON variant (qkern_neon.h) is always compiled and always supported.
 * Other compilers (MSVC) and other CPUs build the portable variant only; its loops are written as
 * fixed-width lane arrays that compilers auto-vectorize.
 *
 * Numerics.  Every output y[t, o] is computed by one thread, in an order fixed by the variant and
 * the shapes alone: results do not depend on the thread count, and decode (T == 1) and prefill
 * (T > 1) give the same bits for the same row.  Different variants sum in different orders and
 * (AVX2 / AVX-512 / NEON) use fused multiply-adds, so they agree with each other and with the
 * numpy reference to float32 rounding (~1e-6 relative), not bit for bit.
 *
 * int4 (core.quant format: byte k of a row holds element 2k in the low nibble, 2k+1 in the high
 * one, value = (nibble - 8) * s[o, i // gs]).  AVX2 / AVX-512, when a group is a whole number of
 * "chunks" of CB packed bytes (CB = 8 for AVX2, 16 for AVX-512; i.e. gs % 16 == 0 / gs % 32 == 0;
 * AVX-512 falls back to AVX2, and both to portable, for other group sizes):
 *   - x is permuted once per call into xp: for chunk c, xp[2CB c + j] = x[2(CB c + j)] (low
 *     nibbles) and xp[2CB c + CB + j] = x[2(CB c + j) + 1] (high nibbles), zero past cols;
 *   - per group g, two vector accumulators a0, a1; per chunk the bytes are widened to 32-bit
 *     lanes, lo = float(b & 15), hi = float(b >> 4) (no "- 8": one op less per 8 weights),
 *     a0 += lo * xp_lo, a1 += hi * xp_hi; the "- 8" comes in as -8 * sum(x over the block) added to
 *     lane 0 of a0 at the start of every 64-element block of the group (kept per block, not per
 *     group, so the cancellation stays small for any group size: with activations that all share
 *     one sign the error is <= ~3e-6 of sum |x w|, ~1e-7 for ordinary ones);
 *   - acc += (a0 + a1) * s[g]; y = horizontal sum of acc (fixed tree).
 *   Prefill unpacks a block of rows to floats lo / hi in the same layout (exact) and runs the
 *   same operations for every token, 4 tokens at a time, over column tiles (the accumulators pass
 *   through memory between tiles, which does not change any rounding).
 *   AVX2 with gs % 64 == 0 (the container's groups) uses a "lane layout" instead: 32 bytes as
 *   eight 32-bit lanes, nibble k of every lane by a mask, x permuted and pre-scaled by 16^-k
 *   (coli_q4_lanes); same a0 / a1 / "- 8" / scale structure, two rows per pass.
 * Portable: per group the low-nibble x then the high-nibble x; 64 lanes accumulate
 * ((lo - 8) x_lo + (hi - 8) x_hi) * s, folded by a fixed tree; any even group size.
 * NEON: the AVX2 structure with 4-lane vectors and (nibble - 8) taken directly (qkern_neon.h).
 * An opt-in int8-activation path (coli_q4i8_*, below) quantizes x instead (off by default).
 *
 * int8 (per-row scale): x is copied to a zero-padded buffer; per row, 8 vector accumulators over
 * blocks of 8 * VL bytes (a short last block is copied to a zeroed buffer), folded by a fixed
 * tree, times s[o].  Prefill unpacks the row to floats and runs the same operations per token.
 * AVX2 / AVX-512 decode runs several rows per pass (coli_q8_decode_x86), and 2-4 tokens go
 * straight from the packed row (coli_q8_fewtok_<level>), each row and token with exactly those
 * operations.
 */
#ifndef COLI_QKERN_H
#define COLI_QKERN_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(COLI_SIMDE_TEST)
/* Test-only build: every variant (x86 and NEON) through SIMDe's portable emulation of the
 * intrinsics, so the AVX2 / AVX-512 / NEON code can be checked on a machine without those units
 * (see tests/test_kernels.py::test_simd_variants_emulated). */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/fma.h>
#include <simde/arm/neon.h>
#define COLI_X86 1
#define COLI_ARM 1
#define COLI_T_AVX2
#define COLI_T_AVX512
/* conversions older SIMDe releases lack (element-wise, as the hardware defines them) */
#ifndef _mm512_cvtepu8_epi32
static inline __m512i coli_emu_cvtepu8_epi32(__m128i v)
{
    uint8_t b[16]; int32_t o[16]; int i;
    _mm_storeu_si128((__m128i *)b, v);
    for (i = 0; i < 16; i++) o[i] = b[i];
    return _mm512_loadu_si512(o);
}
#define _mm512_cvtepu8_epi32 coli_emu_cvtepu8_epi32
#endif
#ifndef _mm512_cvtepi8_epi32
static inline __m512i coli_emu_cvtepi8_epi32(__m128i v)
{
    int8_t b[16]; int32_t o[16]; int i;
    _mm_storeu_si128((__m128i *)b, v);
    for (i = 0; i < 16; i++) o[i] = b[i];
    return _mm512_loadu_si512(o);
}
#define _mm512_cvtepi8_epi32 coli_emu_cvtepi8_epi32
#endif
#ifndef _mm512_cvtepi32_ps
static inline __m512 coli_emu_cvtepi32_ps(__m512i v)
{
    int32_t b[16]; float o[16]; int i;
    _mm512_storeu_si512(b, v);
    for (i = 0; i < 16; i++) o[i] = (float)b[i];
    return _mm512_loadu_ps(o);
}
#define _mm512_cvtepi32_ps coli_emu_cvtepi32_ps
#endif
#elif (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__)) \
    && !defined(COLI_NO_SIMD)
#define COLI_X86 1
#include <immintrin.h>
#define COLI_T_AVX2 __attribute__((target("avx,avx2,fma")))
#define COLI_T_AVX512 __attribute__((target("avx,avx2,fma,avx512f,avx512bw,avx512vl")))
#define COLI_ARM 0
#elif (defined(__GNUC__) || defined(__clang__)) && defined(__aarch64__) \
    && !defined(__AARCH64EB__) && !defined(COLI_NO_SIMD)
#define COLI_X86 0
#define COLI_ARM 1           /* AArch64: NEON (Advanced SIMD) is baseline */
#include <arm_neon.h>
#else
#define COLI_X86 0
#define COLI_ARM 0
#endif

#if defined(_MSC_VER) && !defined(__cplusplus) && !defined(inline)
#define inline __inline       /* older MSVC C modes spell it __inline */
#endif

typedef ptrdiff_t coli_idx;

#if defined(__GNUC__) || defined(__clang__)
#define COLI_INLINE static inline __attribute__((always_inline))
#else
#define COLI_INLINE static __forceinline
#endif

enum { COLI_PORTABLE = 0, COLI_AVX2 = 1, COLI_AVX512 = 2, COLI_NEON = 3, COLI_NLEVELS = 4 };
enum { COLI_TB = 4 };          /* tokens per prefill block */
enum { COLI_GINIT = 16 };      /* floats per 64-element block in the start-value table */

/* Floats per group in the start-value table: one 16-float entry per 64 elements of the group. */
static coli_idx coli_q4_gstride(coli_idx gs)
{
    return (gs + 63) / 64 * COLI_GINIT;
}

static const char *coli_level_names[COLI_NLEVELS] = {"portable", "avx2", "avx512", "neon"};

static int coli_simd_supported(int level)
{
    if (level == COLI_PORTABLE)
        return 1;
#if defined(COLI_SIMDE_TEST)
    return level < COLI_NLEVELS;
#elif COLI_X86
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
        return 0;
    if (level == COLI_AVX2)
        return 1;
    if (level == COLI_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
               && __builtin_cpu_supports("avx512vl");
#elif COLI_ARM
    if (level == COLI_NEON)
        return 1;
#endif
    return 0;
}

static int coli_simd_best(void)
{
    int l;
    for (l = COLI_NLEVELS - 1; l > 0; l--)
        if (coli_simd_supported(l))
            return l;
    return COLI_PORTABLE;
}

/* ---- int4: layouts -------------------------------------------------------------------------- */

enum { COLI_CB_LANES = -1 };   /* coli_q4_cb: the AVX2 lane layout (see coli_q4_lanes) */

/* AVX2 with whole 64-element blocks (gs % 64 == 0) reads 32 packed bytes as eight 32-bit lanes
 * and takes nibble k of every lane by a mask (0xF << 4k: no shift, no widening shuffle), so
 * float(lane & mask) = q * 16^k exactly; x is permuted so that its vector k holds the elements
 * of nibble k of each lane (element 8 l + k), pre-scaled by 16^-k (exact: a power of two), so
 * each product is q * x exactly (unless |x| < ~1e-30 becomes subnormal).  Nibble 7 is shifted
 * down (q << 28 does not fit a signed lane) and its x is not scaled.  Three operations per 8
 * weights (and, convert, FMA) instead of five per 16 plus a widening shuffle per 8, and two rows
 * per pass: 9.6 -> 11.0 GB/s on one Zen 3 core, 18.5 -> 21.5 on two; 12.8 / 24-25 with aligned
 * x and 256-row decode blocks (benchmarks/README.md, session 4). */
static int coli_q4_lanes(int lv, coli_idx gs)
{
    return lv == COLI_AVX2 && gs % 64 == 0;
}

static int coli_q4_level(int level, coli_idx gs);

/* Packed bytes per "chunk" of the x layout for a level and group size (or COLI_CB_LANES).
 * AVX2 / NEON and AVX-512 need the group to be whole chunks of 8 / 16 bytes; the portable path
 * takes the whole group as one chunk (any even group size). */
static int coli_q4_cb(int level, coli_idx gs)
{
    coli_idx gb = gs / 2;
    if (coli_q4_lanes(coli_q4_level(level, gs), gs))
        return COLI_CB_LANES;
    if (level == COLI_AVX512 && gb % 16 == 0)
        return 16;
    if ((level == COLI_AVX2 || level == COLI_AVX512 || (level == COLI_NEON && COLI_ARM))
        && gb % 8 == 0)
        return 8;
    return (int)gb;
}

/* Level that actually runs for (level, gs): AVX-512 falls back to AVX2 for groups that are not
 * whole 16-byte chunks, and both (and NEON) to portable for groups that are not whole 8-byte
 * chunks (group sizes that are not multiples of 16). */
static int coli_q4_level(int level, coli_idx gs)
{
    coli_idx gb = gs / 2;
    if (level == COLI_NEON)
        return COLI_ARM && gb % 8 == 0 ? COLI_NEON : COLI_PORTABLE;
    if (level == COLI_AVX512 && gb % 16 == 0)
        return COLI_AVX512;
    if ((level == COLI_AVX2 || level == COLI_AVX512) && gb % 8 == 0)
        return COLI_AVX2;
    return COLI_PORTABLE;
}

/* Output rows per parallel block of a decode product: row r is paired with r + rb / 2 (two
 * prefetch streams) and longer streams read faster -- 256 rows against 64 took the OLMoE
 * geometry's expert products from 26.5 to 22 ms on 2 threads (43 -> 40 on 1) -- where that still
 * leaves every thread at least 4 blocks; else 64. (The bits do not depend on it.) */
static coli_idx coli_decode_rows(coli_idx rows, int nt)
{
    return rows >= 4 * 256 * (coli_idx)nt ? 256 : 64;
}

/* xp: [T][L] with L = ng * gs; ginit: [T][ng][gstride] (used by AVX2 / AVX-512 only). */
static void coli_q4_prep(int cb, const float *x, coli_idx T, coli_idx cols, coli_idx gs,
                         coli_idx ng, float *xp, float *ginit)
{
    coli_idx L = ng * gs, gst = coli_q4_gstride(gs), t, i, g, c, j, k;
    for (t = 0; t < T; t++) {
        const float *xr = x + t * cols;
        float *xo = xp + t * L;
        if (cb == COLI_CB_LANES)
            for (c = 0; c < L / 64; c++)
                for (k = 0; k < 8; k++)
                    for (j = 0; j < 8; j++) {
                        coli_idx e = 64 * c + 8 * j + k;
                        /* 16^-k as a float (k < 7); nibble 7 is shifted down, not scaled */
                        float sk = k == 7 ? 1.0f : 1.0f / (float)(1L << (4 * k));
                        xo[64 * c + 8 * k + j] = e < cols ? xr[e] * sk : 0.0f;
                    }
        else
        for (c = 0; c < L / (2 * cb); c++)
            for (j = 0; j < cb; j++) {
                coli_idx e = 2 * (cb * c + j);
                xo[2 * cb * c + j] = e < cols ? xr[e] : 0.0f;
                xo[2 * cb * c + cb + j] = e + 1 < cols ? xr[e + 1] : 0.0f;
            }
        for (g = 0; g < ng; g++)
            for (k = 0; k < gst / COLI_GINIT; k++) {
                /* -8 * (sum of x over elements 64k .. 64k+63 of group g): the "- 8" of the
                 * nibbles, added to the accumulators at the start of each 64-element block */
                float sum = 0.0f, *gi = ginit + (t * ng + g) * gst + k * COLI_GINIT;
                coli_idx i0 = g * gs + 64 * k, i1 = i0 + 64;
                if (i1 > (g + 1) * gs)
                    i1 = (g + 1) * gs;
                for (i = i0; i < i1 && i < cols; i++)
                    sum += xr[i];
                gi[0] = -8.0f * sum;
                for (j = 1; j < COLI_GINIT; j++)
                    gi[j] = 0.0f;
            }
    }
}

/* ---- int4: portable (any even group size) ---------------------------------------------------
 * x layout: per group, the gb low-nibble elements then the gb high-nibble ones.  64 lanes: lane j
 * accumulates the bytes k of every group with k % 64 == j, as ((lo-8) x_lo + (hi-8) x_hi) * s;
 * the lanes are folded by a fixed tree.  Plain loops the compiler vectorizes. */
enum { COLI_PL = 64 };

static float coli_fold64(float *a)
{
    int n, j;
    for (n = COLI_PL / 2; n >= 1; n /= 2)
        for (j = 0; j < n; j++)
            a[j] = a[j] + a[j + n];
    return a[0];
}

static float coli_q4_row_portable(const uint8_t *w, const float *s, const float *xo,
                                  coli_idx nb, coli_idx ng, coli_idx gs)
{
    coli_idx gb = gs / 2, g, k0, j;
    float acc[COLI_PL];
    for (j = 0; j < COLI_PL; j++)
        acc[j] = 0.0f;
    for (g = 0; g < ng; g++) {
        coli_idx n = nb - g * gb < gb ? nb - g * gb : gb;
        const uint8_t *wg = w + g * gb;
        const float *xl = xo + g * gs, *xh = xl + gb;
        const float sc = s[g];
        for (k0 = 0; k0 < n; k0 += COLI_PL) {
            coli_idx m = n - k0 < COLI_PL ? n - k0 : COLI_PL;
            for (j = 0; j < m; j++) {
                uint8_t b = wg[k0 + j];
                acc[j] = acc[j] + ((float)((int)(b & 15) - 8) * xl[k0 + j]
                                   + (float)((int)(b >> 4) - 8) * xh[k0 + j]) * sc;
            }
        }
    }
    return coli_fold64(acc);
}

static float coli_fold8(const float *a)
{
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* Chunk c of a group whose packed bytes end after `avail` bytes: straight from memory when whole,
 * else copied into buf and padded with 0x88 (nibbles 8, i.e. zero weights; x is zero there). */
static inline const uint8_t *coli_chunk(const uint8_t *wg, coli_idx c, coli_idx cb, coli_idx avail,
                                        uint8_t *buf)
{
    coli_idx n = avail - cb * c;
    if (n >= cb)
        return wg + cb * c;
    memset(buf, 0x88, (size_t)cb);
    if (n > 0)
        memcpy(buf, wg + cb * c, (size_t)n);
    return buf;
}

/* Decode streams are prefetched this many bytes ahead in software (the hardware prefetcher
 * stops at each 4 KiB page).  coli_q4_multirow = 0 (benchmarks and bit tests only) runs decode
 * as before: AVX-512 through its one-row loop, the AVX2 lane kernel without the prefetches. */
enum { COLI_Q4_AHEAD = 1024 };
static int coli_q4_multirow = 1;

/* ---- int4: AVX2 ------------------------------------------------------------------------------ */
#if COLI_X86

COLI_T_AVX2 static inline float coli_hsum256(__m256 v)
{
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

COLI_T_AVX2 static inline __m256 coli_q4_group_avx2(const uint8_t *wg, const float *xg,
                                                    const float *gi, coli_idx nch, coli_idx avail,
                                                    __m256 acc, float sc)
{
    const __m256i m = _mm256_set1_epi32(15);
    __m256 a0 = _mm256_loadu_ps(gi), a1 = _mm256_setzero_ps();
    uint8_t buf[8];
    coli_idx c;
    for (c = 0; c < nch; c++) {
        const uint8_t *b = avail >= 8 * nch ? wg + 8 * c : coli_chunk(wg, c, 8, avail, buf);
        __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
        __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(d, m));
        __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4));
        if (c && c % 4 == 0)   /* a new 64-element block: its "- 8" term */
            a0 = _mm256_add_ps(a0, _mm256_loadu_ps(gi + COLI_GINIT * (c / 4)));
        a0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xg + 16 * c), a0);
        a1 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xg + 16 * c + 8), a1);
    }
    return _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_set1_ps(sc), acc);
}

COLI_T_AVX2 COLI_INLINE float coli_q4_row_avx2_g(const uint8_t *w, const float *s,
                                                 const float *xo, const float *gi, coli_idx nb,
                                                 coli_idx ng, coli_idx gs)
{
    coli_idx gb = gs / 2, g, nch = gb / 8, gst = coli_q4_gstride(gs);
    __m256 acc = _mm256_setzero_ps();
    for (g = 0; g + 1 < ng; g++)        /* whole groups: straight from memory */
        acc = coli_q4_group_avx2(w + g * gb, xo + g * gs, gi + g * gst, nch, gb, acc, s[g]);
    /* the last group may end early (cols % gs): its partial chunks go through a padded copy */
    acc = coli_q4_group_avx2(w + g * gb, xo + g * gs, gi + g * gst, nch, nb - g * gb, acc, s[g]);
    return coli_hsum256(acc);
}

/* The group size as a compile-time constant for the common sizes (fully unrolled chunks). */
COLI_T_AVX2 static float coli_q4_row_avx2(const uint8_t *w, const float *s, const float *xo,
                                    const float *gi, coli_idx nb, coli_idx ng, coli_idx gs)
{
    switch (gs) {
    case 32: return coli_q4_row_avx2_g(w, s, xo, gi, nb, ng, 32);
    case 64: return coli_q4_row_avx2_g(w, s, xo, gi, nb, ng, 64);
    case 128: return coli_q4_row_avx2_g(w, s, xo, gi, nb, ng, 128);
    default: return coli_q4_row_avx2_g(w, s, xo, gi, nb, ng, gs);
    }
}

/* ---- int4: AVX2 lane layout (gs % 64 == 0; see coli_q4_lanes) ----
 * Per 64-element block (32 bytes d): n_k = float(d & (15 << 4k)) for k < 7, float(d >> 28) for
 * k = 7; a0 += n_k * x_k for even k, a1 for odd k, in k order; the block's "- 8" term is a0's
 * start value (first block of a group) or added to a0 before the block (later ones).
 * The masks are read from a table through a pointer the compiler cannot see into (an empty asm):
 * with two rows per pass they do not all fit in the 16 ymm registers, and as known constants gcc
 * rebuilt the spilled ones inside the loop (3 instructions each, -10 % GB/s); this way the ones
 * that do not fit become memory operands. */
static const int32_t coli_nib_masks[7][8] __attribute__((aligned(32))) = {
    {0xF, 0xF, 0xF, 0xF, 0xF, 0xF, 0xF, 0xF},
    {0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0},
    {0xF00, 0xF00, 0xF00, 0xF00, 0xF00, 0xF00, 0xF00, 0xF00},
    {0xF000, 0xF000, 0xF000, 0xF000, 0xF000, 0xF000, 0xF000, 0xF000},
    {0xF0000, 0xF0000, 0xF0000, 0xF0000, 0xF0000, 0xF0000, 0xF0000, 0xF0000},
    {0xF00000, 0xF00000, 0xF00000, 0xF00000, 0xF00000, 0xF00000, 0xF00000, 0xF00000},
    {0xF000000, 0xF000000, 0xF000000, 0xF000000, 0xF000000, 0xF000000, 0xF000000, 0xF000000}};
#define COLI_MASK_TABLE(mt) const int32_t *mt = &coli_nib_masks[0][0]; __asm__("" : "+r"(mt))
#define COLI_NIB_AVX2(d, k)                                                                     \
    _mm256_cvtepi32_ps((k) == 7 ? _mm256_srli_epi32(d, 28)                                     \
                                : _mm256_and_si256(d, _mm256_load_si256(                        \
                                      (const __m256i *)(mt + 8 * ((k) < 7 ? (k) : 0)))))

/* One 64-element block of two rows (packed d1, d2) against x block xb: nibble k goes to a0 / c0
 * for even k, a1 / c1 for odd k, in k order (one x load feeds both rows). */
#define COLI_LANES_STEP(k, A, C)                                                                \
    {                                                                                           \
        __m256 xk = _mm256_loadu_ps(xb + 8 * (k));                                              \
        A = _mm256_fmadd_ps(COLI_NIB_AVX2(d1, k), xk, A);                                       \
        C = _mm256_fmadd_ps(COLI_NIB_AVX2(d2, k), xk, C);                                       \
    }
#define COLI_LANES_BLOCK                                                                        \
    COLI_LANES_STEP(0, a0, c0) COLI_LANES_STEP(1, a1, c1) COLI_LANES_STEP(2, a0, c0)             \
    COLI_LANES_STEP(3, a1, c1) COLI_LANES_STEP(4, a0, c0) COLI_LANES_STEP(5, a1, c1)             \
    COLI_LANES_STEP(6, a0, c0) COLI_LANES_STEP(7, a1, c1)

/* 32 bytes of block c of a group whose packed bytes end after `avail` (padded with 0x88). */
COLI_T_AVX2 static inline __m256i coli_q4_load_lanes(const uint8_t *wg, coli_idx c, coli_idx avail,
                                                     uint8_t *buf)
{
    const uint8_t *b = avail >= 32 * (c + 1) ? wg + 32 * c : coli_chunk(wg, c, 32, avail, buf);
    return _mm256_loadu_si256((const __m256i *)b);
}

/* Two rows per pass, w1 and w2 (w2 == w1 for a lone row): one x load feeds both, and two row
 * streams far apart (the caller pairs r with r + half of its block) keep two hardware prefetch
 * streams busy.  Each row sees exactly the operations of a one-row pass.  Groups of 64 (the
 * container's size) have a loop of their own: one block per group, no per-block branches. */
COLI_T_AVX2 COLI_INLINE void coli_q4_row2_lanes(const uint8_t *w1, const uint8_t *w2,
                                                const float *s1, const float *s2,
                                                const float *xo, const float *gi, coli_idx nb,
                                                coli_idx ng, coli_idx gs, float *y1, float *y2)
{
    coli_idx gb = gs / 2, g = 0, c, nbk = gs / 64, gst = coli_q4_gstride(gs);
    coli_idx nfull = nb == ng * gb ? ng : ng - 1;   /* groups that are whole in memory */
    __m256 acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    uint8_t buf1[32], buf2[32];
    COLI_MASK_TABLE(mt);
    if (gs == 64)
        for (; g < nfull; g++) {
            const float *xb = xo + 64 * g;
            if (coli_q4_multirow && !(g & 1)) {   /* one prefetch per 64 bytes of each stream */
                _mm_prefetch((const char *)(w1 + 32 * g) + COLI_Q4_AHEAD, _MM_HINT_T0);
                _mm_prefetch((const char *)(w2 + 32 * g) + COLI_Q4_AHEAD, _MM_HINT_T0);
            }
            __m256i d1 = _mm256_loadu_si256((const __m256i *)(w1 + 32 * g));
            __m256i d2 = _mm256_loadu_si256((const __m256i *)(w2 + 32 * g));
            __m256 a0 = _mm256_loadu_ps(gi + COLI_GINIT * g), a1 = _mm256_setzero_ps();
            __m256 c0 = a0, c1 = a1;
            COLI_LANES_BLOCK
            acc1 = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_set1_ps(s1[g]), acc1);
            acc2 = _mm256_fmadd_ps(_mm256_add_ps(c0, c1), _mm256_set1_ps(s2[g]), acc2);
        }
    for (; g < ng; g++) {     /* other group sizes, and a last group that ends early */
        const float *xg = xo + g * gs, *gg = gi + g * gst;
        coli_idx avail = g + 1 < ng ? gb : nb - g * gb;
        __m256 a0 = _mm256_loadu_ps(gg), a1 = _mm256_setzero_ps(), c0 = a0, c1 = a1;
        for (c = 0; c < nbk; c++) {
            const float *xb = xg + 64 * c;
            __m256i d1 = coli_q4_load_lanes(w1 + g * gb, c, avail, buf1);
            __m256i d2 = coli_q4_load_lanes(w2 + g * gb, c, avail, buf2);
            if (c) {
                __m256 t = _mm256_loadu_ps(gg + COLI_GINIT * c);
                a0 = _mm256_add_ps(a0, t);
                c0 = _mm256_add_ps(c0, t);
            }
            COLI_LANES_BLOCK
        }
        acc1 = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_set1_ps(s1[g]), acc1);
        acc2 = _mm256_fmadd_ps(_mm256_add_ps(c0, c1), _mm256_set1_ps(s2[g]), acc2);
    }
    *y1 = coli_hsum256(acc1);
    *y2 = coli_hsum256(acc2);
}

/* Decode rows [r0, r1): row r with row r + half in one pass (a lone middle row pairs with
 * itself). */
COLI_T_AVX2 static void coli_q4_rows_lanes(const uint8_t *w, const float *s, const float *xp,
                                           const float *gi, float *y, coli_idx r0, coli_idx r1,
                                           coli_idx nb, coli_idx ng, coli_idx gs)
{
    coli_idx half = (r1 - r0 + 1) / 2, r;
    for (r = r0; r < r0 + half; r++) {
        coli_idx r2 = r + half < r1 ? r + half : r;
        float y2;
        coli_q4_row2_lanes(w + r * nb, w + r2 * nb, s + r * ng, s + r2 * ng, xp, gi, nb, ng, gs,
                           y + r, &y2);
        y[r2] = y2;
    }
}

/* Unpacked row in the lane layout: U[64 c + 8 k + l] = n_k of block c (as the decode kernel
 * computes it), so the prefill kernels (COLI_Q4_PF_AVX2: a0 takes the even 8-float vectors, a1
 * the odd ones) run exactly the decode row's operations. */
COLI_T_AVX2 static void coli_q4_unpack_lanes(const uint8_t *w, float *U, coli_idx nb, coli_idx L)
{
    uint8_t buf[32];
    coli_idx c;
    COLI_MASK_TABLE(mt);
    for (c = 0; c < L / 64; c++) {
        __m256i d = coli_q4_load_lanes(w, c, nb, buf);
        float *u = U + 64 * c;
        _mm256_storeu_ps(u, COLI_NIB_AVX2(d, 0));
        _mm256_storeu_ps(u + 8, COLI_NIB_AVX2(d, 1));
        _mm256_storeu_ps(u + 16, COLI_NIB_AVX2(d, 2));
        _mm256_storeu_ps(u + 24, COLI_NIB_AVX2(d, 3));
        _mm256_storeu_ps(u + 32, COLI_NIB_AVX2(d, 4));
        _mm256_storeu_ps(u + 40, COLI_NIB_AVX2(d, 5));
        _mm256_storeu_ps(u + 48, COLI_NIB_AVX2(d, 6));
        _mm256_storeu_ps(u + 56, COLI_NIB_AVX2(d, 7));
    }
}

/* Unpacked row: U[16 c + j] = float(lo nibble of byte 8c + j), U[16 c + 8 + j] = float(hi). */
COLI_T_AVX2 static void coli_q4_unpack_avx2(const uint8_t *w, float *U, coli_idx nb, coli_idx L)
{
    const __m256i m = _mm256_set1_epi32(15);
    coli_idx c, nfull = nb / 8;
    for (c = 0; c < nfull; c++) {
        __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 8 * c)));
        _mm256_storeu_ps(U + 16 * c, _mm256_cvtepi32_ps(_mm256_and_si256(d, m)));
        _mm256_storeu_ps(U + 16 * c + 8, _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4)));
    }
    for (c = 16 * nfull; c < L; c++)
        U[c] = 8.0f;
    for (c = 8 * nfull; c < nb; c++) {
        coli_idx k = c - 8 * nfull;
        U[16 * nfull + k] = (float)(w[c] & 15);
        U[16 * nfull + 8 + k] = (float)(w[c] >> 4);
    }
}

/* y[t * ys] for nt (1..4) tokens from an unpacked row U; same operations as coli_q4_row_avx2. */
#define COLI_Q4_PF_AVX2(NT)                                                                       \
    COLI_T_AVX2 static void coli_q4_pf##NT##_avx2(const float *U, const float *s,               \
                                                  const float *xp, const float *gi, coli_idx L, \
                                                  coli_idx ng, coli_idx gs, coli_idx g0, coli_idx g1, float *A) \
    {                                                                                           \
        coli_idx g, c, t, nch = gs / 16, gst = coli_q4_gstride(gs);                             \
        __m256 acc[NT];                                                                         \
        for (t = 0; t < NT; t++)                                                                \
            acc[t] = _mm256_loadu_ps(A + 16 * t);                                                       \
        for (g = g0; g < g1; g++) {                                                              \
            __m256 a0[NT], a1[NT], sc = _mm256_set1_ps(s[g]);                                   \
            const float *ug = U + g * gs;                                                       \
            for (t = 0; t < NT; t++) {                                                          \
                a0[t] = _mm256_loadu_ps(gi + (t * ng + g) * gst);                        \
                a1[t] = _mm256_setzero_ps();                                                    \
            }                                                                                   \
            for (c = 0; c < nch; c++) {                                                         \
                __m256 lo = _mm256_loadu_ps(ug + 16 * c), hi = _mm256_loadu_ps(ug + 16 * c + 8);\
                if (c && c % 4 == 0)                                                            \
                    for (t = 0; t < NT; t++)                                                    \
                        a0[t] = _mm256_add_ps(                                                  \
                            a0[t], _mm256_loadu_ps(gi + (t * ng + g) * gst + COLI_GINIT * (c / 4)));\
                for (t = 0; t < NT; t++) {                                                      \
                    const float *xg = xp + t * L + g * gs + 16 * c;                             \
                    a0[t] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xg), a0[t]);                    \
                    a1[t] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xg + 8), a1[t]);                \
                }                                                                               \
            }                                                                                   \
            for (t = 0; t < NT; t++)                                                            \
                acc[t] = _mm256_fmadd_ps(_mm256_add_ps(a0[t], a1[t]), sc, acc[t]);              \
        }                                                                                       \
        for (t = 0; t < NT; t++)                                                                \
            _mm256_storeu_ps(A + 16 * t, acc[t]);                                                   \
    }
COLI_T_AVX2 static float coli_q4_fin_avx2(const float *A)
{
    return coli_hsum256(_mm256_loadu_ps(A));
}
COLI_Q4_PF_AVX2(1)
COLI_Q4_PF_AVX2(2)
COLI_Q4_PF_AVX2(3)
COLI_Q4_PF_AVX2(4)

/* ---- int4: AVX-512 --------------------------------------------------------------------------- */

COLI_T_AVX512 static inline float coli_hsum512(__m512 v)
{
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}

COLI_T_AVX512 static inline __m512 coli_q4_group_avx512(const uint8_t *wg, const float *xg,
                                                        const float *gi, coli_idx nch,
                                                        coli_idx avail, __m512 acc, float sc)
{
    const __m512i m = _mm512_set1_epi32(15);
    __m512 a0 = _mm512_loadu_ps(gi), a1 = _mm512_setzero_ps();
    uint8_t buf[16];
    coli_idx c;
    for (c = 0; c < nch; c++) {
        const uint8_t *b = avail >= 16 * nch ? wg + 16 * c : coli_chunk(wg, c, 16, avail, buf);
        __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
        __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(d, m));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4));
        if (c && c % 2 == 0)   /* a new 64-element block: its "- 8" term */
            a0 = _mm512_add_ps(a0, _mm512_loadu_ps(gi + COLI_GINIT * (c / 2)));
        a0 = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg + 32 * c), a0);
        a1 = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 32 * c + 16), a1);
    }
    return _mm512_fmadd_ps(_mm512_add_ps(a0, a1), _mm512_set1_ps(sc), acc);
}

COLI_T_AVX512 COLI_INLINE float coli_q4_row_avx512_g(const uint8_t *w, const float *s,
                                                     const float *xo, const float *gi,
                                                     coli_idx nb, coli_idx ng, coli_idx gs)
{
    coli_idx gb = gs / 2, g, nch = gb / 16, gst = coli_q4_gstride(gs);
    __m512 acc = _mm512_setzero_ps();
    for (g = 0; g + 1 < ng; g++)        /* whole groups: avail >= gb, straight from memory */
        acc = coli_q4_group_avx512(w + g * gb, xo + g * gs, gi + g * gst, nch, gb, acc,
                                   s[g]);
    acc = coli_q4_group_avx512(w + g * gb, xo + g * gs, gi + g * gst, nch, nb - g * gb,
                               acc, s[g]);
    return coli_hsum512(acc);
}

/* The group size as a compile-time constant for the common sizes (fully unrolled chunks). */
COLI_T_AVX512 static float coli_q4_row_avx512(const uint8_t *w, const float *s, const float *xo,
                                    const float *gi, coli_idx nb, coli_idx ng, coli_idx gs)
{
    switch (gs) {
    case 32: return coli_q4_row_avx512_g(w, s, xo, gi, nb, ng, 32);
    case 64: return coli_q4_row_avx512_g(w, s, xo, gi, nb, ng, 64);
    case 128: return coli_q4_row_avx512_g(w, s, xo, gi, nb, ng, 128);
    default: return coli_q4_row_avx512_g(w, s, xo, gi, nb, ng, gs);
    }
}

/* Decode, two rows per pass (rows r and r + half of the block, as the AVX2 lane kernel): one x
 * load feeds both rows, two row streams far apart, each prefetched COLI_Q4_AHEAD bytes ahead in
 * software.  The nibbles become floats through a 16-entry table (vpermps reads the low 4 bits of
 * each 32-bit lane: float(b & 15) without the and, float(b >> 4) after the shift) -- the same
 * floats as the convert of coli_q4_group_avx512, and every row sees exactly its operations in its
 * order, so the bits are those of coli_q4_row_avx512 (and of the prefill kernels). */
COLI_T_AVX512 COLI_INLINE void coli_q4_row2_avx512_g(const uint8_t *w1, const uint8_t *w2,
                                                     const float *s1, const float *s2,
                                                     const float *xo, const float *gi, coli_idx nb,
                                                     coli_idx ng, coli_idx gs, float *y1, float *y2)
{
    const __m512 tab = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f,
                                      11.f, 12.f, 13.f, 14.f, 15.f);
    coli_idx gb = gs / 2, g, c, nch = gb / 16, gst = coli_q4_gstride(gs), p;
    coli_idx nfull = nb == ng * gb ? ng : ng - 1;   /* groups that are whole in memory */
    __m512 acc1 = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
    uint8_t buf1[16], buf2[16];
    for (g = 0; g < ng; g++) {
        const uint8_t *wg1 = w1 + g * gb, *wg2 = w2 + g * gb;
        const float *xg = xo + g * gs, *gg = gi + g * gst;
        coli_idx avail = g < nfull ? gb : nb - g * gb;
        __m512 a0 = _mm512_loadu_ps(gg), a1 = _mm512_setzero_ps(), c0 = a0, c1 = a1;
        for (p = (g * gb + 63) & ~(coli_idx)63; p < (g + 1) * gb; p += 64) {
            _mm_prefetch((const char *)(w1 + p) + COLI_Q4_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char *)(w2 + p) + COLI_Q4_AHEAD, _MM_HINT_T0);
        }
        for (c = 0; c < nch; c++) {
            const uint8_t *b1 = g < nfull ? wg1 + 16 * c : coli_chunk(wg1, c, 16, avail, buf1);
            const uint8_t *b2 = g < nfull ? wg2 + 16 * c : coli_chunk(wg2, c, 16, avail, buf2);
            __m512i d1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b1));
            __m512i d2 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b2));
            __m512 xl = _mm512_loadu_ps(xg + 32 * c), xh = _mm512_loadu_ps(xg + 32 * c + 16);
            if (c && c % 2 == 0) {   /* a new 64-element block: its "- 8" term */
                __m512 t = _mm512_loadu_ps(gg + COLI_GINIT * (c / 2));
                a0 = _mm512_add_ps(a0, t);
                c0 = _mm512_add_ps(c0, t);
            }
            a0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(d1, tab), xl, a0);
            a1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d1, 4), tab), xh, a1);
            c0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(d2, tab), xl, c0);
            c1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d2, 4), tab), xh, c1);
        }
        acc1 = _mm512_fmadd_ps(_mm512_add_ps(a0, a1), _mm512_set1_ps(s1[g]), acc1);
        acc2 = _mm512_fmadd_ps(_mm512_add_ps(c0, c1), _mm512_set1_ps(s2[g]), acc2);
    }
    *y1 = coli_hsum512(acc1);
    *y2 = coli_hsum512(acc2);
}

COLI_T_AVX512 static void coli_q4_row2_avx512(const uint8_t *w1, const uint8_t *w2,
                                              const float *s1, const float *s2, const float *xo,
                                              const float *gi, coli_idx nb, coli_idx ng,
                                              coli_idx gs, float *y1, float *y2)
{
    switch (gs) {
    case 32: coli_q4_row2_avx512_g(w1, w2, s1, s2, xo, gi, nb, ng, 32, y1, y2); break;
    case 64: coli_q4_row2_avx512_g(w1, w2, s1, s2, xo, gi, nb, ng, 64, y1, y2); break;
    case 128: coli_q4_row2_avx512_g(w1, w2, s1, s2, xo, gi, nb, ng, 128, y1, y2); break;
    default: coli_q4_row2_avx512_g(w1, w2, s1, s2, xo, gi, nb, ng, gs, y1, y2); break;
    }
}

/* Decode rows [r0, r1): row r with row r + half (a lone middle row pairs with itself). */
COLI_T_AVX512 static void coli_q4_rows2_avx512(const uint8_t *w, const float *s, const float *xp,
                                               const float *gi, float *y, coli_idx r0,
                                               coli_idx r1, coli_idx nb, coli_idx ng, coli_idx gs)
{
    coli_idx half = (r1 - r0 + 1) / 2, r;
    for (r = r0; r < r0 + half; r++) {
        coli_idx r2 = r + half < r1 ? r + half : r;
        float y2;
        coli_q4_row2_avx512(w + r * nb, w + r2 * nb, s + r * ng, s + r2 * ng, xp, gi, nb, ng, gs,
                            y + r, &y2);
        y[r2] = y2;
    }
}

/* U[32 c + j] = float(lo nibble of byte 16c + j), U[32 c + 16 + j] = float(hi). */
COLI_T_AVX512 static void coli_q4_unpack_avx512(const uint8_t *w, float *U, coli_idx nb,
                                                coli_idx L)
{
    const __m512i m = _mm512_set1_epi32(15);
    coli_idx c, nfull = nb / 16;
    for (c = 0; c < nfull; c++) {
        __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 16 * c)));
        _mm512_storeu_ps(U + 32 * c, _mm512_cvtepi32_ps(_mm512_and_si512(d, m)));
        _mm512_storeu_ps(U + 32 * c + 16, _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4)));
    }
    for (c = 32 * nfull; c < L; c++)
        U[c] = 8.0f;
    for (c = 16 * nfull; c < nb; c++) {
        coli_idx k = c - 16 * nfull;
        U[32 * nfull + k] = (float)(w[c] & 15);
        U[32 * nfull + 16 + k] = (float)(w[c] >> 4);
    }
}

#define COLI_Q4_PF_AVX512(NT)                                                                     \
    COLI_T_AVX512 static void coli_q4_pf##NT##_avx512(const float *U, const float *s,           \
                                                      const float *xp, const float *gi,         \
                                                      coli_idx L, coli_idx ng, coli_idx gs, coli_idx g0, coli_idx g1, float *A) \
    {                                                                                           \
        coli_idx g, c, t, nch = gs / 32, gst = coli_q4_gstride(gs);                             \
        __m512 acc[NT];                                                                         \
        for (t = 0; t < NT; t++)                                                                \
            acc[t] = _mm512_loadu_ps(A + 16 * t);                                                       \
        for (g = g0; g < g1; g++) {                                                              \
            __m512 a0[NT], a1[NT], sc = _mm512_set1_ps(s[g]);                                   \
            const float *ug = U + g * gs;                                                       \
            for (t = 0; t < NT; t++) {                                                          \
                a0[t] = _mm512_loadu_ps(gi + (t * ng + g) * gst);                        \
                a1[t] = _mm512_setzero_ps();                                                    \
            }                                                                                   \
            for (c = 0; c < nch; c++) {                                                         \
                __m512 lo = _mm512_loadu_ps(ug + 32 * c);                                       \
                __m512 hi = _mm512_loadu_ps(ug + 32 * c + 16);                                  \
                if (c && c % 2 == 0)                                                            \
                    for (t = 0; t < NT; t++)                                                    \
                        a0[t] = _mm512_add_ps(                                                  \
                            a0[t], _mm512_loadu_ps(gi + (t * ng + g) * gst + COLI_GINIT * (c / 2)));\
                for (t = 0; t < NT; t++) {                                                      \
                    const float *xg = xp + t * L + g * gs + 32 * c;                             \
                    a0[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg), a0[t]);                    \
                    a1[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16), a1[t]);               \
                }                                                                               \
            }                                                                                   \
            for (t = 0; t < NT; t++)                                                            \
                acc[t] = _mm512_fmadd_ps(_mm512_add_ps(a0[t], a1[t]), sc, acc[t]);              \
        }                                                                                       \
        for (t = 0; t < NT; t++)                                                                \
            _mm512_storeu_ps(A + 16 * t, acc[t]);                                                   \
    }
COLI_T_AVX512 static float coli_q4_fin_avx512(const float *A)
{
    return coli_hsum512(_mm512_loadu_ps(A));
}
COLI_Q4_PF_AVX512(1)
COLI_Q4_PF_AVX512(2)
COLI_Q4_PF_AVX512(3)
COLI_Q4_PF_AVX512(4)

#endif /* COLI_X86 */

/* ---- NEON (AArch64): int4, int4 x int8, int8 ------------------------------------------------ */
#if COLI_ARM
#include "qkern_neon.h"
#endif

/* ---- int4 x int8 activations (opt-in, AVX2 / AVX-512 / NEON machines, gs % 64 == 0) ---------
 * x is quantized per 32 elements: d = absmax / 127, xq = round(x / d) (int8).  Per 64 elements
 * of a row (32 packed bytes): maddubs(nibbles, xq) of the low and the high nibbles, pairwise
 * summed to 8 int32 lanes (lanes 0-3: elements 0-31, lanes 4-7: elements 32-63), plus the exact
 * integer "- 8 * sum(xq)" of each 32-block, then float: times (d0 x4, d1 x4), summed per group,
 * times the group scale.  All integer sums are exact, so the only error is the rounding of x to
 * int8 (~0.2-0.5 % of an output's magnitude); see qmatmul.set_int8_activations.  NEON: the same
 * integer sums with vmull_s8 / vpadalq_s16 (qkern_neon.h). */
static int coli_q4i8_ok(int level, coli_idx gs)
{
    return (level == COLI_AVX2 || level == COLI_AVX512 || (level == COLI_NEON && COLI_ARM))
           && gs % 64 == 0;
}

/* xq: [T][L] int8, per 64 elements: 32 low-nibble elements (0, 2, .., 62) then 32 high (1, .., 63);
 * xd: [T][L / 64][8] floats (d0 x4, d1 x4); xc: [T][L / 64][8] int32 (-8 sum xq of each 32-block
 * in lanes 0 and 4). */
static void coli_q4i8_prep(const float *x, coli_idx T, coli_idx cols, coli_idx L, int8_t *xq,
                           float *xd, int32_t *xc)
{
    coli_idx t, b, j, h;
    for (t = 0; t < T; t++) {
        const float *xr = x + t * cols;
        for (b = 0; b < L / 64; b++) {
            int8_t *q = xq + t * L + 64 * b;
            float *d = xd + (t * (L / 64) + b) * 8;
            int32_t *c = xc + (t * (L / 64) + b) * 8;
            for (j = 0; j < 8; j++)
                c[j] = 0;
            for (h = 0; h < 2; h++) {          /* the two 32-element halves */
                float amax = 0.0f, dh, inv;
                int32_t sum = 0;
                for (j = 0; j < 32; j++) {
                    coli_idx e = 64 * b + 32 * h + j;
                    float v = e < cols ? xr[e] : 0.0f;
                    amax = v > amax ? v : (-v > amax ? -v : amax);
                }
                dh = amax / 127.0f;
                inv = amax > 0.0f ? 127.0f / amax : 0.0f;
                for (j = 0; j < 32; j++) {
                    coli_idx e = 64 * b + 32 * h + j;   /* element of the row */
                    float v = e < cols ? xr[e] * inv : 0.0f;
                    int qv = (int)(v >= 0.0f ? v + 0.5f : v - 0.5f);
                    qv = qv > 127 ? 127 : (qv < -127 ? -127 : qv);
                    /* element e = 2 * byte + nibble; bytes 16h .. 16h+15 of the block */
                    q[(j & 1) * 32 + 16 * h + j / 2] = (int8_t)qv;
                    sum += qv;
                }
                for (j = 0; j < 4; j++)
                    d[4 * h + j] = dh;
                c[4 * h] = -8 * sum;
            }
        }
    }
}

#if COLI_X86
COLI_T_AVX2 COLI_INLINE __m256 coli_q4i8_blk_avx2(const uint8_t *b, const int8_t *q,
                                                   const int32_t *c)
{
    const __m256i m = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256i v = _mm256_loadu_si256((const __m256i *)b);
    __m256i lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)q)),
                                 _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q + 32))));
    p = _mm256_add_epi32(_mm256_madd_epi16(p, ones), _mm256_loadu_si256((const __m256i *)c));
    return _mm256_cvtepi32_ps(p);
}

/* A last group that ends early (avail packed bytes): its blocks through padded copies. */
COLI_T_AVX2 static __m256 coli_q4i8_tail_avx2(const uint8_t *b, coli_idx avail, const int8_t *xq,
                                             const float *xd, const int32_t *xc, coli_idx blk,
                                             coli_idx nbk)
{
    uint8_t buf[32];
    coli_idx k;
    __m256 ga = _mm256_setzero_ps();
    for (k = 0; k < nbk; k++) {
        coli_idx n = avail - 32 * k;
        memset(buf, 0x88, sizeof(buf));
        if (n > 0)
            memcpy(buf, b + 32 * k, (size_t)(n < 32 ? n : 32));
        ga = _mm256_fmadd_ps(coli_q4i8_blk_avx2(buf, xq + 64 * (blk + k), xc + 8 * (blk + k)),
                             _mm256_loadu_ps(xd + 8 * (blk + k)), ga);
    }
    return ga;
}

COLI_T_AVX2 COLI_INLINE float coli_q4i8_row_avx2_g(const uint8_t *w, const float *s,
                                                   const int8_t *xq, const float *xd,
                                                   const int32_t *xc, coli_idx nb, coli_idx ng,
                                                   coli_idx gs)
{
    coli_idx gb = gs / 2, g, k, nbk = gs / 64;
    __m256 acc[2];
    acc[0] = _mm256_setzero_ps();
    acc[1] = _mm256_setzero_ps();
    for (g = 0; g < ng; g++) {
        coli_idx avail = nb - g * gb, blk = g * nbk;
        const uint8_t *b = w + g * gb;
        __m256 ga;
        if (avail >= gb) {
            ga = _mm256_mul_ps(coli_q4i8_blk_avx2(b, xq + 64 * blk, xc + 8 * blk),
                               _mm256_loadu_ps(xd + 8 * blk));
            for (k = 1; k < nbk; k++)
                ga = _mm256_fmadd_ps(coli_q4i8_blk_avx2(b + 32 * k, xq + 64 * (blk + k),
                                                        xc + 8 * (blk + k)),
                                     _mm256_loadu_ps(xd + 8 * (blk + k)), ga);
        } else {                 /* last group, partly beyond the row: padded copies */
            ga = coli_q4i8_tail_avx2(b, avail, xq, xd, xc, blk, nbk);
        }
        /* two accumulators (even / odd groups): no serial chain of FMAs across the row */
        acc[g & 1] = _mm256_fmadd_ps(ga, _mm256_set1_ps(s[g]), acc[g & 1]);
    }
    return coli_hsum256(_mm256_add_ps(acc[0], acc[1]));
}

/* Two rows per pass (decode): rows r and r + half of the block, each with exactly the operations
 * of coli_q4i8_row_avx2_g (two row streams for the hardware prefetcher, as the float path). */
COLI_T_AVX2 COLI_INLINE void coli_q4i8_row2_avx2_g(const uint8_t *w1, const uint8_t *w2,
                                                   const float *s1, const float *s2,
                                                   const int8_t *xq, const float *xd,
                                                   const int32_t *xc, coli_idx nb, coli_idx ng,
                                                   coli_idx gs, float *y1, float *y2)
{
    coli_idx gb = gs / 2, g, k, nbk = gs / 64, nfull = nb == ng * gb ? ng : ng - 1;
    __m256 a1[2], a2[2];
    a1[0] = a1[1] = a2[0] = a2[1] = _mm256_setzero_ps();
    for (g = 0; g < nfull; g++) {
        coli_idx blk = g * nbk;
        const uint8_t *b1 = w1 + g * gb, *b2 = w2 + g * gb;
        __m256 d = _mm256_loadu_ps(xd + 8 * blk);
        __m256 g1 = _mm256_mul_ps(coli_q4i8_blk_avx2(b1, xq + 64 * blk, xc + 8 * blk), d);
        __m256 g2 = _mm256_mul_ps(coli_q4i8_blk_avx2(b2, xq + 64 * blk, xc + 8 * blk), d);
        for (k = 1; k < nbk; k++) {
            d = _mm256_loadu_ps(xd + 8 * (blk + k));
            g1 = _mm256_fmadd_ps(coli_q4i8_blk_avx2(b1 + 32 * k, xq + 64 * (blk + k),
                                                    xc + 8 * (blk + k)), d, g1);
            g2 = _mm256_fmadd_ps(coli_q4i8_blk_avx2(b2 + 32 * k, xq + 64 * (blk + k),
                                                    xc + 8 * (blk + k)), d, g2);
        }
        a1[g & 1] = _mm256_fmadd_ps(g1, _mm256_set1_ps(s1[g]), a1[g & 1]);
        a2[g & 1] = _mm256_fmadd_ps(g2, _mm256_set1_ps(s2[g]), a2[g & 1]);
    }
    if (g < ng) {   /* a last group that ends early: the one-row code's padded copies */
        coli_idx blk = g * nbk, avail = nb - g * gb;
        a1[g & 1] = _mm256_fmadd_ps(coli_q4i8_tail_avx2(w1 + g * gb, avail, xq, xd, xc, blk, nbk),
                                    _mm256_set1_ps(s1[g]), a1[g & 1]);
        a2[g & 1] = _mm256_fmadd_ps(coli_q4i8_tail_avx2(w2 + g * gb, avail, xq, xd, xc, blk, nbk),
                                    _mm256_set1_ps(s2[g]), a2[g & 1]);
    }
    *y1 = coli_hsum256(_mm256_add_ps(a1[0], a1[1]));
    *y2 = coli_hsum256(_mm256_add_ps(a2[0], a2[1]));
}

COLI_T_AVX2 static void coli_q4i8_rows2_avx2(const uint8_t *w, const float *s, const int8_t *xq,
                                             const float *xd, const int32_t *xc, float *y,
                                             coli_idx r0, coli_idx r1, coli_idx nb, coli_idx ng,
                                             coli_idx gs)
{
    coli_idx half = (r1 - r0 + 1) / 2, r;
    for (r = r0; r < r0 + half; r++) {
        coli_idx r2 = r + half < r1 ? r + half : r;
        float v2;
        if (gs == 64)
            coli_q4i8_row2_avx2_g(w + r * nb, w + r2 * nb, s + r * ng, s + r2 * ng, xq, xd, xc,
                                  nb, ng, 64, y + r, &v2);
        else
            coli_q4i8_row2_avx2_g(w + r * nb, w + r2 * nb, s + r * ng, s + r2 * ng, xq, xd, xc,
                                  nb, ng, gs, y + r, &v2);
        y[r2] = v2;
    }
}

COLI_T_AVX2 static float coli_q4i8_row_avx2(const uint8_t *w, const float *s, const int8_t *xq,
                                            const float *xd, const int32_t *xc, coli_idx nb,
                                            coli_idx ng, coli_idx gs)
{
    switch (gs) {   /* the common group sizes as compile-time constants */
    case 64: return coli_q4i8_row_avx2_g(w, s, xq, xd, xc, nb, ng, 64);
    case 128: return coli_q4i8_row_avx2_g(w, s, xq, xd, xc, nb, ng, 128);
    default: return coli_q4i8_row_avx2_g(w, s, xq, xd, xc, nb, ng, gs);
    }
}
#endif

/* Rows [r0, r1) for all T tokens (each token: the decode row; weights re-read from cache), with
 * the kernel of `level` (NEON where level == COLI_NEON and NEON is compiled, else AVX2 on x86). */
static void coli_q4i8_rows_level(int level, const uint8_t *w, const float *s, const int8_t *xq,
                                 const float *xd, const int32_t *xc, float *y, coli_idx r0,
                                 coli_idx r1, coli_idx T, coli_idx O, coli_idx nb, coli_idx ng,
                                 coli_idx gs)
{
    coli_idx L = ng * gs, r, t;
    (void)level;
#if COLI_X86
    if (T == 1 && (level != COLI_NEON || !COLI_ARM)) {
        coli_q4i8_rows2_avx2(w, s, xq, xd, xc, y, r0, r1, nb, ng, gs);
        return;
    }
#endif
    for (r = r0; r < r1; r++)
        for (t = 0; t < T; t++) {
            const uint8_t *wr = w + r * nb;
            const float *sr = s + r * ng, *dt = xd + t * (L / 64) * 8;
            const int8_t *qt = xq + t * L;
            const int32_t *ct = xc + t * (L / 64) * 8;
            float v = 0.0f;
#if COLI_ARM
            if (level == COLI_NEON || !COLI_X86)
                v = coli_q4i8_row_neon(wr, sr, qt, dt, ct, nb, ng, gs);
#endif
#if COLI_X86
            if (level != COLI_NEON || !COLI_ARM)
                v = coli_q4i8_row_avx2(wr, sr, qt, dt, ct, nb, ng, gs);
#endif
            (void)wr; (void)sr; (void)dt; (void)qt; (void)ct;
            y[t * O + r] = v;
        }
}

/* The same with the machine's int8-activation kernel (AVX2 on x86-64, NEON on AArch64). */
static void coli_q4i8_rows(const uint8_t *w, const float *s, const int8_t *xq, const float *xd,
                           const int32_t *xc, float *y, coli_idx r0, coli_idx r1, coli_idx T,
                           coli_idx O, coli_idx nb, coli_idx ng, coli_idx gs)
{
    coli_q4i8_rows_level(COLI_X86 ? COLI_AVX2 : COLI_NEON, w, s, xq, xd, xc, y, r0, r1, T, O, nb,
                         ng, gs);
}

/* ---- int4: a block of rows [r0, r1) for all T tokens -----------------------------------------
 * lv: level from coli_q4_level (-1: generic).  xp / ginit from coli_q4_prep.  U: scratch of
 * (r1 - r0) * L floats (prefill on AVX2 / AVX-512 / NEON only).  y: [T][O]. */

/* Whether level lv has the unpacked-row prefill kernels (compiled in this build). */
static int coli_q4_has_pf(int lv)
{
#if COLI_X86
    if (lv == COLI_AVX2 || lv == COLI_AVX512)
        return 1;
#endif
#if COLI_ARM
    if (lv == COLI_NEON)
        return 1;
#endif
    (void)lv;
    return 0;
}

static size_t coli_q4_scratch_floats(int lv, coli_idx T, coli_idx rb, coli_idx L)
{
    return T > 1 && coli_q4_has_pf(lv) ? (size_t)(rb * L + rb * T * 16) : 0;
}

static void coli_q4_unpack(int lv, const uint8_t *w, float *U, coli_idx nb, coli_idx L,
                           coli_idx gs)
{
#if COLI_X86
    if (coli_q4_lanes(lv, gs))
        coli_q4_unpack_lanes(w, U, nb, L);
    else if (lv == COLI_AVX512)
        coli_q4_unpack_avx512(w, U, nb, L);
    else if (lv == COLI_AVX2)
        coli_q4_unpack_avx2(w, U, nb, L);
#endif
#if COLI_ARM
    if (lv == COLI_NEON)
        coli_q4_unpack_neon(w, U, nb, L);
#endif
    (void)lv; (void)w; (void)U; (void)nb; (void)L; (void)gs;
}

/* Groups [g0, g1) of n (1..4) tokens from an unpacked row (coli_q4_pf<n>_<level>). */
#define COLI_Q4_PF_N(SUF)                                                                       \
    switch (n) {                                                                                \
    case 4: coli_q4_pf4_##SUF(Ur, sr, xt, gt, L, ng, gs, g0, g1, Ar); break;                    \
    case 3: coli_q4_pf3_##SUF(Ur, sr, xt, gt, L, ng, gs, g0, g1, Ar); break;                    \
    case 2: coli_q4_pf2_##SUF(Ur, sr, xt, gt, L, ng, gs, g0, g1, Ar); break;                    \
    default: coli_q4_pf1_##SUF(Ur, sr, xt, gt, L, ng, gs, g0, g1, Ar); break;                   \
    }

static void coli_q4_pf(int lv, coli_idx n, const float *Ur, const float *sr, const float *xt,
                       const float *gt, coli_idx L, coli_idx ng, coli_idx gs, coli_idx g0,
                       coli_idx g1, float *Ar)
{
#if COLI_X86
    if (lv == COLI_AVX512) {
        COLI_Q4_PF_N(avx512)
    } else if (lv == COLI_AVX2) {
        COLI_Q4_PF_N(avx2)
    }
#endif
#if COLI_ARM
    if (lv == COLI_NEON) {
        COLI_Q4_PF_N(neon)
    }
#endif
    (void)lv; (void)n; (void)Ur; (void)sr; (void)xt; (void)gt; (void)L; (void)ng; (void)gs;
    (void)g0; (void)g1; (void)Ar;
}

/* y of one (row, token) from its prefill accumulator (16 floats). */
static float coli_q4_fin(int lv, const float *A)
{
#if COLI_X86
    if (lv == COLI_AVX512)
        return coli_q4_fin_avx512(A);
    if (lv == COLI_AVX2)
        return coli_q4_fin_avx2(A);
#endif
#if COLI_ARM
    if (lv == COLI_NEON)
        return coli_q4_fin_neon(A);
#endif
    (void)lv; (void)A;
    return 0.0f;
}

enum { COLI_TILE = 256 };   /* prefill: elements per column tile (x and U tiles stay in L1) */

static void coli_q4_rows(int lv, const uint8_t *w, const float *s, const float *xp,
                         const float *gi, float *y, float *U, coli_idx r0, coli_idx r1,
                         coli_idx T, coli_idx O, coli_idx nb, coli_idx ng, coli_idx gs)
{
    coli_idx L = ng * gs, r, t;
    if (T > 1 && coli_q4_has_pf(lv)) {
        for (r = r0; r < r1; r++)
            coli_q4_unpack(lv, w + r * nb, U + (r - r0) * L, nb, L, gs);
        {
            /* Column tiles of gt groups; per (row, token) the accumulator goes through A between
             * tiles, so every output sees exactly the operations of the decode row. */
            coli_idx gt = gs >= COLI_TILE ? 1 : COLI_TILE / gs, g0, g1;
            float *A = U + (r1 - r0) * L;
            for (t = 0; t < (r1 - r0) * T * 16; t++)
                A[t] = 0.0f;
            for (g0 = 0; g0 < ng; g0 += gt) {
                g1 = g0 + gt < ng ? g0 + gt : ng;
                for (t = 0; t < T; t += COLI_TB) {
                    coli_idx n = T - t < COLI_TB ? T - t : COLI_TB;
                    const float *xt = xp + t * L, *gt_ = gi + t * ng * coli_q4_gstride(gs);
                    for (r = r0; r < r1; r++)
                        coli_q4_pf(lv, n, U + (r - r0) * L, s + r * ng, xt, gt_, L, ng, gs, g0,
                                   g1, A + ((r - r0) * T + t) * 16);
                }
            }
            for (r = r0; r < r1; r++)
                for (t = 0; t < T; t++)
                    y[t * O + r] = coli_q4_fin(lv, A + ((r - r0) * T + t) * 16);
        }
        return;
    }
    (void)U;
    (void)lv;
    (void)gi;
#if COLI_X86
    if (T == 1 && coli_q4_lanes(lv, gs)) {
        coli_q4_rows_lanes(w, s, xp, gi, y, r0, r1, nb, ng, gs);
        return;
    }
    if (T == 1 && lv == COLI_AVX512 && coli_q4_multirow) {
        coli_q4_rows2_avx512(w, s, xp, gi, y, r0, r1, nb, ng, gs);
        return;
    }
#endif
    for (r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * nb;
        const float *sr = s + r * ng;
        for (t = 0; t < T; t++) {
            const float *xt = xp + t * L;
            float v;
#if COLI_X86
            const float *gt = gi + t * ng * coli_q4_gstride(gs);
#endif
#if COLI_X86
            if (lv == COLI_AVX512)
                v = coli_q4_row_avx512(wr, sr, xt, gt, nb, ng, gs);
            else if (lv == COLI_AVX2)
                v = coli_q4_row_avx2(wr, sr, xt, gt, nb, ng, gs);
            else
#endif
#if COLI_ARM
            if (lv == COLI_NEON)
                v = coli_q4_row_neon(wr, sr, xt, nb, ng, gs);
            else
#endif
                v = coli_q4_row_portable(wr, sr, xt, nb, ng, gs);
            y[t * O + r] = v;
        }
    }
}

/* ---- int8 ------------------------------------------------------------------------------------ */

/* Bytes per block of the int8 row loop (8 accumulators of VL lanes). */
static coli_idx coli_q8_block(int level)
{
    return level == COLI_AVX512 ? 128 : (level == COLI_NEON && COLI_ARM) ? 32 : 64;
}

/* xp: [T][Lp], Lp = cols rounded up to the block, zero padded. */
static void coli_q8_prep(const float *x, coli_idx T, coli_idx cols, coli_idx Lp, float *xp)
{
    coli_idx t, i;
    for (t = 0; t < T; t++) {
        memcpy(xp + t * Lp, x + t * cols, (size_t)cols * sizeof(float));
        for (i = cols; i < Lp; i++)
            xp[t * Lp + i] = 0.0f;
    }
}

static float coli_q8_row_portable(const int8_t *w, const float *x, coli_idx cols, coli_idx Lp)
{
    /* 64-byte blocks, 16 lanes: lane l sums w[j] x[j] for j % 16 == l, in order. */
    float acc[16];
    int8_t tail[64];
    coli_idx k, j, nfull = cols / 64;
    for (j = 0; j < 16; j++)
        acc[j] = 0.0f;
    for (k = 0; k * 64 < Lp; k++) {
        const int8_t *b = w + 64 * k;
        const float *xb = x + 64 * k;
        coli_idx q;
        if (k >= nfull) {
            memset(tail, 0, sizeof(tail));
            memcpy(tail, b, (size_t)(cols - 64 * k));
            b = tail;
        }
        for (q = 0; q < 4; q++)
            for (j = 0; j < 16; j++)
                acc[j] = acc[j] + (float)b[16 * q + j] * xb[16 * q + j];
    }
    for (j = 0; j < 8; j++)
        acc[j] = acc[j] + acc[j + 8];
    return coli_fold8(acc);
}

#if COLI_X86
COLI_T_AVX2 static float coli_q8_fold_avx2(__m256 *a)
{
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])),
                             _mm256_add_ps(_mm256_add_ps(a[4], a[5]), _mm256_add_ps(a[6], a[7])));
    return coli_hsum256(s);
}

COLI_T_AVX2 static float coli_q8_row_avx2(const int8_t *w, const float *x, coli_idx cols,
                                          coli_idx Lp)
{
    __m256 a[8];
    int8_t tail[64];
    coli_idx k, q, nfull = cols / 64;
    for (q = 0; q < 8; q++)
        a[q] = _mm256_setzero_ps();
    for (k = 0; k * 64 < Lp; k++) {
        const int8_t *b = w + 64 * k;
        if (k >= nfull) {
            memset(tail, 0, sizeof(tail));
            memcpy(tail, b, (size_t)(cols - 64 * k));
            b = tail;
        }
        for (q = 0; q < 8; q++) {
            __m256i d = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8 * q)));
            a[q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_loadu_ps(x + 64 * k + 8 * q), a[q]);
        }
    }
    return coli_q8_fold_avx2(a);
}

COLI_T_AVX2 static void coli_q8_unpack_avx2(const int8_t *w, float *U, coli_idx cols, coli_idx Lp)
{
    coli_idx i;
    for (i = 0; i + 8 <= cols; i += 8)
        _mm256_storeu_ps(U + i, _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + i)))));
    for (; i < cols; i++)
        U[i] = (float)w[i];
    for (; i < Lp; i++)
        U[i] = 0.0f;
}

COLI_T_AVX2 static float coli_q8_pf_avx2(const float *U, const float *x, coli_idx Lp)
{
    __m256 a[8];
    coli_idx k, q;
    for (q = 0; q < 8; q++)
        a[q] = _mm256_setzero_ps();
    for (k = 0; k < Lp; k += 64)
        for (q = 0; q < 8; q++)
            a[q] = _mm256_fmadd_ps(_mm256_loadu_ps(U + k + 8 * q), _mm256_loadu_ps(x + k + 8 * q), a[q]);
    return coli_q8_fold_avx2(a);
}

COLI_T_AVX512 static float coli_q8_fold_avx512(__m512 *a)
{
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])),
                             _mm512_add_ps(_mm512_add_ps(a[4], a[5]), _mm512_add_ps(a[6], a[7])));
    return coli_hsum512(s);
}

COLI_T_AVX512 static float coli_q8_row_avx512(const int8_t *w, const float *x, coli_idx cols,
                                              coli_idx Lp)
{
    __m512 a[8];
    int8_t tail[128];
    coli_idx k, q, nfull = cols / 128;
    for (q = 0; q < 8; q++)
        a[q] = _mm512_setzero_ps();
    for (k = 0; k * 128 < Lp; k++) {
        const int8_t *b = w + 128 * k;
        if (k >= nfull) {
            memset(tail, 0, sizeof(tail));
            memcpy(tail, b, (size_t)(cols - 128 * k));
            b = tail;
        }
        for (q = 0; q < 8; q++) {
            __m512i d = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 16 * q)));
            a[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_loadu_ps(x + 128 * k + 16 * q),
                                   a[q]);
        }
    }
    return coli_q8_fold_avx512(a);
}

COLI_T_AVX512 static float coli_q8_pf_avx512(const float *U, const float *x, coli_idx Lp)
{
    __m512 a[8];
    coli_idx k, q;
    for (q = 0; q < 8; q++)
        a[q] = _mm512_setzero_ps();
    for (k = 0; k < Lp; k += 128)
        for (q = 0; q < 8; q++)
            a[q] = _mm512_fmadd_ps(_mm512_loadu_ps(U + k + 16 * q), _mm512_loadu_ps(x + k + 16 * q),
                                   a[q]);
    return coli_q8_fold_avx512(a);
}

/* ---- int8 decode (T == 1): several rows per pass ----
 * The one-row loop above ran at 0.5-0.7 of the read bandwidth on big matrices (the lm_head):
 * one row stream per thread, and the hardware prefetcher stops at every 4 KiB page.  These read
 * R rows at once from R streams far apart (rows r, r + q, r + 2q, .. of the block), prefetch each
 * stream COLI_Q8_AHEAD bytes ahead in software, and share every x load between the rows.  Each
 * row keeps exactly the accumulators, block order and fold of coli_q8_row_<level> (so the bits
 * are those of the one-row loop and of the prefill kernels): AVX-512 runs 3 rows x 8
 * accumulators in one pass (24 of the 32 zmm registers); AVX2 (16 ymm) runs 2 rows in two
 * passes, accumulators 0-3 over the whole row and then 4-7 (the second pass reads the rows
 * from L1: an accumulator's sequence of operations does not depend on the loop order around
 * it).  A last partial block goes through a zero-padded copy, as in the one-row loop. */
enum { COLI_Q8_AHEAD = 1024, COLI_Q8_R512 = 3, COLI_Q8_R256 = 2 };

COLI_T_AVX512 COLI_INLINE void coli_q8_rown_avx512(const int8_t *const *wr, const int R,
                                                   const float *x, coli_idx cols, coli_idx Lp,
                                                   float *y)
{
    __m512 a[COLI_Q8_R512][8];
    int8_t tail[COLI_Q8_R512][128];
    coli_idx k, nfull = cols / 128;
    int j, q;
    for (j = 0; j < R; j++)
        for (q = 0; q < 8; q++)
            a[j][q] = _mm512_setzero_ps();
    for (k = 0; k < nfull; k++) {
        const float *xb = x + 128 * k;
        for (j = 0; j < R; j++) {
            _mm_prefetch((const char *)(wr[j] + 128 * k) + COLI_Q8_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char *)(wr[j] + 128 * k) + COLI_Q8_AHEAD + 64, _MM_HINT_T0);
        }
        for (q = 0; q < 8; q++) {
            __m512 xv = _mm512_loadu_ps(xb + 16 * q);
            for (j = 0; j < R; j++) {
                __m512i d = _mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(wr[j] + 128 * k + 16 * q)));
                a[j][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), xv, a[j][q]);
            }
        }
    }
    if (128 * nfull < Lp) {
        const float *xb = x + 128 * nfull;
        for (j = 0; j < R; j++) {
            memset(tail[j], 0, sizeof(tail[j]));
            memcpy(tail[j], wr[j] + 128 * nfull, (size_t)(cols - 128 * nfull));
        }
        for (q = 0; q < 8; q++) {
            __m512 xv = _mm512_loadu_ps(xb + 16 * q);
            for (j = 0; j < R; j++) {
                __m512i d = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(tail[j] + 16 * q)));
                a[j][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), xv, a[j][q]);
            }
        }
    }
    for (j = 0; j < R; j++)
        y[j] = coli_q8_fold_avx512(a[j]);
}

COLI_T_AVX2 COLI_INLINE void coli_q8_rown_avx2(const int8_t *const *wr, const int R,
                                               const float *x, coli_idx cols, coli_idx Lp,
                                               float *y)
{
    __m256 a[COLI_Q8_R256][8];
    int8_t tail[COLI_Q8_R256][64];
    coli_idx k, nfull = cols / 64;
    int j, q, h, part = 64 * nfull < Lp;
    if (part)
        for (j = 0; j < R; j++) {
            memset(tail[j], 0, sizeof(tail[j]));
            memcpy(tail[j], wr[j] + 64 * nfull, (size_t)(cols - 64 * nfull));
        }
    for (h = 0; h < 2; h++) {
        __m256 A[COLI_Q8_R256][4];
        for (j = 0; j < R; j++)
            for (q = 0; q < 4; q++)
                A[j][q] = _mm256_setzero_ps();
        for (k = 0; k < nfull + part; k++) {
            const float *xb = x + 64 * k + 32 * h;
            for (j = 0; j < R; j++)
                if (h == 0)
                    _mm_prefetch((const char *)(wr[j] + 64 * k) + COLI_Q8_AHEAD, _MM_HINT_T0);
            for (q = 0; q < 4; q++) {
                __m256 xv = _mm256_loadu_ps(xb + 8 * q);
                for (j = 0; j < R; j++) {
                    const int8_t *b = (k < nfull ? wr[j] + 64 * k : tail[j]) + 32 * h + 8 * q;
                    __m256i d = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)b));
                    A[j][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), xv, A[j][q]);
                }
            }
        }
        for (j = 0; j < R; j++)
            for (q = 0; q < 4; q++)
                a[j][4 * h + q] = A[j][q];
    }
    for (j = 0; j < R; j++)
        y[j] = coli_q8_fold_avx2(a[j]);
}

COLI_T_AVX512 static void coli_q8_row3_avx512(const int8_t *const *wr, const float *x,
                                              coli_idx cols, coli_idx Lp, float *y)
{
    coli_q8_rown_avx512(wr, COLI_Q8_R512, x, cols, Lp, y);
}
COLI_T_AVX512 static void coli_q8_row1_avx512(const int8_t *const *wr, const float *x,
                                              coli_idx cols, coli_idx Lp, float *y)
{
    coli_q8_rown_avx512(wr, 1, x, cols, Lp, y);
}
COLI_T_AVX2 static void coli_q8_row2_avx2(const int8_t *const *wr, const float *x,
                                          coli_idx cols, coli_idx Lp, float *y)
{
    coli_q8_rown_avx2(wr, COLI_Q8_R256, x, cols, Lp, y);
}
COLI_T_AVX2 static void coli_q8_row1_avx2(const int8_t *const *wr, const float *x,
                                          coli_idx cols, coli_idx Lp, float *y)
{
    coli_q8_rown_avx2(wr, 1, x, cols, Lp, y);
}

/* A few tokens (2 .. COLI_Q8_TMAX) per row without the unpacked-row buffer: each block of
 * weights is widened and converted once and multiplied into every token's accumulators, which
 * see exactly the operations of coli_q8_pf_<level> (the bits of prefill and decode).  AVX-512
 * runs accumulators 0-3 then 4-7 (4 x T of the 32 registers), AVX2 two at a time (four passes,
 * the row from L1 after the first). */
enum { COLI_Q8_TMAX = 4 };

COLI_T_AVX512 COLI_INLINE void coli_q8_fewtok_avx512_t(const int8_t *w, const float *xp, const coli_idx T,
                                                coli_idx cols, coli_idx Lp, float *v)
{
    __m512 a[COLI_Q8_TMAX][8];
    int8_t tail[128];
    coli_idx k, nfull = cols / 128, t;
    int q, h, part = 128 * nfull < Lp;
    if (part) {
        memset(tail, 0, sizeof(tail));
        memcpy(tail, w + 128 * nfull, (size_t)(cols - 128 * nfull));
    }
    for (h = 0; h < 2; h++) {
        __m512 A[COLI_Q8_TMAX][4];
        for (t = 0; t < T; t++)
            for (q = 0; q < 4; q++)
                A[t][q] = _mm512_setzero_ps();
        for (k = 0; k < nfull + part; k++) {
            const int8_t *b = (k < nfull ? w + 128 * k : tail) + 64 * h;
            if (h == 0) {
                _mm_prefetch((const char *)(w + 128 * k) + COLI_Q8_AHEAD, _MM_HINT_T0);
                _mm_prefetch((const char *)(w + 128 * k) + COLI_Q8_AHEAD + 64, _MM_HINT_T0);
            }
            for (q = 0; q < 4; q++) {
                __m512 u = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 16 * q))));
                for (t = 0; t < T; t++)
                    A[t][q] = _mm512_fmadd_ps(u, _mm512_loadu_ps(xp + t * Lp + 128 * k + 64 * h
                                                                 + 16 * q), A[t][q]);
            }
        }
        for (t = 0; t < T; t++)
            for (q = 0; q < 4; q++)
                a[t][4 * h + q] = A[t][q];
    }
    for (t = 0; t < T; t++)
        v[t] = coli_q8_fold_avx512(a[t]);
}

/* T as a constant, so the accumulators stay in registers. */
COLI_T_AVX512 static void coli_q8_fewtok_avx512(const int8_t *w, const float *xp, coli_idx T,
                                                coli_idx cols, coli_idx Lp, float *v)
{
    switch (T) {
    case 2: coli_q8_fewtok_avx512_t(w, xp, 2, cols, Lp, v); break;
    case 3: coli_q8_fewtok_avx512_t(w, xp, 3, cols, Lp, v); break;
    default: coli_q8_fewtok_avx512_t(w, xp, 4, cols, Lp, v); break;
    }
}

COLI_T_AVX2 COLI_INLINE void coli_q8_fewtok_avx2_t(const int8_t *w, const float *xp, const coli_idx T,
                                            coli_idx cols, coli_idx Lp, float *v)
{
    __m256 a[COLI_Q8_TMAX][8];
    int8_t tail[64];
    coli_idx k, nfull = cols / 64, t;
    int q, h, part = 64 * nfull < Lp;
    if (part) {
        memset(tail, 0, sizeof(tail));
        memcpy(tail, w + 64 * nfull, (size_t)(cols - 64 * nfull));
    }
    for (h = 0; h < 4; h++) {
        __m256 A[COLI_Q8_TMAX][2];
        for (t = 0; t < T; t++)
            for (q = 0; q < 2; q++)
                A[t][q] = _mm256_setzero_ps();
        for (k = 0; k < nfull + part; k++) {
            const int8_t *b = (k < nfull ? w + 64 * k : tail) + 16 * h;
            if (h == 0)
                _mm_prefetch((const char *)(w + 64 * k) + COLI_Q8_AHEAD, _MM_HINT_T0);
            for (q = 0; q < 2; q++) {
                __m256 u = _mm256_cvtepi32_ps(
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8 * q))));
                for (t = 0; t < T; t++)
                    A[t][q] = _mm256_fmadd_ps(u, _mm256_loadu_ps(xp + t * Lp + 64 * k + 16 * h
                                                                 + 8 * q), A[t][q]);
            }
        }
        for (t = 0; t < T; t++)
            for (q = 0; q < 2; q++)
                a[t][2 * h + q] = A[t][q];
    }
    for (t = 0; t < T; t++)
        v[t] = coli_q8_fold_avx2(a[t]);
}

/* T as a constant, so the accumulators stay in registers. */
COLI_T_AVX2 static void coli_q8_fewtok_avx2(const int8_t *w, const float *xp, coli_idx T,
                                            coli_idx cols, coli_idx Lp, float *v)
{
    switch (T) {
    case 2: coli_q8_fewtok_avx2_t(w, xp, 2, cols, Lp, v); break;
    case 3: coli_q8_fewtok_avx2_t(w, xp, 3, cols, Lp, v); break;
    default: coli_q8_fewtok_avx2_t(w, xp, 4, cols, Lp, v); break;
    }
}

/* Decode rows [r0, r1) at AVX2 / AVX-512: R streams of q rows each, then the rest one by one. */
static void coli_q8_decode_x86(int level, const int8_t *w, const float *s, const float *xp,
                               float *y, coli_idx r0, coli_idx r1, coli_idx cols, coli_idx Lp)
{
    const int R = level == COLI_AVX512 ? COLI_Q8_R512 : COLI_Q8_R256;
    coli_idx q = (r1 - r0) / R, r;
    const int8_t *wr[COLI_Q8_R512];
    float v[COLI_Q8_R512];
    int j;
    for (r = r0; r < r0 + q; r++) {
        for (j = 0; j < R; j++)
            wr[j] = w + (r + j * q) * cols;
        if (level == COLI_AVX512)
            coli_q8_row3_avx512(wr, xp, cols, Lp, v);
        else
            coli_q8_row2_avx2(wr, xp, cols, Lp, v);
        for (j = 0; j < R; j++)
            y[r + j * q] = v[j] * s[r + j * q];
    }
    for (r = r0 + R * q; r < r1; r++) {
        wr[0] = w + r * cols;
        if (level == COLI_AVX512)
            coli_q8_row1_avx512(wr, xp, cols, Lp, v);
        else
            coli_q8_row1_avx2(wr, xp, cols, Lp, v);
        y[r] = v[0] * s[r];
    }
}
#endif /* COLI_X86 */

static size_t coli_q8_scratch_floats(int level, coli_idx T, coli_idx Lp)
{
    return (T > 1 && (level == COLI_AVX2 || level == COLI_AVX512
                      || (level == COLI_NEON && COLI_ARM))) ? (size_t)Lp : 0;
}

/* 0: decode through the one-row loops (kept for A/B benchmarks and the bit tests; same bits). */
static int coli_q8_multirow = 1;

/* Rows [r0, r1) for all T tokens; xp from coli_q8_prep; U: Lp floats (prefill, SIMD levels). */
static void coli_q8_rows(int level, const int8_t *w, const float *s, const float *xp, float *y,
                         float *U, coli_idx r0, coli_idx r1, coli_idx T, coli_idx O,
                         coli_idx cols, coli_idx Lp)
{
    coli_idx r, t;
    (void)level;
#if COLI_X86
    if (T == 1 && coli_q8_multirow && (level == COLI_AVX2 || level == COLI_AVX512)) {
        coli_q8_decode_x86(level, w, s, xp, y, r0, r1, cols, Lp);
        return;
    }
    if (T > 1 && T <= COLI_Q8_TMAX && coli_q8_multirow
        && (level == COLI_AVX2 || level == COLI_AVX512)) {
        float v[COLI_Q8_TMAX];
        for (r = r0; r < r1; r++) {
            if (level == COLI_AVX512)
                coli_q8_fewtok_avx512(w + r * cols, xp, T, cols, Lp, v);
            else
                coli_q8_fewtok_avx2(w + r * cols, xp, T, cols, Lp, v);
            for (t = 0; t < T; t++)
                y[t * O + r] = v[t] * s[r];
        }
        return;
    }
#endif
    for (r = r0; r < r1; r++) {
        const int8_t *wr = w + r * cols;
#if COLI_X86
        if (T > 1 && level == COLI_AVX2) {
            coli_q8_unpack_avx2(wr, U, cols, Lp);
            for (t = 0; t < T; t++)
                y[t * O + r] = coli_q8_pf_avx2(U, xp + t * Lp, Lp) * s[r];
            continue;
        }
        if (T > 1 && level == COLI_AVX512) {
            coli_q8_unpack_avx2(wr, U, cols, Lp);
            for (t = 0; t < T; t++)
                y[t * O + r] = coli_q8_pf_avx512(U, xp + t * Lp, Lp) * s[r];
            continue;
        }
#endif
#if COLI_ARM
        if (T > 1 && level == COLI_NEON) {
            coli_q8_unpack_neon(wr, U, cols, Lp);
            for (t = 0; t < T; t++)
                y[t * O + r] = coli_q8_pf_neon(U, xp + t * Lp, Lp) * s[r];
            continue;
        }
#endif
        (void)U;
        for (t = 0; t < T; t++) {
            float v;
#if COLI_X86
            if (level == COLI_AVX512)
                v = coli_q8_row_avx512(wr, xp + t * Lp, cols, Lp);
            else if (level == COLI_AVX2)
                v = coli_q8_row_avx2(wr, xp + t * Lp, cols, Lp);
            else
#endif
#if COLI_ARM
            if (level == COLI_NEON)
                v = coli_q8_row_neon(wr, xp + t * Lp, cols, Lp);
            else
#endif
                v = coli_q8_row_portable(wr, xp + t * Lp, cols, Lp);
            y[t * O + r] = v * s[r];
        }
    }
}

/* ---- int4: dequantize rows [r0, r1) to float32 W[r][cols] (row-major) -------------------------
 * For prefill with many tokens per matrix: the dequantized rows go to an sgemm, which reaches
 * several times the FLOP rate of the widen-and-FMA loop.  W = (nibble - 8) * s, exactly as
 * core.quant.dequantize_int4 (one rounding: the product; every variant gives the same bits). */
static void coli_q4_dequant_group_portable(const uint8_t *wg, float *Wg, coli_idx n, float sc)
{
    coli_idx j;
    for (j = 0; j + 1 < n; j += 2) {
        uint8_t b = wg[j / 2];
        Wg[j] = (float)((int)(b & 15) - 8) * sc;
        Wg[j + 1] = (float)((int)(b >> 4) - 8) * sc;
    }
    if (j < n)                                    /* odd cols: the last low nibble */
        Wg[j] = (float)((int)(wg[j / 2] & 15) - 8) * sc;
}

#if COLI_X86
/* 16 elements (8 bytes) per step: widen, split the nibbles, convert, scale, interleave. */
COLI_T_AVX2 static void coli_q4_dequant_group_avx2(const uint8_t *wg, float *Wg, coli_idx n,
                                                   float sc)
{
    const __m256i m = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    const __m256 s = _mm256_set1_ps(sc);
    coli_idx c;
    for (c = 0; c + 16 <= n; c += 16) {
        __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(wg + c / 2)));
        __m256 lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(d, m), eight)), s);
        __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(d, 4), eight)), s);
        __m256 a = _mm256_unpacklo_ps(lo, hi), b = _mm256_unpackhi_ps(lo, hi);
        _mm256_storeu_ps(Wg + c, _mm256_permute2f128_ps(a, b, 0x20));
        _mm256_storeu_ps(Wg + c + 8, _mm256_permute2f128_ps(a, b, 0x31));
    }
    if (c < n)
        coli_q4_dequant_group_portable(wg + c / 2, Wg + c, n - c, sc);
}
#endif

static void coli_q4_dequant_rows(const uint8_t *w, const float *s, float *W, coli_idx r0,
                                 coli_idx r1, coli_idx cols, coli_idx nb, coli_idx ng, coli_idx gs)
{
    coli_idx r, g;
#if COLI_X86
    int avx2 = coli_simd_supported(COLI_AVX2);
#endif
    for (r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * nb;
        const float *sr = s + r * ng;
        float *Wr = W + r * cols;
        for (g = 0; g < ng; g++) {
            coli_idx e0 = g * gs, n = e0 + gs < cols ? gs : cols - e0;   /* e0 is even */
#if COLI_X86
            if (avx2) {
                coli_q4_dequant_group_avx2(wr + e0 / 2, Wr + e0, n, sr[g]);
                continue;
            }
#endif
            coli_q4_dequant_group_portable(wr + e0 / 2, Wr + e0, n, sr[g]);
        }
    }
}

#endif /* COLI_QKERN_H */
