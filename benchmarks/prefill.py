"""Prefill speed: the prefill GEMM against dequantize + sgemm, in-process and paired (issue 20).

    python benchmarks/prefill.py [--dir DIR] [--layers 4] [--vocab 151851] [--tokens 512]
                                 [--threads 1,2] [--rounds 5] [--budget-frac 0.25]
                                 [--llama-bench PATH --gguf FILE [--llama-args "--repack 0"]]

One child process per thread count (OMP and OpenBLAS threads = that count, as decode.py's
children) opens benchmarks/llamacpp.py's random OLMoE-geometry container (DIR, default
/work/bench_models/olmoe-geom-<L>L-v<vocab>, made once) with every expert resident, then times
``--tokens``-token prefills (Engine.prefill, a fresh KV cache each) alternating between the two
paths of core.kernels (PREFILL_GEMM on / off) for ``--rounds`` rounds, and prints per path the
best and median wall tok/s, the median process CPU seconds (on a shared machine the CPU time is
the steadier figure: time slices lost to other jobs are not in it), the engine's attention /
experts split, and the paired ratio (median over rounds of off-time / on-time of the same round).

``--llama-bench`` / ``--gguf``: llama.cpp's prefill of the same length on the same thread counts
(``llama-bench -p TOKENS -n 0 -r ROUNDS``, plus ``--llama-args``), run before our child on odd
rounds of the thread loop and after it on even ones, and the ratio ours (GEMM, median) / theirs.

``--budget-frac F`` (0 skips): a further child per thread count opens the container with an
expert pool of F of the expert bytes (``ram_gb``), so most experts of a layer come from disk,
each read once per prefill chunk, and times one prefill (the container's expert files evicted
from the page cache first, posix_fadvise: the run says whether that worked), with hits, misses
and bytes read. Prints numbers; asserts
nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import core  # noqa: E402,F401  (before numpy: core/__init__.py sets OpenBLAS's spin timeout)

PROG = "prefill.py"


def child(a) -> None:
    import numpy as np

    from benchmarks.decode import expert_geometry, load_all_experts
    from core import kernels
    from models import open_model

    geo = expert_geometry(a.dir)
    ids = [int(v) for v in np.random.default_rng(a.seed).integers(1, geo["vocab_size"], a.tokens)]
    if a.stream:
        budget = a.budget_frac * geo["total_expert_bytes"] / 1e9
        engine = open_model(a.dir, ram_gb=budget, prefetch=False, threads=a.threads)
        engine.reset_counters()
        c0, t0 = time.process_time(), time.perf_counter()
        engine.prefill(ids, engine.new_cache())
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        st = engine.store.stats() if hasattr(engine.store, "stats") else {}
        c = dict(engine.counters)
        print(json.dumps({"s": dt, "cpu_s": dc, "budget_gb": budget, "counters": c,
                          "store": st, "gemm": kernels.PREFILL_GEMM}, default=str))
        return
    engine = open_model(a.dir, cap=geo["experts_per_layer"], prefetch=False, threads=a.threads)
    load_all_experts(engine, geo)
    engine.prefill(ids[:64], engine.new_cache())          # warm-up: first touches, allocations
    runs = {True: [], False: []}
    for r in range(a.rounds):
        for mode in ((True, False) if r % 2 == 0 else (False, True)):
            kernels.PREFILL_GEMM = mode
            engine.reset_counters()
            c0, t0 = time.process_time(), time.perf_counter()
            engine.prefill(ids, engine.new_cache())
            runs[mode].append({"s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                               "attention_s": engine.counters["attention_s"],
                               "experts_s": engine.counters["experts_s"]})
    print(json.dumps({"runs": {str(k): v for k, v in runs.items()}, "simd": kernels.simd_level()}))


def run_child(a, threads: int, stream: bool = False) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--dir", str(a.dir),
           "--tokens", str(a.tokens), "--rounds", str(a.rounds), "--seed", str(a.seed),
           "--child-threads", str(threads), "--budget-frac", repr(a.budget_frac)]
    if stream:
        cmd.append("--stream")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode or not lines:
        return {"error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]}
    return json.loads(lines[-1])


def llama_pp(a, t: int) -> float | str:
    """llama-bench's prefill tok/s (avg over its -r repetitions), or an error line."""
    cmd = [str(a.llama_bench), "-m", str(a.gguf), "-t", str(t), "-p", str(a.tokens), "-n", "0",
           "-r", str(a.rounds), "-o", "json"] + a.llama_args.split()
    r = subprocess.run(cmd, capture_output=True, text=True)
    try:
        return float(json.loads(r.stdout)[0]["avg_ts"])
    except (ValueError, KeyError, IndexError, TypeError):
        return f"llama-bench failed (exit {r.returncode})"


def report(a, t: int, res: dict) -> None:
    on, off = res["runs"]["True"], res["runs"]["False"]
    ratio = statistics.median(b["s"] / g["s"] for g, b in zip(on, off))
    cratio = statistics.median(b["cpu_s"] / g["cpu_s"] for g, b in zip(on, off))
    for name, runs in (("prefill GEMM", on), ("dequant+sgemm", off)):
        best = a.tokens / min(r["s"] for r in runs)
        med = a.tokens / statistics.median(r["s"] for r in runs)
        print(f"{t:7d} {name:14s} {best:9.1f} {med:9.1f} {statistics.median(r['cpu_s'] for r in runs):8.2f} "
              f"{statistics.median(r['attention_s'] for r in runs):7.2f} "
              f"{statistics.median(r['experts_s'] for r in runs):8.2f}  "
              + " ".join(f"{a.tokens / r['s']:.0f}" for r in runs))
    print(f"{t:7d} paired speed-up (median of rounds): wall {ratio:.2f}x, CPU {cratio:.2f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=151851)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-frac", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--llama-bench", type=Path, default=None, help="a built llama-bench, to run beside ours")
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF for --llama-bench")
    ap.add_argument("--llama-args", default="", help="extra llama-bench arguments, e.g. '--repack 0'")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-threads", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        a.threads = a.child_threads
        child(a)
        return 0
    try:
        threads = [int(v) for v in a.threads.split(",")]
    except ValueError:
        raise SystemExit(f"{PROG}: error: --threads {a.threads!r}: want comma-separated integers")
    if min(threads) < 1 or a.tokens < 1 or a.rounds < 1 or not 0 <= a.budget_frac < 1:
        raise SystemExit(f"{PROG}: error: --threads, --tokens, --rounds >= 1; 0 <= --budget-frac < 1")
    if (a.llama_bench is None) != (a.gguf is None):
        raise SystemExit(f"{PROG}: error: --llama-bench and --gguf go together")
    for f in (a.llama_bench, a.gguf):
        if f is not None and not f.is_file():
            raise SystemExit(f"{PROG}: error: {f}: no such file")
    from benchmarks.common import evict_file, format_summary, machine_summary
    from benchmarks.llamacpp import our_container
    a.dir = our_container(a.dir, a.layers, a.vocab)
    print(format_summary(machine_summary(a.dir)))
    print(f"model: {a.dir} ({a.layers} layers, vocab {a.vocab}); {a.tokens}-token prefill, "
          f"{a.rounds} paired rounds; load average {os.getloadavg()[0]:.1f}")
    print(f"{'threads':>7} {'path':14s} {'best tok/s':>9} {'med tok/s':>9} {'CPU s':>8} {'attn s':>7} "
          f"{'experts s':>8}  tok/s per round")
    theirs = {}
    for n, t in enumerate(threads):
        if a.llama_bench and n % 2 == 0:
            theirs[t] = llama_pp(a, t)
        res = run_child(a, t)
        if a.llama_bench and n % 2 == 1:
            theirs[t] = llama_pp(a, t)
        if "error" in res:
            print(f"{t:7d} FAILED: {res['error']}")
            continue
        report(a, t, res)
        if t in theirs:
            ours = a.tokens / statistics.median(r["s"] for r in res["runs"]["True"])
            got = theirs[t]
            print(f"{t:7d} llama.cpp {a.gguf.name} {a.llama_args}: " + (
                f"{got:.1f} tok/s -> ours (GEMM, median) / llama.cpp = {ours / got:.2f}x"
                if isinstance(got, float) else got))
    if a.budget_frac > 0:
        print(f"\nstreaming: expert pool = {a.budget_frac:.0%} of the expert bytes, one prefill per "
              f"thread count, prefill GEMM on")
        for t in threads:
            dropped = all([evict_file(f) for f in sorted(a.dir.glob("layer-*.safetensors"))])
            res = run_child(a, t, stream=True)
            if "error" in res:
                print(f"{t:7d} FAILED: {res['error']}")
                continue
            st = res.get("store") or {}
            print(f"{t:7d} threads: {a.tokens / res['s']:.1f} tok/s ({res['s']:.2f} s, CPU {res['cpu_s']:.2f} s), "
                  f"pool {res['budget_gb']:.2f} GB, expert files {'evicted from the page cache' if dropped else 'NOT evicted (page cache may serve them)'}; "
                  f"store: " + ", ".join(f"{k} {v}" for k, v in st.items() if not isinstance(v, (dict, list))))
    print(f"(load average at the end {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
