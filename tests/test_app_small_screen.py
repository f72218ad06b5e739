"""The chat screen on small terminals: below ChatScreen.CHATS_INLINE_MIN / TIERS_INLINE_MIN
columns the chat list and the tier panel collapse, so the chat keeps the width; F3 / F2 open
them over the chat (Esc or a chosen chat closes them). Snapshots at 80x24 and 120x40 (accepted
SVGs in tests/__snapshots__/test_app_small_screen/), and the column widths measured."""
from __future__ import annotations

import asyncio

import pytest

from tests.conftest import wait_for
from tests.test_snapshots import container, dirs, make_app, ready, seed_history, steady  # noqa: F401

pytest.importorskip("pytest_textual_snapshot")

SMALL, LARGE = (80, 24), (120, 40)


def widths(app) -> dict[str, int]:
    return {i: (app.query_one(f"#{i}").region.width if app.query_one(f"#{i}").display else 0)
            for i in ("chats", "main", "tiers")}


def test_small_terminal_gives_the_chat_the_width(container, dirs):
    async def run():
        app = make_app(container)
        async with app.run_test(size=SMALL) as pilot:
            await ready(pilot)
            assert widths(app) == {"chats": 0, "main": 80, "tiers": 0}
            await pilot.press("f2")                                  # tier panel over the chat
            assert widths(app) == {"chats": 0, "main": 80, "tiers": 44}
            await pilot.press("f2")
            assert widths(app)["tiers"] == 0
            await pilot.press("f3")                                  # chat list over the chat
            assert widths(app) == {"chats": 30, "main": 80, "tiers": 0}
            assert app.focused is app.query_one("#chat-list")        # its keys go to the list
            await pilot.press("escape")
            assert widths(app)["chats"] == 0 and app.focused is app.prompt_input
            await pilot.press("f3", "enter")                         # choosing a chat closes it
            assert widths(app)["chats"] == 0 and app.focused is app.prompt_input
            # growing the terminal puts the panels back beside the chat
            await pilot.resize_terminal(140, 40)
            await pilot.pause()
            assert widths(app) == {"chats": 30, "main": 66, "tiers": 44}
            await pilot.resize_terminal(110, 40)
            await pilot.pause()
            assert widths(app) == {"chats": 0, "main": 66, "tiers": 44}
    asyncio.run(run())


def test_chat_80x24(container, dirs, snap_compare):
    """A conversation at 80x24: the chat has every column."""
    old = seed_history(dirs / "data")

    async def run_before(pilot):
        app = pilot.app
        await ready(pilot)
        await app.show_chat(old)
        await wait_for(pilot, lambda: len(app.query("AssistantMessage")) == 2)
        await steady(pilot)

    assert snap_compare(make_app(container), terminal_size=SMALL, run_before=run_before)


def test_tier_panel_over_the_chat_80x24(container, dirs, snap_compare):
    """F2 at 80x24: the tier panel opens over the chat."""
    async def run_before(pilot):
        await ready(pilot)
        await pilot.press("f2")
        await steady(pilot)

    assert snap_compare(make_app(container), terminal_size=SMALL, run_before=run_before)


def test_chat_list_over_the_chat_80x24(container, dirs, snap_compare):
    """F3 at 80x24: the chat list opens over the chat."""
    seed_history(dirs / "data")

    async def run_before(pilot):
        await ready(pilot)
        await pilot.press("f3")
        await steady(pilot)

    assert snap_compare(make_app(container), terminal_size=SMALL, run_before=run_before)


def test_chat_120x40(container, dirs, snap_compare):
    """The same conversation at 120x40: chat list, chat and tier panel side by side."""
    old = seed_history(dirs / "data")

    async def run_before(pilot):
        app = pilot.app
        await ready(pilot)
        await app.show_chat(old)
        await wait_for(pilot, lambda: len(app.query("AssistantMessage")) == 2)
        await steady(pilot)

    assert snap_compare(make_app(container), terminal_size=LARGE, run_before=run_before)


def test_settings_80x24(container, dirs, snap_compare):
    """F5 at 80x24: the settings dialog fits (it scrolls inside)."""
    async def run_before(pilot):
        from colibri_tui.screens import SettingsScreen
        await ready(pilot)
        await pilot.press("f5")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen))
        await steady(pilot)

    assert snap_compare(make_app(container), terminal_size=SMALL, run_before=run_before)


def test_no_model_message_80x24(dirs, monkeypatch, snap_compare):
    """No model and no demo at 80x24: the explanation fits and names the setup wizard."""
    import models
    monkeypatch.setattr(models, "default_model", lambda: None)

    async def run_before(pilot):
        from colibri_tui.screens import MessageScreen
        app = pilot.app
        await wait_for(pilot, lambda: isinstance(app.screen, MessageScreen) and app.screen.query("#message-body"))
        await steady(pilot)

    assert snap_compare(make_app(), terminal_size=SMALL, run_before=run_before)


def test_a_long_message_keeps_its_button_on_a_small_terminal(container, dirs):
    from colibri_tui.screens import MessageScreen

    async def run():
        app = make_app(container)
        async with app.run_test(size=SMALL) as pilot:
            await ready(pilot)
            app.push_screen(MessageScreen("Long", "\n".join(f"line {i}" for i in range(60))))
            await wait_for(pilot, lambda: isinstance(app.screen, MessageScreen) and app.screen.query("#ok"))
            await pilot.pause()
            ok = app.screen.query_one("#ok").region
            assert ok.height == 3 and ok.bottom <= SMALL[1] - 1           # whole, above the footer
            await pilot.click("#ok")
            assert not isinstance(app.screen, MessageScreen)
    asyncio.run(run())
