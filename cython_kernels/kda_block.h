/* Kimi Delta Attention's core (Kimi-Linear / Kimi K3: transformers' KimiLinearDeltaAttention;
 * core.blocks.linear_attention's KDAMixer has the numpy reference and the formulas), token-serial.
 * The conv is linear_attention.h's coli_gdn_conv over the three convs' channels [q | k | v]; then
 *
 *   coli_kda_l2norm: x / sqrt(sum x^2 + 1e-6) (then * scale) per row, the divide form (Qwen's is
 *                    x * (1 / sqrt(.))); the sum in coli_dot's lane order.
 *   coli_kda_gates:  per channel decay = exp(neg_a[h] * softplus(f + dt_bias)), the softplus as
 *                    KimiLinearForgetGate writes it: x above 20, else log(1 + e^x) (logf, not
 *                    log1pf); beta = sigmoid(b) per head.
 *   coli_kda_delta:  per head, position after position, the delta rule with a per-key-channel
 *                    decay: S <- diag(decay) S (key row i scaled by decay_i); S += k (x) beta
 *                    (v - S^T k); o = S^T q. The decay is folded into the two reads: with
 *                    kd = k * decay, qd = q * decay (per channel), a = S^T kd and b = S^T qd of the
 *                    state before the position (one read of the state), delta = beta (v - a),
 *                    o = b + (k . q) delta, then S_i <- decay_i S_i + k_i delta (one read + write).
 *   coli_kda_norm:   w * x / sqrt(mean x^2 + eps) * sigmoid(z) per row of d (o_norm, g_b gate).
 *   coli_kda_block:  all of it for T positions in one call, the same static functions on the same
 *                    values as the step-by-step composition (KDAMixer.core_steps with the
 *                    compiled pieces), so the same bits (tests/test_kda_block.py).
 *
 * Every output is computed by one thread in an order fixed by the shapes (threads split channels
 * or whole heads), so the bits depend neither on the thread count nor on how a prompt is split
 * between calls. Plain C built with -ffp-contract=off; expf / logf are the C library's, so against
 * the numpy reference the results agree to float32 rounding, not bit for bit.
 */
#ifndef COLI_KDA_BLOCK_H
#define COLI_KDA_BLOCK_H

#include <math.h>
#include <string.h>

#include "layer_ops.h"          /* coli_ix, coli_dot */
#include "linear_attention.h"   /* coli_gdn_conv, coli_la_sigmoid, coli_split */

static float coli_kda_softplus(float x)
{
    float e = expf(x < 20.0f ? x : 20.0f);
    return x > 20.0f ? x : logf(1.0f + e);
}

/* rows [r0, r1) of x (row stride `stride`, d wide), in place: (x / sqrt(sum x^2 + eps)) * scale */
static void coli_kda_l2norm(float *x, coli_ix d, coli_ix stride, float eps, float scale, coli_ix r0,
                            coli_ix r1)
{
    coli_ix r, i;
    for (r = r0; r < r1; r++) {
        float *v = x + r * stride;
        float den = sqrtf(coli_dot(v, v, d) + eps);
        if (scale == 1.0f)
            for (i = 0; i < d; i++) v[i] = v[i] / den;
        else
            for (i = 0; i < d; i++) v[i] = (v[i] / den) * scale;
    }
}

/* heads [h0, h1) of T positions: decay[t, h, c] = exp(neg_a[h] * softplus(f[t, h*d + c] + dt[h*d + c])),
 * beta[t, h] = sigmoid(b[t, h]); f, decay [T, H*d], b, beta [T, H] */
static void coli_kda_gates(coli_ix T, coli_ix H, coli_ix d, const float *f, const float *b,
                           const float *dt, const float *neg_a, float *decay, float *beta,
                           coli_ix h0, coli_ix h1)
{
    coli_ix t, h, c, W = H * d;
    for (t = 0; t < T; t++)
        for (h = h0; h < h1; h++) {
            float na = neg_a[h];
            const float *ft = f + t * W + h * d, *dth = dt + h * d;
            float *dc = decay + t * W + h * d;
            for (c = 0; c < d; c++) {
                float g = ft[c] + dth[c];
                dc[c] = expf(na * coli_kda_softplus(g));
            }
            beta[t * H + h] = coli_la_sigmoid(b[t * H + h]);
        }
}

/* heads [h0, h1): q, k, v rows of d at x + (t * qs + h * d) (qs: a position's stride); decay
 * [T, H, d]; beta [T, H]; S [H, d, d] updated; o [T, H, d]. mem (4 * d floats) is scratch. */
static void coli_kda_delta(coli_ix T, coli_ix H, coli_ix d, const float *q, const float *k,
                           const float *v, coli_ix qs, const float *decay, const float *beta,
                           float *S, float *o, float *mem, coli_ix h0, coli_ix h1)
{
    coli_ix t, h, i, j;
    float *sa = mem, *sb = mem + d, *kd = mem + 2 * d, *qd = mem + 3 * d;
    for (h = h0; h < h1; h++) {
        float *Sh = S + h * d * d;
        for (t = 0; t < T; t++) {
            const float *qt = q + t * qs + h * d, *kt = k + t * qs + h * d, *vt = v + t * qs + h * d;
            const float *dc = decay + (t * H + h) * d;
            float bt = beta[t * H + h], kq;
            float *ot = o + (t * H + h) * d;
            for (i = 0; i < d; i++) { kd[i] = kt[i] * dc[i]; qd[i] = qt[i] * dc[i]; }
            for (j = 0; j < d; j++) { sa[j] = kd[0] * Sh[j]; sb[j] = qd[0] * Sh[j]; }
            for (i = 1; i < d; i++) {                      /* a = S^T (k decay), b = S^T (q decay) */
                const float *row = Sh + i * d;
                float ki = kd[i], qi = qd[i];
                for (j = 0; j < d; j++) { sa[j] = sa[j] + ki * row[j]; sb[j] = sb[j] + qi * row[j]; }
            }
            kq = coli_dot(kt, qt, d);
            for (j = 0; j < d; j++) {
                float dl = (vt[j] - sa[j]) * bt;           /* delta */
                ot[j] = sb[j] + kq * dl;
                sa[j] = dl;
            }
            for (i = 0; i < d; i++) {                      /* S_i <- decay_i S_i + k_i delta */
                float *row = Sh + i * d;
                float ki = kt[i], di = dc[i];
                for (j = 0; j < d; j++) row[j] = di * row[j] + ki * sa[j];
            }
        }
    }
}

/* rows [r0, r1) of x, z [rows, d]: out = (w * (x * (1 / sqrt(mean x^2 + eps)))) * sigmoid(z) */
static void coli_kda_norm(const float *x, const float *z, const float *w, coli_ix d, float eps,
                          float *out, coli_ix r0, coli_ix r1)
{
    coli_norm_gated_by(x, z, w, d, eps, out, r0, r1, 1);
}

typedef struct {
    coli_ix T, H, d, K;
    const float *qkv, *f, *b, *z;           /* [T, 3 H d], [T, H d] (f_b out), [T, H], [T, H d] (g_b out) */
    const float *conv_w, *dt, *neg_a, *norm_w;   /* [3 H d, K], [H d], [H], [d] */
    float *conv_state, *S;                  /* [3 H d, K-1], [H, d, d] */
    float eps, scale;
    float *out;                             /* [T, H d] */
} coli_kda_args;

/* scratch floats coli_kda_block needs */
static size_t coli_kda_block_floats(coli_ix T, coli_ix H, coli_ix d, int nt)
{
    return (size_t)(3 * T * H * d + T * H * d + T * H + T * H * d + (coli_ix)nt * 4 * d);
}

/* the whole core for T positions (work: coli_kda_block_floats). No barrier inside a parallel
 * region: the conv (channels split, its own region when there is enough of it), the l2norms (one
 * thread), then one region where each thread runs the gates, the delta rule and the norm of its
 * own heads. */
static void coli_kda_block(const coli_kda_args *A, float *work, int nt)
{
    coli_ix T = A->T, H = A->H, d = A->d, W = H * d, C = 3 * W, r;
    float *y = work, *decay = y + T * C, *beta = decay + T * W, *o = beta + T * H;
    float *mems = o + T * W;
    if (nt < 1) nt = 1;
    coli_gdn_conv_split(T, C, A->K, A->qkv, A->conv_state, A->conv_w, y, nt);
    for (r = 0; r < T * H; r++) {                       /* each position's q heads, then k heads */
        coli_ix pos = r / H, hh = r % H;
        coli_kda_l2norm(y + pos * C + hh * d, d, d, 1e-6f, A->scale, 0, 1);
        coli_kda_l2norm(y + pos * C + W + hh * d, d, d, 1e-6f, 1.0f, 0, 1);
    }
#ifdef _OPENMP
    #pragma omp parallel num_threads(nt)
#endif
    {
#ifdef _OPENMP
        int p = omp_get_thread_num(), n = omp_get_num_threads();
#else
        int p = 0, n = 1;
#endif
        coli_ix lo, hi, t;
        coli_split(H, n, p, &lo, &hi);
        if (lo < hi) {
            coli_kda_gates(T, H, d, A->f, A->b, A->dt, A->neg_a, decay, beta, lo, hi);
            coli_kda_delta(T, H, d, y, y + W, y + 2 * W, C, decay, beta, A->S, o,
                           mems + (coli_ix)p * 4 * d, lo, hi);
            for (t = 0; t < T; t++)
                coli_kda_norm(o, A->z, A->norm_w, d, A->eps, A->out, t * H + lo, t * H + hi);
        }
    }
}

#endif
