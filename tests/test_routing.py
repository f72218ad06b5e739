from core.routing import summary, token_overlap, usage_skew
from core.trace import Trace


def _trace(rows, experts=8, top_k=2):
    return Trace(layers=1, experts=experts, top_k=top_k,
                 records=[(p, 0, tuple(r)) for p, r in enumerate(rows)])


def test_overlap_and_skew_by_hand():
    t = _trace([(0, 1), (0, 2), (3, 4), (3, 4)])
    assert token_overlap(t)[0] == (0.5 + 0 + 1) / 3
    s = usage_skew(t)[0]
    assert s["unused"] == 3                                   # experts 5, 6, 7
    assert s["top10_share"] == 2 / 8                          # one expert (0 or 3, used twice)
    assert s["max_over_mean"] == 2 / (8 / 8)


def test_balanced_routing_has_no_skew():
    rows = [((2 * p) % 8, (2 * p + 1) % 8) for p in range(16)]
    s = summary(_trace(rows))
    assert s["mean"]["max_over_mean"] == 1.0 and s["per_layer"][0]["unused"] == 0
    assert s["mean"]["overlap"] == 0.0
