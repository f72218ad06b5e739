"""Cache policies for the RAM tier: which resident expert of a layer to evict.

A policy only ranks; the store decides what may be evicted (never an expert the current request
still needs, never a pinned one) and passes the candidates. Policies are per layer, as the slot
pools are. The same objects drive the live store and the offline replay (``core/replay.py``).
The default (``models.DEFAULT_POLICY``) is :class:`LFRU`; :class:`Markov` scores a little higher on
the demo trace (its docstring has the measurements) at the memory cost below.
Memory: LRU/LFRU keep O(experts) numbers per layer, Markov up to O(lags x experts^2).
"""
from __future__ import annotations

from typing import Iterable, Sequence


class Policy:
    name = "base"

    def touch(self, layer: int, expert: int) -> None:
        """The expert was used (a hit, or loaded for a request)."""

    def step(self, layer: int) -> None:
        """One request of this layer happened (a token or a prefill batch): the layer's clock."""

    def victim(self, layer: int, candidates: Sequence[int]) -> int:
        raise NotImplementedError

    def forget(self, layer: int, expert: int) -> None:
        """The expert left the cache."""

    def pinned(self, layer: int) -> set[int]:
        """Experts the store loads up front and never evicts."""
        return set()


class LRU(Policy):
    """Evict the least recently used expert."""
    name = "lru"

    def __init__(self):
        self._clock: dict[int, int] = {}
        self._last: dict[tuple[int, int], int] = {}

    def step(self, layer):
        self._clock[layer] = self._clock.get(layer, 0) + 1

    def touch(self, layer, expert):
        self._last[(layer, expert)] = self._clock.get(layer, 0)

    def victim(self, layer, candidates):
        return min(candidates, key=lambda e: (self._last.get((layer, e), -1), e))

    def forget(self, layer, expert):
        self._last.pop((layer, expert), None)


class LFRU(Policy):
    """Routing heat with recency: each use adds 1 to an expert's heat, and heat halves every
    ``half_life`` requests of its layer (32 was among the best of 2..inf on the demo trace). Evict
    the coldest. Heat survives eviction, so an expert popular over the long run wins its slot back
    quickly."""
    name = "lfru"

    def __init__(self, half_life: float = 32.0):
        self.half_life = half_life
        self._clock: dict[int, int] = {}
        self._heat: dict[tuple[int, int], tuple[float, int]] = {}

    def step(self, layer):
        self._clock[layer] = self._clock.get(layer, 0) + 1

    def _now(self, layer, expert) -> float:
        heat, at = self._heat.get((layer, expert), (0.0, 0))
        return heat * 0.5 ** ((self._clock.get(layer, 0) - at) / self.half_life)

    def touch(self, layer, expert):
        self._heat[(layer, expert)] = (self._now(layer, expert) + 1.0, self._clock.get(layer, 0))

    def victim(self, layer, candidates):
        return min(candidates, key=lambda e: (self._now(layer, e), e))


class Markov(Policy):
    """Routing transitions: evict the expert least likely to be routed to by the next request.

    Per layer, counted over the past requests only: for each lag d in 1..``lags``, how often an
    expert ``e`` that was NOT in request ``s`` is in request ``s + d`` given that expert ``a`` was
    in request ``s``. The estimate of ``P(e in the next request)`` from lag d is the mean over
    the experts ``a`` of the request d - 1 before the next one (d = 1: the current request, as
    far as the policy knows it: resident experts that are not candidates, i.e. its unconsumed
    hits, plus those consumed already), each smoothed towards ``e``'s long-run rate (uses per
    request) with the weight of ``prior`` requests; the score adds the lags. Victim: lowest
    score (ties: lowest id), so an expert never routed to goes first, and with no transition
    history the order is LFU's. The counts need O(k^2) updates per request (k = experts per
    request) and a victim O(candidates x k) look-ups, in plain Python.

    Why (``coli replay`` on the demo trace, hits as a fraction of MIN's; caps 6 / 8 / 12 / 16):
    markov 0.935 / 0.942 / 0.960 / 0.978, LFRU 0.932 / 0.937 / 0.954 / 0.975, LRU 0.846 / 0.865 /
    0.919 / 0.954; better than LFRU in each of the 8 layers at cap 8. ``lags`` 1..3 and ``prior``
    0.25..16 all give 0.941-0.942 at cap 8. The ceiling for this kind of signal looks close: on
    the same trace, LFU by the true whole-trace counts gives 0.941, by each document's true counts
    (the future included) 0.951, and the other online predictors tried (LFRU at half-lives 2..inf,
    per-expert reuse-gap hazards, nearest neighbours among past requests, a logistic model of
    recency and several heats, fitted online or even offline) stay at 0.936-0.943. What would
    close the gap to MIN is knowing the next request: an oracle of "used in the next request"
    alone gives 0.964.
    """
    name = "markov"

    def __init__(self, lags: int = 2, prior: float = 1.0):
        if lags < 1:
            raise ValueError("lags must be >= 1")
        self.lags, self.prior = lags, prior
        self._layers: dict[int, _MarkovLayer] = {}

    def _layer(self, layer: int) -> "_MarkovLayer":
        st = self._layers.get(layer)
        if st is None:
            st = self._layers[layer] = _MarkovLayer(self.lags)
        return st

    def step(self, layer):
        self._layer(layer).close_request()

    def touch(self, layer, expert):
        st = self._layer(layer)
        st.current.add(expert)
        st.resident.add(expert)

    def forget(self, layer, expert):
        self._layer(layer).resident.discard(expert)

    def victim(self, layer, candidates):
        st = self._layer(layer)
        requests = max(st.requests, 1)
        rate = lambda e: st.uses.get(e, 0) / requests
        cands = set(candidates)
        now = (st.resident - cands) | st.current      # the current request, as far as known
        given = [now, *reversed(st.history)][: self.lags]

        def score(e: int) -> float:
            r, total = rate(e), 0.0
            for d, src in enumerate(given):
                if not src:
                    total += r
                    continue
                follows, seen, both = st.follows[d], st.seen[d], st.together[d]
                total += sum((follows.get((a, e), 0) + self.prior * r)
                             / (seen.get(a, 0) - both.get((a, e), 0) + self.prior)
                             for a in src) / len(src)
            return total

        return min(candidates, key=lambda e: (score(e), e))


class _MarkovLayer:
    """One layer's transition counts for :class:`Markov` (lag index d = lag - 1)."""

    def __init__(self, lags: int):
        self.history: list[frozenset[int]] = []     # the last ``lags`` finished requests
        self.lags = lags
        self.current: set[int] = set()              # experts touched since the last step
        self.resident: set[int] = set()             # touched and not forgotten
        self.requests = 0
        self.uses: dict[int, int] = {}
        # per lag d: a -> requests holding a that have a successor d later; (a, e) -> of those,
        # the ones holding e too (a itself included); (a, e) -> e not in it, but d requests later
        self.seen = [dict() for _ in range(lags)]
        self.together = [dict() for _ in range(lags)]
        self.follows = [dict() for _ in range(lags)]

    def close_request(self) -> None:
        if not self.current:
            return
        new = frozenset(self.current)
        self.current = set()
        self.requests += 1
        for e in new:
            self.uses[e] = self.uses.get(e, 0) + 1
        for d, old in enumerate(reversed(self.history)):
            seen, together, follows = self.seen[d], self.together[d], self.follows[d]
            for a in old:
                seen[a] = seen.get(a, 0) + 1
                for e in old:
                    together[(a, e)] = together.get((a, e), 0) + 1
                for e in new - old:
                    follows[(a, e)] = follows.get((a, e), 0) + 1
        self.history.append(new)
        del self.history[: -self.lags]


class Pinned(Policy):
    """A hot set per layer (learned from a usage history) stays resident; the rest of the slots
    follow ``base``."""
    name = "pinned"

    def __init__(self, hot: dict[int, Iterable[int]], base: Policy | None = None):
        self.hot = {layer: set(es) for layer, es in hot.items()}
        self.base = base or LRU()
        self.name = f"pinned+{self.base.name}"

    def step(self, layer):
        self.base.step(layer)

    def touch(self, layer, expert):
        self.base.touch(layer, expert)

    def victim(self, layer, candidates):
        free = [e for e in candidates if e not in self.hot.get(layer, ())]
        return self.base.victim(layer, free or candidates)

    def forget(self, layer, expert):
        self.base.forget(layer, expert)

    def pinned(self, layer):
        return set(self.hot.get(layer, ()))


def hot_set(counts: dict[tuple[int, int], float], layers: Iterable[int], per_layer: int) -> dict[int, list[int]]:
    """The ``per_layer`` most used experts of each layer (ties: lower id first)."""
    out = {}
    for layer in layers:
        ranked = sorted(((c, e) for (l, e), c in counts.items() if l == layer and c > 0),
                        key=lambda ce: (-ce[0], ce[1]))
        out[layer] = [e for _, e in ranked[:per_layer]]
    return out


POLICIES = {"lru": LRU, "lfru": LFRU, "markov": Markov}
POLICY_NAMES = (*POLICIES, "pinned")


def make_policy(name: str, usage: dict[tuple[int, int], float] | None = None,
                layers: Iterable[int] = (), cap: int = 0, pin_fraction: float = 0.5) -> Policy:
    """'lru' | 'lfru' | 'markov' | 'pinned' (half of each layer's slots pinned to its hottest
    experts from the usage history, the rest LRU). Unknown names raise ValueError."""
    if name in POLICIES:
        return POLICIES[name]()
    if name == "pinned":
        n = int(cap * pin_fraction)
        return Pinned(hot_set(usage or {}, layers, n) if n else {})
    raise ValueError(f"unknown cache policy {name!r} (choose from {', '.join([*POLICIES, 'pinned'])})")
