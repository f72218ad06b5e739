"""Modal screens: a message, a one-line prompt, a confirmation, chat settings, app settings."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Select, Static, TextArea

from .safetext import one_line, visible
from .settings import POLICIES, Sampling, Settings

MODAL_CSS = """
{name} {{ align: center middle; }}
{name} > Vertical {{ width: 72; max-width: 95%; height: auto; max-height: 90%; border: thick $accent;
                    background: $surface; padding: 1 2; }}
{name} .title {{ text-style: bold; margin-bottom: 1; }}
{name} .buttons {{ height: auto; align-horizontal: right; margin-top: 1; }}
{name} .buttons Button {{ margin-left: 1; }}
{name} .field {{ height: auto; }}
{name} .field Label {{ width: 18; padding-top: 1; }}
{name} .field Input {{ width: 1fr; }}
{name} .error {{ color: $error; height: auto; }}
"""


class MessageScreen(ModalScreen[None]):
    """A clear message (e.g. no model configured); Esc or the button closes it."""
    DEFAULT_CSS = MODAL_CSS.format(name="MessageScreen") + """
    MessageScreen #message-scroll { height: auto; }
    """
    CHROME_ROWS = 10         # the dialog around the body: border, padding, title, the button row

    def on_mount(self) -> None:
        self._fit(self.app.size.height)

    def on_resize(self, event) -> None:
        self._fit(event.size.height)

    def _fit(self, rows: int) -> None:
        """The body gets what the terminal has left (it scrolls beyond), so the button stays."""
        self.query_one("#message-scroll").styles.max_height = max(3, int(rows * 0.9) - self.CHROME_ROWS)
    BINDINGS = [Binding("escape", "dismiss", "Close")]

    def __init__(self, title: str, body: str, button: str = "OK"):
        super().__init__()
        self.title_text, self.body, self.button = title, body, button

    def compose(self) -> ComposeResult:
        with Vertical():
            # the body quotes paths and error text: untrusted, shown as plain visible text
            yield Label(Text(one_line(self.title_text)), classes="title", id="message-title")
            with VerticalScroll(id="message-scroll"):      # a small terminal: the body scrolls, the button stays
                yield Static(Text(visible(self.body)), id="message-body", markup=False)
            with Horizontal(classes="buttons"):
                yield Button(self.button, variant="primary", id="ok")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None)


class TextPrompt(ModalScreen[str | None]):
    DEFAULT_CSS = MODAL_CSS.format(name="TextPrompt")
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, value: str = ""):
        super().__init__()
        self.title_text, self.value = title, value

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(Text(one_line(self.title_text)), classes="title")
            yield Input(one_line(self.value), id="value")
            with Horizontal(classes="buttons"):
                yield Button("Cancel", id="cancel")
                yield Button("OK", variant="primary", id="ok")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(self.query_one(Input).value if event.button.id == "ok" else None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    DEFAULT_CSS = MODAL_CSS.format(name="ConfirmScreen")
    BINDINGS = [Binding("escape", "no", "No"), Binding("y", "yes", "Yes")]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(Text(one_line(self.question)), classes="title")
            with Horizontal(classes="buttons"):
                yield Button("Cancel", id="no")
                yield Button("Delete", variant="error", id="yes")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_yes(self) -> None:
        self.dismiss(True)

    def action_no(self) -> None:
        self.dismiss(False)


def _field(label: str, widget) -> Horizontal:
    return Horizontal(Label(label), widget, classes="field")


def _sampling_fields(s: Sampling):
    yield _field("temperature", Input(str(s.temperature), id="temperature"))
    yield _field("top-p", Input(str(s.top_p), id="top_p"))
    yield _field("top-k (0 = off)", Input(str(s.top_k), id="top_k"))
    yield _field("max new tokens", Input(str(s.max_new_tokens), id="max_new_tokens"))
    yield _field("seed (empty = random)", Input("" if s.seed is None else str(s.seed), id="seed"))


def _read_sampling(screen) -> Sampling:
    v = lambda k: screen.query_one(f"#{k}", Input).value.strip()
    try:
        s = Sampling(temperature=float(v("temperature")), top_p=float(v("top_p")), top_k=int(v("top_k")),
                     max_new_tokens=int(v("max_new_tokens")), seed=int(v("seed")) if v("seed") else None)
    except ValueError:
        raise ValueError("sampling values must be numbers") from None
    s.validate()
    return s


class ChatSettingsScreen(ModalScreen[tuple | None]):
    """System prompt and sampling for one chat; returns (system_prompt, Sampling) or None."""
    DEFAULT_CSS = MODAL_CSS.format(name="ChatSettingsScreen") + """
    ChatSettingsScreen #system { height: 6; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, system_prompt: str, sampling: Sampling):
        super().__init__()
        self.chat_title, self.system_prompt, self.sampling = title, system_prompt, sampling

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(Text(f"Chat settings · {one_line(self.chat_title)}"), classes="title")
            with VerticalScroll():
                yield Label("system prompt")
                yield TextArea(visible(self.system_prompt), id="system")
                yield from _sampling_fields(self.sampling)
            yield Label("", classes="error", id="error")
            with Horizontal(classes="buttons"):
                yield Button("Cancel", id="cancel")
                yield Button("Save", variant="primary", id="save")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id != "save":
            self.dismiss(None)
            return
        try:
            s = _read_sampling(self)
        except ValueError as e:
            self.query_one("#error", Label).update(Text(one_line(str(e))))
            return
        self.dismiss((self.query_one("#system", TextArea).text, s))

    def action_cancel(self) -> None:
        self.dismiss(None)


class SettingsScreen(ModalScreen[Settings | None]):
    """The app's settings (saved to config.toml by the caller)."""
    DEFAULT_CSS = MODAL_CSS.format(name="SettingsScreen") + """
    SettingsScreen Checkbox { margin-left: 18; }
    SettingsScreen .note { color: $text-muted; height: auto; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, settings: Settings, path: str = "", sessions=None):
        super().__init__()
        self.settings, self.path = settings, path
        self.sessions = sessions         # core.sessions.SessionStore: the saved chat caches' size

    def _cache_note(self) -> str:
        """How much disk the saved chat caches take now (least recently used go past the budget)."""
        if self.sessions is None:
            return "saved chat caches: none"
        from .tierpanel import human_bytes
        size, n = self.sessions.size()
        return (f"saved chat caches: {human_bytes(size)} in {n} file{'s' if n != 1 else ''} "
                f"(least recently used go first)")

    def compose(self) -> ComposeResult:
        s = self.settings
        with Vertical():
            yield Label("Settings", classes="title")
            with VerticalScroll():
                yield _field("model folder", Input(one_line(s.model), id="model", placeholder="(the demo model)"))
                yield _field("RAM budget (GB)", Input("" if s.ram_gb is None else str(s.ram_gb), id="ram_gb",
                                                      placeholder="automatic"))
                yield _field("cache policy", Select([(p, p) for p in POLICIES], value=s.policy,
                                                    allow_blank=False, id="policy"))
                yield _field("threads", Input("" if s.threads is None else str(s.threads), id="threads",
                                              placeholder="automatic"))
                yield Checkbox("lookahead prefetch", s.prefetch, id="prefetch")
                yield Checkbox("O_DIRECT reads", s.o_direct, id="o_direct")
                yield Checkbox("float16 KV cache (half the RAM)",
                               s.kv_cache == "float16", id="kv_cache")
                yield Checkbox("reuse the chat's cache (faster turns)",
                               s.prefix_cache, id="prefix_cache")
                yield _field("saved caches (GB)", Input(f"{s.session_cache_gb:g}", id="session_cache_gb",
                                                        placeholder="2"))
                yield Label(Text(one_line(self._cache_note())), classes="note", id="cache_note")
                yield Label("default sampling for new chats", classes="note")
                yield from _sampling_fields(s.sampling)
                yield Label("serve the loaded model (OpenAI / Anthropic API, like `coli serve`)", classes="note")
                yield Checkbox("serve over HTTP", s.serve, id="serve")
                yield _field("server host", Input(one_line(s.serve_host), id="serve_host", placeholder="127.0.0.1"))
                yield _field("server port", Input(str(s.serve_port), id="serve_port", placeholder="8080"))
                yield _field("API key", Input(s.serve_key, id="serve_key", password=True,
                                             placeholder="none ($COLI_API_KEY if set)"))
                if s.overridden:
                    yield Label(Text(one_line("set by the environment (not saved): " +
                                ", ".join(f"{k} ({v})" for k, v in s.overridden.items()))), classes="note")
                yield Label(Text(one_line(f"saved to {self.path}")), classes="note")
            yield Label("", classes="error", id="error")
            with Horizontal(classes="buttons"):
                yield Button("Cancel", id="cancel")
                yield Button("Save", variant="primary", id="save")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id != "save":
            self.dismiss(None)
            return
        v = lambda k: self.query_one(f"#{k}", Input).value.strip()
        try:
            out = Settings(model=v("model"), ram_gb=float(v("ram_gb")) if v("ram_gb") else None,
                           policy=str(self.query_one("#policy", Select).value),
                           prefetch=self.query_one("#prefetch", Checkbox).value,
                           threads=int(v("threads")) if v("threads") else None,
                           o_direct=self.query_one("#o_direct", Checkbox).value,
                           kv_cache="float16" if self.query_one("#kv_cache", Checkbox).value else "float32",
                           prefix_cache=self.query_one("#prefix_cache", Checkbox).value,
                           session_cache_gb=float(v("session_cache_gb")) if v("session_cache_gb") else 0.0,
                           sampling=_read_sampling(self), theme=self.settings.theme,
                           serve=self.query_one("#serve", Checkbox).value,
                           serve_host=v("serve_host") or "127.0.0.1",
                           serve_port=int(v("serve_port")) if v("serve_port") else 8080,
                           serve_key=v("serve_key"),
                           overridden=dict(self.settings.overridden))
            out.validate()
        except ValueError as e:
            msg = str(e) if "must" in str(e) else "RAM budget, threads, saved caches and the port must be numbers"
            self.query_one("#error", Label).update(Text(one_line(msg)))
            return
        self.dismiss(out)

    def action_cancel(self) -> None:
        self.dismiss(None)
