/* One decode position's attention block of one layer, in one call:
 *   out = x + o(attend(rope(norm(q, k)), cache) ...) with q, k, v = proj(rms_norm(x)).
 *
 * Why: as separate calls a layer ran ~15 numpy / Python operations between its four matrix
 * products (biases, q/k norms, reshapes, two rotary calls, the KV append's strided copies,
 * attention's and the products' argument checks and output arrays), and the second OpenMP thread
 * went to sleep in those gaps, so the next product started with one thread while the other woke
 * (benchmarks/README.md, sessions 5-6). Here q/k/v and o run in one parallel region with the
 * small operations in between on one thread (`omp single`), and nothing returns to Python.
 *
 * Optionally the MoE router that follows (post-attention norm, logits, softmax top-k).
 *
 * Gated attention (Qwen3.5 / 3.6, W->gated): q's product has 2 H D rows, per head [q_h | gate_h];
 * the gate rows are set apart after the bias and the attention output is multiplied by
 * sigmoid(gate) (coli_sigmoid_gate, which the one-position step path calls too) before o.
 *
 * Same bits as the separate calls: every piece is the function those calls run (coli_q4_rows per
 * output row, coli_rms_norm, coli_rope, coli_attend_group[_h], coli_sigmoid_gate,
 * coli_matvec_rows, coli_softmax_topk), in the same order, float32 adds for the biases and the
 * residual (numpy's), and numpy's rounding for a float16 cache's new row (coli_f2h). Int4
 * projections with one group size only; callers fall back to the separate calls otherwise.
 */
#ifndef COLI_ATTENTION_BLOCK_H
#define COLI_ATTENTION_BLOCK_H

#include <math.h>
#include <string.h>

#include "layer_ops.h"

enum { COLI_QK_NONE = 0, COLI_QK_FULL = 1, COLI_QK_PER_HEAD = 2 };

/* A layer's attention weights (q, k, v, o in that order). */
typedef struct {
    const uint8_t *w[4];        /* packed int4 rows */
    const float *s[4];          /* per-group scales */
    const float *bias[4];       /* NULL: no bias */
    const float *in_norm;       /* [hidden] */
    const float *q_norm, *k_norm;   /* [H * D] / [KV * D] (full) or [D] (per head) */
    int qk_norm;                /* COLI_QK_* */
    float eps;
    float clip;                 /* < 0: no clipping */
    coli_ix gs, hidden, H, KV, D;
    coli_ix R;                  /* RoPE turns the first R of each head's D dims (GLM-4.5: D / 2) */
    /* the MoE router that follows (router == NULL: none): h = rms_norm(out, post_norm), then
     * its softmax top-k over E experts */
    const float *post_norm, *router;
    coli_ix E, top_k;
    int norm_topk;
    int gated;                  /* q rows per head [q_h | gate_h]; output * sigmoid(gate) */
} coli_attn_w;

/* y[i] = y[i] * sigmoid(g[i]) as numpy's out * (1 / (1 + exp(-gate))) in float32, with libm's
 * expf: gated attention's output gate. The block and the one-position step path (qmatmul's
 * sigmoid_gate) both call this, since numpy's exp has bits of its own. */
static void coli_sigmoid_gate(float *y, const float *g, coli_ix n)
{
    coli_ix i;
    for (i = 0; i < n; i++) {
        float t = expf(-g[i]);
        t = 1.0f + t;
        y[i] = y[i] * (1.0f / t);
    }
}

static coli_ix coli_up16(coli_ix n)
{
    return (n + 15) / 16 * 16;
}

/* An input of the block's int4 products laid out for the kernels: the float path's (xp, gi), or
 * the opt-in int8-activation path's (xq, xd, xc) -- what qmatmul's _q4_run / _q4i8_run prepare. */
typedef struct {
    float *xp, *gi, *xd;
    int8_t *xq;
    int32_t *xc;
} coli_xlay;

/* Floats a layout for `cols` inputs takes (64-byte aligned pieces); with at != NULL, carve it
 * from there. */
static coli_ix coli_xlay_carve(float *at, coli_ix cols, coli_ix gs, coli_xlay *l)
{
    coli_ix ng = (cols + gs - 1) / gs, L = ng * gs, d8 = L / 64 * 8;
    coli_ix nxp = coli_up16(L), ngi = coli_up16(ng * coli_q4_gstride(gs));
    coli_ix nxq = coli_up16((L + 64 + 3) / 4), nd = coli_up16(d8);
    if (at != NULL) {
        l->xp = at;
        l->gi = at + nxp;
        l->xq = (int8_t *)(at + nxp + ngi);
        l->xd = at + nxp + ngi + nxq;
        l->xc = (int32_t *)(at + nxp + ngi + nxq + nd);
    }
    return nxp + ngi + nxq + 2 * nd;
}

static void coli_xlay_prep(int i8, int cb, const float *x, coli_ix cols, coli_ix gs,
                           const coli_xlay *l)
{
    coli_ix ng = (cols + gs - 1) / gs;
    if (i8)
        coli_q4i8_prep(x, 1, cols, ng * gs, l->xq, l->xd, l->xc);
    else
        coli_q4_prep(cb, x, 1, cols, gs, ng, l->xp, l->gi);
}

/* Output rows [r0, r1) of one int4 product of the block (O rows of `cols` inputs). */
static void coli_xlay_rows(int i8, int lv, const uint8_t *w, const float *s, const coli_xlay *l,
                           float *y, coli_ix r0, coli_ix r1, coli_ix O, coli_ix cols, coli_ix gs)
{
    coli_ix ng = (cols + gs - 1) / gs, nb = (cols + 1) / 2;
    if (i8)
        coli_q4i8_rows(w, s, l->xq, l->xd, l->xc, y, r0, r1, 1, O, nb, ng, gs);
    else
        coli_q4_rows(lv, w, s, l->xp, l->gi, y, NULL, r0, r1, 1, O, nb, ng, gs);
}

/* Floats of scratch coli_attention_block needs at S cache positions (64-byte aligned pieces);
 * half: a float16 cache (nt threads widen it into buffers of their own). */
static size_t coli_attention_block_floats(const coli_attn_w *W, coli_ix S, int half, int nt)
{
    coli_ix HD = W->H * W->D;
    coli_xlay l;
    return (size_t)(coli_up16(W->hidden) * 2 + coli_xlay_carve(NULL, W->hidden, W->gs, &l)
                    + coli_up16(HD + 2 * W->KV * W->D) + coli_up16(HD)
                    + coli_xlay_carve(NULL, HD, W->gs, &l) + coli_up16(W->H * S)
                    + 2 * coli_up16(W->E) + (W->gated ? coli_up16(3 * HD) : 0)
                    + (half ? (coli_ix)nt * COLI_KV_CHUNK * W->D : 0));
}

static int coli_thread(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Work item it of one position's attention as coli_attend_one deals them (split parts per kv
 * head, coli_attend_split): query heads [h0, h1) of kv head it / split in one pass over its K /
 * V (coli_attend_group, or its float16-cache form with buf: its widening buffer); with gate !=
 * NULL, then times sigmoid(gate) (the step path's separate pass over the whole output, a group at
 * a time here: the same bits). */
static void coli_attend_block_item(const float *q, const void *K, const void *V, coli_ix ks,
                                   coli_ix vs, int half, coli_ix it, coli_ix split, coli_ix G,
                                   coli_ix D, coli_ix lo, coli_ix S, float scale, float *p,
                                   coli_ix n, float *buf, float *att, int level,
                                   const float *gate)
{
    coli_ix g = it / split, s = it % split;
    coli_ix h0 = g * G + s * G / split, h1 = g * G + (s + 1) * G / split;
    if (half)
        coli_attend_group_h(q + h0 * D, (const uint16_t *)K + g * ks,
                            (const uint16_t *)V + g * vs, h1 - h0, D, lo, S, scale, p + h0 * n,
                            buf, att + h0 * D, level);
    else
        coli_attend_group(q + h0 * D, (const float *)K + g * ks, (const float *)V + g * vs,
                          h1 - h0, D, lo, S, scale, p + h0 * n, att + h0 * D, level);
    if (gate != NULL)
        coli_sigmoid_gate(att + h0 * D, gate + h0 * D, (h1 - h0) * D);
}

/* x [hidden] -> out [hidden]; with a router also h [hidden] (the post-attention norm of out),
 * top [top_k] and wts [top_k] (coli_softmax_topk's). K / V: the layer's cache, kv head g's
 * positions at K + g * ks (rows of D values); this position's key and value are written at row
 * pos, and attention reads rows lo..pos. cs / sn: the rotary cos / sin of pos [D]. work:
 * coli_attention_block_floats(W, pos + 1, half, nt) floats, 64-byte aligned. nt: threads (at
 * most). level: qkern.h's SIMD level. half: K / V are float16 (uint16_t; ks / vs
 * in halves): this position's key and value are rounded as numpy's astype(float16) does, and
 * attention widens the cache exactly (coli_attend_group_h). i8: the products take the opt-in
 * int8-activation path (qkern.h coli_q4i8_*; callers check coli_q4i8_ok). */
static void coli_attention_block(const coli_attn_w *W, const float *x, const float *cs,
                                 const float *sn, void *K, void *V, coli_ix ks, coli_ix vs,
                                 int half, coli_ix pos, coli_ix lo, float scale, float *out,
                                 float *h, int64_t *top, float *wts, int nt, int level, int i8,
                                 float *work)
{
    const coli_ix H = W->H, KV = W->KV, D = W->D, HD = H * D, gs = W->gs, hid = W->hidden;
    const coli_ix S = pos + 1, n = S - lo, G = H / KV;
    const int lv = coli_q4_level(level, gs), cb = coli_q4_cb(level, gs);
    coli_xlay in1, in2;     /* the inputs of q/k/v (the normed x) and of o (the attention) */
    float *hn = work, *yo = hn + coli_up16(hid), *l1 = yo + coli_up16(hid);
    float *qkv = l1 + coli_xlay_carve(l1, hid, gs, &in1), *att = qkv + coli_up16(HD + 2 * KV * D);
    float *l2 = att + coli_up16(HD), *p = l2 + coli_xlay_carve(l2, HD, gs, &in2);
    float *logits = p + coli_up16(H * S), *probs = logits + coli_up16(W->E);
    float *wide = probs + coli_up16(W->E);     /* half: COLI_KV_CHUNK * D floats per thread */
    float *q = qkv, *k = qkv + HD, *v = k + KV * D;
    /* gated: q's product [H, 2, D] lands in qg, then splits into q and gate */
    float *gate = W->gated ? wide + (half ? (coli_ix)nt * COLI_KV_CHUNK * D : 0) : NULL;
    float *qg = W->gated ? gate + HD : q;
    const coli_ix QO = W->gated ? 2 * HD : HD;
    float *ys[3];
    coli_ix Os[3], first[4], rb1 = coli_decode_rows(QO + 2 * KV * D, nt), rb2;
    coli_ix nblk1, nblk2, i, split;
    int m, heads_apart;
    ys[0] = qg;
    ys[1] = k;
    ys[2] = v;
    Os[0] = QO;
    Os[1] = Os[2] = KV * D;
    first[0] = 0;
    for (m = 0; m < 3; m++)
        first[m + 1] = first[m] + (Os[m] + rb1 - 1) / rb1;
    nblk1 = first[3];
    rb2 = coli_decode_rows(hid, nt);
    nblk2 = (hid + rb2 - 1) / rb2;
    /* a parallel loop over heads costs more than a short context's whole attention; the groups
     * dealt to threads as in coli_attend_one */
    heads_apart = nt > 1 && n * H * D >= (coli_ix)1 << 18;
    split = coli_attend_split(KV, G, nt);

    coli_rms_norm(x, W->in_norm, hn, 1, hid, W->eps);
    coli_xlay_prep(i8, cb, hn, hid, gs, &in1);
#ifdef _OPENMP
#pragma omp parallel num_threads(nt) if (nt > 1)
#endif
    {
        coli_ix b, h, it;
#ifdef _OPENMP
#pragma omp for schedule(dynamic)
#endif
        for (b = 0; b < nblk1; b++) {
            int mm = b >= first[2] ? 2 : b >= first[1] ? 1 : 0;
            coli_ix r0 = (b - first[mm]) * rb1, r1 = r0 + rb1 < Os[mm] ? r0 + rb1 : Os[mm];
            coli_xlay_rows(i8, lv, W->w[mm], W->s[mm], &in1, ys[mm], r0, r1, Os[mm], hid, gs);
        }
#ifdef _OPENMP
#pragma omp single
#endif
        {
            coli_ix j, g;
            int mm;
            for (mm = 0; mm < 3; mm++)
                if (W->bias[mm] != NULL)
                    for (j = 0; j < Os[mm]; j++)
                        ys[mm][j] = ys[mm][j] + W->bias[mm][j];
            if (W->gated)
                for (h = 0; h < H; h++) {
                    memcpy(q + h * D, qg + 2 * h * D, sizeof(float) * (size_t)D);
                    memcpy(gate + h * D, qg + (2 * h + 1) * D, sizeof(float) * (size_t)D);
                }
            if (W->qk_norm == COLI_QK_FULL) {
                coli_rms_norm(q, W->q_norm, q, 1, HD, W->eps);
                coli_rms_norm(k, W->k_norm, k, 1, KV * D, W->eps);
            }
            if (W->clip >= 0.0f)    /* np.clip: NaN stays NaN */
                for (j = 0; j < HD + 2 * KV * D; j++) {
                    float c = qkv[j] > -W->clip || qkv[j] != qkv[j] ? qkv[j] : -W->clip;
                    qkv[j] = c < W->clip || c != c ? c : W->clip;
                }
            if (W->qk_norm == COLI_QK_PER_HEAD) {
                coli_rms_norm(q, W->q_norm, q, H, D, W->eps);
                coli_rms_norm(k, W->k_norm, k, KV, D, W->eps);
            }
            if (W->R == D) {
                coli_rope(q, cs, sn, 1, H, D);
                coli_rope(k, cs, sn, 1, KV, D);
            } else {                /* the numpy path's rope_ of x[..., :R], head by head */
                coli_rope_part(q, cs, sn, H, D, W->R);
                coli_rope_part(k, cs, sn, KV, D, W->R);
            }
            for (g = 0; g < KV; g++)
                if (half)
                    for (j = 0; j < D; j++) {
                        ((uint16_t *)K)[g * ks + pos * D + j] = coli_f2h(k[g * D + j]);
                        ((uint16_t *)V)[g * vs + pos * D + j] = coli_f2h(v[g * D + j]);
                    }
                else {
                    memcpy((float *)K + g * ks + pos * D, k + g * D, sizeof(float) * (size_t)D);
                    memcpy((float *)V + g * vs + pos * D, v + g * D, sizeof(float) * (size_t)D);
                }
            if (!heads_apart) {
                for (it = 0; it < KV; it++)
                    coli_attend_block_item(q, K, V, ks, vs, half, it, 1, G, D, lo, S, scale, p,
                                           n, wide, att, level, gate);
                coli_xlay_prep(i8, cb, att, HD, gs, &in2);
            }
        }
        if (heads_apart) {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (it = 0; it < KV * split; it++)
                coli_attend_block_item(q, K, V, ks, vs, half, it, split, G, D, lo, S, scale, p,
                                       n, wide + (coli_ix)coli_thread() * COLI_KV_CHUNK * D, att,
                                       level, gate);
#ifdef _OPENMP
#pragma omp single
#endif
            coli_xlay_prep(i8, cb, att, HD, gs, &in2);
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic)
#endif
        for (b = 0; b < nblk2; b++) {
            coli_ix r0 = b * rb2, r1 = r0 + rb2 < hid ? r0 + rb2 : hid;
            coli_xlay_rows(i8, lv, W->w[3], W->s[3], &in2, yo, r0, r1, hid, HD, gs);
        }
    }
    for (i = 0; i < hid; i++)
        out[i] = x[i] + (W->bias[3] != NULL ? yo[i] + W->bias[3][i] : yo[i]);
    /* the router here too: a stretch of Python between this region and the experts' let the
     * second thread fall asleep (a region after a gap of 160+ us cost 25-100 us more here) */
    if (W->router != NULL) {
        coli_rms_norm(out, W->post_norm, h, 1, hid, W->eps);
        coli_matvec_rows(h, W->router, logits, 1, W->E, hid, level);
        coli_softmax_topk(logits, 1, W->E, W->top_k, W->norm_topk, probs, top, wts);
    }
}

#endif
