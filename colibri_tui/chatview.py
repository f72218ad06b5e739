"""Chat widgets: the message list, a streaming assistant reply (Markdown, collapsible thinking)
and the prompt editor (Enter sends, Shift+Enter / Ctrl+J / Alt+Enter add a newline).

Every message can be selected (click it, or Alt+Up / Alt+Down from anywhere in the chat): the
selected message has the focus, so its keys never reach the prompt. c (or Ctrl+C when no text is
selected with the mouse) copies the message, y copies its code blocks one after another."""
from __future__ import annotations

import re

from rich.text import Text
from textual import events
from textual.actions import SkipAction
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Collapsible, Label, Markdown, Static, TextArea

from .safetext import visible

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")


def _held(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``tag``."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


def split_think(text: str) -> tuple[str | None, str, bool]:
    """(thinking or None, answer, thinking still open) for a reply that may open with <think>.
    Partial tags at the end are held back so they never flash on screen."""
    s = text.lstrip()
    if not s.startswith(THINK_OPEN):
        if s and THINK_OPEN.startswith(s):
            return None, "", False         # maybe the start of <think>: wait
        return None, text, False
    body = s[len(THINK_OPEN):]
    end = body.find(THINK_CLOSE)
    if end < 0:
        return body[: len(body) - _held(body, THINK_CLOSE)].strip("\n"), "", True
    return body[:end].strip("\n"), body[end + len(THINK_CLOSE):].lstrip("\n"), False


# a fenced code block (``` or ~~~, up to 3 spaces of indent); an unclosed one runs to the end
_FENCE = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})[^\n]*\n(?P<code>.*?)(?:^ {0,3}(?P=fence)[`~]*[ \t]*$|\Z)",
                    re.M | re.S)


def code_blocks(text: str) -> list[str]:
    """The contents of the fenced code blocks in ``text``, in order (without the fences)."""
    out = []
    for m in _FENCE.finditer(text):
        code = m.group("code")
        out.append(code[:-1] if code.endswith("\n") else code)
    return out


# keys of a selected (focused) message; the prompt never sees them
MESSAGE_BINDINGS = [
    Binding("c", "copy_message", "Copy"),
    Binding("ctrl+c", "copy_message_or_selection", "Copy", show=False),
    Binding("y", "copy_code", "Copy code"),
    Binding("up,k", "app.select_message(-1)", "Previous", show=False),
    Binding("down,j", "app.select_message(1)", "Next", show=False),
    Binding("escape", "app.focus_prompt", "Back"),      # a second Esc stops a reply
]


class SelectableMessage:
    """Copy actions shared by the user and assistant messages (both focusable)."""

    _code_index = 0
    kind = "message"

    def copy_text(self) -> str:
        return self.content

    def action_copy_message(self) -> None:
        text = self.copy_text()
        if not text.strip():
            self.app.notify(f"this {self.kind} is empty", severity="warning")
            return
        self._copy(text, self.kind)

    def action_copy_message_or_selection(self) -> None:
        if self.screen.get_selected_text():
            raise SkipAction()           # text selected with the mouse: the screen's Ctrl+C copies it
        self.action_copy_message()

    def action_copy_code(self) -> None:
        """Copy the next code block (the first, then the second, …, then the first again)."""
        blocks = code_blocks(self.copy_text())
        if not blocks:
            self.app.notify(f"no code block in this {self.kind}", severity="warning")
            return
        i = self._code_index % len(blocks)
        self._code_index = i + 1
        self._copy(blocks[i], "code block" if len(blocks) == 1 else f"code block {i + 1}/{len(blocks)}")

    def _copy(self, text: str, what: str) -> None:
        copy_out = getattr(self.app, "copy_out", None)      # ColiApp: says where the text went
        if copy_out is not None:
            copy_out(text, what)
        else:
            self.app.copy_to_clipboard(text)
            self.app.notify(f"{what} copied")


class UserMessage(SelectableMessage, Static, can_focus=True):
    BINDINGS = MESSAGE_BINDINGS
    DEFAULT_CSS = """
    UserMessage { background: $boost; border-left: thick $accent; padding: 0 1; margin: 1 0 0 0; }
    UserMessage:focus { background: $accent 25%; border-left: thick $warning; }
    """

    def __init__(self, content: str, **kw):
        # saved text is untrusted: no control reaches the terminal, no markup is parsed (Static's
        # ``content`` is the text itself)
        super().__init__(visible(content), markup=False, **kw)


class AssistantMessage(SelectableMessage, Vertical, can_focus=True):
    BINDINGS = MESSAGE_BINDINGS
    kind = "reply"
    DEFAULT_CSS = """
    AssistantMessage { height: auto; margin: 1 0 0 0; padding: 0 1; border-left: thick $success 50%; }
    AssistantMessage:focus { background: $accent 15%; border-left: thick $warning; }
    AssistantMessage .meta { color: $text-muted; height: auto; }
    AssistantMessage Markdown { margin: 0; padding: 0; }
    AssistantMessage Collapsible { margin: 0; padding: 0; border: none; }
    AssistantMessage .thinking { color: $text-muted; }
    """

    def __init__(self, content: str = "", streaming: bool = False, meta: str = "", **kw):
        super().__init__(**kw)
        self.content = visible(content)     # model text is untrusted: controls made visible
        self.streaming = streaming
        self._meta = meta
        self._sent = ""                # answer text already written to the Markdown stream
        self._stream = None
        self._collapsible: Collapsible | None = None
        self._meta_label: Label | None = None     # kept: it may not be mounted yet when a fast reply ends

    def compose(self) -> ComposeResult:
        thinking, answer, _ = split_think(self.content)
        if thinking is not None:
            self._collapsible = Collapsible(Static(Text(thinking), classes="thinking"), title="Thinking",
                                            collapsed=True)
            yield self._collapsible
        self._sent = answer
        yield Markdown(answer)
        self._meta_label = Label(Text(visible(self._meta)), classes="meta")
        yield self._meta_label

    def copy_text(self) -> str:
        """The answer as written (Markdown source), without the thinking; the thinking while
        there is no answer yet."""
        thinking, answer, _ = split_think(self.content)
        return answer if answer.strip() or thinking is None else thinking

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    async def append(self, text: str) -> None:
        """Add streamed text (a batch of tokens)."""
        if not text:
            return
        self.content += visible(text)
        if not self.query(Markdown):
            return                       # not composed yet: compose/the next append shows it
        thinking, answer, open_ = split_think(self.content)
        if thinking is not None:
            if self._collapsible is None:
                self._collapsible = Collapsible(Static(Text(thinking), classes="thinking"),
                                                title="Thinking…", collapsed=False)
                await self.mount(self._collapsible, before=self.markdown)
            else:
                self._collapsible.query_one(".thinking", Static).update(Text(thinking))
            if not open_ and self._collapsible.title == "Thinking…":
                self._collapsible.title = "Thinking"
                self._collapsible.collapsed = True
        if answer.startswith(self._sent):
            delta = answer[len(self._sent):]
            if delta:
                if self._stream is None:
                    self._stream = Markdown.get_stream(self.markdown)
                await self._stream.write(delta)
                self._sent = answer
        else:                            # the split changed under us: render afresh
            await self._stop_stream()
            await self.markdown.update(answer)
            self._sent = answer

    async def _stop_stream(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    async def on_unmount(self) -> None:
        # removed mid-stream (chat switched, app closing): end the stream's task too
        stream, self._stream = self._stream, None
        if stream is not None and stream._task is not None:
            stream._task.cancel()

    async def finish(self, meta: str = "") -> None:
        """The reply ended: one full render of the whole answer."""
        await self._stop_stream()
        self.streaming = False
        self._meta = meta
        if not self.query(Markdown):
            return                       # compose renders the whole reply
        thinking, answer, _ = split_think(self.content)
        if thinking is not None and self._collapsible is not None:
            self._collapsible.title = "Thinking"
        await self.markdown.update(answer)
        self._sent = answer
        self.set_meta(meta)

    def set_meta(self, meta: str) -> None:
        self._meta = meta
        if self._meta_label is not None:      # else compose shows self._meta
            self._meta_label.update(Text(visible(meta)))


class MessageList(VerticalScroll):
    DEFAULT_CSS = """
    MessageList { height: 1fr; padding: 0 1; }
    MessageList #empty { color: $text-muted; margin: 1 2; }
    """

    def on_mount(self) -> None:
        self.anchor()                    # follow the bottom while replies stream


class PromptInput(TextArea):
    """Enter sends; Shift+Enter (or Ctrl+J / Alt+Enter where the terminal cannot send it) adds a newline."""

    DEFAULT_CSS = """
    PromptInput { height: auto; min-height: 3; max-height: 10; border: tall $accent 50%; }
    PromptInput:focus { border: tall $accent; }
    """

    class Submitted(Message):
        def __init__(self, editor: "PromptInput", text: str):
            super().__init__()
            self.editor, self.text = editor, text

    def __init__(self, **kw):
        kw.setdefault("soft_wrap", True)
        kw.setdefault("show_line_numbers", False)
        kw.setdefault("tab_behavior", "focus")
        super().__init__(**kw)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self._replace_via_keyboard("\n", start, end)
            return
        await super()._on_key(event)
