"""`coli serve` with prompt-prefix reuse (issue 19): a conversation's next request prefills only
its new tokens, and the usage says how many were cached -- OpenAI's
``usage.prompt_tokens_details.cached_tokens``, Anthropic's ``cache_read_input_tokens`` -- with
the official clients against a real server on 127.0.0.1; ``--no-prefix-cache`` reports 0."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.conftest import ROOT
from tests.test_serve import DEMO, Served, env  # noqa: F401  (env: the module's user dirs)

pytest.importorskip("anthropic")
pytest.importorskip("openai")


@pytest.fixture
def fresh(env):  # noqa: F811
    from models import default_model, open_model
    made = []

    def open_one(prefix_cache=True):
        e = open_model(default_model(), threads=1)
        e.usage_file = None
        e.prefix_cache = prefix_cache
        s = Served(e)
        made.append((s, e))
        return s, e
    yield open_one
    for s, e in made:
        s.close()
        e.container.close()


def test_openai_conversation_reports_cached_tokens(fresh):
    s, engine = fresh()
    c = s.openai()
    msgs = [{"role": "user", "content": "Tell me a fortune"}]
    r1 = c.chat.completions.create(model=DEMO, messages=msgs, max_tokens=12, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "Another one"}]
    r2 = c.chat.completions.create(model=DEMO, messages=msgs, max_tokens=12, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens <= cached < r2.usage.prompt_tokens == len(engine.prompt_ids(msgs))
    # streamed, with the usage chunk: the whole conversation again is cached but its last position
    stream = c.chat.completions.create(model=DEMO, messages=msgs, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens       # the same prompt
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r2.choices[0].message.content                  # the same reply, its logits kept
    h = s.health()
    assert h["tokens"]["cached"] == cached + usage.prompt_tokens
    metrics = httpx.get(s.url + "/metrics", timeout=5).text
    assert f'coli_cached_prompt_tokens_total{{model="{s.state.model_id}"}} {cached + usage.prompt_tokens}' in metrics


def test_anthropic_conversation_reports_cache_reads(fresh):
    s, engine = fresh()
    c = s.anthropic()
    msgs = [{"role": "user", "content": "Tell me a fortune"}]
    r1 = c.messages.create(model=DEMO, max_tokens=12, messages=msgs, extra_body={"temperature": 0})
    assert r1.usage.cache_read_input_tokens == 0
    msgs += [{"role": "assistant", "content": r1.content[0].text}, {"role": "user", "content": "Another one"}]
    r2 = c.messages.create(model=DEMO, max_tokens=12, messages=msgs, extra_body={"temperature": 0})
    total = len(engine.prompt_ids(msgs))
    assert r2.usage.cache_read_input_tokens >= r1.usage.input_tokens
    assert r2.usage.input_tokens + r2.usage.cache_read_input_tokens == total
    with c.messages.stream(model=DEMO, max_tokens=12, messages=msgs, extra_body={"temperature": 0}) as st:
        final = st.get_final_message()
    # message_start said the whole prompt; message_delta's cumulative counts replaced it
    assert final.usage.cache_read_input_tokens == total and final.usage.input_tokens == 0
    assert final.content[0].text == r2.content[0].text


def test_no_prefix_cache_reports_zero_and_equals_fresh_runs(fresh):
    s, engine = fresh(prefix_cache=False)
    c = s.openai()
    msgs = [{"role": "user", "content": "Tell me a fortune"}]
    r1 = c.chat.completions.create(model=DEMO, messages=msgs, max_tokens=12, temperature=0)
    r2 = c.chat.completions.create(model=DEMO, messages=msgs, max_tokens=12, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == r2.usage.prompt_tokens_details.cached_tokens == 0
    assert r1.choices[0].message.content == r2.choices[0].message.content
    a = s.anthropic().messages.create(model=DEMO, max_tokens=12, messages=msgs, extra_body={"temperature": 0})
    assert a.usage.cache_read_input_tokens == 0 and a.usage.input_tokens == len(engine.prompt_ids(msgs))


def test_the_flag_on_the_command_line():
    """coli run and serve take --no-prefix-cache (run: one generation, nothing to reuse)."""
    r = subprocess.run([sys.executable, "-m", "colibri_tui.cli", "run", "--ids", "5,6,7", "--max-new-tokens",
                        "3", "--greedy", "--json", "--no-prefix-cache"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stats"]["cached_tokens"] == 0 and out["stats"]["prompt_tokens"] == 3
    from colibri_tui.cli import build_parser
    p = build_parser()
    assert p.parse_args(["serve", "--no-prefix-cache"]).no_prefix_cache
    assert not p.parse_args(["serve"]).no_prefix_cache
