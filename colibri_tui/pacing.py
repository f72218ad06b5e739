"""How often a streaming reply repaints: a CPU budget for the UI thread.

While a reply streams, the UI thread lays out and repaints on the cores the kernel threads decode
on, and holds the GIL that the engine's own Python needs between kernels: each millisecond of
painting is about a millisecond the decode loses (benchmarks/README.md, "The speed users see":
the real app at 0.73 of the benchmark when it painted every 0.15 s, 15-20 ms of CPU a batch on
the 2-core VM). So the app paints at most ``share`` of the time: the CPU its thread has spent
since the reply was sent (the send itself, every batch and the frames they caused) may be at most
``share`` of the time since then, and the next batch waits until it is -- never longer than
``longest``. A cheap paint (a fast machine, a short chat) keeps the worker's own cadence; a costly
one (a slow machine, a long chat, a big terminal) streams in bigger steps; a long prefill, during
which nothing paints, leaves room for the first batches to come at once."""
from __future__ import annotations

import time
from typing import Callable


class PaintBudget:
    """Create it and call ``applied`` on the UI thread (the thread whose CPU time is counted);
    ``due`` may be asked from any thread."""
    SHARE = 0.025       # of the wall time since the send, for the UI thread's CPU
    LONGEST = 1.0       # s: the longest wait for the next batch, whatever a paint costs

    def __init__(self, share: float | None = None, longest: float | None = None,
                 clock: Callable[[], float] = time.monotonic, cpu: Callable[[], float] = time.thread_time):
        self.share = self.SHARE if share is None else share
        self.longest = self.LONGEST if longest is None else longest
        self.clock, self.cpu = clock, cpu
        self._start, self._cpu0 = clock(), cpu()
        self.next_at = float("-inf")     # no batch before this (clock time)

    def applied(self) -> None:
        """A batch was applied: the next may come once the UI's CPU since the start is share of
        the time since the start (at most longest from now)."""
        now, spent = self.clock(), max(0.0, self.cpu() - self._cpu0)
        self.next_at = min(now + self.longest, self._start + spent / self.share)

    def due(self) -> bool:
        return self.clock() >= self.next_at
