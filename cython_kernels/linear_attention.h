/* Linear attention with a recurrent state (Gated DeltaNet: Qwen3.5 / Qwen3.6; core.blocks.
 * linear_attention has the numpy reference and the formulas), token-serial:
 *
 *   coli_gdn_conv:   causal depthwise conv over T positions continuing the conv state [C, K-1]
 *                    (updated), then SiLU; taps summed oldest first.
 *   coli_gdn_gates:  beta = sigmoid(b), decay = exp(-exp(A_log) * softplus(a + dt_bias)).
 *   coli_l2norm:     x * (1 / sqrt(sum x^2 + 1e-6)) (then * scale) per row; the sum in coli_dot's
 *                    lane order.
 *   coli_gdn_delta:  per v head, position after position, the delta rule S <- decay S;
 *                    S += k (x) beta (v - S^T k); o = S^T q with the decay factored out of the
 *                    reads: one read of the state (S^T k, S^T q), one read + write (the update);
 *                    k / q head = v head / (Hv / Hk).
 *   coli_gated_norm: w * x / sqrt(mean x^2 + eps) * silu(z) per row of d.
 *   coli_gdn_block:  all of it for T positions in one call (conv, l2norms, gates, delta rule,
 *                    gated norm): the same static functions on the same values as the step-by-
 *                    step composition, so the same bits (tests/test_linear_attention_block.py).
 *
 * Every output is computed by one thread in an order fixed by the shapes (threads split channels,
 * rows or whole heads), so the bits never depend on the thread count, nor on how the positions
 * are split between calls (a prompt in one pass, in chunks, or decoded one by one). Plain C built
 * with -ffp-contract=off (no fused multiply-add); expf / log1pf are the C library's, so against
 * the numpy reference (numpy's own exp) the results agree to float32 rounding, not bit for bit.
 */
#ifndef COLI_LINEAR_ATTENTION_H
#define COLI_LINEAR_ATTENTION_H

#include <math.h>
#include <string.h>

#include "layer_ops.h"      /* coli_ix, coli_dot */

static float coli_la_sigmoid(float x)
{
    float t = expf(-x);
    t = 1.0f + t;
    return 1.0f / t;
}

static float coli_la_silu(float x) { return x * coli_la_sigmoid(x); }

static float coli_la_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* channels [c0, c1) of y[T, C] = silu(conv(x[T, C] after state[C, K-1], w[C, K])); state updated */
static void coli_gdn_conv(coli_ix T, coli_ix C, coli_ix K, const float *x, float *state,
                          const float *w, float *y, coli_ix c0, coli_ix c1)
{
    coli_ix c, t, j, W = K - 1;
    float win[64];
    for (c = c0; c < c1; c++) {
        const float *wc = w + c * K;
        float *st = state + c * W;
        for (t = 0; t < T; t++) {
            float acc = 0.0f;
            for (j = 0; j < K; j++) {
                coli_ix p = t + j;                          /* index in [state | x] */
                float v = p < W ? st[p] : x[(p - W) * C + c];
                acc = j == 0 ? v * wc[0] : acc + v * wc[j];
            }
            y[t * C + c] = coli_la_silu(acc);
        }
        if (W > 0) {                                        /* the last K-1 inputs, oldest first */
            coli_ix n = W <= 64 ? W : 64;
            for (j = 0; j < n; j++) {
                coli_ix p = T + j;
                win[j] = p < W ? st[p] : x[(p - W) * C + c];
            }
            memcpy(st, win, (size_t)n * sizeof(float));
        }
    }
}

/* beta[i] = sigmoid(b[i]), decay[i] = exp(neg_a[h] * softplus(a[i] + dt[h])), i = t * H + h */
static void coli_gdn_gates(coli_ix T, coli_ix H, const float *a, const float *b, const float *dt,
                           const float *neg_a, float *decay, float *beta)
{
    coli_ix t, h;
    for (t = 0; t < T; t++)
        for (h = 0; h < H; h++) {
            coli_ix i = t * H + h;
            beta[i] = coli_la_sigmoid(b[i]);
            decay[i] = expf(neg_a[h] * coli_la_softplus(a[i] + dt[h]));
        }
}

/* rows [r0, r1) of x [rows, d] (row stride `stride`), in place: x * (1 / sqrt(sum x^2 + eps)) * scale
 * (scale 1: left out) */
static void coli_l2norm(float *x, coli_ix d, coli_ix stride, float eps, float scale, coli_ix r0,
                        coli_ix r1)
{
    coli_ix r, i;
    for (r = r0; r < r1; r++) {
        float *v = x + r * stride;
        float inv = 1.0f / sqrtf(coli_dot(v, v, d) + eps);
        if (scale == 1.0f)
            for (i = 0; i < d; i++) v[i] = v[i] * inv;
        else
            for (i = 0; i < d; i++) v[i] = (v[i] * inv) * scale;
    }
}

/* v heads [h0, h1): q, k rows of dk at q + (t * qs + kh * dk) (qs: a position's stride), v rows of
 * dv at v + (t * vs + h * dv); decay / beta [T, Hv]; S [Hv, dk, dv] updated; o [T, Hv, dv].
 * mem (2 * dv floats) is scratch. Per position, with a = S^T k and b = S^T q of the state before
 * it (one read of the state), delta = beta (v - decay a), o = decay b + (k . q) delta, then
 * S <- decay S + k (x) delta (one read and one write): the delta rule's S <- decay S;
 * S += k (x) beta (v - S^T k); o = S^T q, with the decay taken out of the two reads, so the
 * state is streamed twice per position, not four times (it is 2 MB a layer at Qwen3.6's size). */
static void coli_gdn_delta(coli_ix T, coli_ix Hk, coli_ix Hv, coli_ix dk, coli_ix dv,
                           const float *q, const float *k, coli_ix qs, const float *v, coli_ix vs,
                           const float *decay, const float *beta, float *S, float *o, float *mem,
                           coli_ix h0, coli_ix h1)
{
    coli_ix rep = Hv / Hk, t, h, i, j;
    float *sa = mem, *sb = mem + dv;
    for (h = h0; h < h1; h++) {
        float *Sh = S + h * dk * dv;
        coli_ix kh = h / rep;
        for (t = 0; t < T; t++) {
            const float *qt = q + t * qs + kh * dk, *kt = k + t * qs + kh * dk;
            const float *vt = v + t * vs + h * dv;
            float dec = decay[t * Hv + h], bt = beta[t * Hv + h], kq;
            float *ot = o + (t * Hv + h) * dv;
            for (j = 0; j < dv; j++) { sa[j] = kt[0] * Sh[j]; sb[j] = qt[0] * Sh[j]; }
            for (i = 1; i < dk; i++) {                     /* a = S^T k, b = S^T q */
                const float *row = Sh + i * dv;
                float ki = kt[i], qi = qt[i];
                for (j = 0; j < dv; j++) { sa[j] = sa[j] + ki * row[j]; sb[j] = sb[j] + qi * row[j]; }
            }
            kq = coli_dot(kt, qt, dk);
            for (j = 0; j < dv; j++) {
                float d = (vt[j] - dec * sa[j]) * bt;      /* delta */
                ot[j] = dec * sb[j] + kq * d;
                sa[j] = d;
            }
            for (i = 0; i < dk; i++) {                     /* S <- decay S + k (x) delta */
                float *row = Sh + i * dv;
                float ki = kt[i];
                for (j = 0; j < dv; j++) row[j] = dec * row[j] + ki * sa[j];
            }
        }
    }
}

/* rows [r0, r1) of x, z [rows, d]: out = (w * (x * (1 / sqrt(mean x^2 + eps)))) * gate(z), the
 * gate silu (Gated DeltaNet) or, with sigmoid_gate, sigmoid (KDA's o_norm) */
static void coli_norm_gated_by(const float *x, const float *z, const float *w, coli_ix d, float eps,
                               float *out, coli_ix r0, coli_ix r1, int sigmoid_gate)
{
    coli_ix r, i;
    for (r = r0; r < r1; r++) {
        const float *xr = x + r * d, *zr = z + r * d;
        float *yr = out + r * d;
        float inv = 1.0f / sqrtf(coli_dot(xr, xr, d) / (float)d + eps);
        for (i = 0; i < d; i++)
            yr[i] = (w[i] * (xr[i] * inv)) * (sigmoid_gate ? coli_la_sigmoid(zr[i]) : coli_la_silu(zr[i]));
    }
}

/* the gated RMSNorm of Gated DeltaNet: out = w * x / sqrt(mean x^2 + eps) * silu(z) */
static void coli_gated_norm(const float *x, const float *z, const float *w, coli_ix d, float eps,
                            float *out, coli_ix r0, coli_ix r1)
{
    coli_norm_gated_by(x, z, w, d, eps, out, r0, r1, 0);
}

typedef struct {
    coli_ix T, Hk, Hv, dk, dv, K;
    const float *qkv, *z, *a, *b;           /* the projections: [T, C], [T, Hv*dv], [T, Hv] x2 */
    const float *conv_w, *dt, *neg_a, *norm_w;
    float *conv_state, *S;
    float eps, scale;
    float *out;                             /* [T, Hv * dv] */
} coli_gdn_args;

/* scratch floats coli_gdn_block needs */
static size_t coli_gdn_block_floats(coli_ix T, coli_ix Hk, coli_ix Hv, coli_ix dk, coli_ix dv, int nt)
{
    coli_ix C = 2 * Hk * dk + Hv * dv;
    return (size_t)(T * C + 2 * T * Hv + T * Hv * dv + (coli_ix)nt * 2 * dv);
}

static void coli_split(coli_ix n, int parts, int p, coli_ix *lo, coli_ix *hi)
{
    *lo = n * p / parts;
    *hi = n * (p + 1) / parts;
}

/* coli_gdn_conv over all C channels, split between nt threads in a region of its own when there
 * is enough of it (each channel is one thread's: the same bits whatever the split). */
static void coli_gdn_conv_split(coli_ix T, coli_ix C, coli_ix K, const float *qkv, float *conv_state,
                                const float *conv_w, float *y, int nt)
{
    if (nt > 1 && T * C * K >= (1 << 18)) {
#ifdef _OPENMP
        #pragma omp parallel num_threads(nt)
#endif
        {
#ifdef _OPENMP
            int p = omp_get_thread_num(), n = omp_get_num_threads();
#else
            int p = 0, n = 1;
#endif
            coli_ix lo, hi;
            coli_split(C, n, p, &lo, &hi);
            coli_gdn_conv(T, C, K, qkv, conv_state, conv_w, y, lo, hi);
        }
    } else {
        coli_gdn_conv(T, C, K, qkv, conv_state, conv_w, y, 0, C);
    }
}

/* the whole core for T positions (work: coli_gdn_block_floats). No barrier inside a parallel
 * region (a descheduled thread at a barrier costs a time slice on a loaded machine): the conv
 * (channels split, in its own region when there is enough of it), then the l2norms and gates
 * (small: one thread), then one region where each thread runs the delta rule and the gated norm
 * of its own v heads. */
static void coli_gdn_block(const coli_gdn_args *A, float *work, int nt)
{
    coli_ix T = A->T, Hk = A->Hk, Hv = A->Hv, dk = A->dk, dv = A->dv;
    coli_ix kd = Hk * dk, C = 2 * kd + Hv * dv, r;
    float *y = work, *decay = y + T * C, *beta = decay + T * Hv, *o = beta + T * Hv;
    float *mems = o + T * Hv * dv;
    if (nt < 1) nt = 1;
    coli_gdn_conv_split(T, C, A->K, A->qkv, A->conv_state, A->conv_w, y, nt);
    for (r = 0; r < T * Hk; r++) {                      /* each position's q heads, then k heads */
        coli_ix pos = r / Hk, hh = r % Hk;
        coli_l2norm(y + pos * C + hh * dk, dk, dk, 1e-6f, A->scale, 0, 1);
        coli_l2norm(y + pos * C + kd + hh * dk, dk, dk, 1e-6f, 1.0f, 0, 1);
    }
    coli_gdn_gates(T, Hv, A->a, A->b, A->dt, A->neg_a, decay, beta);
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
        coli_split(Hv, n, p, &lo, &hi);
        if (lo < hi) {
            coli_gdn_delta(T, Hk, Hv, dk, dv, y, y + kd, C, y + 2 * kd, C, decay, beta, A->S, o,
                           mems + (coli_ix)p * 2 * dv, lo, hi);
            for (t = 0; t < T; t++)
                coli_gated_norm(o, A->z, A->norm_w, dv, A->eps, A->out, t * Hv + lo, t * Hv + hi);
        }
    }
}

#endif
