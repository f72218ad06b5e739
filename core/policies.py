"""Cache policies for the RAM tier: which resident expert of a layer to evict.

A policy only ranks; the store decides what may be evicted (never an expert the current request
still needs, never a pinned one) and passes the candidates. Policies are per layer, as the slot
pools are. The same objects drive the live store and the offline replay (``core/replay.py``).
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


POLICIES = {"lru": LRU, "lfru": LFRU}


def make_policy(name: str, usage: dict[tuple[int, int], float] | None = None,
                layers: Iterable[int] = (), cap: int = 0, pin_fraction: float = 0.5) -> Policy:
    """'lru' | 'lfru' | 'pinned' (half of each layer's slots pinned to its hottest experts from
    the usage history, the rest LRU). Unknown names raise ValueError."""
    if name in POLICIES:
        return POLICIES[name]()
    if name == "pinned":
        n = int(cap * pin_fraction)
        return Pinned(hot_set(usage or {}, layers, n) if n else {})
    raise ValueError(f"unknown cache policy {name!r} (choose from lru, lfru, pinned)")
