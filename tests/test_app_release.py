"""The chat app under release conditions: a long prefill that Esc and Ctrl+Q must cut short,
untrusted text (control bytes, markup) from the model and from saved chats, the clipboard
fallback, the export location, next/previous-chat keys. Real app (Textual Pilot), real models."""
from __future__ import annotations

import asyncio
import functools
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
    cfg = json.loads((DEMO / "config.json").read_text())
    cfg.update(num_hidden_layers=96, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
               max_position_embeddings=4096, eos_token_id=[cfg["vocab_size"] + 50])  # eos never sampled
    out = tmp_path_factory.mktemp("slow") / "slow-moe"
    write_random_container(out, cfg)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO / f, out / f)
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return tiny_app_container(tmp_path_factory.mktemp("app"), "c", unreachable_eos=True)


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("COLI_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("COLI_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("COLI_MODEL", raising=False)
    monkeypatch.delenv("COLI_RAM_GB", raising=False)
    return tmp_path


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
            t0 = time.monotonic()
            send_key(app, "escape")
            await wait_for(pilot, lambda: app.gen is None and app.prompt_input.text == "go", timeout=30)
            took = time.monotonic() - t0
            print(f"Esc during a {n}-token prefill: stopped in {took:.3f} s")
            assert took <= RESPONSE_S, f"Esc took {took:.2f} s during prefill"
            # nothing came back: the turn is undone and the prompt is back in the input
            assert [m.content for m in app.history.messages(chat)][-1] == LONG_TURN
            assert "stopped" in str(app.screen.query_one("#status").render())
    asyncio.run(run())


def test_ctrl_q_quits_during_a_long_prefill_at_once(slow_model, dirs):
    pressed = {}

    async def run():
        app = make_app(slow_model)
        async with app.run_test(size=(120, 40)) as pilot:
            await start_long_prefill(pilot)
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
