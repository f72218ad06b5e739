"""Multi-head latent attention (core.blocks.mla) kept in the container's scheme: the transposed
product ``kernels.matmul_t`` (int4 / int8 compiled, the same bits for every SIMD variant and
thread count, float32 rounding from the numpy reference), per-head row views of kv_b_proj, the
many-heads-over-one-latent attention, and decode's compiled block (cython_kernels/mla_block.h)
against the block's step-by-step numpy composition of the same kernels: the same bits of the
output and of the latent row written into the cache, for every SIMD variant, float32 and float16
caches, 1/2/3 threads, q-LoRA and plain q, biases, odd sizes, a context long enough to split the
work, the opt-in int8 activations, and GLM-5's DSA layers (dense while every position is chosen)."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest

from core import kernels, quant
from core.blocks.mla import MLA, Indexer, MLAAttention
from core.container import Weight
from core.cache import KVCache
from core.rope import Rope
from core.step import Step

qm = pytest.importorskip("cython_kernels.qmatmul", reason="compiled kernels not built")

pytestmark = pytest.mark.usefixtures("kernel_settings")


def _int4(rng, rows, cols, gs, scale=0.3):
    packed, scales = quant.quantize_int4((scale * rng.standard_normal((rows, cols))).astype(np.float32), gs)
    return Weight("int4", (rows, cols), packed, scales, gs)


def _int8(rng, rows, cols):
    q, s = quant.quantize_int8(rng.standard_normal((rows, cols)).astype(np.float32))
    return Weight("int8", (rows, cols), q, s)


# --- the transposed product ---------------------------------------------------------------------

@pytest.mark.parametrize("T,O,I,gs", [(1, 192, 512, 64), (3, 37, 200, 40), (1, 5, 17, 2), (2, 130, 96, 32),
                                      (40, 64, 128, 64)])
def test_matmul_t_is_x_times_w_with_the_same_bits_everywhere(T, O, I, gs):
    rng = np.random.default_rng(T * O + I)
    x = rng.standard_normal((T, O)).astype(np.float32)
    for w, dense in ((_int4(rng, O, I, gs), None), (_int8(rng, O, I), None)):
        dense = (quant.dequantize_int4(w.data, w.scales, I, gs) if w.scheme == "int4"
                 else quant.dequantize_int8(w.data, w.scales))
        ref = x.astype(np.float64) @ dense.astype(np.float64)
        outs = []
        for simd in qm.simd_variants():
            qm.set_simd(simd)
            for threads in (1, 2, 3):
                qm.set_num_threads(threads)
                outs.append(kernels.matmul_t(x, w))
        for y in outs:
            np.testing.assert_array_equal(y, outs[0])
        assert outs[0].shape == (T, I) and outs[0].dtype == np.float32
        np.testing.assert_allclose(outs[0], ref, rtol=0, atol=2e-6 * np.abs(ref).max() + 1e-7)
    d = Weight("dense", (O, I), rng.standard_normal((O, I)).astype(np.float32))
    np.testing.assert_allclose(kernels.matmul_t(x, d), x @ d.data, rtol=1e-6, atol=1e-5)


def test_matmul_t_compiled_rows_are_the_same_at_any_row_count():
    rng = np.random.default_rng(1)
    w, x = _int4(rng, 48, 130, 64), rng.standard_normal((5, 48)).astype(np.float32)
    full = qm.q4_matmul_t(x, w.data, w.scales, 130, 64)
    for t in range(5):
        np.testing.assert_array_equal(qm.q4_matmul_t(x[t: t + 1], w.data, w.scales, 130, 64), full[t: t + 1])


def test_weight_rows_are_views_of_the_matrix():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 7)).astype(np.float32)
    x1 = rng.standard_normal((1, 70)).astype(np.float32)
    for w in (_int4(rng, 20, 70, 32), _int8(rng, 20, 70),
              Weight("dense", (20, 70), rng.standard_normal((20, 70)).astype(np.float32))):
        part = kernels.weight_rows(w, 6, 13)
        assert part.shape == (7, 70) and np.shares_memory(part.data, w.data)
        np.testing.assert_allclose(kernels.matmul(x1, part), kernels.matmul(x1, w)[:, 6:13], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(kernels.matmul_t(x, part), kernels.matmul_t(np.pad(x, ((0, 0), (6, 7))), w),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("H,D,dv,S", [(4, 72, 64, 1), (16, 576, 512, 300), (3, 20, 16, 70), (8, 160, 128, 900)])
def test_attend_latent_is_one_kv_head_attention(H, D, dv, S):
    rng = np.random.default_rng(H + S)
    q = rng.standard_normal((H, D)).astype(np.float32)
    rows = rng.standard_normal((S, D)).astype(np.float32)
    s = (q.astype(np.float64) @ rows.T.astype(np.float64)) * 0.1
    p = np.exp(s - s.max(axis=1, keepdims=True))
    ref = ((p / p.sum(axis=1, keepdims=True)) @ rows.astype(np.float64))[:, :dv]
    outs = []
    for simd in qm.simd_variants():
        qm.set_simd(simd)
        for threads in (1, 2, 3):
            qm.set_num_threads(threads)
            outs.append(kernels.attend_latent(q, rows, np.float32(0.1), dv))
            half = rows.astype(np.float16)
            np.testing.assert_array_equal(kernels.attend_latent(q, half, np.float32(0.1), dv),
                                          kernels.attend_latent(q, half.astype(np.float32), np.float32(0.1), dv))
    for y in outs:
        np.testing.assert_array_equal(y, outs[0])
    np.testing.assert_allclose(outs[0], ref, rtol=0, atol=1e-5)


# --- the block ----------------------------------------------------------------------------------

class _Container(dict):
    def load(self, name):
        return self[name]


def _layer(rng, spec: MLA, gs: int, p: str = "a."):
    """An MLAAttention over random int4 weights (as MLA.build loads them)."""
    c = _Container()
    vec = lambda n: Weight("dense", (n,), (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))
    for need in spec.tensors(p):
        if need.optional and not spec.bias:
            continue
        if len(need.shape) == 1:
            c[need.name] = vec(need.shape[0])
        else:
            c[need.name] = _int4(rng, *need.shape, gs)
    return MLAAttention(spec, c, p, 1e-5)


def _cache(spec: MLA, n: int, rng, dtype):
    arch = SimpleNamespace(cache_kinds=[spec.cache_kind()], max_position_embeddings=4096)
    cache = KVCache(arch, dtype=dtype)
    if n:
        D = spec.kv_lora_rank + spec.qk_rope
        cache.append_part(0, "latent", rng.standard_normal((n, 1, D)).astype(np.float32))
        if spec.indexer is not None:
            cache.append_part(0, "index", rng.standard_normal((n, 1, spec.indexer.head_dim)).astype(np.float32))
        cache.length = n
    return cache


def _copy(cache):
    return copy.deepcopy(cache)


CASES = [
    # hidden, heads, q_lora, rank, nope, rope, v, gs, bias, context
    (96, 4, 64, 64, 32, 16, 32, 32, False, 5),
    (80, 3, 0, 48, 24, 8, 40, 16, True, 0),          # plain q_proj, biases, the first position
    (128, 8, 64, 128, 32, 32, 64, 64, False, 700),   # long enough to split the work between threads
    (100, 5, 36, 40, 20, 12, 26, 20, True, 70),      # odd sizes, partial groups
]


@pytest.mark.parametrize("kv", ["float32", "float16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[1]}-q{c[2]}-S{c[9]}")
def test_block_has_the_bits_of_the_step_by_step_composition(case, kv):
    hidden, heads, ql, rank, nope, rope, v, gs, bias, n = case
    rng = np.random.default_rng(hidden + n)
    spec = MLA(hidden, heads, ql, rank, nope, rope, v, scale=(nope + rope) ** -0.5, bias=bias)
    attn = _layer(rng, spec, gs)
    assert attn.fast is not None
    in_norm = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    full = attn.decode_block(in_norm, 1e-5)
    x = rng.standard_normal((1, hidden)).astype(np.float32)
    before = _cache(spec, n, rng, kv)
    pos = np.array([n])
    table = {"main": Rope({"rope_theta": 10000.0}, rope)}
    cos, sin = table["main"].cos_sin(pos)
    run = attn.compiled(in_norm)         # the residual layer's compiled path: x + attn(norm x)
    assert run(0, x, Step([0], pos, _copy(before), table, fused=True)) is not None
    assert run(0, x, Step([0], pos, _copy(before), table, fused=False)) is None
    for simd, i8 in [(s, False) for s in qm.simd_variants()] + [(qm.simd_variants()[-1], True)]:
        qm.set_simd(simd)
        qm.set_int8_activations(i8)
        h = kernels.rms_norm(x, in_norm, 1e-5)
        ref = _copy(before)
        want = attn(0, h, Step([0], pos, ref, table, fused=False))
        for threads in (1, 2, 3):
            qm.set_num_threads(threads)
            msg = f"{simd}, int8 {i8}, {threads} threads"
            got_cache = _copy(before)
            got, _, _ = run(0, x, Step([0], pos, got_cache, table))
            np.testing.assert_array_equal(got, x + want, err_msg=msg)
            np.testing.assert_array_equal(got_cache.arrays[0]["latent"][:, : n + 1],
                                          ref.arrays[0]["latent"][:, : n + 1], err_msg=msg)
            whole = _copy(before)
            whole.ensure(0, n + 1)
            got = full(x, cos, sin, whole.arrays[0]["latent"], n, attn.scale)
            np.testing.assert_array_equal(got, x + want, err_msg=msg)
            np.testing.assert_array_equal(whole.arrays[0]["latent"][:, : n + 1],
                                          ref.arrays[0]["latent"][:, : n + 1], err_msg=msg)


def test_block_agrees_with_the_expanded_float64_attention():
    """The absorbed form in the block is multi-head attention with kv_b's expanded keys and
    values (to float32 rounding)."""
    hidden, heads, ql, rank, nope, rope, v, gs = 96, 4, 64, 64, 32, 16, 32, 32
    rng = np.random.default_rng(7)
    spec = MLA(hidden, heads, ql, rank, nope, rope, v, scale=(nope + rope) ** -0.5)
    attn = _layer(rng, spec, gs)
    cache = _cache(spec, 9, rng, "float32")
    h = rng.standard_normal((1, hidden)).astype(np.float32)
    pos = np.array([9])
    cos, sin = Rope({"rope_theta": 10000.0}, rope).cos_sin(pos)
    cache.ensure(0, 10)
    got = attn.fast(h, cos, sin, cache.arrays[0]["latent"], 9, attn.scale)      # the compiled block
    # float64 reference over the expanded keys / values
    deq = lambda w: quant.dequantize_int4(w.data, w.scales, w.shape[1], w.group_size).astype(np.float64)
    rms = lambda a, w, eps: w * a / np.sqrt((a * a).mean(-1, keepdims=True) + eps)
    qr = rms(h.astype(np.float64) @ deq(attn.q_a).T, attn.q_a_norm, 1e-6)
    q = (qr @ deq(attn.q_b).T).reshape(heads, nope + rope)
    rows = cache.arrays[0]["latent"][0, :10].astype(np.float64)
    lat, krot = rows[:, :rank], rows[:, rank:]
    kvb = deq(attn.kv_b).reshape(heads, nope + v, rank)
    half = rope // 2
    c, s = cos[0, :half].astype(np.float64), sin[0, :half].astype(np.float64)
    qp = q[:, nope:]
    qrot = np.concatenate([qp[:, 0::2] * c - qp[:, 1::2] * s, qp[:, 1::2] * c + qp[:, 0::2] * s], -1)
    out = np.empty((heads, v))
    for hd in range(heads):
        k = np.concatenate([lat @ kvb[hd, :nope].T, krot], -1)
        sc = (np.concatenate([q[hd, :nope], qrot[hd]]) @ k.T) * spec.scale
        p = np.exp(sc - sc.max())
        out[hd] = (p / p.sum()) @ (lat @ kvb[hd, nope:].T)
    want = out.reshape(1, -1) @ deq(attn.o).T
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("context", [3, 7])
def test_dsa_layers_run_dense_while_every_position_is_chosen(context):
    """GLM-5's indexer layers: with no more visible positions than index_topk the compiled block
    runs (and the indexer's key is cached as the numpy step caches it); past it the step-by-step
    path with the selection."""
    hidden, heads, ql, rank, nope, rope, v, gs = 96, 4, 64, 64, 32, 16, 32, 32
    rng = np.random.default_rng(context)
    ix = Indexer(hidden, ql, heads=2, head_dim=32, rope=16, topk=6)
    full_spec = MLA(hidden, heads, ql, rank, nope, rope, v, scale=(nope + rope) ** -0.5, indexer=ix)
    shared_spec = MLA(hidden, heads, ql, rank, nope, rope, v, scale=(nope + rope) ** -0.5, shared_index=True)
    full, shared = _layer(rng, full_spec, gs), _layer(rng, shared_spec, gs)
    x = rng.standard_normal((1, hidden)).astype(np.float32)
    in_norm = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    pos = np.array([context])
    table = {"main": Rope({"rope_theta": 10000.0}, rope)}
    c0, s0 = _cache(full_spec, context, rng, "float32"), _cache(shared_spec, context, rng, "float32")

    def mix(attn, step):
        """x + attn(norm x) as the residual layer runs it: its compiled path, else the mixer."""
        out = attn.compiled(in_norm)(0, x, step) if step.fused else None
        return out[0] if out is not None else x + attn(0, kernels.rms_norm(x, in_norm, 1e-5), step)
    outs = []
    for fused in (False, True):
        c1, s1 = _copy(c0), _copy(s0)
        one, two = Step([0], pos, c1, table, fused=fused), Step([0], pos, s1, table, fused=fused)
        a = mix(full, one)
        two.state = one.state          # the shared layer reads the full layer's choice
        b = mix(shared, two)
        outs.append((a, b, c1, s1, one.state["dsa_allowed"]))
    (a0, b0, c_ref, s_ref, sel0), (a1, b1, c_got, s_got, sel1) = outs
    np.testing.assert_array_equal(a1, a0)
    np.testing.assert_array_equal(b1, b0)
    for part in ("latent", "index"):
        np.testing.assert_array_equal(c_got.arrays[0][part][:, : context + 1], c_ref.arrays[0][part][:, : context + 1])
    np.testing.assert_array_equal(s_got.arrays[0]["latent"][:, : context + 1], s_ref.arrays[0]["latent"][:, : context + 1])
    if context + 1 <= ix.topk:
        assert sel0 is None and sel1 is None
    else:
        assert sel0.sum() == ix.topk and (sel0 == sel1).all()


def test_kv_b_is_held_in_the_container_scheme():
    rng = np.random.default_rng(4)
    spec = MLA(96, 4, 64, 64, 32, 16, 32, scale=0.1)
    attn = _layer(rng, spec, 32)
    assert attn.kv_b.scheme == "int4"
    assert not any(isinstance(getattr(attn, n, None), np.ndarray) and getattr(attn, n).size >= 64 * 64
                   for n in vars(attn) if n.startswith("w_"))
    assert all(np.shares_memory(w.data, attn.kv_b.data) for w in attn.w_kb + attn.w_vb)


def test_engine_decodes_the_same_with_and_without_the_block(containers):
    from models import open_model
    from tests.conftest import oracle_names
    names = [n for n in oracle_names() if n.startswith(("deepseek", "glmdsa"))]
    if not names:
        pytest.skip("no MLA oracle fixtures")
    for name, kv in zip(names, ["float32", "float16"] * len(names)):
        engine = open_model(containers(name, 4), threads=2, kv_cache=kv)
        # the compiled block is DeepSeek's interleaved RoPE only (deepseekv3-c: rope_interleave false)
        assert all((L.mixer.fast is not None) == (L.mixer.spec.interleave and L.mixer.spec.rope) for L in engine.layers)
        runs = []
        for fused in (True, False):
            engine.fused_attention = fused
            cache = engine.new_cache()
            out = [engine.forward([1, 2, 3], cache)]
            for t in (4, 5, 6, 7, 8, 9):
                out.append(engine.forward([t], cache))
            runs.append(np.concatenate(out))
            engine.recycle_cache(cache)
        np.testing.assert_array_equal(runs[0], runs[1], err_msg=f"{name}, {kv} cache")
