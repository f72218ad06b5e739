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


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        import numpy as np          # here, not at import: the UI validates settings through this module
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        import numpy as np
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
            keep = cum - probs[order] < p.top_p     # smallest set whose mass reaches top_p
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[keep]] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        return int(self.rng.choice(probs.size, p=probs))
