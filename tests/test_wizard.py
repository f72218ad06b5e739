"""The setup wizard driven by Textual's Pilot against a loopback Hub serving a tiny real model:
catalog -> folder -> download -> convert -> verify -> chat, and resume after an interruption."""
from __future__ import annotations

import asyncio

import pytest

from tests.conftest import wait_for
from tests.hub_server import HubServer, build_tiny_repo

pytest.importorskip("textual")

REPO = "acme/tiny-moe"
SHARD2 = "model-00002-of-00002.safetensors"


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory):
    return build_tiny_repo(tmp_path_factory.mktemp("hub") / "repo")


@pytest.fixture
def env(tmp_path, monkeypatch, repo_dir):
    monkeypatch.setenv("COLI_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("COLI_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for k in ("COLI_MODEL", "COLI_RAM_GB", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    import models
    monkeypatch.setattr(models, "default_model", lambda: None)      # no demo: first run -> wizard
    from models import catalog
    toml = tmp_path / "catalog.toml"
    toml.write_text(f'''[[models]]
repo = "{REPO}"
name = "Tiny MoE"
family = "qwen3_moe"
params_b = 0.0003
active_b = 0.0001
disk_gb = 0.0001
download_gb = 0.0003
active_expert_gb = 0.00001
min_ram_gb = 0
arch = {{ layers = 2, hidden = 40, experts = 6, top_k = 2, expert_inter = 24, heads = 4, kv_heads = 2, head_dim = 12, vocab = 300, tied = false }}
''')
    monkeypatch.setattr(catalog, "CATALOG", toml)
    with HubServer() as hub:
        hub.add_repo(REPO, repo_dir)
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        yield tmp_path, hub


def make_app():
    from colibri_tui.app import ColiApp
    from colibri_tui.settings import load
    return ColiApp(settings=load(), setup_wizard=True, engine_options={"threads": 1, "cap": 3})


def wizard_shown(app) -> bool:
    from colibri_tui.wizard import SetupWizard
    return isinstance(app.screen, SetupWizard) and app.screen.is_mounted and len(app.screen.query("#repo")) > 0


def _text(screen, selector) -> str:
    return str(screen.query_one(selector).render())


async def answer_download_question(pilot, wiz, button: str) -> None:
    """After a download + conversion the wizard asks whether to delete the download."""
    await wait_for(pilot, lambda: wiz.query_one("#source-buttons").display)
    assert "not needed to chat: delete it?" in _text(wiz, "#source-question")
    await wait_for(pilot, lambda: wiz.focused is wiz.query_one("#keep-source"), 5)   # the safe default
    await pilot.click(button)


def test_wizard_end_to_end_then_chat(env):
    tmp, hub = env
    from colibri_tui.app import ChatScreen
    from colibri_tui.wizard import state_path

    async def run():
        app = make_app()
        async with app.run_test(size=(130, 45)) as pilot:
            await wait_for(pilot, lambda: wizard_shown(app))
            wiz = app.screen
            table = wiz.query_one("#catalog")
            await wait_for(pilot, lambda: table.row_count > 0 or _text(wiz, "#error").strip(), 5)
            assert table.row_count == 1 and "in RAM" in str(table.get_row_at(0)[-1])
            assert "fits in RAM" in _text(wiz, "#fit-detail")
            table.focus()
            await pilot.press("enter")                           # pick the catalog row
            await wait_for(pilot, lambda: wiz.query_one("#steps").current == "where")
            assert "GB free here" in _text(wiz, "#space")
            wiz.query_one("#base").value = str(tmp / "models")
            await pilot.click("#start")
            assert (tmp / "models").exists()
            await answer_download_question(pilot, wiz, "#delete-source")
            await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen) and app.engine is not None)
            assert not (tmp / "models" / "tiny-moe-hf").exists()      # the download is gone
            assert app.settings.model == str(tmp / "models" / "tiny-moe")
            assert (tmp / "models" / "tiny-moe" / "colibri.json").exists()
            assert not state_path().exists()                      # finished: nothing to resume
            assert "ready" in _text(app.screen, "#status")
            from colibri_tui.settings import load
            assert load().model == app.settings.model             # saved: the next start opens it
    asyncio.run(run())


def test_wizard_resumes_after_an_interruption_and_restart(env, monkeypatch):
    tmp, hub = env
    from colibri_tui import wizard
    from colibri_tui.app import ChatScreen
    from colibri_tui.wizard import load_state
    monkeypatch.setattr(wizard, "DOWNLOAD_RETRIES", 0)
    hub.drop_after[SHARD2] = 50_000                  # the network dies mid-shard

    async def first():
        app = make_app()
        async with app.run_test(size=(130, 45)) as pilot:
            await wait_for(pilot, lambda: wizard_shown(app))
            wiz = app.screen
            wiz.query_one("#repo").value = REPO                  # any Hub repo id works too
            await pilot.click("#use-repo")
            await wait_for(pilot, lambda: wiz.query_one("#steps").current == "where")
            wiz.query_one("#base").value = str(tmp / "models")
            await pilot.click("#start")
            await wait_for(pilot, lambda: not wiz.running and wiz.query_one("#resume").display)
            err = _text(wiz, "#error")
            assert "cannot reach" in err and "Traceback" not in err and "\n" not in err.strip()
        assert load_state().step == "download"             # the app is gone; the position is saved

    async def second():
        hub.clear()
        app = make_app()
        async with app.run_test(size=(130, 45)) as pilot:
            await wait_for(pilot, lambda: wizard_shown(app))
            wiz = app.screen
            assert wiz.query_one("#steps").current == "work" and wiz.query_one("#resume").display
            await pilot.pause()
            from textual.widgets import ProgressBar
            bars = list(wiz.query(ProgressBar))
            assert bars and all(b.total is not None for b in bars)           # no animated "--%"
            assert "--%" not in "".join(str(b.query_one("#percentage").render()) for b in bars if b.display)
            total = wiz.query_one("#total-bar", ProgressBar)
            shard1 = (tmp / "models" / "tiny-moe-hf" / "model-00001-of-00002.safetensors").stat().st_size
            assert shard1 + 50_000 < total.progress < total.total             # how far it got
            assert _text(wiz, "#total-line").startswith("downloaded ")
            await pilot.press("enter")                           # focus is on Resume: Enter resumes
            await answer_download_question(pilot, wiz, "#keep-source")
            await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen) and app.engine is not None)
        assert (tmp / "models" / "tiny-moe-hf" / SHARD2).exists()        # kept
        assert hub.gets(SHARD2) == ["bytes=50000-"]            # continued where it stopped
        assert hub.gets("model-00001-of-00002.safetensors") == [] and hub.gets("config.json") == []

    asyncio.run(first())
    asyncio.run(second())


def test_wizard_errors_are_one_line_then_a_local_folder(env, repo_dir):
    tmp, hub = env
    from colibri_tui.app import ChatScreen

    async def run():
        app = make_app()
        async with app.run_test(size=(130, 45)) as pilot:
            await wait_for(pilot, lambda: wizard_shown(app))
            wiz = app.screen
            wiz.query_one("#folder").value = str(tmp / "nowhere")
            await pilot.click("#use-folder")
            await pilot.pause()
            assert "no such folder" in _text(wiz, "#error")
            wiz.query_one("#repo").value = "acme/missing"
            await pilot.click("#use-repo")
            wiz.query_one("#base").value = str(tmp / "models")
            await pilot.click("#start")
            # a mistyped repo id: back to the choice with the id to correct, nothing to resume
            await wait_for(pilot, lambda: not wiz.running and wiz.query_one("#steps").current == "choose")
            assert "acme/missing: no such model" in _text(wiz, "#error")
            assert wiz.query_one("#repo").value == "acme/missing" and wiz.focused is wiz.query_one("#repo")
            assert not (tmp / "models" / "missing-hf").exists()       # no empty folder left
            from colibri_tui.wizard import pending_setup
            assert pending_setup() is None
            hub.clear()
            wiz.query_one("#folder").value = str(repo_dir)     # a Hugging Face folder I already have
            await pilot.click("#use-folder")
            await wait_for(pilot, lambda: wiz.query_one("#steps").current == "where")
            wiz.query_one("#base").value = str(tmp / "mine")
            await pilot.click("#start")
            await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen) and app.engine is not None)
            assert app.settings.model == str(tmp / "mine" / "repo")
            assert hub.requests == []                           # nothing downloaded for a local folder
            cmds = [c.title for c in app.get_system_commands(app.screen)]
            assert "Set up a model" in cmds                     # the palette entry reopens the wizard
            app.action_setup_wizard()
            await wait_for(pilot, lambda: wizard_shown(app))
            assert app.screen.query_one("#steps").current == "choose"
    asyncio.run(run())


def test_wizard_cancel_keeps_progress_for_the_next_start(env):
    tmp, hub = env
    from colibri_tui.app import ChatScreen
    from colibri_tui.wizard import load_state
    hub.delay[SHARD2] = 0.2                      # slow enough to press Cancel mid-file

    async def first():
        app = make_app()
        async with app.run_test(size=(130, 45)) as pilot:
            await wait_for(pilot, lambda: wizard_shown(app))
            wiz = app.screen
            wiz.query_one("#repo").value = REPO
            await pilot.click("#use-repo")
            wiz.query_one("#base").value = str(tmp / "models")
            await pilot.click("#start")
            await wait_for(pilot, lambda: SHARD2 in _text(wiz, "#file-line")
                           and "file 7 of 7" in _text(wiz, "#total-line"))
            await pilot.click("#cancel")
            await wait_for(pilot, lambda: not wiz.running)
            assert "cancelled at download" in _text(wiz, "#error") and wiz.query_one("#resume").display
        assert load_state().step == "download"

    async def second():
        hub.clear()
        hub.delay.clear()
        app = make_app()
        async with app.run_test(size=(130, 45)) as pilot:
            await wait_for(pilot, lambda: wizard_shown(app))
            await pilot.click("#resume")
            await answer_download_question(pilot, app.screen, "#keep-source")
            await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen) and app.engine is not None)
        (rng,) = hub.gets(SHARD2)
        assert rng.startswith("bytes=") and int(rng[6:-1]) > 0          # the partial file was kept

    asyncio.run(first())
    asyncio.run(second())


def _fill_hf_cache(tmp, hub):
    """REPO in the Hugging Face cache under HF_HOME, put there by huggingface_hub itself."""
    from pathlib import Path

    from huggingface_hub import snapshot_download
    snap = Path(snapshot_download(REPO, cache_dir=tmp / "hf-home" / "hub", endpoint=hub.endpoint))
    hub.clear()
    return snap


def test_wizard_converts_a_repo_from_the_hf_cache_without_fetching(env):
    tmp, hub = env
    from colibri_tui.app import ChatScreen
    snap = _fill_hf_cache(tmp, hub)

    async def run():
        app = make_app()
        async with app.run_test(size=(130, 45)) as pilot:
            await wait_for(pilot, lambda: wizard_shown(app))
            wiz = app.screen
            table = wiz.query_one("#catalog")
            await wait_for(pilot, lambda: table.row_count > 0)
            table.focus()
            await pilot.press("enter")
            await wait_for(pilot, lambda: wiz.query_one("#steps").current == "where")
            assert "is in the Hugging Face cache" in _text(wiz, "#where-what")
            wiz.query_one("#base").value = str(tmp / "models")
            await pilot.click("#start")
            await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen) and app.engine is not None)
        assert hub.requests == []                                 # nothing fetched
        assert app.settings.model == str(tmp / "models" / "tiny-moe")
        assert not (tmp / "models" / "tiny-moe-hf").exists() and snap.is_dir()   # the cache is not ours
    asyncio.run(run())


def test_a_folder_in_a_cache_snapshot_is_named_after_its_repo(env):
    tmp, hub = env
    from colibri_tui.app import ChatScreen
    snap = _fill_hf_cache(tmp, hub)
    assert len(snap.name) == 40                                   # the folder is a commit hash

    async def run():
        app = make_app()
        async with app.run_test(size=(130, 45)) as pilot:
            await wait_for(pilot, lambda: wizard_shown(app))
            wiz = app.screen
            wiz.query_one("#folder").value = str(snap)
            await pilot.click("#use-folder")
            await wait_for(pilot, lambda: wiz.query_one("#steps").current == "where")
            wiz.query_one("#base").value = str(tmp / "mine")
            await pilot.click("#start")
            await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen) and app.engine is not None)
        assert app.settings.model == str(tmp / "mine" / "tiny-moe")
    asyncio.run(run())


def test_the_fit_check_column_shows_at_80x24(env):
    """At 80 columns the catalog drops columns until the fit check (the last one) shows whole."""
    tmp, hub = env

    async def run():
        app = make_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: wizard_shown(app))
            wiz = app.screen
            table = wiz.query_one("#catalog")
            await wait_for(pilot, lambda: table.row_count > 0)
            await pilot.pause()
            assert [str(c.label) for c in table.columns.values()][-1] == "Here"
            assert table.virtual_size.width <= table.size.width              # nothing cut off
            assert "in RAM ≤" in "".join(str(s) for s in table.render_lines(table.region.reset_offset))
            await pilot.resize_terminal(130, 45)
            await pilot.pause()
            assert len(table.columns) == 7                                   # wide again: every column
    asyncio.run(run())


@pytest.mark.parametrize("width", [80, 100, 120])
def test_the_real_catalog_fits_at_any_width(env, monkeypatch, width):
    """The shipped catalog (long model names), whatever this machine's verdicts: nothing cut off."""
    from models import catalog
    monkeypatch.setattr(catalog, "CATALOG", catalog.Path(catalog.__file__).resolve().parent / "catalog.toml")

    async def run():
        app = make_app()
        async with app.run_test(size=(width, 24)) as pilot:
            await wait_for(pilot, lambda: wizard_shown(app))
            table = app.screen.query_one("#catalog")
            await wait_for(pilot, lambda: table.row_count > 0)
            await pilot.pause()
            assert [str(c.label) for c in table.columns.values()][::len(table.columns) - 1] == ["Model", "Here"]
            assert table.virtual_size.width <= table.size.width
    asyncio.run(run())
