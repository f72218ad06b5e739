"""Tokenizer, chat template and streaming detokenizer for Hugging Face model directories.

``ChatTokenizer.from_dir(path)`` reads what ``AutoTokenizer.from_pretrained(path)`` reads, without
importing transformers:

* ``tokenizer.json`` through the ``tokenizers`` library (encode / decode); without one, a tiktoken
  vocabulary (``tiktoken.model``, Kimi's) built into the same kind of ``tokenizers.Tokenizer`` by
  ``core.tiktoken_bpe``;
* special tokens (``bos_token``, ``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``,
  ``cls_token``, ``mask_token``, other ``*_token`` strings and a dict ``extra_special_tokens``) from
  ``tokenizer_config.json``, with ``special_tokens_map.json`` filling names the config lacks. Each
  may be a string or an AddedToken dict with ``"content"``;
* the chat template, first found wins: ``chat_template.jinja`` (plus named templates in
  ``chat_templates/*.jinja``), then ``chat_template.json`` (``{"chat_template": ...}``), then the
  ``chat_template`` field of ``tokenizer_config.json``. A template may be a string, a dict of named
  templates or a list of ``{"name", "template"}`` dicts; of several, ``"default"`` is used
  (``"tool_use"`` when tools are passed and it exists), as transformers does.

``apply_chat_template`` renders as transformers' ``apply_chat_template(tokenize=False)`` does
(transformers 5.x ``utils/chat_template_utils.py``): an ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and a no-op ``{% generation %}``
tag, the non-escaping ``tojson`` filter, the ``raise_exception``, ``strftime_now``, ``dict`` and
``namespace`` globals, and the variables ``messages``, ``tools``, ``documents``,
``add_generation_prompt``, every special token by name, and any extra keyword arguments (e.g.
``enable_thinking=False``). Messages are copied to plain data, keys whose value is None are dropped
and reasoning fields are aliased (``reasoning_content`` / ``thinking`` / ``reasoning``) just like
there. Template errors (``raise_exception`` or any jinja error) become one-line ``ValueError``\\ s.

Plain fallback, used when the directory has no chat template at all: each message is one line
``"<Role>: <content>"`` (role capitalized, e.g. ``System:``, ``User:``, ``Assistant:``) ending in
``"\\n"``, and the generation prompt is a final ``"Assistant:"`` with no trailing newline. List
contents (``[{"type": "text", "text": ...}, ...]``) contribute their text parts. ``encode_chat``
encodes this with ``add_special_tokens=True`` (the tokenizer's own BOS etc.), whereas a templated
chat is encoded with ``add_special_tokens=False`` because templates write BOS themselves.

``StreamDecoder`` turns a stream of token ids into text deltas for printing as they come.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterable

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from .errors import ColiError
from .tiktoken_bpe import TIKTOKEN_FILE, has_tiktoken, load_tiktoken_tokenizer

__all__ = ["ChatTokenizer", "StreamDecoder", "compile_chat_template", "load_tokenizer"]

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_REPLACEMENT_CHAR = "\ufffd"


# --------------------------------------------------------------------------------------------
# Jinja environment, matching transformers' _compile_jinja_template
# --------------------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers uses it only to
    track assistant token masks, which we don't need; without it such templates don't compile)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; transformers overrides it with plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` as a template global, without attribute access to the real type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore-prefixed attribute names."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )


@lru_cache(maxsize=32)
def compile_chat_template(chat_template: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses (cached per template text)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(chat_template)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


def _plain(value: Any) -> Any:
    """Rebuild ``value`` from plain JSON-like types (transformers' ``_plain_template_data``)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)) and getattr(value, "ndim", 1) == 0:
        return _plain(value.item())  # numpy scalar
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _to_dicts(value: Any) -> Any:
    """Message objects (dataclasses, pydantic models) to dicts, recursively."""
    if isinstance(value, Mapping):
        return {k: _to_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _to_dicts(value.model_dump())
    return value


def _normalize_messages(messages: Any) -> list[dict]:
    messages = _to_dicts(getattr(messages, "messages", messages))
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages should be a list of dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        message = {k: v for k, v in message.items() if v is not None}
        message = _plain(message)
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _token_content(value: Any) -> str | None:
    """A special token from a config: a string, or an AddedToken dict with "content"."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, Mapping) and isinstance(block.get("text"), str):
                parts.append(block["text"])
        return "".join(parts)
    return str(content)


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _templates_from_value(value: Any) -> dict[str, str]:
    """A config's chat_template value (str, dict, or list of {"name", "template"}) as a dict."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items() if isinstance(v, str)}
    if isinstance(value, (list, tuple)):
        return {
            str(t["name"]): t["template"]
            for t in value
            if isinstance(t, Mapping) and "name" in t and isinstance(t.get("template"), str)
        }
    raise ValueError(f"unsupported chat_template of type {type(value).__name__}")


# --------------------------------------------------------------------------------------------
# ChatTokenizer
# --------------------------------------------------------------------------------------------


class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` plus special tokens and chat template(s). See the module docstring."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_templates: Mapping[str, str] | str | None = None,
        special_tokens: Mapping[str, str] | None = None,
    ):
        self.tokenizer = tokenizer
        if isinstance(chat_templates, str):
            chat_templates = {"default": chat_templates}
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        # name -> content, e.g. {"eos_token": "<|im_end|>"}; every entry is a template variable
        self.special_tokens: dict[str, str] = {k: v for k, v in (special_tokens or {}).items() if v is not None}

    # ---- loading ----

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "ChatTokenizer":
        path = os.fspath(path)
        cfg_file = os.path.join(path, "tokenizer_config.json")
        config = _read_json(cfg_file) if os.path.isfile(cfg_file) else {}
        tok_file = os.path.join(path, "tokenizer.json")
        if os.path.isfile(tok_file):
            tokenizer = Tokenizer.from_file(tok_file)
        elif has_tiktoken(path):            # Kimi: tiktoken.model + its tokenization module
            tokenizer = load_tiktoken_tokenizer(path, config)
        else:
            raise FileNotFoundError(f"no tokenizer.json or {TIKTOKEN_FILE} in {path}")

        special: dict[str, str] = {}
        for key, value in config.items():
            if key in SPECIAL_TOKEN_NAMES or key.endswith("_token"):
                content = _token_content(value)
                if content is not None:
                    special[key] = content
        extra = config.get("extra_special_tokens")
        if isinstance(extra, Mapping):  # named model-specific tokens, e.g. {"image_token": "<image>"}
            for key, value in extra.items():
                content = _token_content(value)
                if content is not None:
                    special[str(key)] = content
        map_file = os.path.join(path, "special_tokens_map.json")
        if os.path.isfile(map_file):  # legacy file: fills what the config lacks
            for key, value in _read_json(map_file).items():
                content = _token_content(value)
                if content is not None and key not in special and (key in SPECIAL_TOKEN_NAMES or key.endswith("_token")):
                    special[key] = content

        templates: dict[str, str] = {}
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                templates["default"] = f.read()
        templates_dir = os.path.join(path, "chat_templates")
        if os.path.isdir(templates_dir):
            for name in sorted(os.listdir(templates_dir)):
                if name.endswith(".jinja"):
                    with open(os.path.join(templates_dir, name), encoding="utf-8") as f:
                        templates[name[: -len(".jinja")]] = f.read()
        if not templates:
            json_file = os.path.join(path, "chat_template.json")
            if os.path.isfile(json_file):
                templates = _templates_from_value(_read_json(json_file).get("chat_template"))
        if not templates:
            templates = _templates_from_value(config.get("chat_template"))
        return cls(tokenizer, templates, special)

    # ---- plain tokenizer API ----

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added/special tokens included (transformers' ``len(tokenizer)``)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(int(token_id))

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """Id of tokenizer_config's ``eos_token``; None when it has none (or it isn't in the vocab)."""
        return self._special_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    # ---- chat ----

    @property
    def chat_template(self) -> str | None:
        """The default template text, or None (plain fallback, or several templates without a default)."""
        return self.chat_templates.get("default")

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_templates)

    def template_uses(self, name: str, tools: Any = True) -> bool:
        """Whether the chat template that would render (``tools`` given or not: the ``tool_use``
        template is chosen when tools are passed and it exists) reads the variable ``name``
        (e.g. ``"tools"``): a template that never reads ``tools`` would drop them in silence."""
        if not self.chat_templates:
            return False
        try:
            template = self._select_template(None, tools)
            env = compile_chat_template(template).environment
            return name in jinja2.meta.find_undeclared_variables(env.parse(template))
        except (ValueError, jinja2.TemplateError):
            return False

    def _select_template(self, chat_template: str | None, tools: Any) -> str:
        templates = self.chat_templates
        if chat_template is not None:
            return templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ValueError(
            "this tokenizer has several chat templates and none is named 'default'; "
            f"pass chat_template= one of {sorted(templates)}"
        )

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` to the prompt string, as transformers'
        ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)``.

        ``chat_template`` may name one of this tokenizer's templates or be template text.
        Extra keyword arguments become template variables (overriding special tokens).
        Without any template, renders the plain fallback described in the module docstring.
        """
        if chat_template is None and not self.chat_templates:
            return self._render_plain(messages, add_generation_prompt)
        template = self._select_template(chat_template, tools)
        chat = _normalize_messages(messages)
        if tools is not None:
            if not all(isinstance(t, Mapping) for t in tools):
                raise ValueError("tools should be JSON schemas (dicts); callables are not supported here")
        if documents is not None:
            if not all(isinstance(d, Mapping) for d in documents):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        variables = _plain({**self.special_tokens, **template_kwargs})
        try:
            compiled = compile_chat_template(template)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template does not compile: {_one_line(e)}") from e
        try:
            return compiled.render(
                messages=chat,
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {_one_line(e)}") from e
        except Exception as e:  # a template calling a method wrongly, dividing by zero, ...
            raise ValueError(f"chat template error: {type(e).__name__}: {_one_line(e)}") from e

    @staticmethod
    def _render_plain(messages: list[dict], add_generation_prompt: bool) -> str:
        chat = _normalize_messages(messages)
        lines = []
        for message in chat:
            role = str(message.get("role", "user")) or "user"
            lines.append(f"{role[:1].upper()}{role[1:]}: {_message_text(message.get('content'))}\n")
        if add_generation_prompt:
            lines.append("Assistant:")
        return "".join(lines)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat: as ``apply_chat_template(tokenize=True)`` with a template
        (no special tokens added: the template writes them), with special tokens for the fallback."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        templated = bool(self.chat_templates) or kwargs.get("chat_template") is not None
        return self.encode(text, add_special_tokens=not templated)

    def stream_decoder(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


# --------------------------------------------------------------------------------------------
# Streaming detokenization
# --------------------------------------------------------------------------------------------


class StreamDecoder:
    """Incremental detokenizer: ``push(id)`` returns the text completed by that token.

    Each push decodes a short window, not all ids so far (that made a reply's detokenizing
    quadratic: 0.5 ms a token at 4,000 tokens): the ids from the start of the previous piece on,
    and returns what lies beyond the text those earlier ids decode to on their own (the
    overlap gives decoders that treat a first token specially -- SentencePiece's leading space
    -- the same context in both decodes). While the window's text ends with U+FFFD (byte-level
    BPE in the middle of a multi-byte UTF-8 character) nothing is returned; the character comes
    out whole once its last byte arrives. ``flush()`` returns whatever is still held back (a
    dangling U+FFFD included) at the end. The concatenation of all returned pieces equals
    ``decode(all ids)`` for decoders whose output for a prefix of ids is a prefix of the full
    output and whose text for a run of ids does not depend on the ids before it (byte-level BPE,
    SentencePiece-style).

    ``tokenizer`` is anything with ``decode(ids, skip_special_tokens=...)``: a ``ChatTokenizer`` or
    a ``tokenizers.Tokenizer``.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.reset()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self._decode(self.ids[self._start:])
        if text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = self._advance(text)
        if delta:                   # the next window starts at this piece's first id
            self._start, self._read = self._read, len(self.ids)
            self._known = self._decode(self.ids[self._start: self._read])
        return delta

    def flush(self) -> str:
        if not self.ids:
            return ""
        return self._advance(self._decode(self.ids[self._start:]))

    def reset(self) -> None:
        self.ids: list[int] = []
        self._start = self._read = 0    # window: ids[_start:]; ids[:_read] are returned text
        self._known = ""                # the text of ids[_start:_read] decoded alone
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return "".join(self._pieces)

    def _advance(self, text: str) -> str:
        # If a decoder ever rewrote earlier text, what was returned can't be taken back: we go on
        # from the same character count.
        delta = text[len(self._known):]
        if delta:
            self._pieces.append(delta)
            self._known = text
        return delta


def load_tokenizer(directory: str | os.PathLike) -> "ChatTokenizer | None":
    """The directory's tokenizer (None without a tokenizer.json or a tiktoken.model); damaged
    tokenizer files are one ColiError naming them (the tokenizers library raises plain Exceptions)."""
    if not (os.path.isfile(os.path.join(directory, "tokenizer.json")) or has_tiktoken(directory)):
        return None
    try:
        return ChatTokenizer.from_dir(directory)
    except ColiError:
        raise
    except Exception as e:      # tokenizers' errors, bad JSON, a template that does not compile
        first = (str(e).strip().splitlines() or [e.__class__.__name__])[0][:200]
        raise ColiError(f"{directory}: the tokenizer files do not load ({first})") from None
