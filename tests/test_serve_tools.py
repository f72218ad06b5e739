"""`coli serve` tools: the requests' tools reach the chat template, the model's calls come back.

How the model "calls" honestly: tests/tools_fixture.py builds a real qwen3_moe container (the
real Qwen3 chat template, a real BPE tokenizer with Qwen3's tool tokens) whose weights make
greedy decoding emit ``<tool_call>\\n{"name": "get_weather", ...}\\n</tool_call>`` after the
template's ``assistant\\n``; the real engine, sampler and detokenizer run it behind the real
server, driven by the official openai and anthropic clients. The parser and the streaming
assembly are tested on the real tokenizer's token-by-token pieces of real tool-call text (and
on every split of it), malformed calls included. A template without tools (the demo's) refuses
them with a 400.
"""
from __future__ import annotations

import json

import httpx
import pytest

from colibri_tui.server.tools import ReplyAssembler, ToolCallParser, parse_call, split_reply
from tests.test_serve import DEMO, Served
from tests.tools_fixture import CALL_TEXT, tool_model

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
A_TOOLS = [{"name": "get_weather", "description": "The weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from tests.conftest import server_env
    yield from server_env(tmp_path_factory, "serve-tools-env")


@pytest.fixture(scope="module")
def caller(env, tmp_path_factory):
    from models import open_model
    e = open_model(tool_model(tmp_path_factory.mktemp("toolcaller")), threads=1)
    yield e
    e.container.close()


@pytest.fixture(scope="module")
def server(caller):
    s = Served(caller, model_id="toolcaller")
    yield s
    s.close()


@pytest.fixture(scope="module")
def demo_server(env):
    from models import default_model, open_model
    e = open_model(default_model(), threads=1)
    s = Served(e)
    yield s
    s.close()
    e.container.close()


# --- the parser on real text ---------------------------------------------------------------------

REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')
CALLS = [{"name": "get_weather", "arguments": {"city": "Rome"}},
         {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]


def _assemble(pieces, max_calls=None):
    a = ReplyAssembler(max_calls)
    parts = [p for piece in pieces for p in a.feed(piece)] + a.flush()
    return "".join(v for k, v in parts if k == "text"), [v for k, v in parts if k == "call"]


def _token_pieces(tokenizer, text):
    """The text as the engine streams it: the real tokenizer's ids, decoded one by one."""
    dec = tokenizer.stream_decoder()
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    return pieces


def test_the_parser_reads_qwen3_calls_from_real_token_streams(caller):
    pieces = _token_pieces(caller.tokenizer, REPLY)
    assert len(pieces) > 10
    assert _assemble(pieces) == ("Let me check.", CALLS) == split_reply(REPLY)
    # any split of the text gives the same parts: one character at a time, or two pieces
    assert _assemble(list(REPLY)) == ("Let me check.", CALLS)
    for cut in range(0, len(REPLY), 7):
        assert _assemble([REPLY[:cut], REPLY[cut:]]) == ("Let me check.", CALLS)
    # parallel_tool_calls false: the second block stays text
    text, calls = _assemble(pieces, max_calls=1)
    assert calls == CALLS[:1] and text.endswith("</tool_call>") and '"Paris"' in text


@pytest.mark.parametrize("bad", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}\n</tool_call>',   # broken JSON
    '<tool_call>\n["get_weather"]\n</tool_call>',
    '<tool_call>\n{"arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}',                # never closed
    'a < b and <tool_ca',
])
def test_malformed_calls_stay_plain_text(caller, bad):
    text = "Sure. " + bad
    assert split_reply(text) == (text, [])
    assert _assemble(_token_pieces(caller.tokenizer, text)) == (text, [])


def test_parse_call_accepts_string_arguments_and_text_around_blocks():
    assert parse_call('{"name": "f", "arguments": "{\\"x\\": 1}"}') == {"name": "f", "arguments": {"x": 1}}
    assert parse_call('{"name": "f"}') == {"name": "f", "arguments": {}}
    p = ToolCallParser()
    assert p.feed("x <tool") == [("text", "x ")]     # "<tool" might start a call: held back
    assert p.feed("box>") == [("text", "<toolbox>")]


# --- the template gets the tools -----------------------------------------------------------------

def _prompt_tokens(engine, messages, tools=None):
    return len(engine.tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools))


def test_the_template_renders_tools_calls_and_results_as_transformers_does(caller):
    transformers = pytest.importorskip("transformers")
    from colibri_tui.server.app import _chat_messages
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(caller.container.path / "tokenizer.json"))
    hf.chat_template = caller.tokenizer.chat_template
    body = {"messages": ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]}
    msgs = _chat_messages(body, tools=True)
    ours = caller.tokenizer.apply_chat_template(msgs, tools=[t for t in TOOLS])
    theirs = hf.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert '"name": "get_weather"' in ours and "<tools>" in ours
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in ours
    assert "<tool_response>\n21 C, sunny\n</tool_response>" in ours


# --- end to end: the official clients ------------------------------------------------------------

def test_openai_chat_returns_the_models_tool_call(server, caller):
    c = server.openai()
    r = c.chat.completions.create(model="toolcaller", messages=ASK, tools=TOOLS, max_tokens=8, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    # the template received the tools: the prompt is the one rendered with them
    assert r.usage.prompt_tokens == _prompt_tokens(caller, ASK, TOOLS) > _prompt_tokens(caller, ASK) + 40

    # the next turn: the call and its result go back through the template
    follow = ASK + [ch.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]
    r2 = c.chat.completions.create(model="toolcaller", messages=follow, tools=TOOLS, max_tokens=8, temperature=0)
    assert r2.choices[0].finish_reason == "tool_calls"     # this model always calls
    assert r2.usage.prompt_tokens == _prompt_tokens(caller, _as_template(follow), TOOLS)


def _as_template(messages):
    from colibri_tui.server.app import _chat_messages
    return _chat_messages({"messages": messages}, tools=True)


def test_openai_streaming_sends_tool_call_deltas(server):
    c = server.openai()
    chunks = list(c.chat.completions.create(model="toolcaller", messages=ASK, tools=TOOLS, max_tokens=8,
                                            temperature=0, stream=True))
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "get_weather"
    assert json.loads(deltas[0].function.arguments) == {"city": "Rome"}
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_renders_the_tools_but_returns_text(server, caller):
    r = server.openai().chat.completions.create(model="toolcaller", messages=ASK, tools=TOOLS, tool_choice="none",
                                                max_tokens=8, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and not ch.message.tool_calls
    assert ch.message.content == "<tool_call>" + CALL_TEXT + "</tool_call>"
    assert r.usage.prompt_tokens == _prompt_tokens(caller, ASK, TOOLS)


def test_anthropic_messages_return_tool_use_blocks(server):
    c = server.anthropic()
    m = c.messages.create(model="toolcaller", max_tokens=8, messages=ASK, tools=A_TOOLS)
    assert m.stop_reason == "tool_use"
    (block,) = m.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Rome"}
    assert block.id.startswith("toolu_")
    # the result goes back as a tool_result block
    m2 = c.messages.create(model="toolcaller", max_tokens=8, tools=A_TOOLS, messages=ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "21 C, sunny"}]}])
    assert m2.stop_reason == "tool_use"

    with c.messages.stream(model="toolcaller", max_tokens=8, messages=ASK, tools=A_TOOLS) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    uses = [b for b in final.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].input == {"city": "Rome"}


@pytest.mark.parametrize("extra, says", [
    ({"tool_choice": "required"}, "'tool_choice' must be"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "'tool_choice' must be"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "name must be a non-empty string"),
    ({"tools": "get_weather"}, "'tools' must be an array"),
    ({"functions": [{"name": "f"}]}, "'functions'"),
])
def test_bad_tool_requests_are_400s(server, extra, says):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=10,
                   json={"model": "toolcaller", "messages": ASK, "tools": TOOLS, **extra})
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


def test_tool_messages_without_tools_and_bad_arguments_are_400s(server):
    for msgs, says in [
        (ASK + [{"role": "tool", "content": "x", "tool_call_id": "c"}], "send the request's 'tools'"),
        (ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}],
         "not valid JSON"),
    ]:
        body = {"model": "toolcaller", "messages": msgs}
        if "JSON" in says:
            body["tools"] = TOOLS
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_a_template_without_tools_refuses_them(demo_server):
    r = httpx.post(demo_server.url + "/v1/chat/completions", timeout=10,
                   json={"model": DEMO, "messages": ASK, "tools": TOOLS})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "'tools' is not supported by this model" in msg and "never reads a `tools` variable" in msg
    with pytest.raises(anthropic.BadRequestError, match="tools"):
        demo_server.anthropic().messages.create(model=DEMO, max_tokens=4, messages=ASK, tools=A_TOOLS)
    # without tools the demo answers as before
    r = demo_server.openai().chat.completions.create(model=DEMO, messages=ASK, max_tokens=3)
    assert r.choices[0].message.tool_calls is None
