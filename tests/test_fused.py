"""One kernel pass for many matrices (q/k/v of a layer, all experts of a MoE layer): the same bits
as one call per matrix, whatever the grouping, thread count or SIMD variant."""
from __future__ import annotations

import numpy as np
import pytest

from core import kernels
from core.container import Weight
from core.engine import expert_ffn
from core.quant import quantize_int4, quantize_int8
from core.store import ExpertFFN
from models import open_model
from tests.conftest import oracle_names

qm = pytest.importorskip("cython_kernels.qmatmul", reason="compiled kernels not built")


pytestmark = pytest.mark.usefixtures("kernel_settings")


def _w4(rng, O, cols, gs):
    w, s = quantize_int4(rng.standard_normal((O, cols)).astype(np.float32), gs)
    return Weight("int4", (O, cols), w, s, gs)


@pytest.mark.parametrize("cols,gs", [(64, 64), (200, 64), (96, 32), (130, 128), (30, 6)])
@pytest.mark.parametrize("threads", [1, 2])
def test_many_equals_separate_calls(cols, gs, threads):
    rng = np.random.default_rng(cols + gs)
    x = rng.standard_normal((9, cols)).astype(np.float32)
    mats = [_w4(rng, O, cols, gs) for O in (5, 70, 1, 130, 64)]
    rows = [(0, 9), (2, 3), (8, 1), (4, 0), (0, 1)]
    for variant in qm.simd_variants():
        qm.set_simd(variant)
        for i8 in (False, True):
            qm.set_int8_activations(i8)
            qm.set_num_threads(threads)
            got = kernels.matmul_many(x, mats, rows)
            qm.set_num_threads(1)
            for w, (t0, n), y in zip(mats, rows, got):
                assert y.shape == (n, w.shape[0])
                want = qm.q4_matmul(x[t0: t0 + n], w.data, w.scales, cols, gs)
                np.testing.assert_array_equal(y, want, err_msg=f"{variant} i8={i8} rows={t0}:{t0 + n}")


def test_many_writes_into_outs_and_rejects_bad_input():
    rng = np.random.default_rng(1)
    a, b = _w4(rng, 7, 64, 32), _w4(rng, 3, 64, 32)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    outs = [np.empty((4, 7), np.float32), np.empty((2, 3), np.float32)]
    got = qm.q4_matmul_many(x, [(a.data, a.scales), (b.data, b.scales)], 64, 32, [(0, 4), (1, 2)], outs)
    assert got[0] is outs[0] and got[1] is outs[1]
    np.testing.assert_array_equal(outs[1], qm.q4_matmul(x[1:3], b.data, b.scales, 64, 32))
    with pytest.raises(ValueError, match="outside"):
        qm.q4_matmul_many(x, [(a.data, a.scales)], 64, 32, [(3, 2)])
    with pytest.raises(ValueError, match="columns"):
        qm.q4_matmul_many(x[:, :32], [(a.data, a.scales)], 64, 32)
    with pytest.raises(ValueError, match="scales"):
        qm.q4_matmul_many(x, [(a.data, a.scales[:, :1])], 64, 32)
    with pytest.raises(ValueError, match="same length"):
        qm.q4_matmul_many(x, [(a.data, a.scales)], 64, 32, [(0, 1), (0, 1)])
    with pytest.raises(ValueError, match="out must be"):
        qm.q4_matmul_many(x, [(a.data, a.scales)], 64, 32, None, [np.empty((4, 6), np.float32)])


def test_mixed_schemes_fall_back_to_one_call_each():
    rng = np.random.default_rng(2)
    a = _w4(rng, 6, 64, 32)
    q, s = quantize_int8(rng.standard_normal((5, 64)).astype(np.float32))
    b = Weight("int8", (5, 64), q, s)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    ya, yb = kernels.matmul_many(x, [a, b])
    np.testing.assert_array_equal(ya, kernels.matmul(x, a))
    np.testing.assert_array_equal(yb, kernels.matmul(x, b))


@pytest.mark.parametrize("H,I,gs", [(64, 32, 32), (136, 66, 64), (2048, 1024, 64)])
def test_swiglu_many_equals_expert_ffn(H, I, gs):
    rng = np.random.default_rng(H)
    ffns = [ExpertFFN(_w4(rng, I, H, gs), _w4(rng, I, H, gs), _w4(rng, H, I, gs)) for _ in range(4)]
    x = rng.standard_normal((6, H)).astype(np.float32)
    spans = [(0, 6), (1, 1), (3, 2), (5, 1)]
    xs = np.concatenate([x[a: a + n] for a, n in spans])
    at, rows = 0, []
    for _, n in spans:
        rows.append((at, n))
        at += n
    for threads in (1, 2):
        qm.set_num_threads(threads)
        y = kernels.swiglu_many(xs, ffns, rows)
        for f, (a, n) in zip(ffns, rows):
            np.testing.assert_array_equal(y[a: a + n], expert_ffn(xs[a: a + n], f))


@pytest.mark.parametrize("H,I,gs", [(64, 32, 32), (136, 66, 64), (2048, 1024, 64), (130, 70, 128)])
def test_swiglu_one_equals_expert_ffn(H, I, gs):
    """Decode's one-call MoE block: each expert's row lands where asked, with expert_ffn's bits,
    for every SIMD variant, thread count and the int8-activation path."""
    rng = np.random.default_rng(H + I)
    ffns = [ExpertFFN(_w4(rng, I, H, gs), _w4(rng, I, H, gs), _w4(rng, H, I, gs)) for _ in range(5)]
    x = rng.standard_normal((1, H)).astype(np.float32)
    x[0, :3] = (-100.0, 100.0, 0.0)       # exp overflow inside silu stays silent and exact
    at = [3, 0, 6, 1, 4]
    for variant in qm.simd_variants():
        qm.set_simd(variant)
        for i8 in (False, True):
            qm.set_int8_activations(i8)
            qm.set_num_threads(1)
            want = [expert_ffn(x, f) for f in ffns]
            for threads in (1, 2):
                qm.set_num_threads(threads)
                out = np.full((7, H), np.nan, np.float32)
                kernels.swiglu_one(x, ffns, out, at)
                for f, k, w in zip(ffns, at, want):
                    np.testing.assert_array_equal(out[k: k + 1], w, err_msg=f"{variant} i8={i8} t={threads}")
                assert np.isnan(out[[2, 5]]).all()          # rows not asked for are untouched


def test_swiglu_one_rejects_bad_input_and_falls_back_for_other_schemes():
    rng = np.random.default_rng(3)
    f = ExpertFFN(_w4(rng, 32, 64, 32), _w4(rng, 32, 64, 32), _w4(rng, 64, 32, 32))
    x = rng.standard_normal((1, 64)).astype(np.float32)
    parts = (f.gate.data, f.gate.scales, f.up.data, f.up.scales, f.down.data, f.down.scales)
    out = np.empty((2, 64), np.float32)
    with pytest.raises(ValueError, match="outside"):
        qm.swiglu_one(x, [parts], 32, out, [2])
    with pytest.raises(ValueError, match="distinct"):
        qm.swiglu_one(x, [parts, parts], 32, out, [1, 1])
    with pytest.raises(ValueError, match="up_s"):
        qm.swiglu_one(x, [parts[:3] + (parts[3][:, :1],) + parts[4:]], 32, out, [0])
    with pytest.raises(ValueError, match="down_w"):
        qm.swiglu_one(x, [parts[:4] + (parts[4][:10],) + parts[5:]], 32, out, [0])
    with pytest.raises(ValueError, match="x must be"):
        qm.swiglu_one(np.ascontiguousarray(np.vstack([x, x])), [parts], 32, out, [0])
    with pytest.raises(ValueError, match="out must be"):
        qm.swiglu_one(x, [parts], 32, out.astype(np.float64), [0])
    q, s = quantize_int8(rng.standard_normal((32, 64)).astype(np.float32))
    mixed = ExpertFFN(Weight("int8", (32, 64), q, s), f.up, f.down)
    kernels.swiglu_one(x, [f, mixed], out, [1, 0])
    np.testing.assert_array_equal(out[1:], expert_ffn(x, f))
    np.testing.assert_array_equal(out[:1], expert_ffn(x, mixed))


def test_store_batches_hits_together(containers):
    """request_batches yields all hits as the first batch, then misses; every expert once."""
    c4 = containers(oracle_names()[0], 4)
    engine = open_model(c4, cap=3, prefetch=False)
    store = engine.store
    list(store.request(0, [0, 1]))                 # 0 and 1 now resident
    batches = [[e for e, _ in b] for b in store.request_batches(0, [1, 2, 0])]
    assert sorted(batches[0]) == [0, 1]
    assert sorted(e for b in batches for e in b) == [0, 1, 2]
    store.close()


def test_many_rows_go_through_sgemm_with_its_bits(monkeypatch):
    """Without the prefill GEMM (COLI_PREFILL_GEMM=0, or a CPU without it) a matrix applied to >=
    SGEMM_MIN_ROWS rows is dequantized and multiplied by numpy: the bits of x @
    dequantize_int4(W).T, whichever call (matmul, matmul_many, fused or not) carries it. (With
    the GEMM: tests/test_prefill.py.)"""
    from core.quant import dequantize_int4
    monkeypatch.setattr(kernels, "PREFILL_GEMM", False)
    rng = np.random.default_rng(5)
    n = kernels.SGEMM_MIN_ROWS
    if not n:
        pytest.skip("sgemm prefill path switched off (COLI_SGEMM_ROWS=0)")
    a, b = _w4(rng, 48, 130, 64), _w4(rng, 20, 130, 64)
    x = rng.standard_normal((n + 3, 130)).astype(np.float32)
    want = x @ dequantize_int4(a.data, a.scales, 130, 64).T
    np.testing.assert_array_equal(kernels.matmul(x, a), want)
    for threads in (0, 1, 2):
        np.testing.assert_array_equal(qm.q4_dequantize(a.data, a.scales, 130, 64, threads=threads),
                                      dequantize_int4(a.data, a.scales, 130, 64))
    ya, yb, yc = kernels.matmul_many(x, [a, b, a], [(0, n + 3), (1, 2), (2, 1)])
    np.testing.assert_array_equal(ya, want)
    np.testing.assert_array_equal(yb, qm.q4_matmul(x[1:3], b.data, b.scales, 130, 64))
    np.testing.assert_array_equal(yc, qm.q4_matmul(x[2:3], a.data, a.scales, 130, 64))
