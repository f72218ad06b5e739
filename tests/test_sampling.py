"""core.sampling.Sampler draws the same token for the same seed as the plain full-vocabulary code
it replaced (kept here as the reference): same values, same sums in the same order, one draw
from the generator per token."""
from __future__ import annotations

import numpy as np
import pytest

from core.sampling import Sampler, SamplingParams


class Reference:
    """The sampler as it was: every step over the whole vocabulary, numpy's choice for the draw."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits):
        p = self.params
        if p.is_greedy:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / p.temperature
        if p.top_k and p.top_k < z.size:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            z = np.where(z < kth, -np.inf, z)
        z -= z.max()
        probs = np.exp(z)
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            keep = cum - probs[order] < p.top_p
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[keep]] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        return int(self.rng.choice(probs.size, p=probs))


def logits_cases():
    rng = np.random.default_rng(7)
    yield "normal", rng.standard_normal(5000).astype(np.float32)
    yield "peaked", (rng.standard_normal(5000) * 8).astype(np.float32)
    yield "flat", (rng.standard_normal(5000) * 0.01).astype(np.float32)     # a huge nucleus
    yield "ties", np.round(rng.standard_normal(3000) * 2).astype(np.float32)  # many equal values
    yield "float64", rng.standard_normal(2000)
    yield "tiny", np.array([0.5, 0.5, -1.0], np.float32)
    yield "one", np.array([3.0], np.float32)
    yield "underflow", np.concatenate([[0.0], np.full(500, -2000.0)]).astype(np.float32)


SETTINGS = [dict(temperature=0.7), dict(temperature=1), dict(temperature=0.05), dict(temperature=4.0),
            dict(temperature=0.7, top_k=1), dict(temperature=0.7, top_k=40),
            dict(temperature=0.7, top_k=2999), dict(temperature=0.7, top_k=100000),
            dict(temperature=0.7, top_p=0.9), dict(temperature=0.7, top_p=0.05),
            dict(temperature=0.7, top_p=0.999999), dict(temperature=1.3, top_k=50, top_p=0.8),
            dict(temperature=0.7, top_k=7, top_p=0.3), dict(greedy=True)]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_same_tokens_as_the_full_vocabulary_sampler(settings):
    for name, logits in logits_cases():
        for seed in (0, 1, 12345):
            params = SamplingParams(seed=seed, **settings)
            ours, ref = Sampler(params), Reference(params)
            got = [ours(logits) for _ in range(40)]
            want = [ref(logits) for _ in range(40)]
            assert got == want, (name, seed)
            # and the generators are in the same state afterwards: one draw a token
            assert ours.rng.random() == ref.rng.random(), (name, seed)


def test_changing_logits_each_step():
    rng = np.random.default_rng(3)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=99)
    ours, ref = Sampler(params), Reference(params)
    for _ in range(50):
        logits = (rng.standard_normal(20000) * rng.uniform(0.1, 6)).astype(np.float32)
        assert ours(logits) == ref(logits)


def test_a_nucleus_bigger_than_the_first_candidates():
    """top-p over near-flat logits: the sort has to go past its first CANDIDATES values."""
    logits = (np.random.default_rng(5).standard_normal(100000) * 1e-3).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_p=0.5, seed=4)
    assert [Sampler(params)(logits) for _ in range(3)] == [Reference(params)(logits) for _ in range(3)]
    kept = Sampler._nucleus(np.full(3000, 1 / 3000), 0.5, None)
    assert kept.tolist() == list(range(1500))      # ties by id, the smallest set reaching 0.5


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("settings", [dict(), dict(top_k=3), dict(top_p=0.5)])
def test_nan_or_inf_logits_are_refused(bad, settings):
    logits = np.array([0.1, bad, 0.3, 0.2], np.float32)
    with pytest.raises(ValueError):
        Sampler(SamplingParams(seed=0, **settings))(logits)
