"""One decode position of one attention layer, the two ways the engine can run it: the
step-by-step path (input norm, ``layer.mixer`` -- its products, norms, RoPE, KV append, attention,
o -- and the residual add: what ``engine.fused_attention = False`` runs, and what a layer without
a compiled block always runs) and the compiled block (``layer.attention_block``, one call), timed
alternately in one process over a synthetic cache (``decode.fill_cache``). Prints ms per call
(best and median of --repeats) and whether both gave the same bits. Asserts nothing.

    python benchmarks/attention_layer.py --dir /work/bench_models/qwen36-geom-4L --layer 3 \\
        --context 16,4096 --threads 1,2 [--repeats 30]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def time_layer(engine, i: int, n: int, repeats: int) -> dict:
    from benchmarks.decode import fill_cache
    from core import kernels

    L, s = engine.layers[i], engine.spec
    cache = engine.new_cache()
    fill_cache(engine, cache, n, "synthetic", 7, s.vocab_size)
    cache.ensure(i, n + 1)
    x = np.random.default_rng(1).standard_normal((1, s.hidden_size), dtype=np.float32)
    pass_ = engine.step(np.array([1]), cache)       # each call writes position n again

    def step():
        return x + L.mixer(i, kernels.rms_norm(x, L.input_norm, s.rms_norm_eps), pass_)

    def block():
        return L.compiled(i, x, pass_)[0]

    ways = {"step": step} if L.compiled is None else {"step": step, "block": block}
    outs = {name: f() for name, f in ways.items()}
    times = {name: [] for name in ways}
    for r in range(repeats):
        for name in (list(ways) if r % 2 else list(ways)[::-1]):
            t0 = time.perf_counter()
            ways[name]()
            times[name].append(1e3 * (time.perf_counter() - t0))
    res = {name: (min(t), statistics.median(t)) for name, t in times.items()}
    if "block" in outs:
        res["same_bits"] = bool(np.array_equal(outs["step"], outs["block"]))
    engine.recycle_cache(cache)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--layer", type=int, required=True)
    ap.add_argument("--context", default="16,4096", help="cache positions before the timed one")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args(argv)
    from core import kernels
    from models import open_model

    try:
        contexts = [int(v) for v in a.context.split(",")]
        threads = [int(v) for v in a.threads.split(",")]
    except ValueError:
        print(f"error: --context / --threads must be comma-separated integers", file=sys.stderr)
        return 2
    engine = open_model(a.dir, cap=1, prefetch=False)
    if not 0 <= a.layer < len(engine.layers):
        print(f"error: --layer must be in 0..{len(engine.layers) - 1}", file=sys.stderr)
        return 2
    print(f"layer {a.layer}: {type(engine.layers[a.layer].mixer).__name__}, compiled block: "
          f"{engine.layers[a.layer].compiled is not None}")
    for t in threads:
        kernels.set_threads(t)
        for n in contexts:
            r = time_layer(engine, a.layer, n, a.repeats)
            cols = "  ".join(f"{k} {v[0]:.3f} / {v[1]:.3f} ms" for k, v in r.items() if k != "same_bits")
            extra = f"  same bits: {r['same_bits']}" if "same_bits" in r else ""
            print(f"threads {t}  context {n:5d}  (best / median)  {cols}{extra}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
