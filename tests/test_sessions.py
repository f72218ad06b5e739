"""Persisted sessions (issue 19): a chat's cache saved beside its history, so that reopening the
app continues a long chat without prefill. The demo model, real files, the real app under
Textual's Pilot. A cache that cannot be used -- corrupt bytes, a truncated file, another model,
another precision -- is recomputed with a one-line warning, never a wrong reply."""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from core.events import Stats, Token
from core.sampling import SamplingParams
from tests.conftest import open_engine, tiny_app_container, wait_for

GREEDY = SamplingParams(greedy=True)




def turn(engine, messages, n=10):
    toks, stats = [], None
    for ev in engine.generate(messages, GREEDY, max_new_tokens=n):
        if isinstance(ev, Token):
            toks.append(ev)
        elif isinstance(ev, Stats):
            stats = ev
    return [t.id for t in toks if t.id >= 0], "".join(t.text for t in toks), stats


FIRST = [{"role": "user", "content": "Tell me a fortune about a cat."}]


def second(reply: str) -> list[dict]:
    return FIRST + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And a dog?"}]


@pytest.fixture
def saved(demo, tmp_path):
    """A store holding chat 1's cache after one turn on the demo, and the turn-2 messages."""
    from core.sessions import SessionStore
    engine = open_engine(demo)
    _, reply, _ = turn(engine, FIRST)
    store = SessionStore(tmp_path / "caches")
    path = store.save(engine, 1)
    assert path == store.path(1) and path.is_file()
    return store, second(reply), engine


def test_a_restored_cache_gives_the_reply_of_the_same_session(saved, demo):
    """Bits: the turn after a restart is the turn the same process gives without one."""
    store, msgs, engine = saved
    same = turn(engine, msgs)
    fresh = open_engine(demo)
    r = store.restore(fresh, 1, fresh.prompt_ids(msgs))
    assert r.loaded and r.warning is None and r.positions > 10
    again = turn(fresh, msgs)
    assert again[0] == same[0] and again[2].cached_tokens == same[2].cached_tokens == r.positions
    assert not list(store.directory.glob("*.tmp")) and len(store.files()) == 1
    # memory has it now: the file is not read again
    assert not store.restore(fresh, 1, fresh.prompt_ids(msgs)).loaded


def test_the_file_is_bound_to_the_model_the_precision_and_intact_bytes(saved, demo, tmp_path):
    store, msgs, _ = saved
    good = store.path(1).read_bytes()

    def attempt(data: bytes | None, engine=None):
        if data is not None:
            store.path(1).write_bytes(data)
        engine = engine or open_engine(demo)
        r = store.restore(engine, 1, engine.prompt_ids(msgs))
        assert not r.loaded and r.warning and "\n" not in r.warning and "computed again" in r.warning
        # never a wrong reply: the turn is the one a fresh engine computes
        _, _, st = turn(engine, msgs)
        assert st.cached_tokens == 0
        return r.warning

    header = struct.unpack("<IQ", good[8:20])[1]
    flipped = bytearray(good)
    flipped[20 + header + 32 + 100] ^= 0x40               # one payload byte
    assert "checksum" in attempt(bytes(flipped))
    ids_at = good.index(b'"ids":[') + 7                   # a token id in the header
    flipped = bytearray(good)
    flipped[ids_at] = ord("9") if good[ids_at] != ord("9") else ord("8")
    assert "checksum mismatch (header)" in attempt(bytes(flipped))
    assert not store.path(1).exists()                     # a damaged file is gone
    assert "truncated" in attempt(good[: len(good) - 1000])
    assert "not a colibrì cache" in attempt(b"garbage" * 10)
    assert "version" in attempt(good[:8] + struct.pack("<I", 99) + good[12:])
    raw = b"[]"                                           # a well-formed header that is no header
    assert "damaged header" in attempt(good[:12] + struct.pack("<Q", len(raw)) + raw
                                       + __import__("hashlib").sha256(raw).digest())
    store.path(1).write_bytes(good)
    assert "float32 KV cache" in attempt(None, open_engine(demo, kv_cache="float16"))
    assert store.path(1).exists()                         # a mismatch is not damage: kept
    other = open_engine(str(tiny_app_container(tmp_path, "other")))
    r = store.restore(other, 1, list(range(1, 40)))
    assert not r.loaded and "another model" in r.warning
    # a format 1 file (written before the objects of format 2; the same bytes otherwise) still reads
    assert good[8:12] == struct.pack("<I", 2)
    store.path(1).write_bytes(good[:8] + struct.pack("<I", 1) + good[12:])
    fresh = open_engine(demo)
    assert store.restore(fresh, 1, fresh.prompt_ids(msgs)).loaded


def test_disk_budget_evicts_the_least_recently_used(demo, tmp_path):
    from core.sessions import SessionStore
    engine = open_engine(demo)
    store = SessionStore(tmp_path / "c")
    sizes = []
    for chat in (1, 2, 3):
        turn(engine, [{"role": "user", "content": f"Fortune number {chat}, please."}])
        p = store.save(engine, chat)
        os.utime(p, ns=(chat * 10 ** 18, chat * 10 ** 18))     # distinct times, in order
        sizes.append(p.stat().st_size)
    assert store.size() == (sum(sizes), 3)
    os.utime(store.path(1), ns=(4 * 10 ** 18, 4 * 10 ** 18))  # chat 1 used most recently
    store.budget_bytes = sizes[0] + 2 * sizes[2]          # chat 3 grows by less than twice
    turn(engine, [{"role": "user", "content": "Fortune number 3, please."}, {"role": "assistant", "content": "x"},
                  {"role": "user", "content": "more"}])
    store.save(engine, 3)                                 # chat 3 grows: chat 2 (oldest) goes
    assert sizes[0] + sizes[1] + store.path(3).stat().st_size > store.budget_bytes
    assert {p.name for p in store.files()} == {store.path(1).name, store.path(3).name}
    store.budget_bytes = 10                               # larger than the whole budget: not saved
    assert store.save(engine, 3) is None and not store.path(3).exists()
    store.delete(1)
    assert store.size() == (0, 0)


def test_settings_validate_the_cache_budget():
    from colibri_tui.settings import Settings, dumps, load
    Settings(session_cache_gb=0).validate()
    for bad in (-1, float("inf"), True):
        with pytest.raises(ValueError, match="saved chat caches"):
            Settings(session_cache_gb=bad).validate()
    text = dumps(Settings(prefix_cache=False, session_cache_gb=0.5))
    assert "prefix_cache = false" in text and "session_cache_gb = 0.5" in text


# --- the app -------------------------------------------------------------------------------------

def make_app(demo, **opts):
    from colibri_tui.app import ColiApp
    from colibri_tui.settings import Sampling, Settings
    return ColiApp(model_path=demo, settings=Settings(sampling=Sampling(temperature=0.0, max_new_tokens=8)),
                   engine_options={"threads": 1, **opts})


async def send(pilot, text: str) -> dict:
    app = pilot.app
    await wait_for(pilot, lambda: app.engine is not None and not app.loading, 30)
    n = len(app.history.messages(app.chat_id))
    app.prompt_input.focus()
    app.prompt_input.text = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.gen is None and len(app.history.messages(app.chat_id)) == n + 2, 60)
    msg = app.history.messages(app.chat_id)[-1]
    assert msg.role == "assistant"
    return {"text": msg.content, **msg.stats}


def notices(app) -> list[str]:
    return [str(n.message) for n in app._notifications]


def test_a_reopened_app_continues_the_chat_without_prefill(demo, dirs):
    from colibri_tui.settings import data_dir

    async def one_session(texts, **opts):
        app = make_app(demo, **opts)
        out = []
        async with app.run_test(size=(120, 40)) as pilot:
            for t in texts:
                out.append(await send(pilot, t))
            await pilot.pause(0.05)
            warned = notices(app)
        return out, None, warned, app

    import asyncio
    (first,), _, _, app = asyncio.run(one_session(["Tell me a fortune"]))
    cache = data_dir() / "caches" / f"chat-{app.chat_id}.kvc"
    assert cache.is_file()
    (after,), shown, warned, app2 = asyncio.run(one_session(["And another?"]))
    assert app2.chat_id == app.chat_id and not warned
    st = after["stats"]
    # no prefill of the earlier turn: its prompt and its reply came from the saved cache (all but
    # a token or two of the reply, re-tokenized), only the new turn's ~14 tokens were computed
    assert st["cached_tokens"] >= first["stats"]["prompt_tokens"] + first["stats"]["new_tokens"] - 3
    assert st["prompt_tokens"] - st["cached_tokens"] <= 16
    # the same two turns in one session (another data dir): the same reply
    os.environ["COLI_DATA_DIR"] = str(dirs / "data-one-session")
    try:
        (a, b), _, _, _ = asyncio.run(one_session(["Tell me a fortune", "And another?"]))
    finally:
        os.environ["COLI_DATA_DIR"] = str(dirs / "data")
    assert a["text"] == first["text"] and b["text"] == after["text"]
    assert b["stats"]["cached_tokens"] == st["cached_tokens"]

    # corrupt the saved cache: the app warns in one line and computes the conversation again
    data = bytearray(cache.read_bytes())
    data[-50] ^= 0xFF
    cache.write_bytes(bytes(data))
    (third,), _, warned, _ = asyncio.run(one_session(["A third?"]))
    assert any("damaged" in w and "computed again" in w for w in warned), warned
    assert third["stats"]["cached_tokens"] == 0 and third["text"]
    assert cache.is_file()                                          # saved again after the turn

    # --no-prefix-cache: nothing restored, nothing saved
    cache.unlink()
    (fourth,), _, warned, _ = asyncio.run(one_session(["A fourth?"], prefix_cache=False))
    assert fourth["stats"]["cached_tokens"] == 0 and not cache.exists()


def test_settings_show_the_saved_caches_and_switch_reuse_off(demo, dirs):
    import asyncio

    async def go():
        app = make_app(demo)
        async with app.run_test(size=(120, 40)) as pilot:
            await send(pilot, "Tell me a fortune")
            assert len(app.engine.prefixes) == 1
            app.action_settings()
            await pilot.pause(0.1)
            from textual.widgets import Checkbox, Input, Label
            screen = app.screen
            note = str(screen.query_one("#cache_note", Label).render())
            assert "in 1 file" in note and "KB" in note, note
            assert screen.query_one("#session_cache_gb", Input).value == "2"
            screen.query_one("#prefix_cache", Checkbox).value = False
            await pilot.click("#save")
            await pilot.pause(0.1)
            assert app.settings.prefix_cache is False and app.engine.prefix_cache is False
            assert len(app.engine.prefixes) == 0
            st = await send(pilot, "Another")
            assert st["stats"]["cached_tokens"] == 0
            # F8: deleting the chat deletes its saved cache
            chat = app.chat_id
            assert app.sessions.path(chat).is_file()
            app.action_delete_chat()
            await pilot.pause(0.1)
            await pilot.press("y")
            await wait_for(pilot, lambda: app.chat_id != chat, 10)
            assert not app.sessions.path(chat).exists()
    asyncio.run(go())


def test_the_chat_flag_and_the_meta_line():
    from colibri_tui.app import fmt_meta
    from colibri_tui.app_cli import engine_options
    from colibri_tui.cli import build_parser
    p = build_parser()
    assert engine_options(p.parse_args(["chat", "--no-prefix-cache"]))["prefix_cache"] is False
    assert "prefix_cache" not in engine_options(p.parse_args(["chat"]))
    line = fmt_meta({"new_tokens": 3, "prompt_tokens": 50, "cached_tokens": 40, "ttft_s": 0.1}, "eos")
    assert "40 of 50 prompt tokens cached" in line
    assert "cached" not in fmt_meta({"new_tokens": 3, "prompt_tokens": 50, "ttft_s": 0.1}, "eos")


def test_a_linear_attention_state_and_its_checkpoint_are_saved_too(fixture_root, containers, tmp_path):
    """qwen3_5_moe keeps conv and recurrent state (not truncatable): the file holds it and the
    checkpoint at the prompt's end, so after a restart the next turn is continued at the same
    point the same session continues it, with the same reply; damaged state bytes are refused."""
    from core.sessions import SessionStore
    from models.registry import supported_types
    if "qwen3_5_moe" not in supported_types() or not (fixture_root / "qwen35moe-a").is_dir():
        pytest.skip("no linear-attention family or fixture here")
    path = containers("qwen35moe-a", 16)
    ids = np.load(fixture_root / "qwen35moe-a" / "reference.npz")["ids"].tolist()
    one = open_engine(path)
    r1 = turn(one, ids[:10], 4)[0]
    store = SessionStore(tmp_path / "caches")
    assert store.save(one, "lin") is not None
    for follow in (ids[:10] + [(t + 1) % one.spec.vocab_size for t in r1] + ids[10:20],   # at the checkpoint
                   ids[:10] + r1[:-1] + ids[10:16]):                                  # at the end
        same = open_engine(path)
        turn(same, ids[:10], 4)
        want = turn(same, follow, 4)
        other = open_engine(path)
        r = store.restore(other, "lin", follow)
        assert r.loaded and r.positions == want[2].cached_tokens > 0
        got = turn(other, follow, 4)
        assert got[0] == want[0] and got[2].cached_tokens == want[2].cached_tokens
    data = bytearray(store.path("lin").read_bytes())
    data[-8] ^= 0x10                                      # inside the checkpoint's state
    store.path("lin").write_bytes(bytes(data))
    r = store.restore(open_engine(path), "lin", ids[:12])
    assert not r.loaded and "checksum" in r.warning


def test_a_dsv4_cache_continues_after_a_restart_with_the_same_logits(fixture_root, containers, tmp_path):
    """DeepSeek V4 (dsv4-a: window 8, CSA ratio 4 with its indexer, HCA ratio 8): the ring and the
    compressors' objects -- entries, the open block's rows, the overlap half -- and their
    checkpoint at the prompt's end go into the file (format 2, objects by kind and version); a
    reopened chat continues without prefill, at the checkpoint or at the end, with the reply and
    the logits of the uninterrupted session; another kind version or damaged object bytes are
    computed again."""
    import json

    from core.sessions import FORMAT, MAGIC, SessionStore
    path = containers("dsv4-a", 16)
    ids = np.load(fixture_root / "dsv4-a" / "reference.npz")["ids"].tolist()
    one = open_engine(path)
    r1 = turn(one, ids[:11], 4)[0]             # 14 positions: blocks open in every compressor
    store = SessionStore(tmp_path / "caches")
    assert store.save(one, "v4") is not None
    raw = store.path("v4").read_bytes()
    size = struct.unpack("<Q", raw[len(MAGIC) + 4: len(MAGIC) + 12])[0]
    header = json.loads(raw[len(MAGIC) + 12: len(MAGIC) + 12 + size])
    assert header["format"] == FORMAT == 2 and header["checkpoint"]
    assert header["objects"][1] == [["compressor", 1, [["entries", [3, 16], "float32"], ["kv", [4, 32], "float32"],
                                                       ["gate", [4, 32], "float32"], ["prior_kv", [4, 16], "float32"],
                                                       ["prior_gate", [4, 16], "float32"]]],
                                    ["indexer", 1, [["entries", [3, 16], "float32"], ["kv", [4, 32], "float32"],
                                                    ["gate", [4, 32], "float32"], ["prior_kv", [4, 16], "float32"],
                                                    ["prior_gate", [4, 16], "float32"]]]]
    assert header["objects"][0] == [] and header["objects"][2][0][2][0] == ["entries", [1, 16], "float32"]
    V = one.spec.vocab_size
    for follow in (ids[:11] + [(t + 1) % V for t in r1] + ids[11:20],    # at the checkpoint
                   ids[:11] + r1[:-1] + ids[11:17]):                    # at the end
        same = open_engine(path)
        turn(same, ids[:11], 4)
        want = turn(same, follow, 4)
        other = open_engine(path)
        r = store.restore(other, "v4", follow)
        assert r.loaded and r.positions == want[2].cached_tokens > 0
        got = turn(other, follow, 4)
        assert got[0] == want[0] and got[2].cached_tokens == want[2].cached_tokens
    # the logits: the restored cache's next pass against the uninterrupted one's, bit for bit
    other = open_engine(path)
    assert store.restore(other, "v4", ids[:11] + r1[:-1] + ids[11:13]).loaded
    a, b = one.prefixes.latest().cache, other.prefixes.latest().cache
    assert a.length == b.length == 14
    nxt = np.asarray(ids[11:16], np.int64)
    np.testing.assert_array_equal(one.forward(nxt, a, all_logits=True), other.forward(nxt, b, all_logits=True))
    # another kind version: another layout, computed again (never misread)
    from models.deepseek_v4 import Compressed
    Compressed.version = 2
    try:
        r = store.restore(open_engine(path), "v4", ids[:12])
    finally:
        Compressed.version = 1
    assert not r.loaded and "do not match" in r.warning and not store.path("v4").exists()
    again = open_engine(path)
    turn(again, ids[:11], 4)
    assert store.save(again, "v4") is not None
    data = bytearray(store.path("v4").read_bytes())
    data[-8] ^= 0x10                                      # inside the compressors' checkpoint
    store.path("v4").write_bytes(bytes(data))
    r = store.restore(open_engine(path), "v4", ids[:12])
    assert not r.loaded and "checksum" in r.warning
