"""`coli import-colibri`: a container in the layout of colibrì's C engine (out-NNNNN shards of
flattened U8 + F32 .qs tensors, no manifest) imported into ours without requantizing.

The fixture is written the way ``c/tools/convert_fp8_to_int4.py`` writes one: its quantizer
(re-expressed below from that file's ``quant_int4_grouped`` / ``quant_int8`` / ``classify``),
every array flattened, one output file per source shard through the stock safetensors writer
(which orders tensors by dtype, so no expert is contiguous), the tensors shuffled over the shards,
the MTP head in out-mtp-00000.
"""
from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest

from core import quant
from core.container import MANIFEST, Container
from core.converter import convert
from core.errors import ColiError
from core.import_colibri import import_colibri
from core.integrity import verify
from core.safetensors_io import SafetensorsFile
from models import open_model, validate_config
from tests.conftest import one_error_line, tiny_config, tiny_tensors, write_hf_model

safetensors_numpy = pytest.importorskip("safetensors.numpy")

# hidden 128 and expert width 192: several int4 groups of 64 per row (2, 3), not one
CFG = dict(hidden_size=128, moe_intermediate_size=192, head_dim=16, num_attention_heads=4,
           num_key_value_heads=2, num_experts=4, vocab_size=97)
IDS = [3, 17, 5, 60, 2, 2, 41, 9]


# --- their quantizer and layout (c/tools/convert_fp8_to_int4.py), re-expressed -------------------
def their_int4_grouped(w: np.ndarray, gs: int = 64) -> tuple[np.ndarray, np.ndarray]:
    O, I = w.shape
    ng = -(-I // gs)
    wp = np.zeros((O, ng * gs), np.float32)
    wp[:, :I] = w
    wr = wp.reshape(O, ng, gs)
    s = np.maximum(np.abs(wr).max(axis=2, keepdims=True) / 7, 1e-8)
    q = np.clip(np.rint(wr / s), -8, 7).astype(np.int32).reshape(O, ng * gs)[:, :I]
    packed = np.zeros((O, (I + 1) // 2), np.uint8)
    packed[:, : (I + 1) // 2] = (q[:, 0::2] + 8).astype(np.uint8)
    packed[:, : I // 2] |= ((q[:, 1::2] + 8).astype(np.uint8) << 4)
    return packed.reshape(-1), s[:, :, 0].astype(np.float32).reshape(-1)


def their_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = np.maximum(np.abs(w).max(axis=1, keepdims=True) / 127, 1e-8)
    q = np.clip(np.rint(w / s), -128, 127).astype(np.int8)
    return q.reshape(-1).view(np.uint8).copy(), s[:, 0].astype(np.float32)


def their_kind(name: str) -> str:
    if name.endswith(("mlp.gate.weight", "norm.weight", "e_score_correction_bias")):
        return "f32"
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "io"                                   # --io-bits 8 (their default): int8 per row
    return "q" if name.endswith(".weight") else "f32"


def their_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, w in tensors.items():
        kind = their_kind(name)
        if kind == "f32" or w.ndim != 2:
            out[name] = w.astype(np.float32)
            continue
        q, s = their_int8(w) if kind == "io" else their_int4_grouped(w)
        out[name], out[name + ".qs"] = q, s
    return out


def write_their_dir(d, cfg, tensors, shards: int = 3, seed: int = 1, mtp: dict | None = None):
    """The C engine's directory: out-00000.. (tensors shuffled over the shards; a weight and its
    scales may land in different files, as source shards split them), out-mtp-00000."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    random.Random(seed).shuffle(names)
    for k in range(shards):
        part = {n: tensors[n] for n in names[k::shards]}
        safetensors_numpy.save_file(part, str(d / f"out-{k:05d}.safetensors"))
    if mtp:
        safetensors_numpy.save_file(mtp, str(d / "out-mtp-00000.safetensors"))
    return d


@pytest.fixture
def pair(tmp_path):
    """(our container converted from the F32 checkpoint, the C engine's directory of it, weights)."""
    cfg = tiny_config(**CFG)
    w = tiny_tensors(cfg, seed=3)
    write_hf_model(tmp_path / "hf", cfg, w)
    ours = convert(tmp_path / "hf", tmp_path / "ours", bits=4, validate_config=validate_config)
    n = cfg["num_hidden_layers"]
    mtp_src = {f"model.layers.{n}.mlp.experts.0.up_proj.weight":
               w["model.layers.0.mlp.experts.0.up_proj.weight"],
               f"model.layers.{n}.eh_proj.weight": w["model.layers.0.self_attn.q_proj.weight"][:, :128],
               f"model.layers.{n}.enorm.weight": w["model.norm.weight"]}
    mtp = their_tensors(mtp_src)
    theirs = write_their_dir(tmp_path / "theirs", cfg, their_tensors(w), mtp=mtp)
    return cfg, ours, theirs, tmp_path


def test_their_encoding_is_ours():
    """Their quantizer and core.quant give the same bytes (the premise of copying them)."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((12, 200)) * 0.3).astype(np.float32)
    q, s = their_int4_grouped(w)
    oq, os_ = quant.quantize_int4(w, 64)
    assert np.array_equal(q.reshape(oq.shape), oq) and np.array_equal(s.reshape(os_.shape), os_)
    q, s = their_int8(w)
    oq, os_ = quant.quantize_int8(w)
    assert np.array_equal(q.reshape(oq.shape), oq) and np.array_equal(s, os_)


def test_import_matches_our_container(pair):
    cfg, ours, theirs, tmp = pair
    # the fixture really is in their layout: flattened arrays, experts split and not contiguous
    f0 = SafetensorsFile(theirs / "out-00000.safetensors")
    assert all(len(i.shape) == 1 for n, i in f0.tensors.items() if i.dtype == "U8")
    assert not f0.metadata
    out = import_colibri(theirs, tmp / "imported", validate_config=validate_config)
    a, b = Container(ours), Container(out)
    try:
        assert a.manifest["tensors"] == b.manifest["tensors"] and a.manifest["shards"] == b.manifest["shards"]
        assert set(a.names()) == set(b.names())
        for name in a.names():          # every tensor's bytes and stored shape identical
            (fa, ia), (fb, ib) = a.index[name], b.index[name]
            assert (ia.dtype, ia.shape) == (ib.dtype, ib.shape), name
            assert fa.pread(ia.nbytes, ia.start) == fb.pread(ib.nbytes, ib.start), name
        assert set(a.experts) == set(b.experts)          # each expert one contiguous range
        for (layer, e), loc in b.experts.items():
            assert a.experts[(layer, e)].end - a.experts[(layer, e)].start == loc.end - loc.start
        assert b.manifest["imported_from"]["format"] == "colibri-c"
        assert b.manifest["classes"]["routed_experts"] == "int4-g64"
        assert b.manifest["classes"]["embeddings"] == "int8-row"
        # the MTP head: set aside as the converter does (mtp-* shards the engine does not open)
        n = cfg["num_hidden_layers"]
        mtp = b.manifest["mtp"]
        assert mtp["layers"] == [n] and mtp["shards"] and not set(mtp["shards"]) & set(b.manifest["shards"])
        assert mtp["quantized"] == {f"model.layers.{n}.mlp.experts.0.up_proj.weight": {
            "scheme": "int4", "shape": [192, 128], "group_size": 64}}
        eh = f"model.layers.{n}.eh_proj.weight"          # no shape in the layout: kept as stored
        assert eh in b.manifest["imported_from"]["as_stored"]
        with SafetensorsFile(out / mtp["shards"][0]) as f:
            assert f.tensors[f"model.layers.{n}.mlp.experts.0.up_proj.weight"].shape == (192, 64)
            assert f.tensors[eh].shape == (64 * 64,) and f.tensors[eh + ".qs"].shape == (64 * 2,)
            assert f.tensors[f"model.layers.{n}.enorm.weight"].dtype == "F32"
        assert verify(out).ok and set(mtp["shards"]) <= set(verify(out).checked)
    finally:
        a.close()
        b.close()
    la, lb = open_model(ours).logits(IDS), open_model(out).logits(IDS)
    assert la.shape == (len(IDS), cfg["vocab_size"]) and np.array_equal(la, lb)


def test_import_cli_resume_and_convert_hint(pair, capsys, dirs):
    from colibri_tui.cli import main as coli
    cfg, ours, theirs, tmp = pair
    assert coli(["import-colibri", str(theirs), str(tmp / "c")]) == 0
    manifest = (tmp / "c" / MANIFEST).read_text()
    assert coli(["import-colibri", str(theirs), str(tmp / "c")]) == 0      # finished: nothing to do
    assert (tmp / "c" / MANIFEST).read_text() == manifest
    import core.import_colibri as ic                   # interrupted after a few tensors, then resumed
    calls, real = [0], ic._copy

    def dying(*a):
        calls[0] += 1
        if calls[0] > 40:
            raise KeyboardInterrupt
        real(*a)
    ic._copy = dying
    try:
        assert coli(["import-colibri", str(theirs), str(tmp / "r")]) != 0
    finally:
        ic._copy = real
    assert not (tmp / "r" / MANIFEST).exists() and (tmp / "r" / ".coli_convert.json").exists()
    assert coli(["import-colibri", str(theirs), str(tmp / "r")]) == 0
    assert json.loads((tmp / "r" / MANIFEST).read_text())["checksums"] == json.loads(manifest)["checksums"]
    line = one_error_line(capsys, ["convert", str(theirs), str(tmp / "x")])
    assert "coli import-colibri" in line and not (tmp / "x" / MANIFEST).exists()


def test_missing_shard_is_one_line(pair, capsys, dirs):
    _, _, theirs, tmp = pair
    gap = tmp / "gap"
    shutil.copytree(theirs, gap)
    (gap / "out-00001.safetensors").unlink()
    line = one_error_line(capsys, ["import-colibri", str(gap), str(tmp / "o1")])
    assert "out-00001.safetensors is missing" in line
    last = tmp / "last"                       # the last shard: no gap, a needed tensor is absent
    shutil.copytree(theirs, last)
    gone = set(SafetensorsFile(last / "out-00002.safetensors").tensors)
    (last / "out-00002.safetensors").unlink()
    line = one_error_line(capsys, ["import-colibri", str(last), str(tmp / "o2")])
    assert "is missing" in line and any(f"tensor {n} " in line for n in gone)
    idx = tmp / "idx"                         # an index naming a shard that is absent
    shutil.copytree(theirs, idx)
    (idx / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "out-00000.safetensors", "y": "out-00003.safetensors"}}))
    line = one_error_line(capsys, ["import-colibri", str(idx), str(tmp / "o3")])
    assert "out-00003.safetensors named by model.safetensors.index.json is missing" in line
    for o in ("o1", "o2", "o3"):
        assert not (tmp / o / MANIFEST).exists()


@pytest.mark.parametrize("case", ["short_weight", "per_row_int4", "dense_count"])
def test_byte_count_fitting_no_scheme_is_one_line(tmp_path, capsys, dirs, case):
    cfg = tiny_config(**CFG)
    t = their_tensors(tiny_tensors(cfg, seed=3))
    name = "model.layers.1.mlp.experts.2.down_proj.weight"         # [128, 192]
    if case == "short_weight":
        t[name] = t[name][:-5]
    elif case == "per_row_int4":
        t[name + ".qs"] = t[name + ".qs"][:128]
    else:
        name = "model.layers.0.input_layernorm.weight"
        t[name] = t[name][:-1]
    d = write_their_dir(tmp_path / "bad", cfg, t)
    line = one_error_line(capsys, ["import-colibri", str(d), str(tmp_path / "o")])
    assert f"tensor {name} " in line and ("fits no scheme" in line or "fit no scheme" in line)
    if case == "per_row_int4":
        assert "one scale per row" in line
    assert not (tmp_path / "o" / MANIFEST).exists()
    with pytest.raises(ColiError, match=name.replace(".", r"\.")):
        import_colibri(d, tmp_path / "o", validate_config)


def test_a_glm5_directory_imports_to_our_container(tmp_path):
    """GLM-5 (glm_moe_dsa) in their layout: MLA and shared experts in out-NNNNN, the DSA
    indexer's weights in out-idx-00000 (their --indexer), the MTP layer in out-mtp-00000; shapes
    from the family's own layout. Same bytes and logits as `coli convert --bits 4` of the same
    transformers checkpoint (tests/oracle/fixtures/glmdsa-a)."""
    from safetensors.numpy import load_file
    from tests.conftest import COMMITTED
    src = COMMITTED / "glmdsa-a" / "model"
    cfg = json.loads((src / "config.json").read_text())
    w = {}
    for f in sorted(src.glob("*.safetensors")):
        w.update(load_file(str(f)))
    ours = convert(src, tmp_path / "ours", bits=4, validate_config=validate_config)
    # their indexer classes as ours: int4 projections, F32 norms and weights_proj
    theirs_all = {}
    for name, t in w.items():
        if name.endswith("indexer.weights_proj.weight"):
            theirs_all[name] = t.astype(np.float32)
        else:
            theirs_all.update(their_tensors({name: t}))
    idx = {n: t for n, t in theirs_all.items() if ".indexer." in n}
    main = {n: t for n, t in theirs_all.items() if ".indexer." not in n}
    d = write_their_dir(tmp_path / "theirs", cfg, main, shards=2)
    safetensors_numpy.save_file(idx, str(d / "out-idx-00000.safetensors"))
    out = import_colibri(d, tmp_path / "imported", validate_config=validate_config)
    a, b = Container(ours), Container(out)
    try:
        assert set(a.names()) == set(b.names())
        for name in a.names():
            (fa, ia), (fb, ib) = a.index[name], b.index[name]
            assert (ia.dtype, ia.shape) == (ib.dtype, ib.shape), name
            ra, rb = (np.frombuffer(f.pread(i.nbytes, i.start), np.uint8) for f, i in ((fa, ia), (fb, ib)))
            cols = a.logical_shapes().get(name, (0, 0))[-1]
            if ia.dtype == "U8" and cols % 2:      # an odd width's padding nibble: theirs 0, ours 8
                ra, rb = ra.reshape(ia.shape).copy(), rb.reshape(ib.shape).copy()
                ra[:, -1] &= 0x0F
                rb[:, -1] &= 0x0F
            assert np.array_equal(ra, rb), name
    finally:
        a.close()
        b.close()
    ids = list(range(1, 12))          # past index_topk: the indexer's choice matters
    assert np.array_equal(open_model(ours).logits(ids), open_model(out).logits(ids))
