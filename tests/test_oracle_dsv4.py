"""DeepSeek V4's oracle fixtures in their two layouts agree with each other.

``fixtures/dsv4-*/model`` is transformers' own layout (save_pretrained), ``fixtures/dsv4-*/hub``
the same model as DeepSeek's release ships it (DeepSeek's names, FP4 experts, FP8 blocks, MTP).
Until the engine runs the family (tests/test_oracle.py picks the fixtures up once deepseek_v4 is
registered) this checks what the files promise: the release's dtypes and scale shapes, that
models/deepseek_v4.RENAMES turns the release's names into exactly transformers' names (MTP
set aside), and that the release's weights decode to the transformers weights' own FP4 / FP8 /
BF16 encoding. Runs on the committed fixtures, or on fresh ones with ``--oracle-fresh``.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from safetensors.numpy import load_file

from core.safetensors_io import bf16_from_float32
from models.deepseek_v4 import LAYOUT, RENAMES
from tests.conftest import COMMITTED
from tests.oracle import hub_formats as hf

NAMES = sorted(p.name for p in COMMITTED.iterdir() if (p / "hub" / "config.json").exists())


def _rename_first(name: str) -> str:
    for pat, rep in RENAMES:
        if re.search(pat, name):
            return re.sub(pat, rep, name)
    return name


def _rename_all(name: str) -> str:
    for pat, rep in RENAMES:
        name = re.sub(pat, rep, name)
    return name


def _set_aside(name: str) -> bool:
    return LAYOUT.mtp_group(name, None) is not None


def _transformers(root, name) -> dict[str, np.ndarray]:
    tensors = {}
    for f in sorted((root / name / "model").glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def test_there_are_dsv4_fixtures():
    assert len(NAMES) >= 2, NAMES


@pytest.mark.parametrize("name", NAMES)
def test_release_layout_dtypes_and_scales(name, fixture_root):
    raw = hf.read_raw(str(fixture_root / name / "hub"))
    cfg = json.loads((fixture_root / name / "hub" / "config.json").read_text())
    assert cfg["expert_dtype"] == "fp4"
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    assert len(cfg["compress_ratios"]) == cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]
    want = {"fp4": "I8", "fp8": "F8_E4M3", "bf16": "BF16", "f32": "F32", "i64": "I64"}
    seen, fp8_blocks = set(), set()
    for n, (dtype, arr) in raw.items():
        if n.endswith(".scale"):
            continue
        cls = hf.hub_class(n)
        seen.add(cls)
        assert dtype == want[cls], (n, dtype)
        if cls in ("fp4", "fp8"):
            s_dtype, scale = raw[hf.scale_name(n)]
            assert s_dtype == "F8_E8M0"
            o, i = arr.shape[0], arr.shape[1] * (2 if cls == "fp4" else 1)
            assert scale.shape == ((o, i // 32) if cls == "fp4" else (-(-o // 128), -(-i // 128))), n
            if cls == "fp8":
                fp8_blocks.add(scale.shape)
    assert seen == set(want)
    assert max(r for r, _ in fp8_blocks) > 1             # some FP8 matrix spans two row blocks
    assert all(hf.hub_class(n[: -len(".scale")] + ".weight") in ("fp4", "fp8") for n in raw if n.endswith(".scale"))
    assert any(n.startswith("mtp.0.e_proj") for n in raw) and any(n.startswith("mtp.0.ffn.experts.") for n in raw)


@pytest.mark.parametrize("name", NAMES)
def test_renames_give_exactly_transformers_names(name, fixture_root):
    hub = [n for n in hf.read_raw(str(fixture_root / name / "hub")) if not n.endswith(".scale")]
    kept = [n for n in hub if not _set_aside(n)]
    assert all(n.startswith("mtp.") for n in hub if _set_aside(n))
    assert [_rename_first(n) for n in kept] == [_rename_all(n) for n in kept]
    renamed = [_rename_first(n) for n in kept]
    assert len(set(renamed)) == len(renamed)
    assert set(renamed) == set(_transformers(fixture_root, name))


@pytest.mark.parametrize("name", NAMES)
def test_release_weights_are_the_transformers_weights_encoded(name, fixture_root):
    raw = hf.read_raw(str(fixture_root / name / "hub"))
    deq = hf.dequantized(raw)
    tf = _transformers(fixture_root, name)
    for n, w in deq.items():
        if _set_aside(n):
            continue
        src, cls = tf[_rename_first(n)], hf.hub_class(n)
        assert w.shape == src.shape and w.dtype == src.dtype, n
        if cls in ("f32", "i64"):
            np.testing.assert_array_equal(w, src, err_msg=n)
        elif cls == "bf16":
            np.testing.assert_array_equal(w, (bf16_from_float32(src).astype(np.uint32) << 16).view(np.float32))
        else:
            scale = raw[hf.scale_name(n)][1]
            code, want_scale = (hf.encode_fp4 if cls == "fp4" else hf.encode_fp8)(src)
            np.testing.assert_array_equal(raw[n][1], code, err_msg=n)
            np.testing.assert_array_equal(scale, want_scale, err_msg=n)
            # and, whatever the encoder: within half the widest code step of the block's scale
            if cls == "fp4":
                step = np.repeat(hf.e8m0(scale), hf.FP4_BLOCK, axis=1)         # 6 - 4 = 2 -> 1
                assert np.all(np.abs(w - src) <= step), n
            else:
                assert np.all(np.abs(w - src) <= np.abs(src) / 16 + 2.0 ** -10 * hf.decode_fp8(
                    np.full(src.shape, 0x38, np.uint8), scale)), n        # 0x38 = 1.0


@pytest.mark.parametrize("name", NAMES)
def test_release_reference_is_there(name, fixture_root):
    ref = np.load(fixture_root / name / "reference.npz")
    assert ref["logits_hub"].shape == ref["logits_orig"].shape and ref["logits_hub"].dtype == np.float32
    assert np.isfinite(ref["logits_hub"]).all()


def test_encoders_round_to_nearest_even():
    # one 32-block whose amax is 6 (scale 2^0): the E2M1 ties go to the even code
    x = np.zeros((1, 32), np.float32)
    x[0, :10] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 6.0, -0.1]
    packed, scale = hf.encode_fp4(x)
    assert scale.tolist() == [[127]]
    np.testing.assert_array_equal(hf.decode_fp4(packed, scale)[0, :10], [0, 1, 1, 2, 2, 4, 4, -4, 6, 0])
    codes = packed.view(np.uint8)[0, :5]
    assert (codes & 0x0F).tolist() == [0, 2, 4, 6, 7] and (codes >> 4).tolist() == [2, 4, 6, 0xE, 8]
    # E4M3 against torch's own cast, where torch is installed
    torch = pytest.importorskip("torch")
    w = np.random.default_rng(0).standard_normal((130, 260)).astype(np.float32) * 3
    code, scale = hf.encode_fp8(w)
    s = np.repeat(np.repeat(hf.e8m0(scale), 128, 0), 128, 1)[:130, :260]
    want = torch.from_numpy(w / s).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(code, want)


def test_transformers_in_memory_names_convert_to_the_same_logits(tmp_path):
    """A state dict saved with transformers' in-memory names (self_attn.*, attn_hc, fused
    mlp.experts.gate_up_proj / down_proj, lm_head) -- what a save without the reverse mapping
    writes -- converts through the family's renames to the saved layout's logits."""
    import shutil

    import pytest
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from colibri_tui.cli import main as coli
    src = COMMITTED / "dsv4-a" / "model"
    m = transformers.DeepseekV4ForCausalLM.from_pretrained(src)
    raw = tmp_path / "raw"
    raw.mkdir()
    shutil.copy(src / "config.json", raw / "config.json")
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(raw / "model.safetensors"))
    assert any(".self_attn." in k for k in m.state_dict()) and "lm_head.weight" in m.state_dict()
    ids = np.load(COMMITTED / "dsv4-a" / "reference.npz")["ids"]
    outs = []
    for d in (src, raw):
        c = tmp_path / f"c-{d.name}"
        assert coli(["convert", str(d), str(c), "--bits", "16"]) == 0
        assert coli(["logits", "--model", str(c), "--ids", ",".join(map(str, ids)), "--out", str(c / "l.npy")]) == 0
        outs.append(np.load(c / "l.npy"))
    np.testing.assert_array_equal(outs[0], outs[1])
