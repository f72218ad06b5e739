"""Text from a model, a saved chat or a file is untrusted: it must never send a control sequence
to the terminal. ``visible`` maps every C0 control but newline and tab, DEL and the C1 controls
to a visible stand-in (ESC becomes ␛, BEL ␇, SO ␎: the Unicode "control pictures" block), so
``\\x1b[2J`` shows as ``␛[2J`` instead of clearing the screen. ``safe_markup`` also escapes Rich
markup, for the few places that parse it (toasts, labels)."""
from __future__ import annotations

from rich.markup import escape

# C0 (0x00-0x1f) -> U+2400 + code, DEL -> U+2421, C1 (0x80-0x9f) -> U+FFFD; newline and tab
# stay. One character for one: a streamed reply is compared with its widget by length.
_TABLE = {c: chr(0x2400 + c) for c in range(0x20) if c not in (0x09, 0x0A)}
_TABLE[0x7F] = "\u2421"
_TABLE.update({c: "\ufffd" for c in range(0x80, 0xA0)})


def visible(text: str) -> str:
    """``text`` with every control character (but newline and tab) made visible."""
    return text.translate(_TABLE) if text else text


def one_line(text: str) -> str:
    """``visible``, on one line (titles, list items): newlines and tabs become spaces."""
    return visible(text).replace("\n", " ").replace("\t", " ")


def safe_markup(text: str) -> str:
    """For widgets that parse Rich markup: visible controls, and ``[`` escaped."""
    return escape(visible(text))
