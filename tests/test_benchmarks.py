"""The benchmark scripts' plumbing (not their timings): each runs our engine in a child process
with the options it was given, on a small real container."""
from __future__ import annotations

from tests.conftest import oracle_names


def test_llamacpp_side_by_side_runs_our_engine(containers):
    from benchmarks.llamacpp import our_bench
    for int8 in (False, True):
        r = our_bench(containers(oracle_names()[0], 4), threads=1, prompt=6, gen=4, int8=int8)
        assert "error" not in r, r
        assert r["tg"] > 0 and r["pp"] > 0


def test_decode_benchmark_repeats_report_medians(containers, tmp_path, capsys):
    import argparse

    from benchmarks.decode import bench
    path = containers(oracle_names()[0], 4)
    a = argparse.Namespace(dir=path, tokens=3, prompt_len=4, seed=0, threads="1,2", prefill=0,
                           no_torch=True, layers=0, int8_activations=False, kv_cache="float32",
                           repeats=2, busy=0, model=None)
    assert bench(a, path, tmp_path) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out
    lines = [l.split() for l in out.splitlines() if l.strip()[:1].isdigit() and len(l.split()) == 7]
    assert [l[:2] for l in lines] == [["1", "2"], ["2", "2"]]      # threads, runs
    assert all(float(l[2]) > 0 and float(l[3]) > 0 for l in lines)   # tok/s, GB/s


def test_decode_benchmark_busy_compares_the_default_count(containers, tmp_path, capsys):
    """--busy 1: a busy process runs during the decode runs, the load-following default is
    measured beside the fixed counts, and the comparison line names the count it used."""
    import argparse

    from benchmarks.decode import bench
    path = containers(oracle_names()[0], 4)
    a = argparse.Namespace(dir=path, tokens=3, prompt_len=4, seed=0, threads="1", prefill=512,
                           no_torch=True, layers=0, int8_activations=False, kv_cache="float32",
                           repeats=1, busy=1, model=None)
    assert bench(a, path, tmp_path) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and "--busy 1" in out
    rows = [l.split() for l in out.splitlines() if l.split()[:1] in (["1"], ["default"]) and len(l.split()) == 10]
    assert [r[0] for r in rows] == ["1", "default"] * 2      # the decode table, the summary table
    summary = [l for l in out.splitlines() if l.startswith("default threads")]
    assert len(summary) == 1 and "x the best fixed count (1 threads" in summary[0]
