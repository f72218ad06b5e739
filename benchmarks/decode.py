"""Decode speed with every expert resident, against the RAM-bandwidth bound (issue 5).

    python benchmarks/decode.py [--dir DIR] [--tokens 32] [--threads 1,2] [--prompt-len 8]

Uses the random-weight OLMoE-1B-7B-geometry container of benchmarks/streaming.py (made once under
DIR, default /work/bench_models/olmoe-geom, and kept), opens it with every expert allowed in RAM
(cap = all experts per layer, prefetch off), decodes ``--tokens`` greedy tokens per thread count,
each run in a fresh process, and prints decode tok/s next to the bandwidth bound:

    bound = numpy read bandwidth (same thread count) / bytes touched per decoded token,
    bytes touched = layers x top-k x expert bytes + dense bytes (attention, norms, router,
    lm_head; the embedding table counts one row).

Each run (a fresh process per thread count) first decodes the same prompt once to load the
experts it routes to into RAM, then decodes again, timed: the figures are that second run's
decode steps (its Stats: decode tok/s, and attention / experts / lm_head seconds).
Prints numbers; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import format_summary, machine_summary, ram_read_gbps  # noqa: E402
from benchmarks.streaming import DEFAULT_DIR, ensure_container, expert_geometry  # noqa: E402


def child(a) -> None:
    import numpy as np

    from core.events import Stats
    from core.sampling import SamplingParams
    from models import open_model

    geo = expert_geometry(a.dir)
    engine = open_model(a.dir, cap=geo["experts_per_layer"], prefetch=False, threads=a.threads)
    prompt = [int(v) for v in np.random.default_rng(a.seed).integers(1, geo["vocab_size"], a.prompt_len)]
    out = {}
    for name in ("warm-up", "timed"):
        first = last = None
        t0 = time.perf_counter()
        for ev in engine.generate(prompt, SamplingParams(greedy=True), max_new_tokens=a.tokens):
            if isinstance(ev, Stats):
                d = ev.as_dict()
                first = d if first is None else first
                last = d
        out[name] = {"wall_s": time.perf_counter() - t0, "first": first, "last": last}
    f, l = out["timed"]["first"], out["timed"]["last"]
    steps = max(1, l["new_tokens"] - 1)
    keep = ("attention_s", "experts_s", "lm_head_s")
    print(json.dumps({"tok_s": l["decode_tok_s"], "steps": steps, "hit_rate": l.get("hit_rate"),
                      **{k: (l.get(k, 0.0) - f.get(k, 0.0)) / steps for k in keep}}, default=str))


def run_child(a, t: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--dir", str(a.dir),
           "--tokens", str(a.tokens), "--prompt-len", str(a.prompt_len), "--seed", str(a.seed),
           "--threads", str(t)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        return {"error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]}
    return json.loads(lines[-1])


def embed_bytes(path: Path) -> int:
    from core.container import Container

    c = Container(path)
    try:
        return sum(info.nbytes for name, (_, info) in c.index.items() if "embed_tokens" in name)
    finally:
        c.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        a.threads = int(a.threads)
        child(a)
        return 0
    path, _, _ = ensure_container(a.dir, a.seed)
    geo = expert_geometry(path)
    emb = embed_bytes(path)
    hidden = 2048
    touched = geo["layers"] * geo["top_k"] * geo["expert_bytes"] + geo["dense_bytes"] - emb \
        + emb // max(1, geo["vocab_size"])
    print("machine:")
    print(format_summary(machine_summary(path)))
    print(f"model: {geo['layers']} layers x {geo['experts_per_layer']} experts of "
          f"{geo['expert_bytes'] / 1e6:.2f} MB (top-{geo['top_k']}), dense {geo['dense_bytes'] / 1e9:.2f} GB "
          f"(embedding {emb / 1e9:.2f} GB, one row touched); touched per token {touched / 1e9:.3f} GB")
    rows = []
    for t in [int(v) for v in a.threads.split(",")]:
        bw = ram_read_gbps(t)
        res = run_child(a, t)
        bw = max(bw, ram_read_gbps(t))
        if "error" in res:
            print(f"threads {t}: FAILED: {res['error']}")
            continue
        rows.append((t, res, bw, bw * 1e9 / touched))
    print(f"\n{'threads':>7} {'tok/s':>7} {'RAM GB/s':>9} {'bound tok/s':>12} {'ratio':>6} "
          f"{'eff. GB/s':>9} {'attn ms':>8} {'experts ms':>10} {'lm_head ms':>10} {'other ms':>9}")
    for t, r, bw, bound in rows:
        step = 1e3 / r["tok_s"]
        parts = [1e3 * r[k] for k in ("attention_s", "experts_s", "lm_head_s")]
        print(f"{t:7d} {r['tok_s']:7.2f} {bw:9.1f} {bound:12.1f} {r['tok_s'] / bound:6.2f} "
              f"{r['tok_s'] * touched / 1e9:9.1f} {parts[0]:8.1f} {parts[1]:10.1f} {parts[2]:10.1f} "
              f"{step - sum(parts):9.1f}")
    print("(second run's decode steps, experts resident; eff. GB/s = tok/s x bytes touched per "
          "token; per-step ms from the engine's Stats, 'other' = the rest of a step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
