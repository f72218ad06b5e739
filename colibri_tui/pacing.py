"""How often a streaming reply repaints: a CPU budget for the UI thread.

While a reply streams, the UI thread lays out and repaints on the cores the kernel threads decode
on, and holds the GIL that the engine's own Python needs between kernels: each millisecond of
painting is about a millisecond the decode loses (benchmarks/README.md, "The speed users see":
the real app at 0.83 of the benchmark when it painted every 0.15 s, ~20 ms of CPU a batch on the
2-core VM). So the app paints at most ``share`` of the time: after each batch it measures the
CPU its thread spent since the previous one (the frames that batch caused included) and lets the
next batch come only once that is ``share`` of the time between them. A cheap paint (a fast
machine, a short chat) keeps the worker's own cadence; a costly one (a slow machine, a long chat,
a big terminal) streams in bigger steps, never further apart than ``longest``."""
from __future__ import annotations

import time
from typing import Callable


class PaintBudget:
    SHARE = 0.025       # of the wall time, for the UI thread's CPU while a reply streams
    LONGEST = 1.0       # s: the longest wait for the next batch, whatever a paint costs

    def __init__(self, share: float | None = None, longest: float | None = None,
                 clock: Callable[[], float] = time.monotonic, cpu: Callable[[], float] = time.thread_time):
        self.share = self.SHARE if share is None else share
        self.longest = self.LONGEST if longest is None else longest
        self.clock, self.cpu = clock, cpu
        self.next_at = float("-inf")     # no batch before this (clock time)
        self._cpu_at: float | None = None

    def applied(self) -> None:
        """A batch was applied (call it on the UI thread, the one whose CPU is measured)."""
        now, cpu = self.clock(), self.cpu()
        if self._cpu_at is not None:
            spent = max(0.0, cpu - self._cpu_at)
            self.next_at = now + min(self.longest, spent / self.share)
        self._cpu_at = cpu

    def due(self) -> bool:
        """Whether the next batch may come (any thread)."""
        return self.clock() >= self.next_at
