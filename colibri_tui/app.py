"""`coli chat`: the full-screen app. A chat list, the conversation (streaming Markdown), the prompt,
and the live tier panel with the Brain map. The engine runs in a thread worker; its events reach
the UI in batches (``runner.run_generation``)."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult, ScreenStackError, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Header, Label, ListItem, ListView, Static

from . import settings as settings_mod
from .chatview import AssistantMessage, MessageList, PromptInput, UserMessage, code_blocks
from .history import History, export_path, title_from
from .pacing import PaintBudget
from .safetext import one_line, visible
from .thinking import prompt_opens_think, split_think
from .screens import ChatSettingsScreen, ConfirmScreen, MessageScreen, SettingsScreen, TextPrompt
from .settings import Settings
from .tierpanel import TierPanel, human_bytes

NO_MODEL = ("No model is configured and this install has no demo model.\n\n"
            "Convert a Hugging Face MoE checkpoint and point colibrì at it:\n\n"
            "    coli convert /path/to/hf-model ./my-model\n"
            "    coli chat --model ./my-model\n\n"
            "or set COLI_MODEL, or `model = \"...\"` in {config}.\n"
            "or let the setup wizard download and convert one: Ctrl+P → “Set up a model”.\n\n"
            "Esc closes this message: your chats stay readable.")


@dataclass
class Generation:
    chat_id: int
    prompt: str
    user_message_id: int
    widget: AssistantMessage | None
    text: str = ""
    tokens: int = 0
    cancel: bool = False
    started: float = field(default_factory=time.monotonic)
    applied: threading.Event = field(default_factory=threading.Event)   # set: the UI took the last batch
    thread: threading.Thread | None = None
    detached: bool = False       # stopped by Esc before any text: the UI is done with it
    holding: bool = False        # its thread holds the engine lock (the app's server waits)
    think_open: bool = False     # the prompt ended inside a think block: the reply starts thinking
    panel_at: float = field(default_factory=time.monotonic)   # when the tier panel last took a batch
    paint: PaintBudget = field(default_factory=PaintBudget)   # when the next batch may come

    def __post_init__(self):
        self.applied.set()


class BatchReady(Message):
    """A batch of engine events from the generation worker (see ``runner.run_generation``)."""

    def __init__(self, gen: Generation, batch: dict):
        super().__init__()
        self.gen, self.batch = gen, batch


class ChatItem(ListItem):
    def __init__(self, chat_id: int, title: str):
        super().__init__(Label(Text(one_line(title)), classes="chat-title"))
        self.chat_id, self.title = chat_id, title


def fmt_meta(stats: dict | None, reason: str | None) -> str:
    if not stats:
        return f"stopped: {reason}" if reason else ""
    cached = stats.get("cached_tokens") or 0
    first = f"first token {stats.get('ttft_s', 0):.2f} s"
    if isinstance(cached, int) and cached > 0:       # prefix reuse: these were not computed again
        first += f" ({cached} of {stats.get('prompt_tokens', 0)} prompt tokens cached)"
    parts = [f"{stats.get('new_tokens', 0)} tokens", f"{stats.get('decode_tok_s', 0):.1f} tok/s",
             first, f"hit rate {stats.get('hit_rate', 1):.0%}",
             f"read {human_bytes(stats.get('bytes_read', 0))}"]
    if reason and reason != "eos":
        parts.append("stopped" if reason == "cancelled" else f"stop: {reason}")
    return " · ".join(parts)


class ChatScreen(Screen):
    BINDINGS = [
        Binding("escape", "app.stop_reply", "Stop", show=True),
        Binding("ctrl+n", "app.new_chat", "New chat", priority=True),
        Binding("f1", "app.about", "About", show=False, priority=True),
        Binding("f2", "app.toggle_panel", "Tier panel", priority=True),
        Binding("ctrl+t", "app.toggle_panel", "Tier panel", show=False),
        Binding("f3", "app.toggle_chats", "Chats", priority=True),
        Binding("f4", "app.chat_settings", "Chat settings", priority=True),
        Binding("f5", "app.settings", "Settings", priority=True),
        Binding("f6", "app.rename_chat", "Rename", priority=True),
        Binding("f7", "app.export_chat", "Export", priority=True),
        Binding("f8", "app.delete_chat", "Delete", priority=True),
        # chat switching from anywhere, whatever has the focus (also the palette)
        Binding("ctrl+pagedown,alt+pagedown", "app.switch_chat(1)", "Next chat", show=False, priority=True),
        Binding("ctrl+pageup,alt+pageup", "app.switch_chat(-1)", "Previous chat", show=False, priority=True),
        # select a message to copy it (c) or its code blocks (y): see chatview.SelectableMessage
        Binding("alt+up", "app.select_message(-1)", "Select message", show=False, priority=True),
        Binding("alt+down", "app.select_message(1)", "Select message", show=False, priority=True),
    ]
    # Below these widths a side panel collapses (the chat keeps the columns); its toggle key
    # (F3, F2) then opens it as an overlay over the chat.
    CHATS_INLINE_MIN = 120       # 30 (chat list) + 44 (tier panel) + a 46-column chat
    TIERS_INLINE_MIN = 100       # 44 (tier panel) + a 56-column chat
    DEFAULT_CSS = """
    #body { layers: base overlay; }
    #chats { width: 30; border-right: tall $primary 40%; }
    #chats.-hidden { display: none; }
    ChatScreen.-narrow-chats #chats { display: none; dock: left; layer: overlay; height: 100%;
                                      background: $surface; border-right: thick $accent; }
    ChatScreen.-narrow-chats #chats.-open { display: block; }
    ChatScreen.-narrow-tiers #tiers { display: none; dock: right; layer: overlay; height: 100%;
                                      background: $surface; border-left: thick $accent; }
    ChatScreen.-narrow-tiers #tiers.-open { display: block; }
    #chats ListView { height: 1fr; }
    #chats .heading { text-style: bold; color: $accent; padding: 0 1; }
    #main { width: 1fr; }
    #status { width: 1fr; height: 1; padding: 0 1; color: $text-muted; }   /* fixed: no layout on update */
    """

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            with Vertical(id="chats"):
                yield Label("Chats", classes="heading")
                yield ListView(id="chat-list")
            with Vertical(id="main"):
                yield MessageList(id="messages")
                yield Static("", id="status")
                yield PromptInput(id="prompt")
            yield TierPanel(id="tiers")
        yield Footer()

    async def on_mount(self) -> None:
        self.fit_width(self.app.size.width)
        self.query_one(PromptInput).focus()
        await self.app.start_up()

    def on_resize(self, event) -> None:
        self.fit_width(event.size.width)

    def fit_width(self, width: int) -> None:
        self.set_class(width < self.CHATS_INLINE_MIN, "-narrow-chats")
        self.set_class(width < self.TIERS_INLINE_MIN, "-narrow-tiers")

    def toggle_side(self, selector: str, narrow_class: str) -> None:
        """Wide: show/hide the panel beside the chat. Narrow: open/close it over the chat."""
        panel = self.query_one(selector)
        if self.has_class(narrow_class):
            panel.toggle_class("-open")
        else:
            panel.toggle_class("-hidden")

    def close_overlays(self) -> bool:
        """Close side panels open over the chat; True if one was open."""
        open_ = list(self.query("#chats.-open, #tiers.-open"))
        for panel in open_:
            panel.remove_class("-open")
        return bool(open_)


class ColiApp(App):
    TITLE = "colibrì"
    COMMANDS = App.COMMANDS
    # While a reply streams, the tier panel (stats, sparkline, brain map) repaints at most this
    # often from the send on, and always with the reply's last batch: each repaint costs the UI
    # thread 5-10 ms of CPU on the cores the kernel threads decode on (benchmarks/README.md,
    # "The speed users see"); a reply shorter than this shows its stats at its end.
    PANEL_INTERVAL = 2.0

    def __init__(self, model_path: str | os.PathLike | None = None, settings: Settings | None = None,
                 history_path: str | os.PathLike | None = None, engine_options: dict | None = None,
                 engine=None, setup_wizard: bool = False, **kw):
        super().__init__(**kw)
        self.setup_wizard = setup_wizard      # no model and no demo: open the wizard, not a message
        self.settings = settings if settings is not None else settings_mod.load()
        self.model_path = str(model_path) if model_path else None
        self.engine_options = dict(engine_options or {})     # command-line flags beat the config
        self.history = History(history_path)
        from core.sessions import SessionStore
        # each chat's cache, saved beside the history after every turn (core.sessions)
        self.sessions = SessionStore(self.history.path.parent / "caches",
                                     int(self.settings.session_cache_gb * 1e9))
        self.engine = engine
        self.engine_error: str | None = None
        self.model_name = ""
        self.slot_bytes: int | None = None
        self.chat_id: int | None = None
        self._gen: Generation | None = None
        self.stopping: Generation | None = None     # detached, its thread still ending
        self.loading = engine is None
        # one engine for the chat and the app's server (settings: serve): whoever generates
        # holds this lock, so the chat waits for a request being decoded and the other way round
        self.engine_lock = threading.Lock()
        self.server = None           # colibri_tui.server.embedded.EmbeddedServer while serving
        self._server_timer = None

    # --- layout helpers ------------------------------------------------------------------------
    def get_default_screen(self) -> Screen:
        return ChatScreen()

    @property
    def messages_view(self) -> MessageList:
        return self.screen_stack[0].query_one(MessageList) if self.screen_stack else self.query_one(MessageList)

    def _q(self, selector, kind=None):
        base = self.screen_stack[0] if self.screen_stack else self.screen
        return base.query_one(selector, kind) if kind else base.query_one(selector)

    def _q_live(self, selector, kind=None):
        """``_q``, or None when there is no such widget: not composed yet, or the app closing
        (a reply's last batch can be applied while it closes)."""
        try:
            return self._q(selector, kind)
        except (NoMatches, ScreenStackError):
            return None

    @property
    def prompt_input(self) -> PromptInput:
        return self._q("#prompt", PromptInput)

    @property
    def gen(self) -> Generation | None:
        """The reply streaming now (None: none)."""
        return self._gen

    @gen.setter
    def gen(self, gen: Generation | None) -> None:
        self._gen = gen
        prompt = self._q_live("#prompt", PromptInput)
        if prompt is not None:     # a blinking cursor is two frames a second the decode pays for
            prompt.cursor_blink = gen is None

    @property
    def tier_panel(self) -> TierPanel:
        return self._q("#tiers", TierPanel)

    def set_status(self, text: str) -> None:
        status = self._q_live("#status", Static)
        if status is not None:     # one line of fixed size: its updates (every batch) need no layout
            status.update(Text(one_line(text)), layout=False)

    def show_title(self, chat_title: str) -> None:
        self.title = f"colibrì · {one_line(chat_title)}"

    def notify(self, message: str, *, title: str = "", severity="information", timeout: float | None = None,
               markup: bool = True) -> None:
        """Every toast as plain text: messages carry chat titles, paths and error text, which
        are untrusted (no control sequence, no Rich markup)."""
        super().notify(one_line(str(message)), title=one_line(title), severity=severity, timeout=timeout,
                       markup=False)

    # --- start-up ------------------------------------------------------------------------------
    async def start_up(self) -> None:
        """Called once the chat screen is composed."""
        if self.settings.theme and self.settings.theme in self.available_themes:
            self.theme = self.settings.theme
        self._theme_ready = True
        # core prints its warnings (a damaged usage history, say) as `coli: warning:` lines on
        # stderr, which the full-screen app would swallow: they become toasts (on_print)
        self.begin_capture_print(self, stdout=False, stderr=True)
        self.show_notices(self.settings.notices)         # a bad config.toml, named key by key
        chats = self.history.chats()
        chat = chats[0] if chats else self.history.new_chat(sampling=self.settings.sampling)
        self.refresh_chat_list()
        await self.show_chat(chat.id)                    # shows the history's notices too
        if self.engine is not None:
            self._engine_ready()
        else:
            self.resolve_and_load()

    NOTICES_SHOWN = 6            # toasts at once; the rest are counted (and all are in the log)

    def show_notices(self, notices: list[str]) -> None:
        """Warn, with toasts, about what was wrong in a file (each notice once: the list is emptied)."""
        items, notices[:] = list(notices), []
        if not items:
            return
        from .paths import logger
        for text in items:
            logger("app").warning("%s", text)
        for text in items[: self.NOTICES_SHOWN]:
            self.notify(text, severity="warning", timeout=20)
        if len(items) > self.NOTICES_SHOWN:
            self.notify(f"… and {len(items) - self.NOTICES_SHOWN} more problems of the same kind (all "
                        f"in the log)", severity="warning", timeout=20)

    def on_print(self, event) -> None:
        """stderr while the app runs (begin_capture_print): `coli: warning:` lines as toasts."""
        if not event.stderr:
            return
        buf = getattr(self, "_stderr_buf", "") + event.text
        *lines, self._stderr_buf = buf.split("\n")
        self._stderr_buf = self._stderr_buf[-4096:]           # never an unbounded partial line
        for line in lines:
            if line.startswith("coli: warning: "):
                self.show_notices([line[len("coli: warning: "):]])

    def resolved_model(self) -> str | None:
        if self.model_path:
            return self.model_path
        if self.settings.model:
            return self.settings.model
        try:
            from models import default_model
            demo = default_model()
        except Exception:
            demo = None
        return str(demo) if demo else None

    def resolve_and_load(self) -> None:
        path = self.resolved_model()
        if path is None:
            self.loading = False
            self.engine_error = "no model configured"
            self.set_status("no model configured · Ctrl+P “Set up a model” · F5 settings")
            if self.setup_wizard:
                self.action_setup_wizard()
                return
            self.push_screen(MessageScreen("No model yet", NO_MODEL.format(config=settings_mod.config_path())))
            return
        self.loading = True
        self.set_status(f"loading {Path(path).name} …")
        self.load_engine(path)
        if self.setup_wizard:
            from .wizard import pending_setup
            if pending_setup() is not None:
                self.notify("an unfinished model setup can be resumed: Ctrl+P → “Set up a model”")

    def action_setup_wizard(self) -> None:
        """The guided path from nothing to a running model (resumes an unfinished setup)."""
        from .wizard import SetupWizard
        if not isinstance(self.screen, SetupWizard):
            self.push_screen(SetupWizard())

    def _open_options(self) -> dict:
        s = self.settings
        opts = dict(threads=s.threads, ram_gb=s.ram_gb, cap=None, policy=s.policy, prefetch=s.prefetch,
                    o_direct=s.o_direct, kv_cache=s.kv_cache)
        opts.update({k: v for k, v in self.engine_options.items() if v is not None and k != "prefix_cache"})
        if opts.get("cap") is not None and "ram_gb" not in self.engine_options:
            opts["ram_gb"] = None            # --cap on the command line beats a configured budget
        return opts

    def _from_thread(self, fn, *args) -> None:
        """Run fn on the UI from a background thread; nothing once the app has closed."""
        try:
            self.call_from_thread(fn, *args)
        except RuntimeError:          # the app is not running any more
            pass

    def load_engine(self, path: str) -> None:
        """Open the model in a daemon thread (quitting never waits for it); a later load wins."""
        self._load_seq = seq = getattr(self, "_load_seq", 0) + 1
        options = self._open_options()

        def load() -> None:
            from core.errors import ColiError
            try:
                from models import open_model
                engine = open_model(path, **options)
                engine.warm_experts()    # the model fits: its experts read now, in the background
            except ColiError as e:
                self._from_thread(self._engine_failed, path, str(e), seq)
                return
            except Exception as e:
                self._from_thread(self._engine_failed, path, f"{e.__class__.__name__}: {e}", seq)
                return
            self._from_thread(self._engine_loaded, engine, seq)
        threading.Thread(target=load, name="coli-load", daemon=True).start()

    def _engine_failed(self, path: str, error: str, seq: int | None = None) -> None:
        if seq is not None and seq != self._load_seq:
            return                    # an older load, superseded
        self.loading = False
        self.engine_error = error
        self.set_status(f"model not loaded: {error}")
        self.push_screen(MessageScreen("The model could not be opened", f"{path}\n\n{error}\n\n"
                                       "Pick another with Ctrl+P → “Set up a model”, fix the folder "
                                       "in F5 (settings), or run `coli chat --model DIR`."))

    def _engine_loaded(self, engine, seq: int | None = None) -> None:
        if seq is None:               # handed over directly (the wizard): loads under way lose
            self._load_seq = getattr(self, "_load_seq", 0) + 1
        elif seq != self._load_seq:
            return                    # an older load, superseded
        if self.server is not None:
            self.stop_server()       # its worker uses the engine that closes now
        old, self.engine = self.engine, engine
        if old is not None and old is not engine:
            for closer in (getattr(old.store, "close", None), getattr(old.container, "close", None)):
                try:
                    if closer is not None:
                        closer()
                except Exception:
                    pass
        self._engine_ready()

    @property
    def prefix_cache(self) -> bool:
        """Prompt-prefix reuse and saved chat caches: the setting, unless --no-prefix-cache."""
        return bool(self.settings.prefix_cache) and self.engine_options.get("prefix_cache") is not False

    def _engine_ready(self) -> None:
        self.loading = False
        self.engine_error = None
        e = self.engine
        e.prefix_cache = self.prefix_cache
        path = getattr(getattr(e, "container", None), "path", None)
        self.model_name = Path(path).name if path else "model"
        self.slot_bytes = getattr(getattr(e, "store", None), "slot_bytes", None)
        plan = getattr(e, "plan", None)
        budget = getattr(plan, "ram_expert_bytes", None)
        self.tier_panel.set_model(e.spec.num_layers, e.spec.num_experts, budget, getattr(e, "known_layers", ()))
        from .runner import snapshot
        placement, heat = snapshot(e)
        self.tier_panel.push(placement=placement, heat=heat, slot_bytes=self.slot_bytes)
        self.sub_title = one_line(self.model_name)
        self.set_status(f"{self.model_name} · ready · Enter sends, Shift+Enter or Ctrl+J newline, Esc stops")
        self.apply_server()

    # --- the app's server ----------------------------------------------------------------------
    SERVE_KEYS = ("serve", "serve_host", "serve_port", "serve_key")

    def apply_server(self, restart: bool = False) -> None:
        """Serve the loaded model when the settings say so (started, restarted, stopped)."""
        s = self.settings
        want = bool(s.serve) and self.engine is not None
        if self.server is not None and (restart or not want or self.server.state.engine is not self.engine):
            self.stop_server()
        if want and self.server is None:
            from core.errors import ColiError
            from .server.embedded import EmbeddedServer
            try:
                self.server = EmbeddedServer(self.engine, s.serve_host, s.serve_port, s.serve_key,
                                             lock=self.engine_lock)
            except ColiError as e:
                self.notify(f"the server did not start: {e}", severity="error")
            else:
                self.notify(f"serving {self.model_name} at {self.server.url}")
                if self._server_timer is None:
                    self._server_timer = self.set_interval(0.5, self._server_tick)
        self._server_tick()

    def stop_server(self) -> None:
        srv, self.server = self.server, None
        if srv is not None:
            srv.stop(timeout=3.0)
        self._server_tick()

    def _server_tick(self) -> None:
        try:
            self.tier_panel.set_server(self.server.info() if self.server is not None else None)
        except Exception:            # no chat screen (closing)
            pass

    # --- chats ---------------------------------------------------------------------------------
    def refresh_chat_list(self) -> None:
        lv = self._q_live("#chat-list", ListView)
        if lv is None:
            return
        chats = [(c.id, c.title) for c in self.history.chats()]
        shown = [(it.chat_id, it.title) for it in lv.children if isinstance(it, ChatItem)]
        if chats != shown:     # else no rebuild: it lays out the screen again, and a send does it
            lv.clear()
            lv.extend(ChatItem(i, title) for i, title in chats)
        self.call_after_refresh(self._select_current_chat)

    def _select_current_chat(self) -> None:
        lv = self._q_live("#chat-list", ListView)     # runs after a refresh: maybe closing by then
        if lv is None:
            return
        items = [it for it in lv.children if isinstance(it, ChatItem)]
        for i, it in enumerate(items):
            if it.chat_id == self.chat_id and lv.index != i:
                lv.index = i

    async def show_chat(self, chat_id: int) -> None:
        self.chat_id = chat_id
        view = self.messages_view
        await view.remove_children()
        msgs = self.history.messages(chat_id)
        widgets = []
        for m in msgs:
            if m.role == "user":
                widgets.append(UserMessage(m.content))
            elif m.role == "assistant":
                tt = m.stats.get("thinking_tokens")
                widgets.append(AssistantMessage(m.content, meta=fmt_meta(m.stats.get("stats"),
                                                                         m.stats.get("reason")),
                                                opened=m.stats.get("think_open") is True,
                                                think_tokens=tt if isinstance(tt, int) else None))
        if self.gen is not None and self.gen.chat_id == chat_id:
            # the reply streaming in this chat: a fresh widget picks up the text so far
            self.gen.widget = AssistantMessage(self.gen.text, streaming=True, opened=self.gen.think_open,
                                               count_tokens=self.count_tokens)
            widgets.append(self.gen.widget)
        elif self.gen is not None:
            self.gen.widget = None
        if not widgets:
            widgets.append(Static("Say something. Enter sends · Shift+Enter / Ctrl+J newline · "
                                  "Esc stops · F2 tier panel · Ctrl+P commands · "
                                  "Alt+↑/↓ or a click selects a message: c copies it, y its code",
                                  id="empty"))
        await view.mount_all(widgets)
        view.scroll_end(animate=False)
        chat = self.history.get(chat_id)
        if chat:
            self.show_title(chat.title)
        self._select_current_chat()
        self.show_notices(self.history.notices)        # damaged rows: skipped, each said once

    @on(ListView.Selected, "#chat-list")
    async def _chat_selected(self, event: ListView.Selected) -> None:
        overlay = self.chat_screen.close_overlays()
        if isinstance(event.item, ChatItem) and event.item.chat_id != self.chat_id:
            await self.show_chat(event.item.chat_id)
            self.prompt_input.focus()
        elif overlay:
            self.prompt_input.focus()

    def action_about(self) -> None:
        from .about import about_text
        self.push_screen(MessageScreen("About colibrì", about_text(self.resolved_model())))   # the demo too

    async def action_new_chat(self) -> None:
        chat = self.history.new_chat(sampling=self.settings.sampling)
        self.chat_id = chat.id
        self.refresh_chat_list()
        await self.show_chat(chat.id)
        self.prompt_input.focus()

    def action_rename_chat(self) -> None:
        chat = self.history.get(self.chat_id)
        if chat is None:
            return

        def done(title: str | None) -> None:
            if title is not None and title.strip():
                self.history.rename(chat.id, title)
                self.refresh_chat_list()
                self.show_title(self.history.get(chat.id).title)
        self.push_screen(TextPrompt("Rename chat", chat.title), done)

    def action_delete_chat(self) -> None:
        chat = self.history.get(self.chat_id)
        if chat is None:
            return
        if self.gen is not None and self.gen.chat_id == chat.id:
            self.notify("a reply is streaming in this chat: Esc stops it first", severity="warning")
            return

        async def done(yes: bool) -> None:
            if not yes:
                return
            self.history.delete(chat.id)
            self.sessions.delete(chat.id)
            rest = self.history.chats()
            nxt = rest[0] if rest else self.history.new_chat(sampling=self.settings.sampling)
            self.chat_id = nxt.id
            self.refresh_chat_list()
            await self.show_chat(nxt.id)
        self.push_screen(ConfirmScreen(f"Delete “{chat.title}”?"), done)

    def action_export_chat(self) -> Path | None:
        chat = self.history.get(self.chat_id)
        if chat is None:
            return None
        from core.errors import ColiError
        from core.fileio import atomic_write_text
        path = export_path(chat)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # the file gets cat'ed in terminals too: controls made visible, as on screen
            atomic_write_text(path, visible(self.history.export_markdown(chat.id)))
        except (OSError, ColiError) as e:
            self.notify(f"export failed: {e}", severity="error")
            return None
        self.notify(f"chat exported to {path}", title="Export", timeout=12)
        self.set_status(f"exported to {path}")
        return path

    def action_chat_settings(self) -> None:
        chat = self.history.get(self.chat_id)
        if chat is None:
            return

        def done(result) -> None:
            if result is not None:
                system, sampling = result
                self.history.update_chat(chat.id, system_prompt=system, sampling=sampling)
                self.notify("chat settings saved")
        self.push_screen(ChatSettingsScreen(chat.title, chat.system_prompt, chat.sampling), done)

    def action_settings(self) -> None:
        def done(new: Settings | None) -> None:
            if new is None:
                return
            old = self.settings
            try:
                path = settings_mod.save(new)
            except OSError as e:
                self.notify(f"settings not saved: {e}", severity="error")
                return
            self.settings = new
            self.sessions.budget_bytes = int(new.session_cache_gb * 1e9)
            if self.engine is not None:
                self.engine.prefix_cache = self.prefix_cache
                if not self.prefix_cache:
                    self.engine.prefixes.clear()       # off: nothing kept in memory either
            self.show_notices(new.notices)              # a damaged config moved aside: where
            if new.model != old.model:
                self.model_path = None           # a model chosen here beats --model from the start
            self.notify(f"settings saved to {path}")
            keys = ("model",) + settings_mod.ENGINE_KEYS
            if any(getattr(old, k) != getattr(new, k) for k in keys) or self.engine is None:
                if self.gen is not None or self.engine_busy():
                    self.notify("the engine reopens after this reply", severity="warning")
                    self._reopen_after = True
                else:
                    self.resolve_and_load()      # the server follows the new engine (_engine_ready)
            elif any(getattr(old, k) != getattr(new, k) for k in self.SERVE_KEYS):
                self.apply_server(restart=True)
        self.push_screen(SettingsScreen(self.settings, str(settings_mod.config_path()), self.sessions), done)

    @property
    def chat_screen(self) -> ChatScreen:
        return self.screen_stack[0]

    def action_toggle_panel(self) -> None:
        self.chat_screen.toggle_side("#tiers", "-narrow-tiers")

    def action_toggle_chats(self) -> None:
        screen = self.chat_screen
        screen.toggle_side("#chats", "-narrow-chats")
        chats = screen.query_one("#chats")
        if chats.has_class("-open"):                 # an overlay: the keys go to the list
            screen.query_one("#chat-list").focus()
        elif self.screen.focused is None or not self.screen.focused.is_attached:
            self.prompt_input.focus()

    async def action_switch_chat(self, delta: int) -> None:
        """The next (delta > 0) or previous chat of the list, wrapping around."""
        ids = [c.id for c in self.history.chats()]
        if not ids:
            return
        i = ids.index(self.chat_id) if self.chat_id in ids else -delta
        target = ids[(i + delta) % len(ids)]
        if target != self.chat_id:
            await self.show_chat(target)
            chat = self.history.get(target)
            self.set_status(f"chat {ids.index(target) + 1} of {len(ids)} · {chat.title if chat else ''}"
                            " · Ctrl+PgUp/PgDn switches")

    COPY_FILE = "copied.txt"

    def copy_to_clipboard(self, text: str) -> None:
        """Textual's OSC 52 (the terminal may ignore it, silently) and the system's clipboard
        tool where one reaches a clipboard (colibri_tui.clipboard)."""
        from . import clipboard
        super().copy_to_clipboard(text)
        self.copied_with = clipboard.system_copy(text)

    def copy_out(self, text: str, what: str) -> Path | None:
        """Copy ``text`` and say truthfully where it went: the system clipboard, or the terminal
        (OSC 52, unconfirmed) plus a file; returns the file when one was written."""
        self.copied_with = None
        self.copy_to_clipboard(text)
        tool = getattr(self, "copied_with", None)
        if tool:
            self.notify(f"{what} copied to the clipboard ({tool})")
            return None
        from core.errors import ColiError
        from core.fileio import atomic_write_text
        path = settings_mod.export_dir() / self.COPY_FILE
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, text)
        except (OSError, ColiError) as e:
            self.notify(f"{what} sent to the terminal's clipboard (OSC 52), which this terminal may "
                        f"ignore; no clipboard tool here, and {path} could not be written: {e}",
                        severity="warning", timeout=12)
            return None
        self.notify(f"{what} sent to the terminal's clipboard (OSC 52), which this terminal may ignore; "
                    f"no clipboard tool here (xclip, xsel, wl-copy), so it is also in {path}",
                    severity="warning", timeout=12)
        return path

    def action_copy_reply(self) -> None:
        msgs = [m for m in self.history.messages(self.chat_id)] if self.chat_id else []
        last = next((m for m in reversed(msgs) if m.role == "assistant"), None)
        if last is None:
            self.notify("no reply to copy", severity="warning")
            return
        self.copy_out(visible(last.content), "last reply")      # as shown: no raw controls

    def action_copy_code(self) -> None:
        msgs = self.history.messages(self.chat_id) if self.chat_id else []
        for m in reversed(msgs):
            blocks = code_blocks(m.content) if m.role == "assistant" else []
            if blocks:
                self.copy_out(visible(blocks[-1]), "code block")
                return
        self.notify("no code block to copy", severity="warning")

    # --- selecting messages (to copy them) ---------------------------------------------------
    def chat_messages(self) -> list[UserMessage | AssistantMessage]:
        return [w for w in self.messages_view.children if isinstance(w, (UserMessage, AssistantMessage))]

    def selected_message(self) -> UserMessage | AssistantMessage | None:
        """The message that has the focus on the chat screen, if any."""
        if not self.screen_stack:
            return None
        focused = self.screen_stack[0].focused
        return focused if isinstance(focused, (UserMessage, AssistantMessage)) else None

    def action_select_message(self, delta: int) -> None:
        """Move the selection ``delta`` messages up (<0) or down (>0). From the prompt, up selects
        the last message; down past the last message gives the focus back to the prompt."""
        items = self.chat_messages()
        current = self.selected_message()
        if current in items:
            i = items.index(current) + delta
        elif delta < 0 and items:
            i = len(items) - 1
        else:
            return
        if i >= len(items):
            self.focus_prompt()
            return
        view = self.messages_view
        view.release_anchor()                # a reply streaming meanwhile must not scroll away
        target = items[max(i, 0)]
        target.focus(scroll_visible=False)
        view.scroll_to_widget(target, animate=False, top=target.outer_size.height > view.size.height)

    def action_focus_prompt(self) -> None:
        self.focus_prompt()

    def focus_prompt(self) -> None:
        self.prompt_input.focus()
        self.messages_view.scroll_end(animate=False)     # and follow the bottom again

    def watch_theme(self, theme: str) -> None:
        """The palette's theme switcher: remember the choice."""
        if getattr(self, "_theme_ready", False) and theme != self.settings.theme:
            self.settings.theme = theme
            try:
                settings_mod.save(self.settings)
            except OSError:
                pass

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Set up a model", "Download, convert and verify a model, or pick a folder "
                            "(resumes an unfinished setup)", self.action_setup_wizard)
        yield SystemCommand("New chat", "Start a new conversation (Ctrl+N)", self.action_new_chat)
        yield SystemCommand("About", "Version, model, and where the log, config and chats live (F1)",
                            self.action_about)
        yield SystemCommand("Stop reply", "Stop the reply being generated (Esc)", self.action_stop_reply)
        yield SystemCommand("Toggle tier panel", "Show or hide the tier panel and Brain map (F2)",
                            self.action_toggle_panel)
        yield SystemCommand("Toggle chat list", "Show or hide the list of chats (F3)", self.action_toggle_chats)
        yield SystemCommand("Next chat", "Open the next chat of the list (Ctrl+PgDn or Alt+PgDn)",
                            lambda: self.run_action("switch_chat(1)"))
        yield SystemCommand("Previous chat", "Open the previous chat of the list (Ctrl+PgUp or Alt+PgUp)",
                            lambda: self.run_action("switch_chat(-1)"))
        yield SystemCommand("Export chat to Markdown", "Write this chat as a .md file (F7)",
                            self.action_export_chat)
        yield SystemCommand("Rename chat", "Give this chat a new title (F6)", self.action_rename_chat)
        yield SystemCommand("Delete chat", "Delete this chat (F8)", self.action_delete_chat)
        yield SystemCommand("Chat settings", "System prompt and sampling for this chat (F4)",
                            self.action_chat_settings)
        yield SystemCommand("Settings", "RAM budget, cache policy, prefetch, threads, O_DIRECT, sampling (F5)",
                            self.action_settings)
        yield SystemCommand("Copy last reply", "Copy the last assistant message to the clipboard",
                            self.action_copy_reply)
        yield SystemCommand("Copy last code block", "Copy the last code block of a reply to the clipboard",
                            self.action_copy_code)
        yield SystemCommand("Select a message", "Alt+↑/Alt+↓ (or a click) selects a message: c copies it, "
                            "y copies its code blocks in turn, Esc goes back to the prompt",
                            lambda: self.action_select_message(-1))

    # --- sending and streaming -----------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def _submitted(self, event: PromptInput.Submitted) -> None:
        await self.send(event.text)

    async def send(self, text: str) -> bool:
        """Start a reply. On any refusal the prompt stays in the input."""
        if not text.strip():
            return False
        if self.gen is not None:
            self.notify("a reply is still streaming: Esc stops it", severity="warning")
            return False
        if self.engine_busy():
            self.notify("the model is still stopping the last reply: Enter again in a moment",
                        severity="warning")
            return False
        if self.engine is None:
            self.notify("the model is still loading" if self.loading else
                        f"no model: {self.engine_error or 'not loaded'} · set one up with Ctrl+P → "
                        "“Set up a model” (download, convert, or a folder you have)", severity="error")
            return False
        chat = self.history.get(self.chat_id)
        if chat is None:
            return False
        try:
            from core.sampling import SamplingParams
            s = chat.sampling
            params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed)
        except ValueError as e:
            self.notify(f"chat settings: {e}", severity="error")
            return False
        first = not self.history.messages(chat.id)
        msg_id = self.history.add_message(chat.id, "user", text)
        if first and chat.title in ("New chat", "Untitled"):
            self.history.rename(chat.id, title_from(text))
            self.show_title(self.history.get(chat.id).title)
        messages = self.history.engine_messages(chat.id)
        view = self.messages_view
        for w in view.query("#empty"):
            w.remove()
        think_open = self.prompt_opens_think(messages)
        widget = AssistantMessage("", streaming=True, opened=think_open, count_tokens=self.count_tokens)
        self.prompt_input.clear()
        await view.mount_all([UserMessage(text), widget])
        view.scroll_end(animate=False)
        self.gen = Generation(chat.id, text, msg_id, widget, think_open=think_open)
        self.tier_panel.reset()
        self.refresh_chat_list()
        self.set_status(f"{self.model_name} · generating · Esc stops")
        self.generate(self.gen, messages, params, s.max_new_tokens)
        return True

    def generate(self, gen: Generation, messages: list[dict], params, max_new_tokens: int) -> None:
        """Run the reply in a daemon thread, not a Textual thread worker: the app's executor is
        joined when the app exits, and quitting must never wait for a prefill to finish."""
        from .runner import run_generation
        engine = self.engine

        def post(batch: dict) -> None:
            # thread-safe and non-blocking: the engine never waits for the UI to paint
            gen.applied.clear()
            self.post_message(BatchReady(gen, batch))

        reuse, sessions = self.prefix_cache, self.sessions

        def warn(text: str) -> None:
            self._from_thread(self.show_notices, [text])

        def save(reason: str) -> None:
            # the chat's cache as this turn left it, before the final batch lets the next turn start
            if not reuse or sessions.budget_bytes <= 0 or not hasattr(engine, "prefixes"):
                return
            try:
                sessions.save(engine, gen.chat_id)
            except OSError as e:
                warn(f"the chat's cache could not be saved ({e.strerror or e}): reopening the app "
                     f"computes the conversation again")

        lock = self.engine_lock
        if lock.locked():
            self.set_status(f"{self.model_name} · waiting for the server's request · Esc stops")

        def run() -> None:
            with lock:               # the app's server generates on this engine too
                gen.holding = True
                try:
                    turn()
                finally:
                    gen.holding = False

        def turn() -> None:
            if reuse and not gen.cancel and hasattr(engine, "prefixes"):
                # a saved cache of this chat (an earlier session): into the engine's pool if it
                # gives more of the prompt than memory has
                try:
                    restored = sessions.restore(engine, gen.chat_id, engine.prompt_ids(messages))
                except Exception as e:             # the prompt itself is refused: generate says so
                    restored = None
                    from .paths import logger
                    logger("app").info("saved cache not restored: %s", e)
                if restored is not None and restored.warning:
                    warn(restored.warning)
            run_generation(engine, messages, params, max_new_tokens, post, cancelled=lambda: gen.cancel,
                           ready=lambda: gen.applied.is_set() and gen.paint.due(), after=save)
        gen.thread = threading.Thread(target=run, name="coli-generate", daemon=True)
        gen.thread.start()

    async def on_batch_ready(self, message: "BatchReady") -> None:
        try:
            await self._apply_batch(message.gen, message.batch)
        finally:
            message.gen.paint.applied()
            message.gen.applied.set()

    def engine_busy(self) -> bool:
        """A reply stopped by Esc whose thread has not ended yet (it ends at the engine's next
        check, within a layer): the engine must not start another meanwhile."""
        st = self.stopping
        return st is not None and st.thread is not None and st.thread.is_alive()

    async def _apply_batch(self, gen: Generation, batch: dict) -> None:
        if not self.is_running or not self.screen_stack:
            return
        if gen.detached:                 # Esc already ended this turn in the UI
            if batch["final"] and self.stopping is gen:
                self.stopping = None
                if getattr(self, "_reopen_after", False):
                    self._reopen_after = False
                    self.resolve_and_load()
            return
        gen.text += batch["text"]
        if gen.widget is not None and gen.widget.is_attached and len(gen.widget.content) < len(gen.text):
            await gen.widget.append(gen.text[len(gen.widget.content):], tokens=batch["tokens"])
        gen.tokens += batch["tokens"]
        now = time.monotonic()
        if batch["final"] or now - gen.panel_at >= self.PANEL_INTERVAL:
            gen.panel_at = now
            self.tier_panel.push(stats=batch["stats"], rate=batch["rate"], placement=batch["placement"],
                                 heat=batch["heat"], routed=batch["routed"], slot_bytes=self.slot_bytes)
        if not batch["final"]:
            n = (batch["stats"] or {}).get("new_tokens", gen.tokens)
            self.set_status(f"{self.model_name} · generating · {n} tokens · Esc stops")
            return
        await self._finish(gen, batch)

    async def _finish(self, gen: Generation, batch: dict) -> None:
        error, reason, stats = batch["error"], batch["reason"], batch["stats"]
        self.gen = None
        if error and not gen.text:
            # nothing came back: undo the turn and give the prompt back
            await self._undo_turn(gen)
            self.notify(f"generation failed: {error}", severity="error")
            self.set_status(f"{self.model_name} · error: {error}")
            return
        if reason == "cancelled" and not gen.text:
            # stopped before the first word (e.g. during a long prefill): undo the turn, keep the prompt
            self.set_status(f"{self.model_name} · stopped before the reply began · the prompt is back")
            await self._undo_turn(gen)
            return
        meta = fmt_meta(stats, reason)
        if error:
            meta += f" · error: {error}"
        self.history.add_message(gen.chat_id, "assistant", gen.text,
                                 {"stats": stats, "reason": reason, **self.thinking_stats(gen)})
        if gen.widget is not None and gen.widget.is_attached:
            await gen.widget.finish(meta)
        self.refresh_chat_list()
        self.set_status(f"{self.model_name} · {'stopped' if reason == 'cancelled' else 'ready'} · {meta}")
        if getattr(self, "_reopen_after", False):
            self._reopen_after = False
            self.resolve_and_load()

    def prompt_opens_think(self, messages: list[dict]) -> bool:
        """Whether the model's chat template ends this prompt inside a think block (Qwen3 /
        Qwen3.6 with thinking on): the reply then starts as thinking."""
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None or not getattr(tok, "has_chat_template", False):
            return False
        try:
            return prompt_opens_think(tok.apply_chat_template(messages, add_generation_prompt=True))
        except Exception:                # a refused prompt: generate says so
            return False

    def count_tokens(self, text: str) -> int | None:
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            return None
        return len(tok.encode(visible(text), add_special_tokens=False))

    def thinking_stats(self, gen: Generation) -> dict:
        """What the saved reply keeps about its thinking (the text itself stays raw)."""
        thinking, _, _ = split_think(gen.text, gen.think_open)
        out = {"think_open": True} if gen.think_open else {}
        if thinking is not None:
            n = gen.widget.think_tokens if gen.widget is not None else None
            if n is None:
                try:
                    n = self.count_tokens(thinking)
                except Exception:
                    n = None
            if n is not None:
                out["thinking_tokens"] = int(n)
        return out

    async def _undo_turn(self, gen: Generation) -> None:
        """Nothing came back: the user's message leaves the chat and returns to the prompt."""
        self.history.delete_message(gen.user_message_id)
        if not self.prompt_input.text.strip():
            self.prompt_input.text = gen.prompt
        if gen.widget is not None and gen.widget.is_attached:
            if self.chat_id == gen.chat_id:
                await self.show_chat(gen.chat_id)

    def action_stop_reply(self) -> None:
        if self.gen is None:
            if self.screen_stack and self.chat_screen.close_overlays():      # Esc closes an overlay
                self.prompt_input.focus()
            return
        gen = self.gen
        gen.cancel = True
        if self.engine is not None and gen.holding:      # never the server's request
            self.engine.cancel()
        if gen.text:                     # a reply under way: its final batch keeps what came
            self.set_status(f"{self.model_name} · stopping …")
            return
        # nothing came yet (a prefill, say): the turn ends here and now, whatever the engine is
        # in the middle of; its thread ends at the next check and its last batch is dropped
        gen.detached, self.gen, self.stopping = True, None, gen
        self.set_status(f"{self.model_name} · stopped before the reply began · the prompt is back")
        self.history.delete_message(gen.user_message_id)
        if not self.prompt_input.text.strip():
            self.prompt_input.text = gen.prompt
        if self.chat_id == gen.chat_id:
            self.call_next(self.show_chat, gen.chat_id)

    def on_unmount(self) -> None:
        if self.server is not None:
            try:
                self.server.stop(timeout=2.0)
            except Exception:
                pass
            self.server = None
        gen = self.gen
        if gen is not None:
            gen.cancel = True
            if self.engine is not None and gen.holding:
                self.engine.cancel()
            if gen.text:             # closing mid-reply: keep what came so far
                try:
                    self.history.add_message(gen.chat_id, "assistant", gen.text, {"reason": "interrupted"})
                except Exception:
                    pass
        try:
            self.history.close()
        except Exception:
            pass


def main(model: str | None = None) -> int:
    ColiApp(model_path=model).run()
    return 0
