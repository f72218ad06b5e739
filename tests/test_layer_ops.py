"""The compiled per-layer operations of a decode step (cython_kernels/layer_ops.h) against their
numpy references in core.kernels: RMS norm, rotary embedding (bit for bit), one-position attention
(every SIMD variant and thread count giving the same bits), the router's softmax + top-k, and the
head-major KV cache."""
from __future__ import annotations

import os

import numpy as np
import pytest

from core import kernels
from core.cache_kinds import KV
from core.cache import KVCache
from core.rope import Rope
from tests.conftest import run_emulated

qm = pytest.importorskip("cython_kernels.qmatmul", reason="compiled kernels not built")


pytestmark = pytest.mark.usefixtures("kernel_settings")


def _numpy(fn, *args):
    """fn with the compiled extension switched off (the reference path)."""
    saved, kernels._compiled = kernels._compiled, None
    try:
        return fn(*args)
    finally:
        kernels._compiled = saved


@pytest.mark.parametrize("shape", [(1, 2048), (5, 7), (3, 4, 64), (1, 1)])
def test_rms_norm_matches_numpy(shape):
    rng = np.random.default_rng(len(shape) + shape[-1])
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    got = kernels.rms_norm(x, w, 1e-6)
    want = _numpy(kernels.rms_norm, x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


def test_rms_norm_takes_views_and_rejects_a_wrong_weight():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 32)).astype(np.float32)[::2]        # not contiguous
    w = np.ones(32, np.float32)
    np.testing.assert_allclose(kernels.rms_norm(x, w, 1e-5), _numpy(kernels.rms_norm, x, w, 1e-5),
                               rtol=2e-6)
    with pytest.raises(ValueError):
        qm.rms_norm(np.ascontiguousarray(x), np.ones(31, np.float32), 1e-5)


@pytest.mark.parametrize("T,H,D", [(1, 16, 128), (7, 3, 64), (2, 1, 6)])
def test_rope_gives_the_bits_of_the_numpy_expression(T, H, D):
    rng = np.random.default_rng(T * H * D)
    x = rng.standard_normal((T, H, D)).astype(np.float32)
    cos, sin = Rope({"rope_theta": 10000.0}, D).cos_sin(np.arange(40, 40 + T))
    want = _numpy(kernels.rope, x.copy(), cos, sin)
    got = kernels.rope(x.copy(), cos, sin)
    np.testing.assert_array_equal(got, want)


def _cache(rng, KV, S, D, spare=5):
    """Keys / values as the KV cache holds them: views [KV, S, D] of a larger buffer."""
    k = rng.standard_normal((KV, S + spare, D)).astype(np.float32)
    v = rng.standard_normal((KV, S + spare, D)).astype(np.float32)
    return k[:, :S], v[:, :S]


@pytest.mark.parametrize("H,KV,D,S,window", [(16, 16, 128, 1, None), (16, 16, 128, 300, None),
                                             (8, 2, 64, 57, None), (4, 4, 64, 40, 7),
                                             (6, 3, 12, 33, None), (2, 1, 8, 600, 100)])
def test_attention_one_position_matches_numpy(H, KV, D, S, window):
    rng = np.random.default_rng(H + KV + D + S)
    keys, values = _cache(rng, KV, S, D)
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    pos = np.array([S - 1])
    scale = np.float32(D ** -0.5)
    want = _numpy(kernels.attention, q, keys, values, scale, pos, window)
    outs = []
    for variant in qm.simd_variants():
        qm.set_simd(variant)
        for threads in (1, 2):
            qm.set_num_threads(threads)
            got = kernels.attention(q, keys, values, scale, pos, window)
            assert got.shape == (1, H * D) and got.dtype == np.float32
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
            outs.append(got)
    for got in outs[1:]:          # every variant and thread count: the same bits
        np.testing.assert_array_equal(got, outs[0])


@pytest.mark.parametrize("H,KV,D,S,lo", [(16, 2, 256, 700, 0), (12, 1, 128, 300, 40),
                                         (6, 3, 40, 133, 5), (8, 8, 64, 90, 0), (10, 2, 48, 77, 3),
                                         (4, 1, 520, 40, 0), (3, 1, 8, 1, 0)])
@pytest.mark.parametrize("half", [False, True])
def test_grouped_heads_have_the_bits_of_each_head_alone(H, KV, D, S, lo, half):
    """attend_one computes the query heads of a kv head in one pass over its K / V (and splits a
    group between threads when kv heads are fewer than threads): every head gets the bits it has
    computed on its own (one head against its kv head), for every variant and thread count."""
    rng = np.random.default_rng(H * S + D)
    q = rng.standard_normal((H, D)).astype(np.float32)
    k = rng.standard_normal((KV, S, D)).astype(np.float32)
    v = rng.standard_normal((KV, S, D)).astype(np.float32)
    if half:
        k, v = k.astype(np.float16).view(np.uint16), v.astype(np.float16).view(np.uint16)
    attend = qm.attend_one_f16 if half else qm.attend_one
    G = H // KV
    for variant in qm.simd_variants():
        qm.set_simd(variant)
        qm.set_num_threads(1)
        alone = np.concatenate([attend(q[h:h + 1], k[h // G:h // G + 1], v[h // G:h // G + 1],
                                       0.0625, lo) for h in range(H)], axis=1)
        for threads in (1, 2, 3):
            qm.set_num_threads(threads)
            np.testing.assert_array_equal(attend(q, k, v, 0.0625, lo), alone,
                                          err_msg=f"{variant} threads={threads}")


@pytest.mark.parametrize("window", [None, 37])
def test_prefill_attention_in_query_blocks_matches_one_block(window, monkeypatch):
    """A prefill's attention runs ATTENTION_QUERY_BLOCK query rows at a time (bounded scores);
    the result is the one-block computation's, with causality and the window per row."""
    rng = np.random.default_rng(3)
    T, H, KV, D, past = 300, 4, 2, 16, 20
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    keys = rng.standard_normal((KV, past + T, D)).astype(np.float32)
    values = rng.standard_normal((KV, past + T, D)).astype(np.float32)
    pos = np.arange(past, past + T)
    blocked = kernels.attention(q, keys, values, np.float32(0.25), pos, window)
    monkeypatch.setattr(kernels, "ATTENTION_QUERY_BLOCK", 1 << 30)
    whole = kernels.attention(q, keys, values, np.float32(0.25), pos, window)
    assert blocked.shape == whole.shape == (T, H * D)
    np.testing.assert_allclose(blocked, whole, rtol=1e-5, atol=1e-6)
    # the first query row sees positions 0..past only: changing a later key must not move it
    keys2 = keys.copy()
    keys2[:, past + 5] += 1.0
    again = kernels.attention(q[:1], keys2[:, : past + 1], values[:, : past + 1], np.float32(0.25),
                              pos[:1], window)
    np.testing.assert_allclose(again, whole[:1], rtol=1e-5, atol=1e-6)


def test_attention_rejects_mismatched_shapes():
    rng = np.random.default_rng(3)
    keys, values = _cache(rng, 2, 10, 8)
    with pytest.raises(ValueError):
        qm.attend_one(np.zeros((3, 8), np.float32), keys, values, 1.0, 0)     # 3 heads, 2 kv
    with pytest.raises(ValueError):
        qm.attend_one(np.zeros((2, 8), np.float32), keys, values[:, :9], 1.0, 0)


@pytest.mark.parametrize("T,E,D", [(1, 64, 2048), (7, 32, 256), (31, 5, 12), (3, 128, 9)])
def test_router_logits_match_numpy_with_the_same_bits_in_every_variant(T, E, D):
    """Every variant that runs the dense kernel (dense.h: AVX2, AVX-512, NEON) gives its bits; the
    portable one (x86 without FMA) its own dot products; all close to numpy."""
    rng = np.random.default_rng(T + E + D)
    h = rng.standard_normal((T, D)).astype(np.float32)
    W = rng.standard_normal((E, D)).astype(np.float32)
    want = h @ W.T
    outs = {}
    for variant in qm.simd_variants():
        qm.set_simd(variant)
        got = kernels.router_logits(h, W)
        assert got.shape == (T, E) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(D))
        np.testing.assert_array_equal(qm.router_logits(h, W), got)      # the attention block's
        outs.setdefault(qm.dense_level() != "portable", []).append(got)
    for same in outs.values():
        for got in same[1:]:
            np.testing.assert_array_equal(got, same[0])
    with pytest.raises(ValueError):
        qm.router_logits(h, W[:, :-1].copy())


def test_router_logits_of_many_rows_have_the_bits_of_one():
    """Many rows (prefill) route from the logits one row (decode) gets: the dense kernel at every
    row count where it runs; on the portable variant numpy's sgemm above ROUTER_C_ROWS."""
    rng = np.random.default_rng(9)
    h = rng.standard_normal((40, 16)).astype(np.float32)
    W = rng.standard_normal((8, 16)).astype(np.float32)
    for variant in qm.simd_variants():
        qm.set_simd(variant)
        many = kernels.router_logits(h, W)
        if kernels._dense_compiled():
            np.testing.assert_array_equal(many, np.concatenate([kernels.router_logits(h[t: t + 1], W)
                                                                for t in range(40)]))
        else:
            np.testing.assert_array_equal(many, h @ W.T)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("T,E,k", [(1, 64, 8), (5, 32, 4), (3, 8, 8), (2, 128, 1)])
def test_softmax_topk_matches_numpy(T, E, k, norm):
    rng = np.random.default_rng(T * E + k)
    logits = (rng.standard_normal((T, E)) * 2).astype(np.float32)
    logits[0, 3] = logits[0, 5] = logits[0].max() + 1          # a tie: the lower expert first
    top, w = kernels.softmax_topk(logits, k, norm)
    rtop, rw = _numpy(kernels.softmax_topk, logits, k, norm)
    np.testing.assert_array_equal(top, rtop)
    assert top[0, 0] == 3 and (k == 1 or top[0, 1] == 5)
    assert w.dtype == np.float32 and top.dtype == np.int64
    np.testing.assert_allclose(w, rw, rtol=2e-6)


def test_kv_cache_grows_and_keeps_what_it_holds():
    class Spec:
        num_layers, num_kv_heads, head_dim, max_position_embeddings = 2, 3, 4, 16   # reserve 16
        cache_kinds = [KV(3, 4)] * 2
    cache = KVCache(Spec)
    rng = np.random.default_rng(0)
    ks = rng.standard_normal((150, 3, 4)).astype(np.float32)
    got = None
    for start, n in [(0, 40), (40, 30), (70, 1), (71, 79)]:
        got, _ = cache.append(1, ks[start: start + n], ks[start: start + n])
        cache.length += n
    assert got.shape == (3, 150, 4)
    np.testing.assert_array_equal(got, ks.transpose(1, 0, 2))


def test_kv_cache_reservation_costs_no_memory_until_written():
    """The reserved positions are address space only: RSS grows with what is written (the
    OLMoE geometry reserves 1 GiB of it; one position is 256 KiB)."""
    psutil = pytest.importorskip("psutil")

    class Spec:
        num_layers, num_kv_heads, head_dim, max_position_embeddings = 16, 16, 128, 4096
        cache_kinds = [KV(16, 128)] * 16
    cache = KVCache(Spec)
    k = np.ones((1, 16, 128), np.float32)
    before = psutil.Process().memory_info().rss
    for layer in range(16):
        keys, _ = cache.append(layer, k, k)
    grown = psutil.Process().memory_info().rss - before
    assert cache.k[0].shape == (16, 4096, 128) and keys.shape == (16, 1, 128)
    assert grown < 64 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB for one position"


@pytest.mark.parametrize("k,H", [(1, 5), (2, 64), (8, 2048), (9, 131)])
def test_rank_sum_has_numpys_bits(k, H):
    """Decode's weighted sum over ranks: the bits of the numpy expression it replaces, in rank
    order (values spread over many magnitudes, so another order would round differently)."""
    rng = np.random.default_rng(k * H)
    c = (rng.standard_normal((k, H)) * 10.0 ** rng.integers(-4, 5, (k, H))).astype(np.float32)
    w = rng.random(k).astype(np.float32)
    got = kernels.rank_sum(c, w)
    want = np.add.reduce(c * w[:, None], axis=0, keepdims=True)
    assert got.shape == (1, H)
    np.testing.assert_array_equal(got, want)
    if k > 2:       # the order matters for these values: a reversed sum differs somewhere
        rev = np.add.reduce((c * w[:, None])[::-1], axis=0, keepdims=True)
        assert not np.array_equal(rev, want)
    np.testing.assert_array_equal(_numpy(kernels.rank_sum, c, w), want)


def test_silu_mul_in_place_has_silus_bits():
    rng = np.random.default_rng(7)
    g = (rng.standard_normal((33, 70)) * 30).astype(np.float32)
    g[0, :3] = (-200.0, 200.0, 0.0)           # exp overflow: silu gives -0, silently
    u = rng.standard_normal((33, 70)).astype(np.float32)
    want = kernels.silu(g) * u
    got = kernels.silu_mul(g, u.copy())
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[0, 0]) == np.signbit(want[0, 0])


def test_float16_conversion_is_exact_for_every_half():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    want = h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    for variant in qm.simd_variants():
        qm.set_simd(variant)
        for path in ("auto", "avx2", "scalar"):      # F16C where the CPU has it; integer AVX2; C
            got = qm.f16_to_f32(h, path)
            if path == "avx2" and got.size == 0:
                continue                              # no AVX2 on this CPU
            np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan],
                                          err_msg=f"{variant} {path}")
            assert np.isnan(got[nan]).all()


@pytest.mark.parametrize("H,KV,D,S,lo", [(16, 16, 128, 1, 0), (8, 2, 64, 200, 0), (4, 4, 128, 300, 130),
                                         (6, 3, 40, 70, 5), (4, 4, 128, 600, 0)])
def test_float16_cache_attention_has_the_bits_of_float32_over_the_same_values(H, KV, D, S, lo):
    """The opt-in float16 KV cache widens rows in chunks inside the kernel: the bits of the
    float32 kernel over the widened values, per SIMD variant and thread count; the numpy
    (prefill) path widens the same way."""
    rng = np.random.default_rng(S + lo)
    q = rng.standard_normal((H, D)).astype(np.float32)
    k = (rng.standard_normal((KV, S, D)) * 3).astype(np.float16)
    v = rng.standard_normal((KV, S, D)).astype(np.float16)
    k32, v32 = k.astype(np.float32), v.astype(np.float32)
    for variant in qm.simd_variants():
        qm.set_simd(variant)
        for threads in (1, 2):
            qm.set_num_threads(threads)
            got = qm.attend_one_f16(q, k.view(np.uint16), v.view(np.uint16), 0.125, lo)
            np.testing.assert_array_equal(got, qm.attend_one(q, k32, v32, 0.125, lo),
                                          err_msg=f"{variant} threads={threads}")
    pos = np.array([S - 1])
    window = S - lo if lo else None
    np.testing.assert_array_equal(kernels.attention(q[None], k, v, np.float32(0.125), pos, window),
                                  kernels.attention(q[None], k32, v32, np.float32(0.125), pos, window))
    pq = np.arange(max(0, S - 3), S)
    qs = rng.standard_normal((len(pq), H, D)).astype(np.float32)
    np.testing.assert_array_equal(_numpy(kernels.attention, qs, k, v, np.float32(0.125), pq, None),
                                  _numpy(kernels.attention, qs, k32, v32, np.float32(0.125), pq, None))


# --- the softmax's exp (layer_ops.h coli_exp: one algorithm, every variant the same bits) -------

def _exp_inputs():
    """A dense sweep of [-104, 0], the floats around the edges, and the special values."""
    sweep = np.linspace(-104.0, 0.0, (1 << 22) + 1, dtype=np.float32)
    edges = np.concatenate([np.float32(e) + np.arange(-300, 300, dtype=np.float32) * np.spacing(np.float32(e))
                            for e in (-103.97, -87.34, -1.0, -0.35)]).astype(np.float32)
    tiny = -np.logspace(-38, -1, 2000, dtype=np.float32)
    return np.concatenate([sweep, edges, tiny]).astype(np.float32)


def _softmax_unnorm(p, scale=1.0):
    p = np.array(p, np.float32)
    s = qm.softmax_unnorm_(p, scale)
    return p, np.float32(s)


def test_softmax_exp_is_within_about_one_ulp_of_exp():
    """exp(x - max) with max = 0 (the sweep holds 0): the kernel's exp itself, against float64
    exp, in ulps of the float32 result (subnormals: in units of the smallest one)."""
    x = _exp_inputs()
    for variant in qm.simd_variants():
        qm.set_simd(variant)
        got, _ = _softmax_unnorm(x)
        want = np.exp(x.astype(np.float64))
        ulp = np.maximum(np.spacing(want.astype(np.float32)).astype(np.float64), 2.0 ** -149)
        err = np.abs(got.astype(np.float64) - want) / ulp
        assert err.max() <= 1.5, (variant, float(err.max()), float(x[err.argmax()]))


def test_softmax_exp_special_values():
    x = np.float32([0.0, -np.inf, -104.5, -150.0, -1e30, -103.97, -87.5, -0.0, -1e-30])
    for variant in qm.simd_variants():
        qm.set_simd(variant)
        got, s = _softmax_unnorm(x)
        assert got[0] == 1.0 and got[7] == 1.0 and got[8] == 1.0
        assert (got[1:5] == 0.0).all() and got[5] > 0.0 and 0.0 < got[6] < np.finfo(np.float32).tiny * 100
        nan, _ = _softmax_unnorm(np.float32([0.0, np.nan, -1.0]))
        assert np.isnan(nan[1]) and nan[0] == 1.0      # a NaN score stays NaN; the max skips it
        big, _ = _softmax_unnorm(np.float32([100.0, 0.0]))
        assert big[0] == 1.0 and big[1] == np.float32(np.exp(-100.0))   # a subnormal, rounded once


@pytest.mark.parametrize("n", [1, 7, 8, 9, 15, 16, 17, 31, 33, 100, 4096, 4099])
def test_softmax_unnorm_has_the_same_bits_in_every_variant(n):
    """The exp and the sum (lanes of 8 folded in a fixed order): the same bits for every SIMD
    variant, for lengths around the 8- and 16-wide blocks; the sum is the lane-order sum of the
    returned p."""
    rng = np.random.default_rng(n)
    scores = (rng.standard_normal(n) * 6).astype(np.float32)
    outs = []
    for variant in qm.simd_variants():
        qm.set_simd(variant)
        outs.append(_softmax_unnorm(scores, 0.37))
    p0, s0 = outs[0]
    for p, s in outs[1:]:
        np.testing.assert_array_equal(p.view(np.uint32), p0.view(np.uint32))
        assert s.view(np.uint32) == s0.view(np.uint32)
    lanes = np.zeros(8, np.float32)
    for j in range(n):
        lanes[j % 8] = np.float32(lanes[j % 8] + p0[j])
    fold = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))
    assert np.float32(fold) == s0
    arg = scores * np.float32(0.37)
    np.testing.assert_allclose(p0, np.exp((arg - arg.max()).astype(np.float64)), rtol=2.5e-7, atol=1e-45)


# the NEON variant (and AVX2 / AVX-512 where the CPU lacks them) through SIMDe's emulation; SIMDe
# computes fused multiply-adds as two roundings, so the harness puts fused ones (fmaf per lane) in
# their place, as the hardware computes them
_EMU_SOFTMAX = r"""
#include "qkern.h"
/* SIMDe emulates the fused multiply-adds as a multiply then an add (two roundings): put fused
 * ones (fmaf per lane) in their place, as the hardware computes them. */
static __m256 emu_fma8(__m256 a, __m256 b, __m256 c, float sa)
{ float x[8], y[8], z[8]; int i; _mm256_storeu_ps(x, a); _mm256_storeu_ps(y, b); _mm256_storeu_ps(z, c);
  for (i = 0; i < 8; i++) x[i] = fmaf(sa * x[i], y[i], z[i]); return _mm256_loadu_ps(x); }
static __m512 emu_fma16(__m512 a, __m512 b, __m512 c, float sa)
{ float x[16], y[16], z[16]; int i; _mm512_storeu_ps(x, a); _mm512_storeu_ps(y, b); _mm512_storeu_ps(z, c);
  for (i = 0; i < 16; i++) x[i] = fmaf(sa * x[i], y[i], z[i]); return _mm512_loadu_ps(x); }
static float32x4_t emu_fma4(float32x4_t c, float32x4_t a, float32x4_t b, float sa)
{ float x[4], y[4], z[4]; int i; vst1q_f32(x, a); vst1q_f32(y, b); vst1q_f32(z, c);
  for (i = 0; i < 4; i++) x[i] = fmaf(sa * x[i], y[i], z[i]); return vld1q_f32(x); }
#undef _mm256_fmadd_ps
#undef _mm256_fnmadd_ps
#undef _mm512_fmadd_ps
#undef _mm512_fnmadd_ps
#undef vfmaq_f32
#undef vfmsq_f32
#define _mm256_fmadd_ps(a, b, c) emu_fma8(a, b, c, 1.0f)
#define _mm256_fnmadd_ps(a, b, c) emu_fma8(a, b, c, -1.0f)
#define _mm512_fmadd_ps(a, b, c) emu_fma16(a, b, c, 1.0f)
#define _mm512_fnmadd_ps(a, b, c) emu_fma16(a, b, c, -1.0f)
#define vfmaq_f32(c, a, b) emu_fma4(c, a, b, 1.0f)
#define vfmsq_f32(c, a, b) emu_fma4(c, a, b, -1.0f)
#include "layer_ops.h"
#include <stdio.h>
int main(void) {
    enum { N = 1 << 16 };
    static float x[N + 11], ref[N + 11], got[N + 11];
    long i, n, fails = 0; int lv;
    static const long ns[] = {1, 7, 8, 9, 15, 16, 17, 24, 33, 100, N + 11};
    for (i = 0; i < N; i++) x[i] = -104.0f + 104.0f * (float)i / (float)N;
    x[N] = 0.0f; x[N + 1] = -INFINITY; x[N + 2] = -1e-30f; x[N + 3] = -87.5f; x[N + 4] = -103.9f;
    x[N + 5] = 3.0f; x[N + 6] = -200.0f; x[N + 7] = 1e-7f; x[N + 8] = -0.0f; x[N + 9] = -5.0f;
    x[N + 10] = 2.5f;
    for (i = 0; i < (long)(sizeof(ns) / sizeof(ns[0])); i++) {
        float sref, s;
        n = ns[i];
        memcpy(ref, x + (N + 11 - n), sizeof(float) * n);
        sref = coli_softmax_unnorm_lv(ref, n, 0.75f, COLI_PORTABLE);
        for (lv = 1; lv < COLI_NLEVELS; lv++) {
            memcpy(got, x + (N + 11 - n), sizeof(float) * n);
            s = coli_softmax_unnorm_lv(got, n, 0.75f, lv);
            if (memcmp(got, ref, sizeof(float) * n) || memcmp(&s, &sref, sizeof s)) {
                printf("FAIL level %s n=%ld\n", coli_level_names[lv], n);
                fails++;
            }
        }
    }
    printf(fails ? "FAILED %ld\n" : "OK\n", fails);
    return fails != 0;
}
"""


def test_softmax_exp_variants_emulated(tmp_path):
    run_emulated(tmp_path, _EMU_SOFTMAX)


