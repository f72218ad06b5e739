"""Compiled int4 / int8 matmul kernels against the numpy references in core.quant."""
import numpy as np
import pytest

from core.quant import (
    dequantize_int4,
    dequantize_int8,
    int4_shapes,
    matmul_int4_ref,
    matmul_int8_ref,
    quantize_int4,
    quantize_int8,
)

qm = pytest.importorskip("cython_kernels.qmatmul", reason="compiled kernels not built")


@pytest.fixture(autouse=True)
def _restore_threads():
    yield
    qm.set_num_threads(0)


def _close(y, ref, x, wdq):
    """Within 1e-5 of sum |x_i * w_i| per output (~1e-4 relative to typical outputs)."""
    assert y.shape == ref.shape and y.dtype == np.float32
    scale = np.abs(np.asarray(x, np.float64)).reshape(-1, wdq.shape[1]) @ np.abs(wdq.astype(np.float64)).T
    err = np.abs(y.astype(np.float64) - ref.astype(np.float64)).reshape(scale.shape)
    assert (err <= 1e-5 * scale + 1e-30).all(), float((err / (scale + 1e-30)).max())


def _close4(y, x, w, s, cols, gs):
    _close(y, matmul_int4_ref(x, w, s, cols, gs), x, dequantize_int4(w, s, cols, gs))


def _close8(y, x, q, s):
    _close(y, matmul_int8_ref(x, q, s), x, dequantize_int8(q, s))


def _int4_case(rng, O, cols, gs, T):
    w, s = quantize_int4(rng.standard_normal((O, cols)).astype(np.float32), gs)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    return x, w, s


INT4_CASES = [
    # (O, cols, group_size)
    (1, 64, 64),
    (1, 2048, 64),
    (37, 64, 32),
    (64, 100, 64),      # last group partial
    (33, 129, 32),      # odd cols
    (17, 1, 64),        # a single element
    (8, 7, 128),        # cols < group size, odd
    (50, 1000, 128),
    (13, 333, 128),
    (96, 2048, 32),
    (65, 4096, 128),
    (11, 30, 6),        # groups that are not whole 32-bit words
    (9, 21, 2),
    (10, 517, 10),
]


@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("O,cols,gs", INT4_CASES)
def test_q4_matches_reference(O, cols, gs, T):
    rng = np.random.default_rng(O * 1000 + cols + gs + T)
    x, w, s = _int4_case(rng, O, cols, gs, T)
    assert (w.shape, s.shape) == int4_shapes(O, cols, gs)
    _close4(qm.q4_matmul(x, w, s, cols, gs), x, w, s, cols, gs)


INT8_CASES = [(1, 64), (1, 2048), (37, 100), (33, 129), (5, 1), (64, 15), (50, 1000), (96, 4096)]


@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("O,cols", INT8_CASES)
def test_q8_matches_reference(O, cols, T):
    rng = np.random.default_rng(O * 1000 + cols + T)
    q, s = quantize_int8(rng.standard_normal((O, cols)).astype(np.float32))
    x = rng.standard_normal((T, cols)).astype(np.float32)
    _close8(qm.q8_matmul(x, q, s), x, q, s)
    _close8(qm.q8_matmul(x, q.view(np.int8), s), x, q, s)   # int8 memory is accepted as well


def test_q4_extreme_nibbles():
    """All 16 nibble values, both nibble positions, a scale per group."""
    rng = np.random.default_rng(1)
    O, cols, gs = 16, 96, 32
    w = rng.integers(0, 256, size=(O, cols // 2), dtype=np.uint8)
    w[0] = 0x00
    w[1] = 0xFF
    w[2] = 0x0F
    w[3] = 0xF0
    s = rng.uniform(0.01, 2.0, size=(O, cols // gs)).astype(np.float32)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    _close4(qm.q4_matmul(x, w, s, cols, gs), x, w, s, cols, gs)


def test_q8_extreme_values():
    q = np.array([[-128, 127, -1, 0, 1] * 7, [127] * 35, [-128] * 35], dtype=np.int8).view(np.uint8)
    s = np.array([0.5, 1.0, 2.0], dtype=np.float32)
    x = np.linspace(-1, 1, 2 * 35, dtype=np.float32).reshape(2, 35)
    _close8(qm.q8_matmul(x, q, s), x, q, s)


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_bit_identical_across_thread_counts(kind):
    rng = np.random.default_rng(7)
    O, cols, gs = 301, 1000, 64
    if kind == "q4":
        x, w, s = _int4_case(rng, O, cols, gs, 7)
        run = lambda x: qm.q4_matmul(x, w, s, cols, gs)  # noqa: E731
    else:
        w, s = quantize_int8(rng.standard_normal((O, cols)).astype(np.float32))
        x = rng.standard_normal((7, cols)).astype(np.float32)
        run = lambda x: qm.q8_matmul(x, w, s)  # noqa: E731
    results = {}
    for n in (1, 2, 3):
        qm.set_num_threads(n)
        results[n] = (run(x), run(x[:1]))
    for n in (2, 3):
        assert np.array_equal(results[1][0], results[n][0])
        assert np.array_equal(results[1][1], results[n][1])
    # decode (T == 1) and prefill (T > 1) use the same per-row arithmetic
    assert np.array_equal(results[1][1][0], results[1][0][0])
    for t in range(7):
        assert np.array_equal(run(x[t:t + 1])[0], results[1][0][t])


def test_threads_api():
    assert isinstance(qm.openmp_enabled(), bool)
    default = qm.get_num_threads()
    assert isinstance(default, int) and default >= 1
    qm.set_num_threads(2)
    assert qm.get_num_threads() == (2 if qm.openmp_enabled() else 1)
    qm.set_num_threads(0)
    assert qm.get_num_threads() == default


def test_package_exports():
    import cython_kernels

    for name in ("q4_matmul", "q8_matmul", "set_num_threads", "get_num_threads", "openmp_enabled"):
        assert callable(getattr(cython_kernels, name))


def test_out_argument_and_1d_input():
    rng = np.random.default_rng(3)
    O, cols, gs = 20, 128, 64
    x, w, s = _int4_case(rng, O, cols, gs, 2)
    out = np.full((2, O), np.nan, dtype=np.float32)
    y = qm.q4_matmul(x, w, s, cols, gs, out=out)
    assert y is out
    _close4(out, x, w, s, cols, gs)
    y1 = qm.q4_matmul(x[0], w, s, cols, gs)
    assert y1.shape == (O,) and np.array_equal(y1, out[0])
    q, s8 = quantize_int8(rng.standard_normal((O, cols)).astype(np.float32))
    out8 = np.empty((2, O), dtype=np.float32)
    assert qm.q8_matmul(x, q, s8, out=out8) is out8
    _close8(out8, x, q, s8)
    with pytest.raises(ValueError):
        qm.q4_matmul(x, w, s, cols, gs, out=np.empty((2, O + 1), dtype=np.float32))


def test_noncontiguous_and_empty_inputs():
    rng = np.random.default_rng(4)
    O, cols, gs = 12, 64, 32
    x, w, s = _int4_case(rng, O, cols, gs, 6)
    xs = x[::2]   # not C-contiguous: copied
    _close4(qm.q4_matmul(xs, w, s, cols, gs), xs, w, s, cols, gs)
    assert qm.q4_matmul(x[:0], w, s, cols, gs).shape == (0, O)
    q, s8 = quantize_int8(rng.standard_normal((O, cols)).astype(np.float32))
    assert qm.q8_matmul(x[:0], q, s8).shape == (0, O)


def test_shape_errors():
    rng = np.random.default_rng(5)
    x, w, s = _int4_case(rng, 4, 64, 32, 1)
    with pytest.raises(ValueError):
        qm.q4_matmul(x, w, s, 63, 32)            # cols disagrees with x
    with pytest.raises(ValueError):
        qm.q4_matmul(x, w, s, 64, 64)            # scales are for gs 32
    with pytest.raises(ValueError):
        qm.q4_matmul(x, w, s, 64, 31)            # odd group size
    with pytest.raises(TypeError):
        qm.q4_matmul(x, w.astype(np.int32), s, 64, 32)
    q, s8 = quantize_int8(rng.standard_normal((4, 64)).astype(np.float32))
    with pytest.raises(ValueError):
        qm.q8_matmul(x, q, s8[:3])
    with pytest.raises(ValueError):
        qm.q8_matmul(x[:, :32], q, s8)
