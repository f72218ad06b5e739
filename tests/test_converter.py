import errno
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from core import converter as conv
from core import quant
from core.container import Container
from core.errors import ColiError
from core.safetensors_io import SafetensorsFile, SafetensorsWriter
from models import validate_config
from tests.conftest import ROOT, tiny_config, tiny_tensors, write_hf_model


def convert(src, out, **kw):
    return conv.convert(src, out, validate_config=validate_config, **kw)


def tree_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_int4_container_layout_and_bytes(tmp_path):
    cfg = tiny_config()
    tensors = tiny_tensors(cfg)
    src = write_hf_model(tmp_path / "src", cfg, tensors, shards=3)
    out = convert(src, tmp_path / "out")
    c = Container(out)
    assert c.manifest["converter"]["bits"] == 4
    assert sorted(c.experts) == [(l, e) for l in range(2) for e in range(6)]
    for loc in c.experts.values():     # one contiguous range per expert, checked by Container too
        assert loc.end - loc.start == sum(i.nbytes for _, i in loc.parts.values())
    for shard in c.manifest["shards"]:  # every shard opens with the stock reader
        with safe_open(out / shard, "np") as f:
            assert len(list(f.keys())) > 0
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    packed, scales = quant.quantize_int4(tensors[name], 64)
    w = c.load(name)
    assert w.scheme == "int4" and w.shape == tensors[name].shape
    np.testing.assert_array_equal(w.data, packed)
    np.testing.assert_array_equal(w.scales, scales)
    emb = c.load("model.embed_tokens.weight")
    assert emb.scheme == "int8"
    np.testing.assert_array_equal(emb.data, quant.quantize_int8(tensors["model.embed_tokens.weight"])[0])
    router = c.load("model.layers.0.mlp.gate.weight")
    assert router.scheme == "dense"
    np.testing.assert_array_equal(router.data, tensors["model.layers.0.mlp.gate.weight"])
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_bits16_keeps_source_dtypes(tmp_path):
    src = write_hf_model(tmp_path / "src", tiny_config(), dtype="BF16")
    out = convert(src, tmp_path / "out", bits=16)
    c = Container(out)
    assert not c.quant
    for name, (f, info) in c.index.items():
        assert info.dtype == "BF16", name
        s = SafetensorsFile(next(src.glob("*.safetensors")))
        assert f.pread(info.nbytes, info.start) == s.pread(info.nbytes, s.tensors[name].start)


def test_fp8_block_scaled_source_is_dequantized(tmp_path):
    cfg = tiny_config(hidden_size=256, head_dim=64)
    tensors = tiny_tensors(cfg)
    src = tmp_path / "src"
    write_hf_model(src, cfg, tensors)
    name = "model.layers.0.self_attn.q_proj.weight"                # [256, 256]
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 0x7E, size=(256, 256), dtype=np.uint8)  # finite E4M3 codes
    scale_inv = rng.uniform(0.01, 0.1, size=(2, 2)).astype(np.float32)
    f = SafetensorsFile(src / "model.safetensors")
    entries = [(n, i.dtype, i.shape) for n, i in f.tensors.items() if n != name]
    entries += [(name, "F8_E4M3", (256, 256)), (name + "_scale_inv", "F32", (2, 2))]
    w = SafetensorsWriter(src / "fp8.safetensors", entries)
    for n, dtype, _ in entries[:-2]:
        w.write(n, f.raw(n))
    w.write(name, codes)
    w.write(name + "_scale_inv", scale_inv)
    w.commit()
    f.close()
    (src / "model.safetensors").unlink()
    out = convert(src, tmp_path / "out", bits=16)
    from core.safetensors_io import to_float32
    want = to_float32(codes, "F8_E4M3") * np.repeat(np.repeat(scale_inv, 128, 0), 128, 1)
    got = Container(out).load(name)
    np.testing.assert_array_equal(got.data, want)
    assert name + "_scale_inv" not in Container(out)


def test_bad_inputs_give_clear_errors(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with pytest.raises(ColiError, match="no config.json"):
        convert(src, tmp_path / "o1")
    (src / "config.json").write_text("{nope")
    with pytest.raises(ColiError, match="invalid JSON"):
        convert(src, tmp_path / "o2")
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ColiError, match=r"unsupported model_type 'llama' \(supported: deepseek_v3, deepseek_v4, glm4_moe, glm_moe_dsa, kimi_k2, kimi_linear, olmoe, qwen3_5_moe, qwen3_5_moe_text, qwen3_moe\)"):
        convert(src, tmp_path / "o3")
    model = write_hf_model(tmp_path / "sharded", tiny_config(), shards=2)
    (model / "model-00002-of-00002.safetensors").rename(model / "gone")
    with pytest.raises(ColiError, match="shard model-00002-of-00002.safetensors .* is missing"):
        convert(model, tmp_path / "o4")
    (model / "gone").rename(model / "model-00002-of-00002.safetensors")
    p = model / "model-00001-of-00002.safetensors"
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(ColiError, match="model-00001-of-00002.safetensors is truncated"):
        convert(model, tmp_path / "o5")
    rope = write_hf_model(tmp_path / "rope", tiny_config(rope_parameters={"rope_type": "longrope",
                                                                          "rope_theta": 1e4}))
    with pytest.raises(ColiError, match="rope type 'longrope' is not supported"):
        convert(rope, tmp_path / "o6")
    act = write_hf_model(tmp_path / "act", tiny_config(hidden_act="gelu"))
    with pytest.raises(ColiError, match="hidden_act 'gelu' is not supported"):
        convert(act, tmp_path / "o7")
    for d in ("o3", "o4", "o5", "o6", "o7"):
        assert not (tmp_path / d / "colibri.json").exists()


KILL_AFTER_SECOND_SHARD = textwrap.dedent("""
    import os, signal, sys
    from core import converter
    from models import validate_config
    shards_done = 0
    def progress(p):
        global shards_done
        if p.shard_index >= 2 and p.tensor:   # mid-way through the third shard: die hard
            os.kill(os.getpid(), signal.SIGKILL)
    converter.convert(sys.argv[1], sys.argv[2], validate_config=validate_config, progress=progress)
""")


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_resume_after_kill_is_byte_identical(tmp_path):
    src = write_hf_model(tmp_path / "src", tiny_config(num_hidden_layers=4), shards=2)
    whole = convert(src, tmp_path / "whole")
    out = tmp_path / "killed"
    r = subprocess.run([sys.executable, "-c", KILL_AFTER_SECOND_SHARD, str(src), str(out)], cwd=ROOT)
    assert r.returncode == -9
    assert not (out / "colibri.json").exists(), "a killed run must not look complete"
    assert (out / conv.LOCK).exists() and (out / conv.JOURNAL).exists()
    assert len(json.loads((out / conv.JOURNAL).read_text())["done"]) == 2
    seen = []
    convert(src, out, progress=lambda p: seen.append(p.shard_index))
    assert tree_bytes(out) == tree_bytes(whole)
    assert min(i for i in seen) == 0 and not (out / conv.LOCK).exists()


def test_resume_with_other_parameters_is_refused(tmp_path):
    src = write_hf_model(tmp_path / "src", tiny_config())
    out = tmp_path / "out"

    def stop(p):
        if p.shard_index == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(src, out, progress=stop)
    assert not list(out.glob("*.tmp")) and not (out / conv.LOCK).exists()
    with pytest.raises(ColiError, match="different parameters .*bits"):
        convert(src, out, bits=8)
    convert(src, out)
    with pytest.raises(ColiError, match="other parameters"):
        convert(src, out, bits=8)


def test_lock_keeps_a_second_converter_out(tmp_path):
    src = write_hf_model(tmp_path / "src", tiny_config())
    out = tmp_path / "out"
    out.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / conv.LOCK).write_text(str(sleeper.pid))
        with pytest.raises(ColiError, match=f"another converter \\(pid {sleeper.pid}\\)"):
            convert(src, out)
    finally:
        sleeper.kill()
        sleeper.wait()
    convert(src, out)      # the lock's owner is gone: a stale lock is taken over
    assert (out / "colibri.json").exists()


def test_disk_full(tmp_path, monkeypatch):
    src = write_hf_model(tmp_path / "src", tiny_config())
    monkeypatch.setattr(conv.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(ColiError, match="not enough free space"):
        convert(src, tmp_path / "a")
    monkeypatch.undo()

    import core.safetensors_io as sio
    calls = {"n": 0}
    real = sio.pwrite

    def full(f, data, offset):
        calls["n"] += 1
        if calls["n"] > 30:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, data, offset)

    monkeypatch.setattr(sio, "pwrite", full)
    with pytest.raises(ColiError, match="no space left"):
        convert(src, tmp_path / "b")
    assert not list((tmp_path / "b").glob("*.tmp")) and not (tmp_path / "b" / "colibri.json").exists()


MEASURE = textwrap.dedent("""
    import json, sys
    from core.memory import peak_rss_bytes, rss_bytes
    from core import converter
    import numpy as np, psutil                 # imports done before the baseline
    base = peak_rss_bytes()
    converter.convert(sys.argv[1], sys.argv[2], bits=int(sys.argv[3]))
    print(json.dumps({"base": base, "peak": peak_rss_bytes()}))
""")


@pytest.mark.parametrize("bits", [4, 16])
def test_peak_memory_is_bounded_by_blocks_not_tensors(tmp_path, bits):
    """A 128 MiB embedding converts with far less extra memory than its own size."""
    cfg = tiny_config(vocab_size=32768, hidden_size=1024, head_dim=256, num_hidden_layers=1,
                      num_experts=2, moe_intermediate_size=64)
    tensors = tiny_tensors(cfg)
    big = tensors["model.embed_tokens.weight"].nbytes
    src = write_hf_model(tmp_path / "src", cfg, tensors)
    del tensors
    r = subprocess.run([sys.executable, "-c", MEASURE, str(src), str(tmp_path / "out"), str(bits)],
                       cwd=ROOT, capture_output=True, text=True, check=True)
    m = json.loads(r.stdout)
    grew = m["peak"] - m["base"]
    print(f"largest tensor {big / 2**20:.0f} MiB, peak growth {grew / 2**20:.1f} MiB "
          f"(bound {conv.PEAK_BOUND_BLOCKS} x {conv.BLOCK_BYTES >> 20} MiB)")
    assert grew < conv.PEAK_BOUND_BLOCKS * conv.BLOCK_BYTES
    assert grew < big / 2
