"""The chat app under release conditions: a long prefill that Esc and Ctrl+Q must cut short,
untrusted text (control bytes, markup) from the model and from saved chats, the clipboard
fallback, the export location, next/previous-chat keys. Real app (Textual Pilot), real models."""
from __future__ import annotations

import asyncio
import gc
import json
import shutil
import time
from pathlib import Path

import pytest

from tests.conftest import tiny_app_container, wait_for

pytest.importorskip("textual")

DEMO = Path(__file__).resolve().parent.parent / "models" / "demo" / "qwen3-moe-demo"
# the bound: Esc and Ctrl+Q take effect within this while a prompt is prefilled
RESPONSE_S = 0.3


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """The demo model's geometry and tokenizer with 96 random-weight layers: a ~1000-token
    history takes seconds to prefill, one layer a few tens of milliseconds."""
    from core.synthetic import write_random_container
    from models import family_for
    cfg = json.loads((DEMO / "config.json").read_text())
    cfg.update(num_hidden_layers=96, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
               max_position_embeddings=4096, eos_token_id=[cfg["vocab_size"] + 50])  # eos never sampled
    out = tmp_path_factory.mktemp("slow") / "slow-moe"
    write_random_container(out, cfg, family_for(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO / f, out / f)
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return tiny_app_container(tmp_path_factory.mktemp("app"), "c", unreachable_eos=True)


def make_app(model, max_new_tokens=24, **kw):
    from colibri_tui.app import ColiApp
    from colibri_tui.settings import Sampling, Settings
    s = Settings(sampling=Sampling(max_new_tokens=max_new_tokens, seed=1))
    return ColiApp(model_path=model, settings=s, engine_options={"threads": 1}, **kw)


LONG_TURN = " ".join(["The quick brown fox jumps over the lazy dog and keeps running."] * 11)


def send_key(app, key: str) -> None:
    """A key from the terminal, as Pilot sends it, without Pilot's wait for an idle process
    (a prefill keeps the process busy, so that wait would measure itself)."""
    from textual import events
    app._driver.send_message(events.Key(key, None))


async def start_long_prefill(pilot) -> int:
    """A chat whose history is ~1000 tokens; send one more prompt and wait until its prefill
    is under way. Returns the number of prompt tokens."""
    app = pilot.app
    await wait_for(pilot, lambda: app.engine is not None, timeout=60)
    chat = app.history.new_chat(sampling=app.settings.sampling)
    for i in range(3):
        app.history.add_message(chat.id, "user", LONG_TURN)
        app.history.add_message(chat.id, "assistant", LONG_TURN)
    await app.show_chat(chat.id)
    n = len(app.engine.prompt_ids(app.history.engine_messages(chat.id) + [{"role": "user", "content": "go"}]))
    app.prompt_input.text = "go"
    app.prompt_input.focus()
    await pilot.press("enter")
    # some layers done, the first token far away
    await wait_for(pilot, lambda: app.engine.counters["experts_s"] > 0.2, timeout=30)
    assert app.gen is not None and app.gen.tokens == 0
    return n


def test_escape_stops_a_long_prefill_at_once(slow_model, dirs):
    async def run():
        app = make_app(slow_model)
        async with app.run_test(size=(120, 40)) as pilot:
            n = await start_long_prefill(pilot)
            assert n > 900
            chat = app.chat_id
            gc.collect()          # earlier tests' garbage: not this app's to collect in the window
            t0 = time.monotonic()
            send_key(app, "escape")
            await wait_for(pilot, lambda: app.gen is None and app.prompt_input.text == "go", timeout=30)
            took = time.monotonic() - t0
            print(f"Esc during a {n}-token prefill: stopped in {took:.3f} s")
            assert took <= RESPONSE_S, f"Esc took {took:.2f} s during prefill"
            # nothing came back: the turn is undone and the prompt is back in the input
            assert [m.content for m in app.history.messages(chat)][-1] == LONG_TURN
            assert "stopped" in str(app.screen.query_one("#status").render())
            # the engine itself stops within a few layers (its prefill had seconds to go), and
            # only then can the next reply start
            await wait_for(pilot, lambda: app.stopping is None, timeout=60)
            engine_took = time.monotonic() - t0
            print(f"  the engine's thread ended {engine_took:.3f} s after Esc")
            assert engine_took < 2.0 and not app.engine_busy()
            assert [m.content for m in app.history.messages(chat)][-1] == LONG_TURN   # nothing added
            assert app.engine.counters["experts_s"] > 0 and app.gen is None
    asyncio.run(run())


def test_ctrl_q_quits_during_a_long_prefill_at_once(slow_model, dirs):
    pressed = {}

    async def run():
        app = make_app(slow_model)
        async with app.run_test(size=(120, 40)) as pilot:
            await start_long_prefill(pilot)
            gc.collect()
            pressed["t"] = time.monotonic()
            send_key(app, "ctrl+q")
            while app.is_running and time.monotonic() - pressed["t"] < 30:
                await asyncio.sleep(0.01)
        return app

    app = asyncio.run(run())          # also waits for the event loop's executor threads
    took = time.monotonic() - pressed["t"]
    print(f"Ctrl+Q during prefill: app exited in {took:.3f} s")
    assert took <= RESPONSE_S, f"Ctrl+Q took {took:.2f} s during prefill"
    assert not app.is_running


# every C0 control, DEL, every C1 control, then: clear screen (CSI), set the window title and
# write the clipboard (OSC), a reset (ESC c) and Rich markup
EVIL = ("".join(chr(c) for c in range(0x20)) + "\x7f" + "".join(chr(c) for c in range(0x80, 0xA0))
        + "\x1b[2J\x1b[H\x1b]0;pwned\x07\x1b]52;c;aGk=\x1b\\\x1bc [bold]markup[/bold] [/]")


def terminal_controls(app) -> set[str]:
    """Control characters in what the app would write to the terminal as cell text."""
    bad = set()
    for strip in app.screen._compositor.render_strips():
        for seg in strip:
            bad.update(f"{ord(ch):#04x}" for ch in seg.text if ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0)
    return bad


def screen_text(app) -> str:
    return "\n".join("".join(seg.text for seg in strip) for strip in app.screen._compositor.render_strips())


def test_visible_maps_every_control():
    from colibri_tui.safetext import one_line, safe_markup, visible
    out = visible(EVIL)
    assert len(out) == len(EVIL)                     # one for one (streaming compares lengths)
    assert not [c for c in out if ord(c) < 0x20 and c not in "\n\t" or 0x7F <= ord(c) < 0xA0]
    assert "␛[2J" in out and "␇" in out and "␎" in out and "\u2421" in out and "\n" in out and "\t" in out
    assert "\n" not in one_line("a\nb\tc") and safe_markup("[bold]x") == "\\[bold]x"
    assert visible("plain text, ünïcode ✓") == "plain text, ünïcode ✓"


def test_untrusted_text_never_reaches_the_terminal(tiny_model, dirs, monkeypatch):
    from colibri_tui.chatview import AssistantMessage
    monkeypatch.setenv("COLI_EXPORT_DIR", str(dirs / "exports"))
    for var in ("DISPLAY", "WAYLAND_DISPLAY"):            # no clipboard tool: copies go to a file
        monkeypatch.delenv(var, raising=False)

    async def run():
        app = make_app(tiny_model)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None)
            chat = app.history.new_chat(title="title " + EVIL)
            app.history.add_message(chat.id, "user", "question " + EVIL)
            app.history.add_message(chat.id, "assistant", "<think>" + EVIL + "</think>answer " + EVIL,
                                    {"stats": {"new_tokens": 1}, "reason": EVIL})
            app.refresh_chat_list()
            await app.show_chat(chat.id)       # a saved chat holding \x1b[2J, opened
            await pilot.pause(0.3)
            assert terminal_controls(app) == set()
            text = screen_text(app)
            assert "␛[2J" in text and "question" in text and "answer" in text
            assert "␛" in app.title and "\x1b" not in app.title
            # a reply streaming control bytes
            view = app.messages_view
            w = AssistantMessage("", streaming=True)
            await view.mount(w)
            for piece in ("streamed ", EVIL[:40], EVIL[40:], " end"):
                await w.append(piece)
            await w.finish(EVIL)
            await pilot.pause(0.3)
            assert terminal_controls(app) == set()
            # toasts: controls and markup as plain text
            app.notify("toast " + EVIL, title=EVIL)
            await pilot.pause(0.3)
            assert terminal_controls(app) == set()
            assert "[bold]markup[/bold]" in screen_text(app)
            app.set_status("status " + EVIL)
            await pilot.pause()
            assert terminal_controls(app) == set()
            # dialogs quoting the title (rename, delete)
            await pilot.press("f6")
            await pilot.pause()
            assert terminal_controls(app) == set()
            await pilot.press("escape", "f8")
            await pilot.pause()
            assert terminal_controls(app) == set() and "[bold]markup[/bold]" in screen_text(app)
            await pilot.press("escape")
            # the export file: controls made visible too
            path = app.action_export_chat()
            body = path.read_text()
            assert path.parent == dirs / "exports" and "␛[2J" in body and "\x1b" not in body
            # and a copy (no clipboard tool here: saved to a file) carries no raw control either
            app.action_copy_reply()
            copied = (dirs / "exports" / "copied.txt").read_text()
            assert "answer ␀␁" in copied and "␛[2J" in copied and "\x1b" not in copied
    asyncio.run(run())


def test_next_and_previous_chat_keys_work_from_anywhere(tiny_model, dirs):
    async def run():
        app = make_app(tiny_model)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None)
            for title in ("third", "second"):
                c = app.history.new_chat(title)
                app.history.add_message(c.id, "user", f"hello {title}")
            order = [c.id for c in app.history.chats()]           # the chat list's order
            await app.show_chat(order[0])
            await pilot.press("ctrl+pagedown")
            assert app.chat_id == order[1]
            await pilot.press("alt+up")                            # a message has the focus now
            assert app.selected_message() is not None
            await pilot.press("ctrl+pagedown")
            assert app.chat_id == order[2]
            await pilot.press("ctrl+pagedown")                     # wraps around
            assert app.chat_id == order[0]
            await pilot.press("ctrl+pageup", "alt+pageup")
            assert app.chat_id == order[1]
            app.query_one("#chat-list").focus()
            await pilot.press("alt+pagedown")
            assert app.chat_id == order[2]
            assert app.prompt_input.text == ""                     # no key leaked into the prompt
            names = {c.title for c in app.get_system_commands(app.screen)}
            assert {"Next chat", "Previous chat"} <= names
    asyncio.run(run())


def test_no_model_toast_points_to_the_setup_wizard(dirs):
    from colibri_tui.app import ColiApp
    from colibri_tui.screens import MessageScreen
    from colibri_tui.settings import Settings

    async def run():
        app = ColiApp(settings=Settings())
        app.resolved_model = lambda: None
        notes = []
        orig = app.notify
        app.notify = lambda msg, **kw: (notes.append(msg), orig(msg, **kw))[1]
        async with app.run_test() as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, MessageScreen))
            await pilot.press("escape")
            app.prompt_input.text = "hello"
            await pilot.press("enter")
            await pilot.pause()
            assert "Set up a model" in notes[-1] and "F5" not in notes[-1]
            assert app.prompt_input.text == "hello"
    asyncio.run(run())


def test_copy_says_where_the_text_went(tiny_model, dirs, monkeypatch):
    """Without a clipboard tool the toast says the copy went to the terminal (OSC 52, which it
    may ignore) and to a file; with one (a stand-in xclip on PATH, DISPLAY set) the text goes
    through it."""
    bin_dir = dirs / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))                 # no real clipboard tool
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.setenv("COLI_EXPORT_DIR", str(dirs / "exports"))
    reply = "the answer\n```\ncode ✓\n```"

    async def run():
        app = make_app(tiny_model)
        notes = []
        orig = app.notify
        app.notify = lambda msg, **kw: (notes.append(msg), orig(msg, **kw))[1]
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            chat = app.history.new_chat()
            app.history.add_message(chat.id, "user", "q")
            app.history.add_message(chat.id, "assistant", reply)
            await app.show_chat(chat.id)
            app.action_copy_reply()
            saved = dirs / "exports" / "copied.txt"
            assert "copied to" not in notes[-1] and "OSC 52" in notes[-1] and str(saved) in notes[-1]
            assert saved.read_text() == reply
            # a clipboard tool in reach: it gets the text, and the toast names it
            got = dirs / "xclip-got"
            tool = bin_dir / "xclip"
            tool.write_text(f"#!/bin/sh\n[ \"$1 $2\" = \"-selection clipboard\" ] || exit 3\ncat > '{got}'\n")
            tool.chmod(0o755)
            monkeypatch.setenv("DISPLAY", ":99")
            monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
            await pilot.press("alt+up", "y")                      # the selected reply's code block
            assert notes[-1] == "code block copied to the clipboard (xclip)"
            assert got.read_text() == "code ✓"
    asyncio.run(run())


def test_a_later_model_load_wins_over_an_earlier_one(tiny_model, dirs):
    """Loads run in daemon threads (quitting never waits for one); when two overlap, the one
    asked for last decides, whichever finishes first."""
    from colibri_tui.screens import MessageScreen

    async def run():
        app = make_app(tiny_model)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None)
            old = app.engine
            app.load_engine(str(dirs / "not-a-model"))          # fails fast, but was superseded
            app.load_engine(str(tiny_model))
            await wait_for(pilot, lambda: app.engine is not old)
            await pilot.pause(0.3)
            assert not isinstance(app.screen, MessageScreen) and app.engine_error is None
    asyncio.run(run())
