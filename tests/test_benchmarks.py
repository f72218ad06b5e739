"""The benchmark scripts' plumbing (not their timings): each runs our engine in a child process
with the options it was given, on a small real container."""
from __future__ import annotations

import numpy as np
import pytest

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


def test_decode_benchmark_family_geometries_at_a_context(tmp_path, capsys):
    """--geometry's configs (benchmarks/families.py, tiny versions of the same structure), decoded
    at a short prompt and after N cached positions (--context; a synthetic fill, a real prefill): the rows, the bytes
    breakdown naming each layer's cache kinds, and the prefill line."""
    import argparse

    from benchmarks.decode import bench
    from benchmarks.families import ensure, geometry
    for name, fill, kinds in (("glm45air", "synthetic", "4 layers x (kv 256 B)"),
                              ("glm5", "prefill", "1 layer x (latent 96 B + index_keys 64 B), 1 layer x (latent 96 B)")):
        path, made, _ = ensure(tmp_path / name, geometry(name, tiny=True))
        assert made
        a = argparse.Namespace(dir=path, tokens=3, prompt_len=4, seed=0, threads="1", prefill=12,
                               no_torch=True, layers=0, int8_activations=False, kv_cache="float32",
                               repeats=1, busy=0, model=None, context="0,20", fill=fill, preload=True)
        (tmp_path / f"{name}-{fill}").mkdir()
        assert bench(a, path, tmp_path / f"{name}-{fill}") == 0
        out = capsys.readouterr().out
        assert "FAILED" not in out and kinds in out, out
        rows = [l.split() for l in out.splitlines() if l.split()[:2] in (["0", "1"], ["20", "1"])]
        assert [r[0] for r in rows] == ["0", "20"] * 2          # decode table, prefill table
        assert float(rows[1][-1]) >= 0 and float(rows[0][2]) > 0   # fill s; tok/s
        assert "prefill of 12 positions" in out


def test_decode_benchmark_qwen36_counts_the_fixed_state(tmp_path, capsys):
    """--geometry qwen36 (tiny): 3 Gated DeltaNet layers + 1 attention layer; the bytes touched
    count the linear layers' fixed state read + written each step, the synthetic fill sets their
    state, and each row times the linear core three ways (numpy, compiled pieces, fused)."""
    import argparse

    from benchmarks.decode import bench
    from benchmarks.families import ensure, geometry
    from core import kernels
    path, _, _ = ensure(tmp_path / "q", geometry("qwen36", tiny=True))
    a = argparse.Namespace(dir=path, tokens=3, prompt_len=4, seed=0, threads="1", prefill=0,
                           no_torch=True, layers=0, int8_activations=False, kv_cache="float32",
                           repeats=1, busy=0, model=None, context="0,20", fill="synthetic", preload=True)
    (tmp_path / "run").mkdir()
    assert bench(a, path, tmp_path / "run") == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and "1 layer x (kv 256 B)" in out, out
    fixed = 3 * ((2 * 2 * 16 + 4 * 16) * 3 + 4 * 16 * 16) * 4       # 3 layers' conv + recurrent, f32
    assert f"read + written each step: 2 x {fixed:,} B" in out
    rows = [l.split() for l in out.splitlines() if l.split()[:2] in (["0", "1"], ["20", "1"])]
    assert [r[0] for r in rows][:2] == ["0", "20"] and float(rows[1][2]) > 0
    steps = [l for l in out.splitlines() if l.strip().startswith(("0 ", "20 ")) and "numpy" in l]
    assert len(steps) == 2, out
    if kernels.linear_attention_kernels() is not None:
        assert all("fused" in l and "pieces" in l for l in steps)

def test_decode_benchmark_dsv4flash_counts_fp4_experts_and_its_caches(tmp_path, capsys):
    """--geometry dsv4flash (tiny): FP4 routed experts, the ring / compressed entries / indexer
    keys counted at each context (attention reads at most index_topk of a CSA layer's entries),
    tid2eid a lookup table like the embedding (one row a token); the synthetic fill writes the
    compressors' entries, and the decode runs at both contexts."""
    import argparse

    from benchmarks.decode import bench, cache_read_bytes, fill_cache
    from benchmarks.families import ensure, geometry
    from models import family_for, open_model
    cfg = geometry("dsv4flash", tiny=True)
    path, _, _ = ensure(tmp_path / "d", cfg, fp4_experts=True)
    spec = family_for(cfg).spec(cfg)
    # mean context 43.5: ring 4 layers x 8 x 32 x 4 B; CSA (ratio 4): 10 entries, 3 read (topk) x 32 x 4
    # + its open block 2 x 4 x (64 + 32) x 4, indexer 10 x 16 x 4 + 2 x 4 x (32 + 16) x 4; HCA (8):
    # 5 x 32 x 4 + 2 x 8 x 32 x 4
    assert cache_read_bytes(spec, 43.5, "float32", cfg["index_topk"]) == {
        "ring": 4096, "compressor": 384 + 3072 + 640 + 2048, "indexer": 640 + 1536}
    engine = open_model(path, threads=1)
    cache = engine.new_cache()
    fill_cache(engine, cache, 40, "synthetic", 0, cfg["vocab_size"])
    assert [len(cache[i]["compressor"].entries(40)) for i in (2, 3)] == [10, 5]
    assert np.isfinite(engine.forward([7], cache)).all() and cache.length == 41
    a = argparse.Namespace(dir=path, tokens=3, prompt_len=4, seed=0, threads="1", prefill=0,
                           no_torch=True, layers=0, int8_activations=False, kv_cache="float32",
                           repeats=1, busy=0, model=None, context="0,40", fill="synthetic", preload=True)
    (tmp_path / "run").mkdir()
    assert bench(a, path, tmp_path / "run") == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and "3 index tables" in out and "fp4_e2m1_ue8m0 experts" in out
    assert "1 layer x (ring 0 B + compressor 32 B + indexer 16 B)" in out
    rows = [l.split() for l in out.splitlines() if l.split()[:2] in (["0", "1"], ["40", "1"])]
    assert [r[0] for r in rows][:2] == ["0", "40"] and float(rows[1][2]) > 0


@pytest.mark.parametrize("name, label", [("glm45air", "GLM-4.5-Air"), ("dsv4flash", "DeepSeek-V4-Flash")])
def test_streaming_benchmark_takes_a_geometry(tmp_path, capsys, monkeypatch, name, label):
    """streaming.py --geometry: the family container (tiny here), 2 of 8 experts per layer, one
    row per run."""
    from benchmarks import common, families, streaming
    monkeypatch.setitem(families.GEOMETRIES, name, families.geometry(name, tiny=True))
    for mod in (common, streaming):       # never drop the shared machine's page cache from a test
        monkeypatch.setattr(mod, "drop_page_cache", lambda: False)
    assert streaming.main(["--geometry", name, "--dir", str(tmp_path / "g"), "--tokens", "4",
                           "--cap", "2", "--o-direct", "1", "--keep"]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and label in out
    assert sum(l.startswith(("prefetch off", "prefetch on")) for l in out.splitlines()) == 2


def test_bigger_than_ram_reads_llama_cpp_s_decode_time_and_replays_the_demo_trace():
    """benchmarks/bigger_than_ram.py's plumbing: llama.cpp's perf lines (the decode's, not the
    prompt's), and the replay projection on the demo model's routing trace."""
    from benchmarks.bigger_than_ram import llama_eval, replay_projection
    err = ("llama_perf_context_print: prompt eval time =     812.40 ms /    15 tokens (   54.16 ms per token)\n"
           "llama_perf_context_print:        eval time =    6200.00 ms /    31 runs   (  200.00 ms per token,"
           "     5.00 tokens per second)\n")
    assert llama_eval(err) == (6200.0, 31)
    assert llama_eval("nothing here") is None
    r = replay_projection(0.25, 3e6, 8, 12, disk_gbps=1.0)
    assert r["trace_cap"] == 8 and r["trace_experts"] == 32
    assert 0 < r["hit_rate"] <= r["belady_hit_rate"] < 1
    assert r["missed_per_token"] == (1 - r["hit_rate"]) * 8 * 12 * 3e6
    assert abs(r["disk_bound_tok_s"] - 1e9 / r["missed_per_token"]) < 1e-9


def test_kernel_ab_compares_old_and_new_decode_kernels(capsys):
    import pytest
    pytest.importorskip("cython_kernels.qmatmul", reason="compiled kernels not built")
    from benchmarks.kernel_ab import main
    for kind in ("int8", "int4"):
        main(["--kind", kind, "--shapes", "70x200", "--threads", "1,2", "--rounds", "2",
              "--calls", "1", "--bw-mib", "8"])
        rows = [l.split() for l in capsys.readouterr().out.splitlines() if l.strip().startswith("70x200")]
        assert [r[1] for r in rows] == ["1", "2"]
        assert all(float(r[2]) >= 0 and float(r[4]) >= 0 for r in rows)   # old, new GB/s

def test_attention_benchmark_times_two_builds_in_one_process(capsys):
    """benchmarks/attention.py loads a second build of the extension (here: the same file) under
    another name and alternates the two; bad arguments give one line and a non-zero exit."""
    qm = pytest.importorskip("cython_kernels.qmatmul", reason="compiled kernels not built")
    from benchmarks import attention

    attention.main(["--before", qm.__file__, "--positions", "16", "--threads", "1", "--shapes",
                    "olmoe,qwen36", "--rounds", "1", "--min-time", "0.001", "--cold-mib", "1",
                    "--bandwidth-mib", "8"])
    rows = [ln for ln in capsys.readouterr().out.splitlines() if "S=" in ln]
    assert len(rows) == 2 and all("before" in r and "GB/s" in r for r in rows)
    with pytest.raises(SystemExit) as e:
        attention.main(["--positions", "many"])
    assert "bad --positions" in str(e.value)


def test_bigger_than_ram_keeps_a_child_s_output_that_is_not_utf8():
    """A random model's text is arbitrary bytes (llama.cpp prints raw token pieces): the reader
    keeps the rest of the output instead of dying in its thread with a UnicodeDecodeError."""
    import sys

    from benchmarks.bigger_than_ram import run_measured
    r = run_measured([sys.executable, "-c", "import sys; sys.stdout.buffer.write(b'ok \\x8a\\xff tail'); "
                      "sys.stderr.write('eval time = 1 ms')"], timeout=30)
    assert r["rc"] == 0 and r["stdout"].startswith("ok ") and r["stdout"].endswith(" tail")
    assert r["stderr"] == "eval time = 1 ms"
