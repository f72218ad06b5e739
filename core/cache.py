"""The per-layer caches of one sequence: the arrays each layer's cache kinds keep
(core.cache_kinds, declared per layer by the family in ``ArchSpec.cache_kinds``), held here and
handled by the kinds themselves -- how to make, append, view, checkpoint and restore them, and
whether positions can be dropped -- so prefix reuse (core.prefix_cache), saved sessions
(core.sessions) and the planner ask the kinds, not the engine.
"""
from __future__ import annotations

import numpy as np

from .cache_kinds import layer_kinds
from .errors import ColiError
from .planner import kv_reserved_positions


class KVCache:
    """Per layer, the growing arrays (``arrays``: keys and values, a latent, index keys; each
    [lead, capacity, width], head-major: one head's positions are contiguous, which is how
    attention reads them) and the fixed-size ones (``state``: a linear-attention layer's conv and
    recurrent state, a sliding window's ring), ``length`` positions committed.

    The first append reserves core.planner.kv_reserved_positions (4096, or the model's maximum if
    smaller; what the automatic RAM budget keeps free for it) at once, in an anonymous mapping
    (core.memory.lazy_array): address space only until positions are written, so RSS grows with
    the context and a growing array's copies are gone (doubling from 64 positions stalled decode
    for 0.3-0.4 s at 256 and 512 positions of the OLMoE geometry). Past the reservation it doubles.

    ``recycled``: the arrays of a finished cache (``buffers()``) to write over instead: their
    pages are mapped already (Engine.new_cache). ``dtype``: float32, or the opt-in float16 (half
    the memory and the reads of attention; keys and values rounded to half precision, so outputs
    change slightly -- see README); fixed-size state stays float32 (core.cache_kinds)."""

    def __init__(self, spec, recycled: list[dict] | None = None, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        self.kinds = [layer_kinds(entry) for entry in spec.cache_kinds]
        for i, kinds in enumerate(self.kinds):
            for kind in kinds:
                if not hasattr(kind, "make"):
                    raise ColiError(f"layer {i} keeps a {kind.name} cache, which this engine does not run")
        old = recycled if recycled is not None and len(recycled) == len(self.kinds) else None
        # per layer: what each kind made, by kind name (``cache[i][kind.name]``); and, merged by
        # array name, the growing arrays (``arrays``) and the fixed-size ones (``state``) of the
        # kinds that keep named arrays (parts / state_parts: every kind here so far) -- what
        # attention, prefix reuse and saved sessions read
        self.layers, self.arrays, self.state = [], [], []
        self._owner: list[dict] = []     # per layer, array name -> its kind
        for i, kinds in enumerate(self.kinds):
            prev = old[i] if old is not None else {}
            kept, parts, fixed, owner = {}, {}, {}, {}
            for kind in kinds:
                made = kept[kind.name] = kind.make(self.dtype, prev)
                if _keeps_arrays(kind):
                    (parts if kind.growing else fixed).update(made)
                    owner.update(dict.fromkeys(made, kind))
            objects = {k.name for k in kinds if not _keeps_arrays(k)}     # checkpointed by kind name
            if len(kept) != len(kinds) or objects & set(owner):
                raise ColiError(f"layer {i}: its cache kinds' names collide ({', '.join(k.name for k in kinds)})")
            self.layers.append(kept)
            self.arrays.append(parts)
            self.state.append(fixed)
            self._owner.append(owner)
        self._views()
        self.length = 0     # positions committed (all layers)
        # per layer, the positions its fixed state has folded in (== length after a whole pass;
        # a pass cut short leaves them ahead, and a state layer then refuses to continue)
        self.folded = [0] * len(self.arrays)
        self.reserve = kv_reserved_positions(spec)

    def __getitem__(self, layer: int) -> dict:
        """What layer's kinds keep, by kind name (a kind of named arrays: {name: array})."""
        return self.layers[layer]

    @property
    def savable(self) -> bool:
        """Every kind keeps named arrays, or (a kind keeping an object of its own: a compressor's
        state) says how to write it as arrays (``to_arrays``, core.sessions): what core.sessions
        writes."""
        return all(_keeps_arrays(k) or hasattr(k, "to_arrays") for kinds in self.kinds for k in kinds)

    def objects(self) -> list[list]:
        """Per layer, (kind, what it keeps) of the kinds keeping an object (core.sessions)."""
        return [[(k, kept[k.name]) for k in kinds if not _keeps_arrays(k)]
                for kinds, kept in zip(self.kinds, self.layers)]

    @property
    def truncatable(self) -> bool:
        """Every layer's kinds can drop their last positions (core.prefix_cache)."""
        return all(k.truncatable for kinds in self.kinds for k in kinds)

    def _views(self) -> None:
        # attention's keys and values per layer (None where a layer keeps no growing KV): the
        # compiled decode block writes into these
        self.k = [parts.get("k") for parts in self.arrays]
        self.v = [parts.get("v") for parts in self.arrays]

    def buffers(self) -> list[dict]:
        """Every array, per layer (growing and fixed, by name), and what the other kinds keep (by
        kind name): what a new cache writes over (recycled)."""
        return [{**kept, **parts, **fixed} for kept, parts, fixed in zip(self.layers, self.arrays, self.state)]

    def capacity(self) -> int:
        """Positions every layer has room for without growing."""
        return min((a.shape[1] for parts in self.arrays for a in parts.values()), default=0)

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k/v [T, kv_heads, D] for positions [length, length+T) and return views
        [kv_heads, length+T, D] over [0, length+T)."""
        return self.append_part(layer, "k", k), self.append_part(layer, "v", v)

    def append_part(self, layer: int, name: str, x: np.ndarray):
        """Store x [T, lead, width] in one of a layer's arrays for positions [length, length+T)
        and return what its kind's ``append`` returns: for a growing kind the view [lead,
        length+T, width] over [0, length+T); for a ring (rows, first position)."""
        kind = self._owner[layer][name]
        if kind.growing:
            self.ensure(layer, self.length + x.shape[0])
            return kind.append(self.arrays[layer], name, x, self.length)
        self.folded[layer] = self.length + x.shape[0]       # a fixed-size array took them in
        return kind.append(self.state[layer], name, x, self.length)

    def ensure(self, layer: int, n: int) -> None:
        """Room for n positions in a layer's growing arrays (growing them, positions kept)."""
        parts = self.arrays[layer]
        if any(a.shape[1] < n for a in parts.values()):
            for kind in self.kinds[layer]:
                if kind.growing:
                    made = self.layers[layer][kind.name]
                    kind.ensure(made, n, self.length, self.reserve)
                    parts.update(made)
            self.k[layer], self.v[layer] = parts.get("k"), parts.get("v")

    def checkpoint(self) -> list[dict] | None:
        """What truncating cannot bring back, as of ``length`` (per layer {name: copy}: the
        fixed-size arrays), or None when every kind can truncate."""
        if self.truncatable:
            return None
        out = []
        for kinds, kept in zip(self.kinds, self.layers):
            layer = {}
            for kind in kinds:
                saved = kind.checkpoint(kept[kind.name])
                if _keeps_arrays(kind):
                    layer.update(saved)          # by array name, as core.sessions writes them
                else:
                    layer[kind.name] = saved
            out.append(layer)
        return out

    def restore(self, saved: list[dict], n: int) -> None:
        """Put a checkpoint taken at n positions back: the fixed-size arrays written over in
        place, the growing ones truncated to n."""
        for kinds, kept, layer in zip(self.kinds, self.layers, saved):
            for kind in kinds:
                kind.restore(kept[kind.name], layer if _keeps_arrays(kind) else layer[kind.name])
        self.length = n
        self.folded = [n] * len(self.folded)


def _keeps_arrays(kind) -> bool:
    """A kind of named arrays (growing ``parts`` or fixed ``state_parts``); others keep an object."""
    return hasattr(kind, "parts") or hasattr(kind, "state_parts")
