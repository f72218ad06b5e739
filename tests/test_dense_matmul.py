"""The row-invariant dense float32 products (cython_kernels/dense.h, ``dense_matmul`` /
``dense_matmul_t``): bits against a numpy emulation of their order, the same bits for one row and
many, every thread count and every SIMD variant (those the CPU lacks through SIMDe), close to
float64; and their use by core.kernels (bits-16 weights, the router) so that decode and prefill
give the same bits."""
from __future__ import annotations

import numpy as np
import pytest

from core import kernels
from core.container import Weight
from tests.conftest import attention_one_row_at_a_time, decode_and_prefill, run_emulated

qm = pytest.importorskip("cython_kernels.qmatmul")
if not hasattr(qm, "dense_matmul"):
    pytest.skip("extension built before the dense kernel", allow_module_level=True)


def _fma(acc: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """fma(a, b, acc) in float32, elementwise: a * b is exact in float64 and so is its sum with the
    accumulator here (the test data's exponents stay within 53 - 48 bits of each other), so
    rounding it to float32 is the one rounding of a fused multiply-add."""
    return (acc.astype(np.float64) + a.astype(np.float64) * b.astype(np.float64)).astype(np.float32)


def lanes_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """dense.h's order: lane j = fma chain over k = j (mod 16) in increasing k from +0, then
    ((l0+l8)+(l4+l12)) + ((l2+l10)+(l6+l14)) + (((l1+l9)+(l5+l13)) + ((l3+l11)+(l7+l15)))."""
    T, K = x.shape
    lanes = np.zeros((T, w.shape[0], 16), np.float32)
    for k in range(K):
        lanes[:, :, k % 16] = _fma(lanes[:, :, k % 16], x[:, k, None], w[None, :, k])
    s8 = lanes[..., :8] + lanes[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    return (s4[..., 0] + s4[..., 2]) + (s4[..., 1] + s4[..., 3])


def chain_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """dense_matmul_t's order: y[t, i] = one fma chain over o in increasing o from +0."""
    acc = np.zeros((x.shape[0], w.shape[1]), np.float32)
    for o in range(x.shape[1]):
        acc = _fma(acc, x[:, o, None], w[None, o, :])
    return acc


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.fixture(autouse=True)
def _restore():
    yield
    qm.set_simd("auto")
    qm.set_num_threads(0)


def _data(T, K, O, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((T, K)).astype(np.float32), rng.standard_normal((O, K)).astype(np.float32)


# K: a 16-lane step's edge, shorter than one step, a partial last step, several k panels (1024)
# with a partial step after them; O: tile (6 / 3) and work-block (96) remainders; T: a tile's
# rows (4 / 2), a work block's (64) and more, none
@pytest.mark.parametrize("T,K,O", [(1, 2048, 50), (5, 1100, 97), (37, 17, 13), (3, 15, 7),
                                   (70, 2100, 101), (1, 0, 5), (0, 10, 3), (9, 16, 1), (2, 1, 2),
                                   (66, 64, 192)])
def test_dense_matmul_has_its_order_on_every_variant_thread_count_and_row_count(T, K, O):
    x, w = _data(T, K, O, T * 1000 + K + O)
    want = _bits(lanes_ref(x, w))
    for variant in qm.simd_variants():
        qm.set_simd(variant)
        for threads in (1, 2, 3):
            qm.set_num_threads(threads)
            y = qm.dense_matmul(x, w)
            assert y.shape == (T, O) and y.dtype == np.float32
            np.testing.assert_array_equal(_bits(y), want, err_msg=f"{variant}, {threads} threads")
        for t in range(0, T, max(1, T // 5)):        # one row alone: the bits of its row
            np.testing.assert_array_equal(_bits(qm.dense_matmul(x[t: t + 1], w)), want[t: t + 1])


@pytest.mark.parametrize("T,O,I", [(1, 128, 512), (6, 33, 70), (5, 1, 16), (9, 7, 3), (0, 4, 4),
                                   (3, 0, 5), (130, 20, 100)])
def test_dense_matmul_t_has_its_order_on_every_variant_thread_count_and_row_count(T, O, I):
    rng = np.random.default_rng(T + O + I)
    x = rng.standard_normal((T, O)).astype(np.float32)
    w = rng.standard_normal((O, I)).astype(np.float32)
    want = _bits(chain_ref(x, w))
    for variant in qm.simd_variants():
        qm.set_simd(variant)
        for threads in (1, 2):
            qm.set_num_threads(threads)
            y = qm.dense_matmul_t(x, w)
            assert y.shape == (T, I)
            np.testing.assert_array_equal(_bits(y), want, err_msg=f"{variant}, {threads} threads")
        for t in range(T):
            np.testing.assert_array_equal(_bits(qm.dense_matmul_t(x[t: t + 1], w)), want[t: t + 1])


def test_close_to_float64():
    x, w = _data(40, 3000, 70, 5)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
    assert (np.abs(qm.dense_matmul(x, w) - ref) / scale).max() < 2e-6
    xt = x[:, :70].copy()
    ref_t = xt.astype(np.float64) @ w.astype(np.float64)
    assert (np.abs(qm.dense_matmul_t(xt, w) - ref_t) / (np.abs(xt) @ np.abs(w))).max() < 2e-6


def test_bad_shapes_are_one_clear_error():
    x, w = _data(3, 8, 4, 1)
    with pytest.raises(ValueError, match="columns"):
        qm.dense_matmul(x, w[:, :7])
    with pytest.raises(ValueError, match="2-D"):
        qm.dense_matmul(x[0], w)
    with pytest.raises(ValueError, match="rows"):
        qm.dense_matmul_t(x, w)
    with pytest.raises(ValueError):
        qm.dense_matmul(x, w, out=np.empty((3, 5), np.float32))


def _runs_dense() -> bool:
    return kernels._dense_compiled()


@pytest.mark.skipif(not _runs_dense(), reason="the dense kernel does not run here (portable x86: numpy)")
def test_kernels_give_one_row_the_bits_of_many():
    """core.kernels' dense products and the router: row t of a prefill-sized call (below and above
    SGEMM_MIN_ROWS / ROUTER_C_ROWS) has the bits of the one-row call of decode."""
    x, w = _data(70, 300, 64, 11)
    dense = Weight("dense", w.shape, w)
    for T in (2, 31, 32, 70):
        many = [kernels.matmul(x[:T], dense), kernels.router_logits(x[:T], w),
                kernels.matmul_t(x[:T, :64], Weight("dense", (64, 300), w))]
        for t in (0, T // 2, T - 1):
            one = [kernels.matmul(x[t: t + 1], dense), kernels.router_logits(x[t: t + 1], w),
                   kernels.matmul_t(x[t: t + 1, :64], Weight("dense", (64, 300), w))]
            for a, b in zip(many, one):
                np.testing.assert_array_equal(_bits(a[t: t + 1]), _bits(b))
    # the C router (the compiled attention block's) has the same bits
    np.testing.assert_array_equal(_bits(qm.router_logits(x[:5], w)), _bits(kernels.router_logits(x[:5], w)))


# one fixture per family (Qwen3.5's linear layers: tests/test_qwen3_5_moe.py); not glmdsa: its
# sparse-attention indexer multiplies activations (numpy, batched in prefill) and the selected
# positions' attention runs through numpy at every row count
@pytest.mark.skipif(not _runs_dense(), reason="the dense kernel does not run here (portable x86: numpy)")
@pytest.mark.parametrize("name", ["olmoe-a", "qwen3moe-a", "glm4moe-a", "deepseekv3-a", "kimilinear-a"])
def test_bits16_decode_equals_prefill_with_one_row_attention(name, fixture_root, containers, monkeypatch):
    """A bits-16 model's decode has the bits of its prefill once prefill's attention (numpy's
    batched scores, where decode runs the compiled attend_one) also runs one row at a time: every
    matrix product (dense_matmul / dense_matmul_t) and the router give one row the bits it gets
    among many."""
    from models import open_model
    monkeypatch.setattr(kernels, "attention", attention_one_row_at_a_time(kernels.attention))
    engine = open_model(containers(name, 16))
    decoded, prefilled = decode_and_prefill(engine, np.load(fixture_root / name / "reference.npz")["ids"].tolist())
    np.testing.assert_array_equal(decoded, prefilled)


# the AVX2 / AVX-512 loops (and NEON's portable ones) through SIMDe's emulation, for machines that
# lack them, under AddressSanitizer where the toolchain has it (the masked tails, the copied
# panels); SIMDe computes fused multiply-adds as two roundings, so the harness puts fused ones
# (fmaf per lane) in their place, as the hardware computes them
_EMU_DENSE = r"""
#include "qkern.h"
static __m256 emu_fma8(__m256 a, __m256 b, __m256 c)
{ float x[8], y[8], z[8]; int i; _mm256_storeu_ps(x, a); _mm256_storeu_ps(y, b); _mm256_storeu_ps(z, c);
  for (i = 0; i < 8; i++) x[i] = fmaf(x[i], y[i], z[i]); return _mm256_loadu_ps(x); }
static __m512 emu_fma16(__m512 a, __m512 b, __m512 c)
{ float x[16], y[16], z[16]; int i; _mm512_storeu_ps(x, a); _mm512_storeu_ps(y, b); _mm512_storeu_ps(z, c);
  for (i = 0; i < 16; i++) x[i] = fmaf(x[i], y[i], z[i]); return _mm512_loadu_ps(x); }
/* SIMDe's masked loads / stores touch the whole vector; the hardware's read and write only the
 * lanes of the mask (and fault on no other): emulate that, so that ASan judges the kernel's
 * accesses, not the emulation's */
static __m512 emu_maskz_loadu16(__mmask16 m, const float *p)
{ float v[16]; int i; for (i = 0; i < 16; i++) v[i] = (m >> i) & 1 ? p[i] : 0.0f; return _mm512_loadu_ps(v); }
static void emu_mask_storeu16(float *p, __mmask16 m, __m512 a)
{ float v[16]; int i; _mm512_storeu_ps(v, a); for (i = 0; i < 16; i++) if ((m >> i) & 1) p[i] = v[i]; }
static __m256 emu_maskload8(const float *p, __m256i m)
{ int32_t k[8]; float v[8]; int i; _mm256_storeu_si256((__m256i *)k, m);
  for (i = 0; i < 8; i++) v[i] = k[i] < 0 ? p[i] : 0.0f; return _mm256_loadu_ps(v); }
static void emu_maskstore8(float *p, __m256i m, __m256 a)
{ int32_t k[8]; float v[8]; int i; _mm256_storeu_si256((__m256i *)k, m); _mm256_storeu_ps(v, a);
  for (i = 0; i < 8; i++) if (k[i] < 0) p[i] = v[i]; }
#undef _mm256_fmadd_ps
#undef _mm512_fmadd_ps
#undef _mm512_maskz_loadu_ps
#undef _mm512_mask_storeu_ps
#undef _mm256_maskload_ps
#undef _mm256_maskstore_ps
#define _mm256_fmadd_ps(a, b, c) emu_fma8(a, b, c)
#define _mm512_fmadd_ps(a, b, c) emu_fma16(a, b, c)
#define _mm512_maskz_loadu_ps(m, p) emu_maskz_loadu16(m, p)
#define _mm512_mask_storeu_ps(p, m, a) emu_mask_storeu16(p, m, a)
#define _mm256_maskload_ps(p, m) emu_maskload8(p, m)
#define _mm256_maskstore_ps(p, m, a) emu_maskstore8(p, m, a)
#include "dense.h"
#include <stdio.h>
#include <stdlib.h>

static unsigned long long rs = 88172645463325252ull;
static float rnd(void)
{ rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return (float)((long long)(rs >> 11) % 2001 - 1000) / 337.0f; }

/* dense_matmul as dense.pxi drives it (x laid out for many rows, blocks of TB x OB) */
static void run(int lv, const float *x, const float *W, long T, long K, long O, float *y)
{
    long ntb = (T + COLI_DN_TB - 1) / COLI_DN_TB, nob = (O + COLI_DN_OB - 1) / COLI_DN_OB, b;
    long ldx = T > 1 ? coli_dn_ldx(K) : K;
    size_t per = coli_dn_scratch_floats(T, K);
    float *X = T > 1 ? malloc(sizeof(float) * (size_t)(T * ldx)) : NULL;
    float *scratch = per ? malloc(sizeof(float) * per) : NULL;
    if (X)
        coli_dn_lay_x(x, K, 0, T, X, ldx);
    for (b = 0; b < ntb * nob; b++) {
        long o0 = (b / ntb) * COLI_DN_OB, t0 = (b % ntb) * COLI_DN_TB;
        coli_dn_block(lv, X ? X : x, ldx, X != NULL, W, K, t0, t0 + COLI_DN_TB < T ? t0 + COLI_DN_TB : T,
                      o0, o0 + COLI_DN_OB < O ? o0 + COLI_DN_OB : O, y, O, scratch);
    }
    free(X);
    free(scratch);
}

static void run_t(int lv, const float *x, const float *W, long T, long O, long I, float *y)
{
    long i0;
    for (i0 = 0; i0 < I; i0 += COLI_DNT_IB)
        coli_dnt_block(lv, x, W, O, I, T, i0, i0 + COLI_DNT_IB < I ? i0 + COLI_DNT_IB : I, y);
}

int main(void)
{
    static const long cases[][3] = {{1, 2048, 50}, {5, 1100, 97}, {37, 17, 13}, {3, 15, 7},
                                    {70, 1030, 101}, {1, 33, 9}, {9, 16, 1}, {2, 1, 2}, {66, 64, 30}};
    long c, i, fails = 0;
    int lv;
    for (c = 0; c < (long)(sizeof(cases) / sizeof(cases[0])); c++) {
        long T = cases[c][0], K = cases[c][1], O = cases[c][2];
        /* exact sizes, so that ASan sees a read past the last row */
        float *x = malloc(sizeof(float) * (size_t)(T * K)), *W = malloc(sizeof(float) * (size_t)(O * K));
        float *ref = malloc(sizeof(float) * (size_t)(T * O)), *got = malloc(sizeof(float) * (size_t)(T * O));
        float *rt = malloc(sizeof(float) * (size_t)(T * K)), *gt = malloc(sizeof(float) * (size_t)(T * K));
        for (i = 0; i < T * K; i++) x[i] = rnd();
        for (i = 0; i < O * K; i++) W[i] = rnd();
        run(COLI_PORTABLE, x, W, T, K, O, ref);
        if (K >= O)     /* the transposed product: x's first T * O floats as [T][O], W as [O][K] */
            run_t(COLI_PORTABLE, x, W, T, O, K, rt);
        for (lv = 1; lv < COLI_NLEVELS; lv++) {
            long t;
            run(lv, x, W, T, K, O, got);
            if (memcmp(got, ref, sizeof(float) * (size_t)(T * O))) {
                printf("FAIL dense level %s T=%ld K=%ld O=%ld\n", coli_level_names[lv], T, K, O);
                fails++;
            }
            for (t = 0; t < T; t++) {      /* one row alone: the bits of its row */
                run(lv, x + t * K, W, 1, K, O, got);
                if (memcmp(got, ref + t * O, sizeof(float) * (size_t)O)) {
                    printf("FAIL one row level %s T=%ld K=%ld O=%ld t=%ld\n", coli_level_names[lv], T, K, O, t);
                    fails++;
                }
            }
            if (K >= O) {
                run_t(lv, x, W, T, O, K, gt);
                if (memcmp(gt, rt, sizeof(float) * (size_t)(T * K))) {
                    printf("FAIL dense_t level %s T=%ld O=%ld I=%ld\n", coli_level_names[lv], T, O, K);
                    fails++;
                }
            }
        }
        free(x); free(W); free(ref); free(got); free(rt); free(gt);
    }
    printf(fails ? "FAILED %ld\n" : "OK\n", fails);
    return fails != 0;
}
"""


def test_dense_variants_emulated(tmp_path):
    run_emulated(tmp_path, _EMU_DENSE, flags=("-ffp-contract=off",))    # as setup.py builds the extension


