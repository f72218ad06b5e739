"""The default thread count follows the machine's load (core.threads); the count never changes
the bits (tests/test_store.py and tests/test_kernels.py check thread-count invariance)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from core.threads import ThreadGovernor, _busy_seconds, threads_for


@pytest.mark.parametrize("others, physical, logical, want", [
    (0.0, 2, 2, 2), (0.1, 2, 2, 2), (1.0, 2, 2, 1), (0.9, 2, 2, 1), (2.0, 2, 2, 1), (5.0, 2, 2, 1),
    (0.0, 8, 16, 8), (1.0, 8, 16, 8),          # SMT: one busy logical CPU leaves 8 cores
    (9.0, 8, 16, 7), (3.0, 4, 4, 1), (1.0, 4, 4, 3), (-0.5, 4, 4, 4), (0.0, 1, 1, 1),
])
def test_threads_for(others, physical, logical, want):
    assert threads_for(others, physical, logical) == want


def test_governor_follows_the_measured_load():
    now, busy, applied = [0.0], [(0.0, 0.0)], []
    g = ThreadGovernor(2, 2, applied.append, interval_s=0.5, clock=lambda: now[0],
                       sample=lambda: busy[0])
    assert g.threads == 2 and applied == [2]

    def step(dt, system, mine):
        now[0] += dt
        s, m = busy[0]
        busy[0] = (s + system, m + mine)
        return g.update()
    assert step(0.2, 0.1, 0.1) == 2 and applied == [2]     # too soon: no new look
    assert step(0.4, 1.2, 1.1) == 2                        # 0.6 s: we used 1.2 of 1.3 busy seconds
    assert step(1.0, 2.0, 1.0) == 1 and applied == [2, 1]  # another process kept a core busy
    assert g.others_busy == pytest.approx(1.0)
    assert step(1.0, 1.0, 0.95) == 2 and applied == [2, 1, 2]   # it ended


def test_busy_seconds_sees_another_process():
    """The real counters: a busy-loop process shows up as about one core of other load."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        s0, m0, t0 = *_busy_seconds(), time.monotonic()
        time.sleep(1.0)
        s1, m1, t1 = *_busy_seconds(), time.monotonic()
    finally:
        spinner.kill()
        spinner.wait()
    others = ((s1 - s0) - (m1 - m0)) / (t1 - t0)
    assert 0.6 < others < 4.0, others
    assert m1 - m0 < 0.3          # we slept: our own time is not counted as the others'


def test_engine_without_a_count_governs_and_with_one_does_not(tmp_path):
    from core import kernels
    if kernels.backend() != "cython":
        pytest.skip("no compiled kernels")
    from colibri_tui.cli import main as coli
    from models import open_model
    from tests.conftest import tiny_config, write_hf_model
    src = write_hf_model(tmp_path / "src", tiny_config())
    assert coli(["convert", str(src), str(tmp_path / "c"), "--bits", "4"]) == 0
    e = open_model(tmp_path / "c")
    assert e.governor is not None and kernels.get_threads() == e.governor.threads
    fixed = open_model(tmp_path / "c", threads=1)
    assert fixed.governor is None and kernels.get_threads() == 1
