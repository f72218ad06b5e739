"""benchmarks/turns.py's plumbing (not its timings): a short conversation on the demo model, the
three modes measured, turn 2 prefilling only its new tokens."""
from __future__ import annotations

import argparse


def test_turns_benchmark_rows(capsys):
    from benchmarks.turns import run, table
    from models import default_model
    if default_model() is None:
        import pytest
        pytest.skip("no demo model")
    a = argparse.Namespace(model=None, turns=3, user_tokens=20, reply_tokens=4, threads=1, cap=None,
                           kv_cache="float32", seed=0, repeats=2)
    rows = run(a)
    assert [r["turn"] for r in rows] == [1, 2, 3]
    assert rows[0]["cached"] == 0 and rows[0]["new"] == 20
    for prev, r in zip(rows, rows[1:]):
        # the previous prompt and its reply's fed tokens came from the cache: only the last
        # reply token (never fed) and the 20 new ids were computed
        assert r["cached"] == prev["prompt"] + 3 and r["new"] == 21
        assert r["restart_s"] > 0 and r["restore_s"] > 0 and r["file_bytes"] > 0
        assert r["recompute_s"] > 0 and r["reuse_s"] > 0
    lines = table(rows).splitlines()
    assert len(lines) == 4 and lines[0].split()[:3] == ["turn", "prompt", "new"]
