"""One forward pass's context, handed to every block instead of the engine: what the pass is
(token ids, positions, its rotary tables, the cache), what blocks leave for later layers of the
same pass (``state``), and the narrow face of the engine a block may use (the expert store,
routing records, cancel checks, the lookahead and timing hook ``mixed``).
"""
from __future__ import annotations

import time

import numpy as np


class Step:
    """``tables``: name -> rotary table (core.rope.Rope: cos_sin(positions)). ``engine``: whose
    store, counters, routing records and cancel flag the blocks use; None: a pass of blocks on
    their own (tests, benchmarks): no store, nothing recorded, never cancelled. ``fused``: the
    compiled paths are on (default: the engine's ``fused_attention``, else True)."""

    def __init__(self, ids, pos, cache, tables: dict, engine=None, fused: bool | None = None):
        self.ids = np.asarray(ids, dtype=np.int64)        # [T] token ids (hash routers read them)
        self.pos = np.asarray(pos, dtype=np.int64)        # [T] absolute positions
        self.cache = cache                                # core.cache.KVCache
        # the compiled paths are on (off: the step-by-step composition, the same bits)
        self.fused = (engine.fused_attention if engine is not None else True) if fused is None else fused
        self.decode = self.fused and len(self.pos) == 1   # one position through the compiled paths
        self.state: dict = {}      # what a block leaves for later layers of this pass (DSA's choice)
        self._tables, self._rope = tables, {}
        self.mixed_at = 0.0
        self._engine = engine
        self.store = engine.store if engine is not None else None
        self.counters = engine.counters if engine is not None else {}
        # a MoE block's routing: counted for the history, live view, prefetch recall and trace
        self.record_routing = engine.record_routing if engine is not None else None
        self.cancel_checks = engine is not None and engine.cancel_checks   # a long pass may stop early

    def rope(self, name: str = "main") -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) [T, dim] of the named rotary table at this pass's positions, computed once."""
        got = self._rope.get(name)
        if got is None:
            got = self._rope[name] = self._tables[name].cos_sin(self.pos)
        return got

    def check_cancel(self) -> None:
        """Raise inside a generation whose cancel flag is set (between pieces of a long pass)."""
        if self._engine is not None:
            self._engine.check_cancel()

    def mixed(self, i: int, x: np.ndarray) -> None:
        """Layer i's mixer is done and x is the residual its ffn starts from: the clock splits
        attention from experts here, and the next MoE layer's router predicts from x (lookahead
        prefetch: the engine asks that layer's ``router_input``)."""
        self.mixed_at = time.perf_counter()
        if self._engine is not None:
            self._engine.lookahead(i, x, self)
