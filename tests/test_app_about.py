"""F1 (and the palette's About) names the version, the model and where the log, config and data
live: the place `coli --help` names too (issue 15)."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("textual")


def test_f1_names_the_log_and_config(tmp_path, monkeypatch):
    monkeypatch.setenv("COLI_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("COLI_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("COLI_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.delenv("COLI_MODEL", raising=False)
    from colibri_tui.app import ColiApp
    from colibri_tui.cli import _version
    from colibri_tui.screens import MessageScreen
    from colibri_tui.settings import Settings

    async def go():
        app = ColiApp(model_path=None, settings=Settings(), engine_options={"threads": 1})
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            while isinstance(app.screen, MessageScreen):      # the no-model message first
                await pilot.press("escape")
                await pilot.pause()
            await pilot.press("f1")
            await pilot.pause()
            assert isinstance(app.screen, MessageScreen)
            body = str(app.screen.query_one("#message-body").render())
            from models import default_model
            demo = default_model()          # no model given: the app runs the demo, and says so
            for want in (str(tmp_path / "logs" / "colibri.log"), str(tmp_path / "config" / "config.toml"),
                         str(tmp_path / "data"), f"colibri {_version()}", *([str(demo)] if demo else [])):
                assert want in body, (want, body)
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, MessageScreen)
    asyncio.run(go())
