"""`coli serve` with a thinking template: the thinking goes into ``message.reasoning_content``
(and ``delta.reasoning_content`` while streaming), as vLLM and DeepSeek return it; ``content``
holds the answer alone. Anthropic: a request with ``thinking`` enabled gets a ``thinking`` content
block first (streamed as thinking_delta events, an empty signature), then the answer's blocks.

The splitter runs on real token-by-token pieces of a real tokenizer in both forms (the reply
writes <think>…</think>; the template opened the block). End to end: tests/tools_fixture.py's
real qwen3_moe container with Qwen3.6's real chat template (tests/templates/qwen3_6.jinja), whose
generation prompt opens a think block; the model's greedy chain never closes it, so the whole
reply is thinking: the official openai client gets it as reasoning_content, content empty. A
template with no <think> (Qwen3's in the tools fixture, without enable_thinking, writes none in
the prompt) keeps replies as they were: its test file passes unchanged."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from colibri_tui.thinking import ThinkSplitter, split_think
from tests.test_app_thinking import ANSWER, OPENED, OWN, THINKING, deltas, tok  # noqa: F401
from tests.test_serve import Served
from tests.tools_fixture import tool_model

openai = pytest.importorskip("openai")
HERE = Path(__file__).parent
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]


@pytest.mark.parametrize("text,opened", [(OWN, False), (OPENED, True), (ANSWER, False)])
def test_splitter_on_a_real_token_stream(tok, text, opened):  # noqa: F811
    sp = ThinkSplitter(opened)
    thought = answer = ""
    for piece in deltas(tok, text):
        t, a = sp.feed(piece)
        thought, answer = thought + t, answer + a
        assert "think>" not in thought + answer
    t, a = sp.flush()
    thought, answer = thought + t, answer + a
    want = split_think(text, opened, final=True, loose=False)
    assert (thought or None, answer) == (want[0] or None, want[1])
    assert answer == ANSWER and thought == (THINKING if text != ANSWER else "")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from tests.conftest import server_env
    yield from server_env(tmp_path_factory, "serve-think-env")


@pytest.fixture(scope="module")
def server(env, tmp_path_factory):
    from models import open_model
    c = Path(tool_model(tmp_path_factory.mktemp("thinker")))
    shutil.copy(HERE / "templates" / "qwen3_6.jinja", c / "chat_template.jinja")
    e = open_model(c, threads=1)
    assert e.tokenizer.apply_chat_template(ASK).endswith("<think>\n")
    s = Served(e, model_id="thinker")
    yield s
    s.close()
    e.container.close()


def test_openai_reasoning_content(server):
    c = server.openai()
    r = c.chat.completions.create(model="thinker", messages=ASK, max_tokens=6, temperature=0)
    msg = r.choices[0].message.model_dump()
    assert msg["reasoning_content"] and not msg["content"]
    assert "think>" not in msg["reasoning_content"]

    chunks = list(c.chat.completions.create(model="thinker", messages=ASK, max_tokens=6, temperature=0,
                                            stream=True))
    streamed = "".join(ch.choices[0].delta.model_dump().get("reasoning_content") or "" for ch in chunks
                       if ch.choices)
    assert streamed == msg["reasoning_content"]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ""


def test_anthropic_thinking_blocks(server):
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    think = {"type": "enabled", "budget_tokens": 1024}
    greedy = {"extra_body": {"temperature": 0}}
    r = c.messages.create(model="thinker", messages=ASK, max_tokens=6, thinking=think, **greedy)
    kinds = [b.type for b in r.content]
    assert kinds[0] == "thinking" and r.content[0].thinking and "think>" not in r.content[0].thinking
    assert all(b.type != "text" or not b.text for b in r.content[1:])

    with c.messages.stream(model="thinker", messages=ASK, max_tokens=6, thinking=think, **greedy) as s:
        final = s.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == r.content[0].thinking

    # not asked for: the reply as before (no thinking block)
    plain = c.messages.create(model="thinker", messages=ASK, max_tokens=6, **greedy)
    assert [b.type for b in plain.content] == ["text"]
    assert plain.content[0].text == r.content[0].thinking or r.content[0].thinking in plain.content[0].text
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model="thinker", messages=ASK, max_tokens=6, thinking={"type": "sometimes"})


def test_anthropic_thinking_block_sent_back_is_the_turns_reasoning():
    from colibri_tui.server.app import _anthropic_turn
    (msg,) = _anthropic_turn("assistant", [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                           {"type": "redacted_thinking", "data": "x"},
                                           {"type": "text", "text": "Hi"}], "messages[1].content", False)
    assert msg == {"role": "assistant", "content": "Hi", "reasoning_content": "hmm"}
