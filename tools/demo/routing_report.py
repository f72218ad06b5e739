"""Routing of the demo model on held-out text: a trace, and what it says about caching.

    python -m tools.demo.routing_report [--corpus heldout.jsonl] [--docs 40] [--tokens 64]
                                        [--trace models/demo/routing_trace.txt]

Each held-out document is fed token by token (decode-style, teacher-forced), so every step is one
store request per layer, as in chat. Prints, per layer: expert-usage skew, token-to-token overlap,
recall@k of the lookahead predictor (the next layer's norm + router on the current hidden state),
and the replay of each cache policy at 25 % capacity next to Belady/MIN.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from core.cache import KVCache
from core.replay import replay
from core.routing import summary
from core.trace import TraceWriter, read_trace
from models import default_model, open_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default="/work/demo_train/corpus/heldout.jsonl")
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--trace", default="models/demo/routing_trace.txt")
    args = ap.parse_args(argv)
    engine = open_model(default_model(), threads=1)
    engine.usage_file = None
    spec, tok = engine.spec, engine.tokenizer
    docs = [json.loads(line) for line in Path(args.corpus).read_text().splitlines()]
    docs = [d for d in docs if d.get("kind") == "text"][: args.docs]
    engine.trace = TraceWriter(args.trace, spec.num_layers, spec.num_experts, spec.top_k)
    engine.reset_counters()
    for d in docs:
        ids = tok.encode(d["text"], add_special_tokens=False)[: args.tokens]
        cache = KVCache(spec)
        for t in ids:
            engine.forward([t], cache)
    engine.trace.close()
    c = engine.counters
    recall = c["predicted_hit"] / c["predicted"] if c["predicted"] else 0.0
    trace = read_trace(args.trace)
    s = summary(trace)
    cap = spec.num_experts // 4
    r = replay(trace, cap)
    steps = len(trace.records) // max(1, len(s["per_layer"]))
    print(f"{len(docs)} held-out documents, {steps} decode steps per layer "
          f"({spec.num_layers} layers x {spec.num_experts} experts, top-{spec.top_k})")
    print("layer  top10%  top25%  unused  max/mean  overlap")
    for layer, row in s["per_layer"].items():
        print(f"{layer:5d}  {row['top10_share']:6.1%}  {row['top25_share']:6.1%}  {row['unused']:6d}  "
              f"{row['max_over_mean']:8.2f}  {row['overlap']:7.1%}")
    m = s["mean"]
    print(f" mean  {m['top10_share']:6.1%}  {m['top25_share']:6.1%}          {m['max_over_mean']:8.2f}  "
          f"{m['overlap']:7.1%}")
    print(f"lookahead recall@{spec.top_k} (layers 1..{spec.num_layers - 1}): {recall:.1%}")
    o = r["overall"]
    print(f"replay at cap {cap} (25 %): " + ", ".join(
        f"{n} {o[n]['hit_rate']:.1%}" + (f" ({o[n]['ratio_to_belady']:.3f} of MIN)" if n != "belady" else "")
        for n in [*r["policies"], "belady"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
