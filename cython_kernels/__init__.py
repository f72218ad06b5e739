"""Compiled int4 / int8 matmul kernels (see ``qmatmul.pyx``; formats in ``core.quant``).

Build in place with ``python setup.py build_ext --inplace`` (or ``pip install -e .``).
Importing this package raises ImportError when the extension has not been built, so callers
can fall back to the numpy references in ``core.quant``.
"""
try:
    from .qmatmul import (
        expert_swiglu,
        get_num_threads,
        int8_activations,
        openmp_enabled,
        q4_dequantize,
        q4_matmul,
        q4_matmul_many,
        q8_matmul,
        set_int8_activations,
        set_num_threads,
        set_simd,
        simd_level,
        simd_variants,
    )
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "cython_kernels.qmatmul is not built; run `python setup.py build_ext --inplace` "
        "or `pip install -e .` in the colibri checkout"
    ) from exc

__all__ = ["q4_matmul", "q4_dequantize", "q4_matmul_many", "q8_matmul", "expert_swiglu", "set_num_threads", "get_num_threads",
           "openmp_enabled", "simd_level", "simd_variants", "set_simd", "set_int8_activations",
           "int8_activations"]
