/* The small operations around the matrix products of a decode step: RMS norm, rotary embedding,
 * attention of one query row against the KV cache, and the router's softmax + top-k.
 *
 * Why in C: each is microseconds of arithmetic, but as numpy expressions a layer took ~30 array
 * operations (temporaries, broadcasting, masks) -- ~1 ms of a ~60 ms token on the OLMoE geometry
 * (benchmarks/README.md). Plain C: the loops are written with fixed-width lane arrays that
 * compilers auto-vectorize, and every output is summed in an order fixed by the shapes alone, so
 * results never depend on the thread count (the attention splits whole heads between threads).
 * The attention's dot products and weighted sums also have AVX2 variants (x86-64, picked at run
 * time from qkern.h's level) with the same per-lane operations: the same bits as the portable
 * loops. The softmax's exp is this file's own (coli_exp: portable C with fmaf, AVX2, AVX-512 and
 * NEON, the same operations per element, ~1 ulp), so it too gives the same bits in every variant
 * and on every platform, and runs 8-16 scores per instruction instead of one libm call each.
 * Built with -ffp-contract=off like qkern.h, so the rotary embedding gives exactly the bits of
 * the numpy expression it replaces (core.kernels.rope's reference); the others agree with their
 * numpy references (core.kernels) to float32 rounding.
 */
#ifndef COLI_LAYER_OPS_H
#define COLI_LAYER_OPS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "qkern.h"      /* coli_idx, COLI_X86 / COLI_T_AVX2, the level numbers */
#include "dense.h"      /* coli_dn_matvec: the router's order */
#if COLI_X86
#include <cpuid.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

typedef coli_idx coli_ix;

enum { COLI_LN = 8 };   /* lanes of the vectorizable reductions */

static float coli_lane_fold(const float *a)
{
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

static float coli_dot(const float *a, const float *b, coli_ix n)
{
    float acc[COLI_LN] = {0};
    coli_ix i, l, n8 = n / COLI_LN * COLI_LN;
    for (i = 0; i < n8; i += COLI_LN)
        for (l = 0; l < COLI_LN; l++)
            acc[l] += a[i + l] * b[i + l];
    for (l = 0; i + l < n; l++)
        acc[l] += a[i + l] * b[i + l];
    return coli_lane_fold(acc);
}

#if COLI_X86
/* coli_lane_fold of a0..a7 (one row's 8 lanes each) into out[0..8), in registers: the fold's
 * three levels of sums ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) eight rows at a time, the values
 * moved between lanes by shuffles (no rounding): the same bits as eight coli_lane_fold calls. */
COLI_T_AVX2 static inline void coli_fold8_avx2(__m256 a0, __m256 a1, __m256 a2, __m256 a3,
                                               __m256 a4, __m256 a5, __m256 a6, __m256 a7,
                                               float *out)
{
    /* level 1: [r l0-3 | s l0-3] + [r l4-7 | s l4-7] = [r t0-3 | s t0-3] */
#define COLI_L1(x, y) _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), \
                                    _mm256_permute2f128_ps(x, y, 0x31))
    __m256 y01 = COLI_L1(a0, a1), y23 = COLI_L1(a2, a3), y45 = COLI_L1(a4, a5);
    __m256 y67 = COLI_L1(a6, a7), z0, z1, f;
#undef COLI_L1
    /* level 2: u0 = t0 + t2, u1 = t1 + t3 -> z0 = [r0 u0 u1, r2 u0 u1 | r1 .., r3 ..] */
    z0 = _mm256_add_ps(_mm256_shuffle_ps(y01, y23, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm256_shuffle_ps(y01, y23, _MM_SHUFFLE(3, 2, 3, 2)));
    z1 = _mm256_add_ps(_mm256_shuffle_ps(y45, y67, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm256_shuffle_ps(y45, y67, _MM_SHUFFLE(3, 2, 3, 2)));
    /* level 3: u0 + u1 -> [r0 r2 r4 r6 | r1 r3 r5 r7] */
    f = _mm256_add_ps(_mm256_shuffle_ps(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm256_shuffle_ps(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* out[j] = coli_dot(q, K + j * D, D) for j < n, with the same bits (D % 8 == 0): the 8 lanes of
 * coli_dot in one register, eight rows at a time (eight add chains instead of one) folded in
 * registers, then four at a time. */
COLI_T_AVX2 static void coli_dots_avx2(const float *q, const float *K, coli_ix n, coli_ix D,
                                       float *out)
{
    coli_ix j, d;
    float lanes[4][COLI_LN];
    for (j = 0; j + 8 <= n; j += 8) {
        const float *k = K + j * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0;
        __m256 a7 = a0;
        for (d = 0; d < D; d += 8) {
            __m256 x = _mm256_loadu_ps(q + d);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(x, _mm256_loadu_ps(k + d)));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(x, _mm256_loadu_ps(k + D + d)));
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(x, _mm256_loadu_ps(k + 2 * D + d)));
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(x, _mm256_loadu_ps(k + 3 * D + d)));
            a4 = _mm256_add_ps(a4, _mm256_mul_ps(x, _mm256_loadu_ps(k + 4 * D + d)));
            a5 = _mm256_add_ps(a5, _mm256_mul_ps(x, _mm256_loadu_ps(k + 5 * D + d)));
            a6 = _mm256_add_ps(a6, _mm256_mul_ps(x, _mm256_loadu_ps(k + 6 * D + d)));
            a7 = _mm256_add_ps(a7, _mm256_mul_ps(x, _mm256_loadu_ps(k + 7 * D + d)));
        }
        coli_fold8_avx2(a0, a1, a2, a3, a4, a5, a6, a7, out + j);
    }
    for (; j + 4 <= n; j += 4) {
        const float *k = K + j * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (d = 0; d < D; d += 8) {
            __m256 x = _mm256_loadu_ps(q + d);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(x, _mm256_loadu_ps(k + d)));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(x, _mm256_loadu_ps(k + D + d)));
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(x, _mm256_loadu_ps(k + 2 * D + d)));
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(x, _mm256_loadu_ps(k + 3 * D + d)));
        }
        _mm256_storeu_ps(lanes[0], a0);
        _mm256_storeu_ps(lanes[1], a1);
        _mm256_storeu_ps(lanes[2], a2);
        _mm256_storeu_ps(lanes[3], a3);
        for (d = 0; d < 4; d++)
            out[j + d] = coli_lane_fold(lanes[d]);
    }
    for (; j < n; j++)
        out[j] = coli_dot(q, K + j * D, D);
}
#endif

/* out[j] = q . K[j] for n rows of D floats, every row in coli_dot's order; avx2: the AVX2
 * variant (same bits), which needs D % 8 == 0. */
static void coli_dots(const float *q, const float *K, coli_ix n, coli_ix D, float *out, int avx2)
{
    coli_ix j;
#if COLI_X86
    if (avx2) {
        coli_dots_avx2(q, K, n, D, out);
        return;
    }
#endif
    (void)avx2;
    for (j = 0; j < n; j++)
        out[j] = coli_dot(q, K + j * D, D);
}

/* Whether the AVX2 variants run at qkern.h's level for rows of D floats. */
static int coli_ops_avx2(int level, coli_ix D)
{
#if COLI_X86
    return (level == COLI_AVX2 || level == COLI_AVX512) && D % 8 == 0;
#else
    (void)level; (void)D;
    return 0;
#endif
}

/* Router logits for T rows on the calling thread: out [T][E] = x [T][D] . W[e].  Where the dense
 * kernel runs (dense.h: AVX2, AVX-512, NEON) its order, row by row: the bits of
 * core.kernels.router_logits at every row count (dense_matmul is row-invariant), so a compiled
 * decode block's router and prefill's agree.  The portable variant (x86 without FMA, where
 * core.kernels routes many rows to numpy) keeps coli_dot's order. */
static void coli_matvec_rows(const float *x, const float *W, float *out, coli_ix T, coli_ix E,
                             coli_ix D, int level)
{
    coli_ix t;
    int avx2 = coli_ops_avx2(level, D);
    for (t = 0; t < T; t++) {
        if (coli_dn_level(level) != COLI_PORTABLE)
            coli_dn_matvec(level, x + t * D, W, D, E, out + t * E);
        else
            coli_dots(x + t * D, W, E, D, out + t * E, avx2);
    }
}

/* y[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)) for rows r of n elements (the sum of squares in
 * double: as exact as float32 can hold the mean). */
static void coli_rms_norm(const float *x, const float *w, float *y, coli_ix rows, coli_ix n,
                          float eps)
{
    coli_ix r, i, l;
    for (r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        double acc[4] = {0.0, 0.0, 0.0, 0.0}, ss;
        float inv;
        for (i = 0; i + 4 <= n; i += 4)
            for (l = 0; l < 4; l++)
                acc[l] += (double)xr[i + l] * (double)xr[i + l];
        for (; i < n; i++)
            acc[0] += (double)xr[i] * (double)xr[i];
        ss = (acc[0] + acc[2]) + (acc[1] + acc[3]);
        inv = 1.0f / sqrtf((float)(ss / (double)n) + eps);
        for (i = 0; i < n; i++)
            yr[i] = w[i] * (xr[i] * inv);
    }
}

/* In place, x [T][H][D], cos / sin [T][D]: x * cos + rotate_half(x) * sin, rotate_half(x) =
 * (-x2, x1) -- the same two products and one sum per element as the numpy expression. */
static void coli_rope(float *x, const float *cs, const float *sn, coli_ix T, coli_ix H, coli_ix D)
{
    coli_ix t, h, i, half = D / 2;
    for (t = 0; t < T; t++) {
        const float *c = cs + t * D, *s = sn + t * D;
        for (h = 0; h < H; h++) {
            float *v = x + (t * H + h) * D;
            for (i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] + (-b) * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* coli_rope of one position on the first R dims of each of H heads of D values (cs / sn [R]):
 * the same operations as coli_rope over those dims, the rest untouched (partial RoPE). */
static void coli_rope_part(float *x, const float *cs, const float *sn, coli_ix H, coli_ix D, coli_ix R)
{
    coli_ix h, i, half = R / 2;
    for (h = 0; h < H; h++) {
        float *v = x + h * D;
        for (i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cs[i] + (-b) * sn[i];
            v[i + half] = b * cs[i + half] + a * sn[i + half];
        }
    }
}

/* ---- exp and the softmax's numerator ------------------------------------------------------
 * One exp, written four times (portable C with fmaf, AVX2, AVX-512, NEON) with the same
 * operations in the same order per element, so every variant gives the same bits:
 *   x clamped to [-104, 89] (a NaN becomes -104, and is put back at the end; below -104 the
 *   result rounds to 0 and above 88.73 it overflows to inf anyway, which the clamped path gives);
 *   n = round(x / ln2) by the 1.5 * 2^23 shifter (n sits in the low bits of k);
 *   r = x - n ln2 in two FMAs (ln2 as hi + lo); exp(r) on |r| <= ln2/2 by Cephes' degree-7
 *   polynomial in Horner form with FMAs; times 2^n as two exact powers of two 2^(n/2) (both
 *   normal), so a subnormal result is rounded once.
 * Max error ~1 ulp of float64 exp over [-104, 0] (tests/test_layer_ops.py measures it). libm's
 * expf is not used: it is one call per score and its bits differ between platforms. */
#define COLI_EXP_LO (-104.0f)
#define COLI_EXP_HI 89.0f
#define COLI_EXP_SHIFT 12582912.0f                 /* 1.5 * 2^23 */
#define COLI_EXP_LOG2E 1.44269502162933349609375f  /* float(1 / ln 2) */
#define COLI_EXP_LN2HI 0.693145751953125f          /* ln 2, high bits */
#define COLI_EXP_LN2LO 1.428606765330187045e-06f   /* ln 2 - LN2HI */
#define COLI_EXP_P0 1.9875691500e-4f
#define COLI_EXP_P1 1.3981999507e-3f
#define COLI_EXP_P2 8.3334519073e-3f
#define COLI_EXP_P3 4.1665795894e-2f
#define COLI_EXP_P4 1.6666665459e-1f
#define COLI_EXP_P5 5.0000001201e-1f

static float coli_exp(float x)
{
    union { float f; int32_t i; uint32_t u; } k, sh, s1, s2;
    float xc = x > COLI_EXP_LO ? x : COLI_EXP_LO, j, r, y;
    uint32_t b;
    xc = xc < COLI_EXP_HI ? xc : COLI_EXP_HI;
    sh.f = COLI_EXP_SHIFT;
    k.f = fmaf(xc, COLI_EXP_LOG2E, COLI_EXP_SHIFT);
    j = k.f - COLI_EXP_SHIFT;
    r = fmaf(-j, COLI_EXP_LN2HI, xc);
    r = fmaf(-j, COLI_EXP_LN2LO, r);
    y = fmaf(COLI_EXP_P0, r, COLI_EXP_P1);
    y = fmaf(y, r, COLI_EXP_P2);
    y = fmaf(y, r, COLI_EXP_P3);
    y = fmaf(y, r, COLI_EXP_P4);
    y = fmaf(y, r, COLI_EXP_P5);
    y = fmaf(y, r * r, r);
    y = y + 1.0f;
    b = (uint32_t)(k.i - sh.i + 254);       /* n + 254 in [104, 382] */
    s1.u = (b >> 1) << 23;                  /* 2^floor(n/2), 2^ceil(n/2) */
    s2.u = (b - (b >> 1)) << 23;
    y = y * s1.f * s2.f;
    return x != x ? x : y;
}

#if COLI_X86
COLI_T_AVX2 static inline __m256 coli_exp_avx2(__m256 x)
{
    const __m256 sh = _mm256_set1_ps(COLI_EXP_SHIFT);
    __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(COLI_EXP_LO));     /* x > lo ? x : lo */
    __m256 k, j, r, y;
    __m256i b, b1;
    xc = _mm256_min_ps(xc, _mm256_set1_ps(COLI_EXP_HI));           /* xc < hi ? xc : hi */
    k = _mm256_fmadd_ps(xc, _mm256_set1_ps(COLI_EXP_LOG2E), sh);
    j = _mm256_sub_ps(k, sh);
    r = _mm256_fnmadd_ps(j, _mm256_set1_ps(COLI_EXP_LN2HI), xc);
    r = _mm256_fnmadd_ps(j, _mm256_set1_ps(COLI_EXP_LN2LO), r);
    y = _mm256_fmadd_ps(_mm256_set1_ps(COLI_EXP_P0), r, _mm256_set1_ps(COLI_EXP_P1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(COLI_EXP_P2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(COLI_EXP_P3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(COLI_EXP_P4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(COLI_EXP_P5));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    b = _mm256_add_epi32(_mm256_sub_epi32(_mm256_castps_si256(k), _mm256_castps_si256(sh)),
                         _mm256_set1_epi32(254));
    b1 = _mm256_srli_epi32(b, 1);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(b1, 23)));
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(b, b1), 23)));
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

COLI_T_AVX512 static inline __m512 coli_exp_avx512(__m512 x)
{
    const __m512 sh = _mm512_set1_ps(COLI_EXP_SHIFT);
    __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(COLI_EXP_LO));
    __m512 k, j, r, y;
    __m512i b, b1;
    xc = _mm512_min_ps(xc, _mm512_set1_ps(COLI_EXP_HI));
    k = _mm512_fmadd_ps(xc, _mm512_set1_ps(COLI_EXP_LOG2E), sh);
    j = _mm512_sub_ps(k, sh);
    r = _mm512_fnmadd_ps(j, _mm512_set1_ps(COLI_EXP_LN2HI), xc);
    r = _mm512_fnmadd_ps(j, _mm512_set1_ps(COLI_EXP_LN2LO), r);
    y = _mm512_fmadd_ps(_mm512_set1_ps(COLI_EXP_P0), r, _mm512_set1_ps(COLI_EXP_P1));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(COLI_EXP_P2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(COLI_EXP_P3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(COLI_EXP_P4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(COLI_EXP_P5));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r);
    y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
    b = _mm512_add_epi32(_mm512_sub_epi32(_mm512_castps_si512(k), _mm512_castps_si512(sh)),
                         _mm512_set1_epi32(254));
    b1 = _mm512_srli_epi32(b, 1);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(b1, 23)));
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(b, b1), 23)));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), y, x);
}
#endif

#if COLI_ARM
static inline float32x4_t coli_exp_neon(float32x4_t x)
{
    const float32x4_t sh = vdupq_n_f32(COLI_EXP_SHIFT), lo = vdupq_n_f32(COLI_EXP_LO);
    const float32x4_t hi = vdupq_n_f32(COLI_EXP_HI);
    float32x4_t xc = vbslq_f32(vcgtq_f32(x, lo), x, lo), k, j, r, y;
    uint32x4_t b, b1;
    xc = vbslq_f32(vcltq_f32(xc, hi), xc, hi);
    k = vfmaq_f32(sh, xc, vdupq_n_f32(COLI_EXP_LOG2E));
    j = vsubq_f32(k, sh);
    r = vfmsq_f32(xc, j, vdupq_n_f32(COLI_EXP_LN2HI));
    r = vfmsq_f32(r, j, vdupq_n_f32(COLI_EXP_LN2LO));
    y = vfmaq_f32(vdupq_n_f32(COLI_EXP_P1), vdupq_n_f32(COLI_EXP_P0), r);
    y = vfmaq_f32(vdupq_n_f32(COLI_EXP_P2), y, r);
    y = vfmaq_f32(vdupq_n_f32(COLI_EXP_P3), y, r);
    y = vfmaq_f32(vdupq_n_f32(COLI_EXP_P4), y, r);
    y = vfmaq_f32(vdupq_n_f32(COLI_EXP_P5), y, r);
    y = vfmaq_f32(r, y, vmulq_f32(r, r));
    y = vaddq_f32(y, vdupq_n_f32(1.0f));
    b = vaddq_u32(vsubq_u32(vreinterpretq_u32_f32(k), vreinterpretq_u32_f32(sh)), vdupq_n_u32(254));
    b1 = vshrq_n_u32(b, 1);
    y = vmulq_f32(y, vreinterpretq_f32_u32(vshlq_n_u32(b1, 23)));
    y = vmulq_f32(y, vreinterpretq_f32_u32(vshlq_n_u32(vsubq_u32(b, b1), 23)));
    return vbslq_f32(vceqq_f32(x, x), y, x);
}
#endif

#if COLI_X86
/* coli_softmax_unnorm_lv's two passes over the whole 8-blocks (scale + max over all n, then exp
 * and the lane sums) in AVX2, or AVX-512 (16 at a time, summed as two 8-blocks in order). */
COLI_T_AVX512 static void coli_softmax_pass_avx512(float *p, coli_ix n, coli_ix n8, float scale,
                                                   float m0, float *m, float *acc)
{
    coli_ix j = 0;
    __m512 vs = _mm512_set1_ps(scale), vm = _mm512_set1_ps(m0);
    __m256 a = _mm256_loadu_ps(acc);
    float lanes[16], mm;
    int l;
    for (; j + 16 <= n; j += 16) {
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(p + j), vs);
        _mm512_storeu_ps(p + j, x);
        vm = _mm512_max_ps(x, vm);
    }
    _mm512_storeu_ps(lanes, vm);
    mm = lanes[0];
    for (l = 1; l < 16; l++)
        mm = lanes[l] > mm ? lanes[l] : mm;
    for (; j < n; j++) {
        p[j] = p[j] * scale;
        if (p[j] > mm)
            mm = p[j];
    }
    vm = _mm512_set1_ps(mm);
    for (j = 0; j + 16 <= n8; j += 16) {
        __m512 e = coli_exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(p + j), vm));
        _mm512_storeu_ps(p + j, e);
        a = _mm256_add_ps(a, _mm256_loadu_ps(p + j));
        a = _mm256_add_ps(a, _mm256_loadu_ps(p + j + 8));
    }
    if (j < n8) {
        __m256 e = coli_exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(mm)));
        _mm256_storeu_ps(p + j, e);
        a = _mm256_add_ps(a, e);
    }
    _mm256_storeu_ps(acc, a);
    *m = mm;
}

COLI_T_AVX2 static void coli_softmax_pass_avx2(float *p, coli_ix n, coli_ix n8, float scale,
                                               float m0, float *m, float *acc)
{
    coli_ix j = 0;
    __m256 vs = _mm256_set1_ps(scale), vm = _mm256_set1_ps(m0), a = _mm256_loadu_ps(acc);
    float lanes[8], mm;
    int l;
    for (; j + 8 <= n; j += 8) {
        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(p + j), vs);
        _mm256_storeu_ps(p + j, x);
        vm = _mm256_max_ps(x, vm);
    }
    _mm256_storeu_ps(lanes, vm);
    mm = lanes[0];
    for (l = 1; l < 8; l++)
        mm = lanes[l] > mm ? lanes[l] : mm;
    for (; j < n; j++) {
        p[j] = p[j] * scale;
        if (p[j] > mm)
            mm = p[j];
    }
    vm = _mm256_set1_ps(mm);
    for (j = 0; j < n8; j += 8) {
        __m256 e = coli_exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(p + j), vm));
        _mm256_storeu_ps(p + j, e);
        a = _mm256_add_ps(a, e);
    }
    _mm256_storeu_ps(acc, a);
    *m = mm;
}

static void coli_softmax_unnorm_x86(float *p, coli_ix n, float scale, int avx512, float *m,
                                    float *acc)
{
    coli_ix n8 = n / COLI_LN * COLI_LN;
    if (avx512)
        coli_softmax_pass_avx512(p, n, n8, scale, *m, m, acc);
    else
        coli_softmax_pass_avx2(p, n, n8, scale, *m, m, acc);
}
#endif

#if COLI_ARM
static void coli_softmax_unnorm_neon(float *p, coli_ix n, float scale, float *m, float *acc)
{
    coli_ix j = 0, n8 = n / COLI_LN * COLI_LN;
    float32x4_t vs = vdupq_n_f32(scale), vm = vdupq_n_f32(*m);
    float32x4_t a0 = vld1q_f32(acc), a1 = vld1q_f32(acc + 4);
    float lanes[4], mm;
    int l;
    for (; j + 4 <= n; j += 4) {
        float32x4_t x = vmulq_f32(vld1q_f32(p + j), vs);
        vst1q_f32(p + j, x);
        vm = vbslq_f32(vcgtq_f32(x, vm), x, vm);
    }
    vst1q_f32(lanes, vm);
    mm = lanes[0];
    for (l = 1; l < 4; l++)
        mm = lanes[l] > mm ? lanes[l] : mm;
    for (; j < n; j++) {
        p[j] = p[j] * scale;
        if (p[j] > mm)
            mm = p[j];
    }
    vm = vdupq_n_f32(mm);
    for (j = 0; j < n8; j += 8) {
        float32x4_t e0 = coli_exp_neon(vsubq_f32(vld1q_f32(p + j), vm));
        float32x4_t e1 = coli_exp_neon(vsubq_f32(vld1q_f32(p + j + 4), vm));
        vst1q_f32(p + j, e0);
        vst1q_f32(p + j + 4, e1);
        a0 = vaddq_f32(a0, e0);
        a1 = vaddq_f32(a1, e1);
    }
    vst1q_f32(acc, a0);
    vst1q_f32(acc + 4, a1);
    *m = mm;
}
#endif

/* The softmax's numerator: the scores p[0..n) become exp(scale * p[j] - max) in place; returns
 * their sum, added in COLI_LN lanes (p[j] into lane j % 8, in order) and folded by
 * coli_lane_fold -- the same order in every variant. The max is order-free (equal scores give
 * the same exp; a NaN score is skipped by every variant, as `p > m` skips it). level: qkern.h's
 * SIMD level (portable where the variant is not built). */
static float coli_softmax_unnorm_lv(float *p, coli_ix n, float scale, int level)
{
    coli_ix j = 0, l, n8 = n / COLI_LN * COLI_LN;
    float m = -INFINITY, acc[COLI_LN] = {0};
#if COLI_X86
    if (level == COLI_AVX2 || level == COLI_AVX512) {
        coli_softmax_unnorm_x86(p, n, scale, level == COLI_AVX512, &m, acc);
        j = n8;
    } else
#endif
#if COLI_ARM
    if (level == COLI_NEON) {
        coli_softmax_unnorm_neon(p, n, scale, &m, acc);
        j = n8;
    } else
#endif
    {
        for (j = 0; j < n; j++) {
            p[j] = p[j] * scale;
            if (p[j] > m)
                m = p[j];
        }
        for (j = 0; j < n8; j += COLI_LN)
            for (l = 0; l < COLI_LN; l++) {
                p[j + l] = coli_exp(p[j + l] - m);
                acc[l] += p[j + l];
            }
    }
    (void)level;
    for (l = 0; j + l < n; l++) {
        p[j + l] = coli_exp(p[j + l] - m);
        acc[l] += p[j + l];
    }
    return coli_lane_fold(acc);
}

/* coli_softmax_unnorm_lv at the best variant this CPU runs (the same bits as any other). */
static float coli_softmax_unnorm(float *p, coli_ix n, float scale)
{
    static int best = -1;
    if (best < 0)
        best = coli_simd_best();
    return coli_softmax_unnorm_lv(p, n, scale, best);
}

#if COLI_X86
/* out[d] += w[j] * V[j * ld + d] for rows j < n in order, columns [d0, d1) (AVX2): 32 columns
 * held in registers across the n rows (out is read and written once per call, not per row),
 * then 8, then one at a time; each element gets the same product and sum as the scalar loop. */
COLI_T_AVX2 static void coli_weighted_cols_avx2(const float *w, const float *V, coli_ix n,
                                                coli_ix ld, float *out, coli_ix d0, coli_ix d1)
{
    coli_ix j, d = d0;
    for (; d + 32 <= d1; d += 32) {
        __m256 a0 = _mm256_loadu_ps(out + d), a1 = _mm256_loadu_ps(out + d + 8);
        __m256 a2 = _mm256_loadu_ps(out + d + 16), a3 = _mm256_loadu_ps(out + d + 24);
        for (j = 0; j < n; j++) {
            const float *v = V + j * ld + d;
            __m256 wj = _mm256_set1_ps(w[j]);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(wj, _mm256_loadu_ps(v)));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(wj, _mm256_loadu_ps(v + 8)));
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(wj, _mm256_loadu_ps(v + 16)));
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(wj, _mm256_loadu_ps(v + 24)));
        }
        _mm256_storeu_ps(out + d, a0);
        _mm256_storeu_ps(out + d + 8, a1);
        _mm256_storeu_ps(out + d + 16, a2);
        _mm256_storeu_ps(out + d + 24, a3);
    }
    for (; d + 8 <= d1; d += 8) {
        __m256 a = _mm256_loadu_ps(out + d);
        for (j = 0; j < n; j++)
            a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(V + j * ld + d)));
        _mm256_storeu_ps(out + d, a);
    }
    for (; d < d1; d++)
        for (j = 0; j < n; j++)
            out[d] = out[d] + w[j] * V[j * ld + d];
}
#endif

#if COLI_X86
/* coli_weighted_rows in AVX-512: each output element gets the same products and sums in the
 * same order (only more columns per instruction): the same bits. */
COLI_T_AVX512 static void coli_weighted_rows_avx512(const float *w, const float *V, coli_ix n,
                                                    coli_ix D, float *out, const char *pf,
                                                    coli_ix npf)
{
    coli_ix j, d = 0;
    for (; d + 64 <= D; d += 64) {
        __m512 a0 = _mm512_loadu_ps(out + d), a1 = _mm512_loadu_ps(out + d + 16);
        __m512 a2 = _mm512_loadu_ps(out + d + 32), a3 = _mm512_loadu_ps(out + d + 48);
        for (j = 0; j < n; j++) {
            const float *v = V + j * D + d;
            __m512 wj = _mm512_set1_ps(w[j]);
            if (npf > 0) {          /* a line of the next block (coli_group_weighted) */
                __builtin_prefetch(pf, 0, 3);
                pf += 64;
                npf--;
            }
            a0 = _mm512_add_ps(a0, _mm512_mul_ps(wj, _mm512_loadu_ps(v)));
            a1 = _mm512_add_ps(a1, _mm512_mul_ps(wj, _mm512_loadu_ps(v + 16)));
            a2 = _mm512_add_ps(a2, _mm512_mul_ps(wj, _mm512_loadu_ps(v + 32)));
            a3 = _mm512_add_ps(a3, _mm512_mul_ps(wj, _mm512_loadu_ps(v + 48)));
        }
        _mm512_storeu_ps(out + d, a0);
        _mm512_storeu_ps(out + d + 16, a1);
        _mm512_storeu_ps(out + d + 32, a2);
        _mm512_storeu_ps(out + d + 48, a3);
    }
    for (; d + 16 <= D; d += 16) {
        __m512 a = _mm512_loadu_ps(out + d);
        for (j = 0; j < n; j++)
            a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_set1_ps(w[j]), _mm512_loadu_ps(V + j * D + d)));
        _mm512_storeu_ps(out + d, a);
    }
    for (; d < D; d += 8) {
        __m256 a = _mm256_loadu_ps(out + d);
        for (j = 0; j < n; j++)
            a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(V + j * D + d)));
        _mm256_storeu_ps(out + d, a);
    }
}

/* coli_lane_fold of the 16 8-lane halves of a0..a7 (row r in a_r: head 0's lanes low, head 1's
 * high) in registers: out0[r] = fold(a_r low), out1[r] = fold(a_r high). The same three levels
 * of sums as coli_lane_fold ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), eight at a time, the rows
 * moved between lanes by shuffles (moves, no rounding): the same bits. */
COLI_T_AVX512 static inline void coli_fold16_avx512(__m512 a0, __m512 a1, __m512 a2, __m512 a3,
                                                    __m512 a4, __m512 a5, __m512 a6, __m512 a7,
                                                    float *out0, float *out1)
{
    /* 128-bit blocks of a_r: [h0 l0-3, h0 l4-7, h1 l0-3, h1 l4-7]; level 1: t = l0-3 + l4-7 */
#define COLI_L1(x, y) _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)), \
                                    _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)))
    __m512 y01 = COLI_L1(a0, a1), y23 = COLI_L1(a2, a3), y45 = COLI_L1(a4, a5);
    __m512 y67 = COLI_L1(a6, a7), z0, z1, f;
#undef COLI_L1
    /* y01 blocks: [r0 h0 t, r0 h1 t, r1 h0 t, r1 h1 t]; level 2: u0 = t0 + t2, u1 = t1 + t3 */
    z0 = _mm512_add_ps(_mm512_shuffle_ps(y01, y23, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(y01, y23, _MM_SHUFFLE(3, 2, 3, 2)));
    z1 = _mm512_add_ps(_mm512_shuffle_ps(y45, y67, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(y45, y67, _MM_SHUFFLE(3, 2, 3, 2)));
    /* z0 blocks: [r0 u, r2 u | r0 h1.., r2 h1.. | r1, r3 | r1 h1, r3 h1]; level 3: u0 + u1 */
    f = _mm512_add_ps(_mm512_shuffle_ps(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm512_shuffle_ps(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
    /* f blocks: [h0 r0 r2 r4 r6, h1 r0 r2 r4 r6, h0 r1 r3 r5 r7, h1 r1 r3 r5 r7] */
    f = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15), f);
    _mm256_storeu_ps(out0, _mm512_castps512_ps256(f));
    _mm256_storeu_ps(out1, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
}

/* The dot products of two query heads (qq: their D values interleaved by 8, q0[0..8) q1[0..8)
 * q0[8..16) ...) with n rows of K: a 512-bit register holds head 0's 8 lanes of coli_dot for a
 * row and head 1's 8 lanes (the row's 8 values broadcast to both halves), so each lane sums the
 * same products in the same order as coli_dot / coli_dots_avx2, then coli_lane_fold: the same
 * bits, half the instructions. Rows after the last multiple of 8: coli_dots_avx2. */
COLI_T_AVX512 static void coli_dots2_avx512(const float *qq, const float *q0, const float *q1,
                                            const float *K, coli_ix n, coli_ix D, float *out0,
                                            float *out1, const char *pf, coli_ix npf)
{
    coli_ix j, d;
    for (j = 0; j + 8 <= n; j += 8) {
        const float *k = K + j * D;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0;
        __m512 a7 = a0;
        for (d = 0; d < D; d += 8) {
            __m512 x = _mm512_loadu_ps(qq + 2 * d);
            if (npf > 0) {          /* a line of the next block (coli_group_dots) */
                __builtin_prefetch(pf, 0, 3);
                pf += 64;
                npf--;
            }
#define COLI_ROW8(r) \
    _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)(k + (r) * D + d))))
            a0 = _mm512_add_ps(a0, _mm512_mul_ps(x, COLI_ROW8(0)));
            a1 = _mm512_add_ps(a1, _mm512_mul_ps(x, COLI_ROW8(1)));
            a2 = _mm512_add_ps(a2, _mm512_mul_ps(x, COLI_ROW8(2)));
            a3 = _mm512_add_ps(a3, _mm512_mul_ps(x, COLI_ROW8(3)));
            a4 = _mm512_add_ps(a4, _mm512_mul_ps(x, COLI_ROW8(4)));
            a5 = _mm512_add_ps(a5, _mm512_mul_ps(x, COLI_ROW8(5)));
            a6 = _mm512_add_ps(a6, _mm512_mul_ps(x, COLI_ROW8(6)));
            a7 = _mm512_add_ps(a7, _mm512_mul_ps(x, COLI_ROW8(7)));
#undef COLI_ROW8
        }
        coli_fold16_avx512(a0, a1, a2, a3, a4, a5, a6, a7, out0 + j, out1 + j);
    }
    if (j < n) {
        coli_dots_avx2(q0, K + j * D, n - j, D, out0 + j);
        coli_dots_avx2(q1, K + j * D, n - j, D, out1 + j);
    }
}
#endif

/* out[D] += w[j] * V[j] for rows j < n, added in order (callers zero out first; a cache read in
 * chunks adds chunk after chunk: the same bits). w: the softmax weights, p[j] / sum. */
static void coli_weighted_rows(const float *w, const float *V, coli_ix n, coli_ix D, float *out,
                               int avx2)
{
    coli_ix j, d;
#if COLI_X86
    if (avx2) {
        coli_weighted_cols_avx2(w, V, n, D, out, 0, D);
        return;
    }
#endif
    (void)avx2;
    for (j = 0; j < n; j++) {
        const float *v = V + j * D;
        float wj = w[j];
        for (d = 0; d < D; d++)
            out[d] += wj * v[d];
    }
}

/* Rows of K / V that the query heads of a group read in turn while the rows sit in L1 (~16 KiB;
 * a multiple of coli_dots_avx2's 4-row block). */
static coli_ix coli_group_rows(coli_ix D)
{
    coli_ix r = (coli_ix)4096 / (D > 0 ? D : 1) / 4 * 4;
    return r < 4 ? 4 : r;
}

/* Scores -> weights of nh heads (p: nh rows of n scores): w = exp(scale * s - max) / sum per
 * head; out (nh rows of D) zeroed for the weighted sums. */
static void coli_group_softmax(float *p, coli_ix nh, coli_ix n, coli_ix D, float scale,
                               float *out, int level)
{
    coli_ix i, j;
    for (i = 0; i < nh; i++) {
        float *pi = p + i * n, sum = coli_softmax_unnorm_lv(pi, n, scale, level);
        for (j = 0; j < n; j++)
            pi[j] = pi[j] / sum;
        for (j = 0; j < D; j++)
            out[i * D + j] = 0.0f;
    }
}

/* Whether the AVX-512 forms of the group's dots / weighted sums run (rows of D floats; qq of
 * coli_group_dots holds 2 * D floats). */
static int coli_group_avx512(int level, coli_ix D)
{
    return COLI_X86 && level == COLI_AVX512 && coli_ops_avx2(level, D) && D <= 512;
}

/* p[i * n + j0 + r] = q_i . rows[r] for the nh heads and the m rows of a block (coli_dot's bits:
 * AVX-512 takes the heads two at a time). */
static void coli_group_dots(const float *q, const float *rows, coli_ix m, coli_ix D, coli_ix nh,
                            float *p, coli_ix n, coli_ix j0, const float *next, coli_ix mnext,
                            int level)
{
    coli_ix i = 0;
    int avx2 = coli_ops_avx2(level, D);
#if COLI_X86
    if (coli_group_avx512(level, D)) {
        float qq[2 * 512];
        coli_ix d, l, lines = mnext * D / 16, share = (lines + nh / 2 - 1) / (nh / 2 > 0 ? nh / 2 : 1);
        for (; i + 2 <= nh; i += 2) {
            coli_ix first = i / 2 * share, cnt = lines - first < share ? lines - first : share;
            const float *q0 = q + i * D, *q1 = q0 + D;
            for (d = 0; d < D; d += 8)
                for (l = 0; l < 8; l++) {
                    qq[2 * d + l] = q0[d + l];
                    qq[2 * d + 8 + l] = q1[d + l];
                }
            coli_dots2_avx512(qq, q0, q1, rows, m, D, p + i * n + j0, p + (i + 1) * n + j0,
                              (const char *)next + first * 64, cnt > 0 ? cnt : 0);
        }
    }
#endif
    for (; i < nh; i++)
        coli_dots(q + i * D, rows, m, D, p + i * n + j0, avx2);
}

/* out_i += w_i[j0 + r] * rows[r] for the nh heads (w: nh rows of n weights), rows in order. */
static void coli_group_weighted(const float *w, coli_ix n, coli_ix j0, const float *rows,
                                coli_ix m, coli_ix D, coli_ix nh, float *out, const float *next,
                                coli_ix mnext, int level)
{
    coli_ix i;
    int avx2 = coli_ops_avx2(level, D);
#if COLI_X86
    if (coli_group_avx512(level, D)) {
        coli_ix lines = mnext * D / 16, share = (lines + nh - 1) / nh;
        for (i = 0; i < nh; i++) {
            coli_ix first = i * share, cnt = lines - first < share ? lines - first : share;
            coli_weighted_rows_avx512(w + i * n + j0, rows, m, D, out + i * D,
                                      (const char *)next + first * 64, cnt > 0 ? cnt : 0);
        }
        return;
    }
#endif
    for (i = 0; i < nh; i++)
        coli_weighted_rows(w + i * n + j0, rows, m, D, out + i * D, avx2);
}

/* The nh query heads of one kv head (q, out: nh rows of D; p: nh * (S - lo) floats of scratch):
 * out_i = softmax(scale * q_i . K[j]) . V[j] over cache rows j in [lo, S) (rows of D contiguous
 * floats). The heads share each pass over K and over V (a block of rows, then every head's dot
 * products / weighted sums over it), so the cache is read from memory once per group instead of
 * once per head; each head's arithmetic is a lone head's, in the same order (the same
 * bits for any grouping). level: qkern.h's SIMD level (every variant: the same bits). */
static void coli_attend_group(const float *q, const float *K, const float *V, coli_ix nh,
                              coli_ix D, coli_ix lo, coli_ix S, float scale, float *p, float *out,
                              int level)
{
    coli_ix n = S - lo, B = coli_group_rows(D), j, m;
    K += lo * D;
    V += lo * D;
    for (j = 0; j < n; j += m) {
        m = n - j < B ? n - j : B;
        coli_group_dots(q, K + j * D, m, D, nh, p, n, j, K + (j + m) * D,
                        n - j - m < B ? n - j - m : B, level);
    }
    coli_group_softmax(p, nh, n, D, scale, out, level);
    for (j = 0; j < n; j += m) {
        m = n - j < B ? n - j : B;
        coli_group_weighted(p, n, j, V + j * D, m, D, nh, out, V + (j + m) * D,
                            n - j - m < B ? n - j - m : B, level);
    }
}

/* ---- float16 KV cache (opt-in) ----------------------------------------------------------------
 * Keys and values stored as IEEE half precision are widened to float32 exactly (every half is a
 * float), CH rows at a time into a small buffer, and go through the float32 head code above: the
 * result has the bits of the float32 kernel over the widened values, for every variant. */
enum { COLI_KV_CHUNK = 64 };

static float coli_h2f(uint16_t h)
{
    /* exponent/mantissa moved into place and rebiased; subnormals via an exact float subtraction */
    union { uint32_t u; float f; } o, magic;
    uint32_t e = (uint32_t)(h & 0x7c00u);
    magic.u = 113u << 23;
    o.u = ((uint32_t)(h & 0x7fffu) << 13) + ((127u - 15u) << 23);
    if (e == 0x7c00u)
        o.u += (128u - 16u) << 23;            /* inf / nan */
    else if (e == 0) {
        o.u += 1u << 23;                      /* zero / subnormal */
        o.f -= magic.f;
    }
    o.u |= (uint32_t)(h & 0x8000u) << 16;
    return o.f;
}

/* float -> half as numpy's astype(float16) does it (npy_floatbits_to_halfbits): round to nearest
 * even, subnormal halves, overflow to inf, NaN kept a NaN with the top of its payload. */
static uint16_t coli_f2h(float x)
{
    union { float f; uint32_t u; } v;
    uint32_t f, f_exp, f_sig;
    uint16_t h_sgn, h_sig;
    v.f = x;
    f = v.u;
    h_sgn = (uint16_t)((f & 0x80000000u) >> 16);
    f_exp = f & 0x7f800000u;
    if (f_exp >= 0x47800000u) {                    /* inf, NaN, or too large: inf */
        if (f_exp == 0x7f800000u && (f & 0x007fffffu) != 0) {
            uint16_t r = (uint16_t)(0x7c00u + ((f & 0x007fffffu) >> 13));
            return (uint16_t)(h_sgn + (r == 0x7c00u ? r + 1 : r));
        }
        return (uint16_t)(h_sgn + 0x7c00u);
    }
    if (f_exp <= 0x38000000u) {                    /* a subnormal half, or zero */
        if (f_exp < 0x33000000u)
            return h_sgn;
        f_exp >>= 23;
        f_sig = 0x00800000u + (f & 0x007fffffu);
        f_sig >>= (113 - f_exp);
        if ((f_sig & 0x00003fffu) != 0x00001000u || (f & 0x000007ffu))
            f_sig += 0x00001000u;
        return (uint16_t)(h_sgn + (uint16_t)(f_sig >> 13));
    }
    f_sig = f & 0x007fffffu;
    if ((f_sig & 0x00003fffu) != 0x00001000u)
        f_sig += 0x00001000u;
    h_sig = (uint16_t)(f_sig >> 13);
    return (uint16_t)(h_sgn + (uint16_t)(h_sig + (uint16_t)((f_exp - 0x38000000u) >> 13)));
}

#if COLI_X86
/* coli_h2f on 8 halves at a time (AVX2 integer operations; the same exact values). */
COLI_T_AVX2 static void coli_h2f_avx2(const uint16_t *h, float *f, coli_ix n)
{
    const __m256i mant = _mm256_set1_epi32(0x7fff), infe = _mm256_set1_epi32(0x7c00 << 13);
    const __m256i bias = _mm256_set1_epi32((127 - 15) << 23), infb = _mm256_set1_epi32((128 - 16) << 23);
    const __m256i one = _mm256_set1_epi32(1 << 23), zero = _mm256_setzero_si256();
    const __m256 magic = _mm256_castsi256_ps(_mm256_set1_epi32(113 << 23));
    coli_ix i;
    for (i = 0; i + 8 <= n; i += 8) {
        __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
        __m256i o = _mm256_slli_epi32(_mm256_and_si256(x, mant), 13);
        __m256i e = _mm256_and_si256(o, infe);
        __m256i isinf = _mm256_cmpeq_epi32(e, infe), isden = _mm256_cmpeq_epi32(e, zero);
        __m256 den;
        o = _mm256_add_epi32(o, bias);
        o = _mm256_add_epi32(o, _mm256_and_si256(isinf, infb));
        den = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_add_epi32(o, one)), magic);
        o = _mm256_blendv_epi8(o, _mm256_castps_si256(den), isden);
        o = _mm256_or_si256(o, _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x8000)), 16));
        _mm256_storeu_ps(f + i, _mm256_castsi256_ps(o));
    }
    for (; i < n; i++)
        f[i] = coli_h2f(h[i]);
}

#define COLI_T_F16C __attribute__((target("avx,avx2,fma,f16c")))

/* The F16C instruction converts 8 halves in one operation (the same values; a NaN may come out
 * quieted). Most AVX2 CPUs have it; cpuid leaf 1, ECX bit 29, checked once. */
COLI_T_F16C static void coli_h2f_f16c(const uint16_t *h, float *f, coli_ix n)
{
    coli_ix i;
#ifdef COLI_SIMDE_TEST      /* SIMDe has no F16C: the integer conversion (the same values) */
    (void)i;
    coli_h2f_avx2(h, f, n);
#else
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++)
        f[i] = coli_h2f(h[i]);
#endif
}

static int coli_has_f16c(void)
{
    static int known = -1;
    unsigned int a, b, c, d;
    if (known < 0)
        known = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)) != 0;
    return known;
}
#endif

/* The AVX2 integer conversion where the CPU has AVX2 (tests reach it on F16C machines too);
 * returns 0 where it cannot run. */
static int coli_h2f_avx2_int(const uint16_t *h, float *f, coli_ix n)
{
#if COLI_X86
    if (coli_simd_supported(COLI_AVX2)) {
        coli_h2f_avx2(h, f, n);
        return 1;
    }
#endif
    (void)h; (void)f; (void)n;
    return 0;
}

static void coli_h2f_rows(const uint16_t *h, float *f, coli_ix n, int avx2)
{
    coli_ix i;
#if COLI_X86
    if (avx2 && coli_has_f16c()) {
        coli_h2f_f16c(h, f, n);
        return;
    }
    if (avx2) {
        coli_h2f_avx2(h, f, n);
        return;
    }
#endif
    (void)avx2;
    for (i = 0; i < n; i++)
        f[i] = coli_h2f(h[i]);
}

/* coli_attend_group over a float16 cache: COLI_KV_CHUNK rows widened into buf (COLI_KV_CHUNK *
 * D floats of scratch), then every head's dot products (resp. weighted sums) over them. */
static void coli_attend_group_h(const float *q, const uint16_t *K, const uint16_t *V, coli_ix nh,
                                coli_ix D, coli_ix lo, coli_ix S, float scale, float *p,
                                float *buf, float *out, int level)
{
    coli_ix n = S - lo, j, m;
    int avx2 = coli_ops_avx2(level, D);
    for (j = 0; j < n; j += m) {
        m = n - j < COLI_KV_CHUNK ? n - j : COLI_KV_CHUNK;
        coli_h2f_rows(K + (lo + j) * D, buf, m * D, avx2);
        coli_group_dots(q, buf, m, D, nh, p, n, j, buf, 0, level);
    }
    coli_group_softmax(p, nh, n, D, scale, out, level);
    for (j = 0; j < n; j += m) {
        m = n - j < COLI_KV_CHUNK ? n - j : COLI_KV_CHUNK;
        coli_h2f_rows(V + (lo + j) * D, buf, m * D, avx2);
        coli_group_weighted(p, n, j, buf, m, D, nh, out, buf, 0, level);
    }
}

/* How the query heads of a position are dealt to threads: kv head g's G query heads in `split`
 * parts (work item it: kv head it / split, heads [h0, h1)). One part per kv head when there are
 * at least as many kv heads as threads; else the group is cut so every thread has work (each
 * part still reads its kv head's K / V once). */
static coli_ix coli_attend_split(coli_ix KV, coli_ix G, int nt)
{
    coli_ix split = nt > 1 && KV < nt ? (nt + KV - 1) / KV : 1;
    return split < G ? split : G;
}

/* Attention of one query position (decode): q [H][D]; K / V: the cache of kv head g at
 * K + g * ks (resp. V + g * vs), positions 0..S-1 of D floats each (rows before lo are outside a
 * sliding window); out [H][D]. Query head h reads kv head h / (H / KV); the heads of a kv head
 * go through one pass over its cache (coli_attend_group), split between nt threads by kv head
 * (and within a group when KV < nt). Each head's bits are the same for any split. level:
 * qkern.h's SIMD level (the same bits in every variant). half: K and V are float16
 * (uint16_t; ks / vs in halves), widened in the kernel. Returns -1 when scratch cannot be
 * allocated. */
static int coli_attend_one(const float *q, const void *K, const void *V, coli_ix ks, coli_ix vs,
                           float *out, coli_ix H, coli_ix KV, coli_ix D, coli_ix lo, coli_ix S,
                           float scale, int nt, int level, int half)
{
    coli_ix n = S - lo, G = H / KV, h, split, items, it;
    float *p;
    if (n <= 0) {
        for (h = 0; h < H * D; h++)
            out[h] = 0.0f;
        return 0;
    }
    /* a parallel region costs more than a short context's whole attention */
    if (nt < 2 || n * H * D < (coli_ix)1 << 18)
        nt = 1;
    split = coli_attend_split(KV, G, nt);
    items = KV * split;
    p = (float *)malloc(sizeof(float) * (size_t)(H * n + (half ? items * COLI_KV_CHUNK * D : 0)));
    if (p == NULL)
        return -1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (it = 0; it < items; it++) {
        coli_ix g = it / split, s = it % split;
        coli_ix h0 = g * G + s * G / split, h1 = g * G + (s + 1) * G / split;
        if (half)
            coli_attend_group_h(q + h0 * D, (const uint16_t *)K + g * ks,
                                (const uint16_t *)V + g * vs, h1 - h0, D, lo, S, scale,
                                p + h0 * n, p + H * n + it * COLI_KV_CHUNK * D, out + h0 * D,
                                level);
        else
            coli_attend_group(q + h0 * D, (const float *)K + g * ks, (const float *)V + g * vs,
                              h1 - h0, D, lo, S, scale, p + h0 * n, out + h0 * D, level);
    }
    free(p);
    return 0;
}

/* Router: per row of logits [T][E], probs = softmax; top[k] = the k largest (ties: lower expert
 * first, as a stable sort of -probs); wts = their probs, divided by their sum when norm. */
static void coli_softmax_topk(const float *logits, coli_ix T, coli_ix E, coli_ix k, int norm,
                              float *probs, int64_t *top, float *wts)
{
    coli_ix t, e, r;
    for (t = 0; t < T; t++) {
        const float *x = logits + t * E;
        float *p = probs + t * E, sum, ws = 0.0f;
        int64_t *tt = top + t * k;
        float *wt = wts + t * k;
        for (e = 0; e < E; e++)
            p[e] = x[e];
        sum = coli_softmax_unnorm(p, E, 1.0f);     /* x * 1 is exact: softmax(x) */
        for (e = 0; e < E; e++)
            p[e] = p[e] / sum;
        for (r = 0; r < k; r++) {
            coli_ix best = -1, q;
            for (e = 0; e < E; e++) {
                int taken = 0;
                for (q = 0; q < r; q++)
                    taken |= tt[q] == e;
                if (!taken && (best < 0 || p[e] > p[best]))
                    best = e;
            }
            tt[r] = best;
            wt[r] = p[best];
            ws += p[best];
        }
        if (norm)
            for (r = 0; r < k; r++)
                wt[r] = wt[r] / ws;
    }
}

/* The MoE block's output for one row: out = c[0] w[0] + c[1] w[1] + ... in that order, each
 * product rounded, then each sum (the build has -ffp-contract=off): the bits of numpy's
 * (c * w[:, None]) summed over ranks by np.add.reduce along that axis. c: [k][H]. */
static void coli_rank_sum(const float *c, const float *w, coli_ix k, coli_ix H, float *out)
{
    coli_ix r, j;
    for (j = 0; j < H; j++)
        out[j] = c[j] * w[0];
    for (r = 1; r < k; r++) {
        const float *cr = c + r * H;
        float wr = w[r];
        for (j = 0; j < H; j++)
            out[j] = out[j] + cr[j] * wr;
    }
}

#endif
