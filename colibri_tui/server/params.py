"""Checking request bodies field by field: every problem is an ApiError naming the field."""
from __future__ import annotations

import math

MAX_STOP_CHARS = 256


class ApiError(Exception):
    """An HTTP error with a JSON body; ``kind``: the API's error type
    (invalid_request_error, authentication_error, not_found_error, rate_limit_error, ...)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.headers = param, code, headers or {}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _type_name(v) -> str:
    return {type(None): "null", bool: "a boolean", int: "an integer", float: "a number",
            str: "a string", list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


def number(body: dict, name: str, default, lo: float, hi: float):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"'{name}' must be a number, got {_type_name(v)}", name)
    if not lo <= v <= hi:
        raise bad(f"'{name}' must be between {lo:g} and {hi:g}, got {v:g}", name)
    return float(v)


def integer(body: dict, name: str, default, lo: int, hi: int | None = None, why: str = ""):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{name}' must be an integer, got {_type_name(v)}", name)
    if v < lo:
        raise bad(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad(f"'{name}' is {v}, more than {hi}{why}", name)
    return v


def boolean(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, got {_type_name(v)}", name)
    return v


def string(body: dict, name: str, required: bool = False) -> str | None:
    v = body.get(name)
    if v is None:
        if required:
            raise bad(f"'{name}' is required", name)
        return None
    if not isinstance(v, str):
        raise bad(f"'{name}' must be a string, got {_type_name(v)}", name)
    return v


def stops(body: dict, name: str, limit: int = 16) -> list[str]:
    """A string or an array of strings (empty strings are dropped)."""
    v = body.get(name)
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad(f"'{name}' must be a string or an array of strings", name)
    if len(v) > limit:
        raise bad(f"'{name}' has {len(v)} entries; at most {limit}", name)
    # the engine looks for every prefix of every stop string after each token: bounded here
    if any(len(s) > MAX_STOP_CHARS for s in v):
        raise bad(f"'{name}': a stop string is longer than {MAX_STOP_CHARS} characters", name)
    return [s for s in v if s]


def text_content(content, where: str) -> str:
    """A message's content: a string, or an array of text parts ({"type": "text", "text": ...});
    anything else (images, audio, tool blocks) is refused, naming where."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise bad(f"{where}[{i}] must be an object", where)
            kind = part.get("type")
            if kind != "text":
                raise bad(f"{where}[{i}] has type {kind!r}; only text content is supported", where)
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}[{i}].text must be a string", where)
            out.append(part["text"])
        return "".join(out)
    raise bad(f"{where} must be a string or an array of text parts, got {_type_name(content)}", where)


def refuse_unsupported(body: dict, fields: dict[str, object]) -> None:
    """Fields colibrì does not implement: refused unless absent or at their neutral value
    (ignoring them would change what the client asked for without a word)."""
    for name, neutral in fields.items():
        v = body.get(name)
        if v is None or v == neutral or (isinstance(neutral, tuple) and v in neutral):
            continue
        raise bad(f"'{name}' is not supported by this server", name)
