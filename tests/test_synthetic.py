"""Random containers written directly (core/synthetic.py): valid, converter layout, deterministic."""
import json

import numpy as np
import pytest

from core import converter as conv
from core import quant
from core.container import Container
from core.errors import ColiError
from core.safetensors_io import SafetensorsFile
from core.synthetic import container_bytes, tensor_shapes, write_random_container
from models import family_for, open_model, validate_config
from tests.conftest import tiny_config, write_hf_model

FAMILIES = ("olmoe", "qwen3_moe")


def small_config(model_type: str, **over) -> dict:
    kw = dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, vocab_size=211,
              num_hidden_layers=3)
    if model_type == "qwen3_moe":
        kw.update(head_dim=16, moe_intermediate_size=32, intermediate_size=48)
    else:
        kw.update(intermediate_size=32)
    kw.update(over)
    return tiny_config(model_type, **kw)


def header_bytes(path) -> bytes:
    raw = path.read_bytes()
    return raw[: 8 + int.from_bytes(raw[:8], "little")]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_opens_runs_and_experts_are_contiguous(tmp_path, model_type):
    extra = {"mlp_only_layers": [1]} if model_type == "qwen3_moe" else {}
    cfg = small_config(model_type, **extra)
    out = write_random_container(tmp_path / "c", cfg, family_for(cfg))
    c = Container(out)       # refuses an expert that is not one contiguous range
    moe_layers = [0, 2] if model_type == "qwen3_moe" else [0, 1, 2]
    assert sorted(c.experts) == [(l, e) for l in moe_layers for e in range(8)]
    for loc in c.experts.values():
        assert loc.end - loc.start == sum(i.nbytes for _, i in loc.parts.values())
        assert len(loc.parts) == 6      # gate/up/down + scales
    assert json.loads((out / "config.json").read_text()) == cfg
    assert c.manifest["converter"]["params"]["source"] == "synthetic"
    data = sum(f.path.stat().st_size - f.data_start for f in c.files)
    assert data == container_bytes(cfg, family_for(cfg))["total"]
    c.close()
    logits = open_model(out).logits([1, 2, 3, 50, 7])
    assert logits.shape == (5, 211) and np.isfinite(logits).all()
    assert len(set(logits.argmax(-1).tolist())) > 1


@pytest.mark.parametrize("model_type", FAMILIES)
def test_same_layout_as_converting_a_checkpoint(tmp_path, model_type):
    cfg = tiny_config(model_type)
    src = write_hf_model(tmp_path / "src", cfg)
    ref = conv.convert(src, tmp_path / "conv", validate_config=validate_config)
    syn = write_random_container(tmp_path / "syn", cfg, family_for(cfg))
    mref = json.loads((ref / "colibri.json").read_text())
    msyn = json.loads((syn / "colibri.json").read_text())
    for key in ("format", "format_version", "model_type", "classes", "shards", "tensors"):
        assert msyn[key] == mref[key], key
    assert msyn["converter"]["bits"] == mref["converter"]["bits"]
    for shard in mref["shards"]:     # same header bytes: names, order, dtypes, shapes, offsets
        assert header_bytes(syn / shard) == header_bytes(ref / shard), shard
        assert (syn / shard).stat().st_size == (ref / shard).stat().st_size
    assert {n: f.shape for n, f in SafetensorsFile(src / "model.safetensors").tensors.items()} == \
        tensor_shapes(cfg, family_for(cfg))


def test_bits8_layout_matches_converter(tmp_path):
    cfg = tiny_config("olmoe")
    ref = conv.convert(write_hf_model(tmp_path / "src", cfg), tmp_path / "conv", bits=8,
                       validate_config=validate_config)
    syn = write_random_container(tmp_path / "syn", cfg, family_for(cfg), bits=8)
    for shard in json.loads((ref / "colibri.json").read_text())["shards"]:
        assert header_bytes(syn / shard) == header_bytes(ref / shard), shard
    assert np.isfinite(open_model(syn).logits([1, 2, 3])).all()


def test_deterministic_bytes_and_seed_matters(tmp_path):
    cfg = small_config("olmoe")
    a = write_random_container(tmp_path / "a", cfg, family_for(cfg), seed=3)
    b = write_random_container(tmp_path / "b", cfg, family_for(cfg), seed=3)
    c = write_random_container(tmp_path / "c", cfg, family_for(cfg), seed=4)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    assert (a / "layer-000.safetensors").read_bytes() != (c / "layer-000.safetensors").read_bytes()
    # rerunning on a finished container is a no-op; other parameters are refused
    mtime = (a / "layer-000.safetensors").stat().st_mtime_ns
    write_random_container(a, cfg, family_for(cfg), seed=3)
    assert (a / "layer-000.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(ColiError, match="other parameters"):
        write_random_container(a, cfg, family_for(cfg), seed=5)


def test_resume_after_interruption_gives_the_same_bytes(tmp_path):
    cfg = small_config("qwen3_moe")
    a = write_random_container(tmp_path / "a", cfg, family_for(cfg), seed=1)
    b = write_random_container(tmp_path / "b", cfg, family_for(cfg), seed=1)
    before = {p.name: p.read_bytes() for p in b.iterdir()}
    # as if killed while writing layer 1: no manifest, a journal listing layer 0, a partial temp
    (b / "colibri.json").unlink()
    for name in ("layer-001.safetensors", "layer-002.safetensors", "model-other.safetensors"):
        (b / name).unlink()
    (b / "layer-001.safetensors.tmp").write_bytes(b"partial")
    params = json.loads((a / "colibri.json").read_text())["converter"]["params"]
    from core.converter import JOURNAL
    (b / JOURNAL).write_text(json.dumps({"params": params,
                                         "done": {"layer-000.safetensors": True}}))
    mtime = (b / "layer-000.safetensors").stat().st_mtime_ns
    write_random_container(b, cfg, family_for(cfg), seed=1)
    assert (b / "layer-000.safetensors").stat().st_mtime_ns == mtime       # not rewritten
    assert {p.name: p.read_bytes() for p in b.iterdir()} == before


def test_values_look_like_quantized_weights(tmp_path):
    # odd intermediate size: the packed int4 rows end in a padding nibble (code 8), as converted
    cfg = small_config("olmoe", hidden_size=128, intermediate_size=45, num_experts=4)
    c = Container(write_random_container(tmp_path / "c", cfg, family_for(cfg)))
    down = c.load("model.layers.0.mlp.experts.1.down_proj.weight")      # [128, 45]
    assert down.scheme == "int4" and down.shape == (128, 45) and down.data.shape == (128, 23)
    assert ((down.data[:, -1] >> 4) == 8).all()
    up = c.load("model.layers.0.mlp.experts.1.up_proj.weight")          # [45, 128]
    nib = np.concatenate([up.data & 0x0F, up.data >> 4])
    assert nib.min() >= 1 and len(np.unique(nib)) == 15                 # codes -7..7, never -8
    w = quant.dequantize_int4(up.data, up.scales, 128)
    assert abs(w.mean()) < 0.1 * w.std()
    assert 0.9 < w.std() * np.sqrt(128) < 1.1                           # std ≈ 1/sqrt(fan_in)
    wd = quant.dequantize_int4(down.data, down.scales, 45)               # into the residual:
    assert 0.9 < wd.std() * np.sqrt(45) * np.sqrt(2 * 3) < 1.1          # also / sqrt(2·layers)
    emb = c.load("model.embed_tokens.weight")
    assert emb.scheme == "int8" and (emb.data != 0x80).all()
    assert 0.9 < quant.dequantize_int8(emb.data, emb.scales).std() < 1.1
    assert (c.load("model.layers.2.input_layernorm.weight").data == 1).all()
    # routing varies from token to token: router top-2 of normalised embeddings
    router = c.load("model.layers.0.mlp.gate.weight").data                # [4, 128] F32
    x = quant.dequantize_int8(emb.data[:40], emb.scales[:40])
    x /= np.sqrt((x * x).mean(1, keepdims=True))
    top = np.argsort(-(x @ router.T), axis=1)[:, :2]
    assert len({tuple(sorted(t)) for t in top.tolist()}) >= 4
    c.close()


def test_greedy_decoding_does_not_collapse(tmp_path):
    # a deep random model must keep its input visible, else greedy repeats one token and every
    # expert-cache hit rate measured on it is inflated
    cfg = small_config("olmoe", num_hidden_layers=12, vocab_size=2000, hidden_size=128)
    engine = open_model(write_random_container(tmp_path / "c", cfg, family_for(cfg)))
    from core.events import Stats
    from core.sampling import SamplingParams
    stats = [e for e in engine.generate([5, 77, 1234], SamplingParams(greedy=True), max_new_tokens=24)
             if isinstance(e, Stats)][-1]
    assert len(set(stats.extra["ids"])) >= 20      # 24 here; 16 without the residual scaling


def test_bad_arguments(tmp_path):
    with pytest.raises(ColiError):
        cfg = small_config("olmoe")
        write_random_container(tmp_path / "x", cfg, family_for(cfg), bits=16)


@pytest.mark.parametrize("name", ["glm4moe-a", "deepseekv3-b", "glmdsa-a"])
def test_newer_families_same_layout_as_converting_their_transformers_checkpoint(tmp_path, name):
    """The family's layout (core.layout.expected_tensors) is the one source of the tensors: a
    synthetic container of a real tiny transformers checkpoint's config has the converted one's
    tensors, shapes and headers, and runs (MLA latent cache, DSA indexer, shared experts...)."""
    from tests.conftest import COMMITTED
    src = COMMITTED / name / "model"
    cfg = json.loads((src / "config.json").read_text())
    ref = conv.convert(src, tmp_path / "conv", validate_config=validate_config)
    syn = write_random_container(tmp_path / "syn", cfg, family_for(cfg))
    mref, msyn = (json.loads((d / "colibri.json").read_text()) for d in (ref, syn))
    assert msyn["tensors"] == mref["tensors"] and msyn["shards"] == mref["shards"]
    for shard in mref["shards"]:
        assert header_bytes(syn / shard) == header_bytes(ref / shard), shard
    shapes = {}
    for f in src.glob("*.safetensors"):
        shapes.update({n: t.shape for n, t in SafetensorsFile(f).tensors.items()})
    assert shapes == tensor_shapes(cfg, family_for(cfg))
    logits = open_model(syn).logits([1, 2, 3, 50, 7, 9, 11])     # past index_topk: DSA selects
    assert np.isfinite(logits).all()


def test_a_family_with_its_own_expert_parts_runs(tmp_path):
    """Kimi's routed experts are w1 / w3 / w2: the random container records them from the
    family's layout (manifest ``expert_parts``) and runs. Before the layout it recorded nothing
    and its experts were found by no role (KeyError at the first MoE layer)."""
    from pathlib import Path
    fixture = Path(__file__).resolve().parent / "oracle" / "fixtures" / "kimilinear-a" / "model"
    cfg = json.loads((fixture / "config.json").read_text())
    engine = open_model(write_random_container(tmp_path / "c", cfg, family_for(cfg)))
    assert np.isfinite(engine.logits([1, 2, 3])).all()


@pytest.mark.parametrize("fp4", [False, True])
def test_deepseek_v4_same_layout_as_converting_its_checkpoint_and_runs(tmp_path, fp4):
    """DeepSeek V4 (the committed transformers-layout fixture's config): the random container has
    the converted one's tensors and headers at --bits 4 -- what the blocks read as numbers
    (Need.float32: mHC mixes, compressors, routers) F32, the hash layers' tid2eid int64 as the
    source has it, the routed experts FP4 with ``fp4_experts`` as convert(fp4_experts=True) --
    its tid2eid rows name distinct experts, and it decodes a few tokens. Before: the mixes were
    int4 (open refused an unquantized vector) and tid2eid random float32 bytes."""
    from tests.conftest import COMMITTED
    from core.events import Stats
    from core.sampling import SamplingParams
    src = COMMITTED / "dsv4-a" / "model"
    cfg = json.loads((src / "config.json").read_text())
    ref = conv.convert(src, tmp_path / "conv", bits=4, drop_mtp=True, fp4_experts=fp4,
                       validate_config=validate_config)
    syn = write_random_container(tmp_path / "syn", cfg, family_for(cfg), fp4_experts=fp4)
    mref, msyn = (json.loads((d / "colibri.json").read_text()) for d in (ref, syn))
    assert msyn["tensors"] == mref["tensors"] and msyn["shards"] == mref["shards"]
    assert msyn["classes"] == mref["classes"]
    for shard in mref["shards"]:
        assert header_bytes(syn / shard) == header_bytes(ref / shard), shard
    c = Container(syn)
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    for i in (0, 1):
        t = c.load_ints(f"model.layers.{i}.ffn.gate.tid2eid")
        assert t.shape == (cfg["vocab_size"], k) and t.min() >= 0 and t.max() < E
        assert (np.sort(t, axis=1)[:, 1:] != np.sort(t, axis=1)[:, :-1]).all()
        assert len(np.unique(t)) == E
    assert c.load("model.layers.2.hc_attn_fn").scheme == "dense"
    assert c.load("model.layers.2.ffn.experts.1.w1.weight").scheme == (quant.FP4 if fp4 else "int4")
    c.close()
    engine = open_model(syn, threads=1)
    stats = [e for e in engine.generate([5, 77, 123], SamplingParams(greedy=True), max_new_tokens=12)
             if isinstance(e, Stats)][-1]
    assert len(stats.extra["ids"]) == 12 and len(set(stats.extra["ids"])) > 6
    assert np.isfinite(engine.logits(list(range(1, 30)))).all()


def test_fp4_experts_have_the_int4_weights_spread(tmp_path):
    """FP4 experts: every code occurs, group scales are powers of two whose weights have std
    1/sqrt(fan_in) (the down projection also / sqrt(2·layers), as int4's), odd widths end in a
    zero padding nibble."""
    cfg = small_config("olmoe", hidden_size=256, intermediate_size=95, num_experts=4)
    c = Container(write_random_container(tmp_path / "c", cfg, family_for(cfg), fp4_experts=True))
    up = c.load("model.layers.0.mlp.experts.1.up_proj.weight")           # [95, 256]
    assert up.scheme == quant.FP4 and up.data.shape == (95, 128) and up.scales.shape == (95, 8)
    assert len(np.unique(np.concatenate([up.data & 0x0F, up.data >> 4]))) == 16
    assert set(np.unique(up.scales).tolist()) == {121, 122}               # 127 + log2(1/16 / 2.93) = 121.4
    w = quant.dequantize_fp4(up.data, up.scales, 256)
    assert abs(w.mean()) < 0.05 * w.std() and 0.85 < w.std() * np.sqrt(256) < 1.15
    down = c.load("model.layers.0.mlp.experts.1.down_proj.weight")       # [256, 95]: odd
    assert ((down.data[:, -1] >> 4) == 0).all()
    wd = quant.dequantize_fp4(down.data, down.scales, 95)
    assert 0.85 < wd.std() * np.sqrt(95) * np.sqrt(2 * 3) < 1.15
    c.close()
