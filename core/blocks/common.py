"""Small pieces the blocks share: a tensor a block needs (for the layout check, the converter,
synthetic checkpoints and size estimates) and the bias-adding products."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import kernels, quant


@dataclass(frozen=True)
class Need:
    """One tensor of the checkpoint: its name and shape (None: fixed by other tensors, checked
    for consistency by whoever reads it); ``optional`` ones may be absent (biases)."""
    name: str
    shape: tuple[int, ...] | None
    optional: bool = False
    synthetic: bool = True      # written into a synthetic checkpoint of the config (core.synthetic)
    # stays float32 whatever --bits (the converter's plan): the block reads its numbers directly
    # (mHC mixes, a grouped projection, a router, a compressor's position bias)
    float32: bool = False
    # an integer table of indices in 0..index_range - 1, distinct along a row (a hash router's
    # token -> experts): kept as it is at any --bits; a synthetic checkpoint writes valid rows
    index_range: int = 0


def load_needs(c, needs: list[Need], prefix: str) -> dict:
    """The tensors a block declares (its ``tensors(prefix)``) read from the container ``c``, keyed
    by their name after ``prefix`` (``q_proj.weight``): a block writes each tensor's name once. An
    optional tensor the container does not hold is None; a missing required one is one line."""
    return {n.name[len(prefix):]: c.load(n.name) if n.name in c or not n.optional else None for n in needs}


def vector_or_none(w) -> np.ndarray | None:
    """A loaded vector as float32 (an optional one that is absent stays None)."""
    return None if w is None else kernels.vector(w)


def norm_weight(c, name: str, offset: float = 0.0) -> np.ndarray:
    """A norm's weight as float32, plus ``offset`` (1 for a (1+w) RMSNorm, folded at load:
    float32(1 + w) is what transformers multiplies by, so the products are the same)."""
    w = kernels.vector(c.load(name))
    return (w + np.float32(offset)).astype(np.float32) if offset else w


def biased(y: np.ndarray, bias) -> np.ndarray:
    return y + bias if bias is not None else y


def linear(x, w, bias=None):
    return biased(kernels.matmul(x, w), bias)


def float32_matrix(w) -> np.ndarray:
    """A weight as a float32 array whatever its scheme (the values the products use)."""
    if w.scheme == "dense":
        return np.asarray(w.data, dtype=np.float32)
    if w.scheme == "int4":
        return quant.dequantize_int4(w.data, w.scales, w.shape[1], w.group_size)
    if w.scheme == "int8":
        return quant.dequantize_int8(w.data, w.scales)
    if w.scheme == quant.FP4:
        return quant.dequantize_fp4(w.data, w.scales, w.shape[1])
    raise ValueError(f"unknown weight scheme {w.scheme}")
