"""Per-layer cache kinds (core.cache_kinds, issue 17): the planner and coli plan size the caches
from what each layer declares, not from an attention formula."""
from __future__ import annotations

import dataclasses

import pytest

from core.cache_kinds import KV, bytes_per_position, fixed_bytes
from core.errors import ColiError


@dataclasses.dataclass(frozen=True)
class FixedState:
    """A stand-in for a recurrent-state layer: fixed bytes, nothing per position."""
    nbytes: int
    name = "state"

    def bytes_per_position(self, dtype="float32"):
        return 0

    def fixed_bytes(self, dtype="float32"):
        return self.nbytes


def test_kv_bytes():
    k = KV(num_kv_heads=4, head_dim=12)
    assert k.bytes_per_position("float32") == 2 * 4 * 12 * 4 and k.bytes_per_position("float16") == 2 * 4 * 12 * 2
    assert k.fixed_bytes() == 0
    assert bytes_per_position([k, k, FixedState(100)]) == 2 * 384 and fixed_bytes([k, FixedState(100)]) == 100


def test_the_families_declare_kv_on_every_layer():
    from models import family_for
    from tests.conftest import tiny_config
    for mt in ("qwen3_moe", "olmoe"):
        cfg = tiny_config(mt, num_hidden_layers=3)
        spec = family_for(cfg).spec(cfg)
        assert spec.cache_kinds == [KV(2, 12 if mt == "qwen3_moe" else 10)] * 3


def test_the_planner_reserves_what_the_kinds_declare(containers):
    from core.container import Container
    from core.planner import kv_bytes_per_position, kv_reserved_positions, make_plan
    from models import family_for
    from tests.conftest import oracle_names
    c = Container(containers(oracle_names()[0], 4))
    try:
        spec = family_for(c.config).spec(c.config)
        per_layer = 2 * spec.num_kv_heads * spec.head_dim * 4
        assert kv_bytes_per_position(spec) == spec.num_layers * per_layer     # the old formula's value
        base = make_plan(c, spec)
        spec.cache_kinds = [spec.cache_kinds[0], FixedState(10_000_000)] + spec.cache_kinds[2:]
        mixed = make_plan(c, spec)
        assert mixed.kv_bytes_per_position == base.kv_bytes_per_position - per_layer
        assert mixed.kv_reserved_bytes == (mixed.kv_bytes_per_position * kv_reserved_positions(spec)
                                           + 10_000_000)
    finally:
        c.close()


def test_the_engine_refuses_a_kind_it_does_not_run():
    from core.arch import ArchSpec
    from core.engine import KVCache
    spec = ArchSpec(vocab_size=8, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                    rms_norm_eps=1e-6, mlp_kinds=["moe"] * 2, num_experts=2, top_k=1,
                    norm_topk_prob=False, cache_kinds=[KV(1, 4), FixedState(8)])
    with pytest.raises(ColiError, match="layer 1 keeps a state cache"):
        KVCache(spec)
    spec.cache_kinds = []
    spec.__post_init__()
    assert KVCache(spec).k[1].shape == (1, 0, 4)


def test_coli_plan_states_the_bytes_per_position_of_each_kind(containers, capsys):
    """GLM-5's layers keep the MLA latent (+ DSA index keys on full layers), not expanded K/V:
    coli plan says so, with the bytes (issue 17)."""
    from colibri_tui.cli import main as coli
    from core.cache_kinds import IndexKeys, Latent
    from models import family_for
    import json
    path = containers("glmdsa-a", 4)
    cfg = json.loads((path / "config.json").read_text())
    spec = family_for(cfg).spec(cfg)
    rank, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    full = (Latent(rank, rope), IndexKeys(cfg["index_head_dim"]))
    assert spec.cache_kinds == [full if t == "full" else Latent(rank, rope) for t in cfg["indexer_types"]]
    per_position = sum(k.bytes_per_position() for e in spec.cache_kinds
                       for k in (e if isinstance(e, tuple) else (e,)))
    assert per_position == 4 * sum((rank + rope + (cfg["index_head_dim"] if t == "full" else 0))
                                   for t in cfg["indexer_types"])
    assert coli(["plan", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("per position"))
    assert f"{per_position:,} bytes" in line and f"latent ({rank} + {rope} rope)" in line and "index keys" in line
