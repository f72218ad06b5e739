"""The embedded demo model: it ships, it opens, it talks, and it matches transformers."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from core.cache import KVCache
from core.sampling import SamplingParams
from models import default_model, open_model
from tests.conftest import ROOT

REF = ROOT / "tests" / "oracle" / "demo_reference.npz"
DEMO = default_model()
pytestmark = pytest.mark.skipif(DEMO is None, reason="no embedded demo model in this checkout")


def _greedy(engine, prompt, n):
    cache = KVCache(engine.spec)
    logits, out = engine.forward(prompt, cache)[-1], []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = engine.forward([out[-1]], cache)[-1]
    return out


def test_coli_run_uses_the_demo_when_no_model_is_configured(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = lambda: subprocess.run([sys.executable, "-m", "colibri_tui", "run", "Tell me a fortune",
                                  "--seed", "1", "--max-new-tokens", "24", "--json", "--threads", "1"],
                                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    a, b = run(), run()
    assert a.returncode == 0, a.stderr
    assert "using the embedded demo model" in a.stderr
    assert json.loads(a.stdout)["ids"] == json.loads(b.stdout)["ids"]      # seeded: deterministic
    assert json.loads(a.stdout)["stats"]["new_tokens"] > 0


def test_demo_matches_transformers_on_its_dequantized_weights():
    ref = np.load(REF)
    engine = open_model(DEMO, threads=1)
    got = engine.logits(ref["ids"].tolist())
    assert int((got.argmax(1) == ref["logits_q4"].argmax(1)).sum()) >= 31
    assert np.abs(got - ref["logits_q4"]).max() < 1e-3
    assert _greedy(engine, ref["ids"][:8].tolist(), 20) == ref["greedy_q4"].tolist()
    agree = float((got.argmax(1) == ref["logits_orig"].argmax(1)).mean())
    print(f"\ndemo: int4 container vs original float32 weights, argmax agreement {agree:.3f}")
    assert agree >= 0.9


def test_demo_placement_never_changes_output():
    ref = np.load(REF)
    ids = ref["ids"].tolist()
    base = open_model(DEMO, threads=1).logits(ids)
    for kw in (dict(cap=1), dict(cap=4, prefetch=False), dict(cap=8, policy="lfru"),
               dict(cap=2, o_direct=True), dict(cap=16, threads=2)):
        np.testing.assert_array_equal(open_model(DEMO, **{"threads": 1, **kw}).logits(ids), base,
                                      err_msg=str(kw))


def test_demo_chat_generation_stops_and_decodes():
    engine = open_model(DEMO, threads=1)
    events = list(engine.generate("Dimmi qualcosa", SamplingParams(temperature=0.8, seed=4),
                                  max_new_tokens=40))
    final = [e for e in events if type(e).__name__ == "Stats"][-1].extra
    assert final["reason"] in ("eos", "length") and isinstance(final["text"], str)


def test_long_prompts_are_prefilled_in_chunks():
    """generate() prefills PREFILL_CHUNK positions at a time (bounded activations); the result
    matches one pass over the whole prompt to float32 rounding and continues the same way."""
    ids = np.load(REF)["ids"].tolist()
    engine = open_model(DEMO, threads=1)
    whole = engine.forward(ids, KVCache(engine.spec))[-1]
    engine.PREFILL_CHUNK = 5                       # instance override: 7 chunks, the last short
    cache = KVCache(engine.spec)
    calls = []
    forward = engine.forward
    engine.forward = lambda chunk, c, **kw: calls.append(len(chunk)) or forward(chunk, c, **kw)
    chunked = engine.prefill(ids, cache)
    assert calls == [5] * (len(ids) // 5) + ([len(ids) % 5] if len(ids) % 5 else [])
    assert cache.length == len(ids)
    np.testing.assert_allclose(chunked, whole, rtol=1e-4, atol=1e-4)
    assert int(np.argmax(chunked)) == int(np.argmax(whole))
    before = len(calls)
    events = list(engine.generate(ids, SamplingParams(temperature=0.0), max_new_tokens=8))
    assert calls[before: before + len(ids) // 5] == [5] * (len(ids) // 5)     # generate chunks too
    assert [e.id for e in events if type(e).__name__ == "Token"] == _greedy(open_model(DEMO, threads=1), ids, 8)


def test_generations_reuse_the_kv_memory_and_give_the_same_tokens():
    """A finished generation hands its KV arrays to the next (their pages are mapped already);
    the stale positions they hold never reach attention: a repeated prompt gives the same
    tokens and logits after a longer and a shorter conversation. (Without prefix reuse: with
    it, a finished cache stays in the engine's pool instead -- tests/test_prefix_cache.py.)"""
    engine = open_model(DEMO, threads=1)
    engine.prefix_cache = False
    greedy = SamplingParams(greedy=True)

    def run(prompt, n):
        events = list(engine.generate(prompt, greedy, max_new_tokens=n))
        return events[-2].extra["ids"]

    first = run([1, 2, 3, 4, 5], 12)
    spare = engine._kv_spare
    assert spare is not None and spare[0]["k"].shape[1] >= 17
    run(list(range(7, 60)), 20)                      # longer: overwrites those positions
    assert engine._kv_spare[0]["k"] is spare[0]["k"]     # the same memory went round again
    assert run([1, 2, 3, 4, 5], 12) == first
    fresh = engine.forward([1, 2, 3, 4, 5], KVCache(engine.spec), all_logits=True)
    np.testing.assert_array_equal(engine.logits([1, 2, 3, 4, 5]), fresh)
