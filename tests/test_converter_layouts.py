"""`coli convert` on checkpoints as the Hub ships them (issue 17): fused 3-D expert tensors are
split per expert (byte-identical to the per-expert checkpoint), and MTP layers go to shards of
their own that the engine never opens (or are dropped with --drop-mtp)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from colibri_tui.cli import main as coli
from core import converter as conv
from core.container import MANIFEST, Container
from core.integrity import verify
from core.safetensors_io import SafetensorsWriter, to_float32
from models import validate_config
from tests.conftest import ROOT, one_error_line, tiny_config, tiny_tensors, write_hf_model

IDS = [1, 5, 9, 2, 40, 3]


def convert(src, out, **kw):
    return conv.convert(src, out, validate_config=validate_config, **kw)


def shard_bytes(d: Path) -> dict[str, bytes]:
    """Every file of a container but its manifest (which records the source's path and files)."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and p.name != MANIFEST}


def manifest_without_source(d: Path) -> dict:
    m = json.loads((d / MANIFEST).read_text())
    m["converter"]["params"].pop("source")
    m["converter"]["params"].pop("source_files")
    return m


def fuse(tensors: dict[str, np.ndarray], cfg: dict, prefix: str = "model.layers.{}.mlp.experts.",
         layers=None) -> dict[str, np.ndarray]:
    """The per-expert expert tensors of ``layers`` replaced by transformers 5's fused ones:
    gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I]."""
    out = dict(tensors)
    E = cfg["num_experts"]
    for layer in (range(cfg["num_hidden_layers"]) if layers is None else layers):
        p = prefix.format(layer)
        gate = [out.pop(f"{p}{e}.gate_proj.weight") for e in range(E)]
        up = [out.pop(f"{p}{e}.up_proj.weight") for e in range(E)]
        down = [out.pop(f"{p}{e}.down_proj.weight") for e in range(E)]
        out[p + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
        out[p + "down_proj"] = np.stack(down)
    return out


def with_mtp(tensors: dict[str, np.ndarray], cfg: dict, seed: int = 7) -> dict[str, np.ndarray]:
    """A DeepSeek-V3-style MTP layer at index num_hidden_layers: a whole decoder layer (routed
    experts included) plus its enorm/hnorm/eh_proj/shared_head."""
    n = cfg["num_hidden_layers"]
    extra = tiny_tensors({**cfg, "num_hidden_layers": n + 1}, seed)
    out = dict(tensors)
    out.update({k: v for k, v in extra.items() if k.startswith(f"model.layers.{n}.")})
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    rng = np.random.default_rng(seed)
    p = f"model.layers.{n}."
    out[p + "enorm.weight"] = np.ones(H, np.float32)
    out[p + "hnorm.weight"] = np.ones(H, np.float32)
    out[p + "eh_proj.weight"] = rng.standard_normal((H, 2 * H)).astype(np.float32)
    out[p + "shared_head.norm.weight"] = np.ones(H, np.float32)
    out[p + "shared_head.head.weight"] = rng.standard_normal((V, H)).astype(np.float32)
    return out


@pytest.mark.parametrize("dtype,bits,shards", [("F32", 4, 1), ("BF16", 4, 3), ("BF16", 8, 1),
                                               ("BF16", 16, 2)])
def test_fused_experts_convert_byte_identical_to_per_expert(tmp_path, dtype, bits, shards):
    cfg = tiny_config()
    tensors = tiny_tensors(cfg)
    per = write_hf_model(tmp_path / "per", cfg, tensors, shards=shards, dtype=dtype)
    fused = write_hf_model(tmp_path / "fused", cfg, fuse(tensors, cfg), shards=shards, dtype=dtype)
    a = convert(per, tmp_path / "a", bits=bits)
    b = convert(fused, tmp_path / "b", bits=bits)
    assert shard_bytes(a) == shard_bytes(b)
    assert manifest_without_source(a) == manifest_without_source(b)
    c = Container(b)
    assert sorted(c.experts) == [(l, e) for l in range(2) for e in range(6)]
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in c.names())


def test_fused_read_one_expert_at_a_time(tmp_path, monkeypatch):
    """The split reads a fused tensor a row block of one expert at a time, never more."""
    cfg = tiny_config()
    tensors = fuse(tiny_tensors(cfg), cfg)
    src = write_hf_model(tmp_path / "src", cfg, tensors)
    with conv.SafetensorsFile(src / "model.safetensors") as f:
        spans = {n: (f.tensors[n].start, f.tensors[n].end) for n in f.tensors if n.endswith("_proj")
                 and ".experts." in n}
    reads = []
    real = conv.SafetensorsFile.pread

    def pread(self, nbytes, offset):
        reads.append((offset, nbytes))
        return real(self, nbytes, offset)

    monkeypatch.setattr(conv.SafetensorsFile, "pread", pread)
    monkeypatch.setattr(conv, "BLOCK_BYTES", 16 * 40 * 4)       # blocks of 16 rows of 40
    convert(src, tmp_path / "out")
    inside = [(o, n) for o, n in reads for a, b in spans.values() if a <= o < b]
    assert len(inside) > 2 * 6 * 3
    assert max(n for _, n in inside) <= 16 * 40 * 4
    for o, n in inside:             # no read crosses from one expert into the next
        a, b = next(v for v in spans.values() if v[0] <= o < v[1])
        per = (b - a) // 6
        assert (o - a) // per == (o + n - 1 - a) // per


def _fp8_model(d: Path, fused: bool, scale_shape_override=None):
    """1 layer, 2 experts, H=256, I=128, routed experts in FP8 E4M3 with 128x128 block scales
    (per expert, as DeepSeek-V3 ships them, or fused as transformers 5 holds them)."""
    cfg = tiny_config(hidden_size=256, head_dim=64, moe_intermediate_size=128, num_experts=2,
                      num_hidden_layers=1)
    tensors = tiny_tensors(cfg)
    rng = np.random.default_rng(3)
    E, I, H = 2, 128, 256
    codes = {k: rng.integers(0, 0x7E, size=s, dtype=np.uint8)
             for k, s in (("gate", (E, I, H)), ("up", (E, I, H)), ("down", (E, H, I)))}
    scales = {k: rng.uniform(0.01, 0.1, size=(E,) + tuple(-(-x // 128) for x in c.shape[1:])).astype(np.float32)
              for k, c in codes.items()}
    p = "model.layers.0.mlp.experts."
    for e in range(E):
        for k in ("gate", "up", "down"):
            del tensors[f"{p}{e}.{k}_proj.weight"]
    entries, data = [], {}
    for n, a in tensors.items():
        entries.append((n, "F32", a.shape))
        data[n] = a
    if fused:
        gu = np.concatenate([codes["gate"], codes["up"]], axis=1)
        gus = np.concatenate([scales["gate"], scales["up"]], axis=1)
        if scale_shape_override is not None:
            gus = np.ones(scale_shape_override, np.float32)
        for n, a, dt in ((p + "gate_up_proj", gu, "F8_E4M3"), (p + "gate_up_proj_scale_inv", gus, "F32"),
                         (p + "down_proj", codes["down"], "F8_E4M3"),
                         (p + "down_proj_scale_inv", scales["down"], "F32")):
            entries.append((n, dt, a.shape))
            data[n] = a
    else:
        for e in range(E):
            for k in ("gate", "up", "down"):
                n = f"{p}{e}.{k}_proj.weight"
                entries += [(n, "F8_E4M3", codes[k][e].shape), (n + "_scale_inv", "F32", scales[k][e].shape)]
                data[n], data[n + "_scale_inv"] = codes[k][e], scales[k][e]
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    w = SafetensorsWriter(d / "model.safetensors", entries)
    for n, a in data.items():
        w.write(n, a)
    w.commit()
    return d, codes, scales


@pytest.mark.parametrize("bits", [4, 16])
def test_fused_fp8_with_block_scales(tmp_path, bits):
    per, codes, scales = _fp8_model(tmp_path / "per", fused=False)
    fused, _, _ = _fp8_model(tmp_path / "fused", fused=True)
    a = convert(per, tmp_path / "a", bits=bits)
    b = convert(fused, tmp_path / "b", bits=bits)
    assert shard_bytes(a) == shard_bytes(b)
    if bits == 16:       # FP8 widened exactly, its scales applied
        got = Container(b).load("model.layers.0.mlp.experts.1.up_proj.weight").data
        want = to_float32(codes["up"][1], "F8_E4M3") * np.repeat(np.repeat(scales["up"][1], 128, 0), 128, 1)
        np.testing.assert_array_equal(got, want)


def test_fused_fp8_with_other_scale_layout_is_refused(tmp_path, capsys):
    src, _, _ = _fp8_model(tmp_path / "src", fused=True, scale_shape_override=(2, 2, 1))
    line = one_error_line(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert "model.layers.0.mlp.experts.gate_up_proj" in line and "scales" in line
    assert not (tmp_path / "out" / MANIFEST).exists()


@pytest.mark.parametrize("name,shape,why", [
    ("model.layers.1.mlp.experts.gate_up_proj", (6, 40, 48), "but the config needs"),     # transposed
    ("model.layers.1.mlp.experts.gate_up_proj", (6, 47, 40), "but the config needs"),     # 2I odd
    ("model.layers.1.mlp.experts.gate_up_proj", (5, 48, 40), "but the config needs"),     # 5 experts
    ("model.layers.1.mlp.experts.down_proj", (6, 40, 20), "disagrees with"),              # I=20 vs 24
    ("model.layers.1.mlp.experts.down_proj", (6, 40 * 24), "is 3-D"),
])
def test_fused_tensor_with_a_wrong_shape_is_refused(tmp_path, capsys, name, shape, why):
    cfg = tiny_config()
    tensors = fuse(tiny_tensors(cfg), cfg)
    tensors[name] = np.zeros(shape, np.float32)
    src = write_hf_model(tmp_path / "src", cfg, tensors)
    line = one_error_line(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert f"fused expert tensor {name}" in line and why in line, line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_unknown_3d_expert_tensor_is_refused(tmp_path, capsys):
    cfg = tiny_config()
    tensors = fuse(tiny_tensors(cfg), cfg)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[name + ".weight"] = tensors.pop(name)
    src = write_hf_model(tmp_path / "src", cfg, tensors)
    line = one_error_line(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert f"3-D expert tensor {name}.weight [6, 48, 40] is in no layout" in line


def test_fused_and_per_expert_copies_of_one_expert_are_refused(tmp_path, capsys):
    cfg = tiny_config()
    plain = tiny_tensors(cfg)
    tensors = fuse(plain, cfg, layers=[0])
    tensors["model.layers.0.mlp.experts.2.up_proj.weight"] = plain["model.layers.0.mlp.experts.2.up_proj.weight"]
    src = write_hf_model(tmp_path / "src", cfg, tensors)
    line = one_error_line(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert "model.layers.0.mlp.experts.gate_up_proj" in line and "expert 2's up_proj" in line


# --- MTP layers ----------------------------------------------------------------------------------

MTP_TENSORS = 9 + 5 + 6 * 3     # the decoder layer's dense tensors, the MTP extras, the experts


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    """The same tiny model without and with an MTP layer (layer 2 of a 2-layer config; its experts
    fused, as a transformers 5 save would hold them), converted through the command line."""
    d = tmp_path_factory.mktemp("mtp")
    cfg = tiny_config()
    base = tiny_tensors(cfg)
    plain = write_hf_model(d / "plain", cfg, base, shards=2)
    mtp = write_hf_model(d / "mtp", cfg, fuse(with_mtp(base, cfg), cfg, layers=[2]), shards=2)
    for src, out, extra in ((plain, "c-plain", []), (mtp, "c-mtp", []), (mtp, "c-drop", ["--drop-mtp"])):
        assert coli(["convert", str(src), str(d / out), "--bits", "4", *extra]) == 0
    return d


def test_mtp_layer_goes_to_a_shard_of_its_own(mtp_models):
    d = mtp_models
    out = d / "c-mtp"
    m = json.loads((out / MANIFEST).read_text())
    e = m[conv.MTP_KEY]
    assert e["dropped"] is False and e["layers"] == [2] and e["groups"] == ["model.layers.2"]
    assert e["shards"] == ["mtp-00001-of-00001.safetensors"]
    assert e["bytes"] == (out / e["shards"][0]).stat().st_size > 0
    assert e["tensors"] == MTP_TENSORS
    assert e["quantized"]["model.layers.2.mlp.experts.5.down_proj.weight"]["scheme"] == "int4"
    assert e["quantized"]["model.layers.2.eh_proj.weight"] == {"scheme": "int4", "shape": [40, 80],
                                                               "group_size": 64}
    assert "model.layers.2.enorm.weight" not in e["quantized"]          # norms stay F32
    assert not any(".layers.2." in n for n in m["tensors"])
    assert e["shards"][0] not in m["shards"] and e["shards"][0] in m["checksums"]
    c = Container(out)
    assert sorted(c.experts) == [(l, x) for l in range(2) for x in range(6)]
    assert not any(n.startswith("model.layers.2.") for n in c.names())
    # everything the engine loads is the plain conversion's, byte for byte
    plain = shard_bytes(d / "c-plain")
    got = shard_bytes(out)
    assert {k: v for k, v in got.items() if not k.startswith("mtp-")} == plain
    assert manifest_without_source(d / "c-plain")["shards"] == m["shards"]


def test_engine_ignores_the_mtp_layer(mtp_models):
    from models import open_model
    logits = {}
    for name in ("c-plain", "c-mtp", "c-drop"):
        engine = open_model(mtp_models / name, threads=1, prefetch=False)
        try:
            logits[name] = engine.logits(IDS)
            assert sorted({l for l, _ in engine.container.experts}) == [0, 1]
        finally:
            engine.container.close()
    assert np.array_equal(logits["c-plain"], logits["c-mtp"])
    assert np.array_equal(logits["c-plain"], logits["c-drop"])


def test_drop_mtp_omits_them(mtp_models):
    out = mtp_models / "c-drop"
    assert not list(out.glob("mtp-*"))
    e = json.loads((out / MANIFEST).read_text())[conv.MTP_KEY]
    assert e["dropped"] is True and e["layers"] == [2] and e["tensors"] == MTP_TENSORS and e["source_bytes"] > 0
    assert "shards" not in e
    assert shard_bytes(out) == shard_bytes(mtp_models / "c-plain")


def test_info_reports_mtp(mtp_models, capsys):
    def info(name, *extra):
        capsys.readouterr()
        assert coli(["info", "--model", str(mtp_models / name), *extra]) == 0
        return capsys.readouterr().out
    kept = json.loads(info("c-mtp", "--json"))["mtp"]
    assert kept["dropped"] is False and kept["layers"] == [2] and kept["bytes"] > 0
    assert kept["shards"] == ["mtp-00001-of-00001.safetensors"]
    assert json.loads(info("c-drop", "--json"))["mtp"]["dropped"] is True
    assert json.loads(info("c-plain", "--json"))["mtp"] is None
    assert "mtp: model.layers.2 kept aside, not loaded (1 shard," in info("c-mtp")
    assert "mtp: model.layers.2 dropped at conversion" in info("c-drop")
    assert "mtp: none" in info("c-plain")


def test_mtp_shards_are_verified(mtp_models, tmp_path):
    import shutil
    out = tmp_path / "c"
    shutil.copytree(mtp_models / "c-mtp", out)
    r = verify(out)
    assert r.ok and "mtp-00001-of-00001.safetensors" in r.checked
    p = out / "mtp-00001-of-00001.safetensors"
    b = bytearray(p.read_bytes())
    b[-3] ^= 0x40
    p.write_bytes(bytes(b))
    r = verify(out)
    assert r.damaged == ["mtp-00001-of-00001.safetensors: checksum mismatch (the file's bytes changed)"]
    Container(out).close()          # the engine's shards are intact: it still opens


def test_top_level_mtp_module(tmp_path):
    """`mtp.*` (Qwen3.5/3.6-style, experts fused) and `model.mtp.*`: set aside too, never read as
    layer 0 of the model although their names hold `layers.0`."""
    cfg = tiny_config()
    base = tiny_tensors(cfg)
    extra = {k.replace("model.layers.0.", "mtp.layers.0."): v
             for k, v in tiny_tensors(cfg, seed=3).items() if k.startswith("model.layers.0.")}
    extra = fuse(extra, cfg, prefix="mtp.layers.{}.mlp.experts.", layers=[0])
    extra["mtp.fc.weight"] = np.ones((40, 80), np.float32)
    extra["model.mtp.norm.weight"] = np.ones(40, np.float32)
    plain = convert(write_hf_model(tmp_path / "plain", cfg, base), tmp_path / "a")
    out = convert(write_hf_model(tmp_path / "src", cfg, {**base, **extra}), tmp_path / "b")
    e = json.loads((out / MANIFEST).read_text())[conv.MTP_KEY]
    assert e["groups"] == ["model.mtp", "mtp", "mtp.layers.0"] and e["layers"] == []
    assert len(e["shards"]) == 3
    assert "mtp.layers.0.mlp.experts.4.gate_proj.weight" in e["quantized"]
    c = Container(out)
    assert not any("mtp" in n for n in c.names()) and len(c.experts) == 12
    assert {k: v for k, v in shard_bytes(out).items() if not k.startswith("mtp-")} == shard_bytes(plain)


KILL_IN_MTP_SHARD = textwrap.dedent("""
    import os, signal, sys
    from core import converter
    from models import validate_config
    def progress(p):
        if p.shard.startswith("mtp-") and p.tensor:     # mid-way through the MTP shard: die hard
            os.kill(os.getpid(), signal.SIGKILL)
    converter.convert(sys.argv[1], sys.argv[2], validate_config=validate_config, progress=progress)
""")


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_resume_with_mtp_is_byte_identical(tmp_path):
    cfg = tiny_config(num_hidden_layers=3)
    src = write_hf_model(tmp_path / "src", cfg, with_mtp(tiny_tensors(cfg), cfg), shards=2)
    whole = convert(src, tmp_path / "whole")
    out = tmp_path / "killed"
    r = subprocess.run([sys.executable, "-c", KILL_IN_MTP_SHARD, str(src), str(out)], cwd=ROOT)
    assert r.returncode == -9
    assert not (out / MANIFEST).exists()
    assert len(json.loads((out / conv.JOURNAL).read_text())["done"]) == 4   # 3 layers + other
    with pytest.raises(conv.ColiError, match=r"different parameters \(drop_mtp\)"):
        convert(src, out, drop_mtp=True)
    seen = []
    convert(src, out, progress=lambda p: seen.append(p.shard))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in whole.iterdir()}
    assert "mtp-00001-of-00001.safetensors" in seen
