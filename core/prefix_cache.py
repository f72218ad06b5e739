"""Prompt-prefix reuse: the caches of finished generations, kept so that the next prompt which
starts the same way computes only the positions after the shared prefix.

A cache here is ``core.cache.KVCache``: per layer the arrays its cache kinds keep
(``core.cache_kinds``), with ``length`` positions committed. A growing kind adds one row per
position and a position's row depends only on the positions before it, so the cache of ids[:n]
is the first n rows of the cache of ids: truncating is ``cache.length = n`` (rows past
``length`` are dead and overwritten by the next pass).

A kind that cannot truncate -- a recurrent or conv state, one fixed-size array that the positions
fold into, or a sliding window's ring -- says so with ``truncatable = False`` (``core.cache_kinds``;
``can_truncate(spec)`` is what the pool asks). A cache with such a layer continues only at a
point where its state is known: its very end (the prompt extends all of the entry's ids), or
the turn boundary it checkpointed -- what its kinds cannot bring back, copied when its prompt
was prefilled (``KVCache.checkpoint``), put back with the growing arrays truncated to the same
position (``KVCache.restore``). A chat's next prompt always extends the previous
prompt, so its turn is reused even when the reply re-tokenizes differently or the template
drops the reply's thinking from the history.

Which entry a prompt continues, and how far, depends only on the ids (never on placement,
threads or timing), so the placement law holds with reuse on: the same requests in the same
order give the same bits with every expert resident or ``--cap 1``, on 1 thread or 16.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from .cache_kinds import layer_kinds

# an entry continued past this many of its own positions that the new prompt does not share is
# left in the pool and its shared prefix copied instead (a branch: another client with the same
# system prompt, a regenerated reply) -- below it the entry is truncated in place (the previous
# turn's reply re-tokenized a little differently, its end-of-turn token)
BRANCH_TAIL = 64


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def can_truncate(spec) -> bool:
    """True when every layer's cache kinds can drop their last positions (``truncatable``)."""
    return all(getattr(k, "truncatable", True) for e in spec.cache_kinds for k in layer_kinds(e))


def cache_parts(cache) -> list[dict]:
    """Per layer {name: array [lead, capacity, width]}: the cache's arrays."""
    arrays = getattr(cache, "arrays", None)
    if arrays is not None:
        return arrays
    return [{"k": k, "v": v} for k, v in zip(cache.k, cache.v)]


def cache_nbytes(cache) -> int:
    """Bytes of the committed positions (what a saved copy takes; the pool's measure)."""
    n = cache.length
    return sum(a.shape[0] * n * a.shape[2] * a.itemsize for parts in cache_parts(cache) for a in parts.values())


def copy_prefix(src, dst, n: int) -> None:
    """Make dst hold src's first n positions (dst: an empty cache of the same model and dtype)."""
    for layer in range(len(cache_parts(src))):
        dst.ensure(layer, n)
    for parts_src, parts_dst in zip(cache_parts(src), cache_parts(dst)):
        for name, a in parts_src.items():
            parts_dst[name][:, :n] = a[:, :n]
    dst.length = n


@dataclass
class Entry:
    ids: list[int]               # the ids whose positions the cache holds (len == cache.length)
    cache: object
    prompt_len: int = 0          # its generation's prompt: ids[:prompt_len] ...
    logits: object = None        # ... and the logits [vocab] its last position gave
    checkpoint: object = None    # ... and the fixed-size state there (KVCache.checkpoint), if any
    used: float = field(default_factory=time.monotonic)


class PrefixPool:
    """A few finished caches, least recently used first out, bounded by a byte budget (the RAM
    the planner keeps free for caches: ``Plan.kv_reserved_bytes``) and a count. The newest entry
    is always kept, whatever its size: it was in memory during its generation anyway."""

    def __init__(self, budget_bytes: int, max_entries: int = 4, truncatable: bool = True, release=None):
        self.budget_bytes, self.max_entries = int(budget_bytes), int(max_entries)
        self.bytes_per_position = 0      # the cache of one more position (take's room check)
        self.truncatable = truncatable
        self.release = release           # called with each evicted cache (Engine.recycle_cache)
        self.entries: list[Entry] = []

    def __len__(self) -> int:
        return len(self.entries)

    def nbytes(self) -> int:
        return sum(cache_nbytes(e.cache) for e in self.entries)

    def best(self, ids: Sequence[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ids, and the positions of ids it can give:
        all of them when the entry's own prompt was exactly ids (its logits are kept: the same
        prompt again gives the same reply), else at most len(ids) - 1, so that the last position
        is computed again for its logits. For a cache that cannot truncate, only an entry whose
        every id the prompt starts with."""
        best, best_n = None, 0
        for e in self.entries:
            n = common_prefix(e.ids, ids)
            if not (n == len(ids) == e.prompt_len and e.logits is not None):
                n = min(n, len(ids) - 1)
            if not self.truncatable:
                # only where the state is known: the end, or the checkpointed turn boundary
                if n < len(e.ids):
                    n = e.prompt_len if e.checkpoint is not None and n >= e.prompt_len else 0
            if n > best_n:
                best, best_n = e, n
        return best, best_n

    def take(self, ids: Sequence[int], new_cache, positions: int = 0) -> tuple[object, int, object]:
        """(a cache holding the longest cached prefix of ids, its length, the last prompt
        position's logits when the whole prompt is cached, else None); length 0: a new cache from
        ``new_cache()``. An entry is taken out of the pool and truncated, unless more than
        BRANCH_TAIL of its positions would be lost: then its prefix is copied into a new cache
        and the entry stays. ``positions``: the cache the generation starts with (its prompt);
        the least recently used other entries leave first, so that the pool and that cache
        together stay within the budget."""
        entry, n = self.best(ids)
        self._make_room(positions * self.bytes_per_position, keep=entry)
        if entry is None:
            return new_cache(), 0, None
        logits = entry.logits if n == len(ids) else None
        if not self.truncatable:
            self.entries.remove(entry)
            if n < len(entry.ids):
                entry.cache.restore(entry.checkpoint, n)
            return entry.cache, n, logits
        if len(entry.ids) - n > BRANCH_TAIL:
            cache = new_cache()
            copy_prefix(entry.cache, cache, n)
            entry.used = time.monotonic()
            return cache, n, logits
        self.entries.remove(entry)
        entry.cache.length = n
        return entry.cache, n, logits

    def put(self, ids: Sequence[int], cache, prompt_len: int = 0, logits=None, checkpoint=None) -> None:
        """Keep a finished cache (ids: what its positions hold; prompt_len, logits and
        checkpoint: its prompt, the logits of the prompt's last position and the fixed-size
        state there); evict past the budget."""
        ids = list(ids)[: cache.length]
        if not ids:
            self._release(cache)
            return
        if logits is None or prompt_len > len(ids):
            prompt_len, logits, checkpoint = 0, None, None
        # an entry whose ids the new one starts with holds nothing the new one lacks
        for e in list(self.entries):
            if len(e.ids) <= len(ids) and common_prefix(e.ids, ids) == len(e.ids):
                self.entries.remove(e)
                self._release(e.cache)
        self.entries.append(Entry(ids, cache, prompt_len, logits, checkpoint))
        self._evict()

    def _make_room(self, need: int, keep=None) -> None:
        while need and self.nbytes() + need > self.budget_bytes:
            others = [e for e in self.entries if e is not keep]
            if not others:
                return
            oldest = min(others, key=lambda e: e.used)
            self.entries.remove(oldest)
            self._release(oldest.cache)

    def _evict(self) -> None:
        while len(self.entries) > 1 and (len(self.entries) > self.max_entries or
                                         self.nbytes() > self.budget_bytes):
            oldest = min(self.entries[:-1], key=lambda e: e.used)
            self.entries.remove(oldest)
            self._release(oldest.cache)

    def latest(self) -> Entry | None:
        """The most recently kept entry (the chat's last turn)."""
        return max(self.entries, key=lambda e: e.used, default=None)

    def clear(self) -> None:
        for e in self.entries:
            self._release(e.cache)
        self.entries = []

    def _release(self, cache) -> None:
        if self.release is not None:
            self.release(cache)
