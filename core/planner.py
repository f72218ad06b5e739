"""How many experts per layer fit in RAM, and what bounds speed: ``coli plan`` and open_model.

The automatic budget (no --cap / --ram-gb) starts from the memory available now and pays, in this
order: the dense weights, what opening the model adds to the process besides them (measured by
open_model: ``runtime_bytes``; coli plan, which opens nothing, counts 0), the activations of one
prefill pass (``working_bytes``, from the geometry), and the KV cache of the context in use
(``kv_positions``). AUTO_SHARE of what is left is the expert pool; the rest stays with the OS
(other programs, and the page cache, which serves our buffered reads of experts outside the
pool: a tier of its own, ``page_cache_bytes``). The KV room is sized for the
session (coli run: its prompt and reply; otherwise KV_CONTEXT positions, at most KV_SHARE of what
is left) and grows with the context: ``grow_kv_room`` gives back pool slots to pay for it, so the
budget stays a promise. (Until issue 20 the budget reserved 4096 positions and a fixed 512 MiB:
at 1-2 GB free that left the pool one expert per layer.)
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import psutil

from . import cache_kinds
from .arch import KV_CACHES, ArchSpec
from .container import Container
from .errors import ColiError
from .safetensors_io import DTYPES

GB = 1e9
AUTO_SHARE = 0.75                 # share of the memory left after the model's own needs for the pool
# Positions of KV cache core.cache.KVCache maps at once (address space only: pages are touched
# as positions are written, and it grows past them), and the most the automatic budget reserves
# when the session's context is not known (the app, the server).
KV_CONTEXT = 4096
# An unknown context reserves at most this share of the room left after the dense weights and
# the runtime, and at least MIN_CONTEXT positions: a long chat grows it later (grow_kv_room).
KV_SHARE = 0.25
MIN_CONTEXT = 256
KV_STEP = 256                     # the reservation grows in steps of this many positions
PREFILL_CHUNK = 1024              # core.engine.Engine.PREFILL_CHUNK (a test keeps them equal)
ALIGN = 4096


@dataclass
class Plan:
    mode: str                     # 'cap' | 'ram-gb' | 'auto'
    cap: int                      # RAM slots per MoE layer
    num_experts: int
    moe_layers: int
    expert_bytes: int             # all routed experts on disk
    expert_slot_bytes: int        # one RAM slot (largest expert, aligned)
    ram_expert_bytes: int         # the slot pool: the RAM budget for experts
    dense_bytes: int              # resident dense weights as held in RAM
    available_bytes: int
    active_expert_bytes_per_token: int
    projected_hit_rate: float
    bound: str
    kv_bytes_per_position: int = 0  # keys and values of every layer (float32, or float16)
    kv_reserved_bytes: int = 0      # what the budget keeps for caches (kv_positions + fixed state)
    fixed_state_bytes: int = 0      # recurrent / conv state of every layer: its size whatever the context
    kv_positions: int = 0           # positions the reservation covers now (grow_kv_room raises it)
    runtime_bytes: int = 0          # measured: what opening the model added besides the dense weights
    runtime_measured: bool = False  # False: coli plan (nothing opened; runtime_bytes 0)
    working_bytes: int = 0          # activations of one prefill pass (from the geometry)
    # memory the plan leaves to the OS, and how much of the experts outside the pool it could
    # keep in the page cache (buffered reads of those never reach the disk)
    page_cache_bytes: int = 0
    page_cache_share: float = 0.0
    # grow_kv_room's account: KV bytes grown but not yet paid by slots (one slot per layer is
    # never given back), negative when the slots given back cover more than the growth so far
    kv_debt_bytes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def page_cache_tier(self) -> bool:
        """The page cache can serve a real share of the pool's misses (core.pagecache.TIER_SHARE)."""
        from .pagecache import TIER_SHARE
        return self.page_cache_share >= TIER_SHARE


def slot_bytes(container: Container) -> int:
    """One RAM slot: the largest expert, aligned (0 for a model without routed experts)."""
    if not container.experts:
        return 0
    span = max(loc.end - loc.start for loc in container.experts.values())
    return (span + 3 * ALIGN - 1) // ALIGN * ALIGN


def dense_ram_bytes(container: Container, spec: ArchSpec | None = None) -> int:
    """Bytes the dense weights take once loaded (16-bit floats are widened to float32). With the
    spec: an untied embedding the engine reads row by row from the file (Container.load_rows:
    quantized or float32) is left out."""
    from .container import tensor_place
    on_disk = None
    if spec is not None and not spec.tie_word_embeddings:
        name = spec.prefix + "embed_tokens.weight"
        info = container.index.get(name, (None, None))[1]
        if info is not None and len(info.shape) == 2 and (name in container.quant or info.dtype == "F32"):
            on_disk = name
    total = 0
    for name, (_, info) in container.index.items():
        if tensor_place(name)[1] is not None or name == on_disk:
            continue
        widen = 4 // DTYPES[info.dtype].itemsize if info.dtype in ("BF16", "F16") else 1
        total += info.nbytes * widen
    return total


def kv_reserved_positions(spec: ArchSpec) -> int:
    """KV_CONTEXT, or the model's maximum context if smaller: what KVCache maps at once."""
    return min(spec.max_position_embeddings or KV_CONTEXT, KV_CONTEXT)


def kv_bytes_per_position(spec: ArchSpec, kv_cache: str = "float32") -> int:
    """Bytes of cache one position takes over every layer, from the layers' cache kinds
    (core.cache_kinds); kv_cache is one of core.arch.KV_CACHES."""
    return cache_kinds.bytes_per_position(spec.cache_kinds, kv_cache)


def working_bytes(spec: ArchSpec, positions: int = PREFILL_CHUNK) -> int:
    """The float32 activations one pass of ``positions`` (at most a prefill chunk) holds at its
    peak: per position the hidden state and its norm, the MoE block's top-k contributions, q/k/v,
    one expert's gate and up rows, the router's logits; plus the logits of the last position and
    the sampler's copies of them."""
    t = max(1, min(int(positions), PREFILL_CHUNK))
    inter = spec.expert_intermediate or spec.dense_intermediate or 4 * spec.hidden_size
    per_position = (spec.hidden_size * (spec.top_k + 4) + (spec.num_heads + 2 * spec.num_kv_heads)
                    * spec.head_dim + 2 * inter + spec.num_experts)
    return 4 * (t * per_position + 3 * spec.vocab_size)


def make_plan(container: Container, spec: ArchSpec, ram_gb: float | None = None, cap: int | None = None,
              usage: dict | None = None, disk_gbps: float = 1.0, ram_gbps: float = 25.0,
              kv_cache: str = "float32", context: int | None = None,
              runtime_bytes: int | None = None, available: int | None = None) -> Plan:
    """``context``: positions the session needs (prompt + reply), None: not known. ``runtime_bytes``:
    what opening the model added to the process besides the dense weights, as open_model measured
    it (None: not measured). ``available``: the memory available before the model was opened
    (default: now)."""
    if ram_gb is not None and cap is not None:
        raise ColiError("give --ram-gb or --cap, not both")
    if context is not None and context < 1:
        raise ColiError("the context must be >= 1 position")
    experts = container.experts
    layers = sorted({l for l, _ in experts})
    E = spec.num_experts
    slot = slot_bytes(container)
    dense = dense_ram_bytes(container, spec)
    available = psutil.virtual_memory().available if available is None else int(available)
    if kv_cache not in KV_CACHES:
        raise ColiError(f"--kv-cache must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
    kv_position = kv_bytes_per_position(spec, kv_cache)
    fixed = cache_kinds.fixed_bytes(spec.cache_kinds, kv_cache)      # state that does not grow
    runtime = max(0, int(runtime_bytes or 0))
    working = working_bytes(spec, context or PREFILL_CHUNK)
    room = available - dense - runtime - working - fixed       # for the KV cache, the pool and the OS
    if context is not None:
        positions = min(int(context), spec.max_position_embeddings or int(context))
    else:       # not known: KV_CONTEXT, but never more than KV_SHARE of the room
        share = int(KV_SHARE * max(0.0, room) // max(1, kv_position))
        positions = min(kv_reserved_positions(spec), max(MIN_CONTEXT, share))
    kv_reserved = kv_position * positions + fixed
    if cap is not None:
        if cap < 1:
            raise ColiError("--cap must be >= 1")
        mode, n = "cap", cap
    elif ram_gb is not None:
        if not math.isfinite(ram_gb) or ram_gb <= 0:
            raise ColiError("--ram-gb must be a finite number > 0")
        mode, n = "ram-gb", int(ram_gb * GB // max(1, slot * len(layers)))
        if n < 1:
            raise ColiError(f"--ram-gb {ram_gb:g} is too small: one expert per layer needs "
                            f"{slot * len(layers) / GB:.3f} GB")
    else:
        budget = AUTO_SHARE * (room - kv_position * positions)
        mode, n = "auto", max(1, int(budget // max(1, slot * len(layers))))
    n = min(n, E)
    expert_total = sum(l.end - l.start for l in experts.values())
    per_expert = expert_total / max(1, len(experts))
    active = int(per_expert * spec.top_k * len(layers))
    hit = _projected_hit_rate(usage, layers, E, n)
    disk_s = active * (1 - hit) / (disk_gbps * GB)
    ram_s = (active * hit + dense) / (ram_gbps * GB)
    bound = "disk" if disk_s > ram_s else "ram-bandwidth"
    pool = slot * n * len(layers)
    left = max(0, int(available - dense - runtime - working - kv_reserved - pool))
    outside = max(0, expert_total - int(per_expert * n * len(layers)))
    return Plan(mode, n, E, len(layers), expert_total, slot, pool, dense, available,
                active, hit, bound, kv_position, kv_reserved, fixed, positions, runtime,
                runtime_bytes is not None, working, left, min(1.0, left / outside) if outside else 0.0)


def grow_kv_room(plan: Plan, positions: int, store=None, prefixes=None) -> int:
    """The context reached ``positions``, past the reservation: raise it (in KV_STEP steps, up to
    the model's context) and, under the automatic budget, give back as many pool slots per layer
    as the new positions take (store.shrink; never below one), so that pool + caches stay within
    the budget. ``prefixes``: the engine's prefix pool, whose byte budget follows the reservation.
    Returns the slots per layer given back."""
    if positions <= plan.kv_positions:
        return 0
    new = -(-positions // KV_STEP) * KV_STEP
    grown = (new - plan.kv_positions) * plan.kv_bytes_per_position
    plan.kv_positions, plan.kv_reserved_bytes = new, plan.kv_reserved_bytes + grown
    if prefixes is not None:
        prefixes.budget_bytes = plan.kv_reserved_bytes
    given = 0
    if plan.mode == "auto" and store is not None and hasattr(store, "shrink") and plan.moe_layers:
        per_step = plan.expert_slot_bytes * plan.moe_layers     # one slot in every MoE layer
        plan.kv_debt_bytes += grown        # negative: slots given back earlier cover this much more
        if plan.kv_debt_bytes > 0:
            given = min(plan.cap - 1, -(-plan.kv_debt_bytes // max(1, per_step)))
            if given:
                store.shrink(plan.cap - given)
                plan.cap -= given
                plan.ram_expert_bytes = plan.cap * per_step
                plan.kv_debt_bytes -= given * per_step
    return given


def _projected_hit_rate(usage: dict | None, layers, E: int, cap: int) -> float:
    """Share of routing mass on each layer's ``cap`` hottest experts (usage history), else cap/E."""
    if cap >= E:
        return 1.0
    if not usage:
        return cap / E
    rates = []
    for layer in layers:
        counts = sorted((c for (l, _), c in usage.items() if l == layer), reverse=True)
        total = sum(counts)
        rates.append(sum(counts[:cap]) / total if total else cap / E)
    return sum(rates) / len(rates)
