"""Decode products (issues 18, 20): the multi-row kernels against the one-row loops they
replaced, interleaved in one process, next to numpy's read bandwidth measured in the same run.
Prints numbers; asserts nothing.

--kind int8: the int8 per-row product (the lm_head; ``qmatmul._set_q8_multirow``);
--kind int4: int4 group 64 (``qmatmul._set_q4_multirow``: the AVX-512 two-row pass; at other
SIMD levels old and new are the same code).  Rounds alternate old / new (same bits, checked
here too) for every shape and thread count; each figure is the best call of all rounds (a shared
machine spoils single rounds, not the best), the bandwidth the best of its measurements spread
over the run.

    python benchmarks/kernel_ab.py [--kind int8|int4] [--shapes 248320x2048,151936x2048]
                                   [--threads 1,2] [--rounds 8] [--calls 5] [--tokens 1]
                                   [--simd NAME]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import format_summary, machine_summary, parse_shape, ram_read_gbps  # noqa: E402
from cython_kernels import qmatmul as qm  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="248320x2048,151936x2048",
                    help="Qwen3.6's head (248320 x 2048) and OLMoE's benchmark head (151936 x 2048)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=5, help="timed calls per kernel per round")
    ap.add_argument("--tokens", type=int, default=1, help="rows of x (T)")
    ap.add_argument("--kind", choices=("int8", "int4"), default="int8")
    ap.add_argument("--simd", default="auto", help="SIMD variant (default: the dispatcher's)")
    ap.add_argument("--bw-mib", type=int, default=1024, help="array size of the bandwidth reading")
    a = ap.parse_args(argv)
    if a.simd not in ("auto", *qm.simd_variants()):
        raise SystemExit(f"error: --simd {a.simd!r} is not one of auto, {', '.join(qm.simd_variants())}")
    qm.set_simd(a.simd)
    toggle = qm._set_q8_multirow if a.kind == "int8" else qm._set_q4_multirow
    shapes = [parse_shape(s) for s in a.shapes.split(",")]
    threads = [int(t) for t in a.threads.split(",")]
    print("machine:")
    print(format_summary(machine_summary()))
    print(f"  kernels    {a.kind}, simd {qm.simd_level()}, threads {threads}, T={a.tokens}")
    rng = np.random.default_rng(0)
    bw = {t: 0.0 for t in threads}
    best = {}
    sizes = {}
    for O, I in shapes:
        if a.kind == "int8":
            w = rng.integers(-127, 128, size=(O, I), dtype=np.int8)
            s = rng.uniform(0.001, 0.01, size=O).astype(np.float32)
            run = lambda xx: qm.q8_matmul(xx, w, s)  # noqa: E731
        else:
            w = rng.integers(0, 256, size=(O, (I + 1) // 2), dtype=np.uint8)
            s = rng.uniform(0.001, 0.01, size=(O, -(-I // 64))).astype(np.float32)
            run = lambda xx: qm.q4_matmul(xx, w, s, I, 64)  # noqa: E731
        x = rng.standard_normal((a.tokens, I)).astype(np.float32)
        nbytes = w.nbytes + s.nbytes
        ref = None
        for rnd in range(a.rounds):
            for t in threads:
                bw[t] = max(bw[t], ram_read_gbps(t, nbytes=a.bw_mib << 20, repeats=2))
                qm.set_num_threads(t)
                for name, on in (("old", False), ("new", True)) if rnd % 2 == 0 else \
                        (("new", True), ("old", False)):
                    toggle(on)
                    y = run(x)
                    if ref is None:
                        ref = y.copy()
                    elif not np.array_equal(y.view(np.int32), ref.view(np.int32)):
                        raise SystemExit(f"error: {name} kernel gave other bits at {O}x{I}")
                    for _ in range(a.calls):
                        t0 = time.perf_counter()
                        run(x)
                        dt = time.perf_counter() - t0
                        k = (O, I, t, name)
                        best[k] = min(best.get(k, float("inf")), dt)
            print(f"  round {rnd + 1}/{a.rounds} {O}x{I} done", flush=True)
        sizes[O, I] = nbytes
        del w
    toggle(True)
    qm.set_simd("auto")
    qm.set_num_threads(0)
    print()
    for t in threads:
        print(f"numpy read reduction, {t} thread{'s' * (t > 1)}: {bw[t]:.1f} GB/s (best of the run)")
    print(f"\n{'O x I':>12} {'thr':>3} {'old GB/s':>9} {'ratio':>6} {'new GB/s':>9} {'ratio':>6} "
          f"{'new/old':>7}")
    for O, I in shapes:
        nbytes = sizes[O, I]
        for t in threads:
            go = nbytes / best[(O, I, t, "old")] / 1e9
            gn = nbytes / best[(O, I, t, "new")] / 1e9
            print(f"{f'{O}x{I}':>12} {t:3d} {go:9.1f} {go / bw[t]:6.2f} {gn:9.1f} {gn / bw[t]:6.2f} "
                  f"{gn / go:7.2f}")


if __name__ == "__main__":
    main()
