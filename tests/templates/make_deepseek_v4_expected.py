"""Writes deepseek_v4_expected.json: what DeepSeek V4's own encoder renders for each case.

    python tests/templates/make_deepseek_v4_expected.py /path/to/encoding_dsv4.py

The encoder is the release's encoding/encoding_dsv4.py (source in README.md); it is not in this
repository. Each case is a chat in the form colibrì hands a chat template (transformers'
form) plus the template variables; ``to_encoder`` turns it into the encoder's call, which is
stored with the expected text. tests/test_template_deepseek_v4.py renders every case with
models/templates/deepseek_v4.jinja and compares byte for byte.
"""
from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.test_templates import HISTORY_THINK, PLAIN, REASONING_FIELD, TOOL_CHAT, TOOLS  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "deepseek_v4_expected.json")

REASONING_THEN_USER = REASONING_FIELD + [{"role": "user", "content": "E 4+4?"}]

# Results arriving in another order than the calls, a user line in the same turn, and
# arguments of every JSON type.
RESULTS_OUT_OF_ORDER = [
    {"role": "user", "content": "Roma e Milano?"},
    {"role": "assistant", "content": "", "reasoning_content": "Due città.",
     "tool_calls": [{"id": "a", "type": "function",
                     "function": {"name": "meteo", "arguments": {
                         "città": "Roma \"centro\"", "giorni": 3, "ore": 1.5, "allerta": True,
                         "opzioni": {"unità": "°C", "livelli": [1, None, "alto"]}}}},
                    {"id": "b", "type": "function",
                     "function": {"name": "meteo", "arguments": {"città": "Milano"}}},
                    {"id": "c", "type": "function", "function": {"name": "orario", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "c", "content": "12:00"},
    {"role": "tool", "tool_call_id": "b", "content": "pioggia"},
    {"role": "tool", "tool_call_id": "a", "content": "sole"},
    {"role": "user", "content": "Riassumi."},
]

SYSTEM_BETWEEN = [
    {"role": "user", "content": "Ciao"},
    {"role": "system", "content": "Rispondi in inglese."},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Grazie"},
]

THINK = {"thinking": True}
CHAT = {"thinking": False}

# name: (messages, template variables)
CASES = {
    "plain": (PLAIN, {}),
    "plain_chat": (PLAIN, CHAT),
    "plain_thinking": (PLAIN, THINK),
    "plain_enable_thinking": (PLAIN, {"enable_thinking": True}),
    "plain_thinking_max": (PLAIN, {**THINK, "reasoning_effort": "max"}),
    "plain_thinking_high": (PLAIN, {**THINK, "reasoning_effort": "high"}),
    "plain_chat_max": (PLAIN, {**CHAT, "reasoning_effort": "max"}),
    "history_think_chat": (HISTORY_THINK, CHAT),
    "history_think_thinking": (HISTORY_THINK, THINK),
    "reasoning_field_chat": (REASONING_FIELD, CHAT),
    "reasoning_field_thinking": (REASONING_FIELD, THINK),
    "reasoning_then_user_chat": (REASONING_THEN_USER, CHAT),
    "reasoning_then_user_thinking": (REASONING_THEN_USER, THINK),
    "reasoning_then_user_keep": (REASONING_THEN_USER, {**THINK, "drop_thinking": False}),
    "tools_chat": (TOOL_CHAT, {**CHAT, "tools": TOOLS}),
    "tools_thinking": (TOOL_CHAT, {**THINK, "tools": TOOLS}),
    "tools_thinking_max": (TOOL_CHAT, {**THINK, "reasoning_effort": "max", "tools": TOOLS}),
    "tool_calls_undeclared_thinking": (TOOL_CHAT, THINK),
    "tools_only_declared_chat": (PLAIN, {**CHAT, "tools": TOOLS}),
    "tools_only_declared_thinking": (PLAIN, {**THINK, "tools": TOOLS}),
    "tools_no_system_thinking_max": (PLAIN[1:], {**THINK, "reasoning_effort": "max", "tools": TOOLS}),
    "results_out_of_order_chat": (RESULTS_OUT_OF_ORDER, {**CHAT, "tools": TOOLS}),
    "results_out_of_order_thinking": (RESULTS_OUT_OF_ORDER, {**THINK, "tools": TOOLS}),
    "system_between_thinking": (SYSTEM_BETWEEN, THINK),
}


def to_encoder(messages: list[dict], variables: dict) -> tuple[list[dict], dict]:
    """The encoder's messages and keyword arguments for a chat and its template variables:
    tools go on the first message when it is a system message, else on an empty system message
    put first (vLLM's and SGLang's serving wrappers); arguments objects become the JSON text
    OpenAI sends; thinking / enable_thinking choose thinking_mode."""
    messages = copy.deepcopy(messages)
    for m in messages:
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"], ensure_ascii=False)
    if variables.get("tools"):
        if messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": ""})
        messages[0]["tools"] = variables["tools"]
    thinking = variables.get("thinking") or variables.get("enable_thinking")
    kwargs = {"thinking_mode": "thinking" if thinking else "chat"}
    for name in ("drop_thinking", "reasoning_effort"):
        if name in variables:
            kwargs[name] = variables[name]
    return messages, kwargs


def main(encoder_path: str) -> None:
    spec = importlib.util.spec_from_file_location("encoding_dsv4", encoder_path)
    encoder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(encoder)
    cases = []
    for name, (messages, variables) in CASES.items():
        enc_messages, kwargs = to_encoder(messages, variables)
        text = encoder.encode_messages(copy.deepcopy(enc_messages), **kwargs)
        call = "encode_messages(encoder_messages, " + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"
        for add_generation_prompt in (True, False):
            expected, note = text, call
            # The encoder always opens the assistant's turn after a final user / tool turn;
            # without a generation prompt that opening is not there.
            if not add_generation_prompt and messages[-1]["role"] != "assistant":
                suffix = "<｜Assistant｜>" + ("<think>" if kwargs["thinking_mode"] == "thinking" else "</think>")
                assert expected.endswith(suffix), name
                expected, note = expected[: -len(suffix)], f"{call}.removesuffix({suffix!r})"
            cases.append({
                "name": f"{name}{'' if add_generation_prompt else '_no_generation_prompt'}",
                "messages": messages,
                "variables": {**variables, "add_generation_prompt": add_generation_prompt},
                "encoder_messages": enc_messages,
                "encoder_call": note,
                "expected": expected,
            })
    with open(OUT, "w", encoding="utf-8") as f:
        with open(encoder_path, "rb") as src:
            digest = hashlib.sha256(src.read()).hexdigest()
        json.dump({"encoder": "deepseek-ai/DeepSeek-V4-Flash encoding/encoding_dsv4.py (copy: README.md)",
                   "encoder_sha256": digest, "cases": cases}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{len(cases)} cases -> {OUT}")


if __name__ == "__main__":
    main(sys.argv[1])
