"""What a decode step costs besides the weight-streaming kernels (issue 5: "profile the whole
decode step and move into kernels whatever dominates").

    python benchmarks/overhead.py [--dir DIR] [--threads 1] [--context 100] [--steps 60]

Times ``engine.forward`` on one token with every expert resident, twice: with the real kernels,
and with the int4/int8 products (``core.kernels.matmul`` / ``matmul_many``) replaced by instant
stubs that return constant arrays of the right shapes. The second figure is everything else:
norms, RoPE, attention over the KV cache, routing, the expert store's bookkeeping and Python.
Prints numbers; asserts nothing. Uses the OLMoE-geometry model of decode.py / streaming.py (generated on first use).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _stub_products(kernels) -> None:
    """Replace the products by constant outputs (kernels stay importable for the rest)."""
    def matmul_many(x, ws, rows=None, outs=None):
        rows = rows or [(0, x.shape[0])] * len(ws)
        if outs is not None:
            for o in outs:
                o[...] = 0.01
            return outs
        return [np.full((n, w.shape[0]), 0.01, np.float32) for w, (_, n) in zip(ws, rows)]

    kernels.matmul_many = matmul_many
    kernels.matmul = lambda x, w: np.full((x.shape[0], w.shape[0]), 0.01, np.float32)


def step_ms(engine, context: int, steps: int) -> float:
    from core.cache import KVCache

    cache = KVCache(engine.spec)
    engine.forward(list(range(1, context + 1)), cache)
    for _ in range(5):
        engine.forward([5], cache)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.forward([5], cache)
    return (time.perf_counter() - t0) / steps * 1e3


def main(argv=None) -> int:
    from benchmarks.streaming import DEFAULT_DIR, ensure_container, expert_geometry

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=100, help="positions in the KV cache first")
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args(argv)
    path, _, _ = ensure_container(a.dir, 0)

    from core import kernels
    from models import open_model

    engine = open_model(path, cap=expert_geometry(path)["experts_per_layer"], prefetch=False,
                        threads=a.threads)
    real = step_ms(engine, a.context, a.steps)
    _stub_products(kernels)
    rest = step_ms(engine, a.context, a.steps)
    print(f"threads {a.threads}, context {a.context}: decode step {real:.1f} ms; without the "
          f"products (stubbed) {rest:.1f} ms = {rest / real:.0%} of the step "
          f"({rest / engine.spec.num_layers * 1e3:.0f} us per layer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
