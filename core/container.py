"""The colibrì container: a directory of safetensors shards plus a ``colibri.json`` manifest.

Tensor names are the source's. A quantized tensor NAME is U8 ``NAME`` + ``NAME.qs``, its scales:
F32 for int4 / int8, U8 (UE8M0 bytes) for FP4 (see ``core.quant``); the manifest's ``tensors``
map gives each quantized tensor's scheme, logical shape and group size. Each routed expert's
tensors form one contiguous byte range of one shard, so the expert store fetches an expert with
one read. The routed experts are found by the pattern the converter recorded from the family's
layout (``expert_pattern``; containers made before it was recorded use the default,
core.layout.EXPERT_REGEX).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import quant
from .errors import ColiError
from .layout import ExpertPattern, check_recorded_pattern, layer_of
from .safetensors_io import DTYPES, FLOAT_DTYPES, SafetensorsFile, TensorInfo, to_float32

MANIFEST = "colibri.json"
FORMAT = "colibri"
FORMAT_VERSION = 1
EXPERT_PATTERN_KEY = "expert_pattern"     # the manifest's routed-expert pattern (core.layout)


def tensor_place(name: str, experts: ExpertPattern = ExpertPattern()) -> tuple[int | None, int | None]:
    """(layer, routed expert) a tensor belongs to: the layer from ``layers.N.``, the expert by
    ``experts`` (the Hugging Face convention by default)."""
    place = experts.place(name)
    return place if place is not None else (layer_of(name), None)


@dataclass(frozen=True)
class QuantInfo:
    scheme: str                 # 'int4' | 'int8' | quant.FP4
    shape: tuple[int, int]      # logical [O, I]
    group_size: int = 0


@dataclass
class Weight:
    """A matrix or vector in RAM: dense float32, or quantized bytes + scales."""
    scheme: str                 # 'dense' | 'int4' | 'int8' | quant.FP4 (scales: UE8M0 bytes)
    shape: tuple[int, ...]
    data: np.ndarray
    scales: np.ndarray | None = None
    group_size: int = 0


class RowsOnDisk:
    """Rows of a stored 2-D tensor, read (one positioned read per row) when indexed: ``[ids]``
    gives them as an array, like the array in RAM would; nothing is kept."""

    def __init__(self, f: SafetensorsFile, info: TensorInfo):
        self.f, self.info = f, info
        self.shape, self.dtype = tuple(info.shape), np.dtype(DTYPES[info.dtype])
        self.row_bytes = info.nbytes // info.shape[0]

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.asarray(ids)
        flat = ids.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.shape[0]):
            raise IndexError(f"row out of range 0..{self.shape[0] - 1}")
        out = np.empty((flat.size, self.row_bytes), np.uint8)
        for i, r in enumerate(flat.tolist()):
            out[i] = np.frombuffer(self.f.pread(self.row_bytes, self.info.start + r * self.row_bytes), np.uint8)
        return out.view(self.dtype).reshape(ids.shape + self.shape[1:])


@dataclass
class ExpertLocation:
    shard: SafetensorsFile
    start: int
    end: int
    # suffix after "experts.E." -> (full tensor name, info with absolute offsets)
    parts: dict[str, tuple[str, TensorInfo]] = field(default_factory=dict)


def weight_from_bytes(info: TensorInfo, raw: memoryview | bytes, qinfo: QuantInfo | None,
                      scales_info: TensorInfo | None = None, scales_raw=None) -> Weight:
    """Build a Weight over bytes already in RAM (no copy for U8/F32 data)."""
    arr = np.frombuffer(raw, dtype=DTYPES[info.dtype]).reshape(info.shape)
    if qinfo is None:
        if info.dtype != "F32":
            arr = to_float32(arr, info.dtype)
        return Weight("dense", info.shape, arr)
    if qinfo.scheme == quant.FP4:      # every read of FP4 bytes is checked for NaN scales (cheap)
        scales = np.frombuffer(scales_raw, dtype=np.uint8).reshape(scales_info.shape)
        quant.check_fp4(info.name, arr, scales, qinfo.shape[1])
    else:
        scales = np.frombuffer(scales_raw, dtype=np.float32).reshape(scales_info.shape)
    return Weight(qinfo.scheme, qinfo.shape, arr, scales, qinfo.group_size)


MAX_GROUP_SIZE = 1 << 16     # int4 groups larger than this are refused (the kernels size buffers by it)


def _quant_entries(path: Path, tensors) -> dict[str, QuantInfo]:
    """The manifest's per-tensor quantization, every field type- and range-checked."""
    if not isinstance(tensors, dict):
        raise ColiError(f"{path}: {MANIFEST}: 'tensors' is not a JSON object")
    out = {}
    for name, q in tensors.items():
        def bad(why: str) -> ColiError:
            return ColiError(f"{path}: {MANIFEST}: tensor {name}: {why}")
        if not isinstance(q, dict):
            raise bad("entry is not a JSON object")
        scheme, shape, gs = q.get("scheme"), q.get("shape"), q.get("group_size", 0)
        if scheme not in ("int4", "int8", quant.FP4):
            raise bad(f"unknown scheme {scheme!r}")
        if (not isinstance(shape, list) or len(shape) != 2
                or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
            raise bad(f"shape {shape!r} is not two positive integers")
        if scheme == "int4" and not (isinstance(gs, int) and not isinstance(gs, bool)
                                     and 2 <= gs <= MAX_GROUP_SIZE and gs % 2 == 0):
            raise bad(f"group_size {gs!r} is not an even integer in 2..{MAX_GROUP_SIZE}")
        if scheme == quant.FP4 and gs != quant.FP4_GROUP:
            raise bad(f"group_size {gs!r}: {quant.FP4} has one scale per {quant.FP4_GROUP}")
        out[name] = QuantInfo(scheme, (shape[0], shape[1]), gs if scheme != "int8" else 0)
    return out


class Container:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        mpath = self.path / MANIFEST
        if not self.path.is_dir():
            raise ColiError(f"{self.path}: no such model directory")
        if not mpath.exists():
            raise ColiError(f"{self.path} is not a colibrì container (no {MANIFEST}); "
                            f"convert it first with `coli convert`")
        try:
            self.manifest = json.loads(mpath.read_text())
            self.config = json.loads((self.path / "config.json").read_text())
        except FileNotFoundError as e:
            raise ColiError(f"{self.path}: missing {Path(e.filename).name}") from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ColiError(f"{self.path}: invalid JSON in {MANIFEST} or config.json ({e})") from None
        if not isinstance(self.manifest, dict) or not isinstance(self.config, dict):
            raise ColiError(f"{self.path}: {MANIFEST} and config.json must each hold a JSON object")
        if self.manifest.get("format") != FORMAT or self.manifest.get("format_version") != FORMAT_VERSION:
            raise ColiError(f"{self.path}: unsupported container format "
                            f"{self.manifest.get('format')} v{self.manifest.get('format_version')}")
        self.quant: dict[str, QuantInfo] = _quant_entries(self.path, self.manifest.get("tensors", {}))
        conv = self.manifest.get("converter")
        gs = conv.get("group_size") if isinstance(conv, dict) else None
        odd = next((n for n, q in self.quant.items() if q.scheme == "int4" and gs is not None
                    and q.group_size != gs), None)
        if odd is not None:       # the converter writes one group size for every int4 tensor
            raise ColiError(f"{self.path}: {MANIFEST}: tensor {odd} has group size "
                            f"{self.quant[odd].group_size}, the converter's was {gs!r}")
        # MTP layers the converter set aside (core.converter): their shards are never opened here,
        # so they are no layers or experts of this model; `coli info` reports them
        mtp = self.manifest.get("mtp")
        self.mtp: dict | None = mtp if isinstance(mtp, dict) else None
        # the routed experts' part names where the checkpoint has its own (Kimi's w1 / w3 / w2):
        # expert_weights keys them by role (gate_proj.weight / up_proj.weight / down_proj.weight)
        parts = self.manifest.get("expert_parts")
        self.expert_roles: dict[str, str] = {}
        if parts is not None:
            if (not isinstance(parts, dict) or set(parts) != {"gate", "up", "down"}
                    or not all(isinstance(v, str) and v for v in parts.values())
                    or len(set(parts.values())) != 3):
                raise ColiError(f"{self.path}: {MANIFEST}: expert_parts must name the gate, up and down "
                                f"tensors, got {parts!r}")
            self.expert_roles = {v: f"{k}_proj.weight" for k, v in parts.items()}
        regex = self.manifest.get(EXPERT_PATTERN_KEY)
        self.expert_pattern = ExpertPattern(check_recorded_pattern(regex, f"{self.path}: {MANIFEST}")
                                            if regex is not None else ExpertPattern().regex)
        shards = self.manifest.get("shards")
        if not isinstance(shards, list) or not all(isinstance(x, str) and x for x in shards):
            raise ColiError(f"{self.path}: {MANIFEST} has no valid list of shards")
        self.files: list[SafetensorsFile] = []
        self.index: dict[str, tuple[SafetensorsFile, TensorInfo]] = {}
        try:
            for shard in shards:
                p = self.path / shard
                if Path(shard).name != shard or not p.is_file():
                    raise ColiError(f"{self.path}: shard {shard} is missing")
                f = SafetensorsFile(p)
                self.files.append(f)
                self._check_header_digest(shard, f)
                for name, info in f.tensors.items():
                    if name in self.index:
                        raise ColiError(f"{self.path}: tensor {name} is stored twice "
                                        f"({self.index[name][0].path.name} and {shard})")
                    self.index[name] = (f, info)
            self._check_quantized()
            self.experts = self._locate_experts()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for f in self.files:
            f.close()

    def _check_header_digest(self, shard: str, f: SafetensorsFile) -> None:
        """The shard's header as the converter wrote it (core.integrity), where it was recorded."""
        sums = self.manifest.get("checksums")
        if sums is None:
            return                      # converted before checksums existed
        rec = sums.get(shard) if isinstance(sums, dict) else None
        want = rec.get("header_sha256") if isinstance(rec, dict) else None
        if not isinstance(want, str):
            raise ColiError(f"{self.path}: {MANIFEST} has no checksum for {shard}")
        if want != f.header_sha256:
            raise ColiError(f"{self.path}: the header of {shard} changed since conversion (its "
                            f"checksum differs); convert the model again")

    def _check_quantized(self) -> None:
        """Every quantized tensor's manifest entry against its stored bytes: the packed weight's
        dtype and shape, and its scales (.qs) -- a wrong shape or group size would otherwise be
        read as garbage, or size the kernels' buffers (a group of 2^30 took 5.3 GB)."""
        for name, q in self.quant.items():
            if name not in self.index:
                raise ColiError(f"{self.path}: {MANIFEST} lists {name}, which no shard holds")
            if name + ".qs" not in self.index:
                raise ColiError(f"{self.path}: quantized tensor {name} has no scales ({name}.qs)")
            info, sinfo = self.index[name][1], self.index[name + ".qs"][1]
            rows, cols = q.shape
            if q.scheme == quant.FP4:
                why = quant.fp4_layout_error(rows, cols, (info.dtype, info.shape),
                                             (sinfo.dtype, sinfo.shape))
                if why is not None or info.dtype != "U8" or sinfo.dtype != "U8":
                    want = quant.fp4_shapes(rows, cols)
                    raise ColiError(f"{self.path}: FP4 tensor {name} [{rows}, {cols}] is stored as "
                                    f"{info.dtype} {list(info.shape)} + {sinfo.dtype} "
                                    f"{list(sinfo.shape)} scales; {MANIFEST} needs U8 {list(want[0])} "
                                    f"+ U8 {list(want[1])}")
                continue
            if q.scheme == "int4":
                want = ((rows, (cols + 1) // 2), (rows, -(-cols // q.group_size)))
            else:
                want = ((rows, cols), (rows,))
            got = (info.shape, sinfo.shape)
            if info.dtype != "U8" or sinfo.dtype != "F32" or got != want:
                raise ColiError(
                    f"{self.path}: {name} does not match its {MANIFEST} entry ({q.scheme} "
                    f"{rows}x{cols}" + (f", group size {q.group_size}" if q.scheme == "int4" else "")
                    + f": expects U8 {list(want[0])} + F32 scales {list(want[1])}, stored "
                    f"{info.dtype} {list(info.shape)} + {sinfo.dtype} {list(sinfo.shape)})")

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def names(self):
        return self.index.keys()

    def logical_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape as the model sees it ([O, I] for a quantized tensor, whose stored
        bytes are packed); scales (.qs) left out."""
        return {n: self.quant[n].shape if n in self.quant else info.shape
                for n, (_, info) in self.index.items() if not (n.endswith(".qs") and n[:-3] in self.quant)}

    def _locate_experts(self) -> dict[tuple[int, int], ExpertLocation]:
        found: dict[tuple[int, int], ExpertLocation] = {}
        for name, (f, info) in self.index.items():
            parsed = self.expert_pattern.parse(name)
            if parsed is None:
                continue
            layer, expert, part = parsed
            loc = found.setdefault((layer, expert), ExpertLocation(f, info.start, info.end))
            if loc.shard is not f:
                raise ColiError(f"{self.path}: expert {layer}/{expert} spans two shards")
            loc.start, loc.end = min(loc.start, info.start), max(loc.end, info.end)
            loc.parts[part] = (name, info)
        roles = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
        for (layer, expert), loc in found.items():
            if loc.end - loc.start != sum(i.nbytes for _, i in loc.parts.values()):
                raise ColiError(f"{self.path}: expert {layer}/{expert} is not contiguous in its shard")
            have = {self.expert_roles.get(p, p) for p in loc.parts}
            if not have.issuperset(roles):     # a pattern or part names that do not fit the tensors
                raise ColiError(f"{self.path}: expert {layer}/{expert} has no {', '.join(r for r in roles if r not in have)} "
                                f"({MANIFEST}'s expert_pattern / expert_parts do not fit its tensors)")
        return found

    def load(self, name: str) -> Weight:
        """Read one (possibly quantized) tensor into RAM."""
        try:
            f, info = self.index[name]
        except KeyError:
            raise ColiError(f"{self.path}: tensor {name} is missing from the container") from None
        q = self.quant.get(name)
        if q is None:
            return weight_from_bytes(info, f.pread(info.nbytes, info.start), None)
        sf, sinfo = self.index[name + ".qs"]
        return weight_from_bytes(info, f.pread(info.nbytes, info.start), q, sinfo,
                                 sf.pread(sinfo.nbytes, sinfo.start))

    def load_ints(self, name: str) -> np.ndarray:
        """An integer tensor as int64 (a routing table: DeepSeek V4's ``tid2eid``)."""
        try:
            f, info = self.index[name]
        except KeyError:
            raise ColiError(f"{self.path}: tensor {name} is missing from the container") from None
        if info.dtype in FLOAT_DTYPES or info.dtype == "BOOL":
            raise ColiError(f"{self.path}: tensor {name} is {info.dtype}, not an integer table")
        return np.frombuffer(f.pread(info.nbytes, info.start), dtype=DTYPES[info.dtype]).reshape(info.shape).astype(np.int64)

    def load_rows(self, name: str) -> Weight:
        """A matrix whose rows are read from the file when asked for (``RowsOnDisk``; its scales,
        if any, in RAM): an untied embedding, of which a token needs one row -- 311 MB of a
        151,851-row int8 table otherwise held for 2 KB a token (issue 20). A dense 16-bit table
        is widened in RAM as load() does (its rows would be widened at every lookup)."""
        f, info = self.index.get(name, (None, None))
        if info is None or (name not in self.quant and info.dtype != "F32") or len(info.shape) != 2:
            return self.load(name)
        rows = RowsOnDisk(f, info)
        q = self.quant.get(name)
        if q is None:
            return Weight("dense", info.shape, rows)
        sf, sinfo = self.index[name + ".qs"]
        scales = np.frombuffer(sf.pread(sinfo.nbytes, sinfo.start),
                               dtype=np.uint8 if q.scheme == quant.FP4 else np.float32).reshape(sinfo.shape)
        return Weight(q.scheme, q.shape, rows, scales, q.group_size)

    def expert_weights(self, layer: int, expert: int, blob) -> dict[str, Weight]:
        """Split one expert's bytes (read with a single pread of its range) into Weights keyed
        by the suffix after ``experts.E.`` (e.g. ``gate_proj.weight``; a family's own part names,
        the manifest's ``expert_parts``, come back by role: ``w1.weight`` as ``gate_proj.weight``)."""
        loc = self.experts[(layer, expert)]
        view = memoryview(blob)

        def part(info: TensorInfo):
            return view[info.start - loc.start: info.end - loc.start]

        out: dict[str, Weight] = {}
        for suffix, (full, info) in loc.parts.items():
            if suffix.endswith(".qs"):
                continue
            q = self.quant.get(full)
            sinfo = loc.parts[suffix + ".qs"][1] if q is not None else None
            out[self.expert_roles.get(suffix, suffix)] = weight_from_bytes(info, part(info), q, sinfo,
                                            part(sinfo) if sinfo is not None else None)
        return out

    def read_expert(self, layer: int, expert: int) -> bytearray:
        loc = self.experts[(layer, expert)]
        return loc.shard.pread(loc.end - loc.start, loc.start)
