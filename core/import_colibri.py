"""`coli import-colibri SRC OUT`: a container published by colibrì's C engine -> our container,
its quantized bytes copied as they are (nothing is requantized).

The C engine (github.com/JustVugg/colibri, ``c/tools/convert_fp8_to_int4.py``; read by
``qt_from_disk`` / ``qt_resolve_fmt`` in ``c/colibri.c``) writes the same tensor encoding as
``core.quant``: a quantized weight NAME is U8 ``NAME`` + F32 ``NAME.qs``, int4 nibbles offset by 8
with the even element in the low nibble and s = max(absmax(group) / 7, 1e-8) per group of 64
along the row, int8 one scale per row (absmax / 127); norms, the router and biases are F32, with
Hugging Face tensor names. What differs is the layout:

* files ``out-NNNNN.safetensors`` (one per source shard, numbered from 0), ``out-mtp-NNNNN`` (the
  multi-token-prediction head, layer ``num_hidden_layers``) and ``out-idx-NNNNN`` (GLM-5's DSA
  lightning-indexer weights of the decoder layers, extracted in a separate pass);
* quantized weights and their scales are stored flattened to 1-D (``qbytes.reshape(-1)``), so
  shapes come from config.json and the scheme from the byte counts (``qt_resolve_fmt``);
* no manifest, no checksums, no ``__metadata__`` (only an optional ``colibri.fmt`` stamp that our
  schemes never carry), and the stock safetensors writer orders tensors by dtype, so an expert's
  U8 weights and F32 scales are far apart -- or in different files when the source checkpoint
  split them.

Why an import and not reading the directory in place: our expert store fetches a routed expert
with one read of one contiguous byte range (core.container), and the integrity checks
(core.integrity) need a manifest with recorded digests; reading their layout directly would mean a
second container class, several reads per expert and no checksums. The import is a sequential
copy (no arithmetic on the weights), reusing the converter's planner and writer
(``core.converter.write_container``): the same shard layout, experts contiguous, checksums,
temp-file shards, resumable, lock, manifest last.

Shapes come only from ``core.synthetic.checkpoint_shapes`` (the family's tensor layout); an
MTP layer's tensors take the shape of the same tensor in a decoder layer. The MTP head (out-mtp-*,
``model.layers.{num_hidden_layers}.*``) goes where the converter puts MTP layers
(``core.layout.Layout.mtp_group``): ``mtp-*`` shards listed under the manifest's ``"mtp"``, not under
``"shards"``, so the engine never opens them. A tensor whose shape the layout does not give (the
MTP's ``eh_proj``/``enorm``/``hnorm``/``shared_head``; the DSA indexer while no family lists it) is
copied with its stored dtype and 1-D shape (``NAME`` and ``NAME.qs`` as they are) and named in the
manifest's ``imported_from.as_stored``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .container import MANIFEST, MAX_GROUP_SIZE
from .converter import (COPIED_FILES, Progress, _check_side_files, _group_key, _Out, _plan, _Source,
                        expert_entries, load_config, write_container)
from .errors import ColiError
from .layout import Layout, layer_of
from .safetensors_io import DTYPES, FLOAT_DTYPES, SafetensorsFile, SafetensorsWriter, TensorInfo

IMPORTER_VERSION = 1
SOURCE_FORMAT = "colibri-c"          # the C engine's directory layout
COPY_BYTES = 8 << 20                 # bytes copied at a time
_SHARD = re.compile(r"^out-(?:(mtp|idx)-)?(\d{5})\.safetensors$")
_KINDS = {None: "out-", "mtp": "out-mtp-", "idx": "out-idx-"}
_STAMP = "colibri.fmt"               # the C engine's optional per-tensor format stamp


def is_colibri_dir(path: str | Path) -> bool:
    """A directory in the C engine's layout: out-NNNNN shards and no manifest of ours."""
    p = Path(path)
    return (p.is_dir() and not (p / MANIFEST).exists()
            and any(_SHARD.match(f.name) for f in p.iterdir() if f.is_file()))


@dataclass
class _Tensor:
    """One logical tensor of the source: its stored weight and, when quantized, its scales."""
    name: str
    file: SafetensorsFile
    info: TensorInfo
    scales: TensorInfo | None
    scales_file: SafetensorsFile | None = None     # a source shard may split weight and scales
    scheme: str = ""                  # 'int4' | 'int8' | 'f32' | 'keep'
    shape: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return self.info.nbytes + (self.scales.nbytes if self.scales is not None else 0)


def _shard_files(src: Path) -> list[Path]:
    """The source's shards, every numbering without a gap (a gap is a missing shard)."""
    found: dict[str | None, dict[int, Path]] = {}
    for f in sorted(src.iterdir()):
        m = _SHARD.match(f.name)
        if m and f.is_file():
            found.setdefault(m.group(1), {})[int(m.group(2))] = f
    if not found.get(None):
        raise ColiError(f"{src}: no out-NNNNN.safetensors shards (not a container of colibrì's "
                        f"C engine)")
    for kind, by_num in found.items():
        for k in range(max(by_num) + 1):
            if k not in by_num:
                raise ColiError(f"{src}: shard {_KINDS[kind]}{k:05d}.safetensors is missing (the "
                                f"{_KINDS[kind]}* shards run from 0 to {max(by_num):05d})")
    index = src / "model.safetensors.index.json"
    if index.is_file():          # not written by the C engine; checked where it names out-* shards
        try:
            named = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            named = set()
        for shard in sorted(n for n in named if isinstance(n, str) and _SHARD.match(n)):
            if not (src / shard).is_file():
                raise ColiError(f"{src}: shard {shard} named by model.safetensors.index.json is missing")
    return [f for kind in sorted(found, key=lambda k: k or "") for f in found[kind].values()]


def _infer(t: _Tensor, shape: tuple[int, ...], group_size: int, where: str) -> str:
    """The scheme of a tensor from its byte counts and the shape config.json gives it."""
    info, s = t.info, t.scales
    nb = info.nbytes
    label = f"{where}: tensor {t.name} ({t.file.path.name})"
    if s is None:
        n = int(np.prod(shape, dtype=np.int64))
        if info.dtype not in FLOAT_DTYPES or info.dtype.startswith("F8_"):
            raise ColiError(f"{label} is {info.dtype} without scales ({t.name}.qs): it fits no "
                            f"scheme")
        got = nb // DTYPES[info.dtype].itemsize
        if got != n:
            raise ColiError(f"{label}: {nb} bytes of {info.dtype} ({got} elements) fit no scheme "
                            f"for its shape {list(shape)} from config.json ({n} elements)")
        return "f32" if info.dtype == "F32" else "keep"
    ns = s.nbytes
    if len(shape) != 2:
        raise ColiError(f"{label} is quantized ({nb} bytes + {ns} bytes of scales) but its shape "
                        f"{list(shape)} from config.json is not a matrix: it fits no scheme")
    if info.dtype != "U8" or s.dtype != "F32":
        raise ColiError(f"{label} is {info.dtype} with {s.dtype} scales; quantized tensors are U8 "
                        f"with F32 scales")
    rows, cols = shape
    fits = {"int4": (rows * ((cols + 1) // 2), 4 * rows * -(-cols // group_size)),
            "int8": (rows * cols, 4 * rows)}
    for scheme, want in fits.items():
        if (nb, ns) == want:
            return scheme
    hint = ""
    if nb == fits["int4"][0] and ns == 4 * rows:
        hint = " (it is int4 with one scale per row, the C engine's fmt=2, which our container does not hold)"
    elif nb == rows * ((cols + 3) // 4) and ns == 4 * rows:
        hint = " (it is int2, which our container does not hold)"
    elif nb == fits["int4"][0] and ns % (4 * rows) == 0:
        hint = (f" (it is int4 with {ns // (4 * rows)} scales per row: rerun with the container's "
                f"--group-size)")
    raise ColiError(f"{label}: {nb} bytes + {ns} bytes of scales fit no scheme for [{rows}, {cols}] "
                    f"from config.json (int4-g{group_size} needs {fits['int4'][0]} + "
                    f"{fits['int4'][1]}, int8 {fits['int8'][0]} + {fits['int8'][1]})" + hint)


def _shape_for(name: str, shapes: dict[str, tuple[int, ...]],
               by_suffix: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """A tensor's shape from the family's layout: its own entry, else (an MTP layer mirrors a
    decoder layer) the same tensor of any decoder layer; None when the layout does not say."""
    if name in shapes:
        return shapes[name]
    layer = layer_of(name)
    if layer is None:
        return None
    return by_suffix.get(name.split(f"layers.{layer}.", 1)[1])


def _copy(w: SafetensorsWriter, name: str, f: SafetensorsFile, info: TensorInfo, report) -> None:
    """Copy one stored tensor's bytes into tensor ``name`` of ``w``, a chunk at a time."""
    for off in range(0, info.nbytes, COPY_BYTES):
        n = min(COPY_BYTES, info.nbytes - off)
        w.write(name, np.frombuffer(f.pread(n, info.start + off), dtype=np.uint8), off)
        report(n)


def import_colibri(src: str | Path, out: str | Path, validate_config: Callable, group_size: int = 64,
                   progress: Callable[[Progress], None] | None = None) -> Path:
    """Import the C engine's container ``src`` into our container ``out`` (bytes copied).
    ``validate_config`` (models.validate_config) reads the config into the family's ArchSpec:
    its layout gives the tensors' shapes and what is set aside."""
    from .synthetic import checkpoint_shapes
    src, out = Path(src), Path(out)
    if group_size < 2 or group_size % 2 or group_size > MAX_GROUP_SIZE:
        raise ColiError(f"--group-size must be an even number in 2..{MAX_GROUP_SIZE}, not {group_size}")
    if not src.is_dir():
        raise ColiError(f"{src}: no such directory")
    if (src / MANIFEST).exists():
        raise ColiError(f"{src} is already a container of ours ({MANIFEST}); nothing to import")
    if out.exists() and not out.is_dir():
        raise ColiError(f"{out} exists and is not a directory; choose another output directory")
    if src.resolve() == out.resolve() or src.resolve().is_relative_to(out.resolve()):
        raise ColiError(f"the output {out} is or contains the source {src}; choose another directory")
    paths = _shard_files(src)
    config = load_config(src)
    spec = validate_config(config)
    _check_side_files(src)
    files: list[SafetensorsFile] = []
    try:
        for p in paths:
            files.append(SafetensorsFile(p))
        return _import(src, out, config, files, group_size, checkpoint_shapes(spec), spec.layout,
                       validate_config, progress)
    finally:
        for f in files:
            f.close()


def _import(src: Path, out: Path, config: dict, files: list[SafetensorsFile], group_size: int,
            shapes: dict[str, tuple[int, ...]], layout: Layout, validate_config, progress) -> Path:
    where = str(src)
    stored: dict[str, tuple[SafetensorsFile, TensorInfo]] = {}
    for f in files:
        for name, info in f.tensors.items():
            if name in stored:
                raise ColiError(f"{where}: tensor {name} is stored twice ({stored[name][0].path.name} "
                                f"and {f.path.name})")
            stored[name] = (f, info)
        stamp = f.metadata.get(_STAMP)
        if stamp:
            try:
                stamped = json.loads(stamp)
            except ValueError:
                stamped = None
            name = next(iter(stamped), None) if isinstance(stamped, dict) else "?"
            raise ColiError(f"{where}: {f.path.name} stamps tensor {name} as "
                            f"{stamped.get(name) if isinstance(stamped, dict) else stamp!r} "
                            f"({_STAMP}), a format our container does not hold")
    for name in shapes:
        if name not in stored or stored[name][0].path.name.startswith(_KINDS["mtp"]):
            raise ColiError(f"{where}: tensor {name} is missing: none of the {len(files)} shards "
                            f"holds it (a shard may be missing)")
    tensors: dict[str, _Tensor] = {}
    for name, (f, info) in stored.items():
        if name.endswith(".qs"):
            if name[:-3] not in stored:
                raise ColiError(f"{where}: scales {name} ({f.path.name}) have no weight {name[:-3]} "
                                f"(a shard may be missing)")
            continue
        s = stored.get(name + ".qs")
        tensors[name] = _Tensor(name, f, info, s[1] if s else None, s[0] if s else None)
    num_layers = config.get("num_hidden_layers")
    by_suffix = {n.split(f"layers.{layer}.", 1)[1]: s for n, s in shapes.items()
                 for layer in [layer_of(n)] if layer is not None}
    # output tensor name -> (source file, stored info); the plan's sources, what MTP group each is in
    copies: dict[str, tuple[SafetensorsFile, TensorInfo]] = {}
    sources: dict[str, _Source] = {}
    schemes: dict[str, str] = {}
    mtp: dict[str, str] = {}
    as_stored: list[str] = []
    for name in sorted(tensors):
        t = tensors[name]
        group = layout.mtp_group(name, num_layers)
        if group is None and t.file.path.name.startswith(_KINDS["mtp"]):
            group = "mtp"                 # an out-mtp-* tensor whatever its name
        t.shape = _shape_for(name, shapes, by_suffix)
        if t.shape is not None:
            t.scheme = _infer(t, t.shape, group_size, where)
            parts = [(name, t.file, t.info, t.info.dtype, t.shape)]
        else:                             # the layout does not name it: bytes and shapes as stored
            t.scheme = "keep"
            as_stored.append(name)
            parts = [(name, t.file, t.info, t.info.dtype, t.info.shape)]
            if t.scales is not None:
                parts.append((name + ".qs", t.scales_file, t.scales, t.scales.dtype, t.scales.shape))
        for out_name, f, info, dtype, shape in parts:
            sources[out_name] = _Source(out_name, f, dtype, shape)
            schemes[out_name] = t.scheme if out_name == name else "keep"
            copies[out_name] = (f, info)
            if out_name == name and t.scales is not None and t.shape is not None:
                copies[out_name + ".qs"] = (t.scales_file, t.scales)
            if group is not None:
                mtp[out_name] = group
    loaded = {n: t for n, t in tensors.items() if n not in mtp}
    validate_config(config, {n: t.shape for n, t in loaded.items() if t.shape is not None})

    plan = _plan(sources, 16, mtp, layout)
    for _, outs in plan:                 # bits 16 above: every scheme is set here
        for o in outs:
            o.scheme = schemes[o.source.name]
    found = {schemes[n] for n in schemes if n not in mtp}
    bits = 4 if "int4" in found else 8 if "int8" in found else 16
    params = {"importer": SOURCE_FORMAT, "importer_version": IMPORTER_VERSION,
              "group_size": group_size, "source": str(src.resolve()),
              "source_files": {f.path.name: f.path.stat().st_size for f in files}}
    extra: dict = {"imported_from": {"format": SOURCE_FORMAT, "source": str(src.resolve()),
                                     "as_stored": as_stored},
                   "classes": _classes({n: t for n, t in loaded.items() if t.shape is not None},
                                       group_size, layout),
                   **expert_entries(layout)}

    def nbytes(name: str) -> int:
        return copies[name][1].nbytes + (copies[name + ".qs"][1].nbytes
                                         if name + ".qs" in copies and name + ".qs" not in sources else 0)

    more = {}
    if mtp:                              # as the converter records the MTP layers it sets aside
        groups = sorted(set(mtp.values()), key=lambda g: _group_key(g, layout.prefix))
        more["mtp"] = {"dropped": False, "groups": groups,
                       "layers": sorted({int(g.rsplit(".", 1)[1]) for g in groups
                                         if g.startswith(layout.prefix + "layers.")}),
                       "source_bytes": sum(nbytes(n) for n in mtp)}

    def write_tensor(w: SafetensorsWriter, o: _Out, report) -> None:
        name = o.source.name
        _copy(w, name, *copies[name], report)
        if name + ".qs" in copies and name + ".qs" not in sources:
            _copy(w, name + ".qs", *copies[name + ".qs"], report)

    def finalize(d: Path) -> None:
        for fname in COPIED_FILES:
            if (src / fname).exists():
                tmp = d / (fname + ".tmp")
                shutil.copyfile(src / fname, tmp)
                os.replace(tmp, d / fname)

    return write_container(out, params, plan, bits, group_size, config.get("model_type"),
                           write_tensor=write_tensor, cost=lambda o: nbytes(o.source.name),
                           finalize=finalize, progress=progress, manifest_extra=extra, **more)


def _classes(loaded: dict[str, _Tensor], group_size: int, layout: Layout) -> dict[str, str]:
    """What the manifest's ``classes`` says: each class's schemes as found in the source."""
    def kind(name: str) -> str:
        if layout.experts.place(name) is not None:
            return "routed_experts"
        if "shared_expert" in name:
            return "shared_experts"
        if name == layout.embed_name:
            return "embeddings"
        if name == layout.head:
            return "lm_head"
        if "self_attn" in name and name.endswith("proj.weight"):
            return "attention"
        if name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
            return "dense_mlp"
        return "norms_router_biases"
    label = {"int4": f"int4-g{group_size}", "int8": "int8-row", "f32": "f32", "keep": "source dtype"}
    found: dict[str, set[str]] = {}
    for name, t in loaded.items():
        found.setdefault(kind(name), set()).add(label[t.scheme])
    return {k: "+".join(sorted(v)) for k, v in sorted(found.items())}
