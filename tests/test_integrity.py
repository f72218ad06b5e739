"""Damaged containers and configs get one clear refusal, never a wrong answer (issue 16): each
case mutates one file of a real converted container and runs the real command line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from colibri_tui.cli import main as coli
from core.container import MANIFEST
from tests.conftest import ROOT, one_error_line, tiny_config, write_hf_model

RUN = ["--ids", "1,2,3", "--max-new-tokens", "3", "--greedy", "--threads", "1", "--json"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    d = tmp_path_factory.mktemp("integrity")
    src = write_hf_model(d / "src", tiny_config())
    assert coli(["convert", str(src), str(d / "c"), "--bits", "4"]) == 0
    return d / "c"


@pytest.fixture
def container(pristine, tmp_path):
    import shutil
    out = tmp_path / "c"
    shutil.copytree(pristine, out)
    return out


def _edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _without_checksums(container) -> None:
    _edit_json(container / MANIFEST, lambda m: m.pop("checksums"))


@pytest.mark.parametrize("change, match", [
    (lambda c: c["rope_parameters"].update(rope_theta=0), "rope_theta must be a finite number > 0"),
    (lambda c: c["rope_parameters"].update(rope_theta=-10000.0), "rope_theta"),
    (lambda c: c["rope_parameters"].update(rope_theta=float("nan")), "rope_theta"),
    (lambda c: c.pop("rope_parameters") and c.update(rope_theta=0.0), "rope_theta"),     # older configs
    (lambda c: c["rope_parameters"].update(rope_theta="1e4"), "rope_theta"),
    (lambda c: c.pop("rope_parameters") and c.update(rope_theta=10000.0,
                                                     rope_scaling={"rope_type": "linear", "factor": 0}),
     "factor must be a finite number > 0"),
    (lambda c: c.update(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": -2.0}), "factor"),
    (lambda c: c.update(rms_norm_eps=0), "rms_norm_eps must be a finite number > 0"),
    (lambda c: c.update(rms_norm_eps=-1e-6), "rms_norm_eps"),
    (lambda c: c.update(rms_norm_eps=float("inf")), "rms_norm_eps"),
    (lambda c: c.update(tie_word_embeddings="False"), "tie_word_embeddings must be true or false"),
    (lambda c: c.update(norm_topk_prob=1), "norm_topk_prob must be true or false"),
    (lambda c: c.update(head_dim=0), "head_dim must be a positive integer"),
    (lambda c: c.update(num_key_value_heads="2"), "num_key_value_heads"),
    (lambda c: c.update(max_position_embeddings=-1), "max_position_embeddings"),
    (lambda c: c.update(mlp_only_layers="0"), "mlp_only_layers must be a list of integers"),
    (lambda c: c.update(use_sliding_window="yes"), "use_sliding_window"),
])
def test_meaningless_config_values_are_refused(container, capsys, change, match):
    _edit_json(container / "config.json", change)
    line = one_error_line(capsys, ["run", "--model", str(container), *RUN])
    assert match.split("|")[0] in line, line


def test_valid_configs_still_run(container, capsys):
    _edit_json(container / "config.json", lambda c: c.update(rms_norm_eps=1e-5, tie_word_embeddings=False))
    assert coli(["run", "--model", str(container), *RUN]) == 0


def test_a_missing_lm_head_is_an_error_not_the_embedding(container, capsys):
    """With tie_word_embeddings false, the embedding is not an output head."""
    from core.safetensors_io import SafetensorsFile, SafetensorsWriter
    other = container / "model-other.safetensors"
    f = SafetensorsFile(other)
    keep = {n: (t.dtype, t.shape, f.raw(n)) for n, t in f.tensors.items() if not n.startswith("lm_head.")}
    f.close()
    w = SafetensorsWriter(other, [(n, d, s) for n, (d, s, _) in keep.items()])
    for n, (_, _, a) in keep.items():
        w.write(n, a)
    w.commit()
    _edit_json(container / MANIFEST, lambda m: [m["tensors"].pop(k) for k in list(m["tensors"]) if k.startswith("lm_head.")])
    line = one_error_line(capsys, ["run", "--model", str(container), *RUN])
    assert "the header of model-other.safetensors changed since conversion" in line
    _without_checksums(container)        # as a container converted before checksums existed
    line = one_error_line(capsys, ["run", "--model", str(container), *RUN])
    assert "lm_head.weight is missing" in line


def _first_int4(manifest) -> str:
    return next(n for n, q in manifest["tensors"].items() if q["scheme"] == "int4")


@pytest.mark.parametrize("change, match", [
    (lambda q: q.update(group_size=1 << 30), "group_size"),
    (lambda q: q.update(group_size=8), "has group size 8, the converter's was 64"),
    (lambda q: q.update(shape=[q["shape"][0], q["shape"][1] + 2]), "does not match"),
    (lambda q: q.update(shape=[q["shape"][0] * 2, q["shape"][1]]), "does not match"),
    (lambda q: q.update(shape=["4", 8]), "shape"),
    (lambda q: q.update(scheme="int3"), "unknown scheme"),
    (lambda q: q.update(scheme="int8"), "does not match"),
])
def test_manifest_entries_are_checked_against_the_stored_tensors(container, capsys, change, match):
    def edit(m):
        change(m["tensors"][_first_int4(m)])
    _edit_json(container / MANIFEST, edit)
    line = one_error_line(capsys, ["info", "--model", str(container)])
    assert match in line and MANIFEST in line, line


@pytest.mark.parametrize("change", [
    lambda m: m.update(shards="layer-000.safetensors"),
    lambda m: m.update(tensors=[1]),
    lambda m: m["shards"].append("../../etc/passwd"),
    lambda m: m["tensors"].update({"nope.weight": {"scheme": "int8", "shape": [2, 2]}}),
    lambda m: m["tensors"].update({"x": "int4"}),
])
def test_manifest_structure_damage_is_one_line(container, capsys, change):
    _edit_json(container / MANIFEST, change)
    one_error_line(capsys, ["info", "--model", str(container)])


def test_a_deeply_nested_manifest_is_one_line(container, capsys):
    (container / MANIFEST).write_text("[" * 100000 + "]" * 100000)
    one_error_line(capsys, ["info", "--model", str(container)])


def test_a_quantized_tensor_without_scales_is_named(container, capsys):
    from core.safetensors_io import SafetensorsFile, SafetensorsWriter
    m = json.loads((container / MANIFEST).read_text())
    name = _first_int4(m)
    shard = next(p for p in sorted(container.glob("*.safetensors"))
                 if name + ".qs" in SafetensorsFile(p).tensors)
    f = SafetensorsFile(shard)
    keep = {n: (t.dtype, t.shape, f.raw(n)) for n, t in f.tensors.items() if n != name + ".qs"}
    f.close()
    w = SafetensorsWriter(shard, [(n, d, s) for n, (d, s, _) in keep.items()])
    for n, (_, _, a) in keep.items():
        w.write(n, a)
    w.commit()
    line = one_error_line(capsys, ["info", "--model", str(container)])
    assert f"the header of {shard.name} changed since conversion" in line
    _without_checksums(container)
    line = one_error_line(capsys, ["info", "--model", str(container)])
    assert f"{name} has no scales" in line


def test_the_converter_refuses_a_huge_group_size(tmp_path, capsys):
    src = write_hf_model(tmp_path / "src", tiny_config())
    line = one_error_line(capsys, ["convert", str(src), str(tmp_path / "o"), "--group-size", str(1 << 30)])
    assert "--group-size" in line


def test_unchanged_containers_give_the_same_logits(container, tmp_path, capsys):
    """The checks refuse damage only: a pristine container's logits are those of main."""
    out = tmp_path / "l.npy"
    assert coli(["logits", "--model", str(container), "--ids", "1,2,3,4", "--out", str(out), "--threads", "1"]) == 0
    logits = np.load(out)
    assert np.isfinite(logits).all() and logits.shape[0] == 4


# --- the converter refuses sources it would turn into containers that do not load ---------------
def _source(tmp_path, **over):
    return write_hf_model(tmp_path / "src", tiny_config(**over))


@pytest.mark.parametrize("damage, match", [
    (lambda src: _edit_json(src / "config.json", lambda c: c.update(num_key_value_heads=4)),
     "k_proj.weight has shape [24, 40], but the config needs [48, 40]"),
    (lambda src: _edit_json(src / "config.json", lambda c: c.update(hidden_size=48)), "has shape"),
    (lambda src: _edit_json(src / "config.json", lambda c: c.update(num_experts=7)),
     "mlp.gate.weight has shape"),
    (lambda src: _edit_json(src / "config.json", lambda c: c.update(num_hidden_layers=3)),
     "model.layers.2.input_layernorm.weight is missing"),
    (lambda src: (src / "tokenizer.json").write_text("{garbage"), "tokenizer files do not load"),
    (lambda src: (src / "generation_config.json").write_text("[1, 2"), "generation_config.json"),
])
def test_the_converter_refuses_a_source_whose_parts_disagree(tmp_path, capsys, damage, match):
    from tests.conftest import tokenizer_files
    src = _source(tmp_path)
    if not (src / "tokenizer.json").exists():
        tokenizer_files(src)
    if not (src / "generation_config.json").exists():
        (src / "generation_config.json").write_text('{"eos_token_id": 2}')
    damage(src)
    line = one_error_line(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert match in line, line
    assert not (tmp_path / "out" / MANIFEST).exists()


def test_a_source_missing_an_expert_tensor_is_refused(tmp_path, capsys):
    from core.safetensors_io import SafetensorsFile, SafetensorsWriter
    src = _source(tmp_path)
    for shard in sorted(src.glob("*.safetensors")):
        f = SafetensorsFile(shard)
        keep = {n: (t.dtype, t.shape, f.raw(n)) for n, t in f.tensors.items()
                if n != "model.layers.1.mlp.experts.3.up_proj.weight"}
        f.close()
        w = SafetensorsWriter(shard, [(n, d, s) for n, (d, s, _) in keep.items()])
        for n, (_, _, a) in keep.items():
            w.write(n, a)
        w.commit()
    line = one_error_line(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert "model.layers.1.mlp.experts.3.up_proj.weight is missing" in line


def test_a_container_whose_config_was_edited_is_refused_at_open(container, capsys):
    _edit_json(container / "config.json", lambda c: c.update(num_key_value_heads=4))
    line = one_error_line(capsys, ["run", "--model", str(container), *RUN])
    assert "k_proj.weight has shape" in line and str(container) in line


# --- usage histories: never a crash, a hang, or user data inside the installation -----------------
def _demo():
    from models import default_model
    d = default_model()
    if d is None:
        pytest.skip("no embedded demo model")
    return d


def test_usage_counts_that_add_up_to_inf_are_ignored(tmp_path, capsys):
    from core.usage import load_usage
    p = tmp_path / ".coli_usage"
    p.write_text("-1 2 4\n-2 1 5\n0 1 1e308\n0 2 1e308\n1 0 3\n")
    assert load_usage(p, 2, 4) == {}
    assert "add up to more than a float holds" in capsys.readouterr().err


def test_a_run_with_an_inf_history_finishes_cleanly(container, capsys):
    (container / ".coli_usage").write_text("-1 2 6\n-2 1 5\n0 1 1e308\n0 2 1e308\n")
    capsys.readouterr()
    assert coli(["run", "--model", str(container), *RUN]) == 0
    err = capsys.readouterr().err
    assert "internal error" not in err and err.count("ignoring usage history") == 1


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no FIFOs on this OS")
def test_a_fifo_named_coli_usage_is_never_opened(container, capsys):
    import os
    import subprocess
    import sys
    os.mkfifo(container / ".coli_usage")
    r = subprocess.run([sys.executable, "-m", "colibri_tui", "run", "--model", str(container), *RUN],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "not a regular file" in r.stderr


def test_the_demo_history_is_user_data_not_package_data(tmp_path, monkeypatch):
    from models import model_usage_path
    demo = _demo()
    monkeypatch.setenv("COLI_DATA_DIR", str(tmp_path / "data"))
    p = model_usage_path(demo)
    assert p.is_relative_to(tmp_path / "data") and not p.is_relative_to(demo)
    other = tmp_path / "mine"
    other.mkdir()
    assert model_usage_path(other) == other.resolve() / ".coli_usage"      # colibrì's place


def test_a_demo_run_writes_no_file_into_the_package(tmp_path):
    import subprocess
    import sys
    demo = _demo()
    before = sorted(p.name for p in demo.iterdir())
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("COLI_MODEL",)}
    env.update(COLI_DATA_DIR=str(tmp_path / "data"), COLI_CONFIG_DIR=str(tmp_path / "cfg"))
    r = subprocess.run([sys.executable, "-m", "colibri_tui", "run", "Hello", "--max-new-tokens", "3",
                        "--seed", "1"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in demo.iterdir()) == before
    assert list((tmp_path / "data" / "usage").glob("*.coli_usage"))


def test_a_truncated_expert_is_refused_at_open_whatever_the_prefetch(container, capsys):
    """Read timing cannot decide: the shard's size is checked against its header at open."""
    shard = container / "layer-001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-40])
    for flags in ([], ["--no-prefetch"], ["--cap", "1"]):
        line = one_error_line(capsys, ["run", "--model", str(container), *RUN, *flags])
        assert "layer-001.safetensors is truncated" in line, line


# --- past the model's context: refused or stopped, never extrapolated ---------------------------
def test_past_max_position_embeddings_is_refused_or_stopped(container, capsys, tmp_path):
    _edit_json(container / "config.json", lambda c: c.update(max_position_embeddings=8))
    line = one_error_line(capsys, ["run", "--model", str(container), "--ids", ",".join(["1"] * 9), "--json"])
    assert "the prompt needs 9 positions, past the model's context of 8" in line
    line = one_error_line(capsys, ["logits", "--model", str(container), "--ids", ",".join(["1"] * 9),
                                    "--out", str(tmp_path / "l.npy")])
    assert "past the model's context of 8" in line
    capsys.readouterr()
    assert coli(["run", "--model", str(container), "--ids", "1,2,3,4,5", "--max-new-tokens", "10",
                 "--greedy", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["reason"] == "context" and len(out["ids"]) == 4     # positions 5, 6, 7 + the last


@pytest.mark.parametrize("edit", [
    lambda h: h["model.norm.weight"].update(dtype="I32"),                     # same size, other dtype
    lambda h: h.update({"__metadata__": {"format": "colibri", "x": "1"}}),     # harmless-looking
])
def test_an_edited_header_is_refused_by_its_digest(container, capsys, edit):
    """Header edits that stay self-consistent (sizes and offsets still tile the file) are caught
    by the header digest the converter recorded; without it they are the validator's."""
    shard = container / "model-other.safetensors"
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8: 8 + n])
    edit(header)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    shard.write_bytes(len(blob).to_bytes(8, "little") + blob + data[8 + n:])
    line = one_error_line(capsys, ["run", "--model", str(container), *RUN])
    assert "the header of model-other.safetensors changed since conversion" in line
    _edit_json(container / MANIFEST, lambda m: m["checksums"].pop("model-other.safetensors"))
    line = one_error_line(capsys, ["run", "--model", str(container), *RUN])
    assert "has no checksum for model-other.safetensors" in line


def test_a_group_size_that_fits_no_scales_is_refused(container, capsys):
    def edit(m):            # every int4 entry and the converter's record: consistent, but wrong
        for q in m["tensors"].values():
            if q["scheme"] == "int4":
                q["group_size"] = 8
        m["converter"]["group_size"] = 8
    _edit_json(container / MANIFEST, edit)
    line = one_error_line(capsys, ["info", "--model", str(container)])
    assert "does not match its colibri.json entry" in line, line
