"""Tool calls: the requests' ``tools`` for the chat template, and the model's calls parsed back.

Qwen3 (and the Hermes-style templates: Qwen2.5, Qwen3-MoE, many fine-tunes) tell the model to
answer a call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; the template
renders an assistant message's ``tool_calls`` and a ``tool`` message's result back the same way.

``ToolCallParser`` is fed the reply's text as it streams and hands out what is plain text and
what is a call: text that may still become ``<tool_call>`` is held back (never more than that
tag's length), a block is held until its ``</tool_call>``, and a block whose body is not a JSON
object with a string ``name`` and an object ``arguments`` (or one never closed) goes out as the
plain text it was -- never an error. The non-streaming responses run the same parser over the
whole text, so both shapes of a reply agree.
"""
from __future__ import annotations

import json
import uuid

from .params import bad

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_id(api: str = "openai") -> str:
    return ("call_" if api == "openai" else "toolu_") + uuid.uuid4().hex[:24]


def parse_call(body: str) -> dict | None:
    """A block's body as {"name", "arguments": dict}, or None when it is not a call."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):        # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": args}


class ToolCallParser:
    """``feed(text)`` / ``flush()`` return a list of ("text", str) and ("call", {"name",
    "arguments"}) in the reply's order. ``max_calls``: blocks past it stay text (None: any)."""

    def __init__(self, max_calls: int | None = None):
        self.buf, self.inside, self.calls, self.max_calls = "", False, 0, max_calls

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.buf += text
        out: list[tuple[str, object]] = []
        while True:
            if not self.inside:
                at = self.buf.find(OPEN)
                if at < 0:
                    # hold back a tail that could still become "<tool_call>"
                    hold = max((k for k in range(1, len(OPEN)) if self.buf.endswith(OPEN[:k])), default=0)
                    self._text(out, self.buf[: len(self.buf) - hold])
                    self.buf = self.buf[len(self.buf) - hold:]
                    return out
                self._text(out, self.buf[:at])
                self.buf, self.inside = self.buf[at:], True
            end = self.buf.find(CLOSE)
            if end < 0:
                return out
            block, self.buf, self.inside = self.buf[: end + len(CLOSE)], self.buf[end + len(CLOSE):], False
            call = parse_call(block[len(OPEN): -len(CLOSE)])
            if call is None or (self.max_calls is not None and self.calls >= self.max_calls):
                self._text(out, block)
            else:
                self.calls += 1
                out.append(("call", call))

    def flush(self) -> list[tuple[str, object]]:
        """The end of the reply: what is held back is text (an unclosed block included)."""
        out: list[tuple[str, object]] = []
        self._text(out, self.buf)
        self.buf, self.inside = "", False
        return out

    @staticmethod
    def _text(out: list, text: str) -> None:
        if not text:
            return
        if out and out[-1][0] == "text":
            out[-1] = ("text", out[-1][1] + text)
        else:
            out.append(("text", text))


class ReplyAssembler:
    """The parser's parts as the responses send them: whitespace at the end of text is held
    until more text follows; before a call, after one and at the end of a reply with calls it
    is dropped (the template's own newlines around ``<tool_call>``), so a streamed reply and a
    whole one carry the same content and calls."""

    def __init__(self, max_calls: int | None = None):
        self.parser, self.held, self.calls, self.after_call = ToolCallParser(max_calls), "", 0, False

    def feed(self, text: str) -> list[tuple[str, object]]:
        return self._shape(self.parser.feed(text))

    def flush(self) -> list[tuple[str, object]]:
        out = self._shape(self.parser.flush())
        if self.held and not self.calls:
            out.append(("text", self.held))
        self.held = ""
        return out

    def _shape(self, parts):
        out = []
        for k, v in parts:
            if k == "call":
                self.held, self.after_call = "", True
                self.calls += 1
                out.append((k, v))
                continue
            v = self.held + v
            if self.after_call:
                v = v.lstrip()
            body = v.rstrip()
            self.held = v[len(body):]
            if body:
                out.append(("text", body))
                self.after_call = False
        return out


def split_reply(text: str, max_calls: int | None = None) -> tuple[str, list[dict]]:
    """A whole reply: (its text outside the calls, the calls), as ReplyAssembler streams it."""
    a = ReplyAssembler(max_calls)
    parts = a.feed(text) + a.flush()
    return "".join(v for k, v in parts if k == "text"), [v for k, v in parts if k == "call"]


# --- the requests' side ------------------------------------------------------------------------

def _schema(v, where: str) -> dict:
    if v is None:
        return {"type": "object", "properties": {}}
    if not isinstance(v, dict):
        raise bad(f"{where} must be a JSON schema object", "tools")
    return v


def openai_tools(body: dict) -> tuple[list[dict] | None, bool]:
    """(The request's tools as the template gets them, {"type": "function", "function": {...}},
    or None; whether the reply is parsed for calls). tool_choice "none": the template still gets
    them (a conversation's earlier calls and results render as they were) but the reply is
    plain text, as vLLM does."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise bad("'functions' / 'function_call' (deprecated) are not supported; send 'tools'", "functions")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad("'tool_choice' needs 'tools'", "tool_choice")
        return None, False
    if not isinstance(tools, list):
        raise bad("'tools' must be an array of tools", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        f = t["function"]
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise bad(f"tools[{i}].function.name must be a non-empty string", "tools")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise bad(f"tools[{i}].function.description must be a string", "tools")
        fn = {"name": f["name"]}
        if f.get("description") is not None:
            fn["description"] = f["description"]
        fn["parameters"] = _schema(f.get("parameters"), f"tools[{i}].function.parameters")
        out.append({"type": "function", "function": fn})
    if choice is None or choice == "auto":
        return out, True
    if choice == "none":
        return out, False
    raise bad("'tool_choice' must be \"auto\" or \"none\" here (\"required\" and a named function are "
              "not supported: nothing forces the model to call)", "tool_choice")


def anthropic_tools(body: dict) -> tuple[list[dict] | None, bool]:
    """As openai_tools, from Anthropic's {name, description, input_schema}."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if choice is not None and not isinstance(choice, dict):
        raise bad("'tool_choice' must be an object such as {\"type\": \"auto\"}")
    if tools is None or tools == []:
        if kind not in (None, "none", "auto"):
            raise bad("'tool_choice' needs 'tools'")
        return None, False
    if not isinstance(tools, list):
        raise bad("'tools' must be an array of tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise bad(f"tools[{i}] must be an object with a non-empty 'name'")
        if t.get("type") not in (None, "custom"):
            raise bad(f"tools[{i}] has type {t['type']!r}; only client tools (name, description, "
                      f"input_schema) are supported")
        if t.get("description") is not None and not isinstance(t["description"], str):
            raise bad(f"tools[{i}].description must be a string")
        fn = {"name": t["name"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fn["parameters"] = _schema(t.get("input_schema"), f"tools[{i}].input_schema")
        out.append({"type": "function", "function": fn})
    if kind in (None, "auto"):
        return out, True
    if kind == "none":
        return out, False
    raise bad(f"'tool_choice' type {kind!r} is not supported (\"auto\" or \"none\": nothing forces "
              f"the model to call)")


def arguments_object(v, where: str) -> dict:
    """An assistant message's tool_call arguments: OpenAI sends a JSON string; templates are
    written for an object (transformers' documented form), so it is parsed, as vLLM does."""
    if isinstance(v, dict):
        return v
    if isinstance(v, str):
        try:
            obj = json.loads(v) if v.strip() else {}
        except (ValueError, RecursionError):
            raise bad(f"{where} is not valid JSON", "messages") from None
        if isinstance(obj, dict):
            return obj
    raise bad(f"{where} must be a JSON object (or a string holding one)", "messages")
