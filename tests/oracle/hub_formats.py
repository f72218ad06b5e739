"""DeepSeek V4's release formats, in numpy: FP4 E2M1 routed experts and FP8 E4M3 block-scaled
matrices, both with UE8M0 (F8_E8M0) power-of-two scales; the dtype class of every tensor name
as the release ships it; a plain safetensors reader that knows F8_E8M0.

The generator encodes the oracle's tiny models with these (never with the engine's code) and
tests/test_oracle_dsv4.py decodes with them:

* FP4: ``X.weight`` I8 [O, I/2], two E2M1 codes a byte, the low nibble the even column; code
  bits s·e1e0·m (magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6); ``X.scale`` F8_E8M0 [O, I/32], one per
  32 consecutive inputs of a row. value = E2M1(code) · 2^(byte − 127).
* FP8: ``X.weight`` F8_E4M3 [O, I] (fn: bias 7, max 448, no inf); ``X.scale`` F8_E8M0
  [⌈O/128⌉, ⌈I/128⌉]. value = E4M3(byte) · 2^(scale byte − 127) of the weight's 128×128 block.

Encoding: the block's scale is the smallest power of two 2^e with amax / 2^e ≤ qmax (6 or 448;
e = ⌈log2(amax / qmax)⌉, as DeepSeek's and vLLM's ue8m0 quantizers round the scale up), then
every value goes to the nearest code, ties to the even code (torch's float8_e4m3fn cast does the
same for E4M3; the generator checks that they agree).
"""
from __future__ import annotations

import json
import os
import re

import numpy as np

from core.safetensors_io import _fp8_e4m3_table

FP4_BLOCK = 32
FP8_BLOCK = 128
FP4_MAX = 6.0
FP8_MAX = 448.0
# magnitude of E2M1 codes 0..7; codes 8..15 are the same negated
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_ALL = np.concatenate([E2M1, -E2M1]).astype(np.float32)
E4M3_POS = _fp8_e4m3_table()[:127]          # codes 0x00..0x7E: 0 .. 448, ascending

# --- which tensors the release stores how (names as DeepSeek writes them) -------------------
# FP8 + 128x128 scales: the attention projections, the indexer's query, the shared experts,
# the MTP block's own projections. FP4 + per-32 scales: the routed experts. F32: mHC, sinks,
# compressor position biases, router bias. I64: the hash table. Everything else BF16.
_FP4 = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_FP8 = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|\.ffn\.shared_experts\.w[123]"
                  r"|^mtp\.\d+\.[eh]_proj)\.weight$")
_F32 = re.compile(r"(^|\.)hc_|\.attn_sink$|\.ape$|\.gate\.bias$")
_I64 = re.compile(r"\.gate\.tid2eid$")


def hub_class(name: str) -> str:
    """'fp4' | 'fp8' | 'f32' | 'i64' | 'bf16' for one (weight) tensor name of the release."""
    for cls, pat in (("fp4", _FP4), ("fp8", _FP8), ("f32", _F32), ("i64", _I64)):
        if pat.search(name):
            return cls
    return "bf16"


def scale_name(weight_name: str) -> str:
    return weight_name[: -len(".weight")] + ".scale"


# --- encoders -------------------------------------------------------------------------------
def _pow2_exponent(amax: np.ndarray, qmax: float) -> np.ndarray:
    """Smallest e with amax / 2^e <= qmax (e = 0 for an all-zero block), as int."""
    x = np.asarray(amax, dtype=np.float64) / qmax
    m, k = np.frexp(np.where(x > 0, x, 1.0))                      # x = m·2^k, m in [0.5, 1)
    e = np.where(m == 0.5, k - 1, k)
    return np.where(x > 0, e, 0).astype(np.int64)


def _nearest_even(a: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest entry of the ascending non-negative ``table`` for each a >= 0, ties to
    the even index (the even code: codes count up with the magnitude)."""
    lo = np.clip(np.searchsorted(table, a, side="right") - 1, 0, len(table) - 2)
    d_lo, d_hi = a - table[lo], table[lo + 1] - a
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1))
    return np.where(a >= table[-1], len(table) - 1, lo + up)


def _blocks(shape: tuple[int, int], br: int, bc: int) -> tuple[int, int]:
    return -(-shape[0] // br), -(-shape[1] // bc)


def _expand(scale: np.ndarray, shape: tuple[int, int], br: int, bc: int) -> np.ndarray:
    return np.repeat(np.repeat(scale, br, axis=0), bc, axis=1)[: shape[0], : shape[1]]


def _block_amax(w: np.ndarray, br: int, bc: int) -> np.ndarray:
    nr, nc = _blocks(w.shape, br, bc)
    pad = np.zeros((nr * br, nc * bc), dtype=np.float64)
    pad[: w.shape[0], : w.shape[1]] = np.abs(w)
    return pad.reshape(nr, br, nc, bc).max(axis=(1, 3))


def encode_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [O, I] float32 -> (E4M3 bytes uint8 [O, I], UE8M0 bytes uint8 [⌈O/128⌉, ⌈I/128⌉])."""
    e = _pow2_exponent(_block_amax(w, FP8_BLOCK, FP8_BLOCK), FP8_MAX)
    x = np.asarray(w, np.float64) / np.ldexp(1.0, _expand(e, w.shape, FP8_BLOCK, FP8_BLOCK))
    code = _nearest_even(np.abs(x), E4M3_POS.astype(np.float64)).astype(np.uint8)
    code |= np.where(np.signbit(x), 0x80, 0).astype(np.uint8)
    return code, (e + 127).astype(np.uint8)


def encode_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [O, I] float32 (I a multiple of 32) -> (packed int8 [O, I/2], UE8M0 bytes uint8 [O, I/32])."""
    rows, cols = w.shape
    if cols % FP4_BLOCK:
        raise ValueError(f"FP4 needs the input size to be a multiple of {FP4_BLOCK}, got {cols}")
    e = _pow2_exponent(np.abs(w).reshape(rows, cols // FP4_BLOCK, FP4_BLOCK).max(-1), FP4_MAX)
    x = np.asarray(w, np.float64) / np.ldexp(1.0, np.repeat(e, FP4_BLOCK, axis=1))
    code = _nearest_even(np.abs(x), E2M1.astype(np.float64)).astype(np.uint8)
    code |= np.where(np.signbit(x), 8, 0).astype(np.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.view(np.int8), (e + 127).astype(np.uint8)


# --- decoders -------------------------------------------------------------------------------
def e8m0(scale: np.ndarray) -> np.ndarray:
    """UE8M0 bytes -> float32 2^(byte - 127) (0xFF, the NaN code, decodes to NaN)."""
    b = np.asarray(scale, dtype=np.uint8).astype(np.int64)
    return np.where(b == 255, np.nan, np.ldexp(1.0, b - 127)).astype(np.float32)


def decode_fp8(code: np.ndarray, scale: np.ndarray) -> np.ndarray:
    vals = _fp8_e4m3_table()[np.asarray(code, dtype=np.uint8)]
    return vals * _expand(e8m0(scale), vals.shape, FP8_BLOCK, FP8_BLOCK)


def decode_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    b = np.asarray(packed).view(np.uint8)
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[0], -1)
    return E2M1_ALL[codes] * np.repeat(e8m0(scale), FP4_BLOCK, axis=1)


# --- reading a checkpoint -------------------------------------------------------------------
_NP = {"F32": "<f4", "BF16": "<u2", "F8_E4M3": "u1", "F8_E8M0": "u1", "I8": "i1", "I64": "<i8"}


def read_raw(model_dir: str) -> dict[str, tuple[str, np.ndarray]]:
    """Every tensor of a checkpoint directory (one file or an index) as (dtype, stored array)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out: dict[str, tuple[str, np.ndarray]] = {}
    for fn in files:
        with open(os.path.join(model_dir, fn), "rb") as f:
            blob = f.read()
        n = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8: 8 + n])
        header.pop("__metadata__", None)
        for name, info in header.items():
            start, end = info["data_offsets"]
            arr = np.frombuffer(blob, dtype=_NP[info["dtype"]], count=(end - start) // np.dtype(_NP[info["dtype"]]).itemsize,
                                offset=8 + n + start)
            out[name] = (info["dtype"], arr.reshape(info["shape"]))
    return out


def dequantized(raw: dict[str, tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The weights exactly as the release means them: FP4 / FP8 times their UE8M0 scales, BF16
    widened, F32 and I64 as stored; the ``.scale`` companions consumed."""
    out = {}
    for name, (dtype, arr) in raw.items():
        if name.endswith(".scale"):
            continue
        if dtype == "I8":
            out[name] = decode_fp4(arr, raw[scale_name(name)][1])
        elif dtype == "F8_E4M3":
            out[name] = decode_fp8(arr, raw[scale_name(name)][1])
        elif dtype == "BF16":
            out[name] = (arr.astype(np.uint32) << 16).view(np.float32)
        else:
            out[name] = np.array(arr)
    return out
