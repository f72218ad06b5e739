"""The tiered expert store: a fixed pool of RAM slots per MoE layer in front of the SSD.

* RAM tier: ``cap`` aligned slots per layer (colibrì's ``--cap``), allocated once, so the RAM
  budget is a promise: nothing else grows with the model. Pinned experts (a hot set learned from
  the usage history) take slots first and are never evicted.
* Disk tier: one positioned read per expert (its tensors are one contiguous byte range) straight
  into a slot, in a thread pool (``core.fileio.read_at``: positioned, without the GIL, on every
  OS), optionally with ``O_DIRECT`` (aligned reads into aligned slots; falls back to buffered
  reads where the filesystem refuses).
* ``request(layer, ids)`` yields hits at once, then each miss as soon as its read completes, so
  the layer computes resident experts while the others load. When the request needs more experts
  than there are slots (``cap`` < top-k or a prefill batch-union), slots of experts the caller has
  already consumed are reused: the generator protocol guarantees a yielded expert has been used
  by the time the next one is asked for.
* ``prefetch(layer, ids)`` starts reads for the next layer's predicted experts; it only evicts in
  that layer's pool, so it can never evict what the current layer holds.
* ``shrink(cap)`` gives slots back to the OS between passes (the automatic budget paying for a
  growing KV cache: core.planner.grow_kv_room).
* Buffered reads may be served by the OS page cache, a tier of its own: stats() says how much
  of the bytes read came from it (core.pagecache).

Weights are parsed in place (numpy views over the slot), so a hit costs no copy.
"""
from __future__ import annotations

import errno
import os
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from .container import Container
from .errors import ColiError
from .fileio import read_at
from .memory import anonymous_buffer, release_pages
from .pagecache import CACHED_READ_GBPS, disk_read_bytes, served_share
from .planner import ALIGN, slot_bytes
from .policies import LRU, Policy
from .store import ExpertFFN, ExpertStore



@dataclass
class _Slot:
    buf: memoryview
    expert: int = -1
    ffn: ExpertFFN | None = None
    future: Future | None = None      # read in flight
    prefetched: bool = False          # loaded by prefetch, not yet requested
    offset: int = 0                   # where the slot starts in the arena (shrink releases it)


@dataclass
class _Layer:
    slots: list[_Slot]
    where: dict[int, int] = field(default_factory=dict)     # expert -> slot index


class TieredStore(ExpertStore):
    tiers = ("ram", "disk")

    def __init__(self, container: Container, cap: int, policy: Policy | None = None,
                 o_direct: bool = False, io_threads: int = 4, prefetch: bool = True,
                 pin: bool = True):
        if cap < 1:
            raise ColiError("the RAM budget is too small for even one expert per layer")
        self.container, self.cap = container, cap
        self.policy = policy or LRU()
        self.prefetch_enabled = prefetch
        self._layers_of = sorted({layer for layer, _ in container.experts})
        self.num_experts = 1 + max((e for _, e in container.experts), default=-1)   # 0: a dense model
        self.slot_bytes = slot_bytes(container)        # largest expert + room to align reads
        # Every slot in one page-aligned arena: a big model's tens of thousands of slots are not
        # as many mappings (Linux allows 65,530 per process by default).
        size = self.slot_bytes * cap * len(self._layers_of)
        try:
            arena = anonymous_buffer(size) if size else memoryview(bytearray(0))
        except (OSError, OverflowError) as e:      # more than the OS will map at all
            raise ColiError(f"cannot reserve {size / 1e9:.1f} GB for {cap} experts per layer "
                            f"({getattr(e, 'strerror', None) or e}); ask for fewer with --cap or "
                            f"--ram-gb") from None
        self._arena = arena
        slots = (_Slot(arena[i * self.slot_bytes: (i + 1) * self.slot_bytes], offset=i * self.slot_bytes)
                 for i in range(cap * len(self._layers_of)))
        self.layers = {l: _Layer([next(slots) for _ in range(cap)]) for l in self._layers_of}
        self.o_direct = False
        self._fds: dict[str, int] = {}
        self._open_files(o_direct)
        self._pool = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix="coli-io")
        self._lock = threading.Lock()
        self.reset_stats()
        self._pinned: dict[int, set[int]] = {}
        if pin:           # pin=False: the caller pins later (open_model: after sizing the pool)
            self._pin()

    # --- files -----------------------------------------------------------------------------------
    def _open_files(self, o_direct: bool) -> None:
        flag = getattr(os, "O_DIRECT", 0) if o_direct else 0
        if o_direct and not flag:
            print("colibri: O_DIRECT is not available on this OS; using buffered reads", file=sys.stderr)
        for f in self.container.files:
            key = str(f.path)
            fd = -1
            if flag:
                try:
                    fd = os.open(f.path, os.O_RDONLY | flag)
                except OSError as e:
                    print(f"colibri: O_DIRECT refused for {f.path.name} ({e.strerror}); "
                          f"using buffered reads", file=sys.stderr)
                    flag = 0
            if fd < 0:
                fd = os.open(f.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            self._fds[key] = fd
        self.o_direct = bool(flag)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    # --- reading -----------------------------------------------------------------------------------
    def _read(self, layer: int, expert: int, slot: _Slot) -> ExpertFFN:
        """Runs in an I/O thread: one read of the expert's range into the slot, parsed in place."""
        loc = self.container.experts[(layer, expert)]
        fd = self._fds[str(loc.shard.path)]
        start, n = loc.start, loc.end - loc.start
        if self.o_direct:
            lo = start // ALIGN * ALIGN
            length = (start + n - lo + ALIGN - 1) // ALIGN * ALIGN
            head = start - lo
        else:
            lo, length, head = start, n, 0
        t0 = time.perf_counter()
        got = self._pread(fd, slot.buf[:length], lo)
        if got < head + n:
            raise ColiError(f"{loc.shard.path.name} is truncated: expert {layer}/{expert} could not be read")
        dt = time.perf_counter() - t0
        with self._lock:
            self._stats["bytes_read"] += n
            self._stats["read_s"] += dt
            if not self.o_direct and n > dt * CACHED_READ_GBPS * 1e9:
                self._stats["fast_read_bytes"] += n      # faster than a disk: the page cache's
        return ExpertFFN.from_parts(self.container.expert_weights(layer, expert, slot.buf[head:head + n]), n)

    def _pread(self, fd: int, view: memoryview, offset: int) -> int:
        try:
            return read_at(fd, view, offset)     # positioned, without the GIL, on every OS
        except OSError as e:
            if e.errno == errno.EINVAL and self.o_direct:
                raise ColiError("O_DIRECT read refused by the filesystem; run without --o-direct") from None
            raise

    def _start(self, layer: int, expert: int, slot_index: int, prefetched: bool) -> _Slot:
        L = self.layers[layer]
        slot = L.slots[slot_index]
        if slot.expert >= 0:
            L.where.pop(slot.expert, None)
            self.policy.forget(layer, slot.expert)
        slot.expert, slot.ffn, slot.prefetched = expert, None, prefetched
        slot.future = self._pool.submit(self._read, layer, expert, slot)
        L.where[expert] = slot_index
        return slot

    def _ready(self, slot: _Slot) -> ExpertFFN:
        if slot.ffn is None:
            t0 = time.perf_counter()
            slot.ffn = slot.future.result()
            self._stats["disk_wait_s"] += time.perf_counter() - t0
            slot.future = None
        return slot.ffn

    def _free_slot(self, layer: int, protected: set[int]) -> int | None:
        """An empty slot, else the policy's victim among evictable resident experts."""
        L = self.layers[layer]
        candidates = []
        for i, s in enumerate(L.slots):
            if s.expert < 0:
                return i
            if s.expert in protected or s.expert in self._pinned.get(layer, ()):
                continue
            if s.future is not None and not s.future.done():
                continue      # a read in flight into this slot
            candidates.append(s.expert)
        if not candidates:
            return None
        return L.where[self.policy.victim(layer, candidates)]

    def pin(self) -> None:
        """Load the policy's hot set (at most cap - 1 per layer), if not done at construction."""
        if not any(self._pinned.values()):
            self._pin()

    def _pin(self) -> None:
        self._pinned = {}
        for layer in self._layers_of:
            hot = [e for e in sorted(self.policy.pinned(layer)) if (layer, e) in self.container.experts]
            hot = hot[: max(0, self.cap - 1)]        # leave at least one slot for the rest
            self._pinned[layer] = set(hot)
            for i, e in enumerate(hot):
                self._start(layer, e, i, prefetched=False)
        for layer in self._layers_of:
            for e in self._pinned[layer]:
                self._ready(self.layers[layer].slots[self.layers[layer].where[e]])
        self.reset_stats()

    # --- the interface -------------------------------------------------------------------------------
    def has(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self.container.experts

    def request(self, layer, expert_ids):
        for batch in self._serve(layer, expert_ids, together=False):
            yield batch[0]

    def request_batches(self, layer, expert_ids):
        """Like request(), but each step yields every expert that is ready at that moment (all
        the hits first, then misses as their reads complete), so the caller can compute them in
        one pass; they are consumed when the caller asks for the next batch."""
        L = self.layers[layer]
        ids = list(dict.fromkeys(int(e) for e in expert_ids))
        slots = [L.slots[L.where[e]] if e in L.where else None for e in ids]
        if not all(s is not None and s.future is None for s in slots):
            return self._serve(layer, ids, together=True)
        # every expert resident and loaded (the common decode step): _serve's bookkeeping for
        # one batch of hits, without its generator (~60 us per layer in a decode step)
        self.policy.step(layer)
        self._stats["hits"] += len(ids)
        for e, s in zip(ids, slots):
            self._claim_prefetched(s)
            self.policy.touch(layer, e)
        return iter(([(e, s.ffn) for e, s in zip(ids, slots)],))

    def _claim_prefetched(self, slot: _Slot) -> None:
        """A request found this slot loaded by a prefetch: count it used, once."""
        if slot.prefetched:
            self._stats["prefetch_used"] += 1
            slot.prefetched = False

    def _serve(self, layer, expert_ids, together: bool):
        L = self.layers[layer]
        ids = list(dict.fromkeys(int(e) for e in expert_ids))
        self.policy.step(layer)
        st = self._stats
        waiting = [e for e in ids if e not in L.where]        # misses not yet given a slot
        st["misses"] += len(waiting)
        st["hits"] += len(ids) - len(waiting)
        for e in ids:
            if e in L.where:
                self._claim_prefetched(L.slots[L.where[e]])
        protected = set(ids)          # experts of this request not yet consumed: never evicted

        def launch():
            while waiting:
                i = self._free_slot(layer, protected)
                if i is None:
                    return
                self._start(layer, waiting.pop(0), i, prefetched=False)

        launch()
        remaining = [e for e in ids]
        while remaining:
            slots = {e: L.slots[L.where[e]] for e in remaining if e in L.where}
            ready = [e for e, sl in slots.items() if sl.future is None or sl.future.done()]
            if not ready:
                inflight = [sl.future for sl in slots.values()] or \
                           [sl.future for sl in L.slots if sl.future is not None]
                if not inflight:
                    raise RuntimeError("expert store: no slot can be freed")   # cap >= 1 prevents it
                t0 = time.perf_counter()
                wait(inflight, return_when=FIRST_COMPLETED)
                st["disk_wait_s"] += time.perf_counter() - t0
                launch()
                continue
            for part in ([ready] if together else [[e] for e in ready]):
                for e in part:
                    self.policy.touch(layer, e)
                yield [(e, self._ready(L.slots[L.where[e]])) for e in part]
                for e in part:
                    remaining.remove(e)
                    protected.discard(e)  # consumed: its slot may serve the rest of this request
                    launch()

    def prefetch(self, layer, expert_ids):
        if not self.prefetch_enabled or layer not in self.layers:
            return
        L = self.layers[layer]
        issued = 0
        for e in expert_ids:
            e = int(e)
            if e in L.where:
                continue
            i = self._free_slot(layer, set(int(x) for x in expert_ids))
            if i is None:
                break
            self._start(layer, e, i, prefetched=True)
            issued += 1
        self._stats["prefetch_issued"] += issued

    def reset_stats(self) -> None:
        self._stats = {"hits": 0, "misses": 0, "bytes_read": 0, "disk_wait_s": 0.0, "read_s": 0.0,
                       "prefetch_issued": 0, "prefetch_used": 0, "fast_read_bytes": 0}
        self._disk0 = disk_read_bytes()      # the process's storage reads when counting started
        # a prefetch issued before the reset is not this window's: finding it later is a plain
        # hit, never "used" (which would count more used than issued)
        for L in self.layers.values():
            for slot in L.slots:
                slot.prefetched = False

    def stats(self) -> dict:
        s = dict(self._stats)
        total = s["hits"] + s["misses"]
        s["hit_rate"] = s["hits"] / total if total else 1.0
        s["tiers"] = list(self.tiers)
        s["cap"] = self.cap
        s["slot_bytes"] = self.slot_bytes
        s["ram_bytes"] = self.slot_bytes * self.cap * len(self.layers)
        s["o_direct"] = self.o_direct
        # how much of what we read the OS served from its page cache (core.pagecache)
        now = disk_read_bytes() if self._disk0 is not None else None
        if self.o_direct:
            s["disk_bytes"], s["page_cache_share"], s["page_cache_source"] = s["bytes_read"], 0.0, "o_direct"
        elif now is not None:
            s["disk_bytes"] = now - self._disk0
            s["page_cache_share"] = served_share(s["bytes_read"], s["disk_bytes"])
            s["page_cache_source"] = "io"
        else:
            s["disk_bytes"] = None
            s["page_cache_share"] = s["fast_read_bytes"] / s["bytes_read"] if s["bytes_read"] else 0.0
            s["page_cache_source"] = "timing"
        return s

    def shrink(self, cap: int) -> None:
        """Keep at most ``cap`` (>= 1) slots per layer and give the others' memory back to the OS
        (core.memory.release_pages). Between passes only: no request may be running. Empty slots
        go first, then the policy's victims, then (below cap - 1) pinned experts, last pinned first."""
        cap = max(1, int(cap))
        if cap >= self.cap:
            return
        for layer, L in self.layers.items():
            inflight = [s.future for s in L.slots if s.future is not None]
            if inflight:
                wait(inflight)           # no read may land in a released slot
            pinned = self._pinned.get(layer, set())
            while len(pinned) > cap - 1:
                pinned.discard(max(pinned))
            while len(L.slots) > cap:
                empty = [i for i, s in enumerate(L.slots) if s.expert < 0]
                if empty:
                    i = empty[0]
                else:
                    free = [s.expert for s in L.slots if s.expert not in pinned]
                    i = L.where[self.policy.victim(layer, free)]
                slot = L.slots.pop(i)
                if slot.expert >= 0:
                    self.policy.forget(layer, slot.expert)
                release_pages(self._arena, slot.offset, self.slot_bytes)
                L.where = {s.expert: j for j, s in enumerate(L.slots) if s.expert >= 0}
        self.cap = cap

    def resident(self) -> dict[int, dict[int, str]]:
        """layer -> {expert: 'pinned' | 'ram'} for the live view."""
        return {l: {e: ("pinned" if e in self._pinned.get(l, ()) else "ram") for e in L.where}
                for l, L in self.layers.items()}
