"""`coli convert`: a Hugging Face checkpoint directory -> a colibrì container, streamed and resumable.

Memory: tensors are converted in row blocks of about ``BLOCK_BYTES`` of float32, so peak memory
is a small constant (a few blocks) whatever the size of the model or of its largest tensor.
Resume: the output is one shard per decoder layer plus one for everything else; each shard is
written to a temp file and renamed when complete, and a journal records finished shards. A rerun
with the same parameters skips them; the result is byte-identical to an uninterrupted run (the
writer is deterministic). ``colibri.json`` is written last, so a directory without it is never
mistaken for a finished container. A lock file keeps two converters out of one directory.

Checkpoints as the Hub ships them, read through the family's layout (core.layout.Layout):
* A release's own tensor names are first renamed to the family's (``Layout.renames``).
* Fused expert tensors (transformers 5's in-memory layout, which some checkpoints are saved in):
  ``...mlp.experts.gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and
  ``...mlp.experts.down_proj`` [E, H, I] are split into our per-expert tensors
  ``...mlp.experts.E.{gate_proj,up_proj,down_proj}.weight``, read a row block of one expert at a
  time; the result is byte-identical to converting the same weights given per expert
  (``Layout.fused_rules``; a family's own expert parts, Kimi's w1/w3/w2, are the split's names).
* MTP (multi-token prediction) layers -- ``model.layers.N.*`` with N >= ``num_hidden_layers``, and
  ``mtp.*`` / ``model.mtp.*`` (``Layout.mtp_group``) -- are no part of the language model: they go
  to shards of their own (``mtp-0000i-of-0000k.safetensors``, quantized with the same classes),
  listed in the manifest under ``"mtp"`` and not under ``"shards"``, so the engine never opens
  them; their checksums are recorded with the others. ``drop_mtp`` leaves them out (the manifest still says so).
* Tensors the family declares no part of the language model (``Layout.dropped``: a composite
  image-text checkpoint's vision tower, ``model.visual.*``) are left out; the manifest's
  ``"dropped"`` says which prefixes, how many tensors and their source bytes (``coli info``).
  Sizes of a composite checkpoint come from its ``text_config``.
* Each tensor's class (f32 / int8 / int4 / kept as stored) is the layout's (``Layout.tensor_class``).
  The manifest records the routed experts' pattern (``expert_pattern``) and, where they are not
  gate/up/down_proj, their part names (``expert_parts``): the container finds them by these.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import psutil

from . import quant
from .arch import language_config
from .container import EXPERT_PATTERN_KEY, FORMAT, FORMAT_VERSION, MANIFEST, MAX_GROUP_SIZE
from .errors import ColiError
from .fileio import atomic_write_text
from .integrity import ALGORITHM, shard_checksums
from .layout import EXPERT_PARTS, Layout, expected_tensors, layer_of
from .safetensors_io import DTYPES, FLOAT_DTYPES, SafetensorsFile, SafetensorsWriter, to_float32

BLOCK_BYTES = 8 << 20       # float32 bytes converted at a time
PEAK_BOUND_BLOCKS = 8        # peak extra memory stays under this many blocks (tested)
JOURNAL = ".coli_convert.json"
LOCK = ".coli_convert.lock"
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                "tiktoken.model", "tokenization_kimi.py")   # Kimi's tokenizer (core/tiktoken_bpe.py)
FP8_SCALE_SUFFIX = "_scale_inv"
# DeepSeek V4's own scale companions: ``X.scale`` beside ``X.weight``, F8_E8M0 (UE8M0) bytes -- of
# an FP8 weight's 128x128 blocks, or of an FP4 weight's groups of 32 (I8 [O, I/2], two E2M1 codes
# a byte), whose bits the container keeps (quant.FP4)
SCALE_SUFFIX = ".scale"
FP4_CODE_DTYPES = ("I8", "U8")
FP4_SCALE_DTYPES = ("F8_E8M0", "U8")
FP8_BLOCK = 128
CONVERTER_VERSION = 1
MTP_KEY = "mtp"                 # the manifest's entry for the MTP layers (Layout.mtp_group)
MTP_SHARD_PREFIX = "mtp-"       # their shards: mtp-00001-of-0000k.safetensors
EXPERT_PARTS_KEY = "expert_parts"   # the routed experts' part names where not gate/up/down_proj
DROPPED_KEY = "dropped"         # the manifest's entry for tensors no part of the language model

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
    # a slice of a fused 3-D expert tensor: rows [row0, row0 + shape[0]) of expert ``expert``
    fused: str | None = None
    expert: int = 0
    row0: int = 0
    stored: str = ""                  # the name in the file where the layout renamed it
    # an FP4 weight's scale bytes (its name in its file): ``shape`` is then the logical [O, I]
    fp4_scale: str | None = None

    @property
    def key(self) -> str:
        """The tensor's name in its file."""
        return self.stored or self.name

    @property
    def nbytes(self) -> int:
        if self.fused is not None:
            return int(np.prod(self.shape)) * DTYPES[self.dtype].itemsize
        own = self.file.tensors[self.key].nbytes
        return own + (self.file.tensors[self.fp4_scale].nbytes if self.fp4_scale is not None else 0)

    @property
    def floating(self) -> bool:
        """Values the converter can decode to float32 (and so requantize)."""
        return self.dtype in FLOAT_DTYPES or self.fp4_scale is not None


@dataclass
class _Out:
    source: _Source
    scheme: str                        # 'int4' | 'int8' | quant.FP4 | 'f32' | 'keep'

    def entries(self, group_size: int) -> list[tuple[str, str, tuple[int, ...]]]:
        s = self.source
        if self.scheme == quant.FP4:
            codes, scales = quant.fp4_shapes(s.shape[0], s.shape[1])
            return [(s.name, "U8", codes), (s.name + ".qs", "U8", scales)]
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


def _gather(files: list[SafetensorsFile], layout: Layout) -> dict[str, _Source]:
    """Every tensor of the checkpoint under the family's name (``layout.renames``), FP8 block
    scales attached to their weights."""
    sources: dict[str, _Source] = {}
    scales, companions = [], []
    for f in files:
        for stored, info in f.tensors.items():
            name = layout.rename(stored)
            if name.endswith(FP8_SCALE_SUFFIX):
                scales.append((f, stored, name))
                continue
            if name.endswith(SCALE_SUFFIX) and info.dtype in FP4_SCALE_DTYPES:
                companions.append((f, stored, name))
                continue
            other = sources.get(name)
            if other is not None and (stored != name or other.key != name):
                raise ColiError(f"{f.path.name}: tensors {other.key} and {stored} are both renamed {name} "
                                f"by the family's layout")
            sources[name] = _Source(name, f, info.dtype, info.shape, stored="" if stored == name else stored)
    for f, stored, name in scales:
        owner = name[: -len(FP8_SCALE_SUFFIX)]
        if owner not in sources:
            raise ColiError(f"{f.path.name}: scale {stored} has no weight {owner}")
        sources[owner].scale_inv = stored
    for f, stored, name in companions:
        owner = name[: -len(SCALE_SUFFIX)] + ".weight"
        if owner not in sources:
            raise ColiError(f"{f.path.name}: scale {stored} has no weight {owner}")
        _attach_scale(sources[owner], f, stored)
    return sources


def _attach_scale(s: _Source, f: SafetensorsFile, stored: str) -> None:
    """A DeepSeek ``.scale`` companion: block scales of an FP8 weight, or the group scales of an
    FP4 one (its logical shape [O, 2 x stored columns]); a scale whose shape does not fit its
    weight is one line naming both."""
    got = tuple(f.tensors[stored].shape)
    where = f"{f.path.name}: {s.key} ({s.dtype} {list(s.shape)})"
    if s.file is not f:
        raise ColiError(f"{where}: its scale {stored} is in another file ({f.path.name})")
    if s.dtype == "F8_E4M3" and len(s.shape) == 2:
        need = (-(-s.shape[0] // FP8_BLOCK), -(-s.shape[1] // FP8_BLOCK))
        if got != need:
            raise ColiError(f"{where}: scale {stored} has shape {list(got)}, its {FP8_BLOCK}x{FP8_BLOCK} "
                            f"blocks need {list(need)}")
        s.scale_inv = stored
    elif s.dtype in FP4_CODE_DTYPES and len(s.shape) == 2:
        rows, cols = s.shape[0], 2 * s.shape[1]
        if quant.fp4_layout_error(rows, cols, ("U8", (rows, s.shape[1])), ("U8", got)):
            raise ColiError(f"{where}: FP4 scale {stored} has shape {list(got)}, the weight's groups "
                            f"of 32 need {list(quant.fp4_shapes(rows, cols)[1])}")
        s.fp4_scale, s.shape = stored, (rows, cols)
    else:
        raise ColiError(f"{where}: a scale ({stored}) beside a weight that is neither FP8 (F8_E4M3) "
                        f"nor FP4 (I8 codes)")


def _stored_rows(src: _Source, r0: int, r1: int) -> np.ndarray:
    """Stored elements of rows [r0, r1) of a source tensor (of its slice of a fused tensor)."""
    if src.fused is None:
        return src.file.raw(src.key, r0, r1)
    t = src.file.tensors[src.fused]
    dt = DTYPES[t.dtype]
    rows, cols = t.shape[1], t.shape[2]
    first = src.expert * rows + src.row0 + r0
    buf = src.file.pread((r1 - r0) * cols * dt.itemsize, t.start + first * cols * dt.itemsize)
    return np.frombuffer(buf, dtype=dt).reshape(r1 - r0, cols)


def _fp4_rows(src: _Source, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
    """An FP4 source's (codes, scale bytes) of rows [r0, r1), as the container stores them (U8),
    refused in one line if a scale decodes to NaN."""
    codes = src.file.raw(src.key, r0, r1).view(np.uint8)
    scales = src.file.raw(src.fp4_scale, r0, r1).view(np.uint8)
    quant.check_fp4(src.key, codes, scales, src.shape[1], row0=r0)
    return codes, scales


def _read_rows(src: _Source, files_by_name: dict[str, SafetensorsFile], r0: int, r1: int) -> np.ndarray:
    """float32 rows [r0, r1) of a 2-D source tensor, FP8 block scales applied (FP4: decoded)."""
    if src.fp4_scale is not None:
        return quant.dequantize_fp4(*_fp4_rows(src, r0, r1), src.shape[1])
    x = to_float32(_stored_rows(src, r0, r1), src.dtype)
    if src.scale_inv is not None:
        sf = files_by_name[src.scale_inv]
        if src.fused is None:
            s = sf.float32(src.scale_inv)
        else:                     # [E, rows/128, cols/128]: this expert's blocks only
            s = sf.float32(src.scale_inv, src.expert, src.expert + 1)[0]
        rows = (src.row0 + np.arange(r0, r1)) // FP8_BLOCK
        cols = np.arange(x.shape[1]) // FP8_BLOCK
        x = x * s[rows][:, cols]
    return x


def _expert_count(config: dict) -> int | None:
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if isinstance(config.get(key), int) and not isinstance(config.get(key), bool):
            return config[key]
    return None


def _split_fused(sources: dict[str, _Source], config: dict, files_by_name,
                 layout: Layout) -> dict[str, _Source]:
    """Replace each fused 3-D expert tensor (``layout.fused_rules``) by its per-expert slices (no
    bytes are read)."""
    H = config.get("hidden_size")
    E = _expert_count(config)
    rules = {r.name: (i, r) for i, r in enumerate(layout.fused_rules)}
    fused_re = re.compile(rf"^(?P<prefix>.*\.experts\.)(?P<kind>{'|'.join(map(re.escape, rules))})$")
    fused = {n: m for n in sources if (m := fused_re.match(n))}
    odd = next((n for n, s in sources.items() if len(s.shape) == 3 and ".experts." in n
                and n not in fused), None)
    if odd is not None:      # e.g. a `.weight`-suffixed fused tensor: no checkpoint we know has one
        known = " and ".join(f"...experts.{r.name} {_fused_shape(r)}" for _, r in rules.values())
        raise ColiError(f"{sources[odd].file.path.name}: 3-D expert tensor {odd} "
                        f"{list(sources[odd].shape)} is in no layout colibrì knows (fused experts are "
                        f"read as {known})")
    out = {n: s for n, s in sources.items() if n not in fused}
    inter: dict[str, tuple[int, int, str]] = {}     # prefix -> (experts, intermediate, tensor)
    # each prefix's tensors in the rules' order
    for name, m in sorted(fused.items(), key=lambda nm: (nm[1]["prefix"], rules[nm[1]["kind"]][0])):
        s = sources[name]
        prefix, kind = m.group("prefix", "kind")
        rule = rules[kind][1]
        k = len(rule.parts)
        many = f"{k} x " if k > 1 else ""
        want = (f"[experts, {many}intermediate, hidden]" if rule.hidden_in
                else "[experts, hidden, intermediate]")

        def bad(why: str) -> ColiError:
            return ColiError(f"{s.file.path.name}: fused expert tensor {name} {why}")
        if len(s.shape) != 3:
            raise bad(f"has shape {list(s.shape)}; a fused {kind} is 3-D {want}")
        if s.dtype not in FLOAT_DTYPES:
            raise bad(f"has dtype {s.dtype}, not a floating-point type")
        e, rows, cols = s.shape
        i_size = rows // k if rule.hidden_in else cols
        h_size = cols if rule.hidden_in else rows
        if (rows % k) or (isinstance(H, int) and h_size != H) or (E is not None and e != E) \
                or i_size == 0:
            raise bad(f"has shape {list(s.shape)}, but the config needs {want} = "
                      f"[{E if E is not None else 'E'}, {f'{many}I' if rule.hidden_in else H}, "
                      f"{H if rule.hidden_in else 'I'}] (hidden_size {H}, {E} experts)")
        seen = inter.setdefault(prefix, (e, i_size, name))
        if seen[:2] != (e, i_size):
            raise bad(f"has shape {list(s.shape)}, which disagrees with {seen[2]} "
                      f"({seen[0]} experts of intermediate size {seen[1]})")
        if s.scale_inv is not None:
            if s.dtype != "F8_E4M3":
                raise bad(f"has block scales ({s.scale_inv}) but dtype {s.dtype}, not F8_E4M3")
            got = files_by_name[s.scale_inv].tensors[s.scale_inv]
            need = (e, -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
            if tuple(got.shape) != need or (k > 1 and i_size % FP8_BLOCK):
                raise bad(f"is FP8 with scales {s.scale_inv} {list(got.shape)}: only the layout of "
                          f"transformers' fused FP8 experts, scales {list(need)} of {FP8_BLOCK}x"
                          f"{FP8_BLOCK} blocks with an intermediate size divisible by {FP8_BLOCK}, "
                          f"is understood; convert a per-expert or BF16 checkpoint instead")
        for x in range(e):
            for j, part in enumerate(rule.parts):
                target = f"{prefix}{x}.{part}.weight"
                if target in out:
                    raise bad(f"holds expert {x}'s {part}, which {target} gives as well")
                out[target] = _Source(target, s.file, s.dtype,
                                      (i_size if rule.hidden_in else h_size, cols), s.scale_inv,
                                      fused=s.key, expert=x, row0=j * i_size)
    return out


def _fused_shape(rule) -> str:
    """A fused expert tensor's shape, in words: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    k = len(rule.parts)
    return f"[E, {k if k > 1 else ''}I, H]" if rule.hidden_in else "[E, H, I]"


def _plan(sources: dict[str, _Source], bits: int, mtp: dict[str, str] | None = None,
          layout: Layout = Layout(), floats: frozenset = frozenset()) -> list[tuple[str, list[_Out]]]:
    """Output shards in order: one per decoder layer, then everything else, then one per MTP group
    (``mtp``: tensor name -> group, see ``Layout.mtp_group``). Within a shard, the dense tensors by
    name, then each routed expert's tensors together (``layout.experts``); each tensor's scheme
    from its class (``layout.tensor_class``). ``floats``: names the blocks read as float32
    (``Need.float32``), kept so at any --bits."""
    mtp = mtp or {}
    by_layer: dict[int | None, list[_Out]] = {}
    by_group: dict[str, list[_Out]] = {}
    for name in sorted(sources):
        s = sources[name]
        if s.fp4_scale is not None and bits == 16:
            scheme = quant.FP4       # shipped FP4: its bits kept (the source's encoding, as at --bits 16)
        elif not s.floating and bits != 16:
            scheme = "keep"
        else:
            scheme = layout.scheme(name, len(s.shape), bits, name in floats)
        if s.scale_inv is not None and bits == 16:
            scheme = "f32"   # FP8 with block scales: widened exactly (scale applied) at --bits 16
        if name in mtp:
            by_group.setdefault(mtp[name], []).append(_Out(s, scheme))
            continue
        by_layer.setdefault(layer_of(name), []).append(_Out(s, scheme))

    def order(o: _Out):
        place = layout.experts.place(o.source.name)
        return (place is not None, place[1] if place else 0, o.source.name)

    layers = sorted(k for k in by_layer if k is not None)
    width = max(3, len(str(max(layers, default=0))))
    plan = [(f"layer-{k:0{width}d}.safetensors", sorted(by_layer[k], key=order)) for k in layers]
    if None in by_layer:
        plan.append(("model-other.safetensors", sorted(by_layer[None], key=order)))
    groups = sorted(by_group, key=lambda g: _group_key(g, layout.prefix))
    plan += [(f"{MTP_SHARD_PREFIX}{i + 1:05d}-of-{len(groups):05d}.safetensors",
              sorted(by_group[g], key=order)) for i, g in enumerate(groups)]
    return plan


def _group_key(group: str, prefix: str = "model."):
    m = re.search(r"layers\.(\d+)$", group)
    return (not group.startswith(prefix + "layers."), group.rsplit(".layers.", 1)[0] if m else group,
            int(m.group(1)) if m else -1)


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
            block = _stored_rows(s, r0, r1) if len(s.shape) >= 2 else s.file.raw(s.key)
            w.write(s.name, block, r0 * block.nbytes // max(1, r1 - r0))
        elif len(s.shape) < 2:
            w.write(s.name, s.file.float32(s.key))
        else:
            if o.scheme == quant.FP4 and s.fp4_scale is not None:     # shipped FP4: bytes copied
                codes, scales = _fp4_rows(s, r0, r1)
                w.write(s.name, codes, r0 * codes.shape[1])
                w.write(s.name + ".qs", scales, r0 * scales.shape[1])
                report(s.nbytes * (r1 - r0) // rows)
                continue
            x = _read_rows(s, files_by_name, r0, r1).reshape(r1 - r0, cols)
            if o.scheme == quant.FP4:        # a float source encoded (tests; shipped FP4 is copied)
                codes, scales = quant.quantize_fp4(x)
                w.write(s.name, codes, r0 * codes.shape[1])
                w.write(s.name + ".qs", scales, r0 * scales.shape[1])
            elif o.scheme == "int4":
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


def convert(src: str | Path, out: str | Path, bits: int | None = None, group_size: int = 64,
            validate_config: Callable[[dict], None] | None = None,
            progress: Callable[[Progress], None] | None = None, drop_mtp: bool = False,
            fp4_experts: bool = False) -> Path:
    """Convert ``src`` (a local Hugging Face model directory) into a container at ``out``.
    ``bits`` None: 16 (nothing requantized) when the checkpoint ships weights in a low-bit format
    the engine runs as they are (FP4 experts: DeepSeek V4), else 4 (``default_bits``).
    ``drop_mtp``: leave the MTP layers out (by default they go to shards of their own).
    ``fp4_experts``: encode float routed experts as FP4 (quant.quantize_fp4) -- a container of the
    shipped FP4 layout from a float checkpoint, for tests and synthetic models."""
    src, out = Path(src), Path(out)
    if bits is not None and bits not in (4, 8, 16):
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
    spec = validate_config(config) if validate_config is not None else None
    layout = getattr(spec, "layout", None) or Layout()     # the family's (no family: the default)
    drop = layout.dropped          # no part of the language model (a vision tower): left out
    text = language_config(config)       # a composite model's sizes are its text_config's
    _check_side_files(src)
    files = _open_sources(src)
    try:
        files_by_name = {n: f for f in files for n in f.tensors}
        gathered = _gather(files, layout)
        left_out = sorted(n for n in gathered if drop and n.startswith(drop))
        dropped_entry = None
        if left_out:
            dropped_entry = {"prefixes": sorted({next(d for d in drop if n.startswith(d)) for n in left_out}),
                             "tensors": len(left_out),
                             "source_bytes": sum(gathered[n].nbytes for n in left_out)}
            gathered = {n: s for n, s in gathered.items() if n not in set(left_out)}
        sources = _split_fused(gathered, text, files_by_name, layout)
        bits = default_bits(sources.values()) if bits is None else bits
        num_layers = text.get("num_hidden_layers")
        mtp = {n: g for n in sources if (g := layout.mtp_group(n, num_layers)) is not None}
        if validate_config is not None:   # the weights against the config, before any writing
            validate_config(config, {n: s.shape for n, s in sources.items() if n not in mtp})
    except BaseException:
        for f in files:
            f.close()
        raise
    mtp_entry = None
    if mtp:
        groups = sorted(set(mtp.values()), key=lambda g: _group_key(g, layout.prefix))
        mtp_entry = {"dropped": bool(drop_mtp), "groups": groups,
                     "layers": sorted({int(g.rsplit(".", 1)[1]) for g in groups
                                       if g.startswith(layout.prefix + "layers.")}),
                     "source_bytes": sum(sources[n].nbytes for n in mtp)}
        if drop_mtp:
            mtp_entry["tensors"] = len(mtp)
            sources = {n: s for n, s in sources.items() if n not in mtp}
            mtp = {}
    floats = frozenset(n.name for n in expected_tensors(spec) if n.float32) if spec is not None else frozenset()
    plan = _plan(sources, bits, mtp, layout, floats)
    if fp4_experts:
        plan = fp4_experts_plan(plan, layout)
    params = {"bits": bits, "group_size": group_size, "converter_version": CONVERTER_VERSION,
              "source": str(src.resolve()),
              "source_files": {f.path.name: f.path.stat().st_size for f in files}}
    if fp4_experts:                 # only where it matters, so older journals still resume
        params["fp4_experts"] = True
    if mtp_entry is not None:       # only where it matters, so older journals still resume
        params["drop_mtp"] = bool(drop_mtp)
    if dropped_entry is not None:
        params["dropped"] = dropped_entry["prefixes"]

    extra = {DROPPED_KEY: dropped_entry} if dropped_entry else {}
    extra.update(expert_entries(layout))

    template = getattr(spec, "chat_template", None)

    def copy_side_files(out: Path) -> None:
        for fname in COPIED_FILES:
            if (src / fname).exists():
                tmp = out / (fname + ".tmp")
                shutil.copyfile(src / fname, tmp)
                os.replace(tmp, out / fname)
        if template is not None:          # the family's, where the release has a tokenizer but no template
            from .tokenizer import load_tokenizer
            tok = load_tokenizer(src)
            if tok is not None and not tok.has_chat_template:
                atomic_write_text(out / "chat_template.jinja", template)

    try:
        return write_container(
            out, params, plan, bits, group_size, config.get("model_type"),
            write_tensor=lambda w, o, report: _convert_tensor(w, o, group_size, files_by_name, report),
            cost=lambda o: o.source.nbytes, finalize=copy_side_files, progress=progress,
            mtp=mtp_entry, manifest_extra=extra or None, floats=floats)
    finally:
        for f in files:
            f.close()


def default_bits(sources) -> int:
    """What ``coli convert`` does without --bits: keep a release's own FP4 weights (and so every
    tensor as shipped, FP8 widened exactly: --bits 16) where it has them -- precision is chosen
    once, and there its authors chose it -- else int4 (--bits 4)."""
    return 16 if any(s.fp4_scale is not None for s in sources) else 4


def expert_entries(layout: Layout) -> dict:
    """What the manifest records of the routed experts, for the container: their pattern, and
    their part names (gate, up, down) where the family has its own."""
    out = {EXPERT_PATTERN_KEY: layout.experts.regex}
    if layout.experts.parts != EXPERT_PARTS:
        out[EXPERT_PARTS_KEY] = dict(zip(("gate", "up", "down"), (f"{n}.weight" for n in layout.experts.parts)))
    return out


def fp4_experts_plan(plan: list[tuple[str, list[_Out]]], layout: Layout) -> list[tuple[str, list[_Out]]]:
    """The plan with each routed expert's float matrix encoded FP4 (``convert(fp4_experts=True)``,
    core.synthetic's FP4 containers)."""
    def float_expert(s: _Source) -> bool:
        return layout.experts.place(s.name) is not None and len(s.shape) == 2 and s.dtype in FLOAT_DTYPES
    return [(n, [_Out(o.source, quant.FP4) if float_expert(o.source) else o for o in outs]) for n, outs in plan]


def write_container(out: Path, params: dict, plan: list[tuple[str, list[_Out]]], bits: int,
                    group_size: int, model_type: str | None, write_tensor, cost, finalize,
                    progress: Callable[[Progress], None] | None = None,
                    manifest_extra: dict | None = None, mtp: dict | None = None,
                    floats: frozenset = frozenset()) -> Path:
    """Write the shards of ``plan`` into ``out`` resumably, under the lock, manifest last.

    ``write_tensor(writer, out_tensor, report)`` fills one tensor (calling ``report(n)`` as it
    goes, in units of ``cost``); ``finalize(out)`` writes the side files just before the manifest.
    Used by the converter and by ``core.synthetic``, so their containers cannot differ in layout.

    Shards named ``mtp-...`` hold MTP layers: they are listed under the manifest's ``"mtp"``
    (``mtp``'s fields plus ``shards``, ``tensors`` (a count), ``bytes`` and ``quantized``, their
    tensors' entries in the form of the top-level ``tensors``), not under ``"shards"``, so no
    Container opens them; ``checksums`` covers them with the others.
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
                    diff = [k for k in {**prev, **params} if prev.get(k) != params.get(k)]
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
            def quantized(shards) -> dict:
                sizes = {"int4": group_size, quant.FP4: quant.FP4_GROUP}
                q = {o.source.name: {"scheme": o.scheme, "shape": list(o.source.shape),
                                     **({"group_size": sizes[o.scheme]} if o.scheme in sizes else {})}
                     for name, outs in plan if name in shards for o in outs
                     if o.scheme in ("int4", "int8", quant.FP4)}
                return dict(sorted(q.items()))
            aside = [name for name, _ in plan if name.startswith(MTP_SHARD_PREFIX)]
            main = [name for name, _ in plan if name not in aside]
            manifest = {
                "format": FORMAT, "format_version": FORMAT_VERSION, "model_type": model_type,
                "converter": {"params": params, "bits": bits, "group_size": group_size},
                "classes": _class_summary(bits, group_size, fp4=any(o.scheme == quant.FP4
                                                                    for _, outs in plan for o in outs),
                                          f32=[o.source.name for name, outs in plan if name in main
                                               for o in outs if o.source.name in floats and o.scheme == "f32"]),
                "shards": main,
                "tensors": quantized(set(main)),
                "checksums": checksums,      # per shard, of the file and its header (core.integrity)
                **(manifest_extra or {}),
            }
            if mtp is not None or aside:
                entry = {"dropped": False, **(mtp or {})}
                if not entry["dropped"]:
                    entry.update(shards=aside, tensors=sum(len(outs) for n, outs in plan if n in aside),
                                 bytes=sum((out / n).stat().st_size for n in aside),
                                 quantized=quantized(set(aside)))
                manifest[MTP_KEY] = entry
            atomic_write_text(manifest_path, json.dumps(manifest, indent=1))
            journal_path.unlink(missing_ok=True)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise ColiError(f"no space left on the device holding {out}; free some space and "
                                f"rerun the same command to resume") from None
            raise
    return out


def _class_summary(bits: int, group_size: int, fp4: bool = False, f32: list[str] = ()) -> dict[str, str]:
    """The manifest's ``classes`` (coli info). ``f32``: the tensors a family's blocks read as numbers
    (Need.float32: DeepSeek V4's mHC mixes, compressors, routers), written float32."""
    experts = {"routed_experts": f"{quant.FP4} (E2M1, a UE8M0 scale per 32)"} if fp4 else {}
    if bits == 16:
        return {"all": f"source dtype (nothing {'else ' if fp4 else ''}quantized)", **experts}
    main = f"int4-g{group_size}" if bits == 4 else "int8-row"
    kinds = sorted({re.sub(r"(^|\.)(layers\.)?\d+\.", r"\1", n.rsplit(".weight", 1)[0]).rsplit(".", 1)[-1]
                    for n in f32})
    return {"routed_experts": main, "shared_experts": main, "attention": main, "dense_mlp": main,
            "embeddings": "int8-row", "lm_head": "int8-row", "norms_router_biases": "f32", **experts,
            **({"f32_matrices": f"{len(f32)} ({', '.join(kinds[:6])}{', ...' if len(kinds) > 6 else ''})"} if f32 else {})}


