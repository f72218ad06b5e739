"""What a routing trace says about a model's experts: usage skew, token-to-token overlap.

(The third figure, how well the next layer's router applied to the current hidden state predicts
the next layer's experts, needs hidden states; the engine measures it live as ``prefetch_recall``.)
"""
from __future__ import annotations

from .trace import Trace, requests_per_layer


def usage_skew(trace: Trace) -> dict[int, dict]:
    """Per layer: share of routing mass on the hottest 10 % / 25 % of experts, experts never used,
    and max/mean load (1.0 = perfectly balanced)."""
    out = {}
    for layer, reqs in requests_per_layer(trace).items():
        counts = [0] * trace.experts
        for r in reqs:
            for e in r:
                counts[e] += 1
        total = sum(counts) or 1
        ranked = sorted(counts, reverse=True)
        top = lambda frac: sum(ranked[: max(1, round(frac * trace.experts))]) / total
        out[layer] = {"top10_share": top(0.10), "top25_share": top(0.25),
                      "unused": sum(1 for c in counts if c == 0),
                      "max_over_mean": max(counts) / (total / trace.experts)}
    return out


def token_overlap(trace: Trace) -> dict[int, float]:
    """Per layer: mean |A ∩ B| / k between the expert sets of consecutive positions — the share
    of a token's experts that the previous token already used (what an LRU of size k would hit)."""
    out = {}
    for layer, reqs in requests_per_layer(trace).items():
        pairs = [len(set(a) & set(b)) / max(1, len(b)) for a, b in zip(reqs, reqs[1:])]
        out[layer] = sum(pairs) / len(pairs) if pairs else 0.0
    return out


def summary(trace: Trace) -> dict:
    skew, overlap = usage_skew(trace), token_overlap(trace)
    n = len(skew) or 1
    return {"per_layer": {l: {**skew[l], "overlap": overlap[l]} for l in skew},
            "mean": {"top10_share": sum(s["top10_share"] for s in skew.values()) / n,
                     "top25_share": sum(s["top25_share"] for s in skew.values()) / n,
                     "max_over_mean": sum(s["max_over_mean"] for s in skew.values()) / n,
                     "overlap": sum(overlap.values()) / n}}
