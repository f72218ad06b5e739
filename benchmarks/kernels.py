"""Kernel speed against the machine's read bandwidth (issue 5). Prints numbers; asserts nothing.

Decode (T == 1): GB/s of packed weights + scales streamed by ``q4_matmul`` (int4, group 64) and
``q8_matmul`` (int8 per row), 1 and 2 threads, next to numpy's read-reduction bandwidth with the
same thread count (benchmarks/common.ram_read_gbps, best of several measurements spread over the
run, because this kind of machine is often shared) -> ratio. The goal is ratio >= 0.85 for the
matrices far bigger than the last-level cache (151936 x 2048); the small ones fit in L2/L3, so
their ratio can exceed 1. ``int4 i8x`` rows: the opt-in int8-activation path
(``set_int8_activations``), not the default. ``fp4`` rows: ``fp4_matmul`` over E2M1 codes + a
UE8M0 byte per 32 (core.quant.FP4, the routed experts DeepSeek V4 / Kimi K3 ship), and at the end
its share of the read bandwidth against the int4 kernel's on the same shape and thread count.

Prefill (T > 1): GFLOP/s (2 * O * I * T / s), next to numpy sgemm on the float32 matrix of the
same shape (OpenBLAS with its own default threads).

    python benchmarks/kernels.py [--repeats N] [--rounds R] [--simd default|all|avx2|...]
                                 [--prefill T] [--threads 1,2] [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import format_summary, machine_summary, ram_read_gbps  # noqa: E402
from cython_kernels import qmatmul as qm  # noqa: E402

SHAPES = [(2048, 1024), (1024, 2048), (7168, 2048), (151936, 2048)]   # (O rows, I cols)
GS = 64


def _weights(O, I, kind, rng):
    """Random packed weights (values do not matter for speed; no quantization pass needed)."""
    if kind.startswith("int4"):
        w = rng.integers(0, 256, size=(O, (I + 1) // 2), dtype=np.uint8)
        s = rng.uniform(0.001, 0.01, size=(O, -(-I // GS))).astype(np.float32)
    elif kind == "fp4":
        w = rng.integers(0, 256, size=(O, (I + 1) // 2), dtype=np.uint8)
        s = rng.integers(110, 130, size=(O, -(-I // 32)), dtype=np.uint8)
    else:
        w = rng.integers(-127, 128, size=(O, I), dtype=np.int8)
        s = rng.uniform(0.001, 0.01, size=O).astype(np.float32)
    return w, s, w.nbytes + s.nbytes


def _best(fn, repeats, min_time=0.3):
    """Best seconds per call over ``repeats`` timed batches (each batch ~min_time / repeats)."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    n = max(1, int(min_time / repeats / one))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


class Bandwidth:
    """numpy read-reduction bandwidth per thread count: the best of every measurement so far."""

    def __init__(self, threads):
        self.threads = threads
        self.best = {t: 0.0 for t in threads}

    def measure(self, nbytes=1 << 30, repeats=5):
        for t in self.threads:
            self.best[t] = max(self.best[t], ram_read_gbps(t, nbytes=nbytes, repeats=repeats))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--simd", default="default",
                    help="'default' (what the dispatcher picks), 'all' (every supported variant) "
                         "or one variant name")
    ap.add_argument("--prefill", type=int, default=64, help="T for the prefill columns (0: skip)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--quick", action="store_true", help="skip the 151936-row matrix")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all cases (best kept)")
    a = ap.parse_args(argv)
    threads = [int(t) for t in a.threads.split(",")]
    print("machine:")
    print(format_summary(machine_summary()))
    print(f"  kernels    simd {qm.simd_level()} (supported: {', '.join(qm.simd_variants())}), "
          f"openmp {qm.openmp_enabled()}, default threads {qm.get_num_threads()}")
    bw = Bandwidth(threads)
    bw.measure()
    variants = ([qm.simd_level()] if a.simd == "default" else
                list(qm.simd_variants()) if a.simd == "all" else [a.simd])
    rng = np.random.default_rng(0)
    shapes = SHAPES[:-1] if a.quick else SHAPES
    # every case is measured in --rounds rounds spread over the run and the best kept: on a
    # shared machine a burst of other work then spoils one round, not the figure
    cases = []
    for v in variants:
        for kind in ("int4", "int4 i8x", "int8", "fp4"):
            if kind == "int4 i8x" and v == "portable":
                continue
            for O, I in shapes:
                w, s, nbytes = _weights(O, I, kind, rng)
                cases.append({"v": v, "kind": kind, "O": O, "I": I, "w": w, "s": s,
                              "nbytes": nbytes, "dec": {}, "pf": {}, "sg": None})
    x1 = {I: rng.standard_normal((1, I)).astype(np.float32) for _, I in shapes}
    xp = {I: rng.standard_normal((a.prefill, I)).astype(np.float32) for _, I in shapes} \
        if a.prefill else {}
    for rnd in range(a.rounds):
        for c in cases:
            qm.set_simd(c["v"])
            qm.set_int8_activations(c["kind"] == "int4 i8x")
            w, s, O, I = c["w"], c["s"], c["O"], c["I"]
            if c["kind"].startswith("int4"):
                run = lambda xx: qm.q4_matmul(xx, w, s, I, GS)  # noqa: E731
            elif c["kind"] == "fp4":
                run = lambda xx: qm.fp4_matmul(xx, w, s, I)  # noqa: E731
            else:
                run = lambda xx: qm.q8_matmul(xx, w, s)  # noqa: E731
            for t in threads:
                qm.set_num_threads(t)
                g = c["nbytes"] / _best(lambda: run(x1[I]), a.repeats) / 1e9
                c["dec"][t] = max(c["dec"].get(t, 0.0), g)
                if a.prefill and O * I <= 16 << 20:
                    f = 2 * O * I * a.prefill / _best(lambda: run(xp[I]), 3) / 1e9
                    c["pf"][t] = max(c["pf"].get(t, 0.0), f)
            if a.prefill and O * I <= 16 << 20 and c["kind"] == "int4" and rnd == 0:
                wf = rng.standard_normal((O, I)).astype(np.float32)
                c["sg"] = 2 * O * I * a.prefill / _best(lambda: xp[I] @ wf.T, 3) / 1e9
                del wf
            print(f"  round {rnd + 1}/{a.rounds}: {c['v']} {c['kind']} {O}x{I}: "
                  + ", ".join(f"{t}T {c['dec'][t]:.1f} GB/s" for t in threads), flush=True)
        bw.measure(repeats=3)
    qm.set_int8_activations(False)
    qm.set_num_threads(0)
    qm.set_simd("auto")
    rows = [(c["v"], c["kind"], c["O"], c["I"], c["nbytes"], c["dec"], c["pf"], c["sg"])
            for c in cases]

    print()
    for t in threads:
        print(f"numpy read reduction, {t} thread{'s' * (t > 1)}: {bw.best[t]:.1f} GB/s "
              f"(best of the run)")
    print(f"\ndecode (T=1): GB/s of packed weights + scales (best of {a.repeats} x {a.rounds} rounds); "
          f"ratio = GB/s / numpy read bandwidth at the same thread count")
    hdr = f"{'simd':8} {'kind':9} {'O x I':>12} {'MB':>7}" + "".join(
        f" {f'{t}T GB/s':>9} {'ratio':>6}" for t in threads)
    if a.prefill:
        hdr += "".join(f" {f'pf{a.prefill} {t}T':>10}" for t in threads) + f" {'sgemm':>7}"
    print(hdr)
    for v, kind, O, I, nbytes, dec, pf, sg in rows:
        line = f"{v:8} {kind:9} {f'{O}x{I}':>12} {nbytes / 1e6:7.1f}"
        line += "".join(f" {dec[t]:9.1f} {dec[t] / bw.best[t]:6.2f}" for t in threads)
        if a.prefill:
            line += "".join(f" {pf[t]:10.1f}" if t in pf else f" {'-':>10}" for t in threads)
            line += f" {sg:7.1f}" if sg else f" {'-':>7}"
        print(line)
    if a.prefill:
        print(f"(prefill columns: GFLOP/s at T={a.prefill}; sgemm: numpy float32 x @ W.T, same "
              f"shape, OpenBLAS default threads)")
    q4 = {(v, O, I): dec for v, kind, O, I, _, dec, _, _ in rows if kind == "int4"}
    print("\nfp4 decode: its share of the read bandwidth / the int4 kernel's (same shape, threads)")
    for v, kind, O, I, _, dec, _, _ in rows:
        if kind == "fp4":
            print(f"{v:8} {f'{O}x{I}':>12}" + "".join(
                f"  {t}T {dec[t] / q4[(v, O, I)][t]:.2f}" for t in threads))


if __name__ == "__main__":
    main()
