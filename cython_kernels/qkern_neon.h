/* NEON variant (level COLI_NEON) of the hot loops in qkern.h, for AArch64.
 *
 * Included by qkern.h (after its shared helpers) when COLI_ARM is set: on __aarch64__ with gcc /
 * clang, where Advanced SIMD is part of the baseline (no target attribute, no run-time check), and
 * in the COLI_SIMDE_TEST build, where <arm_neon.h> names come from SIMDe's emulation so the code is
 * checked on x86 too (tests/test_kernels.py::test_simd_variants_emulated).
 *
 * Numerics follow the AVX2 variant's structure with 4-lane vectors: every output is computed by
 * one thread in an order fixed by the shapes alone, decode and prefill run the same operations
 * (same bits), and the fused multiply-adds are explicit (vfmaq_f32).
 *
 * int4 (group sizes that are whole 8-byte chunks, gs % 16 == 0; others run the portable code):
 *   x layout as AVX2 (cb = 8): for chunk c, xp[16c + j] = x[2(8c + j)], xp[16c + 8 + j] =
 *   x[2(8c + j) + 1].  Per chunk the 8 bytes become the signed values (nibble - 8) directly (one
 *   XOR with 0x88, then arithmetic shifts: the offset-binary convention of the portable code, no
 *   start-value table), widened to four float32x4 and accumulated in four accumulators a0..a3
 *   (low nibbles 0-3, 4-7, high nibbles 0-3, 4-7); per group acc += ((a0 + a1) + (a2 + a3)) *
 *   s[g]; y = vaddvq_f32(acc).  Prefill unpacks a block of rows to these floats (exact) and runs
 *   the same operations for up to 4 tokens at a time, over the column tiles of coli_q4_rows.
 * int4 x int8 activations (gs % 64 == 0): per 32 packed bytes, the nibble x xq products
 *   (vmull_s8 / vmlal_s8, exact in int16) summed pairwise into int32 lanes (vpaddlq / vpadalq,
 *   exact), plus the "- 8 * sum(xq)" term, then float, times the 32-element scale, summed per
 *   group, times the group scale.  Baseline NEON only (no dotprod extension needed).
 * int8: 32-byte blocks, 8 accumulators of 4 lanes, folded by a fixed tree, times s[o]. */
#ifndef COLI_QKERN_NEON_H
#define COLI_QKERN_NEON_H

static inline float coli_hsum_neon(float32x4_t v)
{
    return vaddvq_f32(v);
}

/* ---- int4 ------------------------------------------------------------------------------------ */

/* 8 packed bytes -> (nibble - 8) of the low nibbles (*lo) and of the high nibbles (*hi). */
static inline void coli_q4_nib_neon(const uint8_t *b, int16x8_t *lo, int16x8_t *hi)
{
    int8x8_t v = veor_s8(vreinterpret_s8_u8(vld1_u8(b)), vdup_n_s8((int8_t)-120)); /* ^ 0x88 */
    *lo = vmovl_s8(vshr_n_s8(vshl_n_s8(v, 4), 4));
    *hi = vmovl_s8(vshr_n_s8(v, 4));
}

static inline float32x4_t coli_cvt_lo_neon(int16x8_t v)
{
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(v)));
}

static inline float32x4_t coli_cvt_hi_neon(int16x8_t v)
{
    return vcvtq_f32_s32(vmovl_high_s16(v));
}

static inline float32x4_t coli_q4_group_neon(const uint8_t *wg, const float *xg, coli_idx nch,
                                             coli_idx avail, float32x4_t acc, float sc)
{
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
    uint8_t buf[8];
    coli_idx c;
    for (c = 0; c < nch; c++) {
        const uint8_t *b = avail >= 8 * nch ? wg + 8 * c : coli_chunk(wg, c, 8, avail, buf);
        const float *x = xg + 16 * c;
        int16x8_t lo, hi;
        coli_q4_nib_neon(b, &lo, &hi);
        a0 = vfmaq_f32(a0, coli_cvt_lo_neon(lo), vld1q_f32(x));
        a1 = vfmaq_f32(a1, coli_cvt_hi_neon(lo), vld1q_f32(x + 4));
        a2 = vfmaq_f32(a2, coli_cvt_lo_neon(hi), vld1q_f32(x + 8));
        a3 = vfmaq_f32(a3, coli_cvt_hi_neon(hi), vld1q_f32(x + 12));
    }
    return vfmaq_f32(acc, vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)), vdupq_n_f32(sc));
}

COLI_INLINE float coli_q4_row_neon_g(const uint8_t *w, const float *s, const float *xo,
                                     coli_idx nb, coli_idx ng, coli_idx gs)
{
    coli_idx gb = gs / 2, g, nch = gb / 8;
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (g = 0; g + 1 < ng; g++)        /* whole groups: straight from memory */
        acc = coli_q4_group_neon(w + g * gb, xo + g * gs, nch, gb, acc, s[g]);
    /* the last group may end early (cols % gs): its partial chunks go through a padded copy */
    acc = coli_q4_group_neon(w + g * gb, xo + g * gs, nch, nb - g * gb, acc, s[g]);
    return coli_hsum_neon(acc);
}

static float coli_q4_row_neon(const uint8_t *w, const float *s, const float *xo, coli_idx nb,
                              coli_idx ng, coli_idx gs)
{
    switch (gs) {   /* the common group sizes as compile-time constants */
    case 32: return coli_q4_row_neon_g(w, s, xo, nb, ng, 32);
    case 64: return coli_q4_row_neon_g(w, s, xo, nb, ng, 64);
    case 128: return coli_q4_row_neon_g(w, s, xo, nb, ng, 128);
    default: return coli_q4_row_neon_g(w, s, xo, nb, ng, gs);
    }
}

/* Unpacked row: U[16c + j] = lo nibble of byte 8c + j minus 8, U[16c + 8 + j] = hi minus 8;
 * 0 past the row (x is zero there). */
static void coli_q4_unpack_neon(const uint8_t *w, float *U, coli_idx nb, coli_idx L)
{
    coli_idx c, nfull = nb / 8;
    for (c = 0; c < nfull; c++) {
        int16x8_t lo, hi;
        coli_q4_nib_neon(w + 8 * c, &lo, &hi);
        vst1q_f32(U + 16 * c, coli_cvt_lo_neon(lo));
        vst1q_f32(U + 16 * c + 4, coli_cvt_hi_neon(lo));
        vst1q_f32(U + 16 * c + 8, coli_cvt_lo_neon(hi));
        vst1q_f32(U + 16 * c + 12, coli_cvt_hi_neon(hi));
    }
    for (c = 16 * nfull; c < L; c++)
        U[c] = 0.0f;
    for (c = 8 * nfull; c < nb; c++) {
        coli_idx k = c - 8 * nfull;
        U[16 * nfull + k] = (float)((int)(w[c] & 15) - 8);
        U[16 * nfull + 8 + k] = (float)((int)(w[c] >> 4) - 8);
    }
}

/* Groups [g0, g1) of NT (1..4) tokens from an unpacked row U; the accumulators pass through A
 * (16 floats per token, 4 used).  Same operations as coli_q4_row_neon. */
#define COLI_Q4_PF_NEON(NT)                                                                     \
    static void coli_q4_pf##NT##_neon(const float *U, const float *s, const float *xp,         \
                                      const float *gi, coli_idx L, coli_idx ng, coli_idx gs,   \
                                      coli_idx g0, coli_idx g1, float *A)                      \
    {                                                                                           \
        coli_idx g, c, t, nch = gs / 16;                                                        \
        float32x4_t acc[NT];                                                                    \
        (void)gi;                                                                               \
        (void)ng;                                                                               \
        for (t = 0; t < NT; t++)                                                                \
            acc[t] = vld1q_f32(A + 16 * t);                                                     \
        for (g = g0; g < g1; g++) {                                                             \
            float32x4_t a0[NT], a1[NT], a2[NT], a3[NT], sc = vdupq_n_f32(s[g]);                 \
            const float *ug = U + g * gs;                                                       \
            for (t = 0; t < NT; t++) {                                                          \
                a0[t] = vdupq_n_f32(0.0f);                                                      \
                a1[t] = a0[t];                                                                  \
                a2[t] = a0[t];                                                                  \
                a3[t] = a0[t];                                                                  \
            }                                                                                   \
            for (c = 0; c < nch; c++) {                                                         \
                float32x4_t u0 = vld1q_f32(ug + 16 * c), u1 = vld1q_f32(ug + 16 * c + 4);       \
                float32x4_t u2 = vld1q_f32(ug + 16 * c + 8), u3 = vld1q_f32(ug + 16 * c + 12);  \
                for (t = 0; t < NT; t++) {                                                      \
                    const float *xg = xp + t * L + g * gs + 16 * c;                             \
                    a0[t] = vfmaq_f32(a0[t], u0, vld1q_f32(xg));                                \
                    a1[t] = vfmaq_f32(a1[t], u1, vld1q_f32(xg + 4));                            \
                    a2[t] = vfmaq_f32(a2[t], u2, vld1q_f32(xg + 8));                            \
                    a3[t] = vfmaq_f32(a3[t], u3, vld1q_f32(xg + 12));                           \
                }                                                                               \
            }                                                                                   \
            for (t = 0; t < NT; t++)                                                            \
                acc[t] = vfmaq_f32(acc[t], vaddq_f32(vaddq_f32(a0[t], a1[t]),                   \
                                                     vaddq_f32(a2[t], a3[t])), sc);             \
        }                                                                                       \
        for (t = 0; t < NT; t++)                                                                \
            vst1q_f32(A + 16 * t, acc[t]);                                                      \
    }
COLI_Q4_PF_NEON(1)
COLI_Q4_PF_NEON(2)
COLI_Q4_PF_NEON(3)
COLI_Q4_PF_NEON(4)

static float coli_q4_fin_neon(const float *A)
{
    return coli_hsum_neon(vld1q_f32(A));
}

/* ---- int4 x int8 activations (layouts: coli_q4i8_prep in qkern.h) ---------------------------- */

/* Half h (32 elements, 16 packed bytes) of a 64-element block: exact int32 partial sums of
 * (nibble x xq), plus the "- 8 sum(xq)" term in lane 0, as floats. */
static inline float32x4_t coli_q4i8_half_neon(const uint8_t *b, const int8_t *q, const int32_t *c)
{
    uint8x16_t v = vld1q_u8(b);
    int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(15)));
    int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
    int8x16_t ql = vld1q_s8(q), qh = vld1q_s8(q + 32);
    /* |nibble x xq| <= 15 * 127: two products per int16 lane cannot overflow */
    int16x8_t p0 = vmlal_s8(vmull_s8(vget_low_s8(lo), vget_low_s8(ql)), vget_low_s8(hi),
                            vget_low_s8(qh));
    int16x8_t p1 = vmlal_high_s8(vmull_high_s8(lo, ql), hi, qh);
    int32x4_t sum = vpadalq_s16(vaddq_s32(vpaddlq_s16(p0), vld1q_s32(c)), p1);
    return vcvtq_f32_s32(sum);
}

COLI_INLINE float coli_q4i8_row_neon_g(const uint8_t *w, const float *s, const int8_t *xq,
                                       const float *xd, const int32_t *xc, coli_idx nb,
                                       coli_idx ng, coli_idx gs)
{
    coli_idx gb = gs / 2, g, k, nbk = gs / 64;
    float32x4_t acc[2];
    uint8_t buf[32];
    acc[0] = vdupq_n_f32(0.0f);
    acc[1] = acc[0];
    for (g = 0; g < ng; g++) {
        coli_idx avail = nb - g * gb, blk = g * nbk;
        const uint8_t *bg = w + g * gb;
        float32x4_t ga0 = vdupq_n_f32(0.0f), ga1 = ga0;
        for (k = 0; k < nbk; k++) {
            const uint8_t *b = bg + 32 * k;
            const int8_t *q = xq + 64 * (blk + k);
            const float *d = xd + 8 * (blk + k);
            const int32_t *c = xc + 8 * (blk + k);
            if (avail < 32 * (k + 1)) {   /* last group, partly beyond the row: padded copy */
                coli_idx n = avail - 32 * k;
                memset(buf, 0x88, sizeof(buf));
                if (n > 0)
                    memcpy(buf, b, (size_t)n);
                b = buf;
            }
            ga0 = vfmaq_f32(ga0, coli_q4i8_half_neon(b, q, c), vld1q_f32(d));
            ga1 = vfmaq_f32(ga1, coli_q4i8_half_neon(b + 16, q + 16, c + 4), vld1q_f32(d + 4));
        }
        /* two accumulators (even / odd groups): no serial chain of FMAs across the row */
        acc[g & 1] = vfmaq_f32(acc[g & 1], vaddq_f32(ga0, ga1), vdupq_n_f32(s[g]));
    }
    return coli_hsum_neon(vaddq_f32(acc[0], acc[1]));
}

static float coli_q4i8_row_neon(const uint8_t *w, const float *s, const int8_t *xq,
                                const float *xd, const int32_t *xc, coli_idx nb, coli_idx ng,
                                coli_idx gs)
{
    switch (gs) {
    case 64: return coli_q4i8_row_neon_g(w, s, xq, xd, xc, nb, ng, 64);
    case 128: return coli_q4i8_row_neon_g(w, s, xq, xd, xc, nb, ng, 128);
    default: return coli_q4i8_row_neon_g(w, s, xq, xd, xc, nb, ng, gs);
    }
}

/* ---- int8 ------------------------------------------------------------------------------------ */

/* 16 int8 weights times 16 floats of x into a[0..3] (4 lanes each). */
static inline void coli_q8_fma16_neon(float32x4_t *a, const int8_t *b, const float *x)
{
    int8x16_t v = vld1q_s8(b);
    int16x8_t l = vmovl_s8(vget_low_s8(v)), h = vmovl_high_s8(v);
    a[0] = vfmaq_f32(a[0], coli_cvt_lo_neon(l), vld1q_f32(x));
    a[1] = vfmaq_f32(a[1], coli_cvt_hi_neon(l), vld1q_f32(x + 4));
    a[2] = vfmaq_f32(a[2], coli_cvt_lo_neon(h), vld1q_f32(x + 8));
    a[3] = vfmaq_f32(a[3], coli_cvt_hi_neon(h), vld1q_f32(x + 12));
}

static float coli_q8_fold_neon(const float32x4_t *a)
{
    return coli_hsum_neon(vaddq_f32(vaddq_f32(vaddq_f32(a[0], a[1]), vaddq_f32(a[2], a[3])),
                                    vaddq_f32(vaddq_f32(a[4], a[5]), vaddq_f32(a[6], a[7]))));
}

/* Lp: a multiple of 32 (coli_q8_block); x zero padded to Lp. */
static float coli_q8_row_neon(const int8_t *w, const float *x, coli_idx cols, coli_idx Lp)
{
    float32x4_t a[8];
    int8_t tail[32];
    coli_idx k, q, nfull = cols / 32;
    for (q = 0; q < 8; q++)
        a[q] = vdupq_n_f32(0.0f);
    for (k = 0; k * 32 < Lp; k++) {
        const int8_t *b = w + 32 * k;
        if (k >= nfull) {
            memset(tail, 0, sizeof(tail));
            memcpy(tail, b, (size_t)(cols - 32 * k));
            b = tail;
        }
        coli_q8_fma16_neon(a, b, x + 32 * k);
        coli_q8_fma16_neon(a + 4, b + 16, x + 32 * k + 16);
    }
    return coli_q8_fold_neon(a);
}

static void coli_q8_unpack_neon(const int8_t *w, float *U, coli_idx cols, coli_idx Lp)
{
    coli_idx i;
    for (i = 0; i + 16 <= cols; i += 16) {
        int8x16_t v = vld1q_s8(w + i);
        int16x8_t l = vmovl_s8(vget_low_s8(v)), h = vmovl_high_s8(v);
        vst1q_f32(U + i, coli_cvt_lo_neon(l));
        vst1q_f32(U + i + 4, coli_cvt_hi_neon(l));
        vst1q_f32(U + i + 8, coli_cvt_lo_neon(h));
        vst1q_f32(U + i + 12, coli_cvt_hi_neon(h));
    }
    for (; i < cols; i++)
        U[i] = (float)w[i];
    for (; i < Lp; i++)
        U[i] = 0.0f;
}

/* One token from an unpacked row: the operations of coli_q8_row_neon. */
static float coli_q8_pf_neon(const float *U, const float *x, coli_idx Lp)
{
    float32x4_t a[8];
    coli_idx k, q;
    for (q = 0; q < 8; q++)
        a[q] = vdupq_n_f32(0.0f);
    for (k = 0; k < Lp; k += 32)
        for (q = 0; q < 8; q++)
            a[q] = vfmaq_f32(a[q], vld1q_f32(U + k + 4 * q), vld1q_f32(x + k + 4 * q));
    return coli_q8_fold_neon(a);
}

#endif /* COLI_QKERN_NEON_H */
