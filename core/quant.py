"""Quantization in colibrì's tensor convention, and the numpy reference math.

A quantized weight NAME of logical shape [O, I] is stored as U8 ``NAME`` plus F32 ``NAME.qs``:

* int4 grouped: ``NAME`` is [O, ceil(I/2)]; byte k holds element 2k in the low nibble and 2k+1
  in the high nibble; value = (nibble - 8) * s[o, i // gs]; ``NAME.qs`` is [O, ceil(I/gs)].
  s = max(absmax(group) / 7, 1e-8); q = clip(rint(w / s), -8, 7); the last group is zero-padded.
* int8 per row: ``NAME`` is [O, I] (bytes are two's-complement int8); ``NAME.qs`` is [O];
  value = q * s[o]; s = absmax(row) / 127.
* FP4 as shipped (``FP4``: releases whose routed experts are E2M1 with UE8M0 scales, MXFP4 too): ``NAME`` is U8
  [O, ceil(I/2)] of E2M1 codes, byte k holding element 2k in the low nibble and 2k+1 in the high
  one; ``NAME.qs`` is U8 [O, ceil(I/32)] of UE8M0 scales (see the FP4 section below).

All arithmetic is float32, so any implementation following these lines reproduces our bytes.
The functions here are the reference the Cython kernels are tested against.
"""
from __future__ import annotations

import numpy as np

from .errors import ColiError

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


# --- FP4: E2M1 codes with a UE8M0 scale per 32 (the source's bits, kept as they are) ---------------
# Releases ship them as ``X.weight`` I8 [O, I/2] + ``X.scale`` F8_E8M0 [O, I/32], or (compressed-
# tensors mxfp4) as ``weight_packed`` U8 [O, I/2] + ``weight_scale`` U8 [O, I/32]. Both are this
# one encoding: a converter copies the weight bytes to U8 ``NAME`` and the
# scale bytes to U8 ``NAME.qs`` unchanged (``check_fp4`` first). A code's bit 3 is the sign, bits
# 0-2 index the magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; a scale byte b is 2^(b - 127), b = 255 NaN.
# value = E2M1[code] * 2^(b - 127) in float32: exact whenever it is finite (a power-of-two times a
# two-bit significand; 2^-128 is a float32 subnormal), +-inf past float32's range (codes >= 4 at
# b >= 253), as float32 / bfloat16 arithmetic upstream gives. A row whose I is not a multiple of 32
# ends in a partial group (the padding nibble of an odd I and the rest of the group hold nothing:
# ignored by the decoder and the kernels, written as code 0 by the encoder).
FP4 = "fp4_e2m1_ue8m0"
FP4_GROUP = 32
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
UE8M0_NAN = 255
# every scale byte's value (2^(b - 127), float32; b = 0 gives the subnormal 2^-127)
UE8M0 = np.append(np.ldexp(np.float32(1.0), np.arange(-127, 128)).astype(np.float32), np.float32(np.nan))


def fp4_shapes(rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of (codes, scale bytes) for a logical [rows, cols] FP4 tensor."""
    return (rows, (cols + 1) // 2), (rows, -(-cols // FP4_GROUP))


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[O, I] float -> (codes uint8 [O, ceil(I/2)], scale bytes uint8 [O, ceil(I/32)]).

    Per group of 32: the smallest power of two s with amax / s <= 6 (s = 2^ceil(log2(amax / 6)),
    amax / 6 in float32, as ue8m0 scales round up; clamped to 2^-127..2^127; an all-zero
    group gets 2^0), then each w / s (exact) to the nearest E2M1 magnitude, ties to the even code
    (round-to-nearest-even of the one mantissa bit), the sign from w's sign bit. Tests and
    synthetic containers use it; shipped FP4 is copied, never re-encoded."""
    w = np.asarray(w, dtype=np.float32)
    if not np.isfinite(w).all():
        raise ValueError("quantize_fp4: the weights hold NaN or inf")
    rows, cols = w.shape
    groups = -(-cols // FP4_GROUP)
    g = np.zeros((rows, groups * FP4_GROUP), np.float32)
    g[:, :cols] = w
    g = g.reshape(rows, groups, FP4_GROUP)
    amax = np.abs(g).max(axis=2)
    m, e = np.frexp(amax / np.float32(6.0))
    e = np.where(m == 0.5, e - 1, e)                  # ceil(log2): an exact power of two keeps e - 1
    e = np.where(amax == 0, 0, np.clip(e, -127, 127)).astype(np.int32)
    a = np.abs(g) * np.ldexp(np.float32(1.0), -e)[:, :, None].astype(np.float32)   # exact unless tiny
    idx = ((a > 0.25).astype(np.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
           + (a >= 3.5) + (a > 5.0)).astype(np.uint8)  # ties: .25, 1.25, 2.5, 5 down; .75, 1.75, 3.5 up
    codes = (idx | (np.signbit(g).astype(np.uint8) << 3)).reshape(rows, groups * FP4_GROUP)[:, :cols]
    if cols % 2:
        codes = np.concatenate([codes, np.zeros((rows, 1), np.uint8)], axis=1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(packed), (e + 127).astype(np.uint8)


def dequantize_fp4(packed: np.ndarray, scales: np.ndarray, cols: int) -> np.ndarray:
    """Exact float32 [O, cols] of FP4 codes and scale bytes (E2M1[code] * 2^(b - 127))."""
    packed = np.asarray(packed).view(np.uint8)
    rows = packed.shape[0]
    codes = np.empty((rows, packed.shape[1] * 2), np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    s = np.repeat(UE8M0[np.asarray(scales).view(np.uint8)], FP4_GROUP, axis=1)[:, :cols]
    with np.errstate(over="ignore"):          # +-inf past float32's range is the value
        return E2M1[codes[:, :cols]] * s


def matmul_fp4_ref(x: np.ndarray, packed: np.ndarray, scales: np.ndarray, cols: int) -> np.ndarray:
    """Reference y = x @ W.T for FP4 W (numpy's sum order; the kernels' is in qmatmul.fp4_matmul)."""
    return np.asarray(x, dtype=np.float32) @ dequantize_fp4(packed, scales, cols).T


def fp4_layout_error(rows: int, cols: int, codes: tuple, scales: tuple) -> str | None:
    """Why stored (dtype, shape) pairs of codes and scale bytes do not hold an [rows, cols] FP4
    tensor, or None. Dtypes: U8 (ours, compressed-tensors), I8 (a release's codes), F8_E8M0
    (a release's scales) -- bytes all."""
    want_c, want_s = fp4_shapes(rows, cols)
    (cd, cs), (sd, ss) = codes, scales
    if cd not in ("U8", "I8") or tuple(cs) != want_c:
        return f"codes are {cd} {list(cs)}, [{rows}, {cols}] needs U8 {list(want_c)} (two a byte)"
    if sd not in ("U8", "F8_E8M0") or tuple(ss) != want_s:
        return f"scales are {sd} {list(ss)}, [{rows}, {cols}] needs U8 {list(want_s)} (one per 32)"
    return None


def check_fp4(name: str, packed: np.ndarray, scales: np.ndarray, cols: int,
              dtypes: tuple[str, str] = ("U8", "U8"), row0: int = 0) -> None:
    """Refuse a malformed FP4 pair with one line naming ``name``: codes [O, ceil(I/2)], scales
    [O, ceil(I/32)], no NaN scale (byte 255). The converter calls it on the source's bytes, the
    container on every FP4 tensor it reads."""
    why = fp4_layout_error(packed.shape[0], cols, (dtypes[0], packed.shape), (dtypes[1], scales.shape))
    if why is not None:
        raise ColiError(f"FP4 tensor {name}: {why}")
    bad = np.flatnonzero(np.asarray(scales).view(np.uint8).reshape(-1) == UE8M0_NAN)
    if bad.size:
        r, g = divmod(int(bad[0]), scales.shape[1])
        raise ColiError(f"FP4 tensor {name}: scale byte 255 (NaN) at row {row0 + r}, group {g} "
                        f"({bad.size} such)")


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
