"""Decode attention speed (issues 18 / 20): one query position's ``attend_one`` against a KV cache
of S positions, for the head shapes of Qwen3.6 (16 q / 2 kv heads x 256), OLMoE (16 / 16 x 128)
and GLM-4.5-Air (96 / 8 x 128), 1 and 2 threads. Prints microseconds per call and the K + V bytes
read per second next to numpy's read bandwidth at the same thread count (benchmarks/common
ram_read_gbps). Times: the best of --rounds rounds (each a batch of --min-time seconds), as a
shared machine only ever slows a round down. Asserts nothing.

The cache rotates between copies totalling >= --cold-mib MiB, so each call reads K / V from
memory as in a real decode step (where the layer's weights pass through the caches between two
attentions), not from the last-level cache.

--before PATH: a second build of the extension (a qmatmul*.so of another commit, e.g. copied
from main before a change) loaded into the same process under another name; its calls alternate
with this checkout's, round by round, and the table gains its time and the ratio before / after.

    python benchmarks/attention.py [--before /tmp/base/qmatmul.cpython-311-x86_64-linux-gnu.so]
                                   [--positions 16,1024,4096,16384] [--threads 1,2]
                                   [--shapes qwen36,olmoe,glm45air] [--rounds 5] [--f16]
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import format_summary, machine_summary, ram_read_gbps  # noqa: E402
from cython_kernels import qmatmul as qm  # noqa: E402

SHAPES = {"qwen36": (16, 2, 256), "olmoe": (16, 16, 128), "glm45air": (96, 8, 128)}


def load_extension(path):
    """The compiled extension at ``path`` as a separate module (its init symbol is PyInit_qmatmul,
    so the module name must end in .qmatmul)."""
    name = "coli_before.qmatmul"
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _time(call, caches, min_time):
    """Seconds per call: calls cycle through the caches, for ~min_time."""
    call(*caches[0])
    n, t0 = 0, time.perf_counter()
    while True:
        for c in caches:
            call(*c)
        n += len(caches)
        el = time.perf_counter() - t0
        if el >= min_time:
            return el / n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="a qmatmul*.so of another commit, timed alternately")
    ap.add_argument("--positions", default="16,1024,4096,16384")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.05, help="seconds per timed batch")
    ap.add_argument("--cold-mib", type=int, default=256)
    ap.add_argument("--f16", action="store_true", help="a float16 cache (attend_one_f16)")
    a = ap.parse_args(argv)
    try:
        positions = [int(x) for x in a.positions.split(",")]
        threads = [int(x) for x in a.threads.split(",")]
        shapes = [(s, SHAPES[s]) for s in a.shapes.split(",")]
    except (ValueError, KeyError) as e:
        sys.exit(f"attention.py: bad --positions / --threads / --shapes ({e})")
    if a.before and not os.path.isfile(a.before):
        sys.exit(f"attention.py: no such file {a.before}")
    mods = {"after": qm}
    if a.before:
        mods["before"] = load_extension(a.before)
    print(format_summary(machine_summary()))
    print(f"simd {qm.simd_level()}, float16 cache: {a.f16}, cold set >= {a.cold_mib} MiB")
    bw = {t: ram_read_gbps(t, nbytes=1 << 29, repeats=3) for t in threads}
    rng = np.random.default_rng(0)
    rows = []
    for name, (H, KV, D) in shapes:
        for S in positions:
            one = 2 * KV * S * D * (2 if a.f16 else 4)
            copies = max(1, min(64, -(-a.cold_mib * (1 << 20) // one)))
            q = rng.standard_normal((H, D)).astype(np.float32)
            caches = []
            for _ in range(copies):
                k = rng.standard_normal((KV, S, D)).astype(np.float32)
                v = rng.standard_normal((KV, S, D)).astype(np.float32)
                if a.f16:
                    k, v = k.astype(np.float16).view(np.uint16), v.astype(np.float16).view(np.uint16)
                caches.append((q, k, v, np.float32(D ** -0.5), 0))
            for t in threads:
                times = {lab: [] for lab in mods}
                for r in range(a.rounds):
                    order = list(mods) if r % 2 == 0 else list(mods)[::-1]
                    for lab in order:
                        m = mods[lab]
                        m.set_num_threads(t)
                        call = m.attend_one_f16 if a.f16 else m.attend_one
                        times[lab].append(_time(call, caches, a.min_time))
                # the best round: on a shared machine the others are slowed by neighbours
                med = {lab: min(v) for lab, v in times.items()}
                gbps = one / med["after"] / 1e9
                row = (f"{name:9s} {H:3d}/{KV:<2d}x{D:<3d} S={S:6d} thr={t}  "
                       f"after {med['after'] * 1e6:9.1f} us  {gbps:6.2f} GB/s "
                       f"({gbps / bw[t]:4.2f} of {bw[t]:.1f})")
                if "before" in med:
                    row += (f"  before {med['before'] * 1e6:9.1f} us "
                            f"x{med['before'] / med['after']:.2f}")
                print(row, flush=True)
                rows.append(row)
            del caches
    qm.set_num_threads(0)


if __name__ == "__main__":
    main()
