"""Shared blocks (core/blocks, issue 17): each router kind routes and predicts by its own rule."""
from __future__ import annotations

import numpy as np

from core import kernels
from core.blocks.routers import SoftmaxTopK


def test_softmax_topk_routes_as_the_kernels_and_predicts_strongest_first():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 24)).astype(np.float32)
    h = rng.standard_normal((5, 24)).astype(np.float32)
    r = SoftmaxTopK(w, top_k=3, norm_topk_prob=True)
    top, weights = r.route(h)
    want_top, want_w = kernels.softmax_topk(kernels.router_logits(h, w), 3, True)
    np.testing.assert_array_equal(top, want_top)
    np.testing.assert_array_equal(weights, want_w)
    ranked = r.predict(h)
    assert sorted(ranked) == sorted(set(top.reshape(-1).tolist()))          # each expert once
    strongest = {}
    for e, p in zip(top.reshape(-1).tolist(), weights.reshape(-1).tolist()):
        strongest[e] = max(strongest.get(e, 0.0), p)
    assert [strongest[e] for e in ranked] == sorted(strongest.values(), reverse=True)
    assert r.predict(h[:1]) == top[0].tolist()          # one row: its top-k, in the router's order
