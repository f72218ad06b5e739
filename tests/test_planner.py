"""The automatic RAM budget at low memory (issue 20): the KV room is the session's context, the
runtime allowance is measured, the pool gives slots back as the context grows, and the OS page
cache is named when it acts as a tier."""
from __future__ import annotations

import numpy as np
import psutil
import pytest

from core import planner
from core.container import Container

CONFIG = dict(model_type="olmoe", vocab_size=1000, hidden_size=512, intermediate_size=512,
              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, num_experts=32,
              num_experts_per_tok=4, hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=4096)
OLD_RUNTIME = 512 << 20           # the planner's fixed allowance before issue 20


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from core.synthetic import write_random_container
    return write_random_container(tmp_path_factory.mktemp("planner") / "m", CONFIG, seed=5)


def _spec(c):
    from models import family_for
    return family_for(c.config).spec(c.config)


def _available(monkeypatch, n: int) -> None:
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": int(n)})())


def test_a_low_memory_budget_gives_the_pool_more_than_one_expert_per_layer(model):
    """Memory where the old planner (4096 positions of KV + 512 MiB) had room for one expert per
    layer: the session's context and the measured runtime leave the pool far more."""
    c = Container(model)
    try:
        spec = _spec(c)
        slot, layers = planner.slot_bytes(c), len({l for l, _ in c.experts})
        dense, per_position = planner.dense_ram_bytes(c, spec), planner.kv_bytes_per_position(spec)
        # the old formula: 0.75 x available - dense - 512 MiB - 4096 positions = 1.5 slots per layer
        available = int((dense + OLD_RUNTIME + 4096 * per_position + 1.5 * slot * layers) / planner.AUTO_SHARE)
        old_cap = max(1, int((planner.AUTO_SHARE * available - dense - OLD_RUNTIME - 4096 * per_position)
                             // (slot * layers)))
        assert old_cap == 1
        runtime = 40 << 20                              # as open_model would have measured it
        plan = planner.make_plan(c, spec, available=available, context=80, runtime_bytes=runtime)
        working = planner.working_bytes(spec, 80)
        want = int(planner.AUTO_SHARE * (available - dense - runtime - working - 80 * per_position)
                   // (slot * layers))
        assert plan.cap == min(spec.num_experts, want) > 1
        assert (plan.kv_positions, plan.kv_reserved_bytes) == (80, 80 * per_position)
        assert (plan.runtime_bytes, plan.runtime_measured, plan.working_bytes) == (runtime, True, working)
        # a session of unknown length: 4096 positions at most, never more than a quarter of the room
        unknown = planner.make_plan(c, spec, available=available)
        room = available - dense - planner.working_bytes(spec)
        assert unknown.kv_positions == min(4096, max(planner.MIN_CONTEXT, int(0.25 * room // per_position)))
        assert unknown.cap > old_cap
        # what the plan leaves to the OS, and the share of the experts outside the pool it could
        # cache (a runtime that leaves the pool part of the experts)
        big = int(available - dense - working - 80 * per_position - 8.5 * slot * layers / planner.AUTO_SHARE)
        tight = planner.make_plan(c, spec, available=available, context=80, runtime_bytes=big)
        assert tight.cap == 8
        pool = tight.cap * slot * layers
        left = available - dense - big - working - tight.kv_reserved_bytes - pool
        assert tight.page_cache_bytes == left
        outside = tight.expert_bytes - tight.expert_bytes * tight.cap / spec.num_experts
        assert tight.page_cache_share == pytest.approx(min(1.0, left / outside), rel=1e-3)
        assert tight.page_cache_tier == (tight.page_cache_share >= 0.10)
    finally:
        c.close()


def test_the_prefill_chunk_the_planner_counts_is_the_engine_s():
    from core.engine import Engine
    assert planner.PREFILL_CHUNK == Engine.PREFILL_CHUNK


def test_the_kv_room_grows_with_the_context_and_the_pool_pays_for_it(model, monkeypatch):
    """Past the reserved positions the pool gives back slots (never below one per layer), so pool
    + caches stay within what was promised; the output is the full-RAM run's."""
    from core.sampling import SamplingParams
    from models import open_model

    c = Container(model)
    spec = _spec(c)
    slot, layers = planner.slot_bytes(c), len({l for l, _ in c.experts})
    dense, per_position = planner.dense_ram_bytes(c, spec), planner.kv_bytes_per_position(spec)
    c.close()
    # room for ~20 slots per layer besides the model's dense weights and a small runtime
    _available(monkeypatch, dense + (60 << 20) + 20 * slot * layers / planner.AUTO_SHARE)
    engine = open_model(model, context=16, threads=1)
    plan = engine.plan
    assert plan.mode == "auto" and plan.runtime_measured and plan.kv_positions == 16
    cap0, promised = plan.cap, plan.ram_expert_bytes + plan.kv_reserved_bytes
    assert 1 < cap0 <= spec.num_experts and engine.store.cap == cap0
    prompt = [int(i) for i in np.random.default_rng(0).integers(1, 1000, size=600)]
    out = [e.id for e in engine.generate(prompt, SamplingParams(greedy=True), max_new_tokens=8)
           if type(e).__name__ == "Token" and e.id >= 0]
    assert plan.kv_positions >= 600 + 7 and plan.kv_positions % planner.KV_STEP == 0
    assert 1 <= engine.store.cap == plan.cap < cap0          # slots given back
    assert plan.ram_expert_bytes == engine.store.stats()["ram_bytes"]
    paid = plan.ram_expert_bytes + plan.kv_reserved_bytes
    assert paid <= promised or plan.cap == 1                 # within the promise (or one slot left)
    assert engine.prefixes.budget_bytes == plan.kv_reserved_bytes
    full = open_model(model, cap=spec.num_experts, threads=1)
    same = [e.id for e in full.generate(prompt, SamplingParams(greedy=True), max_new_tokens=8)
            if type(e).__name__ == "Token" and e.id >= 0]
    assert out == same                                       # placement never changes output


def test_shrink_gives_slots_back_and_keeps_serving_the_right_bytes(model):
    from core.tiered_store import TieredStore

    c = Container(model)
    try:
        store = TieredStore(c, cap=8)
        for e in range(8):
            list(store.request(0, [e]))
        store.shrink(3)
        assert store.cap == 3 and all(len(L.slots) == 3 for L in store.layers.values())
        assert len(store.layers[0].where) == 3 and store.stats()["ram_bytes"] == 3 * store.slot_bytes * 4
        for e in (0, 5, 7, 2, 31):      # hits and misses after the shrink: the container's own bytes
            (got, ffn), = store.request(0, [e])
            ref = c.expert_weights(0, e, c.read_expert(0, e))
            assert got == e and np.array_equal(np.asarray(ffn.gate.data), np.asarray(ref["gate_proj.weight"].data))
        store.close()
    finally:
        c.close()


def test_released_pages_read_as_zeros():
    from core.memory import anonymous_buffer, release_pages
    import mmap
    page = mmap.PAGESIZE
    buf = anonymous_buffer(8 * page)
    buf[:] = b"\x07" * (8 * page)
    if not release_pages(buf, 2 * page, 3 * page):
        pytest.skip("this OS gives no way to release anonymous pages")
    assert bytes(buf[2 * page: 5 * page]) == bytes(3 * page)
    assert buf[page] == 7 and buf[5 * page] == 7


def test_the_store_says_how_much_the_page_cache_served(model):
    """A file just written sits in the page cache: reading its experts does not touch the disk."""
    from core import pagecache
    from core.tiered_store import TieredStore

    assert pagecache.served_share(100, 25) == 0.75
    assert pagecache.served_share(100, 400) == 0.0 and pagecache.served_share(0, 0) == 0.0
    c = Container(model)
    try:
        for e in range(32):
            c.read_expert(1, e)             # make sure the bytes are cached
        store = TieredStore(c, cap=4)
        store.reset_stats()
        for e in range(32):
            list(store.request(1, [e]))
        st = store.stats()
        assert st["bytes_read"] > 0
        if pagecache.disk_read_bytes() is None:
            assert st["page_cache_source"] == "timing" and st["disk_bytes"] is None
        else:
            assert st["page_cache_source"] == "io" and st["disk_bytes"] >= 0
            assert st["page_cache_share"] > 0.5
        store.close()
    finally:
        c.close()


def test_coli_plan_reports_the_context_the_runtime_and_the_page_cache(model, monkeypatch, capsys):
    from colibri_tui.cli import main

    c = Container(model)
    spec = _spec(c)
    slot, layers, dense = planner.slot_bytes(c), len({l for l, _ in c.experts}), planner.dense_ram_bytes(c, spec)
    c.close()
    _available(monkeypatch, dense + 8 * slot * layers / planner.AUTO_SHARE + (64 << 20))
    assert main(["plan", "--model", str(model), "--context", "300"]) == 0
    out = capsys.readouterr().out
    assert "kept free for 300 positions" in out and "grows with the context" in out
    assert "runtime measured when the model opens" in out
    assert "page cache" in out and "the OS page cache acts as a tier" in out
    assert main(["plan", "--model", str(model), "--context", "300", "--json"]) == 0
    import json
    d = json.loads(capsys.readouterr().out)
    assert d["kv_positions"] == 300 and d["page_cache_tier"] is True and d["page_cache_bytes"] > 0
    assert main(["plan", "--model", str(model), "--context", "0"]) != 0      # one line, no traceback
    assert "the context must be >= 1 position" in capsys.readouterr().err


def test_the_tier_panel_names_the_page_cache_when_it_acts_as_a_tier():
    from textual.app import App

    from colibri_tui.tierpanel import TierPanel

    class Host(App):
        def compose(self):
            yield TierPanel()

    async def run():
        app = Host()
        async with app.run_test() as pilot:
            panel = app.query_one(TierPanel)
            panel.set_model(4, 32, 10_000_000)
            await pilot.pause()
            assert "pg cache" not in panel.plain()             # nothing read yet
            panel.push(stats={"new_tokens": 3, "bytes_read": 5_000_000, "hits": 1, "misses": 9,
                              "page_cache_share": 0.62, "page_cache_source": "io"})
            await pilot.pause()
            assert "pg cache" in panel.plain() and "OS tier · 62% of reads" in panel.plain()
            panel.push(stats={"new_tokens": 4, "bytes_read": 6_000_000, "page_cache_share": 0.01})
            await pilot.pause()
            assert "pg cache" not in panel.plain()             # the disk served the reads

    import asyncio
    asyncio.run(run())


def test_an_untied_embedding_stays_on_disk_and_gives_the_same_rows(model):
    """One row a token: read from the file when needed, left out of the dense RAM the budget pays."""
    from core.container import RowsOnDisk
    from core.kernels import rows
    from models import open_model

    c = Container(model)
    try:
        spec = _spec(c)
        name = spec.prefix + "embed_tokens.weight"
        assert not spec.tie_word_embeddings
        assert planner.dense_ram_bytes(c) - planner.dense_ram_bytes(c, spec) == c.index[name][1].nbytes
        lazy, full = c.load_rows(name), c.load(name)
        assert isinstance(lazy.data, RowsOnDisk) and lazy.shape == full.shape
        ids = np.array([0, 999, 5, 5, 123])
        assert np.array_equal(rows(lazy, ids), rows(full, ids))          # the same bits
        with pytest.raises(IndexError):
            lazy.data[np.array([1000])]
    finally:
        c.close()
    engine = open_model(model, cap=4, threads=1)
    assert isinstance(engine.embed.weight.data, RowsOnDisk) and engine.plan.dense_bytes == planner.dense_ram_bytes(
        Container(model), engine.spec)


def test_coli_run_reserves_its_prompt_and_reply():
    from colibri_tui.cli import TEMPLATE_ALLOWANCE, _context_needed
    assert _context_needed([5, 6, 7], 10) == 13
    assert _context_needed("héllo", 10) == len("héllo".encode()) + TEMPLATE_ALLOWANCE + 10
