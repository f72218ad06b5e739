"""Routing traces, the .coli_usage history, and offline policy replay against Belady/MIN."""
import argparse
import json
import random

import pytest

from core.errors import ColiError
from core.policies import LFRU, LRU, Markov, Pinned, make_policy
from core.replay import DEFAULT_POLICIES, belady, first_half, replay, simulate
from core.trace import Trace, TraceWriter, read_trace, requests_per_layer
from core.usage import counts_from_trace, engine_hash, load_usage, save_usage


# ---------------------------------------------------------------- helpers

def random_requests(rng, n, experts, k):
    return [tuple(rng.sample(range(experts), k)) for _ in range(n)]


def zipf_requests(rng, n, experts, k, s=1.2):
    weights = [1 / (r + 1) ** s for r in range(experts)]
    perm = list(range(experts))
    rng.shuffle(perm)  # the hot experts are not simply the low ids
    out = []
    for _ in range(n):
        chosen = []
        while len(chosen) < k:
            e = perm[rng.choices(range(experts), weights)[0]]
            if e not in chosen:
                chosen.append(e)
        out.append(tuple(chosen))
    return out


def write_trace(path, layers, experts, k, per_layer):
    """per_layer: {layer: [requests]} (same number of requests per layer)."""
    n = len(next(iter(per_layer.values())))
    with TraceWriter(path, layers, experts, k) as w:
        for pos in range(n):
            for layer in sorted(per_layer):
                w.record(pos, layer, per_layer[layer][pos])
    return path


def serve(resident, req, cap, pinned, choices):
    """All ways the live store can serve ``req`` (written independently of core.replay): hits are
    the experts resident on arrival; misses take slots in order, evicting a resident expert that
    is neither pinned nor an unconsumed expert of the request; if there is none, the caller
    consumes the next expert (hits first, then loaded misses) and its slot is reused.
    ``choices(candidates)`` -> the victims to explore. Yields (hits, resident after, consumed order)."""
    hits = [e for e in req if e in resident]
    misses = [e for e in req if e not in resident]

    def go(i, res, unconsumed, queue):
        if i == len(misses):
            yield len(hits), frozenset(res), queue
            return
        e = misses[i]
        if len(res) < cap:
            yield from go(i + 1, res | {e}, unconsumed, queue + [e])
            return
        free = sorted(r for r in res if r not in unconsumed and r not in pinned)
        q = list(queue)
        while not free:
            c = q.pop(0)
            unconsumed = unconsumed - {c}
            free = [c] if c not in pinned else []
        for v in choices(free):
            yield from go(i + 1, (res - {v}) | {e}, unconsumed, q + [e])

    yield from go(0, frozenset(resident), frozenset(req), list(hits))


def brute_lru(requests, cap):
    """LRU with request-granularity timestamps (ties: lowest id) on the store's rules."""
    stamp, hits, n = {}, 0, 0
    for t, req in enumerate(requests):
        n += len(req)
        pick = lambda free: [min(free, key=lambda r: (stamp.get(r, t), r))]
        (h, res, _), = serve(set(stamp), req, cap, set(), pick)
        hits += h
        stamp = {e: (t if e in req else stamp[e]) for e in res}
    return hits, n


def brute_optimum(requests, cap):
    """The most hits any eviction choices can get on the store's rules (exhaustive)."""
    from functools import lru_cache

    @lru_cache(None)
    def best(t, res):
        if t == len(requests):
            return 0
        return max(h + best(t + 1, r) for h, r, _ in serve(res, requests[t], cap, set(), lambda f: f))
    return best(0, frozenset())


# ---------------------------------------------------------------- traces

def test_trace_round_trip(tmp_path):
    p = tmp_path / "t.trace"
    recs = [(0, 0, (3, 1)), (0, 1, (2, 0)), (1, 0, (1, 4)), (1, 1, (0, 5)), (2, 0, (4,))]
    w = TraceWriter(p, layers=2, experts=6, top_k=2)
    assert not p.exists()  # appears only on close
    for r in recs:
        w.record(*r)
    w.close()
    w.close()  # idempotent
    assert p.read_text().splitlines()[0] == "# colibri-trace 1 layers=2 experts=6 top_k=2"
    assert p.read_text().splitlines()[1] == "0 0 3 1"
    t = read_trace(p)
    assert (t.layers, t.experts, t.top_k) == (2, 6, 2)
    assert t.records == recs
    assert t.positions == 3
    assert requests_per_layer(t) == {0: [(3, 1), (1, 4), (4,)], 1: [(2, 0), (0, 5)]}
    assert [f.name for f in tmp_path.iterdir()] == ["t.trace"]  # no temp file left


def test_trace_writer_accepts_numpy_like_ints_and_rejects_bad_records(tmp_path):
    np = pytest.importorskip("numpy")
    with TraceWriter(tmp_path / "t", 2, 6, 2) as w:
        w.record(np.int64(0), np.int32(1), np.array([5, 2]))
        for bad in [(0, 2, (1,)), (0, 0, (6,)), (0, 0, (1, 1)), (0, 0, ()), (0, 0, (1, 2, 3)), (-1, 0, (1,))]:
            with pytest.raises(ValueError):
                w.record(*bad)
    assert read_trace(tmp_path / "t").records == [(0, 1, (5, 2))]


def test_trace_writer_abort_and_bad_dir(tmp_path):
    p = tmp_path / "t"
    w = TraceWriter(p, 1, 4, 2)
    w.record(0, 0, (1, 2))
    w.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ColiError, match="cannot write trace"):
        TraceWriter(tmp_path / "missing" / "t", 1, 4, 2)


@pytest.mark.parametrize("text, line, what", [
    ("", None, "empty"),
    ("hello\n", 1, "not a colibri trace"),
    ("# colibri-trace 2 layers=1 experts=4 top_k=2\n", 1, "version 2"),
    ("# colibri-trace 1 layers=1 experts=4\n", 1, "top_k"),
    ("# colibri-trace 1 layers=1 experts=4 top_k=2\n0 0 1\n0 0 x\n", 3, "non-integer"),
    ("# colibri-trace 1 layers=1 experts=4 top_k=2\n0 0 1\n\n1 1 2\n", 4, "layer 1"),
    ("# colibri-trace 1 layers=1 experts=4 top_k=2\n0 0 9\n", 2, "expert 9"),
    ("# colibri-trace 1 layers=1 experts=4 top_k=2\n0 0 1 2 3\n", 2, "top_k is 2"),
    ("# colibri-trace 1 layers=1 experts=4 top_k=2\n0 0\n", 2, "expected"),
    ("# colibri-trace 1 layers=1 experts=4 top_k=2\n0 0 1 1\n", 2, "twice"),
])
def test_malformed_trace(tmp_path, text, line, what):
    p = tmp_path / "bad.trace"
    p.write_text(text)
    with pytest.raises(ColiError) as ei:
        read_trace(p)
    msg = str(ei.value)
    assert "\n" not in msg and str(p) in msg and what in msg
    if line is not None:
        assert f"{p}:{line}:" in msg


def test_binary_and_missing_trace(tmp_path):
    p = tmp_path / "bin"
    p.write_bytes(b"# colibri-trace 1 layers=1 experts=4 top_k=2\n\xff\xfe\x00\n")
    with pytest.raises(ColiError, match=r"bin:2: .*not text"):
        read_trace(p)
    with pytest.raises(ColiError, match="cannot read trace"):
        read_trace(tmp_path / "nope")


def test_trace_comments_and_crlf(tmp_path):
    p = tmp_path / "t"
    p.write_bytes(b"# colibri-trace 1 layers=1 experts=4 top_k=2\r\n# a note\r\n0 0 3 1\r\n")
    assert read_trace(p).records == [(0, 0, (3, 1))]


# ---------------------------------------------------------------- usage

def test_usage_round_trip(tmp_path):
    p = tmp_path / ".coli_usage"
    counts = {(0, 1): 5, (0, 3): 2, (1, 0): 7, (1, 2): 0}
    save_usage(p, counts, layers=2, experts=4)
    lines = p.read_text().splitlines()
    assert lines[0] == "-1 2 4"
    assert lines[1] == f"-2 1 {engine_hash('colibri-py')}"
    assert lines[2:] == ["0 1 5", "0 3 2", "1 0 7"]  # ints, sparse (zero left out)
    assert load_usage(p, 2, 4) == {(0, 1): 5, (0, 3): 2, (1, 0): 7}
    assert list(tmp_path.iterdir()) == [p]  # atomic: no temp file left


def test_engine_hash_matches_colibri_fnv1a():
    # FNV-1a 32 as in colibrì's route_trace.h; empty string is the offset basis
    assert engine_hash("") == 2166136261
    assert engine_hash("a") == 0xE40C292C


def test_usage_decay(tmp_path):
    p = tmp_path / "u"
    save_usage(p, {(0, 0): 4, (0, 1): 3}, 1, 2, decay=0.5)
    assert p.read_text().splitlines()[2:] == ["0 0 2", "0 1 2"]      # 1.5 rounds half up, as in colibrì
    assert load_usage(p, 1, 2) == {(0, 0): 2.0, (0, 1): 2.0}
    with pytest.raises(ValueError):
        save_usage(p, {}, 1, 2, decay=0)


def test_usage_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    import core.usage as usage
    p = tmp_path / "u"
    save_usage(p, {(0, 0): 1}, 1, 2)
    before = p.read_bytes()

    def boom(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(usage.os, "replace", boom)
    with pytest.raises(ColiError, match="No space left"):
        save_usage(p, {(0, 0): 9}, 1, 2)
    assert p.read_bytes() == before
    assert list(tmp_path.iterdir()) == [p]


def test_usage_empty_history_is_empty_file(tmp_path):
    p = tmp_path / "u"
    save_usage(p, {}, 2, 4)
    assert p.read_bytes() == b""
    assert load_usage(p, 2, 4) == {}


def test_usage_missing_file_is_silent(tmp_path, capsys):
    assert load_usage(tmp_path / "none", 2, 4) == {}
    assert capsys.readouterr().err == ""


def test_usage_legacy_and_colibri_files(tmp_path, capsys):
    p = tmp_path / "u"
    p.write_text("0 1 3\n1 2 4\n0 1 1\n")  # colibrì's headerless legacy layout; duplicates add up
    assert load_usage(p, 2, 4) == {(0, 1): 4, (1, 2): 4}
    p.write_text(f"-1 2 4\n-2 1 {engine_hash('olmoe')}\n-3 0 0\n1 3 10\n")  # another engine, future header
    assert load_usage(p, 2, 4) == {(1, 3): 10}
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("content", [
    b"-1 3 4\n-2 1 1\n0 1 5\n",          # other model's layer count
    b"-1 2 8\n0 1 5\n",                  # other model's expert count
    b"-1 2 4\n-2 9 1\n0 1 5\n",          # future format version
    b"-1 2 4\n0 1 five\n",               # corrupt count
    b"-1 2 4\n0 1\n",                    # short line
    b"-1 2 4\n5 1 2\n",                  # layer out of range
    b"-1 2 4\n0 1 -3\n",                 # negative count
    b"-1 2 4\n0 1 nan\n",
    b"\x00\xff\x01binary",
])
def test_usage_corrupt_or_mismatched_is_ignored_with_warning(tmp_path, capsys, content):
    p = tmp_path / "u"
    p.write_bytes(content)
    assert load_usage(p, 2, 4) == {}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning" in err and str(p) in err


def test_usage_unreadable_is_ignored_with_warning(tmp_path, capsys):
    assert load_usage(tmp_path, 2, 4) == {}  # a directory: unreadable
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning" in err


def test_counts_from_trace():
    t = Trace(2, 4, 2, [(0, 0, (1, 2)), (0, 1, (3, 0)), (1, 0, (2, 0))])
    assert counts_from_trace(t) == {(0, 1): 1, (0, 2): 2, (1, 3): 1, (1, 0): 1, (0, 0): 1}


# ---------------------------------------------------------------- simulation

def test_hand_computed_lru_and_belady():
    reqs = [(1,), (2,), (3,), (1,), (2,), (3,), (1,), (2,)]
    # LRU on a cycle one longer than the cache misses every time
    assert simulate(reqs, 2, LRU(), 0) == (0, 8)
    # MIN: 1m 2m 3m(evicts 2: next use 4 vs 3) 1h 2m(evicts 1: 6 vs 5) 3h 1m(evicts 3: never) 2h
    assert belady(reqs, 2) == (3, 8)
    reqs = [(1,), (2,), (1,), (3,), (1,), (2,)]
    # LRU: 1m 2m 1h 3m(evicts 2) 1h 2m(evicts 3)
    assert simulate(reqs, 2, LRU(), 0) == (2, 6)
    assert belady(reqs, 2) == (2, 6)
    # top-2 requests, cap 3: 1m 2m | 1h 3m | 2h 3h | 1h 2h
    reqs = [(1, 2), (3, 1), (2, 3), (1, 2)]
    assert simulate(reqs, 3, LRU(), 0) == (5, 8)
    assert belady(reqs, 3) == (5, 8)
    # cap 2: 1m 2m | 1h, 3m evicts 2 (the only expert not in the request) | 3h, 2m evicts 1 |
    # 2h, 1m evicts 3  -> every choice is forced, MIN does no better
    assert simulate(reqs, 2, LRU(), 0) == (3, 8)
    assert belady(reqs, 2) == (3, 8)
    # an expert of the current request is never evicted before it is used, even when the policy
    # ranks it lowest: {1, 2, 3} resident, 1 cold, 2 and 3 hot; request (1, 4) evicts 2 or 3
    warm = [(2, 3)] * 5 + [(1,)]
    rec = Recorder(LFRU)
    assert simulate(warm + [(1, 4), (1,)], 3, rec, 0) == (4 * 2 + 1 + 1, 5 * 2 + 1 + 2 + 1)
    assert [c for c in rec.calls if c[0] == "victim"] == [("victim", 0, (2, 3), 2)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["random", "zipf"])
def test_belady_never_worse_than_lru_lfru(seed, kind):
    rng = random.Random(seed)
    experts, k = rng.choice([(8, 2), (16, 4), (32, 8), (12, 3)])
    gen = random_requests if kind == "random" else zipf_requests
    reqs = gen(rng, 150, experts, k)
    for cap in (1, max(1, k // 2), k, k + 1, 2 * k, experts - 1, experts):
        bh, ba = belady(reqs, cap)
        for policy in (LRU(), LFRU(), LFRU(half_life=2.0)):
            h, a = simulate(reqs, cap, policy, layer=3)
            assert a == ba == len(reqs) * k
            assert h <= bh, (policy.name, cap)


@pytest.mark.parametrize("seed", range(4))
def test_lru_matches_independent_model(seed):
    rng = random.Random(100 + seed)
    reqs = zipf_requests(rng, 120, 16, 4)
    for cap in (1, 2, 3, 4, 6, 10):
        assert simulate(reqs, cap, LRU(), 0) == brute_lru(reqs, cap)


def test_belady_is_the_optimum_on_tiny_cases():
    rng = random.Random(7)
    for _ in range(40):
        k = rng.choice([1, 2, 3])
        reqs = random_requests(rng, 7, 5, k)
        for cap in (1, 2, 3, 4):
            assert belady(reqs, cap)[0] == brute_optimum(reqs, cap), (reqs, cap)


def test_cap_at_least_experts_gives_only_compulsory_misses():
    rng = random.Random(1)
    reqs = zipf_requests(rng, 200, 10, 3)
    distinct = len({e for r in reqs for e in r})
    for cap in (10, 11, 50):
        for h, a in (simulate(reqs, cap, LRU(), 0), simulate(reqs, cap, LFRU(), 0), belady(reqs, cap)):
            assert a - h == distinct


def test_cap_smaller_than_top_k():
    rng = random.Random(2)
    reqs = random_requests(rng, 100, 16, 8)
    for cap in (1, 2, 5):
        bh, ba = belady(reqs, cap)
        for pol in (LRU(), LFRU()):
            h, a = simulate(reqs, cap, pol, 0)
            assert a == ba == 800 and 0 <= h <= bh
    # the same 8 experts every token with 4 slots: a token ends with its last 4 experts resident;
    # the next token hits those (consumed first) and reloads the other 4 into the freed slots
    same = [tuple(range(8))] * 10
    assert simulate(same, 4, LRU(), 0) == (36, 80)
    assert belady(same, 4) == (36, 80)
    # a request whose still-needed experts fill every slot: consumed hits make room
    assert simulate([(1, 2), (3, 1, 2)], 2, LRU(), 0) == (2, 5)
    # one slot: nothing survives a top-2 token
    assert simulate([(1, 2), (3, 4)] * 3, 1, LRU(), 0) == (0, 12)
    # ... unless the next token starts with the expert the last one ended with (hits go first)
    assert simulate([(1, 2), (2, 1)] * 3, 1, LRU(), 0) == (5, 12)
    # the hit is consumed first and its slot reused: 2 hits, 1 misses
    assert simulate([(1, 2)] * 3, 1, LRU(), 0) == (2, 6)


def test_cap_must_be_positive():
    with pytest.raises(ValueError):
        simulate([(1,)], 0, LRU(), 0)
    with pytest.raises(ValueError):
        belady([(1,)], 0)


def Recorder(base=LRU):
    class _Recorder(base):
        def __init__(self):
            super().__init__()
            self.calls = []

        def step(self, layer):
            self.calls.append(("step", layer))
            super().step(layer)

        def touch(self, layer, e):
            self.calls.append(("touch", layer, e))
            super().touch(layer, e)

        def victim(self, layer, candidates):
            v = super().victim(layer, candidates)
            self.calls.append(("victim", layer, tuple(candidates), v))
            return v

        def forget(self, layer, e):
            self.calls.append(("forget", layer, e))
            super().forget(layer, e)
    return _Recorder()


def test_simulate_drives_policy_interface():
    pol = Recorder()
    simulate([(1, 2), (3, 2)], 2, pol, 5)
    assert pol.calls == [
        ("step", 5), ("touch", 5, 1), ("touch", 5, 2),
        ("step", 5), ("victim", 5, (1,), 1), ("forget", 5, 1), ("touch", 5, 2), ("touch", 5, 3),
    ]  # 2 is part of the request, so it is never a candidate; the hit is consumed first


def test_pinned_policy_keeps_its_hot_set():
    rng = random.Random(3)
    reqs = random_requests(rng, 200, 16, 4)
    pol = Pinned({0: [0, 1, 2]})
    h, a = simulate(reqs, 5, pol, 0)
    # the pinned experts always hit (they are resident from the start)
    uses_of = lambda hot: sum(1 for r in reqs for e in r if e in hot)
    assert h >= uses_of({0, 1, 2})

    class Spy(Pinned):
        def victim(self, layer, candidates):
            assert not set(candidates) & {0, 1, 2}
            return super().victim(layer, candidates)
    assert simulate(reqs, 5, Spy({0: [0, 1, 2]}), 0) == (h, a)
    # like the store, at most cap - 1 pins (lowest ids): one slot always serves the rest
    class Spy2(Pinned):
        def victim(self, layer, candidates):
            assert not set(candidates) & {0, 1}
            return super().victim(layer, candidates)
    h3, _ = simulate(reqs, 3, Spy2({0: [0, 1, 2]}), 0)
    assert h3 >= uses_of({0, 1})
    assert simulate(reqs, 1, Pinned({0: [0, 1, 2]}), 0) == simulate(reqs, 1, LRU(), 0)


def _feed(pol, layer, requests):
    """Serve ``requests`` to the policy as finished requests (step, then touch each expert)."""
    for req in requests:
        pol.step(layer)
        for e in req:
            pol.touch(layer, e)


def test_markov_follows_transitions_where_lfu_ties():
    # 5 always follows 1, 6 never does; both are used equally often (LFU ties, lowest id: 5)
    history = [(1, 2), (5, 3), (6, 4)] * 10
    pol = Markov()
    _feed(pol, 0, history)
    pol.step(0)                                   # a new request ...
    pol.touch(0, 1)                               # ... that routes to 1 (consumed already)
    assert pol.victim(0, [5, 6]) == 6
    assert pol.victim(0, [6, 5]) == 6             # candidate order does not matter
    # the current request is also what is resident but not a candidate (unconsumed hits)
    pol2 = Markov()
    _feed(pol2, 0, history + [(4, 1)])            # 1 resident since the last request
    pol2.step(0)
    assert pol2.victim(0, [5, 6]) == 6            # 1 is not a candidate: part of this request
    # without history the order is LFU's: never used first, then fewest uses, ties lowest id
    pol3 = Markov()
    _feed(pol3, 0, [(3,), (3,), (2,)])
    pol3.step(0)
    assert pol3.victim(0, [3, 2, 9]) == 9
    assert pol3.victim(0, [3, 2]) == 2
    assert pol3.victim(0, [4, 9]) == 4


def test_markov_layers_are_independent_and_forget_tracks_residency():
    pol = Markov()
    _feed(pol, 0, [(1, 2), (5, 3), (6, 4)] * 10)
    _feed(pol, 1, [(1, 2), (6, 3), (5, 4)] * 10)  # the other way round in layer 1
    for layer, want in ((0, 6), (1, 5)):
        pol.step(layer)
        pol.touch(layer, 1)
        assert pol.victim(layer, [5, 6]) == want
    assert pol.victim(2, [7, 3]) == 3             # a layer never seen: all ties, lowest id
    pol.forget(0, 1)
    assert 1 not in pol._layer(0).resident


@pytest.mark.parametrize("seed", range(4))
def test_markov_on_the_store_rules(seed):
    rng = random.Random(seed)
    reqs = zipf_requests(rng, 300, 16, 4)
    protected_ok = []

    class Spy(Markov):
        def victim(self, layer, candidates):
            v = super().victim(layer, candidates)
            protected_ok.append(v in candidates)
            return v
    for cap in (1, 3, 4, 6, 10):
        got = simulate(reqs, cap, Spy(), 0)
        assert got == simulate(reqs, cap, Markov(), 0)          # deterministic
        assert got[0] <= belady(reqs, cap)[0]
    assert protected_ok and all(protected_ok)
    # with room for every expert only the compulsory misses remain
    assert simulate(reqs, 16, Markov(), 0)[0] == belady(reqs, 16)[0]
    # cap == top_k: every miss must evict a non-requested expert; all policies agree
    assert simulate(reqs, 4, Markov(), 0) == simulate(reqs, 4, LRU(), 0)


def test_markov_is_registered():
    assert isinstance(make_policy("markov"), Markov)
    assert "markov" in DEFAULT_POLICIES
    with pytest.raises(ValueError, match="markov"):
        make_policy("fifo")
    with pytest.raises(ValueError):
        Markov(lags=0)


# ---------------------------------------------------------------- replay

def _trace_file(tmp_path, n=120, layers=3, experts=16, k=4, seed=0):
    rng = random.Random(seed)
    per_layer = {layer: zipf_requests(rng, n, experts, k) for layer in range(layers)}
    return write_trace(tmp_path / "r.trace", layers, experts, k, per_layer), per_layer


def test_replay_report(tmp_path):
    path, per_layer = _trace_file(tmp_path)
    t = read_trace(path)
    res = replay(t, cap=6)
    assert res["cap"] == 6 and res["policies"] == ["lru", "lfru", "markov", "pinned"]
    assert sorted(res["per_layer"]) == [0, 1, 2]
    total_b = 0
    for layer, row in res["per_layer"].items():
        bh, ba = belady(per_layer[layer], 6)
        assert row["belady"] == {"hits": bh, "accesses": ba, "hit_rate": bh / ba}
        assert row["lru"]["hits"] == simulate(per_layer[layer], 6, LRU(), layer)[0]
        assert row["markov"]["hits"] == simulate(per_layer[layer], 6, Markov(), layer)[0]
        for name in ("lru", "lfru", "markov"):
            assert row[name]["hits"] <= bh
            assert row[name]["ratio_to_belady"] == pytest.approx(row[name]["hits"] / bh)
        total_b += bh
    o = res["overall"]
    assert o["belady"]["hits"] == total_b and o["belady"]["accesses"] == 3 * 120 * 4
    assert o["lru"]["ratio_to_belady"] == pytest.approx(o["lru"]["hits"] / total_b)
    assert 0 < o["lru"]["hit_rate"] <= o["belady"]["hit_rate"] <= 1


def test_replay_pinned_learns_from_first_half(tmp_path):
    path, per_layer = _trace_file(tmp_path, n=100)
    t = read_trace(path)
    half = first_half(t)
    assert len(half.records) == len(t.records) // 2
    assert all(pos < 50 for pos, _, _ in half.records)
    res = replay(t, cap=6, policies=["pinned"])
    pol = make_policy("pinned", usage=counts_from_trace(half), layers=[0, 1, 2], cap=6)
    for layer in range(3):
        assert len(pol.pinned(layer)) == 3
        assert res["per_layer"][layer]["pinned"]["hits"] == simulate(per_layer[layer], 6, pol, layer)[0]
    with pytest.raises(ValueError, match="unknown cache policy"):
        replay(t, 6, ["mru"])
    assert replay(t, 6, "lru,belady")["policies"] == ["lru"]


# ---------------------------------------------------------------- CLI

def _cli(argv):
    from colibri_tui.cli_replay import add_parser, cmd_replay
    ap = argparse.ArgumentParser(prog="coli")
    sub = ap.add_subparsers(dest="command")
    add_parser(sub)
    args = ap.parse_args(argv)
    assert args.command == "replay"
    return cmd_replay(args)


def test_cli_replay_table(tmp_path, capsys):
    path, _ = _trace_file(tmp_path, n=40, layers=2)
    assert _cli(["replay", str(path), "--cap", "5"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "2 layers x 16 experts, top-4, 40 positions; cap 5" in lines[0]
    head = next(l for l in lines if l.split()[:1] == ["layer"])
    assert head.split() == ["layer", "lru", "lfru", "markov", "pinned", "belady",
                            "lru/belady", "lfru/belady", "markov/belady", "pinned/belady"]
    rows = {l.split()[0]: l.split() for l in lines if l.split() and l.split()[0] in ("0", "1", "all")}
    assert set(rows) == {"0", "1", "all"}
    assert rows["all"][5].endswith("%") and float(rows["all"][6]) <= 1


def test_cli_replay_json(tmp_path, capsys):
    path, per_layer = _trace_file(tmp_path, n=40, layers=2)
    assert _cli(["replay", str(path), "--cap", "5", "--json", "--policies", "lru,lfru"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    d = json.loads(out)
    assert d["policies"] == ["lru", "lfru"] and d["cap"] == 5
    assert (d["layers"], d["experts"], d["top_k"], d["positions"]) == (2, 16, 4, 40)
    assert set(d["per_layer"]) == {"0", "1"}
    assert d["overall"]["belady"]["hits"] == sum(belady(r, 5)[0] for r in per_layer.values())
    assert "pinned" not in d["overall"]


@pytest.mark.parametrize("argv, what", [
    (["--cap", "0"], "--cap"),
    (["--cap", "4", "--policies", "lru,mru"], "unknown policy 'mru'"),
    (["--cap", "4", "--policies", ","], "at least one"),
])
def test_cli_replay_bad_args(tmp_path, argv, what):
    path, _ = _trace_file(tmp_path, n=10, layers=1)
    with pytest.raises(ColiError, match=what):
        _cli(["replay", str(path), *argv])


def test_cli_replay_bad_trace(tmp_path):
    bad = tmp_path / "bad"
    bad.write_text("# colibri-trace 1 layers=1 experts=4 top_k=2\n0 0 7\n")
    with pytest.raises(ColiError, match=r"bad:2: expert 7"):
        _cli(["replay", str(bad), "--cap", "2"])
    with pytest.raises(ColiError, match="cannot read trace"):
        _cli(["replay", str(tmp_path / "missing"), "--cap", "2"])
    empty = tmp_path / "empty"
    empty.write_text("# colibri-trace 1 layers=1 experts=4 top_k=2\n")
    with pytest.raises(ColiError, match="no routing records"):
        _cli(["replay", str(empty), "--cap", "2"])
