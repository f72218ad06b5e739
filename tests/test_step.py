"""The engine's pass context (core.step.Step) and the layer protocol around it: token ids reach
the layers, a layer's ``known_experts`` is asked before layer 0 (hash routing: its experts follow
from the ids alone) and prefetched, named rotary tables are computed once per pass, and the
residual layer's lookahead asks the next MoE layer's ``router_input``."""
from __future__ import annotations

import numpy as np

from core.rope import Rope
from core.step import Step


def test_known_experts_are_prefetched_before_layer_0_from_the_ids(demo):
    from models import open_model
    engine = open_model(str(demo), threads=1, cap=4, prefetch=True)
    events, layer0 = [], engine.layers[0]

    class Hashed:         # layer 1, as a hash-routed layer would declare it
        def __init__(self, inner):
            self.inner, self.kind, self.router = inner, inner.kind, inner.router
            self.router_input = inner.router_input

        def known_experts(self, step):
            events.append(("known", step.ids.tolist()))
            return [int(t) % 4 for t in step.ids]

        def __call__(self, i, x, step):
            return self.inner(i, x, step)

    def first(i, x, step):
        events.append(("layer 0", None))
        return layer0(i, x, step)

    engine.layers[1] = Hashed(engine.layers[1])
    engine.layers[0] = first
    engine.layers[0].kind = "dense"       # a plain function: no router to look ahead through
    engine._known = [(1, engine.layers[1])]
    prefetched = []
    prefetch = engine.store.prefetch
    engine.store.prefetch = lambda layer, experts: (prefetched.append((layer, list(experts))), prefetch(layer, experts))
    engine.logits([5, 6, 7])
    assert events[:2] == [("known", [5, 6, 7]), ("layer 0", None)]
    assert prefetched[0] == (1, [1, 2, 3])


def test_named_rotary_tables_are_computed_once_per_pass():
    calls = []

    class Table:
        def __init__(self, rope):
            self.rope = rope

        def cos_sin(self, pos):
            calls.append(pos.tolist())
            return self.rope.cos_sin(pos)

    main, other = Rope({"rope_theta": 10000.0}, 8), Rope({"rope_theta": 160000.0}, 4)
    step = Step([1, 2], [3, 4], None, {"main": Table(main), "compressed": Table(other)})
    a, b = step.rope(), step.rope("compressed")
    assert step.rope() is a and step.rope("compressed") is b and calls == [[3, 4], [3, 4]]
    np.testing.assert_array_equal(a[0], main.cos_sin(np.array([3, 4]))[0])
    assert b[0].shape == (2, 4) and step.ids.dtype == np.int64 and not step.decode


def test_lookahead_predicts_from_the_next_moe_layers_router_input(demo):
    from models import open_model
    engine = open_model(str(demo), threads=1, cap=4, prefetch=True)
    seen = []
    nxt = engine.layers[1]
    router_input = nxt.router_input
    nxt.router_input = lambda x, step: (seen.append(x.shape), router_input(x, step))[1]
    engine.logits([5, 6, 7])
    assert seen == [(3, engine.spec.hidden_size)]     # after layer 0's mixer, once
