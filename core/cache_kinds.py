"""What each layer keeps between positions: its cache kind (declared per layer by the family,
``ArchSpec.cache_kinds``), which knows its bytes per position and its fixed bytes. The planner,
``coli plan`` and the RAM budget size the caches from these, never from an attention formula, so
a family whose layers keep something else -- an MLA latent, index keys, a linear-attention
layer's conv and recurrent state, which are fixed-size whatever the context -- only declares
another kind.

Kinds are numpy-free and cheap to build; the arrays live in ``core.engine.KVCache``.
"""
from __future__ import annotations

from dataclasses import dataclass


def _itemsize(dtype: str) -> int:
    import numpy as np          # here: the UI's fit check imports this module too
    return np.dtype(dtype).itemsize


@dataclass(frozen=True)
class KV:
    """Full attention's keys and values: ``num_kv_heads`` x ``head_dim`` each, per position."""
    num_kv_heads: int
    head_dim: int
    name = "kv"

    def bytes_per_position(self, dtype: str = "float32") -> int:
        return 2 * self.num_kv_heads * self.head_dim * _itemsize(dtype)

    def fixed_bytes(self, dtype: str = "float32") -> int:
        return 0


def bytes_per_position(kinds, dtype: str = "float32") -> int:
    """Bytes one more position of context costs, over every layer."""
    return sum(k.bytes_per_position(dtype) for k in kinds)


def fixed_bytes(kinds, dtype: str = "float32") -> int:
    """Bytes the caches take whatever the context (recurrent state and the like)."""
    return sum(k.fixed_bytes(dtype) for k in kinds)
