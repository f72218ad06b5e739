import os as _os

# OpenBLAS (numpy's BLAS: a prefill's attention products) keeps its worker threads spinning for
# 2^28 cycles (~0.1 s) after every call; the kernels' OpenMP team that runs next (the prefill
# GEMM, the experts) then shares the cores with them: 2-thread prefill of the OLMoE geometry ran
# at 82-146 tok/s, 120-313 with a 2^4-cycle timeout (benchmarks/README.md, prefill GEMM). Speed
# only: the spin time changes no result. OpenBLAS reads it when it loads, so it is set here,
# before this package's modules import numpy; a user's own OPENBLAS_THREAD_TIMEOUT wins.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
