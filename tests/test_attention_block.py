"""Decode's attention block as one compiled call (cython_kernels/attention_block.h) against the
step-by-step path it replaces (core.blocks.attention.GQAAttention's operations and the residual add): the same
bits of the output and of the key / value written into the cache, for every q/k norm kind, with
biases and clipping, grouped-query heads, a sliding window, a context long enough to split the
heads between threads, float32 and float16 caches, every SIMD variant, the opt-in int8
activations and several thread counts; gated attention (Qwen3.5 / 3.6: q's rows per head
[q_h | gate_h], the output times sigmoid(gate)); and the MoE router it can end with
(post-attention norm, logits, softmax top-k)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from core import kernels, quant
from core.arch import ArchSpec
from core.container import Weight
from core.blocks.attention import GQA, GQAAttention
from core.cache import KVCache
from core.rope import Rope
from core.step import Step

qm = pytest.importorskip("cython_kernels.qmatmul", reason="compiled kernels not built")

pytestmark = pytest.mark.usefixtures("kernel_settings")


def _int4(rng, rows, cols, gs):
    packed, scales = quant.quantize_int4(rng.standard_normal((rows, cols)).astype(np.float32), gs)
    return Weight("int4", (rows, cols), packed, scales, gs)


def _layer(rng, hidden, H, KV, D, gs, qk_norm, bias, window):
    vec = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    q_norm = {"none": None, "full": vec(H * D), "per_head": vec(D)}[qk_norm]
    k_norm = {"none": None, "full": vec(KV * D), "per_head": vec(D)}[qk_norm]
    return SimpleNamespace(
        q=_int4(rng, H * D, hidden, gs), k=_int4(rng, KV * D, hidden, gs),
        v=_int4(rng, KV * D, hidden, gs), o=_int4(rng, hidden, H * D, gs),
        q_bias=vec(H * D) if bias else None, k_bias=vec(KV * D) if bias else None,
        v_bias=vec(KV * D) if bias else None, o_bias=vec(hidden) if bias else None,
        input_norm=vec(hidden), q_norm=q_norm, k_norm=k_norm, window=window,
        post_norm=vec(hidden), router=rng.standard_normal((6, hidden)).astype(np.float32))


def _spec(hidden, H, KV, D, qk_norm, clip):
    s = ArchSpec(vocab_size=8, hidden_size=hidden, num_layers=1, num_heads=H, num_kv_heads=KV,
                 head_dim=D, rms_norm_eps=1e-5, mlp_kinds=["moe"], num_experts=6, top_k=2,
                 norm_topk_prob=True, max_position_embeddings=4096)
    s.qk_norm, s.clip_qkv = qk_norm, clip       # the attention's options (GQA's), kept with the sizes
    return s


def _block(L, s, router=False):
    return kernels.attention_block([L.q, L.k, L.v, L.o], [L.q_bias, L.k_bias, L.v_bias, L.o_bias],
                                   L.input_norm, s.qk_norm, L.q_norm, L.k_norm, s.rms_norm_eps,
                                   s.clip_qkv, s.num_heads, s.num_kv_heads, s.head_dim,
                                   L.router if router else None, L.post_norm, s.top_k,
                                   s.norm_topk_prob)


def _attention(L, s) -> GQAAttention:
    """The numpy block over the test layer's weights (as GQA.build would load them)."""
    att = GQAAttention.__new__(GQAAttention)
    att.spec = GQA(s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.qk_norm, s.clip_qkv, L.window)
    att.eps, att.window, att.rope_dim, att.scale = s.rms_norm_eps, L.window, s.head_dim, np.float32(s.head_dim ** -0.5)
    for n in ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm"):
        setattr(att, n, getattr(L, n))
    return att


def _step(cache, n, cos, sin):
    """One position n over cache, blocks on their own (no engine), with these rotary rows."""
    return Step([0], [n], cache, {"main": SimpleNamespace(cos_sin=lambda pos: (cos, sin))}, fused=False)


def _filled_cache(rng, s, n, dtype=np.float32):
    cache = KVCache(s, dtype=dtype)
    if n:
        k = rng.standard_normal((n, s.num_kv_heads, s.head_dim)).astype(np.float32)
        cache.append(0, k, rng.standard_normal(k.shape).astype(np.float32))
        cache.length = n
    cache.ensure(0, n + 1)          # as the engine does before the block
    return cache


CASES = [
    # hidden, H, KV, D, gs, qk_norm, bias, clip, window, context
    (256, 4, 4, 64, 64, "full", False, None, None, 9),
    (256, 4, 2, 64, 64, "per_head", False, None, None, 0),
    (192, 6, 2, 32, 32, "none", True, 0.7, None, 30),
    (256, 4, 1, 64, 128, "per_head", True, None, 16, 40),
    (128, 4, 4, 64, 64, "full", False, None, None, 1100),     # heads split between threads
    (200, 2, 2, 64, 40, "none", False, None, None, 3),          # odd sizes: portable int4 path
]


@pytest.mark.parametrize("kv", ["float32", "float16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[5]}-H{c[1]}-KV{c[2]}-S{c[9]}")
def test_block_has_the_bits_of_the_step_by_step_path(case, kv):
    hidden, H, KV, D, gs, qk_norm, bias, clip, window, n = case
    rng = np.random.default_rng(hidden + H + n)
    s = _spec(hidden, H, KV, D, qk_norm, clip)
    L = _layer(rng, hidden, H, KV, D, gs, qk_norm, bias, window)
    x = rng.standard_normal((1, hidden)).astype(np.float32)
    before = _filled_cache(rng, s, n, kv)
    cos, sin = Rope({"rope_theta": 10000.0}, D).cos_sin(np.array([n]))
    scale = np.float32(D ** -0.5)
    attn = _attention(L, s)
    block, routed = _block(L, s), _block(L, s, router=True)
    assert block is not None and routed is not None
    lo = max(0, n - window + 1) if window else 0
    for simd, i8 in [(v, False) for v in qm.simd_variants()] + [(qm.simd_variants()[-1], True)]:
        qm.set_simd(simd)
        qm.set_int8_activations(i8)     # the opt-in int8-activation products, on both paths
        ref = KVCache(s, dtype=kv)      # the step-by-step path with this variant's products
        ref.arrays = [{"k": before.k[0].copy(), "v": before.v[0].copy()}]
        ref._views()
        ref.length = n
        want = x + attn(0, kernels.rms_norm(x, L.input_norm, s.rms_norm_eps), _step(ref, n, cos, sin))
        for threads in (1, 2, 3):
            qm.set_num_threads(threads)
            k, v = before.k[0].copy(), before.v[0].copy()
            got = block(x, cos, sin, k, v, n, lo, scale)
            np.testing.assert_array_equal(got, want, err_msg=f"{simd}, int8 {i8}, {threads} threads")
            np.testing.assert_array_equal(k[:, : n + 1], ref.k[0][:, : n + 1])
            np.testing.assert_array_equal(v[:, : n + 1], ref.v[0][:, : n + 1])
        got, h, top, weights = routed(x, cos, sin, before.k[0].copy(), before.v[0].copy(), n, lo,
                                      scale)
        want_h = kernels.rms_norm(want, L.post_norm, s.rms_norm_eps)
        want_top, want_w = kernels.softmax_topk(kernels.router_logits(want_h, L.router), 2, True)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(h, want_h)
        np.testing.assert_array_equal(top, want_top)
        np.testing.assert_array_equal(weights, want_w)


def test_block_rejects_what_does_not_fit():
    rng = np.random.default_rng(3)
    s = _spec(128, 2, 2, 64, "none", None)
    L = _layer(rng, 128, 2, 2, 64, 64, "none", False, None)
    block = _block(L, s)
    cache = KVCache(s)
    cache.ensure(0, 8)
    k, v = cache.k[0], cache.v[0]
    x = np.zeros((1, 128), np.float32)
    cos = sin = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError, match="x must be"):
        block(np.zeros((1, 127), np.float32), cos, sin, k, v, 0, 0, 1.0)
    with pytest.raises(ValueError, match="cos / sin"):
        block(x, np.zeros((1, 32), np.float32), sin, k, v, 0, 0, 1.0)
    with pytest.raises(ValueError, match="cache"):
        block(x, cos, sin, k, v, k.shape[1], 0, 1.0)            # no room for the position
    with pytest.raises(ValueError, match="cache"):
        block(x, cos, sin, k[:1], v[:1], 0, 0, 1.0)             # kv heads
    with pytest.raises(ValueError, match="router"):
        qm.AttentionBlock([(w.data, w.scales) for w in (L.q, L.k, L.v, L.o)], 64, [None] * 4,
                          L.input_norm, "none", None, None, 1e-5, None, 2, 2, 64, L.post_norm,
                          L.router[:, :5].copy(), 2)
    # projections the block does not take: the step-by-step path runs instead
    L.o = Weight("dense", L.o.shape, np.zeros(L.o.shape, np.float32))
    assert _block(L, s) is None
    L2 = _layer(rng, 128, 2, 2, 64, 64, "full", False, None)
    L2.q_norm = L2.q_norm[:5]
    assert _block(L2, _spec(128, 2, 2, 64, "full", None)) is None


def test_engine_decodes_the_same_with_and_without_the_block(containers):
    from models import open_model
    from tests.conftest import oracle_names
    kinds = [("float32", False), ("float16", False), ("float32", True)] * len(oracle_names())
    for name, (kv, i8) in zip(oracle_names(), kinds):
        engine = open_model(containers(name, 4), threads=2, kv_cache=kv)
        kernels.set_int8_activations(i8)
        if not any(getattr(L, "compiled", None) is not None for L in engine.layers):
            continue     # a family whose attention has no compiled step yet (partial RoPE, MLA)
        runs = []
        for fused in (True, False):
            engine.fused_attention = fused
            cache = engine.new_cache()
            out = [engine.forward([1, 2, 3], cache)]
            for t in (4, 5, 6, 7):
                out.append(engine.forward([t], cache))
            runs.append(np.concatenate(out))
            engine.recycle_cache(cache)
        np.testing.assert_array_equal(runs[0], runs[1], err_msg=f"{name}, {kv} cache, int8 {i8}")


def test_float16_rounding_of_a_new_cache_row_is_numpys():
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    exact = halves.view(np.float16).astype(np.float32)
    finite = exact[np.isfinite(exact)]
    pairs = np.sort(np.unique(finite))
    mids = ((pairs[:-1].astype(np.float64) + pairs[1:]) / 2).astype(np.float32)    # ties
    rng = np.random.default_rng(0)
    rand = (rng.standard_normal(200_000) * np.exp2(rng.integers(-30, 20, 200_000))).astype(np.float32)
    x = np.concatenate([finite, mids, np.nextafter(mids, np.float32(np.inf)),
                        np.nextafter(mids, np.float32(-np.inf)), rand,
                        np.array([np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 1e-8, -0.0, 1e30],
                                 np.float32)])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(qm.f32_to_f16(x), want)


@pytest.mark.parametrize("kv", ["float32", "float16"])
@pytest.mark.parametrize("qk_norm,rope_dim", [("per_head", 32), ("none", 16), ("full", 48)])
def test_partial_rope_block_has_the_bits_of_the_step_by_step_path(qk_norm, rope_dim, kv):
    """GLM-4.5 turns the first half of each head (partial_rotary_factor): the block rotates
    the first rope_dim dims as GQAAttention._rope does, every SIMD variant, 1-3 threads."""
    hidden, H, KV, D, gs, n = 256, 4, 2, 64, 64, 21
    rng = np.random.default_rng(rope_dim)
    s = _spec(hidden, H, KV, D, qk_norm, None)
    L = _layer(rng, hidden, H, KV, D, gs, qk_norm, True, None)
    x = rng.standard_normal((1, hidden)).astype(np.float32)
    before = _filled_cache(rng, s, n, kv)
    cos, sin = Rope({"rope_theta": 10000.0, "partial_rotary_factor": rope_dim / D}, rope_dim,
                    partial=True).cos_sin(np.array([n]))
    scale = np.float32(D ** -0.5)
    attn = _attention(L, s)
    attn.rope_dim = rope_dim
    block = kernels.attention_block([L.q, L.k, L.v, L.o], [L.q_bias, L.k_bias, L.v_bias, L.o_bias],
                                    L.input_norm, s.qk_norm, L.q_norm, L.k_norm, s.rms_norm_eps, None,
                                    H, KV, D, rope_dim=rope_dim)
    assert block is not None
    for simd in qm.simd_variants():
        qm.set_simd(simd)
        ref = KVCache(s, dtype=kv)
        ref.arrays = [{"k": before.k[0].copy(), "v": before.v[0].copy()}]
        ref._views()
        ref.length = n
        want = x + attn(0, kernels.rms_norm(x, L.input_norm, s.rms_norm_eps), _step(ref, n, cos, sin))
        for threads in (1, 2, 3):
            qm.set_num_threads(threads)
            k, v = before.k[0].copy(), before.v[0].copy()
            got = block(x, cos, sin, k, v, n, 0, scale)
            np.testing.assert_array_equal(got, want, err_msg=f"{simd}, {threads} threads")
            np.testing.assert_array_equal(k[:, : n + 1], ref.k[0][:, : n + 1])
    with pytest.raises(ValueError, match="cos / sin"):       # the table must be rope_dim wide
        block(x, np.zeros((1, D), np.float32), np.zeros((1, D), np.float32), k, v, n, 0, scale)


GATED_CASES = [
    # hidden, H, KV, D, gs, qk_norm, bias, clip, rope_dim, context
    (256, 4, 2, 64, 64, "per_head", False, None, 16, 21),     # Qwen3.5 / 3.6's kind, shrunk
    (192, 6, 2, 32, 32, "none", True, 0.7, 32, 30),           # biases (q's over 2 H D), clip
    (256, 4, 1, 64, 64, "full", False, None, 64, 0),          # the first position
    (128, 8, 2, 64, 64, "per_head", False, None, 16, 600),    # heads split between threads
]


@pytest.mark.parametrize("kv", ["float32", "float16"])
@pytest.mark.parametrize("case", GATED_CASES, ids=lambda c: f"{c[5]}-H{c[1]}-KV{c[2]}-R{c[8]}-S{c[9]}")
def test_gated_block_has_the_bits_of_the_step_by_step_path(case, kv):
    """Gated attention (Qwen3.5 / 3.6): q's rows per head [q_h | gate_h], the attention times
    sigmoid(gate) before o. GQAAttention.compiled_block gives the block (with and without the
    router), and it has the step-by-step path's bits (which at one position takes the block's
    sigmoid, kernels.sigmoid_gate), every SIMD variant, int8 activations, 1-3 threads."""
    hidden, H, KV, D, gs, qk_norm, bias, clip, rope_dim, n = case
    rng = np.random.default_rng(hidden + H + n + 7)
    s = _spec(hidden, H, KV, D, qk_norm, clip)
    L = _layer(rng, hidden, H, KV, D, gs, qk_norm, bias, None)
    L.q = _int4(rng, 2 * H * D, hidden, gs)
    L.q_bias = (0.1 * rng.standard_normal(2 * H * D)).astype(np.float32) if bias else None
    x = rng.standard_normal((1, hidden)).astype(np.float32)
    before = _filled_cache(rng, s, n, kv)
    cos, sin = Rope({"rope_theta": 10000.0, "partial_rotary_factor": rope_dim / D}, rope_dim,
                    partial=True).cos_sin(np.array([n]))
    scale = np.float32(D ** -0.5)
    attn = _attention(L, s)
    attn.spec = GQA(hidden, H, KV, D, qk_norm, clip, rope_dim=rope_dim, gated=True)
    attn.rope_dim = rope_dim
    block = attn.compiled_block(L.input_norm)
    routed = attn.compiled_block(L.input_norm, L.router, L.post_norm, s.top_k, s.norm_topk_prob)
    assert block is not None and routed is not None
    for simd, i8 in [(v, False) for v in qm.simd_variants()] + [(qm.simd_variants()[-1], True)]:
        qm.set_simd(simd)
        qm.set_int8_activations(i8)
        ref = KVCache(s, dtype=kv)
        ref.arrays = [{"k": before.k[0].copy(), "v": before.v[0].copy()}]
        ref._views()
        ref.length = n
        want = x + attn(0, kernels.rms_norm(x, L.input_norm, s.rms_norm_eps), _step(ref, n, cos, sin))
        for threads in (1, 2, 3):
            qm.set_num_threads(threads)
            k, v = before.k[0].copy(), before.v[0].copy()
            got = block(x, cos, sin, k, v, n, 0, scale)
            np.testing.assert_array_equal(got, want, err_msg=f"{simd}, int8 {i8}, {threads} threads")
            np.testing.assert_array_equal(k[:, : n + 1], ref.k[0][:, : n + 1])
            np.testing.assert_array_equal(v[:, : n + 1], ref.v[0][:, : n + 1])
        got, h, top, weights = routed(x, cos, sin, before.k[0].copy(), before.v[0].copy(), n, 0, scale)
        want_h = kernels.rms_norm(want, L.post_norm, s.rms_norm_eps)
        want_top, want_w = kernels.softmax_topk(kernels.router_logits(want_h, L.router), 2, True)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(h, want_h)
        np.testing.assert_array_equal(top, want_top)
        np.testing.assert_array_equal(weights, want_w)
    # a q projection without the gate rows is not this layer's: the step-by-step path reports it
    attn.q = _int4(rng, H * D, hidden, gs)
    assert attn.compiled_block(L.input_norm) is None


def test_compiled_sigmoid_gate_is_numpys_formula_to_float32_rounding():
    """kernels.sigmoid_gate at one position (libm's expf) against numpy's out / (1 + exp(-gate))
    (prefill's; numpy's own exp differs from expf in ~1/6 of these bits): within 2 float32
    epsilons relative (4 ulp where 1 / (1 + t) crosses a power of two), the same at the extremes (exp overflowing to inf: 0 or -0, NaN
    kept), and several positions (prefill) get each row's one-position bits."""
    rng = np.random.default_rng(5)
    gate = np.concatenate([rng.standard_normal(4000) * 8, [-1e3, 1e3, 0.0, -0.0, np.inf, -np.inf, np.nan,
                                                          -88.7, -89.0, 88.7]]).astype(np.float32)[None]
    out = rng.standard_normal(gate.shape).astype(np.float32)
    with np.errstate(over="ignore"):
        want = out * (np.float32(1.0) / (np.float32(1.0) + np.exp(-gate)))
    got = kernels.sigmoid_gate(out.copy(), gate)
    np.testing.assert_allclose(got, want, rtol=2.5e-7, atol=0)
    ends = ~np.isnan(want[0, -10:])          # NaN stays NaN (its sign bit is libm's choice)
    np.testing.assert_array_equal(np.signbit(got[0, -10:][ends]), np.signbit(want[0, -10:][ends]))
    # several positions (prefill) take the same function: each row the bits of one position
    two = kernels.sigmoid_gate(np.concatenate([out, out]), np.concatenate([gate, gate]))
    np.testing.assert_array_equal(two, np.concatenate([got, got]))
    with pytest.raises(ValueError, match="shape"):
        qm.sigmoid_gate(out.copy(), gate[:, :5].copy())
