"""The app serves its loaded model: the settings switch starts and stops `coli serve`'s server
(Textual's Pilot), real HTTP requests reach it (httpx and the openai client), the tier panel shows
its address, requests served and queue, and the app's chat keeps working while it serves: one
engine, so a chat reply waits for the request being decoded (and the other way round)."""
from __future__ import annotations

import asyncio
import functools
import threading

import httpx
import pytest

from tests.conftest import tiny_app_container, wait_for

pytest.importorskip("textual")
openai = pytest.importorskip("openai")

wait_for = functools.partial(wait_for, timeout=30.0)


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return tiny_app_container(tmp_path_factory.mktemp("app-server"), "c", unreachable_eos=True)


def make_app(container):
    from colibri_tui.app import ColiApp
    from colibri_tui.settings import Sampling, Settings
    s = Settings(sampling=Sampling(max_new_tokens=24, seed=1))
    return ColiApp(model_path=container, settings=s, engine_options={"cap": 3, "threads": 1})


async def _switch(pilot, on: bool, port: str = "0", host: str | None = None, key: str | None = None):
    from textual.widgets import Checkbox, Input

    from colibri_tui.screens import SettingsScreen
    app = pilot.app
    await pilot.press("f5")
    assert isinstance(app.screen, SettingsScreen)
    app.screen.query_one("#serve", Checkbox).value = on
    app.screen.query_one("#serve_port", Input).value = port
    if host is not None:
        app.screen.query_one("#serve_host", Input).value = host
    if key is not None:
        app.screen.query_one("#serve_key", Input).value = key
    await pilot.click("#save")


def test_the_settings_switch_starts_and_stops_the_server(container, dirs):
    from colibri_tui import settings as S
    from colibri_tui.chatview import AssistantMessage
    from colibri_tui.tierpanel import TierPanel

    async def run():
        app = make_app(container)
        async with app.run_test(size=(140, 45)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None)
            assert app.server is None and "server" not in app.query_one(TierPanel).plain()
            await _switch(pilot, True)
            await wait_for(pilot, lambda: app.server is not None)
            assert S.load().serve is True and S.load().serve_port == 0
            srv = app.server
            base = srv.url[: -len("/v1")]
            assert srv.url.startswith("http://127.0.0.1:") and srv.port > 0
            r = await asyncio.to_thread(httpx.get, base + "/health", timeout=10)
            assert r.status_code == 200 and r.json()["model"] == "c"
            client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0)
            reply = await asyncio.to_thread(client.chat.completions.create, model="c", max_tokens=5,
                                            messages=[{"role": "user", "content": "hello"}])
            assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
            # the tier panel: address, requests served, queue
            panel = app.query_one(TierPanel)
            await wait_for(pilot, lambda: "1 served" in panel.plain(width=60))
            text = panel.plain(width=60)
            assert srv.url in text and "queue 0/8" in text
            # the stats' height is set, not measured: it follows the lines, the server's two too
            await pilot.pause(0.1)
            stats = panel.query_one("#tier-stats")
            assert stats.size.height == panel._table().row_count + 1 == len(panel.plain().rstrip("\n").splitlines())

            # the app's chat works while serving: a request decodes, the chat's reply waits for it
            slow = {}

            def long_request():
                slow["r"] = client.completions.create(model="c", prompt="hello world", max_tokens=60)
            t = threading.Thread(target=long_request)
            t.start()
            await wait_for(pilot, lambda: srv.state.worker.current is not None and srv.state.worker.current.tokens > 0)
            app.prompt_input.focus()
            app.prompt_input.text = "ciao mondo"
            await pilot.press("enter")
            await pilot.pause(0.05)
            if t.is_alive():
                assert "waiting for the server's request" in app.query_one("#status").render().plain
            await wait_for(pilot, lambda: app.gen is None and not t.is_alive())
            t.join()
            assert slow["r"].usage.completion_tokens == 60          # never cut by the chat
            assert slow["r"].choices[0].finish_reason == "length"
            msgs = app.history.messages(app.chat_id)
            assert msgs[-1].role == "assistant" and msgs[-1].content
            assert app.query(AssistantMessage).last().content
            await wait_for(pilot, lambda: "2 served" in panel.plain(width=60))

            # off: the server stops, its port is closed, the panel line goes
            await _switch(pilot, False)
            await wait_for(pilot, lambda: app.server is None)
            assert S.load().serve is False
            with pytest.raises(httpx.TransportError):
                await asyncio.to_thread(httpx.get, base + "/health", timeout=3)
            assert "server" not in panel.plain(width=60)
    asyncio.run(run())


def test_escape_on_a_waiting_chat_leaves_the_servers_request_alone(container, dirs):
    async def run():
        app = make_app(container)
        async with app.run_test(size=(140, 45)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None)
            await _switch(pilot, True)
            await wait_for(pilot, lambda: app.server is not None)
            srv = app.server
            client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0)
            out = {}
            t = threading.Thread(target=lambda: out.setdefault(
                "r", client.completions.create(model="c", prompt="hello", max_tokens=60)))
            t.start()
            await wait_for(pilot, lambda: srv.state.worker.current is not None and srv.state.worker.current.tokens > 0)
            app.prompt_input.focus()
            app.prompt_input.text = "ciao"
            await pilot.press("enter")
            await pilot.press("escape")             # the chat's reply stops; not the request
            await wait_for(pilot, lambda: not t.is_alive() and app.gen is None and not app.engine_busy())
            assert out["r"].usage.completion_tokens == 60 and out["r"].choices[0].finish_reason == "length"
    asyncio.run(run())


def test_a_non_loopback_host_needs_a_key(container, dirs):
    async def run():
        app = make_app(container)
        async with app.run_test(size=(140, 45)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None)
            await _switch(pilot, True, host="0.0.0.0")
            from textual.widgets import Label
            assert "must have an API key" in str(app.screen.query_one("#error", Label).render())
            assert app.server is None
    asyncio.run(run())
