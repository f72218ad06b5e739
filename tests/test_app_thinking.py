"""A model's thinking is shown folded, never as the answer (issue 18).

The stream splitting runs on real token streams: a real byte-level BPE tokenizer (trained here;
"<think>" and "</think>" are several tokens, so partial tags arrive) decoded by core.tokenizer's
StreamDecoder one token at a time, in both forms a reply takes: one that writes its own
<think>…</think>, and one that starts inside the think block the chat template opened (Qwen3.6's
real template, tests/templates/qwen3_6.jinja, ends the generation prompt with "<think>\\n"). The
app-level tests drive the real app under Pilot on a real tiny container carrying that template:
the app finds that the prompt opens a think block, and the batches the runner posts go through
the real send / apply / finish path into the widget and the history."""
from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import tiny_app_container, wait_for

pytest.importorskip("textual")
pytest.importorskip("tokenizers")

HERE = Path(__file__).parent
THINKING = "The user greets me. I should answer briefly, in Italian: ciao mondo."
ANSWER = "Ciao! **Hello world**, the quick brown fox.\n\n```python\nprint('ciao')\n```"
OWN = f"<think>\n{THINKING}\n</think>\n\n{ANSWER}"        # the model writes its own tags
OPENED = f"{THINKING}\n</think>\n\n{ANSWER}"               # the template opened the block


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from core.tokenizer import ChatTokenizer
    from tests.conftest import tokenizer_files
    d = tmp_path_factory.mktemp("tok")
    tokenizer_files(d, 300)
    return ChatTokenizer.from_dir(d)


def deltas(tok, text: str) -> list[str]:
    """The text as the engine streams it: one StreamDecoder delta per token."""
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    dec = tok.stream_decoder(skip_special_tokens=False)
    out = [dec.push(i) for i in ids]
    out.append(dec.flush())
    assert "".join(out) == text
    return out


@pytest.mark.parametrize("text,opened", [(OWN, False), (OPENED, True)])
def test_split_on_a_real_token_stream(tok, text, opened):
    from colibri_tui.thinking import split_think
    pieces = deltas(tok, text)
    assert len(pieces) > 30
    seen, shown_thinking = "", []
    for p in pieces:
        seen += p
        thinking, answer, open_ = split_think(seen, opened)
        # never a tag or a piece of one on screen, never thinking in the answer
        for part in (thinking or "", answer):
            assert "<" not in part.replace("</think>", "") or part is answer and "print" in part
            assert "<think>" not in part and "</think>" not in part
        assert answer == "" or ANSWER.startswith(answer)        # so no thinking in it either
        if thinking is not None:
            assert THINKING.startswith(thinking)
            shown_thinking.append(thinking)
        if open_:
            assert answer == ""
    assert split_think(seen, opened) == (THINKING, ANSWER, False)
    assert shown_thinking and shown_thinking[-1] == THINKING
    # thinking only grows while it streams (no flash of a partial tag)
    assert all(b.startswith(a) for a, b in zip(shown_thinking, shown_thinking[1:]))


def test_split_rules():
    from colibri_tui.history import strip_thinking
    from colibri_tui.thinking import prompt_opens_think, split_think
    assert split_think("abc", opened=True) == ("abc", "", True)
    assert split_think("abc</thi", opened=True) == ("abc", "", True)
    assert split_think("plain", opened=False) == (None, "plain", False)
    # a saved reply of the opened form reads back without the flag (as Qwen templates read it)
    assert split_think(OPENED) == (THINKING, ANSWER, False)
    assert strip_thinking(OPENED) == ANSWER.strip() and strip_thinking(OWN) == ANSWER.strip()
    assert strip_thinking("still thinking", opened=True) == ""
    assert strip_thinking("no thinking here") == "no thinking here"
    with open(HERE / "templates" / "qwen3_6.jinja", encoding="utf-8") as f:
        template = f.read()
    from core.tokenizer import compile_chat_template
    render = compile_chat_template(template).render
    msgs = [{"role": "user", "content": "ciao"}]
    assert prompt_opens_think(render(messages=msgs, add_generation_prompt=True))
    assert not prompt_opens_think(render(messages=msgs, add_generation_prompt=True, enable_thinking=False))


@pytest.mark.parametrize("text,opened", [(OWN, False), (OPENED, True)])
def test_widget_streams_thinking_folded(tok, text, opened):
    """The reply widget fed one token at a time: the thinking streams into a collapsed
    Collapsible whose title counts its tokens; the Markdown only ever holds the answer; t
    expands it; the copy is the answer; the raw text is kept."""
    from textual.app import App
    from textual.widgets import Collapsible

    from colibri_tui.chatview import AssistantMessage

    count = lambda s: len(tok.encode(s, add_special_tokens=False))      # noqa: E731
    pieces = deltas(tok, text)

    class OneMessage(App):
        def compose(self):
            yield AssistantMessage("", streaming=True, opened=opened, count_tokens=count)

    async def run():
        app = OneMessage()
        async with app.run_test() as pilot:
            m = app.query_one(AssistantMessage)
            titles = []
            for p in pieces:
                await m.append(p, tokens=1)
                await pilot.pause()
                assert THINKING[:12] not in m.markdown.source
                assert "think>" not in m.markdown.source
                if m.query(Collapsible):
                    c = m.query_one(Collapsible)
                    assert c.collapsed                      # folded while it streams, too
                    titles.append(c.title)
            assert any(t.startswith("Thinking… (") for t in titles)
            await m.finish("12 tokens")
            await pilot.pause()
            c = m.query_one(Collapsible)
            n = count(THINKING)
            assert c.title == f"Thinking ({n} tokens)" and m.think_tokens == n
            assert c.collapsed and m.markdown.source == ANSWER
            assert THINKING in str(c.query_one(".thinking").render())
            assert m.copy_text() == ANSWER and m.content == text
            m.focus()
            await pilot.press("t")
            await pilot.pause()
            assert not c.collapsed
            await pilot.press("t")
            await pilot.pause()
            assert c.collapsed
    asyncio.run(run())


@pytest.fixture(scope="module")
def think_container(tmp_path_factory):
    """The app's tiny container with Qwen3.6's real chat template as its chat_template.jinja."""
    c = Path(tiny_app_container(tmp_path_factory.mktemp("think"), "tiny-think"))
    shutil.copy(HERE / "templates" / "qwen3_6.jinja", c / "chat_template.jinja")
    return c


def make_app(container):
    from colibri_tui.app import ColiApp
    from colibri_tui.settings import Settings
    return ColiApp(model_path=container, settings=Settings(), engine_options={"cap": 3, "threads": 1})


def batches(tok, text: str, per: int = 3) -> list[dict]:
    """The batches run_generation posts for this reply (``per`` tokens each, then the final one)."""
    pieces = deltas(tok, text)
    out = []
    for i in range(0, len(pieces), per):
        chunk = pieces[i:i + per]
        out.append({"text": "".join(chunk), "tokens": len(chunk), "stats": None, "rate": None,
                    "placement": None, "heat": None, "routed": None, "final": False, "reason": None,
                    "error": None})
    out.append({**out[-1], "text": "", "tokens": 0, "final": True, "reason": "eos",
                "stats": {"new_tokens": len(pieces)}})
    return out


def test_app_shows_thinking_folded_and_saves_raw(think_container, dirs, tok):
    """The real app: Qwen3.6's template opens the think block, so the reply starts as thinking;
    the runner's batches stream into the folded block, the answer is the Markdown, the history
    keeps the raw text (and the next prompt gets the answer alone), a reopened chat folds it
    again with the stored token count."""
    from colibri_tui.app import BatchReady
    from colibri_tui.chatview import AssistantMessage
    from textual.widgets import Collapsible

    async def run():
        app = make_app(think_container)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None and not app.loading)
            posted = []

            def fake_generate(gen, messages, params, max_new_tokens):
                posted.append((gen, messages))
            app.generate = fake_generate            # the batches below stand in for the worker
            app.prompt_input.focus()
            app.prompt_input.text = "ciao"
            await pilot.press("enter")
            await wait_for(pilot, lambda: posted)
            gen, messages = posted[0]
            assert gen.think_open and gen.widget.opened      # found from the real template
            for b in batches(tok, OPENED):
                gen.applied.clear()
                app.post_message(BatchReady(gen, b))
                await wait_for(pilot, gen.applied.is_set)
                w = app.query(AssistantMessage).last()
                assert THINKING[:12] not in w.markdown.source
            await wait_for(pilot, lambda: app.gen is None)
            await pilot.pause()
            w = app.query(AssistantMessage).last()
            c = w.query_one(Collapsible)
            assert c.collapsed and c.title.startswith("Thinking (") and w.markdown.source == ANSWER
            saved = app.history.messages(app.chat_id)[-1]
            assert saved.content == OPENED and saved.stats["think_open"] is True
            assert saved.stats["thinking_tokens"] == w.think_tokens
            nxt = app.history.engine_messages(app.chat_id)
            assert nxt[-1] == {"role": "assistant", "content": ANSWER.strip()}
            await app.show_chat(app.chat_id)                 # reopened from the history
            await pilot.pause()
            w = app.query(AssistantMessage).last()
            c = w.query_one(Collapsible)
            assert c.collapsed and c.title == f"Thinking ({saved.stats['thinking_tokens']} tokens)"
            assert w.markdown.source == ANSWER
    asyncio.run(run())


def test_app_real_generation_starts_folded(think_container, dirs):
    """A real reply of the tiny model under Qwen3.6's template: no </think> ever comes, so all
    of it is thinking, folded; nothing shows as the answer."""
    from colibri_tui.chatview import AssistantMessage
    from textual.widgets import Collapsible

    async def run():
        app = make_app(think_container)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None and not app.loading)
            app.prompt_input.focus()
            app.prompt_input.text = "ciao"
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.gen is None and app.history.messages(app.chat_id)
                           and app.history.messages(app.chat_id)[-1].role == "assistant", 30)
            await pilot.pause()
            saved = app.history.messages(app.chat_id)[-1]
            w = app.query(AssistantMessage).last()
            if saved.content.strip() and "</think>" not in saved.content:
                assert w.query_one(Collapsible).collapsed and w.markdown.source == ""
            assert saved.stats.get("think_open") is True
    asyncio.run(run())


# --- snapshot ------------------------------------------------------------------------------------

@pytest.fixture
def snap_dirs(tmp_path, monkeypatch):
    from tests.test_snapshots import CONFIG_FILE
    monkeypatch.setenv("COLI_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("COLI_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for k in ("COLI_MODEL", "COLI_RAM_GB"):
        monkeypatch.delenv(k, raising=False)
    from colibri_tui import settings as settings_mod
    monkeypatch.setattr(settings_mod, "config_path", lambda: CONFIG_FILE)
    return tmp_path


def test_snapshot_thinking_folded(snap_dirs, snap_compare, tmp_path_factory):
    """A chat with two thinking replies from the history: the first folded ("Thinking (N
    tokens)"), the second expanded with t; the answers as Markdown. A container of its own: the
    other tests' replies leave usage behind in theirs, which the Brain map would show."""
    pytest.importorskip("pytest_textual_snapshot")
    think_container = Path(tiny_app_container(tmp_path_factory.mktemp("think-snap"), "tiny-think"))
    shutil.copy(HERE / "templates" / "qwen3_6.jinja", think_container / "chat_template.jinja")
    from colibri_tui.history import History
    from tests.test_snapshots import SIZE, make_app as snap_app, ready, steady

    h = History(snap_dirs / "data" / "history.sqlite3")
    chat = h.new_chat("Thinking")
    h.add_message(chat.id, "user", "ciao mondo")
    h.add_message(chat.id, "assistant", OPENED,
                  {"stats": {"new_tokens": 41, "decode_tok_s": 12.5, "ttft_s": 0.4, "hit_rate": 0.9,
                             "bytes_read": 1_000_000}, "reason": "eos", "think_open": True,
                   "thinking_tokens": 17})
    h.add_message(chat.id, "user", "again?")
    h.add_message(chat.id, "assistant", OWN,
                  {"stats": {"new_tokens": 43, "decode_tok_s": 11.0, "ttft_s": 0.3, "hit_rate": 0.9,
                             "bytes_read": 1_000_000}, "reason": "eos", "thinking_tokens": 19})
    h.close()

    async def run_before(pilot):
        from colibri_tui.chatview import AssistantMessage
        app = pilot.app
        await ready(pilot)
        app.query_one("#chat-list").focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat_id == chat.id and len(app.query(AssistantMessage)) == 2)
        app.query(AssistantMessage).last().focus()
        await pilot.press("t")
        await steady(pilot)

    assert snap_compare(snap_app(think_container), terminal_size=SIZE, run_before=run_before)
