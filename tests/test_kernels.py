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
from tests.conftest import run_emulated

qm = pytest.importorskip("cython_kernels.qmatmul", reason="compiled kernels not built")


pytestmark = pytest.mark.usefixtures("kernel_settings")


ALL_VARIANTS = ["portable", "avx2", "avx512", "neon"]


@pytest.fixture(params=ALL_VARIANTS)
def variant(request):
    """Each SIMD variant this CPU runs (the others are skipped, not failed)."""
    if request.param not in qm.simd_variants():
        pytest.skip(f"SIMD variant {request.param} not supported here")
    qm.set_simd(request.param)
    yield request.param
    qm.set_simd("auto")


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
    (5, 70, 16),        # 8-byte chunks: AVX-512 falls back to AVX2
    (6, 200, 48),       # 24-byte groups: whole 8-byte chunks, not 16-byte ones
    (7, 300, 96),
    (4, 5000, 4096),    # one huge group, last one partial
    (3, 257, 256),
    (2, 9, 2),
]


@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("O,cols,gs", INT4_CASES)
def test_q4_matches_reference(O, cols, gs, T, variant):
    rng = np.random.default_rng(O * 1000 + cols + gs + T)
    x, w, s = _int4_case(rng, O, cols, gs, T)
    assert (w.shape, s.shape) == int4_shapes(O, cols, gs)
    _close4(qm.q4_matmul(x, w, s, cols, gs), x, w, s, cols, gs)


INT8_CASES = [(1, 64), (1, 2048), (37, 100), (33, 129), (5, 1), (64, 15), (50, 1000), (96, 4096),
              (3, 127), (3, 128), (3, 129), (4, 191)]


@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("O,cols", INT8_CASES)
def test_q8_matches_reference(O, cols, T, variant):
    rng = np.random.default_rng(O * 1000 + cols + T)
    q, s = quantize_int8(rng.standard_normal((O, cols)).astype(np.float32))
    x = rng.standard_normal((T, cols)).astype(np.float32)
    _close8(qm.q8_matmul(x, q, s), x, q, s)
    _close8(qm.q8_matmul(x, q.view(np.int8), s), x, q, s)   # int8 memory is accepted as well


@pytest.mark.parametrize("O", [1, 2, 3, 4, 5, 7, 64, 65, 130, 193, 700])
def test_q8_multirow_decode_bits(O, variant):
    """The multi-row int8 decode kernel (several row streams per pass) and the few-token kernel
    (T = 2..4) give exactly the bits of the one-row loop and the unpacked-row prefill they
    replaced, for rows that are not a multiple of the row count or the block, cols that are not a
    multiple of 64 / 128 (the padded tail), and 1 or 2 threads."""
    rng = np.random.default_rng(O)
    for cols in (1, 15, 63, 64, 65, 127, 128, 129, 300, 1000, 2049):
        w = rng.integers(-128, 128, size=(O, cols), dtype=np.int8)
        s = rng.uniform(0.001, 1.0, O).astype(np.float32)
        x = rng.standard_normal(cols).astype(np.float32)
        got = {}
        try:
            for nt in (1, 2):
                qm.set_num_threads(nt)
                for on in (False, True):
                    qm._set_q8_multirow(on)
                    got[nt, on] = qm.q8_matmul(x, w, s).view(np.int32)
        finally:
            qm._set_q8_multirow(True)
        pf = qm.q8_matmul(np.stack([x, -x, x]), w, s)[2].view(np.int32)
        for k, v in got.items():
            assert np.array_equal(v, pf), (cols, k)
        # a few tokens (the direct few-token kernel, T <= 4) and more (the unpacked rows) give
        # each token's decode bits, as the unpacked-row path does
        X = rng.standard_normal((5, cols)).astype(np.float32)
        one = np.stack([qm.q8_matmul(X[t], w, s) for t in range(5)]).view(np.int32)
        try:
            for on in (False, True):
                qm._set_q8_multirow(on)
                for T in (2, 3, 4, 5):
                    assert np.array_equal(qm.q8_matmul(X[:T], w, s).view(np.int32), one[:T]), (cols, T, on)
        finally:
            qm._set_q8_multirow(True)
        _close8(qm.q8_matmul(x[None], w.view(np.uint8), s), x[None], w.view(np.uint8), s)


@pytest.mark.parametrize("gs", [32, 64, 128, 256])
def test_q4_multirow_decode_bits(gs, variant):
    """The two-row AVX-512 int4 decode pass (table conversion, prefetch) gives exactly the bits of
    the one-row loop it replaced and of the prefill kernel: odd row counts (a lone middle row),
    cols that end inside a group or a chunk, 1 or 2 threads. (At other levels both settings run
    the same code.)"""
    rng = np.random.default_rng(gs)
    for O, cols in ((1, gs), (2, 2 * gs), (3, 2 * gs - 2), (5, 2 * gs + 2), (65, 1000), (300, 2048),
                    (7, 33), (4, 1)):
        x, w, s = _int4_case(rng, O, cols, gs, 1)
        got = {}
        try:
            for nt in (1, 2):
                qm.set_num_threads(nt)
                for on in (False, True):
                    qm._set_q4_multirow(on)
                    got[nt, on] = qm.q4_matmul(x, w, s, cols, gs).view(np.int32)
        finally:
            qm._set_q4_multirow(True)
        pf = qm.q4_matmul(np.concatenate([x, -x, x]), w, s, cols, gs)[2:].view(np.int32)
        for k, v in got.items():
            assert np.array_equal(v, pf), (O, cols, k)
        _close4(qm.q4_matmul(x, w, s, cols, gs), x, w, s, cols, gs)


def test_q4_extreme_nibbles(variant):
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


def test_q8_extreme_values(variant):
    q = np.array([[-128, 127, -1, 0, 1] * 7, [127] * 35, [-128] * 35], dtype=np.int8).view(np.uint8)
    s = np.array([0.5, 1.0, 2.0], dtype=np.float32)
    x = np.linspace(-1, 1, 2 * 35, dtype=np.float32).reshape(2, 35)
    _close8(qm.q8_matmul(x, q, s), x, q, s)


@pytest.mark.parametrize("kind", ["q4", "q8", "q4g48", "q4g128"])
def test_bit_identical_across_thread_counts(kind, variant):
    """Per variant: any thread count, and decode vs prefill rows, give the same bits (q4g128:
    two 64-element blocks per group and a partial last group in AVX2's lane layout)."""
    rng = np.random.default_rng(7)
    O, cols, gs = 301, 1000, {"q4g48": 48, "q4g128": 128}.get(kind, 64)
    if kind.startswith("q4"):
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

    for name in ("q4_matmul", "q8_matmul", "expert_swiglu", "set_num_threads", "get_num_threads",
                 "openmp_enabled", "simd_level", "simd_variants", "set_simd"):
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


# --- SIMD dispatch ---------------------------------------------------------------------------------

def test_simd_api():
    variants = qm.simd_variants()
    assert variants[0] == "portable" and set(variants) <= set(ALL_VARIANTS)
    assert qm.simd_level() == variants[-1]            # the best one by default
    for v in variants:
        qm.set_simd(v)
        assert qm.simd_level() == v
    qm.set_simd("auto")
    assert qm.simd_level() == variants[-1]
    with pytest.raises(ValueError):
        qm.set_simd("sse9")
    for v in ALL_VARIANTS:
        if v not in variants:
            with pytest.raises(ValueError):
                qm.set_simd(v)
    assert qm.simd_level() == variants[-1]            # a refused name changes nothing


def test_variants_agree():
    """Every supported variant matches the portable one closely (not bit for bit)."""
    rng = np.random.default_rng(11)
    O, cols, gs = 40, 777, 32
    x, w, s = _int4_case(rng, O, cols, gs, 3)
    q, s8 = quantize_int8(rng.standard_normal((O, cols)).astype(np.float32))
    out = {}
    for v in qm.simd_variants():
        qm.set_simd(v)
        out[v] = (qm.q4_matmul(x, w, s, cols, gs), qm.q8_matmul(x, q, s8))
        _close4(out[v][0], x, w, s, cols, gs)
        _close8(out[v][1], x, q, s8)
    for v in out:
        np.testing.assert_allclose(out[v][0], out["portable"][0], rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(out[v][1], out["portable"][1], rtol=1e-4, atol=1e-3)


def test_large_matrix_threads(variant):
    """Many row blocks (more than the decode block of 64 rows), 1 vs 2 threads."""
    rng = np.random.default_rng(12)
    O, cols, gs = 1000, 256, 64
    x, w, s = _int4_case(rng, O, cols, gs, 5)
    qm.set_num_threads(1)
    a = qm.q4_matmul(x, w, s, cols, gs)
    qm.set_num_threads(2)
    b = qm.q4_matmul(x, w, s, cols, gs)
    assert np.array_equal(a, b)
    _close4(a, x, w, s, cols, gs)


# --- fused expert ----------------------------------------------------------------------------------

def _silu(g):
    with np.errstate(over="ignore"):
        return g * (np.float32(1.0) / (np.float32(1.0) + np.exp(-g)))


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("H,I,gs", [(64, 32, 32), (130, 70, 64), (33, 17, 16), (20, 30, 10)])
def test_expert_swiglu(H, I, gs, T, variant):
    rng = np.random.default_rng(H * 100 + I + T)
    gw, gsc = quantize_int4(rng.standard_normal((I, H)).astype(np.float32), gs)
    uw, usc = quantize_int4(rng.standard_normal((I, H)).astype(np.float32), gs)
    dw, dsc = quantize_int4(rng.standard_normal((H, I)).astype(np.float32), gs)
    x = rng.standard_normal((T, H)).astype(np.float32)
    y = qm.expert_swiglu(x, gw, gsc, uw, usc, dw, dsc, H, I, gs)
    # bit-identical to the unfused kernels ...
    h = _silu(qm.q4_matmul(x, gw, gsc, H, gs)) * qm.q4_matmul(x, uw, usc, H, gs)
    assert np.array_equal(y, qm.q4_matmul(h, dw, dsc, I, gs))
    # ... and close to the numpy reference
    g = matmul_int4_ref(x, gw, gsc, H, gs)
    u = matmul_int4_ref(x, uw, usc, H, gs)
    ref = matmul_int4_ref(_silu(g) * u, dw, dsc, I, gs)
    np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-3 * float(np.abs(ref).max()))
    y1 = qm.expert_swiglu(x[0], gw, gsc, uw, usc, dw, dsc, H, I, gs)
    assert y1.shape == (H,) and np.array_equal(y1, y[0])
    for n in (1, 2, 3):
        qm.set_num_threads(n)
        assert np.array_equal(qm.expert_swiglu(x, gw, gsc, uw, usc, dw, dsc, H, I, gs), y)


def test_expert_swiglu_errors():
    rng = np.random.default_rng(2)
    H, I, gs = 32, 16, 16
    gw, gsc = quantize_int4(rng.standard_normal((I, H)).astype(np.float32), gs)
    dw, dsc = quantize_int4(rng.standard_normal((H, I)).astype(np.float32), gs)
    x = rng.standard_normal((2, H)).astype(np.float32)
    with pytest.raises(ValueError):
        qm.expert_swiglu(x, gw, gsc, gw, gsc, dw, dsc, H, I + 2, gs)       # inter disagrees
    with pytest.raises(ValueError):
        qm.expert_swiglu(x[:, :-1], gw, gsc, gw, gsc, dw, dsc, H, I, gs)   # x columns
    with pytest.raises(ValueError):
        qm.expert_swiglu(x, gw, gsc, gw, gsc[:, :1], dw, dsc, H, I, gs)    # scales shape
    with pytest.raises(ValueError):
        qm.expert_swiglu(x, gw, gsc, gw, gsc, dw, dsc, H, I, 15)           # odd group size


# --- every SIMD variant, emulated ----------------------------------------------------------------
# A machine runs only the variants its CPU has. To check the AVX2, AVX-512 and NEON code everywhere,
# this compiles qkern.h (+ qkern_neon.h) with -DCOLI_SIMDE_TEST (the x86 and arm_neon intrinsics
# through SIMDe, https://github.com/simd-everywhere/simde: the simde-py package of the test extra,
# or e.g. Debian's libsimde-dev) into a small C program that runs every variant against a float64
# reference (int4 and int8; the int4 x int8-activation kernels against the sums of their own
# quantized x), in row blocks of 3 (as threads split them), and checks decode == prefill bit for
# bit. Skipped without a C compiler or SIMDe.
_EMU_SRC = r"""
#include "qkern.h"
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
static unsigned long long st = 88172645463325252ULL;
static unsigned rnd(void) { st ^= st << 13; st ^= st >> 7; st ^= st << 17; return (unsigned)(st >> 11); }
static float xoff = 0.0f;
static float frnd(void) { return xoff + (float)((int)(rnd() % 20001) - 10000) / 5000.0f; }
static int fails = 0;
static void check(const char *what, int lv, long O, long cols, long gs, long T, const float *y,
                  const double *ref, const double *mag)
{
    long i;
    for (i = 0; i < O * T; i++)
        if (!(fabs(y[i] - ref[i]) <= 1e-5 * mag[i] + 1e-30)) {
            printf("FAIL %s lv%d O=%ld cols=%ld gs=%ld T=%ld i=%ld y=%g ref=%g\n", what, lv, O, cols,
                   gs, T, i, y[i], ref[i]);
            fails++;
            return;
        }
}
static void q4case(long O, long cols, long gs, long T)
{
    long nb = (cols + 1) / 2, ng = (cols + gs - 1) / gs, L = ng * gs, i, t, o, lv;
    uint8_t *w = malloc(O * nb + 1);
    float *s = malloc(O * ng * 4), *x = malloc(T * cols * 4), *xp = malloc(T * L * 4);
    float *gi = malloc(T * ng * coli_q4_gstride(gs) * 4), *y = malloc(T * O * 4), *y1 = malloc(O * 4);
    float *U = malloc(64 * L * 4);
    double *ref = malloc(T * O * 8), *mag = malloc(T * O * 8);
    for (i = 0; i < O * nb; i++) w[i] = (uint8_t)rnd();
    for (i = 0; i < O * ng; i++) s[i] = 0.01f + (rnd() % 1000) / 1000.0f;
    for (i = 0; i < T * cols; i++) x[i] = frnd();
    for (t = 0; t < T; t++)
        for (o = 0; o < O; o++) {
            double a = 0, m = 0;
            for (i = 0; i < cols; i++) {
                int b = w[o * nb + i / 2], n = (i & 1) ? b >> 4 : b & 15;
                double v = (double)(n - 8) * s[o * ng + i / gs] * x[t * cols + i];
                a += v; m += fabs(v);
            }
            ref[t * O + o] = a; mag[t * O + o] = m;
        }
    for (lv = 0; lv < COLI_NLEVELS; lv++) {
        int q = coli_q4_level((int)lv, gs), cb = coli_q4_cb((int)lv, gs);
        long r0;
        if (!coli_simd_supported((int)lv)) continue;
        coli_q4_prep(cb, x, T, cols, gs, ng, xp, gi);
        for (r0 = 0; r0 < O; r0 += 3) {
            long r1 = r0 + 3 < O ? r0 + 3 : O;
            coli_q4_rows(q, w, s, xp, gi, y, U, r0, r1, T, O, nb, ng, gs);
        }
        check("q4", (int)lv, O, cols, gs, T, y, ref, mag);
        for (t = 0; t < T; t++) {      /* decode of each token == its prefill row, bit for bit */
            coli_q4_prep(cb, x + t * cols, 1, cols, gs, ng, xp, gi);
            coli_q4_rows(q, w, s, xp, gi, y1, U, 0, O, 1, O, nb, ng, gs);
            for (o = 0; o < O; o++)
                if (memcmp(&y1[o], &y[t * O + o], 4)) {
                    printf("FAIL q4 decode!=prefill lv%ld cols=%ld gs=%ld\n", lv, cols, gs);
                    fails++; t = T; break;
                }
        }
    }
    free(w); free(s); free(x); free(xp); free(gi); free(y); free(y1); free(U); free(ref); free(mag);
}
static void q8case(long O, long cols, long T)
{
    long i, t, o, lv;
    int8_t *w = malloc(O * cols);
    float *s = malloc(O * 4), *x = malloc(T * cols * 4), *y = malloc(T * O * 4), *y1 = malloc(O * 4);
    long Lp = (cols + 127) / 128 * 128;
    float *xp = malloc(T * Lp * 4), *U = malloc(Lp * 4);
    double *ref = malloc(T * O * 8), *mag = malloc(T * O * 8);
    for (i = 0; i < O * cols; i++) w[i] = (int8_t)(rnd() % 255 - 127);
    for (i = 0; i < O; i++) s[i] = 0.01f + (rnd() % 1000) / 1000.0f;
    for (i = 0; i < T * cols; i++) x[i] = frnd();
    for (t = 0; t < T; t++)
        for (o = 0; o < O; o++) {
            double a = 0, m = 0;
            for (i = 0; i < cols; i++) {
                double v = (double)w[o * cols + i] * s[o] * x[t * cols + i];
                a += v; m += fabs(v);
            }
            ref[t * O + o] = a; mag[t * O + o] = m;
        }
    for (lv = 0; lv < COLI_NLEVELS; lv++) {
        long L = (cols + coli_q8_block((int)lv) - 1) / coli_q8_block((int)lv) * coli_q8_block((int)lv);
        if (!coli_simd_supported((int)lv)) continue;
        coli_q8_prep(x, T, cols, L, xp);
        coli_q8_rows((int)lv, w, s, xp, y, U, 0, O, T, O, cols, L);
        check("q8", (int)lv, O, cols, 0, T, y, ref, mag);
        for (t = 0; t < T; t++) {
            coli_q8_prep(x + t * cols, 1, cols, L, xp);
            coli_q8_rows((int)lv, w, s, xp, y1, U, 0, O, 1, O, cols, L);
            for (o = 0; o < O; o++)
                if (memcmp(&y1[o], &y[t * O + o], 4)) {
                    printf("FAIL q8 decode!=prefill lv%ld cols=%ld\n", lv, cols);
                    fails++; t = T; break;
                }
        }
    }
    free(w); free(s); free(x); free(y); free(y1); free(xp); free(U); free(ref); free(mag);
}
static void q4i8case(long O, long cols, long gs, long T)
{
    long nb = (cols + 1) / 2, ng = (cols + gs - 1) / gs, L = ng * gs, i, t, o, lv, r0;
    uint8_t *w = malloc(O * nb + 1);
    float *s = malloc(O * ng * 4), *x = malloc(T * cols * 4), *y = malloc(T * O * 4), *y1 = malloc(O * 4);
    int8_t *xq = malloc(T * L);
    float *xd = malloc(T * (L / 64) * 8 * 4);
    int32_t *xc = malloc(T * (L / 64) * 8 * 4);
    double *ref = malloc(T * O * 8), *mag = malloc(T * O * 8);
    for (i = 0; i < O * nb; i++) w[i] = (uint8_t)rnd();
    for (i = 0; i < O * ng; i++) s[i] = 0.01f + (rnd() % 1000) / 1000.0f;
    for (i = 0; i < T * cols; i++) x[i] = frnd();
    coli_q4i8_prep(x, T, cols, L, xq, xd, xc);
    for (t = 0; t < T; t++)          /* exact: the sums of the quantized x the kernels see */
        for (o = 0; o < O; o++) {
            double a = 0, m = 0;
            for (i = 0; i < cols; i++) {
                long b = i / 64, h = (i % 64) / 32, j = i % 32;
                int q = xq[t * L + 64 * b + (j & 1) * 32 + 16 * h + j / 2];
                int by = w[o * nb + i / 2], n = (i & 1) ? by >> 4 : by & 15;
                double v = (double)(n - 8) * q * xd[(t * (L / 64) + b) * 8 + 4 * h] * s[o * ng + i / gs];
                a += v; m += fabs(v);
            }
            ref[t * O + o] = a; mag[t * O + o] = m;
        }
    for (lv = 1; lv < COLI_NLEVELS; lv++) {
        if (!coli_simd_supported((int)lv) || !coli_q4i8_ok((int)lv, gs)) continue;
        for (r0 = 0; r0 < O; r0 += 3)
            coli_q4i8_rows_level((int)lv, w, s, xq, xd, xc, y, r0, r0 + 3 < O ? r0 + 3 : O, T, O, nb, ng, gs);
        check("q4i8", (int)lv, O, cols, gs, T, y, ref, mag);
        for (t = 0; t < T; t++) {
            coli_q4i8_rows_level((int)lv, w, s, xq + t * L, xd + t * (L / 64) * 8, xc + t * (L / 64) * 8,
                                 y1, 0, O, 1, O, nb, ng, gs);
            for (o = 0; o < O; o++)
                if (memcmp(&y1[o], &y[t * O + o], 4)) {
                    printf("FAIL q4i8 decode!=prefill lv%ld cols=%ld gs=%ld\n", lv, cols, gs);
                    fails++; t = T; break;
                }
        }
    }
    free(w); free(s); free(x); free(y); free(y1); free(xq); free(xd); free(xc); free(ref); free(mag);
}
int main(void)
{
    static const long c4[][3] = {{5, 2048, 64}, {7, 129, 32}, {4, 517, 10}, {3, 1000, 128},
                                 {2, 4100, 4096}, {5, 70, 16}, {6, 200, 48}, {3, 96, 96},
                                 {4, 33, 64}, {3, 63, 32}, {2, 1, 64}, {3, 300, 256}};
    static const long c8[][2] = {{5, 2048}, {3, 1}, {4, 127}, {4, 128}, {4, 129}, {3, 300}, {2, 1000},
                                 {4, 31}, {3, 33}, {3, 200}};
    static const long c48[][3] = {{5, 2048, 64}, {7, 129, 64}, {3, 1000, 128}, {2, 4100, 4096},
                                  {4, 33, 64}, {2, 1, 64}, {3, 300, 256}, {4, 191, 192}};
    long i, T;
    printf("levels:");
    for (i = 0; i < COLI_NLEVELS; i++) {
        if (coli_simd_supported((int)i)) printf(" %s", coli_level_names[i]);
#ifdef COLI_SIMDE_TEST   /* this build emulates every variant */
        else { printf(" FAIL(%s not built)", coli_level_names[i]); fails++; }
#endif
    }
    printf("\n");
    for (T = 1; T <= 6; T += 5) {
        xoff = T == 1 ? 0.0f : 3.0f;   /* activations with a common offset: cancellation */
        for (i = 0; i < (long)(sizeof(c4) / sizeof(c4[0])); i++) q4case(c4[i][0], c4[i][1], c4[i][2], T);
        for (i = 0; i < (long)(sizeof(c8) / sizeof(c8[0])); i++) q8case(c8[i][0], c8[i][1], T);
        for (i = 0; i < (long)(sizeof(c48) / sizeof(c48[0])); i++) q4i8case(c48[i][0], c48[i][1], c48[i][2], T);
    }
    printf(fails ? "FAILED %d\n" : "OK\n", fails);
    return fails != 0;
}
"""


def test_simd_variants_emulated(tmp_path):
    run_emulated(tmp_path, _EMU_SRC)


# --- opt-in int8 activations -----------------------------------------------------------------------

def test_int8_activations_off_by_default():
    assert qm.int8_activations() is False


@pytest.mark.parametrize("O,cols,gs", [(256, 2048, 64), (64, 1000, 128), (33, 129, 64), (9, 63, 64),
                                       (20, 4096, 256), (7, 100, 32)])
def test_int8_activations_accuracy_and_determinism(O, cols, gs, variant):
    """Off by default; when on: deterministic, thread- and T-invariant, within its documented
    accuracy (x rounded to int8 per 32 elements -> ~0.5 % rms of the outputs)."""
    rng = np.random.default_rng(O + cols + gs)
    x, w, s = _int4_case(rng, O, cols, gs, 6)
    exact = qm.q4_matmul(x, w, s, cols, gs)
    qm.set_int8_activations(True)
    assert qm.int8_activations() is True
    y = qm.q4_matmul(x, w, s, cols, gs)
    ref = matmul_int4_ref(x, w, s, cols, gs)
    rms = np.sqrt(((y - ref) ** 2).mean() / (ref ** 2).mean())
    assert rms < 2e-2, rms
    for t in range(6):
        assert np.array_equal(qm.q4_matmul(x[t:t + 1], w, s, cols, gs)[0], y[t])
    for n in (1, 2, 3):
        qm.set_num_threads(n)
        assert np.array_equal(qm.q4_matmul(x, w, s, cols, gs), y)
    if variant == "portable" or gs % 64:
        assert np.array_equal(y, exact)          # no int8 path there: the float path runs
    qm.set_int8_activations(False)
    assert np.array_equal(qm.q4_matmul(x, w, s, cols, gs), exact)
