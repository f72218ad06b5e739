"""The prefill GEMM (cython_kernels/prefill.h, ``q4_prefill_many``): bits against its reference,
the same bits on every SIMD variant, thread count and grouping, and the MoE block's use of it."""
from __future__ import annotations

import numpy as np
import pytest

from core import kernels, quant
from core.blocks.mlp import expert_ffn
from core.container import Weight
from core.store import ExpertFFN

qm = pytest.importorskip("cython_kernels.qmatmul")
if not hasattr(qm, "q4_prefill_many"):
    pytest.skip("extension built before the prefill GEMM", allow_module_level=True)


def fma_chain_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y[t, o] = fma(x[t, k], w[o, k], ...) over k in order from +0, in numpy: the product of two
    float32 is exact in float64 and so is its sum with a float32 accumulator here (the test data's
    exponents stay within 53 - 48 bits of each other), so rounding that sum to float32 is the one
    rounding of a fused multiply-add."""
    acc = np.zeros((x.shape[0], w.shape[0]), np.float32)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    for k in range(x.shape[1]):
        acc = (acc.astype(np.float64) + np.outer(x64[:, k], w64[:, k])).astype(np.float32)
    return acc


def _w4(rng, O, cols, gs) -> Weight:
    d, s = quant.quantize_int4(rng.standard_normal((O, cols)).astype(np.float32), gs)
    return Weight("int4", (O, cols), d, s, gs)


def _deq(w: Weight) -> np.ndarray:
    return quant.dequantize_int4(w.data, w.scales, w.shape[1], w.group_size)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def _variants():
    return qm.simd_variants()


@pytest.fixture(autouse=True)
def _restore():
    yield
    qm.set_simd("auto")
    qm.set_num_threads(0)


# T: one vector, a vector's edge, five vectors (tiles 3 + 2), more than a tile; O: a work block's
# edge (48) and remainders of every tile width; odd cols and a partial last group
@pytest.mark.parametrize("O,cols,gs,T", [(50, 256, 64, 20), (97, 300, 32, 37), (48, 128, 128, 16),
                                         (13, 70, 10, 5), (61, 194, 64, 80), (7, 33, 2, 1),
                                         (130, 130, 64, 100), (5, 64, 64, 17)])
def test_matches_fma_chain_reference_on_every_variant_and_thread_count(O, cols, gs, T):
    rng = np.random.default_rng(O * 1000 + cols)
    w = _w4(rng, O, cols, gs)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    want = fma_chain_ref(x, _deq(w))
    for variant in _variants():
        qm.set_simd(variant)
        for threads in (1, 2, 3):
            qm.set_num_threads(threads)
            got = qm.q4_prefill_many(x, [(w.data, w.scales)], cols, gs)[0]
            np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"{variant} {threads}T")


def test_grouping_and_spans_do_not_change_bits():
    """Matrices on shared or separate row spans, in one call, give each matrix's own bits."""
    rng = np.random.default_rng(3)
    cols, gs = 192, 64
    ws = [_w4(rng, O, cols, gs) for O in (40, 96, 17, 40)]
    x = rng.standard_normal((70, cols)).astype(np.float32)
    rows = [(0, 70), (0, 70), (5, 33), (40, 1)]
    outs = [np.full((n, w.shape[0]), np.nan, np.float32) for (_, n), w in zip(rows, ws)]
    for variant in _variants():
        qm.set_simd(variant)
        got = qm.q4_prefill_many(x, [(w.data, w.scales) for w in ws], cols, gs, rows, outs)
        for (t0, n), w, y, o in zip(rows, ws, got, outs):
            assert y is o
            alone = qm.q4_prefill_many(x[t0: t0 + n], [(w.data, w.scales)], cols, gs)[0]
            np.testing.assert_array_equal(_bits(y), _bits(alone))
            np.testing.assert_array_equal(_bits(y), _bits(fma_chain_ref(x[t0: t0 + n], _deq(w))))


def test_close_to_float64():
    rng = np.random.default_rng(9)
    w = _w4(rng, 300, 2048, 64)
    x = rng.standard_normal((64, 2048)).astype(np.float32)
    got = qm.q4_prefill_many(x, [(w.data, w.scales)], 2048, 64)[0]
    want = x.astype(np.float64) @ _deq(w).astype(np.float64).T
    assert np.abs(got - want).max() <= 1e-5 * np.abs(x).sum(axis=1).max() * np.abs(_deq(w)).max()


def test_empty_and_bad_inputs():
    rng = np.random.default_rng(1)
    w = _w4(rng, 8, 64, 32)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    y = qm.q4_prefill_many(x, [(w.data, w.scales)], 64, 32, [(1, 0)])[0]
    assert y.shape == (0, 8)
    with pytest.raises(ValueError):
        qm.q4_prefill_many(x, [(w.data, w.scales)], 64, 32, [(3, 2)])
    with pytest.raises(ValueError):
        qm.q4_prefill_many(x[:, :32], [(w.data, w.scales)], 64, 32)
    with pytest.raises(ValueError):
        qm.q4_prefill_many(x, [(w.data, w.scales[:, :1])], 64, 32)
    with pytest.raises(ValueError):
        qm.q4_prefill_many(x, [(w.data, w.scales)], 64, 32, None, [np.empty((4, 6), np.float32)])


def test_moe_prefill_uses_the_gemm_from_the_sgemm_row_count(monkeypatch):
    """swiglu_many: experts of >= SGEMM_MIN_ROWS rows get the GEMM's bits (gate, up, silu, down),
    fewer rows the int4 loops' (expert_ffn's); COLI_PREFILL_GEMM=0 (PREFILL_GEMM False) restores
    dequantize + sgemm. Neither depends on the thread count."""
    if kernels.backend() != "cython" or qm.prefill_level() == "portable":
        pytest.skip("no prefill GEMM on this CPU / build")
    monkeypatch.setattr(kernels, "SGEMM_MIN_ROWS", 32)
    rng = np.random.default_rng(7)
    H, I, gs = 128, 64, 64
    ffns = [ExpertFFN(_w4(rng, I, H, gs), _w4(rng, I, H, gs), _w4(rng, H, I, gs)) for _ in range(3)]
    x = rng.standard_normal((90, H)).astype(np.float32)
    rows = [(0, 40), (40, 5), (45, 45)]

    def gemm_ref(xe, f):
        g, u = fma_chain_ref(xe, _deq(f.gate)), fma_chain_ref(xe, _deq(f.up))
        return fma_chain_ref(kernels.silu(g) * u, _deq(f.down))

    for threads in (1, 2):
        qm.set_num_threads(threads)
        y = kernels.swiglu_many(x, ffns, rows)
        for (t0, n), f in zip(rows, ffns):
            want = gemm_ref(x[t0: t0 + n], f) if n >= 32 else expert_ffn(x[t0: t0 + n], f)
            np.testing.assert_array_equal(_bits(y[t0: t0 + n]), _bits(want))
    monkeypatch.setattr(kernels, "PREFILL_GEMM", False)
    y = kernels.swiglu_many(x, ffns, rows)
    for (t0, n), f in zip(rows, ffns):
        np.testing.assert_array_equal(_bits(y[t0: t0 + n]), _bits(expert_ffn(x[t0: t0 + n], f)))


@pytest.mark.parametrize("T,k,H", [(64, 8, 256), (7, 1, 33), (40, 4, 130)])
def test_rank_combine_has_numpys_bits(T, k, H):
    """The MoE block's prefill sum: numpy's contrib = y[slots] * w, then add.reduce over ranks."""
    rng = np.random.default_rng(T + k + H)
    y = rng.standard_normal((T * k + 3, H)).astype(np.float32)
    slots = rng.permutation(T * k + 3)[: T * k].reshape(T, k)
    w = rng.random((T, k)).astype(np.float32)
    want = np.add.reduce(y[slots] * w[:, :, None], axis=1)
    for threads in (1, 2):
        qm.set_num_threads(threads)
        np.testing.assert_array_equal(_bits(kernels.rank_combine(y, slots, w)), _bits(want))
    bad = slots.copy()
    bad[0, 0] = -1
    with pytest.raises(ValueError):
        qm.rank_combine(y, bad, w)
