"""The benchmark scripts' plumbing (not their timings): each runs our engine in a child process
with the options it was given, on a small real container."""
from __future__ import annotations

from tests.conftest import oracle_names


def test_llamacpp_side_by_side_runs_our_engine(containers):
    from benchmarks.llamacpp import our_bench
    r = our_bench(containers(oracle_names()[0], 4), threads=1, prompt=6, gen=4)
    assert "error" not in r, r
    assert r["tg"] > 0 and r["pp"] > 0
