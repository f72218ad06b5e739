"""Real chat templates (tests/templates/, sources in its README) render with core.tokenizer exactly
as transformers' apply_chat_template renders them: plain chats, the generation prompt, thinking on
and off, earlier assistant turns carrying <think>...</think> (stripped from history), tools, tool
calls and tool results."""
from __future__ import annotations

import copy
import json
import os

import pytest

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from core.tokenizer import ChatTokenizer  # noqa: E402
from tests.test_tokenizer import _hf_ids, _write_dir  # noqa: E402

HERE = os.path.join(os.path.dirname(__file__), "templates")
# Our own template for a family whose release ships none (models/templates/).
OURS = os.path.join(os.path.dirname(__file__), "..", "models", "templates")
TEMPLATES = ["qwen3_6", "kimi_k2_thinking", "kimi_k3", "deepseek_v4"]

TOOLS = [{
    "type": "function",
    "function": {
        "name": "meteo",
        "description": "Che tempo fa a <città> & dintorni? 🌞",
        "parameters": {
            "type": "object",
            "properties": {"città": {"type": "string"}, "giorni": {"type": "integer"}},
            "required": ["città"],
        },
    },
}]

PLAIN = [
    {"role": "system", "content": "Sei un assistente. Rispondi \"breve\"."},
    {"role": "user", "content": "Ciao! Perché il cielo è blu? 🌈"},
]

HISTORY_THINK = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nUser asks 2+2. It is 4.\n</think>\n\n4."},
    {"role": "user", "content": "E 3+3?"},
]

REASONING_FIELD = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4.", "reasoning_content": "Easy: four."},
    {"role": "user", "content": "E 3+3?"},
    {"role": "assistant", "content": "6.", "reasoning_content": "Six."},
]

TOOL_CHAT = [
    {"role": "system", "content": "Usa gli strumenti."},
    {"role": "user", "content": "Che tempo fa a Roma?"},
    {"role": "assistant", "content": "<think>\nServe meteo.\n</think>\n\nControllo.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "meteo", "arguments": {"città": "Roma", "giorni": 2}}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "meteo", "content": "{\"t\": 21, \"cielo\": \"sereno\"}"},
    {"role": "assistant", "content": "Sereno, 21°."},
    {"role": "user", "content": "E a Milano?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "call_2", "type": "function",
                     "function": {"name": "meteo", "arguments": {"città": "Milano"}}},
                    {"id": "call_3", "type": "function",
                     "function": {"name": "meteo", "arguments": {"città": "Monza"}}}]},
    {"role": "tool", "tool_call_id": "call_2", "name": "meteo", "content": "pioggia"},
    {"role": "tool", "tool_call_id": "call_3", "name": "meteo", "content": "nebbia"},
]

CASES = {
    "plain": (PLAIN, {}),
    "history_think": (HISTORY_THINK, {}),
    "reasoning_field": (REASONING_FIELD, {}),
    "tools": (TOOL_CHAT, {"tools": TOOLS}),
    "tools_only_declared": (PLAIN, {"tools": TOOLS}),
}

# Template variables each family reads for thinking on / off.
THINKING_KWARGS = {
    "qwen3_6": [{}, {"enable_thinking": True}, {"enable_thinking": False}, {"preserve_thinking": True}],
    "kimi_k2_thinking": [{}],
    "kimi_k3": [{}, {"thinking": False}, {"thinking_effort": "low"}, {"tool_choice": "required"}],
    "deepseek_v4": [{}, {"thinking": True}, {"enable_thinking": True, "reasoning_effort": "max"},
                    {"thinking": True, "drop_thinking": False}],
}


def _template_text(name: str) -> str:
    path = os.path.join(HERE, name + ".jinja")
    with open(path if os.path.exists(path) else os.path.join(OURS, name + ".jinja"), encoding="utf-8") as f:
        return f.read()

@pytest.fixture(scope="module", params=TEMPLATES)
def template_dirs(request, tmp_path_factory):
    template = _template_text(request.param)
    path = _write_dir(tmp_path_factory.mktemp(request.param))
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    return request.param, transformers.AutoTokenizer.from_pretrained(path), ChatTokenizer.from_dir(path)


def _both(hf, tok, messages, **kwargs):
    try:
        expected = hf.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kwargs)
    except Exception as e:  # the template refuses the chat: ours must refuse it too
        with pytest.raises(ValueError):
            tok.apply_chat_template(copy.deepcopy(messages), **kwargs)
        return type(e).__name__
    got = tok.apply_chat_template(copy.deepcopy(messages), **kwargs)
    assert got == expected
    hf_ids = _hf_ids(hf.apply_chat_template(copy.deepcopy(messages), tokenize=True, **kwargs))
    assert tok.encode_chat(copy.deepcopy(messages), **kwargs) == hf_ids
    return got


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_real_template_matches_transformers(template_dirs, case, add_generation_prompt):
    name, hf, tok = template_dirs
    messages, extra = CASES[case]
    for kwargs in THINKING_KWARGS[name]:
        _both(hf, tok, messages, add_generation_prompt=add_generation_prompt, **extra, **kwargs)


def test_qwen3_6_thinking_prompt_and_history(tmp_path):
    """What the app relies on: with thinking on, Qwen3.6's generation prompt opens a think block
    (the reply starts inside it); off, it closes an empty one; earlier turns lose their thinking."""
    with open(os.path.join(HERE, "qwen3_6.jinja"), encoding="utf-8") as f:
        tok = ChatTokenizer.from_dir(_write_dir(tmp_path, f.read()))
    assert tok.apply_chat_template(PLAIN).endswith("<|im_start|>assistant\n<think>\n")
    off = tok.apply_chat_template(PLAIN, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    text = tok.apply_chat_template(HISTORY_THINK)
    assert "It is 4" not in text and "<|im_start|>assistant\n4.<|im_end|>" in text
    tools = tok.apply_chat_template(TOOL_CHAT, tools=TOOLS)
    assert "<parameter=giorni>\n2\n</parameter>" in tools and '"città"' in tools


def test_kimi_k3_tojson_options(tmp_path):
    with open(os.path.join(HERE, "kimi_k3.jinja"), encoding="utf-8") as f:
        tok = ChatTokenizer.from_dir(_write_dir(tmp_path, f.read()))
    text = tok.apply_chat_template(PLAIN, tools=TOOLS)
    decl = json.dumps(TOOLS, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    assert decl in text
    assert text.endswith("<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>")
