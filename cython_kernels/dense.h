/* Dense float32 products y = x @ W.T (x [T][K], W [O][K]) in an order that does not depend on the
 * row count T, the thread count or the SIMD variant (cython_kernels/dense.pxi,
 * core.kernels.matmul for "dense" weights, the router's logits).
 *
 * Why: numpy hands one row to sgemv and many to sgemm, which sum in different orders, so a bits-16
 * model's decode (one row) and prefill (many rows) of the same positions differed by float32
 * rounding (~1e-4 of the logits on the Qwen3.5 fixtures, issue 18).  Here every (t, o) is
 *
 *     16 lanes:  lane j = fma chain over k = j, j + 16, j + 32, ... < K, in increasing k, from +0
 *     y[t][o]  = (((l0 + l8) + (l4 + l12)) + ((l2 + l10) + (l6 + l14)))
 *              + (((l1 + l9) + (l5 + l13)) + ((l3 + l11) + (l7 + l15)))
 *
 * (the pairwise tree of the lanes that halving a 512-bit register gives: j + (j + 8), then + 4,
 * + 2, + 1).  A K that is not a multiple of 16 ends in a partial step whose missing lanes are
 * zero products: fma(0, 0, lane) is the lane (a lane is never -0), the same as no step.  The
 * lanes of a tile pass through memory between k panels (no rounding there), so tiling, panels
 * and the work split between threads change no bit.  AVX-512 holds a (t, o) pair's lanes in one
 * zmm, AVX2 in two ymm (lanes 0-7, 8-15); the portable loops (fmaf) are also NEON's (one fmadd
 * there, auto-vectorized); all give the same bits (tests/test_dense_matmul.py).  On x86 without
 * hardware FMA (the portable variant) fmaf is a library call: core.kernels uses numpy instead.
 *
 * Tiles: R token rows x C weight rows, each pair its own accumulator, one load of x per row and
 * of W per output per step shared by the tile (AVX-512 4 x 6 = 24 zmm, AVX2 2 x 3 = 12 pairs of
 * ymm; one row: 1 x 8 / 1 x 6); the W tile (C rows x a panel of KC floats) stays in L1 while the
 * token tiles of a work block (TB rows x OB outputs) pass over it.
 *
 * Speed (benchmarks/README.md, "Dense products"): one row reads W at sgemv's speed; on one
 * AVX-512 core 32 rows run ~1.5x sgemm, 128 rows at par, 512 rows ~0.8x. */
#ifndef COLI_DENSE_H
#define COLI_DENSE_H

#include <math.h>
#include "qkern.h"

enum { COLI_DN_L = 16 };     /* lanes per (t, o) pair */
enum { COLI_DN_KC = 1024 }; /* k per panel (a multiple of 16) */
enum { COLI_DN_TB = 64 };    /* token rows per work block */
enum { COLI_DN_OB = 96 };    /* weight rows per work block (a multiple of every tile's C) */

/* Scratch floats per thread: the lanes of a work block's pairs between panels. */
enum { COLI_DN_LDP = COLI_DN_KC + 16 };   /* row stride of the copied panels */
enum { COLI_DN_CMAX = 6 };                 /* the widest many-row tile's outputs */

/* Scratch floats per thread for T rows of K: the lanes of a work block's pairs between panels
 * and one output tile's W panel; none for one row (decode: one panel, nothing to allocate). */
static size_t coli_dn_scratch_floats(coli_idx T, coli_idx K)
{
    (void)K;
    if (T <= 1)
        return 0;
    return (size_t)(COLI_DN_TB * COLI_DN_OB * COLI_DN_L + COLI_DN_CMAX * COLI_DN_LDP);
}

/* Row stride of x laid out for many rows: K rounded up to whole 16-lane steps (zeros after K),
 * plus 16 floats, so that the rows of a tile do not share L1 sets (see coli_dn_block). */
static coli_idx coli_dn_ldx(coli_idx K)
{
    return (K + 15) / 16 * 16 + 16;
}

/* Rows [t0, t1) of x [.][K] into X [.][ldx], zero padded (coli_dn_ldx). */
static void coli_dn_lay_x(const float *x, coli_idx K, coli_idx t0, coli_idx t1, float *X,
                          coli_idx ldx)
{
    coli_idx t, k;
    for (t = t0; t < t1; t++) {
        memcpy(X + t * ldx, x + t * K, (size_t)K * sizeof(float));
        for (k = K; k < ldx; k++)
            X[t * ldx + k] = 0.0f;
    }
}

/* The level whose loops run: AVX-512, AVX2, or the portable loops (NEON's too: the same bits). */
static int coli_dn_level(int level)
{
    return level == COLI_AVX512 || level == COLI_AVX2 || (level == COLI_NEON && COLI_ARM)
               ? level : COLI_PORTABLE;
}

static float coli_dn_fold(const float *a)
{
    float s8[8], s4[4];
    int j;
    for (j = 0; j < 8; j++)
        s8[j] = a[j] + a[j + 8];
    for (j = 0; j < 4; j++)
        s4[j] = s8[j] + s8[j + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* ---- portable: R x C pairs of 16 lanes, fmaf ------------------------------------------------ */
/* The pairs (r, c) of x rows x + r ldx and W rows w + c ldw over k in [0, kn) of this panel.
 * acc: the pairs' lanes, pair (r, c) at acc + (r * lda + c) * 16; first: start from +0; last:
 * fold into y[r * ldy + c] (else store the lanes). */
static void coli_dn_tile_portable(const float *x, coli_idx ldx, const float *w, coli_idx ldw,
                                  coli_idx kn, int R, int C, float *acc, coli_idx lda, float *y,
                                  coli_idx ldy, int first, int last)
{
    float a[COLI_DN_L];
    coli_idx k;
    int r, c, j;
    for (r = 0; r < R; r++)
        for (c = 0; c < C; c++) {
            const float *xr = x + r * ldx, *wc = w + c * ldw;
            float *ap = acc + (r * lda + c) * COLI_DN_L;
            for (j = 0; j < COLI_DN_L; j++)
                a[j] = first ? 0.0f : ap[j];
            for (k = 0; k + COLI_DN_L <= kn; k += COLI_DN_L)
                for (j = 0; j < COLI_DN_L; j++)
                    a[j] = fmaf(xr[k + j], wc[k + j], a[j]);
            for (j = 0; k + j < kn; j++)
                a[j] = fmaf(xr[k + j], wc[k + j], a[j]);
            if (last)
                y[r * ldy + c] = coli_dn_fold(a);
            else
                for (j = 0; j < COLI_DN_L; j++)
                    ap[j] = a[j];
        }
}

#if COLI_X86
/* ---- AVX-512: a pair's 16 lanes in one zmm -------------------------------------------------- */
COLI_T_AVX512 static inline float coli_dn_fold512(__m512 v)
{
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

#define COLI_DN_TILE512(R, C)                                                                     \
    COLI_T_AVX512 static void coli_dn_tile512_##R##_##C(                                          \
        const float *x, coli_idx ldx, const float *w, coli_idx ldw, coli_idx kn, float *acc,       \
        coli_idx lda, float *y, coli_idx ldy, int first, int last)                                 \
    {                                                                                             \
        __m512 a[R][C];                                                                           \
        coli_idx k;                                                                               \
        int r, c;                                                                                 \
        _Pragma("GCC unroll 4") for (r = 0; r < R; r++)                                           \
            _Pragma("GCC unroll 8") for (c = 0; c < C; c++)                                       \
                a[r][c] = first ? _mm512_setzero_ps()                                             \
                                : _mm512_loadu_ps(acc + (r * lda + c) * COLI_DN_L);               \
        for (k = 0; k + COLI_DN_L <= kn; k += COLI_DN_L) {                                        \
            __m512 xv[R];                                                                         \
            _Pragma("GCC unroll 4") for (r = 0; r < R; r++)                                       \
                xv[r] = _mm512_loadu_ps(x + r * ldx + k);                                         \
            _Pragma("GCC unroll 8") for (c = 0; c < C; c++) {                                     \
                __m512 wv = _mm512_loadu_ps(w + c * ldw + k);                                     \
                _Pragma("GCC unroll 4") for (r = 0; r < R; r++)                                   \
                    a[r][c] = _mm512_fmadd_ps(xv[r], wv, a[r][c]);                                \
            }                                                                                     \
        }                                                                                         \
        if (k < kn) {               /* the partial last step: zeros past kn */                    \
            __mmask16 m = (__mmask16)((1u << (kn - k)) - 1);                                      \
            __m512 xv[R];                                                                         \
            _Pragma("GCC unroll 4") for (r = 0; r < R; r++)                                       \
                xv[r] = _mm512_maskz_loadu_ps(m, x + r * ldx + k);                                \
            _Pragma("GCC unroll 8") for (c = 0; c < C; c++) {                                     \
                __m512 wv = _mm512_maskz_loadu_ps(m, w + c * ldw + k);                            \
                _Pragma("GCC unroll 4") for (r = 0; r < R; r++)                                   \
                    a[r][c] = _mm512_fmadd_ps(xv[r], wv, a[r][c]);                                \
            }                                                                                     \
        }                                                                                         \
        _Pragma("GCC unroll 4") for (r = 0; r < R; r++)                                           \
            _Pragma("GCC unroll 8") for (c = 0; c < C; c++) {                                     \
                if (last)                                                                         \
                    y[r * ldy + c] = coli_dn_fold512(a[r][c]);                                    \
                else                                                                              \
                    _mm512_storeu_ps(acc + (r * lda + c) * COLI_DN_L, a[r][c]);                   \
            }                                                                                     \
    }
COLI_DN_TILE512(4, 6)
COLI_DN_TILE512(3, 6)
COLI_DN_TILE512(2, 6)
COLI_DN_TILE512(1, 6)
COLI_DN_TILE512(1, 8)
COLI_DN_TILE512(4, 1)
COLI_DN_TILE512(3, 1)
COLI_DN_TILE512(2, 1)
COLI_DN_TILE512(1, 1)

/* ---- AVX2: a pair's lanes 0-7 and 8-15 in two ymm ------------------------------------------- */
COLI_T_AVX2 static inline float coli_dn_fold256(__m256 lo, __m256 hi)
{
    __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* lanes [0, n) of 8 set (n may be <= 0 or >= 8) */
COLI_T_AVX2 static inline __m256i coli_dn_mask8(coli_idx n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 0 ? 0 : n > 8 ? 8 : n)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

#define COLI_DN_TILE256(R, C)                                                                     \
    COLI_T_AVX2 static void coli_dn_tile256_##R##_##C(                                            \
        const float *x, coli_idx ldx, const float *w, coli_idx ldw, coli_idx kn, float *acc,       \
        coli_idx lda, float *y, coli_idx ldy, int first, int last)                                 \
    {                                                                                             \
        __m256 a[R][C][2];                                                                        \
        coli_idx k;                                                                               \
        int r, c, h;                                                                              \
        _Pragma("GCC unroll 4") for (r = 0; r < R; r++)                                           \
            _Pragma("GCC unroll 8") for (c = 0; c < C; c++)                                       \
                _Pragma("GCC unroll 2") for (h = 0; h < 2; h++)                                   \
                    a[r][c][h] = first ? _mm256_setzero_ps()                                      \
                                       : _mm256_loadu_ps(acc + (r * lda + c) * COLI_DN_L + 8 * h); \
        for (k = 0; k + COLI_DN_L <= kn; k += COLI_DN_L) {                                        \
            _Pragma("GCC unroll 2") for (h = 0; h < 2; h++) {                                     \
                __m256 xv[R];                                                                     \
                _Pragma("GCC unroll 4") for (r = 0; r < R; r++)                                   \
                    xv[r] = _mm256_loadu_ps(x + r * ldx + k + 8 * h);                             \
                _Pragma("GCC unroll 8") for (c = 0; c < C; c++) {                                 \
                    __m256 wv = _mm256_loadu_ps(w + c * ldw + k + 8 * h);                         \
                    _Pragma("GCC unroll 4") for (r = 0; r < R; r++)                               \
                        a[r][c][h] = _mm256_fmadd_ps(xv[r], wv, a[r][c][h]);                      \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        if (k < kn) {                                                                             \
            _Pragma("GCC unroll 2") for (h = 0; h < 2; h++) {                                     \
                __m256i m = coli_dn_mask8(kn - k - 8 * h);                                        \
                __m256 xv[R];                                                                     \
                _Pragma("GCC unroll 4") for (r = 0; r < R; r++)                                   \
                    xv[r] = _mm256_maskload_ps(x + r * ldx + k + 8 * h, m);                       \
                _Pragma("GCC unroll 8") for (c = 0; c < C; c++) {                                 \
                    __m256 wv = _mm256_maskload_ps(w + c * ldw + k + 8 * h, m);                   \
                    _Pragma("GCC unroll 4") for (r = 0; r < R; r++)                               \
                        a[r][c][h] = _mm256_fmadd_ps(xv[r], wv, a[r][c][h]);                      \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        _Pragma("GCC unroll 4") for (r = 0; r < R; r++)                                           \
            _Pragma("GCC unroll 8") for (c = 0; c < C; c++) {                                     \
                if (last)                                                                         \
                    y[r * ldy + c] = coli_dn_fold256(a[r][c][0], a[r][c][1]);                     \
                else                                                                              \
                    _Pragma("GCC unroll 2") for (h = 0; h < 2; h++)                               \
                        _mm256_storeu_ps(acc + (r * lda + c) * COLI_DN_L + 8 * h, a[r][c][h]);    \
            }                                                                                     \
    }
COLI_DN_TILE256(2, 3)
COLI_DN_TILE256(1, 3)
COLI_DN_TILE256(1, 6)
COLI_DN_TILE256(2, 1)
COLI_DN_TILE256(1, 1)

typedef void (*coli_dn_tile_fn)(const float *, coli_idx, const float *, coli_idx, coli_idx,
                                float *, coli_idx, float *, coli_idx, int, int);

static coli_dn_tile_fn coli_dn_tile512(int R, int C)
{
    static const coli_dn_tile_fn six[4] = {coli_dn_tile512_1_6, coli_dn_tile512_2_6,
                                           coli_dn_tile512_3_6, coli_dn_tile512_4_6};
    static const coli_dn_tile_fn one[4] = {coli_dn_tile512_1_1, coli_dn_tile512_2_1,
                                           coli_dn_tile512_3_1, coli_dn_tile512_4_1};
    return C == 8 ? coli_dn_tile512_1_8 : C == 6 ? six[R - 1] : one[R - 1];
}

static coli_dn_tile_fn coli_dn_tile256(int R, int C)
{
    if (C == 6)
        return coli_dn_tile256_1_6;
    if (C == 3)
        return R == 2 ? coli_dn_tile256_2_3 : coli_dn_tile256_1_3;
    return R == 2 ? coli_dn_tile256_2_1 : coli_dn_tile256_1_1;
}
#endif

/* Rows and outputs per tile at a level for a block of nt rows.  One row (decode) takes more
 * outputs, i.e. more independent FMA chains and W streams, and one k panel: AVX-512 8 (a
 * 128 x 2048 router from L2 on one thread, W 16 bytes off a cache line: 14.6 -> 12.8 us; 12
 * outputs: 19 us), AVX2 6 (64-byte aligned W: 10.4 -> 9.2 us).  From L2 the one-row product is
 * bound by W's alignment (a 64-byte aligned W: ~8 us, numpy's sgemv 10.8); from DRAM it reads
 * at sgemv's speed whatever the width. */
static void coli_dn_tile_shape(int lv, coli_idx nt, int *R, int *C)
{
    *R = lv == COLI_AVX512 ? 4 : 2;
    *C = lv == COLI_AVX512 ? (nt == 1 ? 8 : 6) : lv == COLI_AVX2 ? (nt == 1 ? 6 : 3) : 4;
}

/* Rows [r0, r0 + n) x columns [k0, k0 + kn) of A [.][K] into P [n][ldp], zeros up to ldp
 * (ldp: kn rounded up to 16, plus 16 floats so that rows 2 KiB apart do not share L1 sets). */
static void coli_dn_pack(const float *A, coli_idx K, coli_idx r0, coli_idx n, coli_idx k0,
                         coli_idx kn, float *P, coli_idx ldp)
{
    coli_idx r, k;
    for (r = 0; r < n; r++) {
        const float *a = A + (r0 + r) * K + k0;
        float *p = P + r * ldp;
        memcpy(p, a, (size_t)kn * sizeof(float));
        for (k = kn; k < ldp; k++)
            p[k] = 0.0f;
    }
}

/* One tile at its level (see coli_dn_tile_portable for the arguments). */
static void coli_dn_tile(int lv, const float *x, coli_idx ldx, const float *w, coli_idx ldw,
                         coli_idx kn, int r, int c, float *acc, float *y, coli_idx ldy, int first,
                         int last)
{
#if COLI_X86
    if (lv == COLI_AVX512) {
        coli_dn_tile512(r, c)(x, ldx, w, ldw, kn, acc, COLI_DN_OB, y, ldy, first, last);
        return;
    }
    if (lv == COLI_AVX2) {
        coli_dn_tile256(r, c)(x, ldx, w, ldw, kn, acc, COLI_DN_OB, y, ldy, first, last);
        return;
    }
#endif
    coli_dn_tile_portable(x, ldx, w, ldw, kn, r, c, acc, COLI_DN_OB, y, ldy, first, last);
}

/* One work block: y[t * ldy + o] for t in [t0, t1), o in [o0, o1) (t1 - t0 <= COLI_DN_TB,
 * o1 - o0 <= COLI_DN_OB); W [.][K] row-major, x [.][ldx]: ldx = K, or (xpad) laid out by
 * coli_dn_lay_x.  scratch: coli_dn_scratch_floats.  With more than one token tile, each output
 * tile's W rows are copied per k panel into a padded buffer (read once per token tile): rows K
 * floats apart -- x's as the caller passes them, W's -- at K = 2048 put every row of a tile into
 * the same L1 sets (4096 x 2048 on one AVX-512 thread, 32 / 512 rows: 113 / 113 GFLOP/s
 * unpadded, 130 / 146 with x laid out once per call and W copied per tile).
 * The zeros that pad x and the copied W to whole 16-lane steps are zero products: no bit
 * changes. */
static void coli_dn_block(int level, const float *x, coli_idx ldx, int xpad, const float *W,
                          coli_idx K, coli_idx t0, coli_idx t1, coli_idx o0, coli_idx o1, float *y,
                          coli_idx ldy, float *scratch)
{
    int lv = coli_dn_level(level), R, C;
    coli_idx k0, o, t, nt = t1 - t0;
    float *accs = scratch, *wp = scratch ? scratch + COLI_DN_TB * COLI_DN_OB * COLI_DN_L : NULL;
    /* one row: one panel (nothing to reuse; the lanes stay in registers) */
    coli_idx kc = nt == 1 ? (K > 0 ? K : 1) : COLI_DN_KC;
    coli_dn_tile_shape(lv, nt, &R, &C);
    for (k0 = 0; k0 < K || k0 == 0; k0 += kc) {             /* K == 0: one empty panel, y = 0 */
        coli_idx kn = K - k0 < kc ? K - k0 : kc, kp = (kn + 15) / 16 * 16;
        int first = k0 == 0, last = k0 + kn >= K, c, pack_w = nt > R;
        for (o = o0; o < o1; o += c) {
            const float *ws = W + o * K + k0;
            coli_idx ldw = K, kk = kn;
            /* the SIMD levels finish a block's last outputs one at a time */
            c = o1 - o >= C ? C : lv == COLI_AVX512 || lv == COLI_AVX2 ? 1 : (int)(o1 - o);
            if (pack_w) {
                coli_dn_pack(W, K, o, c, k0, kn, wp, COLI_DN_LDP);
                ws = wp;
                ldw = COLI_DN_LDP;
                kk = xpad ? kp : kn;
            }
            for (t = t0; t < t1; t += R) {
                int r = t1 - t >= R ? R : (int)(t1 - t);
                float *acc = accs ? accs + ((t - t0) * COLI_DN_OB + (o - o0)) * COLI_DN_L : NULL;
                coli_dn_tile(lv, x + t * ldx + k0, ldx, ws, ldw, kk, r, c, acc, y + t * ldy + o,
                             ldy, first, last);
            }
        }
    }
}

/* y [O] = W [O][K] . x [K] on the calling thread, in the order above (the router of a decode
 * step inside a compiled block: layer_ops.h's coli_matvec_rows). */
static void coli_dn_matvec(int level, const float *x, const float *W, coli_idx K, coli_idx O,
                           float *y)
{
    coli_idx o0;
    for (o0 = 0; o0 < O; o0 += COLI_DN_OB)      /* one row: no scratch (coli_dn_scratch_floats) */
        coli_dn_block(level, x, K, 0, W, K, 0, 1, o0, O - o0 < COLI_DN_OB ? O : o0 + COLI_DN_OB, y,
                      O, NULL);
}

/* ---- the transposed product y = x @ W (x [T][O], W [O][I]) -----------------------------------
 * Every y[t][i] is one fma chain over o in increasing order from +0 (vector lanes hold different
 * i, never different o): the same bits for every row count, thread count and level.  A work
 * block is columns [i0, i1) of every row; tiles of R rows x V vectors of columns, the last
 * vector masked. */
enum { COLI_DNT_IB = 64 };   /* columns per work block */

static void coli_dnt_portable(const float *x, const float *W, coli_idx O, coli_idx NI, coli_idx T,
                              coli_idx i0, coli_idx i1, float *y)
{
    float a[COLI_DNT_IB];
    coli_idx t, o, i, n = i1 - i0;
    for (t = 0; t < T; t++) {
        for (i = 0; i < n; i++)
            a[i] = 0.0f;
        for (o = 0; o < O; o++) {
            float xv = x[t * O + o];
            const float *wr = W + o * NI + i0;
            for (i = 0; i < n; i++)
                a[i] = fmaf(xv, wr[i], a[i]);
        }
        for (i = 0; i < n; i++)
            y[t * NI + i0 + i] = a[i];
    }
}

#if COLI_X86
/* AVX-512: R rows x 4 vectors of 16 columns (the last masked by m3), 16 zmm accumulators. */
COLI_T_AVX512 static void coli_dnt_tile512(const float *x, const float *W, coli_idx O,
                                           coli_idx NI, int R, int V, __mmask16 mlast, float *y)
{
    __m512 a[4][4];
    coli_idx o;
    int r, v;
    __mmask16 m[4];
    for (v = 0; v < 4; v++)
        m[v] = v < V - 1 ? (__mmask16)0xFFFF : v == V - 1 ? mlast : 0;
    for (r = 0; r < 4; r++)
        for (v = 0; v < 4; v++)
            a[r][v] = _mm512_setzero_ps();
    if (R == 4 && V == 4 && mlast == 0xFFFF) {
        for (o = 0; o < O; o++) {
            const float *wr = W + o * NI;
            __m512 w0 = _mm512_loadu_ps(wr), w1 = _mm512_loadu_ps(wr + 16);
            __m512 w2 = _mm512_loadu_ps(wr + 32), w3 = _mm512_loadu_ps(wr + 48);
#pragma GCC unroll 4
            for (r = 0; r < 4; r++) {
                __m512 xv = _mm512_set1_ps(x[r * O + o]);
                a[r][0] = _mm512_fmadd_ps(xv, w0, a[r][0]);
                a[r][1] = _mm512_fmadd_ps(xv, w1, a[r][1]);
                a[r][2] = _mm512_fmadd_ps(xv, w2, a[r][2]);
                a[r][3] = _mm512_fmadd_ps(xv, w3, a[r][3]);
            }
        }
    } else {
        for (o = 0; o < O; o++) {
            const float *wr = W + o * NI;
            __m512 wv[4];
            for (v = 0; v < V; v++)
                wv[v] = _mm512_maskz_loadu_ps(m[v], wr + 16 * v);
            for (r = 0; r < R; r++) {
                __m512 xv = _mm512_set1_ps(x[r * O + o]);
                for (v = 0; v < V; v++)
                    a[r][v] = _mm512_fmadd_ps(xv, wv[v], a[r][v]);
            }
        }
    }
    for (r = 0; r < R; r++)
        for (v = 0; v < V; v++)
            _mm512_mask_storeu_ps(y + r * NI + 16 * v, m[v], a[r][v]);
}

/* AVX2: R (<= 2) rows x 4 vectors of 8 columns, for each half of a 64-column block. */
COLI_T_AVX2 static void coli_dnt_tile256(const float *x, const float *W, coli_idx O, coli_idx NI,
                                         int R, coli_idx n, float *y)
{
    __m256 a[2][4];
    __m256i m[4];
    coli_idx o;
    int r, v, V = (int)((n + 7) / 8);
    for (v = 0; v < 4; v++)
        m[v] = coli_dn_mask8(n - 8 * v);
    for (r = 0; r < 2; r++)
        for (v = 0; v < 4; v++)
            a[r][v] = _mm256_setzero_ps();
    for (o = 0; o < O; o++) {
        const float *wr = W + o * NI;
        __m256 wv[4];
#pragma GCC unroll 4
        for (v = 0; v < 4; v++)
            wv[v] = v < V ? _mm256_maskload_ps(wr + 8 * v, m[v]) : _mm256_setzero_ps();
#pragma GCC unroll 2
        for (r = 0; r < 2; r++) {
            if (r < R) {
                __m256 xv = _mm256_broadcast_ss(x + r * O + o);
#pragma GCC unroll 4
                for (v = 0; v < 4; v++)
                    a[r][v] = _mm256_fmadd_ps(xv, wv[v], a[r][v]);
            }
        }
    }
    for (r = 0; r < R; r++)
        for (v = 0; v < V; v++)
            _mm256_maskstore_ps(y + r * NI + 8 * v, m[v], a[r][v]);
}
#endif

/* Columns [i0, i1) (i1 - i0 <= COLI_DNT_IB) of y [T][I] = x [T][O] @ W [O][I]. */
static void coli_dnt_block(int level, const float *x, const float *W, coli_idx O, coli_idx NI,
                           coli_idx T, coli_idx i0, coli_idx i1, float *y)
{
    int lv = coli_dn_level(level);
    coli_idx t, n = i1 - i0;
#if COLI_X86
    if (lv == COLI_AVX512) {
        int V = (int)((n + 15) / 16);
        coli_idx rem = n - 16 * (V - 1);
        __mmask16 ml = (__mmask16)(rem >= 16 ? 0xFFFF : (1u << rem) - 1);
        for (t = 0; t < T; t += 4)
            coli_dnt_tile512(x + t * O, W + i0, O, NI, T - t >= 4 ? 4 : (int)(T - t), V, ml,
                             y + t * NI + i0);
        return;
    }
    if (lv == COLI_AVX2) {
        coli_idx h;
        for (h = 0; h < n; h += 32)
            for (t = 0; t < T; t += 2)
                coli_dnt_tile256(x + t * O, W + i0 + h, O, NI, T - t >= 2 ? 2 : 1,
                                 n - h < 32 ? n - h : 32, y + t * NI + i0 + h);
        return;
    }
#endif
    coli_dnt_portable(x, W, O, NI, T, i0, i1, y);
}

#endif /* COLI_DENSE_H */
