"""In-process paired A/B of the decode step between two checkouts of this repository: both
engines loaded in one process over the same container (the OLMoE-geometry bench container cut
to LAYERS layers, every expert resident), stepping alternately (the order flips each round),
16 greedy steps per run; prints each side's median step and the median of the per-round ratios,
and whether both produced the same tokens. Both checkouts share the compiled extension of the
one imported first (cython_kernels is not reloaded).

    git worktree add /tmp/wt_before <rev>; git worktree add /tmp/wt_after <rev>
    (copy cython_kernels/*.so into each), then
    LAYERS=8 ROUNDS=9 python benchmarks/ab_commits.py /tmp/wt_before /tmp/wt_after [threads]
"""
import sys, time, importlib, statistics, os
from pathlib import Path
import numpy as np

def load(root):
    for m in [m for m in sys.modules if m == "core" or m.startswith(("core.", "models"))]:
        del sys.modules[m]
    sys.path.insert(0, root)
    import models
    sys.path.remove(root)
    return models

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.decode import truncated_copy  # noqa: E402
container = truncated_copy(Path("/work/bench_models/olmoe-geom"), int(os.environ.get("LAYERS", "8")))
before_root, after_root = sys.argv[1], sys.argv[2]
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 1
engines = {}
for label, root in (("before", before_root), ("after", after_root)):
    models = load(root)
    e = models.open_model(container, threads=threads, cap=64, prefetch=False)
    assert e.__class__.__module__ == "core.engine" and sys.modules["core.engine"].__file__.startswith(root), root
    engines[label] = e
    print(label, sys.modules["core.engine"].__file__, file=sys.stderr)

def run(e, steps=16):
    cache = e.new_cache()
    logits = e.forward([1, 2, 3, 4, 5, 6, 7, 8], cache)[-1]
    ts, toks = [], []
    for _ in range(steps):
        tok = int(np.argmax(logits)); toks.append(tok)
        t0 = time.perf_counter()
        logits = e.forward([tok], cache)[-1]
        ts.append(time.perf_counter() - t0)
    e.recycle_cache(cache)
    return statistics.median(ts), toks

for e in engines.values():
    run(e, 4)   # warm: experts into RAM
ratios, med = [], {"before": [], "after": []}
same = True
for r in range(int(os.environ.get("ROUNDS", "9"))):
    order = ("before", "after") if r % 2 == 0 else ("after", "before")
    got = {}
    for label in order:
        got[label] = run(engines[label])
        med[label].append(got[label][0])
    same &= got["before"][1] == got["after"][1]
    ratios.append(got["after"][0] / got["before"][0])
print(f"threads {threads}: step before {statistics.median(med['before'])*1e3:.2f} ms, after {statistics.median(med['after'])*1e3:.2f} ms, "
      f"after/before median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} rounds), same tokens: {same}")
