"""`coli convert`: a Hugging Face checkpoint directory -> a colibrì container, streamed and resumable.

Memory: tensors are converted in row blocks of about ``BLOCK_BYTES`` of float32, so peak memory
is a small constant (a few blocks) whatever the size of the model or of its largest tensor.
Resume: the output is one shard per decoder layer plus one for everything else; each shard is
written to a temp file and renamed when complete, and a journal records finished shards. A rerun
with the same parameters skips them; the result is byte-identical to an uninterrupted run (the
writer is deterministic). ``colibri.json`` is written last, so a directory without it is never
mistaken for a finished container. A lock file keeps two converters out of one directory.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import psutil

from . import quant
from .container import FORMAT, FORMAT_VERSION, MANIFEST, MAX_GROUP_SIZE, tensor_place
from .errors import ColiError
from .fileio import atomic_write_text
from .integrity import ALGORITHM, shard_checksums
from .safetensors_io import FLOAT_DTYPES, SafetensorsFile, SafetensorsWriter

BLOCK_BYTES = 8 << 20       # float32 bytes converted at a time
PEAK_BOUND_BLOCKS = 8        # peak extra memory stays under this many blocks (tested)
JOURNAL = ".coli_convert.json"
LOCK = ".coli_convert.lock"
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
FP8_SCALE_SUFFIX = "_scale_inv"
FP8_BLOCK = 128
CONVERTER_VERSION = 1


@dataclass
class Progress:
    done_bytes: int        # source bytes converted so far
    total_bytes: int
    shard: str             # output shard being written
    shard_index: int
    shard_count: int
    tensor: str = ""


@dataclass
class _Source:
    name: str
    file: SafetensorsFile
    dtype: str
    shape: tuple[int, ...]
    scale_inv: str | None = None      # FP8 block-scale tensor consumed with this weight

    @property
    def nbytes(self) -> int:
        return self.file.tensors[self.name].nbytes


@dataclass
class _Out:
    source: _Source
    scheme: str                        # 'int4' | 'int8' | 'f32' | 'keep'

    def entries(self, group_size: int) -> list[tuple[str, str, tuple[int, ...]]]:
        s = self.source
        if self.scheme == "int4":
            packed, scales = quant.int4_shapes(s.shape[0], s.shape[1], group_size)
            return [(s.name, "U8", packed), (s.name + ".qs", "F32", scales)]
        if self.scheme == "int8":
            return [(s.name, "U8", s.shape), (s.name + ".qs", "F32", (s.shape[0],))]
        if self.scheme == "f32" or s.dtype.startswith("F8_"):
            return [(s.name, "F32", s.shape)]   # FP8 kept at --bits 16 is widened exactly to F32
        return [(s.name, s.dtype, s.shape)]


def load_config(src: Path) -> dict:
    p = src / "config.json"
    if not p.exists():
        raise ColiError(f"{src}: no config.json (is this a Hugging Face model directory?)")
    try:
        cfg = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ColiError(f"{p}: invalid JSON ({e.__class__.__name__}: {e})") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise ColiError(f"{p}: not a model config (no model_type)")
    return cfg


def _check_side_files(src: Path) -> None:
    """The files copied into the container must load there: parse them before writing anything."""
    gen = src / "generation_config.json"
    if gen.exists():
        try:
            ok = isinstance(json.loads(gen.read_text()), dict)
        except (ValueError, UnicodeDecodeError, RecursionError):
            ok = False
        if not ok:
            raise ColiError(f"{gen}: not a JSON object (a damaged generation_config.json)")
    from .tokenizer import load_tokenizer
    load_tokenizer(src)


def _open_sources(src: Path) -> list[SafetensorsFile]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
            raise ColiError(f"{index}: invalid index (no weight_map)") from None
        files = []
        for shard in sorted(set(weight_map.values())):
            if not (src / shard).exists():
                raise ColiError(f"{src}: shard {shard} named by model.safetensors.index.json is missing")
            files.append(SafetensorsFile(src / shard))
        have = {n for f in files for n in f.tensors}
        missing = [n for n in weight_map if n not in have]
        if missing:
            raise ColiError(f"{src}: tensor {missing[0]} named by the index is in none of the shards")
        return files
    paths = sorted(src.glob("*.safetensors"))
    if not paths:
        raise ColiError(f"{src}: no .safetensors weights found")
    return [SafetensorsFile(p) for p in paths]


def _gather(files: list[SafetensorsFile]) -> dict[str, _Source]:
    sources: dict[str, _Source] = {}
    for f in files:
        for name, info in f.tensors.items():
            if name.endswith(FP8_SCALE_SUFFIX):
                continue
            sources[name] = _Source(name, f, info.dtype, info.shape)
    for f in files:
        for name in f.tensors:
            if name.endswith(FP8_SCALE_SUFFIX):
                owner = name[: -len(FP8_SCALE_SUFFIX)]
                if owner not in sources:
                    raise ColiError(f"{f.path.name}: scale {name} has no weight {owner}")
                sources[owner].scale_inv = name
    return sources


def _read_rows(src: _Source, files_by_name: dict[str, SafetensorsFile], r0: int, r1: int) -> np.ndarray:
    """float32 rows [r0, r1) of a 2-D source tensor, FP8 block scales applied."""
    x = src.file.float32(src.name, r0, r1)
    if src.scale_inv is not None:
        sf = files_by_name[src.scale_inv]
        s = sf.float32(src.scale_inv)
        rows = np.arange(r0, r1) // FP8_BLOCK
        cols = np.arange(x.shape[1]) // FP8_BLOCK
        x = x * s[rows][:, cols]
    return x


def _plan(sources: dict[str, _Source], bits: int) -> list[tuple[str, list[_Out]]]:
    """Output shards in order: one per decoder layer, then everything else. Within a layer, the
    dense tensors by name, then each routed expert's tensors together."""
    by_layer: dict[int | None, list[_Out]] = {}
    for name in sorted(sources):
        s = sources[name]
        if s.dtype not in FLOAT_DTYPES and bits != 16:
            scheme = "keep"
        else:
            scheme = quant.scheme_for(name, len(s.shape), bits)
        if s.scale_inv is not None and bits == 16:
            scheme = "f32"   # FP8 with block scales: widened exactly (scale applied) at --bits 16
        layer, _ = tensor_place(name)
        by_layer.setdefault(layer, []).append(_Out(s, scheme))

    def order(o: _Out):
        layer, expert = tensor_place(o.source.name)
        return (expert is not None, expert or 0, o.source.name)

    layers = sorted(k for k in by_layer if k is not None)
    width = max(3, len(str(max(layers, default=0))))
    plan = [(f"layer-{k:0{width}d}.safetensors", sorted(by_layer[k], key=order)) for k in layers]
    if None in by_layer:
        plan.append(("model-other.safetensors", sorted(by_layer[None], key=order)))
    return plan


def _convert_tensor(w: SafetensorsWriter, o: _Out, group_size: int, files_by_name, report) -> None:
    """Convert one source tensor into ``w``, a row block at a time (``report`` gets source bytes)."""
    s = o.source
    rows = s.shape[0] if len(s.shape) >= 2 else 1
    cols = int(np.prod(s.shape, dtype=np.int64)) // max(1, rows)
    step = max(1, BLOCK_BYTES // max(1, cols * 4))
    if s.scale_inv is not None:
        step = max(FP8_BLOCK, step // FP8_BLOCK * FP8_BLOCK)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        if o.scheme == "keep" and s.scale_inv is None and not s.dtype.startswith("F8_"):
            block = s.file.raw(s.name, r0, r1) if len(s.shape) >= 2 else s.file.raw(s.name)
            w.write(s.name, block, r0 * block.nbytes // max(1, r1 - r0))
        elif len(s.shape) < 2:
            w.write(s.name, s.file.float32(s.name))
        else:
            x = _read_rows(s, files_by_name, r0, r1).reshape(r1 - r0, cols)
            if o.scheme == "int4":
                packed, scales = quant.quantize_int4(x, group_size)
                w.write(s.name, packed, r0 * packed.shape[1])
                w.write(s.name + ".qs", scales, r0 * scales.shape[1] * 4)
            elif o.scheme == "int8":
                q, scales = quant.quantize_int8(x)
                w.write(s.name, q, r0 * cols)
                w.write(s.name + ".qs", scales, r0 * 4)
            else:
                w.write(s.name, x, r0 * cols * 4)
        report(s.nbytes * (r1 - r0) // rows)


class _Lock:
    def __init__(self, out: Path):
        self.path = out / LOCK

    def __enter__(self):
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    pid = int(self.path.read_text().strip() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid and pid != os.getpid() and psutil.pid_exists(pid):
                    raise ColiError(f"{self.path.parent}: another converter (pid {pid}) is writing "
                                    f"here; wait for it or remove {LOCK} if it is gone") from None
                self.path.unlink(missing_ok=True)   # stale lock from a killed run
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            return self
        raise ColiError(f"{self.path}: cannot take the converter lock")

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)


def _space_check(out: Path, need: int) -> None:
    free = shutil.disk_usage(out).free
    if need > free:
        raise ColiError(f"not enough free space in {out}: the container needs {need / 1e9:.2f} GB more, "
                        f"{free / 1e9:.2f} GB free")


def convert(src: str | Path, out: str | Path, bits: int = 4, group_size: int = 64,
            validate_config: Callable[[dict], None] | None = None,
            progress: Callable[[Progress], None] | None = None) -> Path:
    """Convert ``src`` (a local Hugging Face model directory) into a container at ``out``."""
    src, out = Path(src), Path(out)
    if bits not in (4, 8, 16):
        raise ColiError(f"--bits must be 4, 8 or 16, not {bits}")
    if group_size < 2 or group_size % 2 or group_size > MAX_GROUP_SIZE:
        raise ColiError(f"--group-size must be an even number in 2..{MAX_GROUP_SIZE}, not {group_size}")
    if not src.is_dir():
        raise ColiError(f"{src}: no such directory")
    if out.exists() and not out.is_dir():
        raise ColiError(f"{out} exists and is not a directory; choose another output directory")
    if src.resolve() == out.resolve() or src.resolve().is_relative_to(out.resolve()):
        raise ColiError(f"the output {out} is or contains the source {src}; choose another directory")
    config = load_config(src)
    if validate_config is not None:
        validate_config(config)
    _check_side_files(src)
    files = _open_sources(src)
    sources = _gather(files)
    if validate_config is not None:       # the weights against the config, before any writing
        try:
            validate_config(config, {n: s.shape for n, s in sources.items()})
        except BaseException:
            for f in files:
                f.close()
            raise
    files_by_name = {n: f for f in files for n in f.tensors}
    plan = _plan(sources, bits)
    params = {"bits": bits, "group_size": group_size, "converter_version": CONVERTER_VERSION,
              "source": str(src.resolve()),
              "source_files": {f.path.name: f.path.stat().st_size for f in files}}

    def copy_side_files(out: Path) -> None:
        for fname in COPIED_FILES:
            if (src / fname).exists():
                tmp = out / (fname + ".tmp")
                shutil.copyfile(src / fname, tmp)
                os.replace(tmp, out / fname)

    try:
        return write_container(
            out, params, plan, bits, group_size, config.get("model_type"),
            write_tensor=lambda w, o, report: _convert_tensor(w, o, group_size, files_by_name, report),
            cost=lambda o: o.source.nbytes, finalize=copy_side_files, progress=progress)
    finally:
        for f in files:
            f.close()


def write_container(out: Path, params: dict, plan: list[tuple[str, list[_Out]]], bits: int,
                    group_size: int, model_type: str | None, write_tensor, cost, finalize,
                    progress: Callable[[Progress], None] | None = None,
                    manifest_extra: dict | None = None) -> Path:
    """Write the shards of ``plan`` into ``out`` resumably, under the lock, manifest last.

    ``write_tensor(writer, out_tensor, report)`` fills one tensor (calling ``report(n)`` as it
    goes, in units of ``cost``); ``finalize(out)`` writes the side files just before the manifest.
    Used by the converter and by ``core.synthetic``, so their containers cannot differ in layout.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with _Lock(out):
        manifest_path, journal_path = out / MANIFEST, out / JOURNAL
        if manifest_path.exists():
            try:
                done_params = json.loads(manifest_path.read_text()).get("converter", {}).get("params")
            except (json.JSONDecodeError, UnicodeDecodeError):
                done_params = None
            if done_params == params:
                return out
            raise ColiError(f"{out} already holds a container made with other parameters; "
                            f"choose another directory or delete it")
        journal = {"params": params, "done": {}}
        if journal_path.exists():
            try:
                old = json.loads(journal_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                old = None
            if isinstance(old, dict):
                if old.get("params") != params:
                    prev = old.get("params") or {}
                    diff = [k for k in params if prev.get(k) != params[k]]
                    raise ColiError(f"{out} holds an unfinished conversion with different parameters "
                                    f"({', '.join(diff)}); rerun with the same ones or use another "
                                    f"directory")
                journal = old
        sizes = {name: SafetensorsWriter.planned_size([e for o in outs for e in o.entries(group_size)])
                 for name, outs in plan}

        def finished(name: str) -> bool:
            p = out / name
            return name in journal["done"] and p.exists() and p.stat().st_size >= sizes[name]

        _space_check(out, sum(sz for n, sz in sizes.items() if not finished(n)))
        total = sum(cost(o) for _, outs in plan for o in outs)
        done = 0
        try:
            for i, (name, outs) in enumerate(plan):
                if not finished(name):
                    w = SafetensorsWriter(out / name, [e for o in outs for e in o.entries(group_size)],
                                          metadata={"format": FORMAT})
                    try:
                        for o in outs:
                            def report(n: int, _o=o, _name=name, _i=i) -> None:
                                nonlocal done
                                done += n
                                if progress:
                                    progress(Progress(done, total, _name, _i, len(plan), _o.source.name))
                            write_tensor(w, o, report)
                        w.commit()
                    except BaseException:
                        w.abort()
                        raise
                    # hashed now, while the shard is most likely still in the page cache
                    journal["done"][name] = shard_checksums(out / name)
                    atomic_write_text(journal_path, json.dumps(journal))
                done = sum(cost(o) for _, outs in plan[: i + 1] for o in outs)
                if progress:
                    progress(Progress(done, total, name, i, len(plan)))
            finalize(out)
            checksums = {}
            for name, _ in plan:      # a shard finished by an older converter has no digests yet
                rec = journal["done"].get(name)
                ok = isinstance(rec, dict) and all(isinstance(rec.get(k), str)
                                                   for k in (ALGORITHM, "header_" + ALGORITHM))
                checksums[name] = rec if ok else shard_checksums(out / name)
            quantized = {o.source.name: {"scheme": o.scheme, "shape": list(o.source.shape),
                                         **({"group_size": group_size} if o.scheme == "int4" else {})}
                         for _, outs in plan for o in outs if o.scheme in ("int4", "int8")}
            manifest = {
                "format": FORMAT, "format_version": FORMAT_VERSION, "model_type": model_type,
                "converter": {"params": params, "bits": bits, "group_size": group_size},
                "classes": _class_summary(bits, group_size),
                "shards": [name for name, _ in plan],
                "tensors": dict(sorted(quantized.items())),
                "checksums": checksums,      # per shard, of the file and its header (core.integrity)
                **(manifest_extra or {}),
            }
            atomic_write_text(manifest_path, json.dumps(manifest, indent=1))
            journal_path.unlink(missing_ok=True)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise ColiError(f"no space left on the device holding {out}; free some space and "
                                f"rerun the same command to resume") from None
            raise
    return out


def _class_summary(bits: int, group_size: int) -> dict[str, str]:
    if bits == 16:
        return {"all": "source dtype (nothing quantized)"}
    main = f"int4-g{group_size}" if bits == 4 else "int8-row"
    return {"routed_experts": main, "shared_experts": main, "attention": main, "dense_mlp": main,
            "embeddings": "int8-row", "lm_head": "int8-row", "norms_router_biases": "f32"}


