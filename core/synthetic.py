"""Random-weight containers written directly (no transformers, no Hugging Face source).

``write_random_container(out, config, family)`` produces the same directory ``coli convert`` would
produce from a checkpoint of that ``config``: the same shards (one per decoder layer plus
``model-other.safetensors``), the same tensor order inside each shard (dense tensors by name, then
each routed expert's tensors as one contiguous byte range), the same per-class schemes (experts,
attention and dense MLPs int4-g64 or int8 at ``bits=8``; embeddings and lm_head int8 per row;
norms, router, biases and what the blocks read as numbers (``Need.float32``) F32; integer tables
as they are; with ``fp4_experts`` the routed experts in FP4 E2M1 + UE8M0, as ``coli convert
--fp4-experts`` / a DeepSeek V4 release has them) and the same ``colibri.json`` manifest. The layout is computed with
the converter's own planner and the family's layout (``family.spec(config)``: its tensors, their
classes), so the two cannot drift apart. The family is a parameter, as the converter's
``validate_config`` is: core never imports the families.

It is meant for benchmarks and tests at real geometry without downloading a model:

* **Streams:** every tensor is generated and written in chunks of ``CHUNK_BYTES``, so memory stays
  at a few MiB whatever the model size.
* **Fast:** quantized bytes come straight from the bit generator (``random_raw``) with a few
  word-wide bit operations (≈ 0.5–0.8 GB/s on one core), not through float32 weights.
* **Realistic enough to run:** int4 codes are symmetric in −7..7 (what the quantizer produces:
  code −8 never occurs) with per-group scales (±25 %) giving each weight a std ≈ 1/sqrt(fan_in),
  so activations keep a unit scale through the layers; the projections into the residual stream
  (o_proj, down_proj) are further scaled by 1/sqrt(2·layers) (GPT-2's init) so the stream keeps
  the token's identity and greedy decoding does not collapse into one repeated token; int8 codes
  (embeddings std 1, lm_head 1/sqrt(hidden), row scales ±2 %) are symmetric in −127..127; router
  weights are normal(0, 1)·``ROUTER_GAIN``/sqrt(hidden), so router logits have std ≈
  ``ROUTER_GAIN`` and the top-k varies from token to token; norms are ones and biases zeros.
  Routing is therefore close to uniform, not a trained model's skewed, sticky routing. FP4
  experts: uniform random E2M1 codes with power-of-two group scales giving the same weight std
  (scale bytes 127 + log2(std / code RMS), about 120 at a fan-in of 4096); an index table
  (``Need.index_range``: a hash router's token -> experts) has distinct random indices per row.
* **Deterministic:** each tensor's bytes depend only on (seed, tensor name, shape), never on
  chunking or on the other tensors. Shards are written to a temp file and renamed; a journal lets
  an interrupted run resume; ``colibri.json`` is written last.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from . import quant
# the converter's own planner and writer, so that the layout cannot drift from `coli convert`
from .converter import (CONVERTER_VERSION, Progress, _Out, _plan, _Source, expert_entries, fp4_experts_plan,
                        write_container)
from .errors import ColiError
from .layout import expected_tensors
from .safetensors_io import SafetensorsWriter

GENERATOR_VERSION = 2
CHUNK_BYTES = 128 << 10          # generated and written at a time (cache-sized: fastest here)
ROUTER_GAIN = 2.0                # std of the router logits for a unit-RMS hidden state
EMBED_STD = 1.0

_INT4_CODE_RMS = float(np.sqrt(2 * sum(k * k for k in range(1, 8)) / 16))      # ≈ 4.18
_INT8_CODE_RMS = float(np.sqrt(2 * sum(k * k for k in range(1, 128)) / 256))   # ≈ 73.5
_FP4_CODE_RMS = float(np.sqrt(np.mean(np.square(quant.E2M1))))                 # ≈ 2.93
_M8 = np.uint64(0x8888888888888888)
_H80 = np.uint64(0x8080808080808080)
_L7F = np.uint64(0x7F7F7F7F7F7F7F7F)
_U1, _U2 = np.uint64(1), np.uint64(2)


# --- which tensors a config has --------------------------------------------------------------------
def tensor_shapes(config: dict, family) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape of the checkpoint ``config`` describes: the family's
    own layout (core.layout.expected_tensors), biases where the config has them."""
    return checkpoint_shapes(family.spec(config))


def _needs(spec) -> list:
    """The tensors a synthetic checkpoint of ``spec`` holds (core.blocks.common.Need)."""
    out = [n for n in expected_tensors(spec) if n.synthetic]
    for need in out:
        if need.shape is None:
            raise ValueError(f"{need.name}: the family leaves its shape to the tensors")
    return out


def checkpoint_shapes(spec) -> dict[str, tuple[int, ...]]:
    """tensor_shapes for an ArchSpec."""
    return {n.name: n.shape for n in _needs(spec)}


def _plan_spec(spec, bits: int, fp4_experts: bool = False) -> list[tuple[str, list[_Out]]]:
    """The converter's plan for float32 sources (int64 index tables), with its ``floats`` and
    ``fp4_experts`` rules."""
    needs = _needs(spec)
    sources = {n.name: _Source(n.name, None, "I64" if n.index_range else "F32", n.shape) for n in needs}
    plan = _plan(sources, bits, layout=spec.layout, floats=frozenset(n.name for n in needs if n.float32))
    if fp4_experts:
        plan = fp4_experts_plan(plan, spec.layout)
    return plan


def plan(config: dict, family, bits: int = 4, fp4_experts: bool = False) -> list[tuple[str, list[_Out]]]:
    """The converter's shard plan for a checkpoint of ``config`` (float32 sources)."""
    return _plan_spec(family.spec(config), bits, fp4_experts)


def container_bytes(config: dict, family, bits: int = 4, group_size: int = 64,
                    fp4_experts: bool = False) -> dict[str, int]:
    """Planned bytes: {'total': ..., 'experts': ...} (tensor data, headers excluded)."""
    spec = family.spec(config)
    total = experts = 0
    for _, outs in _plan_spec(spec, bits, fp4_experts):
        for o in outs:
            n = SafetensorsWriter.planned_size(o.entries(group_size))
            total += n
            if spec.layout.experts.place(o.source.name) is not None:
                experts += n
    return {"total": total, "experts": experts}


# --- random bytes ----------------------------------------------------------------------------------
def _rngs(seed: int, name: str) -> tuple[np.random.Generator, np.random.Generator]:
    """Two independent streams (codes, scales) that depend only on (seed, name)."""
    key = zlib.crc32(name.encode())
    return (np.random.Generator(np.random.PCG64([seed, key, 0])),
            np.random.Generator(np.random.PCG64([seed, key, 1])))


class _Scratch:
    """Two reusable word buffers for the bit operations (fresh temporaries cost page faults)."""

    def __init__(self, nbytes: int = CHUNK_BYTES):
        self.a = np.empty(-(-nbytes // 8), np.uint64)
        self.b = np.empty(-(-nbytes // 8), np.uint64)


def _int4_codes(rng: np.random.Generator, nbytes: int, sc: _Scratch) -> np.ndarray:
    """Random packed int4 bytes, each nibble uniform over codes 1..15 except that code 0 (value
    -8, which the quantizer never produces) becomes 8 (value 0): values -7..7, mean 0."""
    n = -(-nbytes // 8)
    x, z, t = rng.bit_generator.random_raw(n), sc.a[:n], sc.b[:n]
    np.left_shift(x, _U1, out=z)
    np.bitwise_or(z, x, out=z)
    np.left_shift(z, _U2, out=t)
    np.bitwise_or(z, t, out=z)            # bit 3 of each nibble = OR of the nibble's 4 bits
    np.bitwise_not(z, out=z)
    np.bitwise_and(z, _M8, out=z)         # 0x8 where the nibble was 0
    np.bitwise_or(x, z, out=x)
    return x.view(np.uint8)[:nbytes]


def _int8_codes(rng: np.random.Generator, nbytes: int, sc: _Scratch) -> np.ndarray:
    """Random int8 bytes with -128 (never produced by the quantizer) mapped to 0."""
    n = -(-nbytes // 8)
    x, y, t = rng.bit_generator.random_raw(n), sc.a[:n], sc.b[:n]
    np.bitwise_xor(x, _H80, out=y)        # zero bytes where x was 0x80
    np.bitwise_and(y, _L7F, out=t)
    np.add(t, _L7F, out=t)
    np.bitwise_or(t, y, out=t)            # high bit set iff the byte of y is non-zero
    np.bitwise_not(t, out=t)
    np.bitwise_and(t, _H80, out=t)
    np.bitwise_xor(x, t, out=x)
    return x.view(np.uint8)[:nbytes]


_RESIDUAL_OUT = ("o_proj.weight", "down_proj.weight")   # projections that write the residual


@dataclass
class _Gen:
    """What every tensor's bytes depend on besides its own name and shape."""
    group_size: int
    seed: int
    num_layers: int
    embed: str
    residual_out: tuple[str, ...]        # name suffixes of the projections into the residual
    index_range: dict[str, int]          # index tables: name -> the range of their values
    scratch: _Scratch = field(default_factory=_Scratch)

    def std(self, name: str, shape: tuple[int, ...]) -> float:
        """Weight std: 1/sqrt(fan_in) keeps activations at unit scale; the projections into the
        residual stream get GPT-2's extra 1/sqrt(2·layers), so the stream stays dominated by the
        token (not by the sum of random layer outputs): otherwise a deep random model forgets its
        input and greedy decoding falls into one or two repeated tokens."""
        if name == self.embed:
            return EMBED_STD
        std = 1.0 / np.sqrt(shape[1])
        if name.endswith(self.residual_out):
            std /= np.sqrt(2 * max(1, self.num_layers))
        return std


def _write_tensor(w: SafetensorsWriter, o: _Out, g: _Gen) -> None:
    name, shape, scheme = o.source.name, o.source.shape, o.scheme
    crng, srng = _rngs(g.seed, name)
    if scheme == quant.FP4:
        _write_fp4(w, name, shape, g.std(name, shape), crng, srng)
        return
    if name in g.index_range:
        _write_index_table(w, name, shape, g.index_range[name], crng)
        return
    if scheme in ("int4", "int8"):
        rows, cols = shape
        std = g.std(name, shape)
        if scheme == "int4":
            (_, row_bytes), (_, groups) = quant.int4_shapes(rows, cols, g.group_size)
            codes, base, jitter = _int4_codes, std / _INT4_CODE_RMS, 0.25
        else:
            row_bytes, groups = cols, 1
            # little spread of row norms: big ones would win every argmax of the lm_head
            codes, base, jitter = _int8_codes, std / _INT8_CODE_RMS, 0.02
        total = rows * row_bytes
        for off in range(0, total, CHUNK_BYTES):
            n = min(CHUNK_BYTES, total - off)
            block = codes(crng, n, g.scratch)
            if scheme == "int4" and cols % 2:      # the converter pads the odd column with code 8
                last = np.arange((-(off + 1)) % row_bytes, n, row_bytes)
                block[last] = (block[last] & 0x0F) | 0x80
            w.write(name, block, off)
        srows = max(1, CHUNK_BYTES // (4 * groups))
        for r0 in range(0, rows, srows):
            r1 = min(rows, r0 + srows)
            u = srng.random((r1 - r0) * groups, dtype=np.float32)
            s = (np.float32(base) * (np.float32(1 - jitter) + np.float32(2 * jitter) * u)).astype(np.float32)
            w.write(name + ".qs", s, r0 * groups * 4)
        return
    # F32 (norms, router, biases, what the blocks read as numbers): small, written whole
    if name.endswith("norm.weight"):
        a = np.ones(shape, np.float32)
    elif len(shape) == 2:   # router, mixes, compressor projections
        a = (srng.standard_normal(shape, dtype=np.float32) * np.float32(ROUTER_GAIN / np.sqrt(shape[1])))
    else:                   # biases
        a = np.zeros(shape, np.float32)
    w.write(name, a.astype(np.float32))


def _write_fp4(w: SafetensorsWriter, name: str, shape, std: float, crng, srng) -> None:
    """Uniform random E2M1 codes (every byte is two valid codes) and UE8M0 scale bytes giving the
    weights a std of ``std``: each group's byte is b = floor(127 + log2(std / the codes' RMS)) or
    b + 1, the latter with the probability that makes the mean square scale the target's."""
    rows, cols = shape
    (_, row_bytes), (_, groups) = quant.fp4_shapes(rows, cols)
    total = rows * row_bytes
    for off in range(0, total, CHUNK_BYTES):
        n = min(CHUNK_BYTES, total - off)
        block = crng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]
        if cols % 2:                         # the odd column's padding nibble holds code 0
            last = np.arange((-(off + 1)) % row_bytes, n, row_bytes)
            block[last] &= 0x0F
        w.write(name, block, off)
    e = 127 + np.log2(std / _FP4_CODE_RMS)
    low = int(np.floor(e))
    frac = (4.0 ** (e - low) - 1) / 3        # (1 - p) s^2 + p (2 s)^2 = target^2
    srows = max(1, CHUNK_BYTES // groups)
    for r0 in range(0, rows, srows):
        r1 = min(rows, r0 + srows)
        b = low + (srng.random((r1 - r0) * groups, dtype=np.float32) < frac)
        w.write(name + ".qs", np.clip(b, 0, 254).astype(np.uint8), r0 * groups)


def _write_index_table(w: SafetensorsWriter, name: str, shape, span: int, rng) -> None:
    """int64 rows of shape[1] distinct random indices in 0..span-1."""
    rows, k = shape
    if k > span:
        raise ColiError(f"{name}: {k} distinct indices a row out of {span}")
    step = max(1, CHUNK_BYTES // (4 * span))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w.write(name, rng.random((r1 - r0, span), dtype=np.float32).argsort(axis=1)[:, :k].astype(np.int64),
                r0 * k * 8)


# --- the container ---------------------------------------------------------------------------------
def write_random_container(out: str | Path, config: dict, family, bits: int = 4, group_size: int = 64,
                           seed: int = 0, progress: Callable[[Progress], None] | None = None,
                           fp4_experts: bool = False) -> Path:
    """Write a random-weight container for ``config`` at ``out``; ``family`` (models.family_for:
    what reads the config into an ArchSpec) gives its layout: the tensors and their classes.
    ``fp4_experts``: the routed experts in FP4 (quant.FP4), as ``convert(..., fp4_experts=True)``.

    Rerunning with the same arguments on a finished container returns at once; on an interrupted
    one it resumes from the last complete shard. Other arguments on an existing container are
    refused. ``progress`` receives the converter's ``Progress`` (bytes of container data)."""
    out = Path(out)
    if bits not in (4, 8):
        raise ColiError(f"bits must be 4 or 8 for a random container, not {bits}")
    if group_size < 2 or group_size % 2:
        raise ColiError(f"group_size must be an even number >= 2, not {group_size}")
    if not isinstance(config, dict) or "model_type" not in config:
        raise ColiError("config must be a dict with a model_type")
    spec = family.spec(config)
    shards = _plan_spec(spec, bits, fp4_experts)
    config_text = json.dumps(config, indent=1, sort_keys=True) + "\n"
    params = {"bits": bits, "group_size": group_size, "converter_version": CONVERTER_VERSION,
              "source": "synthetic", "seed": int(seed), "generator_version": GENERATOR_VERSION,
              "config_crc32": zlib.crc32(config_text.encode())}
    if fp4_experts:                 # only where it matters, so older containers still verify
        params["fp4_experts"] = True
    gen = _Gen(group_size, seed, spec.num_layers, spec.layout.embed_name,
               tuple(dict.fromkeys(_RESIDUAL_OUT + (spec.layout.experts.parts[2] + ".weight",))),
               {n.name: n.index_range for n in _needs(spec) if n.index_range})

    def side_files(out: Path) -> None:
        (out / "config.json").write_text(config_text)
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")

    def write_tensor(w, o, report) -> None:
        _write_tensor(w, o, gen)
        report(SafetensorsWriter.planned_size(o.entries(group_size)))

    return write_container(
        out, params, shards, bits, group_size, config.get("model_type"), write_tensor=write_tensor,
        cost=lambda o: SafetensorsWriter.planned_size(o.entries(group_size)), finalize=side_files,
        progress=progress, floats=frozenset(n.name for n in _needs(spec) if n.float32),
        manifest_extra={"synthetic": {"seed": int(seed), "generator_version": GENERATOR_VERSION,
                                      "router_gain": ROUTER_GAIN,
                                      "note": "random weights: for benchmarks and tests, not a language model"},
                        **expert_entries(spec.layout)})


__all__ = ["write_random_container", "tensor_shapes", "plan", "container_bytes"]
