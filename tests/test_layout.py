"""core.layout.Layout, what a family declares of its checkpoint (issue 26): the converter applies
it (renames from a release's own names, fused-expert splits by the family's parts, classes), the
manifest records the expert pattern and the container finds the experts by it (test_layout_bytes:
every fixture converts byte-identically to the converter before the layout)."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from core import converter as conv
from core.container import MANIFEST, Container
from core.errors import ColiError
from core.layout import EXPERT_REGEX, Layout, check_layout
from core.quant import default_class
from models import family_for, validate_config
from tests.conftest import write_hf_model

FIXTURES = Path(__file__).resolve().parent / "oracle" / "fixtures"


def with_layout(**changes):
    """models.validate_config, the spec's layout changed by ``changes`` (a family declaring them)."""
    def validate(config, shapes=None, where="the source checkpoint"):
        spec = validate_config(config)
        spec.layout = dataclasses.replace(spec.layout, **changes)
        if shapes is not None:
            check_layout(spec, shapes, where)
        return spec
    return validate


def fixture(name: str) -> tuple[dict, dict[str, np.ndarray]]:
    d = FIXTURES / name / "model"
    tensors = {}
    for p in sorted(d.glob("*.safetensors")):
        tensors.update(load_file(str(p)))
    return json.loads((d / "config.json").read_text()), tensors


def shard_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and p.name != MANIFEST}


# DeepSeek's original naming, as a release may use it: no "model." prefix, ffn. for mlp., the
# experts' w1 / w3 / w2, head.weight for lm_head.weight
def original_name(name: str) -> str:
    if name == "lm_head.weight":
        return "head.weight"
    name = name.removeprefix("model.").replace(".mlp.", ".ffn.")
    return re.sub(r"(\.experts\.\d+\.)(gate|up|down)_proj\.", lambda m: m.group(1) + {"gate": "w1", "up": "w3",
                                                                                    "down": "w2"}[m.group(2)] + ".", name)


RENAMES = ((r"^head\.weight$", "lm_head.weight"),
           (r"(\.experts\.\d+\.)w1\.", r"\1gate_proj."), (r"(\.experts\.\d+\.)w3\.", r"\1up_proj."),
           (r"(\.experts\.\d+\.)w2\.", r"\1down_proj."), (r"\.ffn\.", ".mlp."),
           (r"^(?!lm_head\.)", "model."))


@pytest.mark.parametrize("bits", [4, 16])
def test_renames_give_the_bytes_of_the_family_named_checkpoint(tmp_path, bits):
    cfg, tensors = fixture("qwen3moe-b")
    plain = write_hf_model(tmp_path / "plain", cfg, tensors)
    orig = write_hf_model(tmp_path / "orig", cfg, {original_name(n): w for n, w in tensors.items()})
    assert "layers.0.ffn.experts.0.w1.weight" in load_file(str(orig / "model.safetensors"))
    a = conv.convert(plain, tmp_path / "a", bits=bits, validate_config=validate_config)
    b = conv.convert(orig, tmp_path / "b", bits=bits, validate_config=with_layout(renames=RENAMES))
    assert shard_bytes(a) == shard_bytes(b)
    ma, mb = (json.loads((d / MANIFEST).read_text()) for d in (a, b))
    assert ma["tensors"] == mb["tensors"] and ma["checksums"] == mb["checksums"]


def test_two_tensors_renamed_alike_are_refused(tmp_path):
    cfg, tensors = fixture("qwen3moe-b")
    src = write_hf_model(tmp_path / "src", cfg, {**tensors, "model.norm2.weight": tensors["model.norm.weight"]})
    with pytest.raises(ColiError, match=r"model\.norm\.weight and model\.norm2\.weight are both renamed "
                                        r"model\.norm\.weight|model\.norm2\.weight and model\.norm\.weight"):
        conv.convert(src, tmp_path / "o", validate_config=with_layout(renames=((r"norm2", "norm"),)))


def test_fused_experts_split_into_the_familys_own_parts(tmp_path):
    """Kimi's routed experts are w1 / w3 / w2; fused (transformers 5: block_sparse_moe.experts.
    gate_up_proj = [w1 | w3], down_proj = w2) they split into those parts, byte-identical to the
    per-expert checkpoint (before the layout they split into gate_proj / up_proj / down_proj,
    which Kimi's layout does not have)."""
    cfg, tensors = fixture("kimilinear-a")
    fused = dict(tensors)
    prefixes = sorted({m.group(1) for n in tensors if (m := re.match(r"(.*\.experts\.)\d+\.w1\.weight$", n))})
    assert prefixes and all(".block_sparse_moe." in p for p in prefixes)
    for p in prefixes:
        E = len([n for n in tensors if n.startswith(p) and n.endswith(".w1.weight")])
        w = {k: [fused.pop(f"{p}{e}.{k}.weight") for e in range(E)] for k in ("w1", "w3", "w2")}
        fused[p + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(w["w1"], w["w3"])])
        fused[p + "down_proj"] = np.stack(w["w2"])
    a = conv.convert(write_hf_model(tmp_path / "per", cfg, tensors), tmp_path / "a", validate_config=validate_config)
    b = conv.convert(write_hf_model(tmp_path / "fused", cfg, fused), tmp_path / "b", validate_config=validate_config)
    assert shard_bytes(a) == shard_bytes(b)


def test_keep_class_stores_the_source_encoding(tmp_path):
    cfg, tensors = fixture("qwen3moe-b")
    src = write_hf_model(tmp_path / "src", cfg, tensors, dtype="BF16")
    out = conv.convert(src, tmp_path / "o", bits=4, validate_config=with_layout(keep=(r"\.o_proj\.weight$",)))
    c = Container(out)
    name = "model.layers.0.self_attn.o_proj.weight"
    assert name not in c.quant and c.index[name][1].dtype == "BF16"
    assert "model.layers.0.self_attn.q_proj.weight" in c.quant
    c.close()


def test_a_familys_own_f32_class():
    """GLM-DSA's indexer weights stay F32 by its layout; the default predicate names no family."""
    name = "model.layers.0.self_attn.indexer.weights_proj.weight"
    assert default_class(name, 2) == "int4"
    cfg, _ = fixture("glmdsa-a")
    assert family_for(cfg).spec(cfg).layout.tensor_class(name, 2) == "f32"
    for router in ("model.layers.1.mlp.gate.weight", "model.layers.1.block_sparse_moe.gate.weight",
                   "model.layers.1.mlp.shared_expert_gate.weight"):
        assert default_class(router, 2) == "f32"
    assert default_class("model.layers.1.mlp.gate_proj.weight", 2) == "int4"


@pytest.fixture(scope="module")
def kimi_container(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi")
    return conv.convert(FIXTURES / "kimilinear-a" / "model", d / "c", validate_config=validate_config)


def _with_manifest(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).symlink_to(p)
    m = json.loads((src / MANIFEST).read_text())
    edit(m)
    (dst / MANIFEST).unlink()
    (dst / MANIFEST).write_text(json.dumps(m))
    return dst


def test_the_container_finds_experts_by_the_recorded_pattern(kimi_container, tmp_path):
    m = json.loads((kimi_container / MANIFEST).read_text())
    assert m["expert_pattern"] == EXPERT_REGEX and m["expert_parts"]["gate"] == "w1.weight"
    c = Container(kimi_container)
    layer, expert = next(iter(c.experts))
    assert set(c.expert_weights(layer, expert, c.read_expert(layer, expert))) == {
        "gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    # a container made before the pattern was recorded: the default, the same experts
    old = Container(_with_manifest(kimi_container, tmp_path / "old", lambda m: m.pop("expert_pattern")))
    assert old.experts.keys() == c.experts.keys()
    # the recorded pattern is the one used: one that matches no tensor finds no expert
    none = Container(_with_manifest(kimi_container, tmp_path / "none", lambda m: m.update(
        expert_pattern=r"\.nothing\.(?P<layer>\d+)\.(?P<expert>\d+)\.")))
    assert none.experts == {} and c.experts
    for x in (old, none, c):
        x.close()


@pytest.mark.parametrize("pattern", ["(", r"experts\.(\d+)\.", 7])
def test_a_bad_recorded_pattern_is_one_line(kimi_container, tmp_path, pattern):
    d = _with_manifest(kimi_container, tmp_path / "bad", lambda m: m.update(expert_pattern=pattern))
    with pytest.raises(ColiError, match="expert_pattern must be a regular expression capturing layer and expert"):
        Container(d)


def test_default_layout_names():
    lay = Layout()
    assert (lay.embed_name, lay.norm_name, lay.head) == ("model.embed_tokens.weight", "model.norm.weight",
                                                          "lm_head.weight")
    assert lay.experts.place("model.layers.3.mlp.experts.5.up_proj.weight") == (3, 5)
    assert lay.experts.place("model.layers.3.mlp.shared_experts.up_proj.weight") is None
    assert lay.mtp_group("model.layers.4.eh_proj.weight", 4) == "model.layers.4"
    assert lay.mtp_group("model.layers.3.eh_proj.weight", 4) is None
    assert lay.mtp_group("mtp.layers.0.mlp.gate.weight", 4) == "mtp.layers.0"
    assert lay.mtp_group("model.mtp.norm.weight", 4) == "model.mtp"


def test_core_and_the_catalog_name_no_family():
    """core/ never imports the families nor branches on a model_type; the quantizer's default
    classes and the catalog name no family: each family's layout and files say what is its own."""
    root = Path(__file__).resolve().parents[1]
    for p in sorted((root / "core").rglob("*.py")):
        text = p.read_text()
        assert not re.search(r"^\s*(from models\b|import models\b)", text, re.M), p
        assert not re.search(r"model_type\s*(==|!=|in )", text), p
    families = ("olmoe", "qwen", "glm", "deepseek", "kimi", "mixtral", "llama")
    for p in (root / "core" / "quant.py", root / "models" / "catalog.py"):
        text = p.read_text().lower()
        assert not [f for f in families if f in text], p
