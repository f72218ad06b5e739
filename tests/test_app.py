"""The full-screen app driven by Textual's Pilot against a tiny real container."""
from __future__ import annotations

import asyncio
import functools
import time

import pytest

from tests.conftest import tiny_app_container, wait_for

pytest.importorskip("textual")

@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return tiny_app_container(tmp_path_factory.mktemp("app"), "c", unreachable_eos=True)


def make_app(container, **kw):
    from colibri_tui.app import ColiApp
    from colibri_tui.settings import Sampling, Settings
    s = Settings(sampling=Sampling(max_new_tokens=kw.pop("max_new_tokens", 24), seed=1))
    return ColiApp(model_path=container, settings=s, engine_options={"cap": 3, "threads": 1}, **kw)


wait_for = functools.partial(wait_for, timeout=10.0)     # these screens settle sooner


def record_batches(app, batches: list) -> None:
    """Append every batch the generation worker posts to ``batches`` as the UI applies it."""
    orig = app._apply_batch

    async def spy(gen, batch):
        batches.append(batch)
        await orig(gen, batch)
    app._apply_batch = spy


async def type_and_send(pilot, text):
    app = pilot.app
    app.prompt_input.focus()
    app.prompt_input.text = text
    await pilot.press("enter")


def test_send_streams_markdown_reply_and_tier_panel(container, dirs):
    from colibri_tui.chatview import AssistantMessage
    from colibri_tui.tierpanel import TierPanel

    async def run():
        app = make_app(container)
        batches = []
        async with app.run_test(size=(140, 45)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None)
            record_batches(app, batches)      # every batch the worker posts passes here
            # Ctrl+J adds a newline instead of sending
            app.prompt_input.focus()
            await pilot.press("h", "i", "ctrl+j", "x")
            assert app.prompt_input.text == "hi\nx" and app.gen is None
            app.prompt_input.text = "hello world"
            await pilot.press("enter")
            assert app.prompt_input.text == ""                 # sent
            await wait_for(pilot, lambda: app.gen is None and batches and batches[-1]["final"])
            reply = app.query(AssistantMessage).last()
            from colibri_tui.safetext import visible        # shown with controls made visible
            assert reply.content and reply.content == visible(app.history.messages(app.chat_id)[-1].content)
            assert batches[-1]["stats"]["new_tokens"] == 24
            # batched: fewer UI calls than tokens
            assert len(batches) < 24
            panel = app.query_one(TierPanel)
            text = panel.plain()
            assert "hit rate" in text and "RAM" in text and "%" in text and "1st token" in text
            # toggles
            await pilot.press("f2")
            assert not panel.display
            await pilot.press("f2")
            assert panel.display
            assert app.history.chats()[0].title == "hello world"
    asyncio.run(run())


def test_escape_cancels_a_long_reply(container, dirs):
    async def run():
        from textual import events
        app = make_app(container, max_new_tokens=100000)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None)
            # keys are posted, not pressed: Pilot.press waits for an idle app, and a streaming
            # reply keeps it busy
            key = lambda k, c=None: app.prompt_input.post_message(events.Key(k, c))
            app.prompt_input.text = "tell me everything"
            key("enter")
            await wait_for(pilot, lambda: app.gen is not None and app.gen.tokens >= 5)
            t0 = time.monotonic()
            for k in ("a", "b"):
                key(k, k)
            key("enter")                                   # a second send is refused, text kept
            await wait_for(pilot, lambda: app.prompt_input.text == "ab")
            assert time.monotonic() - t0 < 2.0 and app.gen is not None   # typing stays responsive
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.gen is None, timeout=5)
            last = app.history.messages(app.chat_id)[-1]
            assert last.role == "assistant" and last.stats["reason"] == "cancelled"
            assert 5 <= last.stats["stats"]["new_tokens"] < 100000
            assert app.prompt_input.text == "ab"
            # switching chats while a reply streams: it keeps streaming into its own chat
            first = app.chat_id
            app.prompt_input.text = "again"
            key("enter")
            await wait_for(pilot, lambda: app.gen is not None and app.gen.tokens >= 3)
            await app.action_new_chat()
            assert app.chat_id != first and app.gen is not None and app.gen.widget is None
            await app.show_chat(first)
            await wait_for(pilot, lambda: app.gen.widget is not None and len(app.gen.widget.content) > 0)
        # closing the app mid-reply keeps what came so far
        msgs = app.history.__class__(app.history.path).messages(first)
        assert msgs[-1].role == "assistant" and msgs[-1].stats["reason"] == "interrupted"
    asyncio.run(run())


def test_history_survives_restart_and_prompt_is_kept_when_send_fails(container, dirs):
    from colibri_tui.chatview import AssistantMessage, UserMessage

    async def first():
        app = make_app(container, max_new_tokens=6)
        async with app.run_test() as pilot:
            await wait_for(pilot, lambda: app.engine is not None)
            await type_and_send(pilot, "ciao mondo")
            await wait_for(pilot, lambda: app.gen is None and len(app.history.messages(app.chat_id)) == 2)
            app.history.rename(app.chat_id, "kept")
            return app.chat_id

    async def second(chat_id):
        app = make_app(container)
        async with app.run_test() as pilot:
            await pilot.pause()
            assert app.chat_id == chat_id and app.history.get(chat_id).title == "kept"
            assert [u.content for u in app.query(UserMessage)] == ["ciao mondo"]
            assert len(app.query(AssistantMessage)) == 1
            # a second chat, then export
            await pilot.press("ctrl+n")
            assert app.chat_id != chat_id and len(app.history.chats()) == 2
            app.chat_id = chat_id
            path = app.action_export_chat()
            assert path.exists() and "## User" in path.read_text() and "ciao mondo" in path.read_text()

    async def no_model():
        from colibri_tui.app import ColiApp
        from colibri_tui.screens import MessageScreen
        from colibri_tui.settings import Settings
        app = ColiApp(settings=Settings())
        app.resolved_model = lambda: None
        async with app.run_test() as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, MessageScreen))
            await pilot.press("escape")
            await type_and_send(pilot, "please keep me")
            await pilot.pause()
            assert app.prompt_input.text == "please keep me"      # the prompt is never lost
            assert not any(m.role == "user" for m in app.history.messages(app.chat_id))

    async def bad_model():
        from colibri_tui.app import ColiApp
        from colibri_tui.screens import MessageScreen
        from colibri_tui.settings import Settings
        app = ColiApp(model_path=dirs / "not-a-model", settings=Settings())
        async with app.run_test() as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, MessageScreen) and app.screen.query("#message-body"))
            body = str(app.screen.query_one("#message-body").render())
            assert "not-a-model" in body and "Traceback" not in body and app.engine is None

    cid = asyncio.run(first())
    asyncio.run(bad_model())
    asyncio.run(second(cid))
    asyncio.run(no_model())


def test_brain_map_aggregates_a_large_grid(dirs):
    from textual.app import App

    from colibri_tui.brainmap import BrainMap, Grid, bins, group_size, zoom_levels

    b = bins(76, 40)
    assert len(b) == 40 and sum(map(len, b)) == 76 and max(map(len, b)) - min(map(len, b)) <= 1
    assert group_size(256, 38) == 7 and group_size(76, 36) == 3 and group_size(8, 41) == 1
    assert zoom_levels(3, 7) == [(3, 7), (2, 4), (1, 2), (1, 1)] and zoom_levels(1, 1) == [(1, 1)]
    L, E = 76, 256
    placement = {l: {e: ("pinned" if e < 8 else "ram") for e in range(0, 64)} for l in range(L)}
    heat = {(l, e): (e * 7 + l) % 50 for l in range(L) for e in range(E)}
    routed = {l: [l % E, (l * 3) % E] for l in range(L)}
    g = Grid(L, E, 2, 7, placement, heat, routed)          # uniform cells of 2 layers × 7 experts
    assert g.rows == 38 and g.cols == 37 and g.expert_range(36) == (252, 255) and g.layer_range(37) == (74, 75)
    assert g.tier[0][0] == "pinned" and g.tier[0][5] == "ram" and g.tier[0][30] == "disk"
    assert g.counts[0][1] == [0, 12, 2, 0]                   # experts 7–13 of layers 0–1: 12 RAM, 2 pinned
    assert g.heat_sum[0][0] == sum(heat[(l, e)] for l in (0, 1) for e in range(7))
    assert any(any(r) for r in g.flash)

    from colibri_tui.tierpanel import TierPanel

    class MapApp(App):
        def compose(self):
            yield TierPanel()

    async def run():
        app = MapApp()
        async with app.run_test(size=(60, 50)) as pilot:
            panel = app.query_one(TierPanel)
            panel.set_model(L, E, ram_budget=64 * L * 1000)
            panel.push(stats={"new_tokens": 3, "hit_rate": 0.5, "hits": 1, "misses": 1, "bytes_read": 10,
                              "attention_s": 1.0, "experts_s": 2.0},
                       rate=4.0, placement=placement, heat=heat, routed=routed, slot_bytes=1000)
            await pilot.pause()
            bm = app.query_one(BrainMap)
            assert bm.size.height >= 5 and "76 layers × 256 experts" in str(panel.query_one("#brain-title").render())
            assert "RAM tier" in panel.plain() and "4.9 MB / 4.9 MB" in panel.plain()
            lines = [bm.render_line(y) for y in range(bm.size.height)]
            assert all(line.cell_length == bm.size.width for line in lines)
            g = bm.grid()      # the whole model fits: every layer and expert in some cell
            assert g.rows * g.lz >= L and g.rows <= 2 * bm.size.height
            assert g.cols * g.ez >= E and bm.gutter_width() + g.cols <= bm.size.width
    asyncio.run(run())


def test_thinking_is_collapsible_and_answer_is_markdown(dirs):
    from textual.app import App
    from textual.widgets import Collapsible

    from colibri_tui.chatview import AssistantMessage, split_think

    assert split_think("<thi") == (None, "", False)
    assert split_think("<think>abc</th") == ("abc", "", True)
    assert split_think("<think>abc</think>\n\nHi") == ("abc", "Hi", False)
    assert split_think("plain **md**") == (None, "plain **md**", False)

    class OneMessage(App):
        def compose(self):
            yield AssistantMessage("", streaming=True)

    async def run():
        app = OneMessage()
        async with app.run_test() as pilot:
            m = app.query_one(AssistantMessage)
            for chunk in ("<thi", "nk>let me", " think</thi", "nk>\n\nThe **answer**", " is 42."):
                await m.append(chunk)
                await pilot.pause()
            c = app.query_one(Collapsible)
            assert c.collapsed and c.title == "Thinking"
            await m.finish("done")
            await pilot.pause()
            assert m.markdown.source == "The **answer** is 42."
            assert "let me think" in str(c.query_one(".thinking").render())
    asyncio.run(run())


def test_settings_roundtrip_and_env_overrides(dirs, monkeypatch):
    from colibri_tui import settings as S

    s = S.load()
    assert s.policy == "lfru" and s.ram_gb is None and s.prefetch
    assert s.kv_cache == "float32"
    s.ram_gb, s.policy, s.o_direct, s.threads, s.kv_cache = 3.5, "lfru", True, 2, "float16"
    s.sampling.temperature = 0.2
    path = S.save(s)
    assert path == dirs / "config" / "config.toml"
    t = S.load()
    assert (t.ram_gb, t.policy, t.o_direct, t.threads, t.kv_cache, t.sampling.temperature) == \
        (3.5, "lfru", True, 2, "float16", 0.2)
    from colibri_tui.app import ColiApp
    assert ColiApp(settings=t)._open_options()["kv_cache"] == "float16"        # reaches open_model
    assert ColiApp(settings=t, engine_options={"kv_cache": "float32"})._open_options()["kv_cache"] == "float32"
    t.kv_cache = "float8"
    with pytest.raises(ValueError, match="KV cache"):
        t.validate()
    monkeypatch.setenv("COLI_RAM_GB", "9")
    monkeypatch.setenv("COLI_MODEL", "/some/model")
    u = S.load()
    assert u.ram_gb == 9.0 and u.model == "/some/model" and set(u.overridden) == {"ram_gb", "model"}
    S.save(u)                                   # environment values are not written back
    monkeypatch.delenv("COLI_RAM_GB")
    monkeypatch.delenv("COLI_MODEL")
    assert S.load().ram_gb == 3.5 and S.load().model == ""
    path.write_text("not = [valid")
    assert S.load().policy == "lfru"            # a broken file gives the defaults, not a crash


def test_chat_management_and_palette(container, dirs):
    from textual.widgets import Input

    from colibri_tui.screens import ChatSettingsScreen, ConfirmScreen, TextPrompt

    async def run():
        app = make_app(container)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            first = app.chat_id
            await pilot.press("f6")                          # rename
            assert isinstance(app.screen, TextPrompt)
            app.screen.query_one(Input).value = "my chat"
            await pilot.press("enter")
            assert app.history.get(first).title == "my chat"
            await pilot.press("f4")                          # per-chat system prompt and sampling
            assert isinstance(app.screen, ChatSettingsScreen)
            app.screen.query_one("#temperature", Input).value = "0.3"
            app.screen.query_one("#system").text = "Be brief."
            await pilot.click("#save")
            chat = app.history.get(first)
            assert chat.sampling.temperature == 0.3 and chat.system_prompt == "Be brief."
            assert app.history.engine_messages(first) == [{"role": "system", "content": "Be brief."}]
            await pilot.press("ctrl+n")
            second = app.chat_id
            await pilot.press("f8")                          # delete, confirmed
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            assert app.history.get(second) is None and app.chat_id == first
            # app settings: saved to config.toml, the engine reopens with them
            from colibri_tui import settings as S
            from colibri_tui.screens import SettingsScreen
            await wait_for(pilot, lambda: app.engine is not None)
            old = app.engine
            await pilot.press("f5")
            assert isinstance(app.screen, SettingsScreen)
            app.screen.query_one("#ram_gb", Input).value = "2"
            app.screen.query_one("#threads", Input).value = "1"
            await pilot.click("#save")
            assert S.load().ram_gb == 2.0 and S.load().threads == 1
            await wait_for(pilot, lambda: app.engine is not None and app.engine is not old)
            names = {c.title for c in app.get_system_commands(app.screen)}
            assert {"New chat", "Stop reply", "Toggle tier panel", "Export chat to Markdown"} <= names
    asyncio.run(run())


def test_runner_batches_and_backs_off():
    from core.events import Done, Stats, Token
    from colibri_tui.runner import run_generation

    class FakeEngine:
        def __init__(self):
            self.cancelled = False

        def generate(self, messages, sampling, stop=(), max_new_tokens=0):
            for i in range(max_new_tokens):
                if self.cancelled:
                    break
                time.sleep(0.002)
                yield Token(i, "x")
                yield Stats(new_tokens=i + 1, extra={"final": False, "routed": {0: [i % 4]}})
            yield Stats(new_tokens=max_new_tokens, extra={"final": True, "ids": [], "text": ""})
            yield Done("cancelled" if self.cancelled else "length")

        def cancel(self):
            self.cancelled = True

        def placement(self):
            return {0: {1: "ram"}}

        def heat(self):
            return {(0, 1): 3}

    posts = []
    out = run_generation(FakeEngine(), [], None, 100, posts.append, interval=0.02)
    assert "".join(p["text"] for p in posts) == "x" * 100 == out["text"]
    assert sum(p["tokens"] for p in posts) == 100 and 2 < len(posts) < 60
    assert posts[-1]["final"] and posts[-1]["reason"] == "length" and posts[-1]["placement"] == {0: {1: "ram"}}
    assert all(not p["final"] for p in posts[:-1]) and posts[0]["routed"] is not None
    # the UI is busy: nothing but the final batch goes out, and it carries everything
    posts.clear()
    run_generation(FakeEngine(), [], None, 50, posts.append, interval=0.0, ready=lambda: False)
    assert len(posts) == 1 and posts[0]["text"] == "x" * 50 and posts[0]["final"]
    # cancel is passed to the engine on the next event
    posts.clear()
    out = run_generation(FakeEngine(), [], None, 10**6, posts.append, cancelled=lambda: True)
    assert out["reason"] == "cancelled" and len(out["text"]) < 5


def test_code_blocks_are_found():
    from colibri_tui.chatview import code_blocks

    text = ("intro\n```python\nprint(1)\n```\nmid ``inline``\n  ~~~\nx = 2\ny = 3\n  ~~~~\n"
            "````md\n```\nnested\n```\n````\n```\nstill streaming")
    assert code_blocks(text) == ["print(1)", "x = 2\ny = 3", "```\nnested\n```", "still streaming"]
    assert code_blocks("no code here") == [] and code_blocks("```\n```") == [""]


def test_select_and_copy_any_message_or_code_block(container, dirs):
    from colibri_tui.chatview import AssistantMessage, UserMessage

    first_reply = ("<think>private musing</think>\n\nTwo ways:\n\n```python\nprint(1)\n```\n\n"
                   "or\n\n~~~sh\necho two\n~~~\n")

    async def run():
        app = make_app(container)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            chat = app.history.new_chat(sampling=app.settings.sampling)
            for role, text in (("user", "first question"), ("assistant", first_reply),
                               ("user", "second question"), ("assistant", "last answer, no code")):
                app.history.add_message(chat.id, role, text)
            await app.show_chat(chat.id)
            await pilot.pause()
            copied, notes = [], []
            app.copy_to_clipboard = copied.append
            orig_notify = app.notify
            app.notify = lambda msg, **kw: (notes.append(msg), orig_notify(msg, **kw))[1]
            items = app.chat_messages()
            assert [type(w) for w in items] == [UserMessage, AssistantMessage] * 2
            assert app.focused is app.prompt_input
            # from the prompt, Alt+Up selects the last message, then older ones
            await pilot.press("alt+up")
            assert app.focused is items[3]
            await pilot.press("alt+up", "alt+up")
            assert app.focused is items[1] and app.selected_message() is items[1]
            assert {"c", "y"} <= set(app.screen.active_bindings)        # shown in the footer
            await pilot.press("c")                                      # an older reply, not the last
            assert copied == [first_reply.split("</think>\n\n", 1)[1]] and notes[-1].startswith("reply ")
            assert "private musing" not in copied[-1]
            await pilot.press("y", "y", "y")                            # its code blocks, cycling
            assert copied[1:] == ["print(1)", "echo two", "print(1)"]
            assert [n.split(" sent ")[0] for n in notes[-3:]] == ["code block 1/2", "code block 2/2", "code block 1/2"]
            await pilot.press("up", "c")                                # plain Up moves too
            assert app.focused is items[0] and copied[-1] == "first question"
            await pilot.press("y")
            assert len(copied) == 5 and "no code block" in notes[-1]
            await pilot.press("down", "down", "ctrl+c")                # Ctrl+C: the message too
            assert app.focused is items[2] and copied[-1] == "second question"
            assert app.prompt_input.text == "" and app.gen is None     # nothing reached the prompt
            # Esc goes back to the prompt, where c and y are typed as usual
            await pilot.press("escape")
            assert app.focused is app.prompt_input
            await pilot.press("c", "y")
            assert app.prompt_input.text == "cy" and len(copied) == 6
            # a click selects a message; Alt+Down past the last one returns to the prompt
            await pilot.click(items[2])
            assert app.focused is items[2]
            await pilot.press("c")
            assert copied[-1] == "second question"
            await pilot.press("alt+down", "c")
            assert app.focused is items[3] and copied[-1] == "last answer, no code"
            await pilot.press("alt+down")
            assert app.focused is app.prompt_input
            await pilot.press("x")
            assert app.prompt_input.text == "cyx" and len(copied) == 8
            # the palette's "last code block" still finds the older reply's last block
            app.action_copy_code()
            assert copied[-1] == "echo two"
    asyncio.run(run())


@pytest.mark.parametrize("interval,all_batches", [(0.0, True), (1e9, False)])
def test_the_tier_panel_repaints_at_most_every_interval_and_with_the_last_batch(container, dirs, monkeypatch,
                                                                               interval, all_batches):
    """While a reply streams the tier panel takes a batch at most every PANEL_INTERVAL from the
    send on (its repaint costs the UI thread CPU the kernel threads need), and always the final one."""
    from colibri_tui.app import ColiApp
    from colibri_tui.tierpanel import TierPanel
    from colibri_tui import runner
    monkeypatch.setattr(ColiApp, "PANEL_INTERVAL", interval)
    # a batch as soon as the UI took the last one, no paint budget: many batches from the small
    # test model
    monkeypatch.setattr(runner, "run_generation", functools.partial(runner.run_generation, interval=0.0))
    from colibri_tui.pacing import PaintBudget
    monkeypatch.setattr(PaintBudget, "SHARE", 1e9)
    pushed = []
    orig_push = TierPanel.push

    def push(self, **kw):
        pushed.append(kw["stats"])
        return orig_push(self, **kw)
    monkeypatch.setattr(TierPanel, "push", push)

    async def run():
        app = make_app(container, max_new_tokens=48)
        batches = []
        async with app.run_test(size=(140, 45)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None)
            record_batches(app, batches)
            app.prompt_input.text = "hello world"
            app.prompt_input.focus()
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.gen is None and batches and batches[-1]["final"])
            assert len(batches) >= 3
            if all_batches:
                assert len(pushed) == len(batches)
            else:                                   # the interval counts from the send: the final only
                assert len(pushed) == 1
            assert pushed[-1] == batches[-1]["stats"]
            assert app.query_one(TierPanel).last["new_tokens"] == batches[-1]["stats"]["new_tokens"]
    asyncio.run(run())


def test_the_paint_budget_spaces_batches_by_the_ui_threads_cpu():
    from colibri_tui.pacing import PaintBudget
    now, cpu = [100.0], [5.0]
    b = PaintBudget(share=0.02, longest=0.5, clock=lambda: now[0], cpu=lambda: cpu[0])
    assert b.due()                     # the send: nothing painted yet
    now[0], cpu[0] = 100.1, 5.001      # the first batch after 0.1 s of prefill, 1 ms of UI work
    b.applied()
    assert b.next_at == pytest.approx(100.05) and b.due()      # within budget: at once
    now[0], cpu[0] = 100.2, 5.005      # 5 ms spent since the send: no batch before 100.25
    b.applied()
    assert b.next_at == pytest.approx(100.25)
    now[0] = 100.24
    assert not b.due()
    now[0] = 100.25
    assert b.due()
    now[0], cpu[0] = 100.3, 5.105      # 105 ms spent: 5.25 s of budget, but at most 0.5 s from now
    b.applied()
    assert b.next_at == pytest.approx(100.8)
    now[0], cpu[0] = 110.0, 5.105      # a long quiet spell (a tool call, a slow disk) builds credit
    b.applied()
    assert b.due()


def test_a_streaming_reply_waits_for_the_paint_budget(container, dirs, monkeypatch):
    """The worker posts the next batch only once the UI's painting since the last is within its
    share of the time (PaintBudget); the prompt's cursor stops blinking while a reply streams."""
    from colibri_tui import runner
    from colibri_tui.pacing import PaintBudget
    monkeypatch.setattr(runner, "run_generation", functools.partial(runner.run_generation, interval=0.0))
    monkeypatch.setattr(PaintBudget, "SHARE", 1e-9)      # any painting: wait the longest
    monkeypatch.setattr(PaintBudget, "LONGEST", 60.0)

    async def run():
        app = make_app(container, max_new_tokens=200)
        batches, blink = [], []
        async with app.run_test(size=(140, 45)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None)
            record_batches(app, batches)
            orig = app._apply_batch

            async def spy(gen, batch):
                blink.append(app.prompt_input.cursor_blink)
                await orig(gen, batch)
            app._apply_batch = spy
            assert app.prompt_input.cursor_blink
            await type_and_send(pilot, "hello world")
            await wait_for(pilot, lambda: app.gen is None and batches and batches[-1]["final"], timeout=60)
            # the first batch (the send's painting already over budget: the next waits 60 s),
            # then only the final one
            assert len(batches) == 2 and batches[-1]["stats"]["new_tokens"] == 200
            assert sum(b["tokens"] for b in batches) == 200
            assert blink == [False] * 2 and app.prompt_input.cursor_blink
    asyncio.run(run())


def test_a_send_rebuilds_the_chat_list_only_when_it_changed(container, dirs):
    from colibri_tui.app import ChatItem

    async def run():
        app = make_app(container, max_new_tokens=4)
        async with app.run_test(size=(140, 45)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None)
            await type_and_send(pilot, "first message")
            await wait_for(pilot, lambda: app.gen is None)
            await pilot.pause(0.1)
            items = list(app.query(ChatItem))
            assert [it.title for it in items] == [app.history.get(app.chat_id).title]
            await type_and_send(pilot, "second message")          # same chat, same title
            await wait_for(pilot, lambda: app.gen is None)
            await pilot.pause(0.1)
            assert list(app.query(ChatItem)) == items               # the same widgets
            app.history.rename(app.chat_id, "renamed")
            app.refresh_chat_list()
            await pilot.pause(0.1)
            assert [it.title for it in app.query(ChatItem)] == ["renamed"]
    asyncio.run(run())


def test_a_replys_end_while_the_app_closes_raises_nothing(container, dirs):
    """The last batch of a reply can be applied while the app is closing (Ctrl+Q as the reply
    ends; a benchmark leaving run_test at the final batch): the chat list, the status line, the
    chat selection and the prompt's cursor then have no screen, and the app exits cleanly."""
    async def run():
        app = make_app(container, max_new_tokens=4)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None)
        app.refresh_chat_list()
        app.set_status("ready")
        app._select_current_chat()
        app.gen = None
    asyncio.run(run())
