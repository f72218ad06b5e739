"""The user-facing generation path (issue 20, section 4): `coli run` and the app read every
expert when the model fits (Engine.warm_experts) instead of at each one's first token; the
events of a generation are one Token and one Stats per new token. Placement only: the same
tokens. On the demo model."""
from __future__ import annotations

import json
import time

import pytest

from core.events import Done, Stats, Token
from core.sampling import SamplingParams
from tests.conftest import open_engine


def wait_loaded(engine, timeout=30.0):
    t0 = time.monotonic()
    while any(s.future is not None and not s.future.done() for L in engine.store.layers.values()
              for s in L.slots) and time.monotonic() - t0 < timeout:
        time.sleep(0.01)


def test_warm_experts_reads_every_expert_when_the_model_fits(demo):
    cold = open_engine(demo)
    warm = open_engine(demo)
    n = warm.spec.num_experts
    assert warm.store.cap >= n                          # the demo fits: the automatic plan holds it
    assert warm.warm_experts()
    wait_loaded(warm)
    moe = [i for i, L in enumerate(warm.layers) if L.kind == "moe"]
    assert all(len(warm.store.resident()[i]) == n for i in moe)
    prompt, greedy = list(range(5, 17)), SamplingParams(greedy=True)
    events = list(warm.generate(prompt, greedy, max_new_tokens=12))
    final = [e for e in events if isinstance(e, Stats)][-1].as_dict()
    assert final["misses"] == 0 and final["hit_rate"] == 1.0      # nothing read at first use
    want = [e for e in cold.generate(prompt, greedy, max_new_tokens=12) if isinstance(e, Stats)][-1]
    assert final["ids"] == want.as_dict()["ids"]                   # placement, never bits
    assert want.as_dict()["misses"] > 0


def test_lookahead_prefetch_resumes_when_the_pool_shrinks_after_warming(demo):
    """Warmed, a model that fits skips the lookahead (nothing can miss); once the pool gives slots
    back (a growing context) experts can miss again, so the lookahead runs again."""
    engine = open_engine(demo)
    if not getattr(engine.store, "prefetch_enabled", False):
        pytest.skip("the store runs without prefetch here")
    assert engine.warm_experts()
    wait_loaded(engine)
    greedy = SamplingParams(greedy=True)

    def issued(prompt):      # the reply's own count (generate starts the store's counters afresh)
        final = [e for e in engine.generate(prompt, greedy, max_new_tokens=8) if isinstance(e, Stats)][-1]
        return final.as_dict()["prefetch_issued"]
    assert issued(list(range(5, 17))) == 0
    engine.store.shrink(2)
    assert issued(list(range(20, 32))) > 0


def test_warm_experts_does_nothing_when_the_model_does_not_fit(demo):
    engine = open_engine(demo, cap=2)
    assert not engine.warm_experts()
    assert all(len(es) == 0 for es in engine.store.resident().values())


def test_one_token_and_one_stats_event_per_new_token(demo):
    engine = open_engine(demo)
    events = list(engine.generate(list(range(5, 17)), SamplingParams(seed=3), max_new_tokens=10))
    final = [e for e in events if isinstance(e, Stats)][-1]
    n = final.new_tokens
    assert isinstance(events[-1], Done)
    tokens = [e for e in events if isinstance(e, Token) and e.id >= 0]
    stats = [e for e in events if isinstance(e, Stats)]
    assert len(tokens) == n and len(stats) == n + (1 if events[-1].reason != "stop" else 0)
    assert len(events) <= 2 * n + 3                  # the tokens, their stats, a tail, the end


def test_coli_run_warms_a_model_that_fits(demo, dirs, capsys):
    from colibri_tui.cli import main as coli
    assert coli(["run", "--model", demo, "--ids", "5,6,7,8", "--max-new-tokens", "6", "--greedy",
                 "--threads", "1", "--json", "--no-prefix-cache"]) == 0
    st = json.loads(capsys.readouterr().out)["stats"]
    assert st["misses"] == 0


def test_coli_serve_warms_a_model_that_fits(demo, dirs):
    """`coli serve` reads every expert at start as `coli run` does: the first request reads none."""
    import os
    import subprocess
    import sys
    import urllib.request

    import openai
    env = {**os.environ, "COLI_LOG_DIR": os.environ["COLI_DATA_DIR"]}
    env.pop("COLI_API_KEY", None)
    p = subprocess.Popen([sys.executable, "-m", "colibri_tui", "serve", "--model", demo, "--port", "0",
                          "--threads", "1", "--no-prefix-cache"], env=env, stderr=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        line = p.stderr.readline()
        assert line.startswith("coli: serving "), line
        url = line.split(" at ")[1].split(" ")[0]
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        r = c.chat.completions.create(model=c.models.list().data[0].id,
                                      messages=[{"role": "user", "content": "Tell me a fortune"}],
                                      max_tokens=6, temperature=0)
        assert r.usage.completion_tokens >= 1
        metrics = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
        misses = [ln for ln in metrics.splitlines() if ln.startswith("coli_expert_misses_total")]
        assert misses and float(misses[0].split()[-1]) == 0, misses
    finally:
        p.kill()
        p.wait(10)
