"""Prompt-prefix reuse (issue 19): a generation computes only the positions after the longest
prefix its prompt shares with a cache the engine kept. On the demo model and the oracle
fixtures, through Engine.generate as the app and the server call it.

The bit policy (README, "Warm conversations"): with reuse on, a turn's cached positions carry
the bits of the passes that computed them (the previous reply's tokens: decode steps), so a
reply may differ from a fresh recompute by float rounding -- never in the argmax on the oracle
fixtures -- and is the same for every placement and thread count; with reuse off, every
generation is today's fresh prefill, bit for bit."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from core.errors import ColiError
from core.events import Done, Stats, Token
from core.sampling import SamplingParams

from tests.conftest import open_engine  # noqa: E402

GREEDY = SamplingParams(greedy=True)
FOLLOW_UPS = ("Tell me a fortune about a cat.", "And one about a dog, please.", "A last one, longer.")




class Recorder:
    """Wraps engine.forward: the positions each pass computed and the logits it returned."""

    def __init__(self, engine):
        self.passes, self.logits = [], []
        inner = engine.forward

        def forward(ids, cache, all_logits=False):
            out = inner(ids, cache, all_logits)
            self.passes.append(len(ids))
            self.logits.append(out.copy())
            return out
        engine.forward = forward


def turn(engine, messages, n=12, sampling=GREEDY, **kw):
    toks, stats, done = [], None, None
    for ev in engine.generate(messages, sampling, max_new_tokens=n, **kw):
        if isinstance(ev, Token):
            toks.append(ev)
        elif isinstance(ev, Stats):
            stats = ev
        elif isinstance(ev, Done):
            done = ev
    return [t.id for t in toks if t.id >= 0], "".join(t.text for t in toks), stats, done


def conversation(engine, n=12):
    """Three turns, each the previous conversation + the reply + a new user message."""
    msgs, out = [], []
    for text in FOLLOW_UPS:
        msgs.append({"role": "user", "content": text})
        ids, reply, stats, _ = turn(engine, msgs, n)
        out.append((ids, stats.prompt_tokens, stats.cached_tokens))
        msgs.append({"role": "assistant", "content": reply})
    return out


def test_turn_two_prefills_only_its_new_tokens(demo):
    engine = open_engine(demo)
    rec = Recorder(engine)
    msgs = [{"role": "user", "content": FOLLOW_UPS[0]}]
    ids1, reply, st1, _ = turn(engine, msgs)
    assert st1.cached_tokens == 0 and rec.passes[0] == st1.prompt_tokens
    rec.passes.clear()
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": FOLLOW_UPS[1]}]
    _, _, st2, _ = turn(engine, msgs)
    prompt2 = engine.prompt_ids(msgs)
    # the cache held turn 1's prompt and every reply token fed back (not the last sampled one)
    assert st2.cached_tokens >= st1.prompt_tokens + len(ids1) - 1
    assert st2.prompt_tokens == len(prompt2) and st2.as_dict()["cached_tokens"] == st2.cached_tokens
    assert rec.passes[0] == len(prompt2) - st2.cached_tokens       # the prefill: the new tokens only
    assert sum(rec.passes) == len(prompt2) - st2.cached_tokens + st2.new_tokens - 1


def test_reuse_off_gives_todays_bits(demo):
    """--no-prefix-cache: every turn is the fresh prefill a new engine gives, tokens and logits."""
    engine = open_engine(demo)
    engine.prefix_cache = False
    rec = Recorder(engine)
    msgs = []
    for text in FOLLOW_UPS[:2]:
        msgs.append({"role": "user", "content": text})
        start = len(rec.logits)
        ids, reply, stats, _ = turn(engine, msgs)
        assert stats.cached_tokens == 0 and rec.passes[start] == stats.prompt_tokens
        fresh = open_engine(demo)
        frec = Recorder(fresh)
        assert turn(fresh, msgs)[0] == ids
        for a, b in zip(rec.logits[start:], frec.logits):
            np.testing.assert_array_equal(a, b)
        msgs.append({"role": "assistant", "content": reply})
    assert len(engine.prefixes) == 0


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_placement_law_holds_with_reuse(demo, kv):
    """A multi-turn conversation with reuse: --cap 1 and 2 threads give the tokens and logits of
    1 thread with every expert resident."""
    runs = {}
    for name, kw in {"resident": {}, "cap1": dict(cap=1), "threads2": dict(threads=2)}.items():
        engine = open_engine(demo, kv_cache=kv, **kw)
        rec = Recorder(engine)
        runs[name] = (conversation(engine), rec.logits)
    base_turns, base_logits = runs["resident"]
    assert all(cached > 0 for _, _, cached in base_turns[1:])
    for name in ("cap1", "threads2"):
        turns, logits = runs[name]
        assert turns == base_turns, name
        assert len(logits) == len(base_logits)
        for a, b in zip(logits, base_logits):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_reuse_is_close_to_a_recompute_on_the_demo(demo):
    """The documented difference: the same conversation with and without reuse, greedy, gives
    the same replies on the demo model (the logits differ by float rounding at most)."""
    on, off = open_engine(demo), open_engine(demo)
    off.prefix_cache = False
    a, b = conversation(on), conversation(off)
    assert [t[0] for t in a] == [t[0] for t in b]
    assert [t[1] for t in a] == [t[1] for t in b]
    assert a[2][2] > 0 and b[2][2] == 0


def test_argmax_of_every_position_is_the_same_on_the_oracle_fixtures(fixture_root, containers):
    """Reuse composes a prompt's positions from several passes: a batched prefill, decode steps
    (the previous reply), the new tokens' prefill after a truncation. On each foundation oracle
    fixture (converted --bits 4 and 16) the argmax of every position equals the one-pass
    teacher-forced logits'."""
    from core.prefix_cache import PrefixPool
    from models import open_model
    from tests.conftest import FOUNDATION_FIXTURES
    checked = 0
    for name in FOUNDATION_FIXTURES:
        ids = np.load(fixture_root / name / "reference.npz")["ids"].tolist()
        for bits in (4, 16):
            engine = open_model(containers(name, bits), threads=1)
            engine.usage_file = None
            T = len(ids)
            k, m = max(2, T // 3), max(3, 2 * T // 3)
            whole = engine.logits(ids)
            cache = engine.new_cache()
            parts = [engine.forward(ids[:k], cache, all_logits=True)]           # turn 1's prefill
            parts += [engine.forward([t], cache, all_logits=True) for t in ids[k:m + 2]]   # its reply
            pool = PrefixPool(1 << 40)
            pool.put(ids[:m + 2], cache)
            # the next prompt shares ids[:m] (the reply's last tokens re-tokenized otherwise)
            nxt = ids[:m] + [(t + 1) % engine.spec.vocab_size for t in ids[m:]]
            reused, n, _ = pool.take(nxt, engine.new_cache)
            assert n == m and reused is cache and cache.length == m
            tail = engine.forward(nxt[m:], cache, all_logits=True)
            got = np.concatenate(parts)[:m]
            assert (got.argmax(-1) == whole[:m].argmax(-1)).all(), (name, bits)
            fresh = engine.logits(nxt)
            assert (tail.argmax(-1) == fresh[m:].argmax(-1)).all(), (name, bits)
            np.testing.assert_allclose(tail, fresh[m:], rtol=1e-3, atol=1e-3)
            engine.store.close()
            checked += 1
    assert checked >= 2


def test_the_same_prompt_again_gives_the_same_reply_computing_nothing(demo):
    """A prompt the cache holds whole (its own turn's): the prompt's last logits were kept, so
    no position is computed again and a seeded sample is the first one's."""
    engine = open_engine(demo)
    rec = Recorder(engine)
    params = SamplingParams(temperature=0.8, seed=11)
    a = turn(engine, "Tell me a fortune", 10, params)
    rec.passes.clear()
    b = turn(engine, "Tell me a fortune", 10, SamplingParams(temperature=0.8, seed=11))
    assert a[0] == b[0] and b[2].cached_tokens == b[2].prompt_tokens
    assert all(p == 1 for p in rec.passes) and len(rec.passes) == b[2].new_tokens - 1


def test_a_shorter_prompt_and_a_branch(demo):
    """A prompt the cache holds all of but its own (a prefix of an earlier one) recomputes its last
    position; a prompt branching off early copies the prefix and keeps the other entry."""
    engine = open_engine(demo)
    base = list(range(20, 120))
    turn(engine, base, 4)
    _, _, st, _ = turn(engine, base[:50], 4)
    assert st.cached_tokens == 49                          # the last position computed again
    assert len(engine.prefixes) == 1                       # truncated in place: 1 + 3 tokens lost
    turn(engine, base + [7] * 100, 4)                      # one long entry again
    _, _, st, _ = turn(engine, base[:10] + [9] * 5, 4)     # branch: 190 positions would go
    assert st.cached_tokens == 10 and len(engine.prefixes) == 2


def test_the_pool_is_bounded_by_the_reserved_cache_memory(demo):
    from core.prefix_cache import cache_nbytes
    engine = open_engine(demo)
    assert engine.prefixes.budget_bytes == engine.plan.kv_reserved_bytes > 0
    engine.prefixes.budget_bytes = 1          # nothing fits: only the newest is kept
    turn(engine, list(range(30, 60)), 3)
    first = engine.prefixes.latest().cache.k[0]
    turn(engine, list(range(300, 340)), 3)
    assert len(engine.prefixes) == 1 and engine.prefixes.latest().ids[0] == 300
    # the evicted one left before the new prompt's cache was made, which writes over its memory
    assert engine.prefixes.latest().cache.k[0] is first
    engine.prefixes.budget_bytes = 10 ** 12
    for i in range(6):
        turn(engine, [500 + i] * 20, 2)
    assert len(engine.prefixes) == engine.prefix_cache_entries
    assert engine.prefixes.nbytes() == sum(cache_nbytes(e.cache) for e in engine.prefixes.entries)


def test_a_kind_that_cannot_truncate_is_only_continued_at_its_end(demo):
    """The interface for a recurrent or conv state: truncatable = False on a kind makes the pool
    reuse an entry only when the prompt extends all of it."""
    from core.prefix_cache import PrefixPool, can_truncate

    class State:
        truncatable = False
    spec = type("Spec", (), {"cache_kinds": [State()]})()
    assert not can_truncate(spec)
    engine = open_engine(demo)
    assert can_truncate(engine.spec)
    pool = PrefixPool(1 << 40, truncatable=False)
    cache = engine.new_cache()
    engine.forward([5, 6, 7, 8], cache)
    pool.put([5, 6, 7, 8], cache)
    assert pool.take([5, 6, 9, 9], engine.new_cache)[1] == 0      # would need a truncation
    got, n, _ = pool.take([5, 6, 7, 8, 1, 2], engine.new_cache)
    assert n == 4 and got is cache


def test_a_cancelled_prefill_keeps_only_whole_passes(demo):
    """A generation cancelled inside its prefill keeps the positions its finished passes
    committed, never a partial one; the next turn computes the rest, like a fresh run."""
    engine = open_engine(demo)
    engine.PREFILL_CHUNK = 64
    prompt = list(range(5, 305))
    flag = threading.Event()
    gen = engine.generate(prompt, GREEDY, max_new_tokens=4, cancel=flag)
    inner = engine.forward

    def forward(ids, cache, all_logits=False):
        if cache.length >= 128:
            flag.set()
        return inner(ids, cache, all_logits)
    engine.forward = forward
    events = list(gen)
    engine.forward = inner
    assert events[-1].reason == "cancelled"
    entry = engine.prefixes.latest()
    assert entry.ids == prompt[: entry.cache.length] and entry.cache.length == 128
    ids, _, st, _ = turn(engine, prompt, 4)
    assert st.cached_tokens == 128
    fresh = open_engine(demo)
    fresh.PREFILL_CHUNK = 64
    assert turn(fresh, prompt, 4)[0] == ids


def test_cancel_is_per_generation_and_generate_checks_at_the_call(demo):
    engine = open_engine(demo)
    with pytest.raises(ColiError, match="empty prompt"):
        engine.generate([])                       # at the call, not at the first next()
    with pytest.raises(ColiError, match="max_position_embeddings"):
        engine.generate([1] * (engine.spec.max_position_embeddings + 1))
    other = threading.Event()
    other.set()                                   # another generation's flag: not this one's
    got = turn(engine, "Tell me a fortune", 5, cancel=threading.Event())
    assert got[3].reason in ("length", "eos") and got[2].new_tokens >= 1
    mine = threading.Event()
    gen = engine.generate("Tell me a fortune", GREEDY, max_new_tokens=50, cancel=mine)
    n = 0
    for ev in gen:
        if isinstance(ev, Token) and ev.id >= 0:
            n += 1
            if n == 2:
                mine.set()
        last = ev
    assert last.reason == "cancelled" and n <= 3
    # engine.cancel() still stops the running generation (its own flag)
    gen = engine.generate("Tell me a fortune", GREEDY, max_new_tokens=50)
    for ev in gen:
        if isinstance(ev, Token):
            engine.cancel()
        last = ev
    assert last.reason == "cancelled"


def test_done_names_the_stop_string_that_matched(demo):
    engine = open_engine(demo)
    engine.prefix_cache = False
    _, text, _, _ = turn(engine, "Tell me a fortune", 20)
    assert len(text) > 6
    stop = text[3:6]
    _, got, _, done = turn(engine, "Tell me a fortune", 20, stop=["@@never@@", stop])
    assert done.reason == "stop" and done.stop == stop and got == text[: text.find(stop)]
    assert turn(engine, "Tell me a fortune", 3)[3].stop is None


def test_a_new_prompt_makes_room_in_the_pool_first(demo):
    """The pool and the cache a generation starts with stay within the budget: older entries
    leave before the new prompt is prefilled, the entry it continues never."""
    engine = open_engine(demo)
    per = engine.prefixes.bytes_per_position
    assert per > 0
    for i in range(3):
        turn(engine, [600 + i] * 100, 2)                 # three entries of 101 positions
    assert len(engine.prefixes) == 3
    engine.prefixes.budget_bytes = 330 * per
    seen = []
    inner = engine.forward

    def forward(ids, cache, all_logits=False):
        seen.append(engine.prefixes.nbytes() + (cache.length + len(ids)) * per)
        return inner(ids, cache, all_logits)
    engine.forward = forward
    turn(engine, [700] * 150, 2)                         # 150 new: two old entries must go
    assert seen[0] <= engine.prefixes.budget_bytes
    assert [e.ids[0] for e in engine.prefixes.entries] == [602, 700]
    _, _, st, _ = turn(engine, [602] * 100 + [5] * 200, 2)    # continues 602, evicts 700 first
    assert st.cached_tokens == 100 and [e.ids[0] for e in engine.prefixes.entries] == [602]


def test_a_state_that_cannot_truncate_continues_at_its_end_or_its_checkpoint(fixture_root, containers):
    """A linear-attention model (qwen3_5_moe: conv and recurrent state, truncatable = False): its
    cache is continued where the state is known -- the end of the entry, or the checkpoint taken
    when the prompt was prefilled (a chat's turn boundary) -- and the replies are a fresh run's."""
    from models.registry import supported_types
    if "qwen3_5_moe" not in supported_types() or not (fixture_root / "qwen35moe-a").is_dir():
        pytest.skip("no linear-attention family or fixture here")
    from models import open_model
    path = containers("qwen35moe-a", 16)
    engine = open_model(path, threads=1)
    engine.usage_file = None
    assert not engine.prefixes.truncatable
    fresh = open_model(path, threads=1)
    fresh.prefix_cache = False
    ids = np.load(fixture_root / "qwen35moe-a" / "reference.npz")["ids"].tolist()
    V = engine.spec.vocab_size
    p1 = ids[:10]
    r1, _, st, _ = turn(engine, p1, 4)
    assert st.cached_tokens == 0
    # the reply comes back re-tokenized otherwise: only the checkpoint at the prompt's end is known
    p2 = p1 + [(t + 1) % V for t in r1] + ids[10:20]
    r2, _, st, _ = turn(engine, p2, 4)
    assert st.cached_tokens == 10 and r2 == turn(fresh, p2, 4)[0]
    # the next prompt extends the whole entry (the reply's fed tokens): continued at its end
    p3 = p2 + r2[:-1] + ids[20:26]
    r3, _, st, _ = turn(engine, p3, 4)
    assert st.cached_tokens == len(p2) + len(r2) - 1 and r3 == turn(fresh, p3, 4)[0]
    # a prompt branching inside the entry, before its checkpoint: nothing reused
    _, _, st, _ = turn(engine, p3[:5] + [1, 2, 3], 2)
    assert st.cached_tokens == 0
    # the same prompt again: the checkpoint and the kept logits, nothing computed
    again, _, st, _ = turn(engine, p3[:5] + [1, 2, 3], 2)
    assert st.cached_tokens == 8


def test_checkpoints_put_the_state_back_with_the_rows():
    """The pool's checkpoint path on a cache of one layer with a growing array and a fixed state
    (the kinds checkpoint and restore themselves: core.cache_kinds)."""
    from core.arch import ArchSpec
    from core.cache import KVCache
    from core.cache_kinds import KV, Recurrent
    from core.prefix_cache import PrefixPool
    spec = ArchSpec(vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2,
                    rms_norm_eps=1e-6, mlp_kinds=["moe"], num_experts=2, top_k=1, norm_topk_prob=False,
                    cache_kinds=[(KV(1, 2), Recurrent(1, 1, 3))])

    def feed(c, ids):                      # rows = ids, the state sums them
        for t in ids:
            c.append(0, np.full((1, 1, 2), t, np.float32), np.zeros((1, 1, 2), np.float32))
            c.state[0]["recurrent"] += t
            c.length += 1
        c.folded = [c.length]

    c = KVCache(spec)
    assert not c.truncatable
    feed(c, [1, 2, 3])
    ck = c.checkpoint()
    feed(c, [4, 5])
    pool = PrefixPool(1 << 30, truncatable=False)
    pool.put([1, 2, 3, 4, 5], c, prompt_len=3, logits=np.zeros(4), checkpoint=ck)
    got, n, logits = pool.take([1, 2, 3, 9, 9], lambda: KVCache(spec))
    assert got is c and n == 3 and logits is None
    assert c.length == 3 and c.folded == [3] and c.state[0]["recurrent"].ravel().tolist() == [6, 6, 6]
    assert c.k[0][0, :3, 0].tolist() == [1, 2, 3]
    assert ck[0]["recurrent"] is not c.state[0]["recurrent"]     # a copy: the next turn writes the live state
    assert KVCache(ArchSpec(**{**vars(spec), "cache_kinds": [KV(1, 2)]})).checkpoint() is None
