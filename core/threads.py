"""The default thread count follows the machine's load.

A decode step is a chain of short OpenMP regions, each ending in a barrier. When another process
keeps a core busy, the kernel thread that shares that core with it gets the CPU only every time
slice or so, and every region waits for it: measured on the 2-core VM with one busy process, 2
threads decoded the demo model at 20-33 tok/s and 1 thread at 169-207 (benchmarks/README.md). A
desktop always has other processes, so the default (``--threads`` not given) is not a fixed
count: between forward passes, at most every ``INTERVAL_S``, we measure how many cores the OTHER
processes kept busy since the last look (the system's busy CPU time minus this process's own, per
second of wall time) and use the cores left over, up to the physical cores.

The thread count never changes what is computed: every output row is reduced by one thread in an
order fixed by the shapes (cython_kernels/qmatmul.pyx), tested in tests/test_kernels.py and
tests/test_store.py, so this decides speed only. A count given by the user (``--threads``, the app
setting) is kept as it is.
"""
from __future__ import annotations

import math
import time
from typing import Callable

INTERVAL_S = 0.5        # how often the load is looked at (each look reads /proc/stat-like counters)
SLACK = 0.25            # a core that others keep busy less than 25 % of the time counts as free


def threads_for(others_busy: float, physical: int, logical: int) -> int:
    """Threads to run when other processes keep ``others_busy`` logical CPUs busy on average:
    the logical CPUs left, at most the physical cores (SMT siblings only share bandwidth), >= 1."""
    free = logical - max(0.0, others_busy)
    return max(1, min(physical, math.floor(free + SLACK)))


def _busy_seconds() -> tuple[float, float]:
    """(CPU seconds the whole system spent busy, CPU seconds this process used), since boot /
    since start. Idle and I/O wait are not busy; guest time is already counted in user time."""
    import psutil
    t = psutil.cpu_times()
    fields = t._asdict()
    total = sum(v for k, v in fields.items() if k not in ("guest", "guest_nice"))
    idle = fields.get("idle", 0.0) + fields.get("iowait", 0.0)
    mine = psutil.Process().cpu_times()
    return total - idle, mine.user + mine.system


class ThreadGovernor:
    """Chooses the kernel thread count from the measured load; ``update()`` is cheap to call
    often (a clock read) and applies a new count through ``apply`` when the load changed it."""

    def __init__(self, physical: int, logical: int, apply: Callable[[int], None],
                 interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 sample: Callable[[], tuple[float, float]] = _busy_seconds):
        self.physical, self.logical = max(1, physical), max(1, logical, physical)
        self.apply, self.interval_s, self.clock, self.sample = apply, interval_s, clock, sample
        self.threads = self.physical
        self.others_busy = 0.0           # the latest measurement, in logical CPUs
        self._t, self._busy = clock(), sample()
        apply(self.threads)

    def update(self) -> int:
        now = self.clock()
        dt = now - self._t
        if dt < self.interval_s:
            return self.threads
        busy = self.sample()
        system, mine = busy[0] - self._busy[0], busy[1] - self._busy[1]
        self._t, self._busy = now, busy
        self.others_busy = max(0.0, (system - mine) / dt)
        n = threads_for(self.others_busy, self.physical, self.logical)
        if n != self.threads:
            self.threads = n
            self.apply(n)
        return n
