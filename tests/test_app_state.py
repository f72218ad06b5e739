"""The app must start, whatever is wrong in its files (issue 16): a damaged chat history, config
or usage file, and a damaged container in the wizard's verify step. Real files (SQLite, TOML, a
converted container), the real app under Textual's Pilot; every problem is a visible notice."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import sys

import pytest

from tests.conftest import tiny_app_container, wait_for

pytest.importorskip("textual")


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return tiny_app_container(tmp_path_factory.mktemp("state"), "c", unreachable_eos=False)


def notices(app) -> list[str]:
    return [str(n.message) for n in app._notifications]


def make_app(container, settings=None):
    from colibri_tui.app import ColiApp
    from colibri_tui.settings import load
    return ColiApp(model_path=container, settings=settings if settings is not None else load(),
                   engine_options={"cap": 3, "threads": 1})


async def send_and_wait(pilot, text: str) -> None:
    app = pilot.app
    app.prompt_input.focus()
    app.prompt_input.text = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.gen is None and app.history.messages(app.chat_id)
                   and app.history.messages(app.chat_id)[-1].role == "assistant", 20)


# --- config.toml -------------------------------------------------------------------------------

BAD_CONFIGS = {
    "sampling.seed": "[sampling]\nseed = inf\n",
    "sampling.max_new_tokens": "[sampling]\nmax_new_tokens = inf\n",
    "engine.threads": "[engine]\nthreads = inf\n",
    "sampling = [1, 2]": "sampling = [1, 2]\n",
    "sampling.seed = -1": "[sampling]\nseed = -1\n",
}


@pytest.mark.parametrize("key", list(BAD_CONFIGS))
def test_an_invalid_config_value_falls_back_with_a_notice_naming_it(dirs, key):
    from colibri_tui.settings import Sampling, Settings, config_path, load
    config_path().write_text('model = "kept"\n' + BAD_CONFIGS[key])
    s = load(env={})                                     # before: OverflowError / AttributeError
    assert s.model == "kept" and s.threads is None and s.sampling == Sampling()
    assert len(s.notices) == 1 and key.split(" =")[0] in s.notices[0], s.notices
    assert "default" in s.notices[0]
    s.validate()                                         # what reached the app is usable
    Settings(sampling=Sampling(seed=s.sampling.seed)).validate()


def test_the_seed_must_fit_numpys_generators():
    from colibri_tui.settings import Sampling
    Sampling(seed=0).validate()
    Sampling(seed=2 ** 64 - 1).validate()
    for bad in (-1, 2 ** 64, 1.5, True):
        with pytest.raises(ValueError, match="seed"):
            Sampling(seed=bad).validate()


def test_the_app_starts_with_a_bad_config_shows_notices_and_replies(container, dirs):
    from colibri_tui.settings import config_path
    config_path().write_text("[sampling]\nseed = -1\nmax_new_tokens = 4\ntemperature = nan\n"
                             "[engine]\nthreads = inf\nprefetch = \"no\"\n")

    async def run():
        app = make_app(container)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None, 20)
            shown = " | ".join(notices(app))
            for key in ("sampling.seed", "sampling.temperature", "engine.threads", "engine.prefetch"):
                assert key in shown, shown
            await send_and_wait(pilot, "hello")           # before: every reply refused (seed -1)
            assert app.history.messages(app.chat_id)[-1].content
    asyncio.run(run())


def test_the_settings_dialogs_refuse_a_seed_outside_0_to_2_64(container, dirs):
    from colibri_tui.screens import ChatSettingsScreen, SettingsScreen
    from colibri_tui.settings import config_path

    async def refused(pilot, key, screen_type, seed):
        app = pilot.app
        await pilot.press(key)
        await wait_for(pilot, lambda: isinstance(app.screen, screen_type))
        app.screen.query_one("#seed").value = seed
        app.screen.query_one("#save").press()
        await pilot.pause()
        assert isinstance(app.screen, screen_type)                  # not saved: still open
        assert "seed must be an integer in 0..18446744073709551615" in str(app.screen.query_one("#error").render())
        await pilot.press("escape")

    async def run():
        app = make_app(container)
        async with app.run_test(size=(120, 45)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None, 20)
            await refused(pilot, "f4", ChatSettingsScreen, "-1")       # before: saved, every reply refused
            await refused(pilot, "f5", SettingsScreen, str(2 ** 64))
            assert app.history.get(app.chat_id).sampling.seed is None
            assert not config_path().exists()
    asyncio.run(run())


def test_an_unreadable_config_is_kept_when_settings_are_saved(dirs):
    from colibri_tui.settings import config_path, load, save
    config_path().write_text("[engine\nthreads = 2\n")
    s = load(env={})
    assert s.notices and "not valid TOML" in s.notices[0]
    s.notices.clear()
    s.threads = 3
    save(s)
    kept = [p for p in config_path().parent.iterdir() if ".damaged-" in p.name]
    assert len(kept) == 1 and kept[0].read_text() == "[engine\nthreads = 2\n"     # nothing lost
    assert str(kept[0]) in s.notices[0]
    assert load(env={}).threads == 3 and not load(env={}).notices


def test_a_model_path_with_control_characters_survives_a_save(dirs):
    from colibri_tui.settings import load, save
    s = load(env={})
    s.model = "/m/a\tb\x1bc\"d\\e\nf\x7f"
    save(s)
    again = load(env={})                              # before: invalid TOML, settings silently lost
    assert again.model == s.model and not again.notices


def test_a_bad_coli_ram_gb_is_ignored_with_a_notice(dirs):
    from colibri_tui.settings import load
    s = load(env={"COLI_RAM_GB": "inf"})
    assert s.ram_gb is None and "COLI_RAM_GB" in s.notices[0]


# --- history.sqlite3 ---------------------------------------------------------------------------

def _history_with_a_chat(path) -> int:
    from colibri_tui.history import History
    h = History(path)
    c = h.new_chat(title="kept chat")
    for i in range(40):
        h.add_message(c.id, "user", f"message {i} " + "x" * 200)
    h.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    h.close()
    return c.id


def _damage(path, how: str) -> None:
    if how == "garbage":
        path.write_bytes(os.urandom(3000))
    elif how == "truncated":
        _history_with_a_chat(path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "directory":
        path.mkdir()
        (path / "inside").write_text("mine")
    elif how == "another schema version":
        _history_with_a_chat(path)
        db = sqlite3.connect(path)
        db.execute("PRAGMA user_version = 9")
        db.close()
    elif how == "another schema":
        db = sqlite3.connect(path)
        db.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, text TEXT)")
        db.commit()
        db.close()


@pytest.mark.parametrize("how", ["garbage", "truncated", "directory", "another schema version",
                                 "another schema"])
def test_a_damaged_history_is_moved_aside_and_the_app_starts(container, dirs, how):
    path = dirs / "data" / "history.sqlite3"
    _damage(path, how)
    before = sorted(p.name for p in path.rglob("*")) if path.is_dir() else path.read_bytes()

    async def run():
        app = make_app(container)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None, 20)
            shown = [n for n in notices(app) if "chat history" in n]
            assert len(shown) == 1 and "kept as" in shown[0] and "fresh history" in shown[0], notices(app)
            await send_and_wait(pilot, "hello")           # the fresh history works
        return shown[0]
    shown = asyncio.run(run())
    kept = [p for p in path.parent.iterdir() if p.name.startswith("history.sqlite3.damaged-")
            and not p.name.endswith(("-wal", "-shm"))]
    assert len(kept) == 1 and str(kept[0]) in shown
    after = sorted(p.name for p in kept[0].rglob("*")) if kept[0].is_dir() else kept[0].read_bytes()
    assert after == before                                  # kept as it was, never deleted


def test_damaged_rows_are_skipped_with_a_notice_and_the_rest_is_shown(container, dirs):
    from colibri_tui.chatview import AssistantMessage, UserMessage
    from colibri_tui.history import History
    path = dirs / "data" / "history.sqlite3"
    h = History(path)
    c = h.new_chat(title="damaged rows")
    ids = [h.add_message(c.id, "user", "first"),
           h.add_message(c.id, "assistant", "a reply", {"stats": {"new_tokens": 3}, "reason": "eos"}),
           h.add_message(c.id, "user", "binary"),
           h.add_message(c.id, "assistant", "stats a string"),
           h.add_message(c.id, "user", "last")]
    h.close()
    db = sqlite3.connect(path)
    db.execute("UPDATE messages SET content = ? WHERE id = ?", (b"\x00\xffblob", ids[2]))
    db.execute("UPDATE messages SET stats = ? WHERE id = ?", (json.dumps("a string"), ids[3]))
    db.execute("UPDATE messages SET stats = ? WHERE id = ?",
               (json.dumps({"stats": {"decode_tok_s": "fast"}}), ids[1]))
    db.execute("UPDATE chats SET sampling = ?, system_prompt = ? WHERE id = ?", ("[1, 2]", b"sys", c.id))
    db.commit()
    db.close()

    async def run():
        app = make_app(container)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None, 20)
            assert app.chat_id == c.id
            assert [m.content for m in app.query(UserMessage)] == ["first", "last"]
            assert [m.content for m in app.query(AssistantMessage)] == ["a reply", "stats a string"]
            shown = " | ".join(notices(app))
            assert f"message {ids[2]} skipped" in shown and "binary data" in shown
            assert f"message {ids[3]}: its statistics are damaged" in shown
            assert f"message {ids[1]}: its statistics are damaged" in shown
            assert "sampling is not a table" in shown and "system prompt is not text" in shown
            n = len(app._notifications)
            await app.show_chat(c.id)                       # each damaged row is said once
            assert len(app._notifications) == n
            # the model gets what the user sees
            assert [m["content"] for m in app.history.engine_messages(c.id)] == \
                ["first", "a reply", "stats a string", "last"]
            await send_and_wait(pilot, "still works")
    asyncio.run(run())
    db = sqlite3.connect(path)                               # reading changed nothing stored
    assert db.execute("SELECT content FROM messages WHERE id = ?", (ids[2],)).fetchone()[0] == b"\x00\xffblob"
    db.close()


def test_a_history_that_cannot_be_written_still_opens_the_app(container, dirs, monkeypatch):
    blocker = dirs / "not-a-dir"
    blocker.write_text("a file where the data folder should be")
    monkeypatch.setenv("COLI_DATA_DIR", str(blocker))

    async def run():
        app = make_app(container)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None, 20)
            assert any("not saved" in n for n in notices(app)), notices(app)
            await send_and_wait(pilot, "hello")
    asyncio.run(run())
    assert blocker.read_text() == "a file where the data folder should be"


CRASHING_APP = r"""
import sys
from colibri_tui import app
async def boom(self):
    raise RuntimeError("boom at start")
app.ColiApp.start_up = boom                  # any bug that escapes the app's own handling
from colibri_tui.cli import main
sys.exit(main(["chat"]))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_coli_chat_exits_non_zero_when_the_app_crashes(dirs):
    import select
    import subprocess
    env = dict(os.environ, COLI_LOG_DIR=str(dirs / "log"), TERM="xterm-256color")
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_APP], stdin=slave, stdout=slave, stderr=slave,
                            env=env)
    os.close(slave)
    out = b""
    while select.select([master], [], [], 60)[0]:
        try:
            chunk = os.read(master, 4096)
        except OSError:                     # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=60)
    os.close(master)
    assert b"boom at start" in out
    assert proc.returncode == 1              # before: a traceback and exit code 0


# --- .coli_usage -------------------------------------------------------------------------------

def test_a_damaged_usage_history_is_a_notice_in_the_app(container, dirs):
    from core.usage import usage_path
    model = dirs / "model"
    shutil.copytree(container, model)
    usage = usage_path(model, shipped=False)
    usage.parent.mkdir(parents=True, exist_ok=True)
    usage.write_bytes(b"\xff\xfe not a usage file")

    async def run():
        app = make_app(model)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None, 20)
            await wait_for(pilot, lambda: any("usage history" in n for n in notices(app)), 5)
            shown = next(n for n in notices(app) if "usage history" in n)
            assert str(usage) in shown and "not a text usage file" in shown
    asyncio.run(run())
    assert usage.read_bytes() == b"\xff\xfe not a usage file"


# --- the wizard's verify step ------------------------------------------------------------------

@pytest.fixture
def wizard_env(dirs, monkeypatch):
    import models
    monkeypatch.setattr(models, "default_model", lambda: None)      # no demo: first run -> wizard
    return dirs


def _wizard_app():
    from colibri_tui.app import ColiApp
    from colibri_tui.settings import load
    return ColiApp(settings=load(), setup_wizard=True, engine_options={"threads": 1, "cap": 3})


async def _verify_folder(pilot, folder):
    from colibri_tui.wizard import SetupWizard
    app = pilot.app
    await wait_for(pilot, lambda: isinstance(app.screen, SetupWizard) and app.screen.query("#folder"))
    wiz = app.screen
    wiz.query_one("#folder").value = str(folder)
    await pilot.click("#use-folder")
    return wiz


def test_the_wizard_stops_on_a_damaged_shard_naming_it(container, wizard_env):
    model = wizard_env / "flipped"
    shutil.copytree(container, model)
    shard = sorted(model.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01                                    # one bit of the weights, past the header
    shard.write_bytes(bytes(data))

    async def run():
        app = _wizard_app()
        async with app.run_test(size=(130, 45)) as pilot:
            wiz = await _verify_folder(pilot, model)
            await wait_for(pilot, lambda: not wiz.running and str(wiz.query_one("#error").render()).strip())
            err = str(wiz.query_one("#error").render())
            assert shard.name in err and "checksum mismatch" in err and "Convert the model again" in err
            assert app.engine is None and wiz.query_one("#resume").display     # not opened, kept
    asyncio.run(run())
    assert shard.read_bytes() == bytes(data)


def test_the_wizard_checks_shards_then_goes_on_and_notes_unrecorded_ones(container, wizard_env, monkeypatch):
    from colibri_tui.app import ChatScreen
    from colibri_tui.wizard import SetupWizard
    intact, old = wizard_env / "intact", wizard_env / "old"
    shutil.copytree(container, intact)
    shutil.copytree(container, old)
    manifest = json.loads((old / "colibri.json").read_text())
    del manifest["checksums"]                          # as converted before checksums existed
    (old / "colibri.json").write_text(json.dumps(manifest))
    seen = []
    orig = SetupWizard._set

    def spy(self, **kw):                               # every verify line the step paints
        if "verify" in kw:
            seen.append(kw["verify"])
        orig(self, **kw)
    monkeypatch.setattr(SetupWizard, "_set", spy)

    async def run(folder):
        app = _wizard_app()
        async with app.run_test(size=(130, 45)) as pilot:
            await _verify_folder(pilot, folder)
            await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen) and app.engine is not None)
            return notices(app)
    shown = asyncio.run(run(intact))
    assert any(s.startswith("checking ") and ".safetensors" in s and "(100%)" in s for s in seen), seen
    assert any("shards intact" in s for s in seen) and not any("checksums" in n for n in shown)
    seen.clear()
    from colibri_tui.settings import config_path
    config_path().unlink()                     # the first run saved its model: the wizard again
    shown = asyncio.run(run(old))
    assert any("no checksums recorded" in n for n in shown), shown
    assert not any(".safetensors" in s for s in seen)             # nothing to hash


def test_cancel_during_the_shard_check_pauses_the_setup(container, wizard_env, monkeypatch):
    from colibri_tui.wizard import SetupWizard, load_state
    model = wizard_env / "big"
    shutil.copytree(container, model)
    orig = SetupWizard._set

    def cancel_at_first_progress(self, **kw):       # Cancel, as the first shard is being hashed
        if str(kw.get("verify", "")).startswith("checking ") and ".safetensors" in kw["verify"]:
            self.cancel_event.set()
        orig(self, **kw)
    monkeypatch.setattr(SetupWizard, "_set", cancel_at_first_progress)

    async def run():
        app = _wizard_app()
        async with app.run_test(size=(130, 45)) as pilot:
            wiz = await _verify_folder(pilot, model)
            await wait_for(pilot, lambda: not wiz.running and str(wiz.query_one("#error").render()).strip())
            assert "cancelled at verify: Resume continues" in str(wiz.query_one("#error").render())
            assert app.engine is None and wiz.query_one("#resume").display
    asyncio.run(run())
    assert load_state().step == "verify"


def test_a_reply_that_ends_before_its_widgets_mount_keeps_its_stats_line():
    """A fast reply can finish between the Markdown's mount and the stats label's (seen in CI:
    NoMatches '.meta'); set_meta reaches the label it composed, mounted or not."""
    from textual.app import App

    from colibri_tui.chatview import AssistantMessage

    class Host(App):
        def on_mount(self) -> None:
            m = AssistantMessage("done", streaming=True)
            self.children_made = list(m.compose())      # composed, not mounted
            m.set_meta("3 tokens · eos")

    async def run():
        app = Host()
        async with app.run_test() as pilot:
            await pilot.pause()
            assert str(app.children_made[-1].content) == "3 tokens · eos"
    asyncio.run(run())
