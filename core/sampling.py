"""Choosing the next token: greedy, or temperature -> top-k -> top-p (the order transformers uses)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


MAX_SEED = 2 ** 64 - 1          # numpy's generators take seeds in 0..2^64-1 (and larger, slowly)


def check_sampling(temperature: float, top_k: int, top_p: float, seed: int | None = None) -> None:
    """ValueError for settings no sampler accepts (numpy-free, so the UI can validate too)."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)) or temperature < 0:
        raise ValueError("temperature must be a finite number >= 0")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED):
        raise ValueError(f"seed must be an integer in 0..{MAX_SEED}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):        # NaN fails this too
        raise ValueError("top-p must be in (0, 1]")
    if top_k < 0:
        raise ValueError("top-k must be >= 0")


@dataclass
class SamplingParams:
    temperature: float = 0.7
    top_k: int = 0          # 0 = off
    top_p: float = 1.0      # 1 = off
    seed: int | None = None
    greedy: bool = False

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p, self.seed)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


CANDIDATES = 1024     # top-p: the values sorted first (the whole vocabulary when the set is larger)


class Sampler:
    """The next token from one step's logits. The draw is numpy's ``Generator.choice(n, p=probs)``
    (cdf = probs.cumsum(); cdf /= cdf[-1]; the first index whose cdf exceeds one ``random()``),
    written out so that the work is proportional to the tokens that can be drawn: the same
    values, the same sums in the same order, the same single draw from the generator -- so the
    same token for the same seed as the plain full-vocabulary code (tests/test_sampling.py keeps
    that code as the reference). On a 151,851-token vocabulary the plain code took 2.5-6 ms a
    token at the defaults and 15-40 ms with top-p (a stable argsort of the whole vocabulary),
    against a decode step of ~21 ms (benchmarks/README.md, "The speed users see")."""

    def __init__(self, params: SamplingParams):
        self.params = params
        import numpy as np          # here, not at import: the UI validates settings through this module
        self.rng = np.random.default_rng(params.seed)
        self._buffers: dict[str, np.ndarray] = {}

    def _buffer(self, name: str, n: int) -> np.ndarray:
        """A float64 scratch array of n, kept between tokens: a fresh 1.2 MB array a step (a
        151,851-token vocabulary) cost more than the arithmetic on it (0.55 of 1.3 ms)."""
        import numpy as np
        b = self._buffers.get(name)
        if b is None or b.size != n:
            b = self._buffers[name] = np.empty(n, np.float64)
        return b

    def __call__(self, logits: np.ndarray) -> int:
        import numpy as np
        p = self.params
        if p.is_greedy:
            return int(np.argmax(logits))
        x = np.asarray(logits).reshape(-1)
        z = np.divide(x, p.temperature, out=self._buffer("z", x.size), dtype=np.float64)  # astype / T
        keep = None                      # the ids that can be drawn (None: every id)
        if p.top_k and p.top_k < z.size:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            keep = np.flatnonzero(z >= kth)      # the others would be exp(-inf) = 0
        m = z.max()
        if keep is None:
            probs = np.exp(np.subtract(z, m, out=z), out=z)
        else:
            probs = self._buffer("p", z.size)    # the full array: the same pairwise sum below
            probs.fill(0.0)
            probs[keep] = np.exp(z[keep] - m)
        total = probs.sum()
        if not (math.isfinite(total) and total > 0):     # NaN / inf logits
            raise ValueError("probabilities contain NaN")
        probs /= total
        if p.top_p < 1.0:
            keep = self._nucleus(probs, p.top_p, keep)
            kept = np.zeros_like(probs)
            kept[keep] = probs[keep]
            probs = kept
            probs /= probs.sum()
        # numpy's choice over the ids that have probability: a zero step of the cdf is never the
        # first to pass the draw, and adding 0.0 is exact, so the cumulative sums at the kept ids
        # are the full array's
        cdf = np.cumsum(probs, out=self._buffer("cdf", z.size)) if keep is None else probs[keep].cumsum()
        cdf /= cdf[-1]
        i = int(cdf.searchsorted(self.rng.random(), side="right"))
        return i if keep is None else int(keep[i])

    @staticmethod
    def _nucleus(probs: np.ndarray, top_p: float, among) -> np.ndarray:
        """The ids (ascending) of the smallest most-likely set whose mass reaches top_p: the
        first m ids of a stable argsort of -probs (ties by id) where m counts the positions whose
        mass before them is < top_p. That mass is the sequential cumsum of the sorted VALUES,
        which an argsort is not needed for (equal values sum the same in any order); "< top_p"
        can only turn false once along it (rounding is monotone), so m is a prefix, and the set
        is every id above the m-th value plus the lowest ids equal to it. The values are sorted
        only down to the CANDIDATES-th largest when the set ends there (a peaked distribution)."""
        import numpy as np
        values = probs if among is None else probs[among]
        top = None
        if values.size > 2 * CANDIDATES:
            v = np.partition(values, values.size - CANDIDATES)[values.size - CANDIDATES]
            top = values[values >= v]            # the sorted order's first entries, exactly
        for ranked in ((top, values) if top is not None else (values,)):
            ranked = np.sort(ranked)[::-1]
            inside = np.cumsum(ranked) - ranked < top_p
            if not inside[-1] or ranked.size == values.size:
                break
        m = int(inside.argmin()) if not inside[-1] else inside.size
        w = ranked[m - 1]
        mask = values > w
        mask[np.flatnonzero(values == w)[: m - int(mask.sum())]] = True
        chosen = np.flatnonzero(mask)
        return chosen if among is None else among[chosen]
