"""Dense float32 products (bits-16 weights, the router): the row-invariant kernel
(``qmatmul.dense_matmul``, cython_kernels/dense.h) against numpy's ``x @ W.T`` (OpenBLAS sgemv for
one row, sgemm for many), interleaved in one process. Prints numbers; asserts nothing.

numpy's BLAS thread count is fixed when the process starts: run once per count with
OPENBLAS_NUM_THREADS set, the kernel at the same count (--threads defaults to it). Each figure is
the best call of all rounds (a shared machine spoils single rounds, not the best); one row is
reported as GB/s of W read, many rows as GFLOP/s. Between the two kernels the process sleeps
(--pause): OpenBLAS's workers spin after each call, and on 2 cores an OpenMP team behind them
ran up to 5x slower (the engine itself no longer calls sgemm for these products).

    OPENBLAS_NUM_THREADS=1 python benchmarks/dense_matmul.py [--shapes 4096x2048,12288x2048]
                                   [--tokens 1,32,128,512] [--rounds 5] [--calls 3] [--simd NAME]

--prefill DIR: instead, a whole prefill of the container DIR (``--tokens``' first count, every
expert resident, --threads threads), alternating the dense kernel on and off (off: numpy for
dense matrices, the old C router / sgemm for the router) round by round.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import format_summary, machine_summary, parse_shape  # noqa: E402
from core import kernels  # noqa: E402,F401  (sets the OpenMP spin the engine runs with)
from cython_kernels import qmatmul as qm  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2048x4096,4096x2048,12288x2048,8192x2048",
                    help="O x K of W; Qwen3.6's linear-attention in_proj: 12288 / 8192 x 2048")
    ap.add_argument("--tokens", default="1,32,128,512", help="rows of x (T)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OPENBLAS_NUM_THREADS", "1")))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3, help="timed calls per kernel per round")
    ap.add_argument("--simd", default="auto", help="SIMD variant (default: the dispatcher's)")
    ap.add_argument("--pause", type=float, default=0.3,
                    help="seconds between the two kernels: after an sgemm OpenBLAS's threads keep "
                         "spinning and a 2-thread OpenMP team on the same cores waits for them")
    ap.add_argument("--prefill", metavar="DIR", help="time Engine.prefill of this container instead")
    a = ap.parse_args(argv)
    if a.prefill:
        return _prefill_ab(a)
    if a.simd not in ("auto", *qm.simd_variants()):
        raise SystemExit(f"error: --simd {a.simd!r} is not one of auto, {', '.join(qm.simd_variants())}")
    qm.set_simd(a.simd)
    qm.set_num_threads(a.threads)
    shapes = [parse_shape(s) for s in a.shapes.split(",")]
    tokens = [int(t) for t in a.tokens.split(",")]
    print("machine:")
    print(format_summary(machine_summary()))
    print(f"  kernels    dense, simd {qm.dense_level()}, threads {a.threads}, "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}")
    rng = np.random.default_rng(0)
    print(f"\n{'O x K':>12} {'T':>4} {'numpy ms':>9} {'dense ms':>9} {'numpy':>8} {'dense':>8} "
          f"{'dense/numpy':>11}   (GB/s of W for T = 1, else GFLOP/s)")
    for O, K in shapes:
        W = rng.standard_normal((O, K)).astype(np.float32)
        for T in tokens:
            x = rng.standard_normal((T, K)).astype(np.float32)
            runs = {"numpy": lambda: x @ W.T, "dense": lambda: qm.dense_matmul(x, W)}
            err = np.abs(runs["dense"]() - x.astype(np.float64) @ W.T.astype(np.float64)).max()
            best = {n: float("inf") for n in runs}
            for rnd in range(a.rounds):
                for name in (("numpy", "dense") if rnd % 2 == 0 else ("dense", "numpy")):
                    f = runs[name]
                    time.sleep(a.pause)     # the other's spinning threads (OpenBLAS's, ours) sleep
                    f()
                    for _ in range(a.calls):
                        t0 = time.perf_counter()
                        f()
                        best[name] = min(best[name], time.perf_counter() - t0)
            rate = (lambda s: W.nbytes / s / 1e9) if T == 1 else (lambda s: 2 * T * O * K / s / 1e9)
            print(f"{f'{O}x{K}':>12} {T:4d} {best['numpy'] * 1e3:9.3f} {best['dense'] * 1e3:9.3f} "
                  f"{rate(best['numpy']):8.1f} {rate(best['dense']):8.1f} "
                  f"{best['numpy'] / best['dense']:11.2f}   max |err| vs float64 {err:.2g}",
                  flush=True)
    qm.set_simd("auto")
    qm.set_num_threads(0)


def _prefill_ab(a) -> None:
    from models import open_model
    T = int(a.tokens.split(",")[0])
    engine = open_model(a.prefill, threads=a.threads)
    ids = (np.arange(T) * 7919 % 1000 + 10).tolist()
    dense = kernels._dense_compiled
    took = {"dense": [], "off": []}
    try:
        for rnd in range(a.rounds):
            for name in (("dense", "off") if rnd % 2 == 0 else ("off", "dense")):
                kernels._dense_compiled = dense if name == "dense" else (lambda: False)
                time.sleep(a.pause)
                cache = engine.new_cache()
                t0 = time.perf_counter()
                engine.prefill(ids, cache)
                took[name].append(time.perf_counter() - t0)
                engine.recycle_cache(cache)
    finally:
        kernels._dense_compiled = dense
    print(f"prefill of {T} tokens, {a.threads} threads, {a.prefill}:")
    for name, ts in took.items():
        print(f"  {name:6s} best {min(ts):.3f} s, median {sorted(ts)[len(ts) // 2]:.3f} s")


if __name__ == "__main__":
    main()
