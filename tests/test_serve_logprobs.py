"""Log-probabilities: the engine's (log_softmax of the step's raw logits, only when asked) and the
OpenAI shapes `coli serve` sends them in (chat `logprobs`/`top_logprobs`, completions `logprobs: N`),
streamed and not, with each token's text and bytes, through the official openai client."""
from __future__ import annotations

import numpy as np
import pytest

from core.events import Token
from core.sampling import SamplingParams
from tests.test_serve import DEMO, Served

openai = pytest.importorskip("openai")

ASK = [{"role": "user", "content": "Tell me a fortune"}]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("logprobs-env")
    with pytest.MonkeyPatch.context() as mp:
        for k in ("data", "config", "logs"):
            (d / k).mkdir()
            mp.setenv(f"COLI_{k.upper()}_DIR", str(d / k))
        mp.delenv("COLI_MODEL", raising=False)
        mp.delenv("COLI_API_KEY", raising=False)
        from models import default_model, open_model
        e = open_model(default_model(), threads=1)
        yield e
        e.container.close()


@pytest.fixture(scope="module")
def server(demo):
    s = Served(demo)
    yield s
    s.close()


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def test_the_engine_reports_the_models_distribution_only_when_asked(demo):
    ids = demo.prompt_ids(ASK)
    toks = [ev for ev in demo.generate(ids, SamplingParams(temperature=0), max_new_tokens=6, logprobs=4)
            if isinstance(ev, Token) and ev.id >= 0]
    assert len(toks) == 6
    new = [t.id for t in toks]
    # teacher-forced, one batched pass: the same distributions up to the decode-vs-prefill bits
    ref = demo.logits(ids + new[:-1])[len(ids) - 1:]
    for t, row in zip(toks, ref):
        lp, top = t.logprobs
        want = _log_softmax(row)
        assert lp == pytest.approx(want[t.id], abs=2e-3)
        assert [i for i, _ in top] == list(np.argsort(-want, kind="stable")[:4])
        assert top[0][0] == t.id and top[0][1] == lp                  # greedy: the most likely
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
    plain = [ev for ev in demo.generate(ids, SamplingParams(temperature=0), max_new_tokens=6)
             if isinstance(ev, Token)]
    assert all(ev.logprobs is None for ev in plain)
    # the raw distribution: a sampling temperature does not change what is reported
    hot = next(ev for ev in demo.generate(ids, SamplingParams(temperature=1.5, seed=3), max_new_tokens=1,
                                          logprobs=3) if isinstance(ev, Token))
    assert [i for i, _ in hot.logprobs[1]] == [i for i, _ in toks[0].logprobs[1]][:3]
    assert hot.logprobs[1][0][1] == pytest.approx(toks[0].logprobs[1][0][1], abs=1e-6)


def test_chat_logprobs_streamed_and_not(server):
    c = server.openai()
    r = c.chat.completions.create(model=DEMO, messages=ASK, max_tokens=8, temperature=0, logprobs=True,
                                  top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    # each token's own bytes, in order, are the reply's bytes
    assert b"".join(bytes(e.bytes) for e in entries) == r.choices[0].message.content.encode()
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert bytes(e.top_logprobs[0].bytes) == bytes(e.bytes)
    chunks = list(c.chat.completions.create(model=DEMO, messages=ASK, max_tokens=8, temperature=0, logprobs=True,
                                            top_logprobs=3, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content or []]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-4)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content
    # top_logprobs 0: the sampled token's only; and none unless asked
    r0 = c.chat.completions.create(model=DEMO, messages=ASK, max_tokens=3, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in r0.choices[0].logprobs.content)
    assert c.chat.completions.create(model=DEMO, messages=ASK, max_tokens=3).choices[0].logprobs is None


def test_completions_logprobs(server):
    c = server.openai()
    r = c.completions.create(model=DEMO, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and max(top.values()) == v and top[tok] == v
    chunks = list(c.completions.create(model=DEMO, prompt="Once upon a time", max_tokens=6, temperature=0,
                                       logprobs=2, stream=True))
    toks = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert toks == lp.tokens
    assert [o for ch in chunks if ch.choices and ch.choices[0].logprobs
            for o in ch.choices[0].logprobs.text_offset] == lp.text_offset
