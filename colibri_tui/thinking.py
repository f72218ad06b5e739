"""A reply's thinking and its answer, apart (no Textual here: the app, the history and the
server share it).

Two forms reach us. A reply that writes its own ``<think>…</think>`` first; and a reply that
starts *inside* a think block because the chat template's generation prompt opened it (Qwen3 /
Qwen3.6 with thinking on end the prompt with ``<|im_start|>assistant\\n<think>\\n``), so the text
is ``…thinking…</think>\\n\\nanswer``. ``opened`` says the second form is under way (known from
the prompt, ``prompt_opens_think``); without it, text holding a ``</think>`` that no ``<think>``
opened is read as the second form too, as those templates read an earlier turn."""
from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _held(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``tag``."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


def split_think(text: str, opened: bool = False, final: bool = False,
                loose: bool = True) -> tuple[str | None, str, bool]:
    """(thinking or None, answer, thinking still open). Partial tags at the end are held back
    so they never flash on screen (``final``: the text is complete, nothing is held).
    ``loose=False``: a </think> that no <think> opened is text (``opened`` is known for sure)."""
    s = text.lstrip()
    if s.startswith(THINK_OPEN):
        body = s[len(THINK_OPEN):]
    elif opened or (loose and THINK_CLOSE in text):
        body = text
    elif s and THINK_OPEN.startswith(s) and not final:
        return None, "", False             # maybe the start of <think>: wait
    else:
        return None, text, False
    end = body.find(THINK_CLOSE)
    if end < 0:
        held = 0 if final else _held(body, THINK_CLOSE)
        return body[: len(body) - held].strip("\n"), "", True
    return body[:end].strip("\n"), body[end + len(THINK_CLOSE):].lstrip("\n"), False


def strip_thinking(text: str, opened: bool = False) -> str:
    """The answer alone (what a later turn's prompt, a server's ``content`` gets)."""
    thinking, answer, open_ = split_think(text, opened)
    if thinking is None:
        return text.strip()
    return "" if open_ else answer.strip()


def prompt_opens_think(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open think block (the reply starts thinking)."""
    tail = prompt.rstrip()
    return tail.endswith(THINK_OPEN)


class ThinkSplitter:
    """A streamed reply, parted as it comes: ``feed(piece)`` and ``flush()`` return
    (thinking delta, answer delta); their concatenations are ``split_think`` of the whole."""

    def __init__(self, opened: bool = False):
        self.opened = opened
        self.text = ""
        self._thinking, self._answer = "", ""

    def _step(self, final: bool) -> tuple[str, str]:
        thinking, answer, _ = split_think(self.text, self.opened, final, loose=False)
        thinking = thinking or ""
        dt = dl = ""
        if thinking.startswith(self._thinking):
            dt, self._thinking = thinking[len(self._thinking):], thinking
        if answer.startswith(self._answer):
            dl, self._answer = answer[len(self._answer):], answer
        return dt, dl

    def feed(self, piece: str) -> tuple[str, str]:
        self.text += piece
        return self._step(False)

    def flush(self) -> tuple[str, str]:
        return self._step(True)
