"""SVG snapshot tests of the main screens (pytest-textual-snapshot's ``snap_compare``).

Every screen is taken in a deterministic state: a fixed terminal size, a tiny converted model
(no reply is generated, so no timings), conversations pre-seeded with fixed stats, paths and
machine numbers (RAM, free disk) replaced by constants, cursor blinking off.

    pytest tests/test_snapshots.py                      # compare
    pytest tests/test_snapshots.py --snapshot-update    # accept the current rendering
    pytest tests/test_snapshots.py --snapshot-report snapshot_report.html   # see the diffs

The accepted SVGs live in tests/__snapshots__/test_snapshots/.
"""
from __future__ import annotations

import time
from collections import namedtuple
from pathlib import PurePosixPath

import pytest

from tests.conftest import tiny_app_container, wait_for

pytest.importorskip("textual")
pytest.importorskip("pytest_textual_snapshot")

SIZE = (120, 40)
GB = 10**9
# what the screens print instead of this machine's paths
CONFIG_FILE = PurePosixPath("/home/user/.config/colibri/config.toml")
MODELS_DIR = PurePosixPath("/home/user/.local/share/colibri/models")

@pytest.fixture(scope="module")
def container(tmp_path_factory):
    """A tiny real container, converted once; its folder name is what the header shows."""
    return tiny_app_container(tmp_path_factory.mktemp("snap"), "tiny-moe")


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """The user's files are never touched; the paths the screens print are constants."""
    monkeypatch.setenv("COLI_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("COLI_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for k in ("COLI_MODEL", "COLI_RAM_GB"):
        monkeypatch.delenv(k, raising=False)
    from colibri_tui import settings as settings_mod
    monkeypatch.setattr(settings_mod, "config_path", lambda: CONFIG_FILE)
    return tmp_path


def make_app(model=None, **kw):
    from colibri_tui.app import ColiApp
    from colibri_tui.settings import Settings
    return ColiApp(model_path=model, settings=Settings(), engine_options={"cap": 3, "threads": 1}, **kw)


async def steady(pilot, timeout=10.0):
    """No blinking cursors, and the screen has stopped changing (Markdown renders asynchronously):
    the screenshot must not depend on when it is taken or on how busy the machine is."""
    await pilot.pause()
    for screen in pilot.app.screen_stack:
        for w in screen.query("Input, TextArea"):
            w.cursor_blink = False
    # no focus, so no cursor: whether a cursor cell is drawn would otherwise race the last refresh
    pilot.app.set_focus(None)
    await pilot.wait_for_scheduled_animations()
    t0, last = time.monotonic(), None
    while time.monotonic() - t0 < timeout:
        await pilot.pause(0.15)
        shot = pilot.app.export_screenshot()
        if shot == last:
            return
        last = shot


async def ready(pilot):
    app = pilot.app
    await wait_for(pilot, lambda: app.engine is not None and not app.loading)
    await pilot.pause()


def test_chat_empty_with_model(container, dirs, snap_compare):
    """The chat screen right after start: a tiny model opened, an empty chat, the tier panel
    with the (idle) Brain map."""
    async def run_before(pilot):
        await ready(pilot)
        await steady(pilot)

    assert snap_compare(make_app(container), terminal_size=SIZE, run_before=run_before)


def test_brain_map_glm5_120x40(container, dirs, snap_compare):
    """The Brain map at GLM-5's size, 76 layers × 256 experts (a synthetic engine state, the
    stats of a reply): every layer and expert fit the tier panel in aggregate cells (3 layers ×
    7 experts each), one cell selected by a click and named under the map."""
    from tests.test_app_brainmap import push_glm5

    async def run_before(pilot):
        app = pilot.app
        await ready(pilot)
        push_glm5(app.tier_panel)
        await pilot.pause()
        bm = app.tier_panel.brain
        await pilot.click(bm, offset=(bm.gutter_width() + 18, 6))      # layers 36–38, experts 126–132
        await steady(pilot)

    assert snap_compare(make_app(container), terminal_size=SIZE, run_before=run_before)


def seed_history(data_dir):
    """Two chats with fixed content and stats; the older one is opened from the chat list."""
    from colibri_tui.history import History
    h = History(data_dir / "history.sqlite3")
    old = h.new_chat("Fibonacci in Python")
    h.add_message(old.id, "user", "Write a Python function for the n-th Fibonacci number.")
    h.add_message(old.id, "assistant",
                  "<think>An iterative version is simplest.</think>\n\n"
                  "Here is an **iterative** version:\n\n"
                  "```python\ndef fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
                  "    return a\n```\n\n"
                  "- runs in `O(n)` time\n- uses constant memory",
                  {"stats": {"new_tokens": 58, "decode_tok_s": 12.5, "ttft_s": 0.42, "hit_rate": 0.875,
                             "bytes_read": 12_345_678}, "reason": "eos"})
    h.add_message(old.id, "user", "And a recursive one?")
    h.add_message(old.id, "assistant", "Recursive, with a cache:\n\n"
                  "```python\nfrom functools import cache\n\n@cache\ndef fib(n):\n"
                  "    return n if n < 2 else fib(n - 1) + fib(n - 2)\n```",
                  {"stats": {"new_tokens": 31, "decode_tok_s": 11.0, "ttft_s": 0.38, "hit_rate": 0.9,
                             "bytes_read": 4_500_000}, "reason": "cancelled"})
    new = h.new_chat("Ciao mondo")
    h.add_message(new.id, "user", "ciao mondo")
    # fixed order, whatever the clock's resolution: "Ciao mondo" is the most recent
    with h.db:
        h.db.execute("UPDATE chats SET created = 1000, updated = 1000 WHERE id = ?", (old.id,))
        h.db.execute("UPDATE chats SET created = 2000, updated = 2000 WHERE id = ?", (new.id,))
    h.close()
    return old.id


def test_chat_loaded_from_history(container, dirs, snap_compare):
    """An earlier conversation picked from the chat list: user turns, Markdown replies with code,
    a collapsed thinking block and the stored per-reply stats."""
    old = seed_history(dirs / "data")

    async def run_before(pilot):
        app = pilot.app
        await ready(pilot)
        app.query_one("#chat-list").focus()
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: app.chat_id == old and len(app.query("AssistantMessage")) == 2)
        await steady(pilot)

    assert snap_compare(make_app(container), terminal_size=SIZE, run_before=run_before)


def test_settings_screen(container, dirs, snap_compare):
    """F5: the app settings (defaults) over the chat screen."""
    async def run_before(pilot):
        from colibri_tui.screens import SettingsScreen
        await ready(pilot)
        await pilot.press("f5")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen))
        await steady(pilot)

    assert snap_compare(make_app(container), terminal_size=SIZE, run_before=run_before)


def test_no_model_message(dirs, monkeypatch, snap_compare):
    """No model configured and no demo model: the explanation, over an empty chat."""
    import models
    monkeypatch.setattr(models, "default_model", lambda: None)

    async def run_before(pilot):
        from colibri_tui.screens import MessageScreen
        app = pilot.app
        await wait_for(pilot, lambda: isinstance(app.screen, MessageScreen) and app.screen.query("#message-body"))
        await steady(pilot)

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=run_before)


CATALOG = '''
[[models]]
repo = "acme/small-moe"
name = "Small MoE"
family = "qwen3_moe"
params_b = 6.9
active_b = 1.3
disk_gb = 4.0
download_gb = 13.8
active_expert_gb = 0.45
min_ram_gb = 2
note = "small and quick"
arch = { layers = 16, hidden = 2048, experts = 64, top_k = 8, expert_inter = 1024, heads = 16, kv_heads = 16, head_dim = 128, vocab = 50304, tied = false }

[[models]]
repo = "acme/medium-moe"
name = "Medium MoE"
family = "qwen3_moe"
params_b = 30.5
active_b = 3.3
disk_gb = 17.0
download_gb = 61.0
active_expert_gb = 0.8
min_ram_gb = 3
arch = { layers = 48, hidden = 2048, experts = 128, top_k = 8, expert_inter = 768, heads = 32, kv_heads = 4, head_dim = 128, vocab = 151936, tied = false }

[[models]]
repo = "acme/huge-moe"
name = "Huge MoE"
family = "qwen3_moe"
params_b = 235.1
active_b = 22.2
disk_gb = 130.0
download_gb = 470.0
active_expert_gb = 5.0
min_ram_gb = 40
arch = { layers = 94, hidden = 4096, experts = 128, top_k = 8, expert_inter = 1536, heads = 64, kv_heads = 4, head_dim = 128, vocab = 151936, tied = false }
'''


def test_setup_wizard_first_step(dirs, monkeypatch, snap_compare):
    """The wizard's first step (no model, no demo): the catalog with its per-row fit check, for a
    fixed machine (16 GB RAM, 12 GB available, 1000 GB free disk) and a fixed three-model catalog."""
    import psutil

    import models
    from colibri_tui import wizard
    from models import catalog
    monkeypatch.setattr(models, "default_model", lambda: None)
    toml = dirs / "catalog.toml"
    toml.write_text(CATALOG)
    monkeypatch.setattr(catalog, "CATALOG", toml)
    VM = namedtuple("VM", "total available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM(16 * GB, 12 * GB))
    monkeypatch.setattr(catalog, "free_disk", lambda directory: 1000 * GB)
    monkeypatch.setattr(wizard, "default_base_dir", lambda: MODELS_DIR)

    async def run_before(pilot):
        app = pilot.app
        await wait_for(pilot, lambda: isinstance(app.screen, wizard.SetupWizard) and app.screen.is_mounted
                       and app.screen.query_one("#catalog").row_count == 3)
        await steady(pilot)

    assert snap_compare(make_app(setup_wizard=True), terminal_size=SIZE, run_before=run_before)
