"""The catalog of downloadable models (``catalog.toml``) and the fit check against this machine.

``load()`` gives ``Entry`` objects; ``estimate(arch)`` recomputes an entry's sizes from its
architecture numbers (the catalog is checked against it by a test); ``fit(entry, directory)``
answers "will it run here, and how": fits in RAM / streams from disk (with a rough tok/s from the
disk bandwidth) / not enough RAM / not enough disk.
"""
from __future__ import annotations

import math
import shutil
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import psutil

CATALOG = Path(__file__).resolve().parent / "catalog.toml"
GB = 1e9
INT4_G64 = 0.5 + 4 / 64          # bytes per parameter: 4-bit value + one f32 scale per 64
INT8_ROW = 1.0
RUNTIME_OVERHEAD_GB = 0.5        # as core.planner.RUNTIME_OVERHEAD (interpreter, KV cache, activations)
AUTO_SHARE = 0.75                # as core.planner.AUTO_SHARE
DISK_GBPS = 1.0                  # as core.planner.make_plan's default disk bandwidth
RAM_GBPS = 25.0


@dataclass
class Entry:
    repo: str
    name: str
    family: str
    params_b: float
    active_b: float
    disk_gb: float
    download_gb: float
    active_expert_gb: float
    min_ram_gb: float
    note: str = ""
    arch: dict = field(default_factory=dict)

    @property
    def dense_gb(self) -> float:
        """Resident (non-expert) weights once converted."""
        return estimate(self.arch)["dense_gb"] if self.arch else max(0.0, self.min_ram_gb - self.active_expert_gb)


def load(path: str | Path | None = None) -> list[Entry]:
    data = tomllib.loads(Path(path or CATALOG).read_text())
    out = []
    for m in data.get("models", []):
        known = {k: m[k] for k in Entry.__dataclass_fields__ if k in m}
        out.append(Entry(**known))
    return out


def estimate(arch: dict) -> dict:
    """Sizes of a MoE transformer converted with --bits 4 (see catalog.toml's header)."""
    L, H, E, K = arch["layers"], arch["hidden"], arch["experts"], arch["top_k"]
    inter, heads, kv, hd, V = arch["expert_inter"], arch["heads"], arch["kv_heads"], arch["head_dim"], arch["vocab"]
    expert = 3 * H * inter
    experts = L * E * expert
    attn = L * (2 * H * heads * hd + 2 * H * kv * hd)
    emb = V * H * (1 if arch.get("tied") else 2)
    small = L * (E * H + 2 * H + 2 * hd) + H               # routers, norms (kept f32)
    total = experts + attn + emb + small
    active_experts = L * K * expert
    dense_bytes = attn * INT4_G64 + emb * INT8_ROW + small * 4
    active_expert_bytes = active_experts * INT4_G64
    return {
        "params_b": total / 1e9,
        "active_b": (attn + emb + small + active_experts) / 1e9,
        "disk_gb": (experts * INT4_G64 + dense_bytes) / GB,
        "download_gb": total * 2 / GB,
        "active_expert_gb": active_expert_bytes / GB,
        "dense_gb": dense_bytes / GB,
        "min_ram_gb": float(math.ceil((dense_bytes + active_expert_bytes) / GB + RUNTIME_OVERHEAD_GB)),
    }


@dataclass
class Fit:
    verdict: str            # 'ram' | 'stream' | 'no-ram' | 'no-disk'
    text: str               # one short line for the UI
    tok_s: float | None     # rough decode speed estimate
    need_disk_gb: float     # download + container
    free_disk_gb: float
    available_ram_gb: float

    @property
    def ok(self) -> bool:
        return self.verdict in ("ram", "stream")

    @property
    def short(self) -> str:
        """A table cell: the verdict and the speed."""
        if self.verdict == "ram":
            return f"in RAM ≤{self.tok_s:.0f} tok/s"
        if self.verdict == "stream":
            return f"streams ≈{self.tok_s:.1f} tok/s"
        return "too little disk" if self.verdict == "no-disk" else "too little RAM"


def free_disk(directory: str | Path) -> int:
    """Free bytes on the file system that holds ``directory`` (or its nearest existing parent)."""
    p = Path(directory).expanduser().resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def fit(entry: Entry, directory: str | Path, available_ram: int | None = None, free: int | None = None,
        disk_gbps: float = DISK_GBPS, keep_download: bool = False) -> Fit:
    avail = (psutil.virtual_memory().available if available_ram is None else available_ram) / GB
    free_gb = (free_disk(directory) if free is None else free) / GB
    need = entry.download_gb + entry.disk_gb
    budget = AUTO_SHARE * avail
    dense = entry.dense_gb
    if need > free_gb:
        return Fit("no-disk", f"not enough disk: needs {need:.0f} GB (download + conversion), "
                              f"{free_gb:.0f} GB free", None, need, free_gb, avail)
    if entry.min_ram_gb > avail:
        return Fit("no-ram", f"needs at least {entry.min_ram_gb:.0f} GB of free RAM, "
                             f"{avail:.1f} GB available", None, need, free_gb, avail)
    experts_gb = max(0.0, entry.disk_gb - dense)
    ram_for_experts = max(0.0, budget - dense - RUNTIME_OVERHEAD_GB)
    hit = 1.0 if experts_gb <= 0 else min(1.0, ram_for_experts / experts_gb)
    seconds = entry.active_expert_gb * (1 - hit) / disk_gbps + (entry.active_expert_gb * hit + dense) / RAM_GBPS
    tok_s = 1 / seconds if seconds > 0 else None
    if hit >= 1.0:
        return Fit("ram", f"fits in RAM · ≤{tok_s:.0f} tok/s", tok_s, need, free_gb, avail)
    return Fit("stream", f"streams from disk ({hit:.0%} of experts in RAM) · ≈{tok_s:.1f} tok/s "
                         f"at {disk_gbps:g} GB/s", tok_s, need, free_gb, avail)
