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
from .thinking import THINK_CLOSE, THINK_OPEN, split_think  # noqa: F401  (re-exported)

NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")


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
    """A reply: its thinking folded in a Collapsible (collapsed unless opened: t or a click),
    streaming into it while the think block is open, then the answer as Markdown.

    ``opened``: the prompt ended inside a think block, so the reply starts as thinking.
    ``think_tokens``: the thinking's length in tokens, shown in the title when known;
    ``count_tokens(text)`` (the model's tokenizer) gives it exactly when the block closes,
    else it is summed from the ``tokens`` of the batches that stream into the block."""

    BINDINGS = MESSAGE_BINDINGS + [Binding("t", "toggle_thinking", "Thinking")]
    kind = "reply"
    DEFAULT_CSS = """
    AssistantMessage { height: auto; margin: 1 0 0 0; padding: 0 1; border-left: thick $success 50%; }
    AssistantMessage:focus { background: $accent 15%; border-left: thick $warning; }
    AssistantMessage .meta { color: $text-muted; height: auto; }
    AssistantMessage Markdown { margin: 0; padding: 0; }
    AssistantMessage Collapsible { margin: 0; padding: 0; border: none; }
    AssistantMessage .thinking { color: $text-muted; }
    """

    def __init__(self, content: str = "", streaming: bool = False, meta: str = "", opened: bool = False,
                 think_tokens: int | None = None, count_tokens=None, **kw):
        super().__init__(**kw)
        self.content = visible(content)     # model text is untrusted: controls made visible
        self.streaming = streaming
        self.opened = opened
        self.think_tokens = think_tokens
        self.count_tokens = count_tokens
        self._meta = meta
        self._sent = ""                # answer text already written to the Markdown stream
        self._stream = None
        self._collapsible: Collapsible | None = None
        self._meta_label: Label | None = None     # kept: it may not be mounted yet when a fast reply ends

    def split(self) -> tuple[str | None, str, bool]:
        return split_think(self.content, self.opened)

    @property
    def thinking(self) -> str | None:
        return self.split()[0]

    @property
    def answer(self) -> str:
        return self.split()[1]

    def thinking_title(self, open_: bool) -> str:
        n = self.think_tokens
        count = f" ({n} token{'' if n == 1 else 's'})" if n is not None else ""
        return ("Thinking…" if open_ else "Thinking") + count

    def _count(self, thinking: str) -> None:
        if self.count_tokens is not None:
            try:
                self.think_tokens = int(self.count_tokens(thinking))
            except Exception:
                pass

    def compose(self) -> ComposeResult:
        thinking, answer, open_ = self.split()
        if thinking is not None:
            if self.think_tokens is None and not open_:
                self._count(thinking)
            self._collapsible = Collapsible(Static(Text(thinking), classes="thinking"),
                                            title=self.thinking_title(open_ and self.streaming), collapsed=True)
            yield self._collapsible
        self._sent = answer
        yield Markdown(answer)
        self._meta_label = Label(Text(visible(self._meta)), classes="meta")
        yield self._meta_label

    def copy_text(self) -> str:
        """The answer as written (Markdown source), without the thinking; the thinking while
        there is no answer yet."""
        thinking, answer, _ = self.split()
        return answer if answer.strip() or thinking is None else thinking

    def action_toggle_thinking(self) -> None:
        if self._collapsible is None:
            self.app.notify("this reply has no thinking", severity="warning")
            return
        self._collapsible.collapsed = not self._collapsible.collapsed

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    async def append(self, text: str, tokens: int | None = None) -> None:
        """Add streamed text (a batch of ``tokens`` tokens)."""
        if not text:
            return
        was_open = self._collapsible is not None and self._collapsible.title.startswith("Thinking…")
        self.content += visible(text)
        if not self.query(Markdown):
            return                       # not composed yet: compose/the next append shows it
        thinking, answer, open_ = self.split()
        if thinking is not None:
            closing = was_open or self._collapsible is None       # this batch may end the block
            if tokens is not None and (open_ or closing):
                self.think_tokens = (self.think_tokens or 0) + tokens
            if not open_ and closing:
                self._count(thinking)    # once, when the block closes
            if self._collapsible is None:
                self._collapsible = Collapsible(Static(Text(thinking), classes="thinking"),
                                                title=self.thinking_title(open_), collapsed=True)
                await self.mount(self._collapsible, before=self.markdown)
            else:
                self._collapsible.query_one(".thinking", Static).update(Text(thinking))
                self._collapsible.title = self.thinking_title(open_)
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
        thinking, answer, open_ = self.split()
        if thinking is not None and self._collapsible is not None:
            self._count(thinking)
            self._collapsible.title = self.thinking_title(False)
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
