/* Prefill int4 products of many rows: y = x @ dequant(W).T as a register-tiled GEMM that
 * dequantizes W a panel at a time (cython_kernels/prefill.pxi, core.kernels.prefill_many).
 *
 * Why: a MoE layer's prefill multiplies each routed expert by the few dozen tokens routed to it
 * (512 tokens x top-8 of 64: ~64 rows per expert).  Dequantizing each expert to a float32 matrix
 * (8 MB) and handing it to OpenBLAS's sgemm costs a pass over memory per matrix, single-threaded
 * unpacking, and an sgemm call per matrix whose thread pool fights the kernels' OpenMP team.
 * Here one OpenMP region runs every matrix of the call; each work block dequantizes a panel of
 * its weight rows into a small buffer (the exact values of core.quant.dequantize_int4, with
 * qkern.h's group functions) and multiplies it by the tokens while it is in L1/L2.
 *
 * Numerics (the same bits on every variant, thread count and grouping): each output is one
 * fused multiply-add chain over k in order,
 *     acc = +0;  for k = 0 .. cols-1:  acc = fma(x[t][k], w[o][k], acc);  y[t][o] = acc
 * with w[o][k] = (nibble - 8) * s[o][k / gs] rounded to float32 (one rounding, as the
 * dequantized matrix).  Vector lanes hold different tokens (never different k), the chain passes
 * through memory between k panels (no rounding there), and the portable variant calls fmaf, so
 * portable, AVX2 and AVX-512 agree bit for bit (tests/test_prefill.py).  NEON runs the portable
 * loops (fmaf is a single fmadd there).  These are not the bits of the decode kernels (qkern.h)
 * nor of sgemm: which path a product takes depends on its row count alone.
 *
 * Layout: the tokens of a span (t0, n) are transposed once per call into xt[k][np] (np = n
 * rounded up to 16, zero padded), so that a vector holds 16 tokens at one k; a tile is V such
 * vectors times NO outputs in registers (AVX-512: 4x6, 3x8, 2x12, 1x16; AVX2: one vector as two
 * halves x 6; portable: 16 lanes x 4), broadcasting w[o][k] from the panel. */
#ifndef COLI_PREFILL_H
#define COLI_PREFILL_H

#include <math.h>
#include "qkern.h"

enum { COLI_PF_TV = 16 };    /* tokens per xt vector */
enum { COLI_PF_OB = 48 };    /* outputs per work block (a multiple of every tile's NO) */
enum { COLI_PF_KC = 128 };   /* k per panel (rounded up to whole groups) */

static coli_idx coli_pf_np(coli_idx n)
{
    return (n + COLI_PF_TV - 1) / COLI_PF_TV * COLI_PF_TV;
}

static coli_idx coli_pf_kc(coli_idx gs)
{
    return (COLI_PF_KC + gs - 1) / gs * gs;
}

/* Scratch floats per thread for spans of at most np tokens: the panel and the accumulators. */
static size_t coli_pf_scratch_floats(coli_idx gs, coli_idx np)
{
    return (size_t)(COLI_PF_OB * coli_pf_kc(gs) + COLI_PF_OB * np + 32);
}

/* Token vectors per tile starting at vector tv of nv (tiles of 4, and 5 as 3 + 2): the layout of
 * xt, the same for every level. */
static int coli_pf_tile_v(coli_idx nv, coli_idx tv)
{
    coli_idx rem = nv - tv;
    return rem == 5 ? 3 : rem >= 4 ? 4 : (int)rem;
}

/* xt holds each tile of V token vectors (16 V tokens from token 16 tv) as its own [cols][16 V]
 * block at xt + 16 tv cols, so a tile reads one contiguous stream (a [k][np] layout put the
 * vectors of one tile 4 * np bytes apart: at np = 512 they fell into 8 L1 sets and the kernel ran
 * at a quarter of its speed).  Zero past the n tokens.  Columns [k0, k1) of every tile. */
static void coli_pf_pack(const float *x, coli_idx ldx, coli_idx n, coli_idx np, coli_idx k0,
                         coli_idx k1, float *xt, coli_idx cols)
{
    coli_idx nv = np / COLI_PF_TV, tv, j, k;
    for (tv = 0; tv < nv; tv += coli_pf_tile_v(nv, tv)) {
        coli_idx ts = COLI_PF_TV * coli_pf_tile_v(nv, tv), t0 = COLI_PF_TV * tv;
        float *d = xt + t0 * cols;
        coli_idx real = n - t0 < ts ? n - t0 : ts;
        /* k outer: the writes run contiguously and the ts rows being read stay in L1 (the other
         * order wrote a cache line per element) */
        for (k = k0; k < k1; k++) {
            const float *xk = x + t0 * ldx + k;
            float *dk = d + k * ts;
            for (j = 0; j < real; j++)
                dk[j] = xk[j * ldx];
            for (; j < ts; j++)
                dk[j] = 0.0f;
        }
    }
}

/* P[o * kc + (k - k0)] = w[o0 + o][k] for o < no, k in [k0, k0 + kn); k0 is a multiple of gs. */
static void coli_pf_panel(int lv, const uint8_t *w, const float *s, coli_idx nb, coli_idx ng,
                          coli_idx gs, coli_idx cols, coli_idx o0, coli_idx no, coli_idx k0,
                          coli_idx kn, coli_idx kc, float *P)
{
    coli_idx o, g, g0 = k0 / gs, g1 = (k0 + kn + gs - 1) / gs;
    (void)lv;
    for (o = 0; o < no; o++) {
        const uint8_t *wr = w + (o0 + o) * nb;
        const float *sr = s + (o0 + o) * ng;
        for (g = g0; g < g1; g++) {
            coli_idx e0 = g * gs, m = e0 + gs < cols ? gs : cols - e0;    /* e0 is even */
#if COLI_X86
            if (lv == COLI_AVX2 || lv == COLI_AVX512) {
                coli_q4_dequant_group_avx2(wr + e0 / 2, P + o * kc + (e0 - k0), m, sr[g]);
                continue;
            }
#endif
            coli_q4_dequant_group_portable(wr + e0 / 2, P + o * kc + (e0 - k0), m, sr[g]);
        }
    }
}

/* ---- tiles: C[o * np + j] (o < NO, j < 16 V) continues its chain over kn steps of k; token j of
 * step k is xt[k * ts + j] (ts: the tile block's row of 16 V tokens) ----------------------------- */

/* Portable: 16 token lanes x NO outputs, fmaf. */
static void coli_pf_tile_portable(const float *xt, coli_idx ts, coli_idx np, const float *P,
                                  coli_idx kc, coli_idx kn, float *C, coli_idx no, int first)
{
    enum { NO = 4 };
    float a[NO][COLI_PF_TV];
    coli_idx k;
    int o, j;
    for (o = 0; o < no; o++)
        for (j = 0; j < COLI_PF_TV; j++)
            a[o][j] = first ? 0.0f : C[o * np + j];
    for (k = 0; k < kn; k++) {
        const float *xv = xt + k * ts;
        for (o = 0; o < no; o++) {
            float b = P[o * kc + k];
            for (j = 0; j < COLI_PF_TV; j++)
                a[o][j] = fmaf(xv[j], b, a[o][j]);
        }
    }
    for (o = 0; o < no; o++)
        for (j = 0; j < COLI_PF_TV; j++)
            C[o * np + j] = a[o][j];
}

#if COLI_X86
/* AVX2: one 16-token vector as two 8-lane halves x 6 outputs (12 accumulators). */
COLI_T_AVX2 static void coli_pf_tile_avx2_6(const float *xt, coli_idx ts, coli_idx np, const float *P,
                                            coli_idx kc, coli_idx kn, float *C, int first)
{
    __m256 a0[6], a1[6];
    coli_idx k;
    int o;
#pragma GCC unroll 6
    for (o = 0; o < 6; o++) {
        a0[o] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(C + o * np);
        a1[o] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(C + o * np + 8);
    }
    for (k = 0; k < kn; k++) {
        __m256 x0 = _mm256_loadu_ps(xt + k * ts), x1 = _mm256_loadu_ps(xt + k * ts + 8);
#pragma GCC unroll 6
        for (o = 0; o < 6; o++) {
            __m256 b = _mm256_broadcast_ss(P + o * kc + k);
            a0[o] = _mm256_fmadd_ps(x0, b, a0[o]);
            a1[o] = _mm256_fmadd_ps(x1, b, a1[o]);
        }
    }
#pragma GCC unroll 6
    for (o = 0; o < 6; o++) {
        _mm256_storeu_ps(C + o * np, a0[o]);
        _mm256_storeu_ps(C + o * np + 8, a1[o]);
    }
}

COLI_T_AVX2 static void coli_pf_tile_avx2_1(const float *xt, coli_idx ts, coli_idx np, const float *P,
                                            coli_idx kc, coli_idx kn, float *C, int first)
{
    __m256 a0 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(C);
    __m256 a1 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(C + 8);
    coli_idx k;
    (void)kc;
    for (k = 0; k < kn; k++) {
        __m256 b = _mm256_broadcast_ss(P + k);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xt + k * ts), b, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xt + k * ts + 8), b, a1);
    }
    _mm256_storeu_ps(C, a0);
    _mm256_storeu_ps(C + 8, a1);
}

/* AVX-512: V 16-token vectors x NO outputs. */
#define COLI_PF_TILE512(V, NO)                                                                    \
    COLI_T_AVX512 static void coli_pf_tile512_##V##_##NO(const float *xt, coli_idx np,           \
                                                         const float *P, coli_idx kc,            \
                                                         coli_idx kn, float *C, int first)       \
    {                                                                                             \
        __m512 a[NO][V];                                                                          \
        coli_idx k;                                                                               \
        int o, v;                                                                                 \
        _Pragma("GCC unroll 16") for (o = 0; o < NO; o++)                                         \
            _Pragma("GCC unroll 4") for (v = 0; v < V; v++)                                       \
                a[o][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(C + o * np + 16 * v);     \
        for (k = 0; k < kn; k++) {                                                                \
            __m512 xv[V];                                                                         \
            _Pragma("GCC unroll 4") for (v = 0; v < V; v++)                                       \
                xv[v] = _mm512_loadu_ps(xt + k * (16 * V) + 16 * v);                                    \
            _Pragma("GCC unroll 16") for (o = 0; o < NO; o++) {                                   \
                __m512 b = _mm512_set1_ps(P[o * kc + k]);                                         \
                _Pragma("GCC unroll 4") for (v = 0; v < V; v++)                                   \
                    a[o][v] = _mm512_fmadd_ps(xv[v], b, a[o][v]);                                 \
            }                                                                                     \
        }                                                                                         \
        _Pragma("GCC unroll 16") for (o = 0; o < NO; o++)                                         \
            _Pragma("GCC unroll 4") for (v = 0; v < V; v++)                                       \
                _mm512_storeu_ps(C + o * np + 16 * v, a[o][v]);                                   \
    }
COLI_PF_TILE512(4, 6)
COLI_PF_TILE512(3, 8)
COLI_PF_TILE512(2, 12)
COLI_PF_TILE512(1, 16)
COLI_PF_TILE512(4, 1)
COLI_PF_TILE512(3, 1)
COLI_PF_TILE512(2, 1)
COLI_PF_TILE512(1, 1)
#endif

#if COLI_X86
/* Outputs per AVX-512 tile of V vectors. */
static int coli_pf_no512(int V)
{
    return V == 4 ? 6 : V == 3 ? 8 : V == 2 ? 12 : 16;
}

COLI_T_AVX512 static void coli_pf_tiles512(int V, const float *xt, coli_idx np, const float *P,
                                           coli_idx kc, coli_idx kn, float *C, coli_idx no,
                                           int first)
{
    int NO = coli_pf_no512(V);
    coli_idx o = 0;
    for (; o + NO <= no; o += NO) {
        const float *Po = P + o * kc;
        float *Co = C + o * np;
        if (V == 4)
            coli_pf_tile512_4_6(xt, np, Po, kc, kn, Co, first);
        else if (V == 3)
            coli_pf_tile512_3_8(xt, np, Po, kc, kn, Co, first);
        else if (V == 2)
            coli_pf_tile512_2_12(xt, np, Po, kc, kn, Co, first);
        else
            coli_pf_tile512_1_16(xt, np, Po, kc, kn, Co, first);
    }
    for (; o < no; o++) {
        const float *Po = P + o * kc;
        float *Co = C + o * np;
        if (V == 4)
            coli_pf_tile512_4_1(xt, np, Po, kc, kn, Co, first);
        else if (V == 3)
            coli_pf_tile512_3_1(xt, np, Po, kc, kn, Co, first);
        else if (V == 2)
            coli_pf_tile512_2_1(xt, np, Po, kc, kn, Co, first);
        else
            coli_pf_tile512_1_1(xt, np, Po, kc, kn, Co, first);
    }
}
#endif

/* The level whose tiles run: AVX-512, AVX2, or the portable loops (also NEON's, where fmaf is
 * one instruction; the same bits). */
static int coli_pf_level(int level)
{
    return level == COLI_AVX512 || level == COLI_AVX2 || (level == COLI_NEON && COLI_ARM)
               ? level : COLI_PORTABLE;
}

/* One work block: outputs [o0, o1) (o1 - o0 <= COLI_PF_OB) of y[j * ldy + o] for the n tokens
 * of xt (a span packed by coli_pf_pack over all cols).  scratch: coli_pf_scratch_floats. */
static void coli_pf_block(int level, const float *xt, coli_idx n, coli_idx np, const uint8_t *w,
                          const float *s, coli_idx cols, coli_idx gs, coli_idx o0, coli_idx o1,
                          float *y, coli_idx ldy, float *scratch)
{
    int lv = coli_pf_level(level);
    coli_idx nb = (cols + 1) / 2, ng = (cols + gs - 1) / gs, kc = coli_pf_kc(gs);
    coli_idx no = o1 - o0, nv = np / COLI_PF_TV, k0, j, o;
    float *P = scratch, *C = scratch + COLI_PF_OB * kc;
    for (k0 = 0; k0 < cols; k0 += kc) {
        coli_idx kn = k0 + kc < cols ? kc : cols - k0, tv;
        int first = k0 == 0, V, v;
        coli_pf_panel(lv, w, s, nb, ng, gs, cols, o0, no, k0, kn, kc, P);
        for (tv = 0; tv < nv; tv += V) {
            coli_idx ts;
            const float *xk;
            V = coli_pf_tile_v(nv, tv);
            ts = COLI_PF_TV * V;
            xk = xt + COLI_PF_TV * tv * cols + k0 * ts;       /* the tile's block, from step k0 */
#if COLI_X86
            if (lv == COLI_AVX512) {
                coli_pf_tiles512(V, xk, np, P, kc, kn, C + COLI_PF_TV * tv, no, first);
                continue;
            }
#endif
            for (v = 0; v < V; v++) {
                const float *xv = xk + COLI_PF_TV * v;
                float *Cv = C + COLI_PF_TV * (tv + v);
#if COLI_X86
                if (lv == COLI_AVX2) {
                    for (o = 0; o + 6 <= no; o += 6)
                        coli_pf_tile_avx2_6(xv, ts, np, P + o * kc, kc, kn, Cv + o * np, first);
                    for (; o < no; o++)
                        coli_pf_tile_avx2_1(xv, ts, np, P + o * kc, kc, kn, Cv + o * np, first);
                    continue;
                }
#endif
                for (o = 0; o < no; o += 4)
                    coli_pf_tile_portable(xv, ts, np, P + o * kc, kc, kn, Cv + o * np,
                                          no - o < 4 ? no - o : 4, first);
            }
        }
    }
    for (j = 0; j < n; j++)
        for (o = 0; o < no; o++)
            y[j * ldy + o0 + o] = C[o * np + j];
}

/* The MoE block's prefill sum for one token: out[j] = y[slot[0]][j] * w[0] + y[slot[1]][j] * w[1]
 * + ... in rank order, each product and each sum rounded on its own (no fused multiply-add:
 * -ffp-contract=off) -- the values of numpy's contrib = y * w then add.reduce over the ranks,
 * without the [T, k, H] array in between. */
static void coli_pf_rank_combine(const float *y, coli_idx H, const int64_t *slot, const float *w,
                                 coli_idx k, float *out)
{
    coli_idx r, j;
    const float *y0 = y + slot[0] * H;
    float w0 = w[0];
    for (j = 0; j < H; j++)
        out[j] = y0[j] * w0;
    for (r = 1; r < k; r++) {
        const float *yr = y + slot[r] * H;
        float wr = w[r];
        for (j = 0; j < H; j++)
            out[j] = out[j] + yr[j] * wr;
    }
}

#endif /* COLI_PREFILL_H */
