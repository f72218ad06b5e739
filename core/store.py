"""The expert store: where routed experts live, and how a layer gets the ones its router chose.

Interface (DESIGN.md): ``request(layer, expert_ids)`` yields ``(expert_id, ExpertFFN)`` pairs as
each expert becomes ready (hits first; a tiered store yields misses as their reads complete),
``prefetch(layer, expert_ids)`` hints experts that will be wanted soon, ``stats()`` reports
hits/misses/bytes. The families never see which store they run on, so placement cannot change
output. ``ResidentStore`` keeps every expert in RAM, each read with one pread of its byte range.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from .container import Container, Weight

GATE, UP, DOWN = "gate_proj.weight", "up_proj.weight", "down_proj.weight"


@dataclass
class ExpertFFN:
    gate: Weight
    up: Weight
    down: Weight
    nbytes: int = 0

    @classmethod
    def from_parts(cls, parts: dict[str, Weight], nbytes: int = 0) -> "ExpertFFN":
        missing = [s for s in (GATE, UP, DOWN) if s not in parts]
        if missing:
            raise KeyError(f"expert tensors missing: {missing}")
        return cls(parts[GATE], parts[UP], parts[DOWN], nbytes)


class ExpertStore:
    def request(self, layer: int, expert_ids: Iterable[int]) -> Iterator[tuple[int, ExpertFFN]]:
        raise NotImplementedError

    def prefetch(self, layer: int, expert_ids: Iterable[int]) -> None:
        """A hint; stores without a slower tier ignore it."""

    def stats(self) -> dict:
        raise NotImplementedError


class ResidentStore(ExpertStore):
    """Every routed expert resident in RAM (loaded once at open)."""

    def __init__(self, container: Container):
        self._experts: dict[tuple[int, int], ExpertFFN] = {}
        self.bytes_loaded = 0
        for (layer, expert) in sorted(container.experts):
            blob = container.read_expert(layer, expert)
            self.bytes_loaded += len(blob)
            self._experts[(layer, expert)] = ExpertFFN.from_parts(
                container.expert_weights(layer, expert, blob), len(blob))
        self.hits = 0

    def request(self, layer, expert_ids):
        for e in expert_ids:
            self.hits += 1
            yield e, self._experts[(layer, int(e))]

    def has(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._experts

    def stats(self) -> dict:
        return {"tiers": ["ram"], "hits": {"ram": self.hits}, "misses": 0, "bytes_read": 0,
                "resident_bytes": self.bytes_loaded}
