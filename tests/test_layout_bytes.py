"""Each family's declared layout (issue 26) converts every checkpoint byte for byte as the
converter did before the layout existed: sha256 of each file `coli convert` writes and of its
manifest, recorded from the code before the refactor (tests/layout_bytes.json, commit 6f5fa50's
converter), for every committed oracle fixture at --bits 4, 8 and 16, and for checkpoints as the
Hub ships them (fused 3-D experts in BF16 over three files, MTP layers kept or dropped, a
top-level ``mtp.*`` module, block-FP8 experts per expert and fused); and of core.synthetic's
random containers of seven fixtures' configs at bits 4 and 8.

The manifest is compared without the source's path (it names this checkout) and without the
keys the layout adds to it (LAYOUT_KEYS: what a container records of its family's layout).

Record (only on the code before a layout change; never to make a failing run pass)::

    python -m tests.test_layout_bytes --record
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from core import converter as conv
from core.container import MANIFEST
from models import validate_config
from tests.conftest import tiny_config, tiny_tensors, write_hf_model
from tests.test_converter_layouts import _fp8_model, fuse, with_mtp

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "oracle" / "fixtures"
RECORD = ROOT / "tests" / "layout_bytes.json"
LAYOUT_KEYS = ("expert_pattern",)      # manifest keys the layout adds (absent before issue 26)


# the fixtures there were when the digests were recorded (later families have no "before")
RECORDED_FIXTURES = ("deepseekv3-a", "deepseekv3-b", "deepseekv3-c", "glm4moe-a", "glm4moe-b", "glmdsa-a",
                     "glmdsa-b", "kimilinear-a", "kimilinear-b", "olmoe-a", "olmoe-b", "olmoe-c", "olmoe-d",
                     "olmoe-e", "qwen35moe-a", "qwen35moe-b", "qwen3moe-a", "qwen3moe-b", "qwen3moe-c",
                     "qwen3moe-d", "qwen3moe-e")


def _fixture_sources():
    return {f"fixture/{name}": (lambda tmp, d=FIXTURES / name: d / "model") for name in RECORDED_FIXTURES}


def _fused_bf16(tmp: Path) -> Path:
    cfg = tiny_config()
    return write_hf_model(tmp / "fused", cfg, fuse(tiny_tensors(cfg), cfg), shards=3, dtype="BF16")


def _mtp_layer(tmp: Path) -> Path:
    cfg = tiny_config()
    return write_hf_model(tmp / "mtp", cfg, with_mtp(tiny_tensors(cfg), cfg))


def _top_mtp(tmp: Path) -> Path:
    cfg = tiny_config()
    extra = {k.replace("model.layers.0.", "mtp.layers.0."): v
             for k, v in tiny_tensors(cfg, seed=3).items() if k.startswith("model.layers.0.")}
    extra = fuse(extra, cfg, prefix="mtp.layers.{}.mlp.experts.", layers=[0])
    extra["mtp.fc.weight"] = np.ones((40, 80), np.float32)
    extra["model.mtp.norm.weight"] = np.ones(40, np.float32)
    return write_hf_model(tmp / "topmtp", cfg, {**tiny_tensors(cfg), **extra})


def _fp8(fused: bool):
    return lambda tmp: _fp8_model(tmp / f"fp8-{fused}", fused=fused)[0]


# case name -> (source maker, convert keyword arguments)
CASES: dict[str, tuple] = {}
for _name, _make in _fixture_sources().items():
    for _bits in (4, 8, 16):
        CASES[f"{_name}@{_bits}"] = (_make, {"bits": _bits})
for _name, _make, _kws in (("fused-bf16", _fused_bf16, ({"bits": 4}, {"bits": 16})),
                           ("mtp-layer", _mtp_layer, ({"bits": 4}, {"bits": 8, "drop_mtp": True})),
                           ("mtp-top", _top_mtp, ({"bits": 8},)),
                           ("fp8-per-expert", _fp8(False), ({"bits": 4}, {"bits": 16})),
                           ("fp8-fused", _fp8(True), ({"bits": 4},))):
    for _kw in _kws:
        CASES[f"{_name}@{_kw['bits']}" + ("-drop-mtp" if _kw.get("drop_mtp") else "")] = (_make, _kw)


def digests(out: Path, new_keys: tuple[str, ...] = LAYOUT_KEYS) -> dict[str, str]:
    """sha256 of every file of the container; the manifest's without the source's path and the
    keys the layout adds (``new_keys``)."""
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
           for p in sorted(out.iterdir()) if p.is_file() and p.name != MANIFEST}
    m = json.loads((out / MANIFEST).read_text())
    m["converter"]["params"].pop("source")
    for key in new_keys:
        m.pop(key, None)
    got[MANIFEST] = hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()
    return got


def convert_case(case: str, tmp: Path) -> dict[str, str]:
    make, kw = CASES[case]
    src = make(tmp)
    return digests(conv.convert(src, tmp / "out", validate_config=validate_config, **kw))


@pytest.mark.parametrize("case", sorted(CASES))
def test_conversion_is_byte_identical_to_before_the_layout(case, tmp_path):
    want = json.loads(RECORD.read_text())["cases"]
    assert case in want, f"{case}: no recorded digests"
    assert convert_case(case, tmp_path) == want[case]


SYNTHETIC = ("olmoe-a", "qwen3moe-b", "deepseekv3-a", "glmdsa-a", "kimilinear-a", "qwen35moe-b", "glm4moe-a")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", SYNTHETIC)
def test_synthetic_container_is_byte_identical_to_before_the_layout(name, bits, tmp_path):
    """core.synthetic's random containers of the fixtures' configs (seed 1), recorded likewise.
    Their manifests now record the expert parts too: before the layout, a random Kimi container
    had no ``expert_parts`` and could not run (its experts' w1/w3/w2 were found by no role).
    kimilinear-a's were re-recorded when the generator began scaling the layout's own down part
    (Kimi's ``w2``) as it scales ``down_proj`` (issue 26's DeepSeek V4 synthetic containers)."""
    from core.synthetic import write_random_container
    from models import family_for
    cfg = json.loads((FIXTURES / name / "model" / "config.json").read_text())
    out = write_random_container(tmp_path / "c", cfg, family_for(cfg), bits=bits, seed=1)
    assert digests(out, LAYOUT_KEYS + ("expert_parts",)) == json.loads(RECORD.read_text())["synthetic"][f"{name}@{bits}"]


def test_every_case_is_recorded():
    assert sorted(json.loads(RECORD.read_text())["cases"]) == sorted(CASES)


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import subprocess
    import tempfile
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    cases = {}
    for case in sorted(CASES):
        with tempfile.TemporaryDirectory() as d:
            cases[case] = convert_case(case, Path(d))
    RECORD.write_text(json.dumps({"recorded_on": commit, "cases": cases}, indent=1, sort_keys=True) + "\n")
    print(f"{len(cases)} cases recorded in {RECORD}")
