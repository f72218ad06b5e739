"""The expert store: where routed experts live, and how a layer gets the ones its router chose.

Interface (DESIGN.md): ``request(layer, expert_ids)`` yields ``(expert_id, ExpertFFN)`` pairs as
each expert becomes ready (hits first; a tiered store yields misses as their reads complete),
``prefetch(layer, expert_ids)`` hints experts that will be wanted soon, ``stats()`` reports
hits/misses/bytes. The families never see which store they run on, so placement cannot change
output. The implementation is ``core.tiered_store.TieredStore``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from .container import Weight

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

    def request_batches(self, layer: int, expert_ids: Iterable[int]) -> Iterator[list[tuple[int, ExpertFFN]]]:
        """The same experts as request(), grouped: each list holds what is ready at that moment
        (computed in one pass by the caller). Stores may override; the default yields one by one."""
        for item in self.request(layer, expert_ids):
            yield [item]

    def prefetch(self, layer: int, expert_ids: Iterable[int]) -> None:
        """A hint; stores without a slower tier ignore it."""

    def has(self, layer: int, expert: int) -> bool:
        raise NotImplementedError

    def stats(self) -> dict:
        raise NotImplementedError

    def reset_stats(self) -> None:
        """Start counting afresh (each generation reports its own run)."""
