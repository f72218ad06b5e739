"""Quantization in colibrì's tensor convention, and the numpy reference math.

A quantized weight NAME of logical shape [O, I] is stored as U8 ``NAME`` plus F32 ``NAME.qs``:

* int4 grouped: ``NAME`` is [O, ceil(I/2)]; byte k holds element 2k in the low nibble and 2k+1
  in the high nibble; value = (nibble - 8) * s[o, i // gs]; ``NAME.qs`` is [O, ceil(I/gs)].
  s = max(absmax(group) / 7, 1e-8); q = clip(rint(w / s), -8, 7); the last group is zero-padded.
* int8 per row: ``NAME`` is [O, I] (bytes are two's-complement int8); ``NAME.qs`` is [O];
  value = q * s[o]; s = absmax(row) / 127.

All arithmetic is float32, so any implementation following these lines reproduces our bytes.
The functions here are the reference the Cython kernels are tested against.
"""
from __future__ import annotations

import numpy as np

INT4_MIN_SCALE = np.float32(1e-8)


def int4_shapes(rows: int, cols: int, group_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of (packed weight, scales) for a logical [rows, cols] int4 tensor."""
    return (rows, (cols + 1) // 2), (rows, -(-cols // group_size))


def quantize_int4(w: np.ndarray, group_size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """[O, I] float -> (packed uint8 [O, ceil(I/2)], scales float32 [O, ceil(I/gs)])."""
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group size must be even and >= 2, got {group_size}")
    w = np.asarray(w, dtype=np.float32)
    rows, cols = w.shape
    groups = -(-cols // group_size)
    padded = np.zeros((rows, groups * group_size), dtype=np.float32)
    padded[:, :cols] = w
    g = padded.reshape(rows, groups, group_size)
    scales = np.maximum(np.abs(g).max(axis=2) / np.float32(7.0), INT4_MIN_SCALE).astype(np.float32)
    q = np.clip(np.rint(g / scales[:, :, None]), -8, 7).astype(np.int8)
    nibbles = (q.reshape(rows, groups * group_size)[:, :cols] + 8).astype(np.uint8)
    if cols % 2:
        nibbles = np.concatenate([nibbles, np.full((rows, 1), 8, dtype=np.uint8)], axis=1)
    packed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(packed), scales


def dequantize_int4(packed: np.ndarray, scales: np.ndarray, cols: int, group_size: int = 64) -> np.ndarray:
    """Inverse of :func:`quantize_int4`: float32 [O, cols]."""
    rows = packed.shape[0]
    nib = np.empty((rows, packed.shape[1] * 2), dtype=np.int8)
    nib[:, 0::2] = (packed & 0x0F).astype(np.int8) - 8
    nib[:, 1::2] = (packed >> 4).astype(np.int8) - 8
    nib = nib[:, :cols].astype(np.float32)
    s = np.repeat(np.asarray(scales, dtype=np.float32), group_size, axis=1)[:, :cols]
    return nib * s


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[O, I] float -> (int8 values viewed as uint8 [O, I], scales float32 [O])."""
    w = np.asarray(w, dtype=np.float32)
    scales = (np.abs(w).max(axis=1) / np.float32(127.0)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1.0))
    q = np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8)
    return np.ascontiguousarray(q.view(np.uint8)), scales


def dequantize_int8(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return np.asarray(q).view(np.int8).astype(np.float32) * np.asarray(scales, dtype=np.float32)[:, None]


def matmul_int4_ref(x: np.ndarray, packed: np.ndarray, scales: np.ndarray, cols: int,
                    group_size: int = 64) -> np.ndarray:
    """Reference y = x @ W.T for int4 W; x [T, cols] -> [T, O]."""
    return np.asarray(x, dtype=np.float32) @ dequantize_int4(packed, scales, cols, group_size).T


def matmul_int8_ref(x: np.ndarray, q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32) @ dequantize_int8(q, scales).T


# --- which scheme each tensor gets at conversion -------------------------------------------------
# A tensor's class is its family's to say (core.layout.Layout.tensor_class); this is the default
# it starts from. colibrì's defaults: routed/shared experts and attention (every other 2-D weight)
# at int4 gs64, embeddings and the head int8 per row, norms, routers, gates and biases F32.
# ``--bits 8`` puts the int4 class at int8; ``--bits 16`` quantizes nothing and keeps every source
# dtype. A router or a gate (a matrix named ``...gate`` / ``...router``, never ``gate_proj``)
# decides which experts run, or how much of a branch passes: it stays F32.
F32, INT8, INT4, KEEP = "f32", "int8", "int4", "keep"
INT8_PARTS = ("embed_tokens", "lm_head")


def default_class(name: str, ndim: int, f32: tuple[str, ...] = (),
                  int8: tuple[str, ...] = INT8_PARTS) -> str:
    """'f32' | 'int8' | 'int4' for one tensor: ``f32`` names (suffixes) a family keeps F32 besides
    norms, routers and gates; ``int8``, parts of the names of its embedding and head."""
    module = name.rsplit(".", 2)[-2] if "." in name else name
    if ndim != 2 or name.endswith(f32) or "norm" in module or module.endswith(("gate", "router")):
        return F32
    if any(part in name for part in int8):
        return INT8
    return INT4


def scheme_at(cls: str, bits: int) -> str:
    """The scheme a tensor of class ``cls`` is stored in at ``--bits``."""
    if bits == 16:
        return KEEP
    return INT8 if cls == INT4 and bits == 8 else cls


def scheme_for(name: str, ndim: int, bits: int, f32: tuple[str, ...] = ()) -> str:
    """'int4' | 'int8' | 'f32' | 'keep' for one source tensor of the default class."""
    return scheme_at(default_class(name, ndim, f32), bits)
