"""What each layer keeps between positions: its cache kind (declared per layer by the family,
``ArchSpec.cache_kinds``), which knows its bytes per position and its fixed bytes. The planner,
``coli plan`` and the RAM budget size the caches from these, never from an attention formula, so
a family whose layers keep something else -- an MLA latent, index keys, a linear-attention
layer's conv and recurrent state, which are fixed-size whatever the context -- only declares
another kind.

Each kind also keeps its own arrays (``core.cache.KVCache`` holds them per layer and asks the
kind): ``make`` them (writing over a finished cache's where the shapes allow), ``append`` a pass's
rows and ``view`` them, say whether positions can be dropped (``truncatable``), ``checkpoint`` and
``restore`` what truncating cannot bring back. Growing kinds keep ``[lead, capacity, width]``
arrays in ``KVCache.arrays`` (a position's row never changes: truncating is setting the length);
fixed-size kinds keep whole arrays in ``KVCache.state``. A new kind is one class.

Kinds are numpy-free to import and cheap to build (the UI's fit check reads their sizes).
"""
from __future__ import annotations

from dataclasses import dataclass


def _itemsize(dtype: str) -> int:
    import numpy as np          # here: the UI's fit check imports this module too
    return np.dtype(dtype).itemsize


class _Growing:
    """A kind whose arrays grow by one row per position: ``parts()`` names them, each
    [lead, positions, width] (head-major: one head's positions contiguous, as attention reads them)."""

    # Prompt-prefix reuse (core.prefix_cache) keeps a finished cache and continues it with a
    # prompt that shares a prefix, dropping the rest: a growing kind's row for a position depends
    # only on the positions before it, so dropping positions is ``cache.length = n``. A kind
    # that folds every position into one fixed-size state (a linear-attention layer's recurrent
    # and conv state) cannot go back: it sets this False, and the pool then continues such a
    # cache only where its state is known -- its very end, or the checkpoint of the state taken
    # at its prompt's end (a turn boundary) -- never truncating it elsewhere.
    truncatable = True
    growing = True

    def parts(self) -> dict[str, tuple[int, int]]:
        raise NotImplementedError

    def make(self, dtype, recycled: dict) -> dict:
        """Empty arrays [lead, 0, width], or ``recycled``'s where lead, width and dtype match."""
        import numpy as np
        out = {}
        for name, (lead, width) in self.parts().items():
            a = recycled.get(name)
            ok = a is not None and a.ndim == 3 and (a.shape[0], a.shape[2]) == (lead, width) and a.dtype == dtype
            out[name] = a if ok else np.empty((lead, 0, width), dtype)
        return out

    def ensure(self, arrays: dict, n: int, length: int, reserve: int) -> None:
        """Room for n positions (the first ``length`` kept). The first growth maps ``reserve``
        positions at once (core.memory.lazy_array: address space until written), then doubles."""
        from .memory import lazy_array
        for name in self.parts():
            old = arrays[name]
            if old.shape[1] < n:
                grown = lazy_array((old.shape[0], max(n, 2 * old.shape[1], reserve), old.shape[2]), old.dtype)
                grown[:, :length] = old[:, :length]
                arrays[name] = grown

    def append(self, arrays: dict, name: str, x, length: int):
        """Write x [T, lead, width] at positions [length, length+T) (room made: ensure) and return
        the view [lead, length+T, width] of every position so far."""
        n = length + x.shape[0]
        arrays[name][:, length: n] = x.transpose(1, 0, 2)
        return arrays[name][:, :n]

    def view(self, arrays: dict, name: str, length: int):
        return arrays[name][:, :length]

    def checkpoint(self, arrays: dict) -> dict:
        return {}           # rows never change once written: nothing truncation loses

    def restore(self, arrays: dict, saved: dict) -> None:
        pass

    def bytes_per_position(self, dtype: str = "float32") -> int:
        return sum(lead * width for lead, width in self.parts().values()) * _itemsize(dtype)

    def fixed_bytes(self, dtype: str = "float32") -> int:
        return 0


@dataclass(frozen=True)
class KV(_Growing):
    """Full attention's keys and values: ``num_kv_heads`` x ``head_dim`` each, per position."""
    num_kv_heads: int
    head_dim: int
    name = "kv"

    def parts(self):
        return {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.head_dim)}

    def describe(self) -> str:
        return f"keys + values ({self.num_kv_heads} x {self.head_dim} each)"


@dataclass(frozen=True)
class Latent(_Growing):
    """Multi-head latent attention (DeepSeek-V3, GLM-5): the compressed latent (``rank`` values,
    normed) and the shared RoPE key (``rope`` values) per position, one row of rank + rope that
    decode attends over as one key/value head (the absorbed form) -- 576 values for GLM-5 where
    expanded keys and values would take 64 x (256 + 256)."""
    rank: int
    rope: int
    name = "latent"

    def parts(self):
        return {"latent": (1, self.rank + self.rope)}

    def describe(self) -> str:
        return f"latent ({self.rank} + {self.rope} rope)"


@dataclass(frozen=True)
class IndexKeys(_Growing):
    """A sparse-attention indexer's key per position (GLM-5's DSA: ``dim`` values)."""
    dim: int
    name = "index_keys"

    def parts(self):
        return {"index": (1, self.dim)}

    def describe(self) -> str:
        return f"index keys ({self.dim})"


class _Fixed:
    """A kind whose arrays have one size whatever the context: a linear-attention layer's conv
    window and recurrent state, which every position folds into. ``state_parts()`` names them,
    each with its full shape; they are float32 whatever the KV cache's precision (the delta rule
    accumulates into them position after position: half precision would drift), allocated once
    per cache, zeroed for a new sequence and written in place by the layer."""

    # the positions are folded in: a cache holding them cannot drop its last ones (see _Growing)
    truncatable = False
    growing = False
    dtype = "float32"

    def state_parts(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def array_dtype(self, cache_dtype: str) -> str:
        """The arrays' dtype: float32 whatever the cache's (see above)."""
        return self.dtype

    def bytes_per_position(self, dtype: str = "float32") -> int:
        return 0

    def fixed_bytes(self, dtype: str = "float32") -> int:
        import math
        size = _itemsize(self.array_dtype(dtype))
        return sum(math.prod(shape) for shape in self.state_parts().values()) * size

    def make(self, dtype, recycled: dict) -> dict:
        """Zeroed arrays (a new sequence starts from the zero state), ``recycled``'s where they fit."""
        import numpy as np
        out, dt = {}, np.dtype(self.array_dtype(np.dtype(dtype).name))
        for name, shape in self.state_parts().items():
            a = recycled.get(name)
            if a is not None and a.shape == tuple(shape) and a.dtype == dt:
                a.fill(0)
            else:
                a = np.zeros(shape, dt)
            out[name] = a
        return out

    def checkpoint(self, arrays: dict) -> dict:
        """A copy of the arrays: the state as of the cache's length."""
        return {name: arrays[name].copy() for name in self.state_parts()}

    def restore(self, arrays: dict, saved: dict) -> None:
        for name in self.state_parts():
            arrays[name][...] = saved[name]


@dataclass(frozen=True)
class Conv(_Fixed):
    """A causal depthwise convolution's window: the last ``width`` (kernel - 1) inputs of each of
    ``channels`` channels, oldest first (transformers' conv_state [channels, kernel - 1])."""
    channels: int
    width: int
    name = "conv"

    def state_parts(self):
        return {"conv": (self.channels, self.width)}

    def describe(self) -> str:
        return f"conv state ({self.channels} x {self.width})"


@dataclass(frozen=True)
class Recurrent(_Fixed):
    """A delta-rule layer's recurrent state S: ``heads`` matrices [k_dim, v_dim]."""
    heads: int
    k_dim: int
    v_dim: int
    name = "recurrent"

    def state_parts(self):
        return {"recurrent": (self.heads, self.k_dim, self.v_dim)}

    def describe(self) -> str:
        return f"recurrent state ({self.heads} x {self.k_dim} x {self.v_dim})"


@dataclass(frozen=True)
class Ring(_Fixed):
    """A sliding window's keys and values (``names``: ``k`` and ``v``; one shared ``kv`` for
    shared-KV attention), ``lead`` x ``width`` per position, of the last ``window`` positions
    only: a ring of ``window`` rows, position p in row p % window, in the cache's precision. Its
    bytes are bounded whatever the context (fixed bytes, none per position); positions that left
    the window are gone, so it cannot drop its last ones (truncatable False: checkpoints copy it).
    Attention sinks are per-head logits of the mixer (DeepSeek V4): nothing to keep here."""
    lead: int
    width: int
    window: int
    names: tuple[str, ...] = ("k", "v")
    name = "ring"

    def state_parts(self):
        return {n: (self.lead, self.window, self.width) for n in self.names}

    def array_dtype(self, cache_dtype: str) -> str:
        return cache_dtype

    def append(self, arrays: dict, name: str, x, length: int):
        """Write x [T, lead, width] for positions [length, length+T) and return (rows, start):
        rows [lead, S, width] of positions [start, length+T) in order, every position a query of
        this pass sees (start = max(0, length - window + 1)), in the cache's precision."""
        import numpy as np
        ring, W, T = arrays[name], self.window, x.shape[0]
        start = max(0, length - W + 1)
        m = length - start
        rows = np.empty((ring.shape[0], m + T, ring.shape[2]), ring.dtype)    # head-major, as attention reads
        rows[:, :m] = ring[:, np.arange(start, length) % W]
        rows[:, m:] = x.transpose(1, 0, 2)
        keep = min(T, W)            # the last W positions of the pass stay
        ring[:, np.arange(length + T - keep, length + T) % W] = rows[:, m + T - keep:]
        return rows, start

    def view(self, arrays: dict, name: str, length: int):
        """(rows, start): the last min(length, window) positions in order, from position start."""
        import numpy as np
        start = max(0, length - self.window)
        return np.ascontiguousarray(arrays[name][:, np.arange(start, length) % self.window]), start

    def describe(self) -> str:
        return f"ring of {self.window} ({' + '.join(self.names)}: {self.lead} x {self.width} each)"


def layer_kinds(entry) -> tuple:
    """A layer's entry in ArchSpec.cache_kinds: one kind, or a tuple of kinds (MLA + index keys)."""
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def bytes_per_position(kinds, dtype: str = "float32") -> int:
    """Bytes one more position of context costs, over every layer."""
    return sum(k.bytes_per_position(dtype) for e in kinds for k in layer_kinds(e))


def fixed_bytes(kinds, dtype: str = "float32") -> int:
    """Bytes the caches take whatever the context (recurrent state and the like)."""
    return sum(k.fixed_bytes(dtype) for e in kinds for k in layer_kinds(e))


def by_kind(kinds, dtype: str = "float32") -> list[dict]:
    """Each distinct kind once, in layer order: what it keeps, on how many layers, its bytes per
    position and its fixed bytes on one layer -- coli plan's lines (a ring, compressed entries
    and indexer keys of one layer said apart)."""
    rows: dict = {}
    for entry in kinds:
        for k in layer_kinds(entry):
            row = rows.setdefault(k, {"kind": getattr(k, "describe", lambda k=k: k.name)(), "layers": 0,
                                      "bytes_per_position": k.bytes_per_position(dtype),
                                      "fixed_bytes": k.fixed_bytes(dtype)})
            row["layers"] += 1
    return list(rows.values())


def describe(kinds, dtype: str = "float32") -> str:
    """What the layers keep per position, e.g. "latent (512 + 64 rope) + index keys (128) on 76
    layers, latent (512 + 64 rope) on 2 layers: 2,344 bytes each" -- for coli plan. Layers that
    keep a fixed-size state say its bytes apart: "conv state (8192 x 3) + recurrent state (32 x
    128 x 128) on 30 layers: 0 bytes each + 2,195,456 fixed"."""
    groups: dict[tuple, int] = {}
    for entry in kinds:
        key = layer_kinds(entry)
        groups[key] = groups.get(key, 0) + 1
    parts = []
    for key, n in groups.items():
        what = " + ".join(getattr(k, "describe", lambda k=k: k.name)() for k in key)
        each = sum(k.bytes_per_position(dtype) for k in key)
        fixed = sum(k.fixed_bytes(dtype) for k in key)
        parts.append(f"{what} on {n} layer{'s' if n != 1 else ''}: {each:,} bytes each"
                     + (f" + {fixed:,} fixed" if fixed else ""))
    return "; ".join(parts)
