"""How many experts per layer fit in RAM, and what bounds speed: ``coli plan`` and open_model."""
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
RUNTIME_OVERHEAD = 512 << 20      # interpreter, libraries, activations of a prefill pass
AUTO_SHARE = 0.75                 # share of available memory the automatic budget may take
# Positions of KV cache reserved at once (core.engine.KVCache: it maps pages as they are written
# and grows past them) and kept free by the automatic budget. A 78-layer model with 8 KV heads of
# 128 needs 0.6 MiB per position: 2.6 GB at 4096, more than the runtime figure above.
KV_CONTEXT = 4096
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
    kv_reserved_bytes: int = 0      # what the automatic budget leaves for the KV cache (incl. fixed state)
    fixed_state_bytes: int = 0      # recurrent / conv state of every layer: its size whatever the context

    def as_dict(self) -> dict:
        return asdict(self)


def slot_bytes(container: Container) -> int:
    """One RAM slot: the largest expert, aligned (0 for a model without routed experts)."""
    if not container.experts:
        return 0
    span = max(loc.end - loc.start for loc in container.experts.values())
    return (span + 3 * ALIGN - 1) // ALIGN * ALIGN


def dense_ram_bytes(container: Container) -> int:
    """Bytes the dense weights take once loaded (16-bit floats are widened to float32)."""
    total = 0
    for name, (_, info) in container.index.items():
        from .container import tensor_place
        if tensor_place(name)[1] is not None:
            continue
        widen = 4 // DTYPES[info.dtype].itemsize if info.dtype in ("BF16", "F16") else 1
        total += info.nbytes * widen
    return total


def kv_reserved_positions(spec: ArchSpec) -> int:
    """KV_CONTEXT, or the model's maximum context if smaller."""
    return min(spec.max_position_embeddings or KV_CONTEXT, KV_CONTEXT)


def kv_bytes_per_position(spec: ArchSpec, kv_cache: str = "float32") -> int:
    """Bytes of cache one position takes over every layer, from the layers' cache kinds
    (core.cache_kinds); kv_cache is one of core.arch.KV_CACHES."""
    return cache_kinds.bytes_per_position(spec.cache_kinds, kv_cache)


def make_plan(container: Container, spec: ArchSpec, ram_gb: float | None = None, cap: int | None = None,
              usage: dict | None = None, disk_gbps: float = 1.0, ram_gbps: float = 25.0,
              kv_cache: str = "float32") -> Plan:
    if ram_gb is not None and cap is not None:
        raise ColiError("give --ram-gb or --cap, not both")
    experts = container.experts
    layers = sorted({l for l, _ in experts})
    E = spec.num_experts
    slot = slot_bytes(container)
    dense = dense_ram_bytes(container)
    available = psutil.virtual_memory().available
    if kv_cache not in KV_CACHES:
        raise ColiError(f"--kv-cache must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
    kv_position = kv_bytes_per_position(spec, kv_cache)
    fixed = cache_kinds.fixed_bytes(spec.cache_kinds, kv_cache)      # state that does not grow
    kv_reserved = kv_position * kv_reserved_positions(spec) + fixed
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
        budget = AUTO_SHARE * available - dense - RUNTIME_OVERHEAD - kv_reserved
        mode, n = "auto", max(1, int(budget // max(1, slot * len(layers))))
    n = min(n, E)
    expert_total = sum(l.end - l.start for l in experts.values())
    per_expert = expert_total / max(1, len(experts))
    active = int(per_expert * spec.top_k * len(layers))
    hit = _projected_hit_rate(usage, layers, E, n)
    disk_s = active * (1 - hit) / (disk_gbps * GB)
    ram_s = (active * hit + dense) / (ram_gbps * GB)
    bound = "disk" if disk_s > ram_s else "ram-bandwidth"
    return Plan(mode, n, E, len(layers), expert_total, slot, slot * n * len(layers), dense, available,
                active, hit, bound, kv_position, kv_reserved, fixed)


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
