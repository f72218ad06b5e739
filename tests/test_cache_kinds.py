"""Per-layer cache kinds (core.cache_kinds, issue 17): the planner and coli plan size the caches
from what each layer declares, not from an attention formula."""
from __future__ import annotations

import dataclasses

import pytest

from core.cache_kinds import KV, bytes_per_position, describe, fixed_bytes
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
    from core.cache import KVCache
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


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_ring_keeps_the_last_window_positions_and_attends_as_the_growing_cache(dtype):
    """A sliding window's ring (core.cache_kinds.Ring): passes of any length give the rows of the
    positions each query sees, in order and in the cache's precision, and attention over them
    with shifted positions is attention over a growing cache with the window (decode: the same
    bits); its bytes do not
    grow with the context; it cannot truncate, and its checkpoint puts it back."""
    import numpy as np
    from core import kernels
    from core.arch import ArchSpec
    from core.cache import KVCache
    from core.cache_kinds import Ring
    W, heads, D = 5, 2, 8
    ring = Ring(heads, D, W)
    spec = ArchSpec(vocab_size=8, hidden_size=8, num_layers=2, num_heads=heads, num_kv_heads=heads, head_dim=D,
                    rms_norm_eps=1e-6, mlp_kinds=["moe"] * 2, num_experts=2, top_k=1, norm_topk_prob=False,
                    cache_kinds=[ring, KV(heads, D)])
    assert ring.bytes_per_position(dtype) == 0 and ring.fixed_bytes(dtype) == 2 * heads * W * D * np.dtype(dtype).itemsize
    assert "ring of 5" in describe(spec.cache_kinds, dtype)
    cache = KVCache(spec, dtype=dtype)
    assert not cache.truncatable and cache.state[0]["k"].shape == (heads, W, D)
    rng = np.random.default_rng(0)
    scale = np.float32(D ** -0.5)
    for T in (3, 1, 7, 1, 1, 4):          # a prompt, decode steps, a pass longer than the window
        k, v, q = (rng.standard_normal((T, heads, D)).astype(np.float32) for _ in range(3))
        pos = np.arange(cache.length, cache.length + T)
        (rk, start), (rv, _) = cache.append_part(0, "k", k), cache.append_part(0, "v", v)
        gk, gv = cache.append(1, k, v)
        assert start == max(0, cache.length - W + 1) and rk.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(rk, gk[:, start:])
        np.testing.assert_array_equal(rv, gv[:, start:])
        got = kernels.attention(q, rk.astype(np.float32), rv.astype(np.float32), scale, pos - start, W)
        want = kernels.attention(q, gk.astype(np.float32), gv.astype(np.float32), scale, pos, W)
        if T == 1:      # the one-row kernel reads the same rows: the same bits
            np.testing.assert_array_equal(got, want)
        else:           # numpy's products over fewer masked columns: float32 rounding
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        cache.length += T
        assert cache.folded[0] == cache.length
        held, first = ring.view(cache.state[0], "k", cache.length)
        np.testing.assert_array_equal(held, cache.k[1][:, first: cache.length])
        assert held.shape[1] == min(cache.length, W)
    saved, n = cache.checkpoint(), cache.length
    cache.append_part(0, "k", np.ones((2, heads, D), np.float32))
    cache.restore(saved, n)
    np.testing.assert_array_equal(ring.view(cache.state[0], "k", n)[0], cache.k[1][:, n - W: n])


def test_a_kind_keeping_an_object_of_its_own_checkpoints_it_and_is_not_saved(tmp_path):
    """A kind need not keep named arrays (a compressor's partial block, its entries): the cache
    holds what its make() returns under the kind's name (cache[i][name]), checkpoints and
    restores it through the kind, recycles it, and saved sessions pass such a cache by."""
    from types import SimpleNamespace
    from core.arch import ArchSpec
    from core.cache import KVCache
    from core.sessions import SessionStore

    @dataclasses.dataclass(frozen=True)
    class Tally:          # counts the positions it saw
        name = "tally"
        truncatable = False
        growing = False

        def make(self, dtype, recycled):
            return recycled.get(self.name) or {"seen": [0]}

        def checkpoint(self, kept):
            return list(kept["seen"])

        def restore(self, kept, saved):
            kept["seen"][:] = saved

        def bytes_per_position(self, dtype="float32"):
            return 0

        def fixed_bytes(self, dtype="float32"):
            return 8

    spec = ArchSpec(vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4,
                    rms_norm_eps=1e-6, mlp_kinds=["moe"], num_experts=2, top_k=1, norm_topk_prob=False,
                    cache_kinds=[(KV(1, 4), Tally())])
    cache = KVCache(spec)
    cache[0]["tally"]["seen"][0] = 3
    saved = cache.checkpoint()
    cache[0]["tally"]["seen"][0] = 5
    cache.restore(saved, 3)
    assert cache[0]["tally"]["seen"] == [3] and cache.length == 3 and not cache.truncatable
    assert KVCache(spec, cache.buffers())[0]["tally"] is cache[0]["tally"]        # recycled
    assert not cache.savable and cache[0]["kv"]["k"] is cache.k[0]
    entry = SimpleNamespace(ids=[1, 2, 3], cache=cache, logits=None, prompt_len=3, checkpoint=saved)
    assert SessionStore(tmp_path).save(None, 1, entry) is None


def test_coli_plan_states_each_dsv4_kind_and_the_state_holds_what_it_says(containers, capsys):
    """DeepSeek V4 (tiny dsv4-a): coli plan gives each kind apart -- the window's ring (fixed),
    the compressed entries and the indexer keys (per ratio positions, plus the open block) -- and
    after a prefill the cache's arrays are those bytes: fixed ones exactly (an HCA compressor keeps
    no overlap half), entries at most the stated bytes per position."""
    import json

    import numpy as np

    from colibri_tui.cli import main as coli
    from core.cache_kinds import by_kind, layer_kinds
    from models import family_for, open_model
    path = containers("dsv4-a", 16)
    cfg = json.loads((path / "config.json").read_text())
    spec = family_for(cfg).spec(cfg)
    D, d, W = cfg["head_dim"], cfg["index_head_dim"], cfg["sliding_window"]
    rates = cfg["compress_rates"]
    csa, hca = rates["compressed_sparse_attention"], rates["heavily_compressed_attention"]
    rows = {r["kind"]: r for r in by_kind(spec.cache_kinds)}
    assert rows[f"ring of {W} (kv: 1 x {D} each)"] == {"kind": f"ring of {W} (kv: 1 x {D} each)", "layers": 4,
                                                       "bytes_per_position": 0, "fixed_bytes": W * D * 4}
    entries = rows[f"compressed entries ({D} per {csa} positions)"]
    index = rows[f"indexer keys ({d} per {csa} positions)"]
    numbers = lambda row: (row["layers"], row["bytes_per_position"], row["fixed_bytes"])    # noqa: E731
    assert numbers(entries) == (2, D * 4 // csa, 4 * 2 * csa * 3 * D)
    assert numbers(index) == (2, d * 4 // csa, 4 * 2 * csa * 3 * d)
    heavy = rows[f"compressed entries ({D} per {hca} positions)"]
    assert numbers(heavy) == (1, D * 4 // hca, 4 * 2 * hca * D)
    assert coli(["plan", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    for k in rows.values():
        assert (f"{k['kind']} on {k['layers']} layer{'s' if k['layers'] > 1 else ''}: "
                f"{k['bytes_per_position']:,} bytes per position + {k['fixed_bytes']:,} fixed each") in out
    engine = open_model(path, threads=1)
    cache = engine.new_cache()
    n = 45
    engine.prefill(list(np.arange(n) % cfg["vocab_size"]), cache)
    for i, entry in enumerate(spec.cache_kinds):
        for k in layer_kinds(entry):
            kept = cache[i][k.name]
            if k.name == "ring":
                assert sum(a.nbytes for a in cache.state[i].values()) == k.fixed_bytes()
                continue
            assert sum(a.nbytes for a in (kept.kv, kept.gate, kept.prior_kv, kept.prior_gate)) == k.fixed_bytes()
            assert kept.entries(n).nbytes == (n // k.ratio) * k.dim * 4 <= n * k.bytes_per_position()


def test_the_flash_kinds_at_the_real_geometry():
    """DeepSeek-V4-Flash's caches as coli plan states them: a 128-position ring of 512 values on
    all 43 layers; CSA (21 layers) 512-value entries + 128-value indexer keys per 4 positions;
    HCA (20 layers) 512-value entries per 128 positions."""
    from core.cache_kinds import by_kind
    from models.catalog import load
    from models.deepseek_v4 import DeepseekV4
    flash = next(e for e in load() if e.repo == "deepseek-ai/DeepSeek-V4-Flash")
    got = [(r["kind"], r["layers"], r["bytes_per_position"], r["fixed_bytes"])
           for r in by_kind(DeepseekV4.spec(flash.config).cache_kinds)]
    assert got == [("ring of 128 (kv: 1 x 512 each)", 43, 0, 128 * 512 * 4),
                   ("compressed entries (512 per 4 positions)", 21, 512, 4 * 2 * 4 * 3 * 512),
                   ("indexer keys (128 per 4 positions)", 21, 128, 4 * 2 * 4 * 3 * 128),
                   ("compressed entries (512 per 128 positions)", 20, 16, 4 * 2 * 128 * 512)]
