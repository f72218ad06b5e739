"""The catalog of downloadable models (``catalog.toml``) and the fit check against this machine.

``load()`` gives ``Entry`` objects; ``estimate(config, family)`` recomputes an entry's sizes from
its published config through the family's own layout (the catalog is checked against it by a
test); ``fit(entry, directory)`` answers "will it run here, and how": fits in RAM / streams from
disk (with a rough tok/s from the disk bandwidth) / not enough RAM / not enough disk.

Numpy-free at import, as the UI needs: ``load`` and ``fit`` read the stored numbers; only
``estimate`` (tests, tools) imports the families.
"""
from __future__ import annotations

import math
import re
import shutil
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import psutil

CATALOG = Path(__file__).resolve().parent / "catalog.toml"
GB = 1e9
GROUP = 64                       # --group-size: int4 values carry one f32 scale per 64 columns
INT4_G64 = 0.5 + 4 / GROUP       # bytes per parameter of an int4 g64 tensor (values + scale rows)
INT8_ROW = 1.0                   # int8 per row: 1 byte per parameter + one f32 scale per row
RUNTIME_OVERHEAD_GB = 0.5        # as core.planner.RUNTIME_OVERHEAD (interpreter, activations)
AUTO_SHARE = 0.75                # as core.planner.AUTO_SHARE
DISK_GBPS = 1.0                  # as core.planner.make_plan's default disk bandwidth
RAM_GBPS = 25.0
KV_CONTEXT = 4096                # as core.planner.KV_CONTEXT: the positions the planner reserves
KV_DTYPE = "float32"             # the engine's default KV cache (core.arch.KV_CACHES[0])
FP8_BLOCK = 128                  # the Hub's block-FP8 checkpoints: one f32 scale_inv per 128 x 128
FP4_BLOCK = 32                   # FP4 (E2M1) experts: half a byte a value + one UE8M0 byte per 32
# source bytes per parameter by the config's dtype (torch_dtype / dtype)
SOURCE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class Entry:
    repo: str
    name: str
    family: str
    params_b: float              # the language model's parameters (MTP layers not counted)
    active_b: float
    disk_gb: float               # the container the engine loads (MTP shards not counted)
    download_gb: float           # the source checkpoint as the Hub ships it, MTP layers included
    active_expert_gb: float
    min_ram_gb: float
    note: str = ""
    dense_gb: float | None = None        # resident weights (everything but the routed experts)
    kv_bytes_per_pos: int | None = None  # cache bytes one position of context takes (float32)
    state_bytes: int = 0                 # cache bytes whatever the context (linear layers' conv +
                                         # recurrent state, float32): counted once, not per position
    mtp_gb: float = 0.0                  # the MTP shards `coli convert` writes aside (--drop-mtp: 0)
    config: dict = field(default_factory=dict)   # the published config.json's fields the family reads
    source: str = ""             # where the config and the download size come from
    pending: str = ""            # not offered yet (load(include_pending=True) lists it): why
    arch: dict = field(default_factory=dict)     # older catalogs: GQA numbers (see _legacy_dense_gb)

    def __post_init__(self):
        if self.dense_gb is None:
            self.dense_gb = (_legacy_dense_gb(self.arch) if self.arch
                             else max(0.0, self.min_ram_gb - self.active_expert_gb - RUNTIME_OVERHEAD_GB))

    @property
    def context_gb(self) -> float:
        """The cache the planner reserves: KV_CONTEXT positions (float32) of KV or MLA latent on
        the layers that grow with context, plus the fixed state of the linear layers once."""
        return ((self.kv_bytes_per_pos or 0) * self.context_positions + self.state_bytes) / GB

    @property
    def context_positions(self) -> int:
        most = self.config.get("max_position_embeddings") or KV_CONTEXT
        return min(int(most), KV_CONTEXT)


def load(path: str | Path | None = None, include_pending: bool = False) -> list[Entry]:
    """The catalog's entries (those marked ``pending`` only with ``include_pending``)."""
    data = tomllib.loads(Path(path or CATALOG).read_text())
    out = []
    for m in data.get("models", []):
        known = {k: m[k] for k in Entry.__dataclass_fields__ if k in m}
        entry = Entry(**known)
        if include_pending or not entry.pending:
            out.append(entry)
    return out


def _legacy_dense_gb(arch: dict) -> float:
    """Resident bytes of an entry that only gives GQA numbers (catalogs written before entries
    carried their config): attention int4, embeddings int8, routers and norms f32."""
    L, H, E, heads, kv, hd, V = (arch[k] for k in ("layers", "hidden", "experts", "heads", "kv_heads",
                                                    "head_dim", "vocab"))
    attn = L * (2 * H * heads * hd + 2 * H * kv * hd)
    emb = V * H * (1 if arch.get("tied") else 2)
    small = L * (E * H + 2 * H + 2 * hd) + H
    return (attn * INT4_G64 + emb * INT8_ROW + small * 4) / GB


# --- the estimate: the family's own layout -----------------------------------------------------
def tensor_bytes(name: str, shape: tuple[int, ...], layout, bits: int = 4, group_size: int = GROUP,
                 float32: bool = False) -> int:
    """Bytes `coli convert --bits` writes for one float source tensor (its class in the family's
    ``layout``, core.converter._Out.entries' shapes): int4 [O, ceil(I/2)] U8 + [O, ceil(I/gs)] F32,
    int8 [O, I] U8 + [O] F32, f32 4 bytes a value. ``float32``: a tensor the blocks read as
    numbers (core.blocks.common.Need.float32), which the converter keeps F32 at any --bits but 16."""
    n = math.prod(shape)
    scheme = layout.scheme(name, len(shape), bits, float32)
    if scheme == "int4":
        rows, cols = shape
        return rows * ((cols + 1) // 2) + 4 * rows * -(-cols // group_size)
    if scheme == "int8":
        return n + 4 * shape[0]
    return 4 * n


def fp4_bytes(shape: tuple[int, ...]) -> int:
    """An FP4 expert matrix [O, I] as the release ships it and the container keeps it: E2M1 values
    two a byte + one UE8M0 scale byte per FP4_BLOCK columns."""
    rows, cols = shape
    return rows * ((cols + 1) // 2) + rows * -(-cols // FP4_BLOCK)


def _native_fp4(name: str, config: dict) -> bool:
    """A routed expert's matrix of a release whose experts are FP4 (``expert_dtype``): kept as
    shipped, in the container as in the download."""
    return config.get("expert_dtype") == "fp4" and re.search(r"\.experts\.\d+\.", name) is not None


def _source_bytes(name: str, shape: tuple[int, ...], config: dict, layout, float32: bool = False) -> int:
    """Bytes of one tensor in the checkpoint the Hub ships: the config's dtype, or block FP8 (1 byte
    a value + an f32 scale_inv per 128 x 128 block; a UE8M0 byte with ``scale_fmt = "ue8m0"``) for
    the decoder layers' projections (and a top-level MTP module's: ``mtp.*``) when the config says
    ``quantization_config.quant_method = "fp8"`` (embeddings, lm_head, norms, the router and the
    matrices the blocks read as numbers -- ``float32``, Need.float32: a compressor's projections --
    stay BF16, e_score_correction_bias F32, as the block-FP8 releases ship them); FP4 experts as
    ``fp4_bytes``."""
    n = math.prod(shape)
    if _native_fp4(name, config):
        return fp4_bytes(shape)
    if name.endswith("e_score_correction_bias"):
        return 4 * n
    if _block_fp8(name, shape, config, layout, float32):
        q = config["quantization_config"]
        block = (q.get("weight_block_size") or [FP8_BLOCK, FP8_BLOCK])
        scale = 1 if q.get("scale_fmt") == "ue8m0" else 4
        return n + scale * -(-shape[0] // block[0]) * -(-shape[1] // block[1])
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return SOURCE_BYTES.get(dtype, 2) * n


def _block_fp8(name: str, shape: tuple[int, ...], config: dict, layout, float32: bool = False) -> bool:
    """A tensor the release ships as block FP8 (see _source_bytes)."""
    q = config.get("quantization_config") or {}
    decoder = name.startswith(layout.prefix + "layers.") or layout.mtp_group(name, None) is not None   # or MTP
    return (q.get("quant_method") == "fp8" and len(shape) == 2 and decoder
            and layout.tensor_class(name, 2) != "f32" and not float32         # the router
            and not any(m and name.startswith(m) for m in q.get("modules_to_not_convert") or ()))


def default_bits(config: dict) -> int:
    """coli convert's --bits when none is given (core.converter.default_bits): 16 for a release
    whose experts ship in FP4 (kept as they are, the rest as shipped, FP8 widened to F32), else 4."""
    return 16 if config.get("expert_dtype") == "fp4" else 4


def estimate(config: dict, family: str | None = None, bits: int | None = None) -> dict:
    """An entry's sizes from its published config.json, through the family's own layout (every
    tensor core.layout.expected_tensors lists, at the class its layout gives it: latent
    attention, indexers, shared experts, dense-first layers...), its MTP layers (the family's
    ``mtp_tensors``) and its cache kinds; FP4 routed experts (``expert_dtype``) count as shipped.
    ``family``: the key (models.registry.FAMILIES) of the family that reads the config, when it
    is not the config's own type. Imports numpy (the families do): the UI reads the numbers the
    catalog stores, which a test checks against this."""
    from core import cache_kinds
    from core.blocks.common import Need
    from core.layout import expected_tensors
    from models.registry import FAMILIES, family_for
    fam = FAMILIES[family] if family else family_for(config)
    spec = fam.spec(config)
    layout = spec.layout
    bits = default_bits(config) if bits is None else bits
    total = experts = params = expert_params = source = 0
    per_layer: dict[int, int] = {}            # one MoE layer's routed-expert bytes, by layer
    def stored(t) -> int:         # what the converter writes for one tensor (Need)
        if bits == 16 and _native_fp4(t.name, config):         # --bits 4 / 8 requantize them too
            return fp4_bytes(t.shape)
        if bits == 16 and config.get("quantization_config"):     # as shipped, block FP8 widened to F32
            fp8 = _block_fp8(t.name, t.shape, config, layout, t.float32)
            return 4 * math.prod(t.shape) if fp8 else _source_bytes(t.name, t.shape, config, layout, t.float32)
        return tensor_bytes(t.name, t.shape, layout, bits, float32=t.float32)

    for t in expected_tensors(spec):
        if not t.synthetic:                   # optional biases the config does not have
            continue
        b, n = stored(t), math.prod(t.shape)
        total, params = total + b, params + n
        source += _source_bytes(t.name, t.shape, config, layout, t.float32)
        place = layout.experts.place(t.name)
        if place is not None:
            experts, expert_params = experts + b, expert_params + n
            per_layer[place[0]] = per_layer.get(place[0], 0) + b
    E, K = spec.num_experts, spec.top_k
    active_experts = sum(per_layer.values()) * K / E if E else 0.0     # top_k x MoE layers x one expert
    # the MTP layers the checkpoint carries (the family lists them, as (name, shape) or Need;
    # converted aside)
    mtp = [m if isinstance(m, Need) else Need(*m)
           for m in (fam.mtp_tensors(spec, config) if hasattr(fam, "mtp_tensors") else [])]
    mtp_bytes = sum(stored(m) for m in mtp)
    source += sum(_source_bytes(m.name, m.shape, config, layout, m.float32) for m in mtp)
    dense = total - experts
    kv = cache_kinds.bytes_per_position(spec.cache_kinds, KV_DTYPE)
    positions = min(spec.max_position_embeddings or KV_CONTEXT, KV_CONTEXT)
    state = cache_kinds.fixed_bytes(spec.cache_kinds, KV_DTYPE)     # once, whatever the context
    context = kv * positions + state
    return {
        "params_b": params / 1e9,
        "active_b": (params - expert_params + expert_params * K / E if E else params) / 1e9,
        "disk_gb": total / GB,
        "download_gb": source / GB,
        "active_expert_gb": active_experts / GB,
        "dense_gb": dense / GB,
        "mtp_gb": mtp_bytes / GB,
        "kv_bytes_per_pos": kv,
        "state_bytes": state,
        "context_gb": context / GB,
        "min_ram_gb": float(math.ceil((dense + active_experts + context) / GB + RUNTIME_OVERHEAD_GB)),
        "bytes": {"total": total, "experts": experts, "dense": dense, "mtp": mtp_bytes, "source": source},
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
    """Will ``entry`` run here, and how. Disk: the download plus the container (and the MTP shards
    the converter writes aside). RAM: the dense weights, the cache the planner reserves and the
    overhead first; what is left of AUTO_SHARE of the available memory holds experts, the rest
    stream from disk (core.planner.make_plan's budget)."""
    avail = (psutil.virtual_memory().available if available_ram is None else available_ram) / GB
    free_gb = (free_disk(directory) if free is None else free) / GB
    need = entry.download_gb + entry.disk_gb + entry.mtp_gb
    budget = AUTO_SHARE * avail
    dense, context = entry.dense_gb, entry.context_gb
    if need > free_gb:
        return Fit("no-disk", f"not enough disk: needs {need:.0f} GB (download + conversion), "
                              f"{free_gb:.0f} GB free", None, need, free_gb, avail)
    if entry.min_ram_gb > avail:
        return Fit("no-ram", f"needs at least {entry.min_ram_gb:.0f} GB of free RAM, "
                             f"{avail:.1f} GB available", None, need, free_gb, avail)
    experts_gb = max(0.0, entry.disk_gb - dense)
    ram_for_experts = max(0.0, budget - dense - RUNTIME_OVERHEAD_GB - context)
    hit = 1.0 if experts_gb <= 0 else min(1.0, ram_for_experts / experts_gb)
    seconds = entry.active_expert_gb * (1 - hit) / disk_gbps + (entry.active_expert_gb * hit + dense) / RAM_GBPS
    tok_s = 1 / seconds if seconds > 0 else None
    # what the reserved context costs, where the entry says (a KV cache, or an MLA latent one)
    ctx = f" · {entry.context_positions}-token context {context:.1f} GB" if entry.kv_bytes_per_pos else ""
    if entry.state_bytes and ctx:             # hybrids: the linear layers' state is fixed, said apart
        ctx += f" (fixed state {entry.state_bytes / GB:.2f} GB)"
    if hit >= 1.0:
        return Fit("ram", f"fits in RAM · ≤{tok_s:.0f} tok/s{ctx}", tok_s, need, free_gb, avail)
    return Fit("stream", f"streams from disk ({hit:.0%} of experts in RAM) · ≈{tok_s:.1f} tok/s "
                         f"at {disk_gbps:g} GB/s{ctx}", tok_s, need, free_gb, avail)
