"""The RAM budget is a promise: a model whose experts are 4x the budget runs within it."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

CONFIG = dict(model_type="olmoe", vocab_size=1000, hidden_size=512, intermediate_size=512,
              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, num_experts=32,
              num_experts_per_tok=4, hidden_act="silu", rms_norm_eps=1e-5)

RUN = textwrap.dedent("""
    import json, sys
    import numpy as np
    from core.memory import peak_rss_bytes, rss_bytes
    from core.sampling import SamplingParams
    from models import open_model
    import core.tiered_store, core.engine, core.tokenizer   # everything imported before the baseline
    base = rss_bytes()
    engine = open_model(sys.argv[1], cap=int(sys.argv[2]))
    events = list(engine.generate(list(range(1, 33)), SamplingParams(greedy=True), max_new_tokens=48))
    final = [e for e in events if type(e).__name__ == "Stats"][-1].as_dict()
    print(json.dumps({"base": base, "peak": peak_rss_bytes(), "dense": engine.plan.dense_bytes,
                      "slots": engine.plan.ram_expert_bytes, "experts": engine.plan.expert_bytes,
                      "hit_rate": final["hit_rate"], "bytes_read": final["bytes_read"]}))
""")

RUNTIME_ALLOWANCE = 12 << 20    # KV cache, activations, Python objects for this context (stated in README)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from core.synthetic import write_random_container
    from models import family_for
    return write_random_container(tmp_path_factory.mktemp("budget") / "m", CONFIG, family_for(CONFIG), seed=3)


def _run(model, cap):
    r = subprocess.run([sys.executable, "-c", RUN, str(model), str(cap)], cwd=ROOT, capture_output=True,
                       text=True, check=True, timeout=600)
    return json.loads(r.stdout)


def test_peak_rss_within_budget_on_a_model_four_times_larger(model):
    m = _run(model, cap=8)                       # 8 of 32 experts per layer: 25 % of the experts
    assert m["experts"] >= 4 * m["slots"] * 0.95
    bound = 1.05 * (m["base"] + m["dense"] + m["slots"]) + RUNTIME_ALLOWANCE
    print(f"\nexperts {m['experts'] / 2**20:.1f} MiB, budget {m['slots'] / 2**20:.1f} MiB, dense "
          f"{m['dense'] / 2**20:.1f} MiB, baseline {m['base'] / 2**20:.1f} MiB -> peak "
          f"{m['peak'] / 2**20:.1f} MiB (bound {bound / 2**20:.1f}), hit rate {m['hit_rate']:.2f}, "
          f"read {m['bytes_read'] / 2**20:.1f} MiB")
    assert m["peak"] <= bound
    assert m["bytes_read"] > m["slots"]          # it really streamed from disk
    full = _run(model, cap=32)                  # the same model fully resident does not fit that bound
    assert full["peak"] > bound


def test_automatic_budget_keeps_room_for_the_kv_cache(monkeypatch):
    """`coli plan` / open_model's automatic pool leaves the KV cache of the session's context free
    (a long chat must not push the process past the budget it was promised; past it, the pool
    gives back slots: tests/test_planner.py)."""
    import psutil

    from core import planner
    from core.container import Container
    from models import default_model, family_for

    demo = default_model()
    if demo is None:
        pytest.skip("no embedded demo model in this checkout")
    c = Container(demo)
    spec = family_for(c.config).spec(c.config)
    per_position = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4
    context = min(spec.max_position_embeddings or planner.KV_CONTEXT, planner.KV_CONTEXT)
    slot = planner.slot_bytes(c)
    layers = len({layer for layer, _ in c.experts})
    dense = planner.dense_ram_bytes(c, spec)
    working = planner.working_bytes(spec, context)
    # available memory for exactly 3 slots per layer once dense, one pass and the KV cache are paid
    avail = dense + working + per_position * context + 3.5 * slot * layers / planner.AUTO_SHARE
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": int(avail)})())
    plan = planner.make_plan(c, spec, context=context)
    assert (plan.kv_bytes_per_position, plan.kv_reserved_bytes) == (per_position, per_position * context)
    assert plan.mode == "auto" and plan.cap == 3 and plan.kv_positions == context
    half = planner.make_plan(c, spec, kv_cache="float16", context=context)   # float16: half the room
    assert (half.kv_bytes_per_position, half.kv_reserved_bytes) == (per_position // 2, per_position * context // 2)
    assert planner.make_plan(c, spec, context=1).cap > 3      # a short session: more slots
