"""FP4 E2M1 + UE8M0 per 32 (core.quant.FP4, the encoding DeepSeek V4 and Kimi K3 ship their routed
experts in): the decoder against an independent float reference of every code and scale byte, the
encoder's rounding, malformed pairs refused with one line, the compiled kernels (cython_kernels/
fp4.h) bit for bit against dense.h's order on every variant, thread count and row count (those the
CPU lacks through SIMDe), and a container with FP4 experts in the engine: the float32 forward of
its decoded weights within 1e-4, and the placement law (--cap 1 vs all, 1 vs 2 threads)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core import kernels, quant
from core.container import Container, Weight
from core.converter import convert
from core.errors import ColiError
from models.registry import validate_config
from tests.conftest import one_error_line, open_engine, run_emulated, write_safetensors

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "oracle" / "fixtures" / "qwen3moe-a"


def e2m1_ref(code: int) -> float:
    """E2M1 from its definition: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0;
    exponent 0 is subnormal (0 or 0.5)."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def test_every_code_and_scale_byte_decodes_to_its_float_value():
    codes = np.arange(256, dtype=np.uint8).reshape(1, 256)          # every pair of codes
    for b in range(255):
        got = quant.dequantize_fp4(codes, np.full((1, 16), b, np.uint8), 512)[0]
        with np.errstate(over="ignore"):
            want = np.array([e2m1_ref(c) * 2.0 ** (b - 127) for byte in range(256)
                             for c in (byte & 15, byte >> 4)], dtype=np.float32)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), b
    # the ends: 2^-127 (a subnormal) keeps 0.5 * 2^-127 exact; 2^127 keeps codes <= 3, 4 and 6 overflow
    assert quant.dequantize_fp4(np.array([[0x71]], np.uint8), np.array([[0]], np.uint8), 2)[0, 0] == 2.0 ** -128
    top = quant.dequantize_fp4(np.array([[0x63, 0xF7]], np.uint8), np.array([[254]], np.uint8), 4)[0]
    assert top[0] == 1.5 * 2.0 ** 127 and np.isposinf(top[1]) and np.isposinf(top[2]) and np.isneginf(top[3])
    assert np.isnan(quant.dequantize_fp4(np.array([[0x22]], np.uint8), np.array([[255]], np.uint8), 2)).all()
    assert list(quant.E2M1) == [e2m1_ref(c) for c in range(16)]


def test_encoder_picks_the_nearest_value_under_the_smallest_scale_that_holds_the_group():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((7, 95)) * np.exp(rng.uniform(-30, 30, (7, 1)))).astype(np.float32)
    w[3, 32:64] = 0                                     # an all-zero group
    w[4, :32] = 6.0                                     # exactly representable at scale 1
    codes, scales = quant.quantize_fp4(w)
    assert codes.shape == (7, 48) and scales.shape == (7, 3) and codes.dtype == scales.dtype == np.uint8
    assert scales[4, 0] == 127 and (codes[4, :16] == 0x77).all()
    assert (codes[:, -1] >> 4 == 0).all()               # the padding nibble of an odd I is code 0
    got = quant.dequantize_fp4(codes, scales, 95)
    for r in range(7):
        for g in range(3):
            grp = w[r, 32 * g: 32 * g + 32].astype(np.float64)
            amax = np.abs(grp).max()
            e = 0 if amax == 0 else max(-127, int(np.ceil(np.log2(float(np.float32(amax) / np.float32(6.0))))))
            assert scales[r, g] == e + 127
            grid = np.array([e2m1_ref(c) for c in range(8)]) * 2.0 ** e
            for v, q in zip(grp, got[r, 32 * g: 32 * g + 32]):
                d = np.abs(grid - abs(v))
                best = np.flatnonzero(d == d.min())
                pick = best[0] if len(best) == 1 else best[best % 2 == 0][0]     # ties: even code
                assert abs(q) == grid[pick] and (q == 0 or np.sign(q) == np.sign(v)), (r, g, v, q)
    # values already on the grid come back exactly
    again = quant.dequantize_fp4(*quant.quantize_fp4(got), 95)
    assert np.array_equal(again, got)
    with pytest.raises(ValueError):
        quant.quantize_fp4(np.array([[np.nan, 1.0]], np.float32))


def test_malformed_pairs_are_refused_with_one_line_naming_the_tensor():
    codes, scales = quant.quantize_fp4(np.ones((4, 64), np.float32))
    quant.check_fp4("w", codes, scales, 64)
    for c, s, why in ((codes[:, :31], scales, "codes are U8 [4, 31]"),
                      (codes, scales[:, :1], "scales are U8 [4, 1]"),
                      (codes[:3], scales, "scales are U8 [4, 2], [3, 64] needs U8 [3, 2]")):
        with pytest.raises(ColiError, match="FP4 tensor layers.0.w") as e:
            quant.check_fp4("layers.0.w", c, s, 64)
        assert why in str(e.value) and "\n" not in str(e.value)
    bad = scales.copy()
    bad[2, 1] = 255
    with pytest.raises(ColiError, match=r"FP4 tensor w: scale byte 255 \(NaN\) at row 2, group 1"):
        quant.check_fp4("w", codes, bad, 64)
    # DeepSeek's dtypes (I8 codes, F8_E8M0 scales) are the same bytes
    assert quant.fp4_layout_error(4, 64, ("I8", (4, 32)), ("F8_E8M0", (4, 2))) is None


# --- the kernels ---------------------------------------------------------------------------------

qm = pytest.importorskip("cython_kernels.qmatmul")


@pytest.fixture
def _restore():
    yield
    qm.set_simd("auto")
    qm.set_num_threads(0)


def positions(a: np.ndarray, K: int) -> np.ndarray:
    """Columns of a in fp4.h's positions: per group of 32, the even columns then the odd ones."""
    p = np.arange(-(-K // 32) * 32)
    j = p % 32
    col = p - j + np.where(j < 16, 2 * j, 2 * (j - 16) + 1)
    out = np.zeros(a.shape[:-1] + (len(p),), np.float32)
    out[..., col < K] = a[..., col[col < K]]
    return out


SHAPES = [(1, 64, 5), (1, 71, 9), (3, 39, 7), (1, 2048, 97), (40, 1100, 13), (70, 2100, 101),
          (2, 32, 1), (33, 1, 4)]


@pytest.mark.parametrize("T,K,O", SHAPES)
def test_kernels_have_dense_orders_bits_on_every_variant_thread_count_and_row_count(T, K, O, _restore):
    from tests.test_dense_matmul import lanes_ref
    rng = np.random.default_rng(T * K + O)
    codes, scales = quant.quantize_fp4(rng.standard_normal((O, K)).astype(np.float32))
    W = quant.dequantize_fp4(codes, scales, K)
    x = rng.standard_normal((T, K)).astype(np.float32)
    want = lanes_ref(positions(x, K), positions(W, K))        # numpy's emulation of the order
    assert np.abs(want - x @ W.T).max() <= 1e-5 * max(1.0, (np.abs(x) @ np.abs(W).T).max())
    for level in qm.simd_variants():
        qm.set_simd(level)
        for threads in (1, 2, 3):
            qm.set_num_threads(threads)
            assert np.array_equal(qm.fp4_matmul(x, codes, scales, K).view(np.uint32), want.view(np.uint32))
            one = np.concatenate([qm.fp4_matmul(x[t: t + 1], codes, scales, K) for t in range(T)])
            assert np.array_equal(one.view(np.uint32), want.view(np.uint32)), (level, threads)


def test_every_scale_byte_and_code_through_the_kernels(_restore):
    """Every code under every scale byte, 2^-127 (subnormal values) to past float32's range (+-inf)
    and NaN: the AVX2 kernels look values up as their two top bytes (fp4.h, coli_f4_group256),
    the others as floats; all give dense.h's order over the decoded weights, NaN where it is NaN."""
    from tests.test_dense_matmul import lanes_ref
    K = 512
    codes = np.tile(np.arange(256, dtype=np.uint8), (256, 1))       # row b: every pair of codes
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], K // 32, axis=1)     # under byte b
    W = quant.dequantize_fp4(codes, scales, K)
    x = np.random.default_rng(7).standard_normal((3, K)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        want = lanes_ref(positions(x, K), positions(W, K))
    assert np.isnan(want[:, 255]).all() and np.isfinite(want[:, :240]).all()
    for level in qm.simd_variants():
        qm.set_simd(level)
        for rows in (x[:1], x):                       # the one-row kernel, the panels
            got = qm.fp4_matmul(rows, codes, scales, K)
            ref = want[: len(rows)]
            assert np.array_equal(np.isnan(got), np.isnan(ref)), level
            assert np.array_equal(got.view(np.uint32)[~np.isnan(ref)], ref.view(np.uint32)[~np.isnan(ref)]), level


def test_one_pass_over_many_matrices_has_the_bits_of_each_alone(_restore):
    rng = np.random.default_rng(5)
    K, x = 72, rng.standard_normal((9, 72)).astype(np.float32)
    mats = [quant.quantize_fp4(rng.standard_normal((O, K)).astype(np.float32)) for O in (39, 8, 39, 1)]
    rows = [(0, 9), (2, 1), (4, 5), (8, 1)]
    for threads in (1, 2):
        qm.set_num_threads(threads)
        got = qm.fp4_matmul_many(x, mats, K, rows)
        for (c, s), (t0, n), y in zip(mats, rows, got):
            assert np.array_equal(y, qm.fp4_matmul(x[t0: t0 + n], c, s, K))
    ws = [Weight(quant.FP4, (c.shape[0], K), c, s, quant.FP4_GROUP) for c, s in mats]
    for (t0, n), w, y in zip(rows, ws, kernels.matmul_many(x, ws, rows)):
        assert np.array_equal(y, kernels.matmul(x[t0: t0 + n], w))
        np.testing.assert_allclose(y, x[t0: t0 + n] @ quant.dequantize_fp4(w.data, w.scales, K).T,
                                   rtol=0, atol=2e-5)


def test_bad_kernel_arguments_are_one_clear_error():
    c, s = quant.quantize_fp4(np.ones((3, 64), np.float32))
    x = np.ones((1, 64), np.float32)
    with pytest.raises(ValueError, match="must be"):
        qm.fp4_matmul(x, c[:, :5], s, 64)
    with pytest.raises(ValueError, match="scales must be"):
        qm.fp4_matmul(x, c, s[:, :1], 64)
    with pytest.raises(ValueError, match="columns"):
        qm.fp4_matmul(x[:, :32], c, s, 64)


# fp4.h through SIMDe (the variants this CPU lacks: NEON here), with test_dense_matmul's fused
# multiply-adds and masked accesses in SIMDe's place (and NEON's vfmaq_f32 fused likewise), under
# AddressSanitizer: a read past a row's last byte (codes and scales allocated at their exact sizes)
# would show
_EMU_FP4 = r"""
static float32x4_t emu_vfmaq(float32x4_t c, float32x4_t a, float32x4_t b)
{ float x[4], y[4], z[4]; int i; vst1q_f32(x, a); vst1q_f32(y, b); vst1q_f32(z, c);
  for (i = 0; i < 4; i++) z[i] = fmaf(x[i], y[i], z[i]); return vld1q_f32(z); }
#undef vfmaq_f32
#define vfmaq_f32(c, a, b) emu_vfmaq(c, a, b)
#include "fp4.h"
#include <stdio.h>
#include <stdlib.h>

static unsigned long long rs = 88172645463325252ull;
static unsigned rnd(void) { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return (unsigned)(rs >> 11); }

/* fp4_matmul as fp4.pxi drives it: one row in row blocks, more in TB x OB blocks */
static void run(int lv, const float *x, const uint8_t *W, const uint8_t *S, long T, long K, long O, float *y)
{
    long ldx = coli_f4_ldx(K), o, t;
    float *X = malloc(sizeof(float) * (size_t)(T * ldx));
    float *scratch = malloc(sizeof(float) * coli_dn_scratch_floats(2, K));
    coli_f4_lay_x(x, K, 0, T, X, ldx);
    if (T == 1)
        for (o = 0; o < O; o += COLI_F4_RB)
            coli_f4_rows(lv, X, W, S, K, o, o + COLI_F4_RB < O ? o + COLI_F4_RB : O, y);
    else
        for (o = 0; o < O; o += COLI_DN_OB)
            for (t = 0; t < T; t += COLI_DN_TB)
                coli_f4_block(lv, X, ldx, W, S, K, t, t + COLI_DN_TB < T ? t + COLI_DN_TB : T, o,
                              o + COLI_DN_OB < O ? o + COLI_DN_OB : O, y, O, scratch);
    free(X);
    free(scratch);
}

int main(void)
{
    static const long cases[][3] = {{1, 2048, 70}, {5, 1100, 97}, {37, 39, 13}, {1, 71, 9},
                                    {70, 1030, 101}, {1, 33, 9}, {9, 32, 1}, {2, 1, 2}};
    long c, i, fails = 0;
    int lv;
    coli_f4_init();
    for (c = 0; c < (long)(sizeof(cases) / sizeof(cases[0])); c++) {
        long T = cases[c][0], K = cases[c][1], O = cases[c][2], ldb = (K + 1) / 2, ng = (K + 31) / 32, t;
        float *x = malloc(sizeof(float) * (size_t)(T * K));
        uint8_t *W = malloc((size_t)(O * ldb)), *S = malloc((size_t)(O * ng));
        float *ref = malloc(sizeof(float) * (size_t)(T * O)), *got = malloc(sizeof(float) * (size_t)(T * O));
        for (i = 0; i < T * K; i++) x[i] = (float)((long)(rnd() % 2001) - 1000) / 337.0f;
        for (i = 0; i < O * ldb; i++) W[i] = (uint8_t)rnd();
        for (i = 0; i < O * ng; i++) S[i] = (uint8_t)(110 + rnd() % 30);
        run(COLI_PORTABLE, x, W, S, T, K, O, ref);
        for (lv = 1; lv < COLI_NLEVELS; lv++) {
            run(lv, x, W, S, T, K, O, got);
            if (memcmp(got, ref, sizeof(float) * (size_t)(T * O))) {
                printf("FAIL fp4 level %s T=%ld K=%ld O=%ld\n", coli_level_names[lv], T, K, O);
                fails++;
            }
            for (t = 0; t < T; t++) {      /* one row alone: the bits of its row */
                run(lv, x + t * K, W, S, 1, K, O, got);
                if (memcmp(got, ref + t * O, sizeof(float) * (size_t)O)) {
                    printf("FAIL fp4 one row level %s T=%ld K=%ld t=%ld\n", coli_level_names[lv], T, K, t);
                    fails++;
                }
            }
        }
        free(x); free(W); free(S); free(ref); free(got);
    }
    printf(fails ? "FAILED %ld\n" : "OK\n", fails);
    return fails != 0;
}
"""


def test_fp4_variants_emulated(tmp_path):
    from tests.test_dense_matmul import _EMU_DENSE
    prelude = _EMU_DENSE.split('#include "dense.h"')[0]       # qkern.h + the fused-FMA / mask shims
    run_emulated(tmp_path, prelude + _EMU_FP4, flags=("-ffp-contract=off",))


# --- a container with FP4 experts ----------------------------------------------------------------

@pytest.fixture(scope="module")
def fp4_models(tmp_path_factory):
    """qwen3moe-a converted with its routed experts as FP4, and (the reference) at bits 16 with
    every expert matrix replaced by the FP4 container's decoded values."""
    d = tmp_path_factory.mktemp("fp4")
    src = FIXTURE / "model"
    fp4 = convert(src, d / "fp4", bits=16, validate_config=validate_config, fp4_experts=True)
    c = Container(fp4)
    tensors = {n: np.asarray(c.load(n).data, np.float32) if n not in c.quant
               else quant.dequantize_fp4(c.load(n).data, c.load(n).scales, c.quant[n].shape[1])
               for n in c.logical_shapes()}
    c.close()
    ref_src = d / "decoded-src"
    ref_src.mkdir()
    for f in src.iterdir():
        if not f.name.endswith((".safetensors", ".safetensors.index.json")) and f.is_file():
            (ref_src / f.name).write_bytes(f.read_bytes())
    write_safetensors(ref_src / "model.safetensors", tensors)
    ref = convert(ref_src, d / "decoded", bits=16, validate_config=validate_config)
    return fp4, ref


def test_container_records_the_scheme_and_stores_each_expert_contiguously(fp4_models):
    fp4, _ = fp4_models
    m = json.loads((fp4 / "colibri.json").read_text())
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert m["tensors"][name] == {"scheme": quant.FP4, "shape": [72, 39], "group_size": 32}
    assert m["classes"]["routed_experts"].startswith(quant.FP4)
    c = Container(fp4)
    try:
        info, sinfo = c.index[name][1], c.index[name + ".qs"][1]
        assert (info.dtype, info.shape, sinfo.dtype, sinfo.shape) == ("U8", (72, 20), "U8", (72, 2))
        parts = c.expert_weights(1, 3, c.read_expert(1, 3))      # one read: contiguous (checked at open)
        assert {w.scheme for w in parts.values()} == {quant.FP4}
        assert c.load("model.layers.1.mlp.gate.weight").scheme == "dense"
    finally:
        c.close()


def _ids():
    return [int(i) for i in np.load(FIXTURE / "reference.npz")["ids"]]


def test_engine_gives_the_float32_forward_of_the_decoded_weights(fp4_models):
    fp4, ref = fp4_models
    want = open_engine(ref).logits(_ids())
    got = open_engine(fp4).logits(_ids())
    assert np.abs(got - want).max() <= 1e-4
    assert np.array_equal(got.argmax(1), want.argmax(1))


def test_placement_law_holds_with_fp4_experts(fp4_models):
    fp4, _ = fp4_models
    ids = _ids()
    base = open_engine(fp4).logits(ids)
    for kw in ({"cap": 1}, {"cap": 2}, {"threads": 2}, {"cap": 1, "threads": 2, "prefetch": False}):
        assert np.array_equal(open_engine(fp4, **kw).logits(ids), base), kw
    # decode through the cache: every step's experts on one row (the fused kernel)
    e = open_engine(fp4, cap=1)
    from core.engine import KVCache
    cache = KVCache(e.spec)
    steps = np.concatenate([e.forward(ids[:5], cache)] + [e.forward([t], cache) for t in ids[5:12]])
    e2 = open_engine(fp4, threads=2)
    cache2 = KVCache(e2.spec)
    steps2 = np.concatenate([e2.forward(ids[:5], cache2)] + [e2.forward([t], cache2) for t in ids[5:12]])
    assert np.array_equal(steps, steps2)
    assert np.abs(steps - base[4:12]).max() <= 1e-4      # forward returns the last row of a prompt


def test_numpy_kernels_give_the_same_semantics(fp4_models, tmp_path):
    fp4, _ = fp4_models
    code = ("import numpy as np, sys; from tests.conftest import open_engine; "
            f"np.save(sys.argv[1], open_engine({str(fp4)!r}).logits({_ids()!r}))")
    out = tmp_path / "numpy.npy"
    subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, check=True,
                   env={**__import__("os").environ, "COLI_KERNELS": "numpy", "PYTHONPATH": str(ROOT)})
    assert np.abs(np.load(out) - open_engine(fp4).logits(_ids())).max() <= 1e-4


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_malformed_fp4_tensors_are_refused_at_open_or_read_with_one_line(fp4_models, tmp_path, capsys):
    fp4, _ = fp4_models
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    # a manifest shape the stored bytes do not hold
    bad = _copy(fp4, tmp_path / "shape")
    m = json.loads((bad / "colibri.json").read_text())
    m["tensors"][name]["shape"] = [39, 104]
    (bad / "colibri.json").write_text(json.dumps(m))
    with pytest.raises(ColiError, match=f"FP4 tensor {name} \\[39, 104\\] is stored as U8 \\[39, 36\\]") as e:
        Container(bad)
    assert "\n" not in str(e.value)
    # a group size other than 32
    m["tensors"][name] = {"scheme": quant.FP4, "shape": [39, 72], "group_size": 64}
    (bad / "colibri.json").write_text(json.dumps(m))
    with pytest.raises(ColiError, match=f"tensor {name}: group_size 64"):
        Container(bad)
    # a NaN scale byte (in every expert's up_proj of layer 0): refused when the expert is read,
    # and by the command line with one line
    nan = _copy(fp4, tmp_path / "nan")
    c = Container(nan)
    places = [c.index[f"model.layers.0.mlp.experts.{e}.up_proj.weight.qs"] for e in range(8)]
    c.close()
    for f, sinfo in places:
        with open(f.path, "r+b") as fh:
            fh.seek(sinfo.start + 5)
            fh.write(b"\xff")
    c = Container(nan)
    try:
        with pytest.raises(ColiError, match=f"FP4 tensor {name}: scale byte 255 \\(NaN\\) at row 1, group 2"):
            c.expert_weights(0, 2, c.read_expert(0, 2))
    finally:
        c.close()
    line = one_error_line(capsys, ["logits", "--model", str(nan), "--ids", "1,2,3", "--out", str(tmp_path / "o.npy")])
    assert "up_proj.weight: scale byte 255 (NaN) at row 1, group 2" in line
