"""The one law: placement decides speed, never output. Logits and greedy tokens are byte-identical
whatever the RAM tier holds, with prefetch on or off, O_DIRECT on or off, 1 or 2 threads."""
from __future__ import annotations

import json

import numpy as np
import pytest

from core import kernels
from core.cache import KVCache
from core.errors import ColiError
from models import open_model
from tests.conftest import oracle_names


def _decode_logits(engine, prompt, n):
    cache = KVCache(engine.spec)
    logits = [engine.forward(prompt, cache)[-1]]
    for _ in range(n - 1):
        logits.append(engine.forward([int(np.argmax(logits[-1]))], cache)[-1])
    return np.stack(logits)


def _variants(top_k, num_experts):
    yield dict(cap=num_experts, prefetch=False)
    yield dict(cap=1)
    yield dict(cap=2, prefetch=False)
    yield dict(cap=top_k, policy="lfru")
    yield dict(cap=1, o_direct=True)
    yield dict(cap=2, threads=1)
    yield dict(cap=2, threads=2, policy="pinned")


@pytest.mark.parametrize("name", oracle_names())
def test_logits_identical_across_placements(name, fixture_root, containers):
    ids = np.load(fixture_root / name / "reference.npz")["ids"].tolist()
    c4 = containers(name, 4)
    base = open_model(c4)
    want_tf, want_dec = base.logits(ids), _decode_logits(base, ids[:6], 12)
    spec = base.spec
    for kw in _variants(spec.top_k, spec.num_experts):
        engine = open_model(c4, **kw)
        np.testing.assert_array_equal(engine.logits(ids), want_tf, err_msg=str(kw))
        np.testing.assert_array_equal(_decode_logits(engine, ids[:6], 12), want_dec, err_msg=str(kw))
        engine.store.close()
    kernels.set_threads(None)


def test_small_cap_reads_from_disk_and_counts(containers):
    name = oracle_names()[0]
    c4 = containers(name, 4)
    engine = open_model(c4, cap=1)
    events = list(engine.generate([1, 2, 3, 4], max_new_tokens=6))
    final = [e for e in events if type(e).__name__ == "Stats"][-1].as_dict()
    assert final["final"] and final["misses"] > 0 and final["bytes_read"] > 0
    assert 0 <= final["hit_rate"] < 1
    assert final["prefetch_issued"] >= final["prefetch_used"] >= 0
    per_token = [e for e in events if type(e).__name__ == "Stats"][:-1]
    assert len(per_token) == 6 and not per_token[0].extra["final"]
    full = open_model(c4)
    full.usage_file = None          # keep this run's counts in memory
    list(full.generate([1, 2, 3, 4], max_new_tokens=6))
    st = full.store.stats()    # everything fits: each used expert is read once, by a miss or a prefetch
    assert st["misses"] + st["prefetch_used"] == len(full.usage)


def test_budget_too_small_and_bad_containers(containers, tmp_path):
    c4 = containers(oracle_names()[0], 4)
    with pytest.raises(ColiError, match="too small: one expert per layer needs"):
        open_model(c4, ram_gb=1e-9)
    with pytest.raises(ColiError, match="--cap must be >= 1"):
        open_model(c4, cap=0)
    with pytest.raises(ColiError, match="unknown cache policy"):
        open_model(c4, policy="fifo")
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(c4, broken)
    shard = json.loads((broken / "colibri.json").read_text())["shards"][0]
    data = (broken / shard).read_bytes()
    (broken / shard).write_bytes(data[: len(data) - 100])
    with pytest.raises(ColiError, match=f"{shard} is truncated"):
        open_model(broken, cap=1)
    (broken / shard).unlink()
    with pytest.raises(ColiError, match=f"shard {shard} is missing"):
        open_model(broken, cap=1)


def _decode_logits_own_cache(engine, prompt, n):
    cache = engine.new_cache()          # the engine's KV precision
    logits = [engine.forward(prompt, cache)[-1]]
    for _ in range(n - 1):
        logits.append(engine.forward([int(np.argmax(logits[-1]))], cache)[-1])
    return np.stack(logits), cache


def test_float16_kv_cache_obeys_the_law_and_stays_close(fixture_root, containers):
    """The opt-in float16 KV cache: half the KV memory; byte-identical across placements and
    threads like float32; logits within a small distance of the float32 cache's."""
    name = oracle_names()[0]
    ids = np.load(fixture_root / name / "reference.npz")["ids"].tolist()
    c4 = containers(name, 4)
    want32, cache32 = _decode_logits_own_cache(open_model(c4), ids[:6], 12)
    base = open_model(c4, kv_cache="float16")
    want, cache = _decode_logits_own_cache(base, ids[:6], 12)
    assert cache.k[0].dtype == np.float16 and cache32.k[0].dtype == np.float32
    assert cache.k[0].nbytes * 2 == cache32.k[0].nbytes
    tf = base.logits(ids)
    for kw in (dict(cap=1), dict(cap=2, threads=2, prefetch=False), dict(cap=2, o_direct=True)):
        engine = open_model(c4, kv_cache="float16", **kw)
        got, _ = _decode_logits_own_cache(engine, ids[:6], 12)
        np.testing.assert_array_equal(got, want, err_msg=str(kw))
        np.testing.assert_array_equal(engine.logits(ids), tf, err_msg=str(kw))
        engine.store.close()
    kernels.set_threads(None)
    scale = np.abs(want32).max()
    assert 0 < np.abs(want - want32).max() < 0.05 * scale
    with pytest.raises(ColiError, match="kv-cache"):
        open_model(c4, kv_cache="float8")


def test_anonymous_buffers_are_aligned_and_zeroed():
    from core.memory import anonymous_buffer
    for n in (1, 10_000, 5 << 20):
        a = np.frombuffer(anonymous_buffer(n), np.uint8)
        assert a.size == n and a.ctypes.data % 4096 == 0 and not a.any()
        a[:] = 7                                         # writable


def test_expert_slots_share_one_arena(containers):
    engine = open_model(containers(oracle_names()[0], 4), cap=3)
    bufs = [s.buf for layer in engine.store.layers.values() for s in layer.slots]
    assert len({id(b.obj) for b in bufs}) == 1                 # one mapping, not one per slot
    addresses = sorted(np.frombuffer(s.buf, np.uint8).ctypes.data
                       for layer in engine.store.layers.values() for s in layer.slots)
    step = engine.store.slot_bytes
    assert step % 4096 == 0 and addresses[0] % 4096 == 0       # O_DIRECT's alignment
    assert np.all(np.diff(addresses) == step)                 # contiguous, none overlapping


def test_an_arena_the_os_cannot_map_is_one_clear_error(containers):
    from core.container import Container
    from core.tiered_store import TieredStore
    c = Container(containers(oracle_names()[0], 4))
    with pytest.raises(ColiError, match="cannot reserve .* --cap"):
        TieredStore(c, cap=1 << 40)        # petabytes: past any machine's address space
