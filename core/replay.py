"""Offline scoring of cache policies on a recorded routing trace, against the optimum.

The model is the live store's RAM tier (``core/tiered_store.py``), one layer at a time, with
prefetch off: ``cap`` slots per layer; pinned experts take slots first (at most ``cap - 1`` of
them, lowest ids kept, so one slot is always left for the rest) and are never evicted. A request
(one position's top-k experts) is served like ``TieredStore.request``:

* every expert resident when the request arrives is a hit, every other one a miss — the store
  counts hits and misses up front, and it never evicts an expert of the current request that has
  not been consumed yet, so a hit cannot turn into a miss half-way;
* the misses get slots in request order; when the layer's slots are full, the victim is
  ``policy.victim(layer, candidates)`` with candidates = resident experts that are neither pinned
  nor an unconsumed expert of this request;
* if there is no candidate (``cap`` smaller than what the request still needs), the store waits
  until the caller consumes the next expert — hits first, in request order, then the misses in
  the order they were loaded — and reuses that expert's slot: it is the only candidate then.

Consumed experts are ``policy.touch``-ed (hits before misses); ``policy.step`` runs once per
request, ``policy.forget`` once per eviction.

``belady`` is the offline optimum MIN under the same rules: the victim is the candidate whose next
use is furthest in the future (never again = infinitely far). That it is optimal under these rules
(the protection of the current request included) is checked against an exhaustive search over
all eviction choices in ``tests/test_replay.py``. A pinned policy's hot set is
resident before the first request, so its first uses are hits that MIN (starting empty) pays
for: with a large ``cap`` a pinned policy can score above MIN. LRU, LFRU and Markov cannot.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import deque
from typing import Callable, Iterable, Sequence

from core.policies import POLICY_NAMES, Policy, make_policy
from core.trace import Trace, requests_per_layer
from core.usage import counts_from_trace

DEFAULT_POLICIES = POLICY_NAMES


def _check_cap(cap: int) -> None:
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
        raise ValueError(f"cap must be a positive integer (experts per layer), got {cap!r}")


def _play(requests: Sequence[Sequence[int]], cap: int, pinned: set[int],
          step: Callable[[], None], touch: Callable[[int], None],
          choose: Callable[[int, list[int]], int], forget: Callable[[int], None]) -> tuple[int, int]:
    """The store's semantics (module docstring) with the decisions left to callbacks;
    ``choose(request_index, sorted_candidates)`` picks a victim."""
    resident = set(pinned)
    hits = accesses = 0
    for t, req in enumerate(requests):
        step()
        ids = list(dict.fromkeys(int(e) for e in req))
        hit_ids = [e for e in ids if e in resident]
        accesses += len(ids)
        hits += len(hit_ids)
        unconsumed = set(ids)
        queue = deque(hit_ids)  # the order in which the caller consumes this request's experts
        for e in [e for e in ids if e not in resident]:  # the misses, in request order
            if len(resident) >= cap:
                cands = sorted(r for r in resident if r not in unconsumed and r not in pinned)
                while not cands:  # wait for the caller to consume an expert, reuse its slot
                    c = queue.popleft()  # never empty: a non-pinned resident expert is unconsumed
                    unconsumed.discard(c)
                    touch(c)
                    if c not in pinned:
                        cands = [c]
                v = choose(t, cands)
                if v not in cands:
                    raise ValueError(f"victim {v} is not one of the candidates {cands}")
                resident.discard(v)
                forget(v)
            resident.add(e)
            queue.append(e)
        for c in queue:  # the rest of the request is consumed
            touch(c)
    return hits, accesses


def simulate(requests: Sequence[tuple[int, ...]], cap: int, policy: Policy,
             layer: int) -> tuple[int, int]:
    """(hits, accesses) of ``policy`` on one layer's request sequence with ``cap`` slots, served
    as the live store serves it (module docstring). ``policy.pinned(layer)`` is resident from
    the start and counts against ``cap`` (at most ``cap - 1`` pins, lowest ids kept)."""
    _check_cap(cap)
    pinned = set(sorted(policy.pinned(layer))[:cap - 1])
    return _play(requests, cap, pinned,
                 step=lambda: policy.step(layer),
                 touch=lambda e: policy.touch(layer, e),
                 choose=lambda t, cands: policy.victim(layer, cands),
                 forget=lambda e: policy.forget(layer, e))


def belady(requests: Sequence[tuple[int, ...]], cap: int) -> tuple[int, int]:
    """(hits, accesses) of the offline optimum MIN with ``cap`` slots (no pins) under the store's
    rules: on a miss with full slots, evict the candidate whose next use (the next later request
    that routes to it) is furthest away; never used again = infinitely far; ties: lowest id."""
    _check_cap(cap)
    uses: dict[int, list[int]] = {}
    for t, req in enumerate(requests):
        for e in dict.fromkeys(req):
            uses.setdefault(int(e), []).append(t)
    never = len(requests)

    def next_use(t: int, e: int) -> int:
        u = uses[e]
        i = bisect_right(u, t)
        return u[i] if i < len(u) else never

    def choose(t, cands):
        return max(cands, key=lambda e: (next_use(t, e), -e))

    nothing = lambda *a: None
    return _play(requests, cap, set(), step=nothing, touch=nothing, choose=choose, forget=nothing)


def _rate(hits: int, accesses: int) -> float:
    return hits / accesses if accesses else 0.0


def _entry(hits: int, accesses: int, best: int | None = None) -> dict:
    d = {"hits": hits, "accesses": accesses, "hit_rate": _rate(hits, accesses)}
    if best is not None:
        # ratio of hit counts = ratio of hit rates (same accesses); None where MIN has no hit
        d["ratio_to_belady"] = hits / best if best else None
    return d


def first_half(trace: Trace) -> Trace:
    """The first half (rounded down) of each layer's requests, as a trace."""
    total: dict[int, int] = {}
    for _, layer, _ in trace.records:
        total[layer] = total.get(layer, 0) + 1
    seen: dict[int, int] = {}
    half = Trace(trace.layers, trace.experts, trace.top_k)
    for rec in trace.records:
        layer = rec[1]
        k = seen.get(layer, 0)
        seen[layer] = k + 1
        if k < total[layer] // 2:
            half.records.append(rec)
    return half


def replay(trace: Trace, cap: int, policies: Iterable[str] = DEFAULT_POLICIES) -> dict:
    """Hit rates of each named policy and of MIN (``"belady"``) on ``trace`` with ``cap`` slots
    per layer.

    ``"pinned"``: its hot set (half the slots of each layer, ``make_policy``'s default) is learned
    from the FIRST HALF of each layer's requests (``counts_from_trace`` on that half) and scored
    on the WHOLE trace, so its figure on the first half is optimistic (it has seen the future);
    the second half is a fair held-out test.

    Returns ``{"cap", "policies", "per_layer": {layer: {name: entry}}, "overall": {name: entry}}``
    where an entry is ``{"hits", "accesses", "hit_rate"}`` plus, for the policies (not for
    belady), ``"ratio_to_belady"`` (policy hits / MIN hits; None when MIN has no hit). Overall
    figures add hits and accesses over the layers. Unknown policy names and cap < 1 raise
    ValueError.
    """
    _check_cap(cap)
    if isinstance(policies, str):
        policies = policies.split(",")
    names = [n for n in dict.fromkeys(policies) if n != "belady"]  # belady: always scored
    if not names:
        raise ValueError("no policy to replay")
    per_layer = requests_per_layer(trace)
    layer_ids = list(per_layer)
    made: dict[str, Policy] = {}
    for name in names:
        usage = counts_from_trace(first_half(trace)) if name == "pinned" else None
        made[name] = make_policy(name, usage=usage, layers=layer_ids, cap=cap)

    layers_out: dict[int, dict] = {}
    tot = {name: [0, 0] for name in [*names, "belady"]}
    for layer, reqs in per_layer.items():
        bh, ba = belady(reqs, cap)
        row = {}
        for name in names:
            h, a = simulate(reqs, cap, made[name], layer)
            row[name] = _entry(h, a, bh)
            tot[name][0] += h
            tot[name][1] += a
        row["belady"] = _entry(bh, ba)
        tot["belady"][0] += bh
        tot["belady"][1] += ba
        layers_out[layer] = row
    bh_all = tot["belady"][0]
    overall = {name: _entry(*tot[name], bh_all) for name in names}
    overall["belady"] = _entry(*tot["belady"])
    return {"cap": cap, "policies": names, "per_layer": layers_out, "overall": overall}
