/* Multi-head latent attention (DeepSeek-V3, GLM-5) for one decode position, absorbed form:
 *
 *   coli_q4t_cols / coli_q8t_cols: the transposed products y = x @ W of an int4 (group) / int8
 *     (per row) matrix W [O, I] (x [T, O] -> y [T, I]): a query taken into latent space through
 *     W_kb. Each output column is the sum over o = 0..O-1, in that order, of (x[o] * s[o, g]) *
 *     q[o, i] (int4: q = nibble - 8), one multiply and one add per term (no fused multiply-add),
 *     so every SIMD variant (portable, AVX2, AVX-512) gives the same bits, and a split of the
 *     columns between threads cannot change them either.
 *   coli_latent_*: attention of H query heads over the one key/value head of latent rows
 *     [S, D] (MQA: keys and values are the same rows); the output keeps the first Dv values of
 *     each head. Scores in coli_dot's order per (head, row) (coli_dots), softmax per head
 *     (coli_softmax_unnorm, then p / sum once per score), the weighted sum per (head, column)
 *     over rows in order: bits independent of the thread count (rows are split for the scores,
 *     heads for the softmax, columns for the sum). The rows are read once for all heads, a chunk
 *     at a time (a float16 cache is widened exactly, chunk by chunk).
 *   coli_mla_block: the whole block of one position in one parallel region (input norm, q-LoRA
 *     or q_proj, kv_a, the latent's norm, interleaved RoPE, the cache row, W_kb, attention, W_vb,
 *     o_proj, residual), every step the function the separate calls run (tests/test_mla_block.py).
 */
#ifndef COLI_MLA_BLOCK_H
#define COLI_MLA_BLOCK_H

#include <float.h>

#include "attention_block.h"

/* ---- transposed products ---------------------------------------------------------------------- */

#if COLI_X86
COLI_T_AVX512 static void coli_q4t_axpy_avx512(const uint8_t *wr, float c, float *y, coli_ix k0,
                                               coli_ix k1)
{
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m512i e8 = _mm512_set1_epi32(8);
    const __m512 cv = _mm512_set1_ps(c);
    coli_ix k;
    for (k = k0; k + 16 <= k1; k += 16) {
        __m128i b = _mm_loadl_epi64((const __m128i *)(wr + k / 2));
        __m128i il = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
        __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(il), e8));
        _mm512_storeu_ps(y + k, _mm512_add_ps(_mm512_loadu_ps(y + k), _mm512_mul_ps(cv, f)));
    }
    for (; k < k1; k++) {
        int q = (k & 1) ? wr[k >> 1] >> 4 : wr[k >> 1] & 15;
        y[k] = y[k] + c * (float)(q - 8);
    }
}

COLI_T_AVX2 static void coli_q4t_axpy_avx2(const uint8_t *wr, float c, float *y, coli_ix k0,
                                           coli_ix k1)
{
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m256i e8 = _mm256_set1_epi32(8);
    const __m256 cv = _mm256_set1_ps(c);
    coli_ix k;
    for (k = k0; k + 8 <= k1; k += 8) {
        int32_t raw;
        __m128i b, il;
        __m256 f;
        memcpy(&raw, wr + k / 2, 4);
        b = _mm_cvtsi32_si128(raw);
        il = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
        f = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(il), e8));
        _mm256_storeu_ps(y + k, _mm256_add_ps(_mm256_loadu_ps(y + k), _mm256_mul_ps(cv, f)));
    }
    for (; k < k1; k++) {
        int q = (k & 1) ? wr[k >> 1] >> 4 : wr[k >> 1] & 15;
        y[k] = y[k] + c * (float)(q - 8);
    }
}

COLI_T_AVX512 static void coli_q8t_axpy_avx512(const int8_t *wr, float c, float *y, coli_ix k0,
                                               coli_ix k1)
{
    const __m512 cv = _mm512_set1_ps(c);
    coli_ix k;
    for (k = k0; k + 16 <= k1; k += 16) {
        __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wr + k))));
        _mm512_storeu_ps(y + k, _mm512_add_ps(_mm512_loadu_ps(y + k), _mm512_mul_ps(cv, f)));
    }
    for (; k < k1; k++)
        y[k] = y[k] + c * (float)wr[k];
}

COLI_T_AVX2 static void coli_q8t_axpy_avx2(const int8_t *wr, float c, float *y, coli_ix k0,
                                           coli_ix k1)
{
    const __m256 cv = _mm256_set1_ps(c);
    coli_ix k;
    for (k = k0; k + 8 <= k1; k += 8) {
        __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wr + k))));
        _mm256_storeu_ps(y + k, _mm256_add_ps(_mm256_loadu_ps(y + k), _mm256_mul_ps(cv, f)));
    }
    for (; k < k1; k++)
        y[k] = y[k] + c * (float)wr[k];
}
#endif

/* y[k] += c * (nibble k of the row - 8) for columns k in [k0, k1), k0 even. */
static void coli_q4t_axpy(int level, const uint8_t *wr, float c, float *y, coli_ix k0, coli_ix k1)
{
    coli_ix k;
#if COLI_X86
    if (level == COLI_AVX512) {
        coli_q4t_axpy_avx512(wr, c, y, k0, k1);
        return;
    }
    if (level == COLI_AVX2) {
        coli_q4t_axpy_avx2(wr, c, y, k0, k1);
        return;
    }
#endif
    (void)level;
    for (k = k0; k < k1; k++) {
        int q = (k & 1) ? wr[k >> 1] >> 4 : wr[k >> 1] & 15;
        y[k] = y[k] + c * (float)(q - 8);
    }
}

static void coli_q8t_axpy(int level, const int8_t *wr, float c, float *y, coli_ix k0, coli_ix k1)
{
    coli_ix k;
#if COLI_X86
    if (level == COLI_AVX512) {
        coli_q8t_axpy_avx512(wr, c, y, k0, k1);
        return;
    }
    if (level == COLI_AVX2) {
        coli_q8t_axpy_avx2(wr, c, y, k0, k1);
        return;
    }
#endif
    (void)level;
    for (k = k0; k < k1; k++)
        y[k] = y[k] + c * (float)wr[k];
}

/* The levels the transposed products run at (NEON: the portable loop; same bits anyway). */
static int coli_qt_level(int level)
{
    return level == COLI_AVX512 || level == COLI_AVX2 ? level : COLI_PORTABLE;
}

/* y [T][NC] = x [T][O] @ W for the columns of groups [g0, g1) of an int4 W [O][ceil(NC/2)] bytes
 * with scales s [O][ng] (gs even). Each column: sum over o in order of (x[o] * s[o][g]) * (q - 8). */
static void coli_q4t_cols(int level, const uint8_t *w, const float *s, const float *x, coli_ix T,
                          coli_ix O, coli_ix NC, coli_ix gs, float *y, coli_ix g0, coli_ix g1)
{
    coli_ix nb = (NC + 1) / 2, ng = (NC + gs - 1) / gs, t, o, g, k;
    coli_ix c0 = g0 * gs, c1 = g1 * gs < NC ? g1 * gs : NC;
    int lv = coli_qt_level(level);
    for (t = 0; t < T; t++) {
        float *yt = y + t * NC;
        const float *xt = x + t * O;
        for (k = c0; k < c1; k++)
            yt[k] = 0.0f;
        for (o = 0; o < O; o++) {
            const uint8_t *wr = w + o * nb;
            const float *sr = s + o * ng;
            for (g = g0; g < g1; g++) {
                coli_ix a = g * gs, b = a + gs < NC ? a + gs : NC;
                coli_q4t_axpy(lv, wr, xt[o] * sr[g], yt, a, b);
            }
        }
    }
}

/* The same for an int8 W [O][NC] with per-row scales s [O], columns [c0, c1). */
static void coli_q8t_cols(int level, const int8_t *w, const float *s, const float *x, coli_ix T,
                          coli_ix O, coli_ix NC, float *y, coli_ix c0, coli_ix c1)
{
    coli_ix t, o, k;
    int lv = coli_qt_level(level);
    for (t = 0; t < T; t++) {
        float *yt = y + t * NC;
        const float *xt = x + t * O;
        for (k = c0; k < c1; k++)
            yt[k] = 0.0f;
        for (o = 0; o < O; o++)
            coli_q8t_axpy(lv, w + o * NC, xt[o] * s[o], yt, c0, c1);
    }
}

/* ---- attention over the latent rows (MQA) ------------------------------------------------------ */

enum { COLI_LAT_CHUNK = 64 };   /* rows read once for every head */

/* Rows [j0, j0 + n) of the cache as float32: the rows themselves, or (half) widened into buf. */
static const float *coli_latent_rows(const void *R, int half, coli_ix D, coli_ix j0, coli_ix n,
                                     float *buf, int avx2)
{
    if (!half)
        return (const float *)R + j0 * D;
    coli_h2f_rows((const uint16_t *)R + j0 * D, buf, n * D, avx2);
    return buf;
}

/* Scores of chunk c: p[h * S + j] = q_h . R[j] for its rows (coli_dot's bits). */
static void coli_latent_scores(const float *q, const void *R, int half, coli_ix H, coli_ix D,
                               coli_ix S, coli_ix c, float *p, float *buf, int avx2)
{
    coli_ix j0 = c * COLI_LAT_CHUNK, n = S - j0 < COLI_LAT_CHUNK ? S - j0 : COLI_LAT_CHUNK, h;
    const float *rows = coli_latent_rows(R, half, D, j0, n, buf, avx2);
    for (h = 0; h < H; h++)
        coli_dots(q + h * D, rows, n, D, p + h * S + j0, avx2);
}

/* Head h's scores become softmax weights: exp(scale * p - max) / sum, where a weight below
 * FLT_MIN (a denormal) counts as 0: x86 multiplies a denormal through a microcode assist (~100
 * cycles), which made the weighted sum of a 4096-position GLM-5 layer 5x slower with peaked
 * scores, and such a term is below float32's resolution of the sum it joins (the largest
 * weight is >= 1 / S). */
static void coli_latent_softmax(float *p, coli_ix S, float scale)
{
    coli_ix j;
    float sum = coli_softmax_unnorm(p, S, scale);
    for (j = 0; j < S; j++) {
        float w = p[j] / sum;
        p[j] = w >= FLT_MIN ? w : 0.0f;
    }
}

/* out[h][d] += p[h][j] * R[j][d] over rows j in order, columns [d0, d1) of each head (out
 * zeroed first): every (head, column) adds its rows in order, whoever runs it. */
static void coli_latent_sum(const float *p, const void *R, int half, coli_ix H, coli_ix D,
                            coli_ix Dv, coli_ix S, float *out, coli_ix d0, coli_ix d1, float *buf,
                            int avx2)
{
    coli_ix c, h, d, j;
    for (h = 0; h < H; h++)
        for (d = d0; d < d1; d++)
            out[h * Dv + d] = 0.0f;
    for (c = 0; c * COLI_LAT_CHUNK < S; c++) {
        coli_ix j0 = c * COLI_LAT_CHUNK, n = S - j0 < COLI_LAT_CHUNK ? S - j0 : COLI_LAT_CHUNK;
        const float *rows = coli_latent_rows(R, half, D, j0, n, buf, avx2);
        for (h = 0; h < H; h++) {
            const float *pw = p + h * S + j0;
            float *o = out + h * Dv;
#if COLI_X86
            if (avx2) {
                coli_weighted_cols_avx2(pw, rows, n, D, o, d0, d1);
                continue;
            }
#endif
            for (j = 0; j < n; j++)
                for (d = d0; d < d1; d++)
                    o[d] = o[d] + pw[j] * rows[j * D + d];
        }
    }
}

/* Columns [d0, d1) of Dv for part t of nt (multiples of 8). */
static void coli_latent_part(coli_ix Dv, int t, int nt, coli_ix *d0, coli_ix *d1)
{
    coli_ix blocks = (Dv + 7) / 8, a = blocks * t / nt, b = blocks * (t + 1) / nt;
    *d0 = a * 8 < Dv ? a * 8 : Dv;
    *d1 = b * 8 < Dv ? b * 8 : Dv;
}

/* Scratch floats coli_latent_* need: scores H * S, nt widening buffers. */
static size_t coli_latent_floats(coli_ix H, coli_ix D, coli_ix S, int half, int nt)
{
    return (size_t)coli_up16(H * S) + (half ? (size_t)nt * COLI_LAT_CHUNK * D : 0);
}

/* The three phases inside a parallel region of nt threads (every thread calls it). */
static void coli_latent_phases(const float *q, const void *R, int half, coli_ix H, coli_ix D,
                               coli_ix Dv, coli_ix S, float scale, float *out, float *p,
                               float *wide, int nt, int avx2)
{
    coli_ix c, h, nc = (S + COLI_LAT_CHUNK - 1) / COLI_LAT_CHUNK;
    int t;
    float *buf = wide + (half ? (coli_ix)coli_thread() * COLI_LAT_CHUNK * D : 0);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (c = 0; c < nc; c++)
        coli_latent_scores(q, R, half, H, D, S, c, p, buf, avx2);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (h = 0; h < H; h++)
        coli_latent_softmax(p + h * S, S, scale);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (t = 0; t < nt; t++) {
        coli_ix d0, d1;
        coli_latent_part(Dv, t, nt, &d0, &d1);
        coli_latent_sum(p, R, half, H, D, Dv, S, out, d0, d1, buf, avx2);
    }
}

/* The widening of a float16 chunk reads whole rows; the sum's columns of the rows only: the
 * phases with one thread give the same bits as with many (each value is computed alike). */
static void coli_attend_latent(const float *q, const void *R, int half, coli_ix H, coli_ix D,
                               coli_ix Dv, coli_ix S, float scale, float *out, float *work, int nt,
                               int level)
{
    int avx2 = coli_ops_avx2(level, D) && Dv % 8 == 0;
    float *p = work, *wide = work + coli_up16(H * S);
    if (nt < 2 || S * H * D < (coli_ix)1 << 16)
        nt = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt) if (nt > 1)
#endif
    coli_latent_phases(q, R, half, H, D, Dv, S, scale, out, p, wide, nt, avx2);
}

/* ---- the block --------------------------------------------------------------------------------- */

typedef struct {
    /* int4 matrices (packed rows, scales): q_a (NULL: plain q_proj in q), q (q_b or q_proj),
     * kv_a, kv_b, o */
    const uint8_t *wqa, *wq, *wkva, *wkvb, *wo;
    const float *sqa, *sq, *skva, *skvb, *so;
    const float *bqa, *bkva, *bo;       /* biases or NULL */
    const float *in_norm;               /* NULL: x is the normed input and no residual is added */
    const float *qa_norm, *kva_norm;
    float eps;                          /* the input norm's; the q_a / kv_a norms use 1e-6 */
    coli_ix gs, hidden, H, Q, rank, nope, rope, v;
} coli_mla_w;

#define COLI_LATENT_EPS 1e-6f

/* DeepSeek's RoPE of one vector of r values (cs / sn: the angles' cos / sin, first half used):
 * pairs in, halves out. */
static void coli_rope_interleaved(const float *x, const float *cs, const float *sn, coli_ix r,
                                  float *y)
{
    coli_ix i, half = r / 2;
    for (i = 0; i < half; i++) {
        float a = x[2 * i], b = x[2 * i + 1];
        y[i] = a * cs[i] - b * sn[i];
        y[half + i] = b * cs[i] + a * sn[i];
    }
}

static coli_ix coli_mla_D(const coli_mla_w *W)
{
    return W->rank + W->rope;
}

/* Floats of scratch coli_mla_block needs at S positions (64-byte aligned pieces). */
static size_t coli_mla_block_floats(const coli_mla_w *W, coli_ix S, int half, int nt)
{
    coli_ix H = W->H, D = coli_mla_D(W), qk = W->nope + W->rope;
    coli_xlay l;
    size_t n = (size_t)coli_up16(W->hidden) * 2 + coli_xlay_carve(NULL, W->hidden, W->gs, &l);
    n += coli_up16(W->Q) + coli_xlay_carve(NULL, W->Q > 0 ? W->Q : 1, W->gs, &l);
    n += coli_up16(D) + coli_up16(W->rope) + coli_up16(H * qk) + coli_up16(H * D) + coli_up16(H * W->rank);
    n += (size_t)H * coli_xlay_carve(NULL, W->rank, W->gs, &l) + coli_up16(H * W->v);
    n += coli_xlay_carve(NULL, H * W->v, W->gs, &l);
    return n + coli_latent_floats(H, D, S, half, nt);
}

/* x [hidden] -> out [hidden] (with in_norm: x + the block; without: o_proj's output of the
 * normed input x). R: the layer's latent cache, rows of rank + rope values (float32, or float16
 * when half); this position's row is written at pos and attention reads rows 0..pos. cs / sn:
 * the rotary angles of pos [rope]. work: coli_mla_block_floats(W, pos + 1, half, nt) floats.
 * i8: the int4 products (not the transposed ones) take the opt-in int8-activation path. */
static void coli_mla_block(const coli_mla_w *W, const float *x, const float *cs, const float *sn,
                           void *R, int half, coli_ix pos, float scale, float *out, int nt,
                           int level, int i8, float *work)
{
    const coli_ix H = W->H, D = coli_mla_D(W), qk = W->nope + W->rope, gs = W->gs;
    const coli_ix hid = W->hidden, rank = W->rank, Q = W->Q, V = W->v, S = pos + 1;
    const coli_ix Oq = H * qk, Okv = rank + W->rope, kvb_rows = W->nope + V;
    const coli_ix nbkvb = (rank + 1) / 2, ngkvb = (rank + gs - 1) / gs;
    const int lv = coli_q4_level(level, gs), cb = coli_q4_cb(level, gs);
    const int avx2 = coli_ops_avx2(level, D) && rank % 8 == 0;
    coli_xlay in1, inq, ino, l;
    coli_ix per_head, rb1, rbq, rbv, rbo, n1a, n1, nq, nv, no, i;
    float *hn = work, *yo = hn + coli_up16(hid), *l1 = yo + coli_up16(hid);
    float *qa = l1 + coli_xlay_carve(l1, hid, gs, &in1), *lq = qa + coli_up16(Q);
    float *kv = lq + coli_xlay_carve(lq, Q > 0 ? Q : 1, gs, &inq), *rot = kv + coli_up16(D);
    float *q = rot + coli_up16(W->rope);
    float *qq = q + coli_up16(H * qk), *olat = qq + coli_up16(H * D);
    float *lh = olat + coli_up16(H * rank), *vo, *lo, *p, *wide;
    per_head = coli_xlay_carve(NULL, rank, gs, &l);
    vo = lh + H * per_head;
    lo = vo + coli_up16(H * V);
    p = lo + coli_xlay_carve(lo, H * V, gs, &ino);
    wide = p + coli_up16(H * S);
    /* row blocks: q_a (or q_proj) and kv_a from the normed x; q_b; W_vb per head; o */
    rb1 = coli_decode_rows((Q > 0 ? Q : Oq) + Okv, nt);
    n1a = ((Q > 0 ? Q : Oq) + rb1 - 1) / rb1;
    n1 = n1a + (Okv + rb1 - 1) / rb1;
    rbq = coli_decode_rows(Oq, nt);
    nq = Q > 0 ? (Oq + rbq - 1) / rbq : 0;
    rbv = coli_decode_rows(V, nt);
    nv = H * ((V + rbv - 1) / rbv);
    rbo = coli_decode_rows(hid, nt);
    no = (hid + rbo - 1) / rbo;
    if (nt < 2)
        nt = 1;

    if (W->in_norm != NULL)
        coli_rms_norm(x, W->in_norm, hn, 1, hid, W->eps);
    else
        memcpy(hn, x, sizeof(float) * (size_t)hid);
    coli_xlay_prep(i8, cb, hn, hid, gs, &in1);
#ifdef _OPENMP
#pragma omp parallel num_threads(nt) if (nt > 1)
#endif
    {
        coli_ix b, h;
#ifdef _OPENMP
#pragma omp for schedule(dynamic)
#endif
        for (b = 0; b < n1; b++) {
            if (b < n1a) {
                coli_ix O1 = Q > 0 ? Q : Oq, r0 = b * rb1, r1 = r0 + rb1 < O1 ? r0 + rb1 : O1;
                coli_xlay_rows(i8, lv, Q > 0 ? W->wqa : W->wq, Q > 0 ? W->sqa : W->sq, &in1,
                               Q > 0 ? qa : q, r0, r1, O1, hid, gs);
            } else {
                coli_ix r0 = (b - n1a) * rb1, r1 = r0 + rb1 < Okv ? r0 + rb1 : Okv;
                coli_xlay_rows(i8, lv, W->wkva, W->skva, &in1, kv, r0, r1, Okv, hid, gs);
            }
        }
#ifdef _OPENMP
#pragma omp single
#endif
        {
            coli_ix j;
            if (W->bkva != NULL)
                for (j = 0; j < Okv; j++)
                    kv[j] = kv[j] + W->bkva[j];
            if (Q > 0) {
                if (W->bqa != NULL)
                    for (j = 0; j < Q; j++)
                        qa[j] = qa[j] + W->bqa[j];
                coli_rms_norm(qa, W->qa_norm, qa, 1, Q, COLI_LATENT_EPS);
                coli_xlay_prep(i8, cb, qa, Q, gs, &inq);
            }
            /* the latent row: normed latent, roped key; written into the cache */
            coli_rms_norm(kv, W->kva_norm, kv, 1, rank, COLI_LATENT_EPS);
            coli_rope_interleaved(kv + rank, cs, sn, W->rope, rot);
            memcpy(kv + rank, rot, sizeof(float) * (size_t)W->rope);
            if (half)
                for (j = 0; j < D; j++)
                    ((uint16_t *)R)[pos * D + j] = coli_f2h(kv[j]);
            else
                memcpy((float *)R + pos * D, kv, sizeof(float) * (size_t)D);
        }
        if (Q > 0) {
#ifdef _OPENMP
#pragma omp for schedule(dynamic)
#endif
            for (b = 0; b < nq; b++) {
                coli_ix r0 = b * rbq, r1 = r0 + rbq < Oq ? r0 + rbq : Oq;
                coli_xlay_rows(i8, lv, W->wq, W->sq, &inq, q, r0, r1, Oq, Q, gs);
            }
        }
        /* per head: the query into latent space (W_kb), its roped tail */
#ifdef _OPENMP
#pragma omp for schedule(dynamic)
#endif
        for (h = 0; h < H; h++) {
            const coli_ix r0 = h * kvb_rows;
            coli_q4t_cols(level, W->wkvb + r0 * nbkvb, W->skvb + r0 * ngkvb, q + h * qk, 1,
                          W->nope, rank, gs, qq + h * D, 0, ngkvb);
            coli_rope_interleaved(q + h * qk + W->nope, cs, sn, W->rope, qq + h * D + rank);
        }
        coli_latent_phases(qq, R, half, H, D, rank, S, scale, olat, p, wide, nt, avx2);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (h = 0; h < H; h++) {
            coli_xlay lay;
            coli_xlay_carve(lh + h * per_head, rank, gs, &lay);
            coli_xlay_prep(i8, cb, olat + h * rank, rank, gs, &lay);
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic)
#endif
        for (b = 0; b < nv; b++) {
            coli_ix per = (V + rbv - 1) / rbv, hh = b / per, r0 = (b % per) * rbv;
            coli_ix r1 = r0 + rbv < V ? r0 + rbv : V, w0 = hh * kvb_rows + W->nope;
            coli_xlay lay;
            coli_xlay_carve(lh + hh * per_head, rank, gs, &lay);
            coli_xlay_rows(i8, lv, W->wkvb + w0 * nbkvb, W->skvb + w0 * ngkvb, &lay, vo + hh * V,
                           r0, r1, V, rank, gs);
        }
#ifdef _OPENMP
#pragma omp single
#endif
        coli_xlay_prep(i8, cb, vo, H * V, gs, &ino);
#ifdef _OPENMP
#pragma omp for schedule(dynamic)
#endif
        for (b = 0; b < no; b++) {
            coli_ix r0 = b * rbo, r1 = r0 + rbo < hid ? r0 + rbo : hid;
            coli_xlay_rows(i8, lv, W->wo, W->so, &ino, yo, r0, r1, hid, H * V, gs);
        }
    }
    for (i = 0; i < hid; i++) {
        float y = W->bo != NULL ? yo[i] + W->bo[i] : yo[i];
        out[i] = W->in_norm != NULL ? x[i] + y : y;
    }
}

#endif
