"""The newer families' config readers (issue 17): transformers 5.24's defaults and aliases, what
they compose, and refusals by name of what the engine does not implement -- at convert and at
open. The numbers themselves are checked against transformers by tests/test_oracle.py."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from core.blocks.attention import GQA
from core.blocks.mla import MLA
from core.blocks.mlp import MoE, SwiGLU
from core.blocks.routers import SigmoidGroupRouter
from core.errors import ColiError
from models import family_for, open_model
from tests.conftest import COMMITTED


def _config(name: str) -> dict:
    return json.loads((COMMITTED / name / "model" / "config.json").read_text())


def _spec(cfg: dict):
    return family_for(cfg).spec(cfg)


def test_glm4_moe_composition_and_defaults():
    cfg = _config("glm4moe-a")
    spec = _spec(cfg)
    first = cfg.get("first_k_dense_replace", 1)
    assert [l.kind for l in spec.layers] == ["dense"] * first + ["moe"] * (cfg["num_hidden_layers"] - first)
    att = spec.layers[0].mixer
    assert isinstance(att, GQA) and not att.o_bias and att.qk_norm == ("per_head" if cfg.get("use_qk_norm") else "none")
    factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    assert att.rope_dim == int(cfg["head_dim"] * factor) and spec.rope_partial
    moe = spec.layers[-1].ffn
    assert isinstance(moe, MoE) and isinstance(moe.router, SigmoidGroupRouter)
    assert moe.shared == SwiGLU(cfg["hidden_size"], cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
    # partial_rotary_factor absent: Glm4MoeConfig's default 0.5, not a full rotation
    bare = {k: v for k, v in cfg.items() if k != "partial_rotary_factor"}
    bare["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    assert _spec(bare).layers[0].mixer.rope_dim == cfg["head_dim"] // 2


def test_mla_families_read_q_lora_null_as_a_plain_q_proj():
    a, b = _spec(_config("deepseekv3-a")), _spec(_config("deepseekv3-b"))
    assert isinstance(a.layers[0].mixer, MLA) and a.layers[0].mixer.q_lora_rank > 0
    assert _config("deepseekv3-b")["q_lora_rank"] is None and b.layers[0].mixer.q_lora_rank == 0
    # yarn: the softmax scale takes mscale(factor, mscale_all_dim)^2
    cfg = _config("deepseekv3-b")
    m = b.layers[0].mixer
    assert m.scale != pytest.approx((m.qk_nope + m.qk_rope) ** -0.5)


def test_glm_moe_dsa_indexer_types_in_every_spelling():
    cfg = _config("glmdsa-a")
    spec = _spec(cfg)
    kinds = ["full" if l.mixer.indexer is not None else "shared" for l in spec.layers]
    assert kinds == cfg["indexer_types"] and all(l.mixer.shared_index == (k == "shared") for l, k in zip(spec.layers, kinds))
    bare = {k: v for k, v in cfg.items() if k != "indexer_types"}
    pattern = "".join("F" if k == "full" else "S" for k in kinds)
    assert [l.mixer.shared_index for l in _spec({**bare, "index_topk_pattern": pattern}).layers] == \
        [k == "shared" for k in kinds]
    # neither: index_topk_freq / index_skip_topk_offset (freq 1: every layer full)
    assert all(l.mixer.indexer is not None for l in _spec(bare).layers)
    freq = _spec({**bare, "index_topk_freq": 2, "index_skip_topk_offset": 1}).layers
    assert [l.mixer.indexer is not None for l in freq] == [True, False, True][: len(freq)]
    with pytest.raises(ColiError, match="layer 0 must run the indexer"):      # transformers raises too
        _spec({**bare, "index_topk_freq": 2, "index_skip_topk_offset": 0})
    with pytest.raises(ColiError, match="must be integers"):
        _spec({**bare, "index_topk_freq": "2"})


@pytest.mark.parametrize("name,change,message", [
    ("deepseekv3-a", {"num_key_value_heads": 2}, "num_key_value_heads different"),
    ("deepseekv3-a", {"n_group": 3}, "n_group 3 not dividing"),
    ("deepseekv3-a", {"topk_group": 9}, "topk_group 9 > n_group"),
    ("deepseekv3-a", {"routed_scaling_factor": 1e300}, "routed_scaling_factor"),
    ("glmdsa-a", {"indexer_types": ["shared", "full", "full"]}, "layer 0 must run the indexer"),
    ("glmdsa-a", {"indexer_types": ["full", "sparse", "full"]}, "indexer_types must list"),
    ("glmdsa-a", {"index_topk_pattern": "FXS", "indexer_types": None}, "index_topk_pattern must be made of F and S"),
    ("glmdsa-a", {"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ("glmdsa-a", {"q_lora_rank": None}, "q_lora_rank = null"),
    ("glmdsa-a", {"mlp_layer_types": ["dense"]}, "mlp_layer_types must list"),
    ("kimilinear-a", {"model_type": "kimi_k3"}, "Kimi K3 .* is not kimi_linear: it adds cross-layer attention residuals"),
    ("glm4moe-a", {"partial_rotary_factor": 0.01, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     "partial_rotary_factor"),
])
def test_what_is_not_implemented_is_refused_by_name_at_convert_and_at_open(name, change, message, tmp_path, containers):
    cfg = {**_config(name), **change}
    cfg = {k: v for k, v in cfg.items() if v is not None or k == "q_lora_rank"}
    with pytest.raises(ColiError, match=message):
        _spec(cfg)
    # at convert: the source's config.json
    src = tmp_path / "src"
    shutil.copytree(COMMITTED / name / "model", src)
    (src / "config.json").write_text(json.dumps(cfg))
    from colibri_tui.cli import main as coli
    assert coli(["convert", str(src), str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out" / "colibri.json").exists()
    # at open: a good container whose config.json was changed afterwards
    c = tmp_path / "c"
    shutil.copytree(containers(name, 4), c)
    (c / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ColiError, match=message):
        open_model(c)


def test_a_model_without_routed_experts_runs(tmp_path):
    """deepseekv3-b cut to its first (dense) layer: the rest becomes an MTP layer set aside, and
    a model with no MoE layer plans and runs (the planner and the store had max() of nothing)."""
    from colibri_tui.cli import main as coli
    src = tmp_path / "src"
    shutil.copytree(COMMITTED / "deepseekv3-b" / "model", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = cfg.get("first_k_dense_replace", 1)
    (src / "config.json").write_text(json.dumps(cfg))
    assert coli(["convert", str(src), str(tmp_path / "c")]) == 0
    engine = open_model(tmp_path / "c")
    assert all(L.kind == "dense" for L in engine.layers) and engine.plan.moe_layers == 0
    logits = engine.logits([1, 2, 3])
    assert logits.shape == (3, cfg["vocab_size"]) and np.isfinite(logits).all()
