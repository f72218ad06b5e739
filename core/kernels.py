"""Matrix products over container weights: the compiled kernels, or the numpy reference.

``COLI_KERNELS=numpy`` forces the reference path (tests compare the two). If the compiled
extension is missing (a broken build), we fall back to numpy with a warning rather than fail.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from . import quant
from .container import Weight

_compiled = None
if os.environ.get("COLI_KERNELS", "").lower() != "numpy":
    try:
        from cython_kernels import qmatmul as _compiled
    except ImportError as e:  # pragma: no cover - depends on the build
        print(f"colibri: compiled kernels unavailable ({e}); using the slow numpy path",
              file=sys.stderr)


def backend() -> str:
    return "cython" if _compiled is not None else "numpy"


def default_threads() -> int:
    """Physical cores: decode is bandwidth-bound and SMT siblings only contend for it."""
    import psutil
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def set_threads(n: int | None) -> None:
    """Compute threads for the kernels (None: physical cores)."""
    if _compiled is not None:
        _compiled.set_num_threads(int(n) if n else default_threads())


def get_threads() -> int:
    return _compiled.get_num_threads() if _compiled is not None else 1


def openmp_enabled() -> bool:
    return bool(_compiled is not None and _compiled.openmp_enabled())


def matmul(x: np.ndarray, w: Weight) -> np.ndarray:
    """y = x @ W.T for x float32 [T, I]; returns float32 [T, O]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if w.scheme == "dense":
        return x @ w.data.T
    if w.scheme == "int4":
        cols = w.shape[1]
        if _compiled is not None:
            return _compiled.q4_matmul(x, w.data, w.scales, cols, w.group_size)
        return quant.matmul_int4_ref(x, w.data, w.scales, cols, w.group_size)
    if w.scheme == "int8":
        if _compiled is not None:
            return _compiled.q8_matmul(x, w.data, w.scales)
        return quant.matmul_int8_ref(x, w.data, w.scales)
    raise ValueError(f"unknown weight scheme {w.scheme}")


def rows(w: Weight, ids: np.ndarray) -> np.ndarray:
    """Rows of a matrix as float32 (embedding lookup)."""
    if w.scheme == "dense":
        return w.data[ids].astype(np.float32)
    if w.scheme == "int8":
        return quant.dequantize_int8(w.data[ids], w.scales[ids])
    if w.scheme == "int4":
        return quant.dequantize_int4(w.data[ids], w.scales[ids], w.shape[1], w.group_size)
    raise ValueError(f"unknown weight scheme {w.scheme}")


def vector(w: Weight) -> np.ndarray:
    if w.scheme != "dense":
        raise ValueError("expected an unquantized vector")
    return w.data.astype(np.float32, copy=False)
