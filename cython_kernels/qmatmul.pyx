# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True, nonecheck=False
"""Quantized matmul kernels (int4 grouped, int8 per row), OpenMP-parallel over output rows.

Formats are those of ``core.quant``. The hot loops live in ``qkern.h`` (C), in SIMD variants
chosen at run time: ``avx512`` (AVX-512 F/BW/VL), ``avx2`` (AVX2 + FMA) and ``portable`` (plain C,
auto-vectorized by the compiler; the only variant off x86 or with MSVC). ``simd_level()`` names
the variant in use, ``simd_variants()`` those this CPU runs, ``set_simd(name)`` forces one
("auto" restores the best). The build targets baseline x86-64 (never -march=native): the wider
variants are compiled per function and picked with the CPU's feature flags.

Guarantees, per variant: every output row is computed by exactly one thread, in an order that
depends only on the shapes, so results are bit-identical for any number of threads, run to run,
and between decode (T == 1) and prefill (T > 1) of the same row. Variants sum in different orders
(and the SIMD ones use fused multiply-adds), so they agree with each other and with the numpy
reference (core.quant) to float32 rounding (~1e-6 relative), not bit for bit. Activations stay
float32: weights are widened to float, never x narrowed -- unless the opt-in int8-activation path
is switched on (``set_int8_activations``; off by default; ~0.5 % rms error). See qkern.h for the
summation order. ``expert_swiglu`` runs a whole SwiGLU expert (gate and up in one pass).
``swiglu_one`` runs the routed experts of one decode row in one call. numpy's C API is used only
there, to read array pointers without the buffer protocol's per-array cost.
"""
from cython.parallel cimport prange, threadid
from libc.stdlib cimport malloc, free
from libc.stdint cimport uint8_t, int8_t, int32_t

import numpy as np
cimport numpy as cnp

cnp.import_array()

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    static int coli_openmp_enabled(void) { return 1; }
    static int coli_max_threads(void) { return omp_get_max_threads(); }
    #else
    static int coli_openmp_enabled(void) { return 0; }
    static int coli_max_threads(void) { return 1; }
    #endif
    """
    int coli_openmp_enabled() noexcept nogil
    int coli_max_threads() noexcept nogil

cdef extern from "qkern.h":
    ctypedef Py_ssize_t coli_idx
    int COLI_PORTABLE, COLI_AVX2, COLI_AVX512, COLI_NLEVELS, COLI_GINIT
    const char* coli_level_names[]
    int coli_simd_supported(int level) noexcept nogil
    int coli_simd_best() noexcept nogil
    int coli_q4_cb(int level, coli_idx gs) noexcept nogil
    coli_idx coli_q4_gstride(coli_idx gs) noexcept nogil
    coli_idx coli_decode_rows(coli_idx rows, int nt) noexcept nogil
    int coli_q4_level(int level, coli_idx gs) noexcept nogil
    void coli_q4_prep(int cb, const float* x, coli_idx T, coli_idx cols, coli_idx gs,
                      coli_idx ng, float* xp, float* ginit) noexcept nogil
    size_t coli_q4_scratch_floats(int lv, coli_idx T, coli_idx rb, coli_idx L) noexcept nogil
    void coli_q4_rows(int lv, const uint8_t* w, const float* s, const float* xp, const float* gi,
                      float* y, float* U, coli_idx r0, coli_idx r1, coli_idx T, coli_idx O,
                      coli_idx nb, coli_idx ng, coli_idx gs) noexcept nogil
    int coli_q4i8_ok(int level, coli_idx gs) noexcept nogil
    void coli_q4i8_prep(const float* x, coli_idx T, coli_idx cols, coli_idx L, int8_t* xq,
                        float* xd, int32_t* xc) noexcept nogil
    void coli_q4i8_rows(const uint8_t* w, const float* s, const int8_t* xq, const float* xd,
                        const int32_t* xc, float* y, coli_idx r0, coli_idx r1, coli_idx T,
                        coli_idx O, coli_idx nb, coli_idx ng, coli_idx gs) noexcept nogil
    void coli_q4_dequant_rows(const uint8_t* w, const float* s, float* W, coli_idx r0,
                              coli_idx r1, coli_idx cols, coli_idx nb, coli_idx ng,
                              coli_idx gs) noexcept nogil
    coli_idx coli_q8_block(int level) noexcept nogil
    int coli_q8_multirow
    int coli_q4_multirow
    void coli_q8_prep(const float* x, coli_idx T, coli_idx cols, coli_idx Lp, float* xp) noexcept nogil
    size_t coli_q8_scratch_floats(int level, coli_idx T, coli_idx Lp) noexcept nogil
    void coli_q8_rows(int level, const int8_t* w, const float* s, const float* xp, float* y,
                      float* U, coli_idx r0, coli_idx r1, coli_idx T, coli_idx O, coli_idx cols,
                      coli_idx Lp) noexcept nogil

cdef int _num_threads = 0   # 0: OpenMP default (omp_get_max_threads, i.e. OMP_NUM_THREADS)
cdef int _level = coli_simd_best()
cdef bint _int8_act = False


def openmp_enabled():
    """True when the extension was compiled with OpenMP."""
    return bool(coli_openmp_enabled())


def set_num_threads(int n):
    """Threads used by the kernels; n <= 0 restores the OpenMP default."""
    global _num_threads
    _num_threads = n if n > 0 else 0


def get_num_threads():
    """Threads the kernels will use (always 1 without OpenMP)."""
    if not coli_openmp_enabled():
        return 1
    return _num_threads if _num_threads > 0 else coli_max_threads()


def simd_variants():
    """Names of the SIMD variants this CPU can run, best last (always starts with 'portable')."""
    return [coli_level_names[l].decode() for l in range(COLI_NLEVELS) if coli_simd_supported(l)]


def simd_level():
    """Name of the SIMD variant the kernels use now."""
    return coli_level_names[_level].decode()


def set_simd(name):
    """Force a SIMD variant ('portable', 'avx2', 'avx512' on x86-64; 'portable', 'neon' on
    arm64), or 'auto' for the best this CPU runs.

    Raises ValueError for an unknown name or a variant this CPU (or this build) cannot run.
    Meant for tests and benchmarks; not thread-safe against kernels running concurrently.
    """
    global _level
    if name == "auto":
        _level = coli_simd_best()
        return
    for l in range(COLI_NLEVELS):
        if coli_level_names[l].decode() == name:
            if not coli_simd_supported(l):
                raise ValueError(f"SIMD variant {name!r} is not supported on this CPU/build "
                                 f"(supported: {', '.join(simd_variants())})")
            _level = l
            return
    raise ValueError(f"unknown SIMD variant {name!r} (expected 'auto' or one of "
                     f"{[coli_level_names[l].decode() for l in range(COLI_NLEVELS)]})")


def set_int8_activations(bint on):
    """Opt-in fast path (off by default): int4 products quantize x to int8 (per 32 elements,
    scale absmax / 127) and use integer dot products (AVX2 maddubs), ~2-3x less work per weight.

    Accuracy cost: x carries ~0.4 % relative rounding (uniform, +-0.5 / 127 of each 32-block's
    absmax), so outputs are off by ~0.1-0.5 % of their magnitude instead of ~1e-6 (measured in
    benchmarks/README.md); logits change, greedy text usually does not. Applies only where it
    exists: the avx2 / avx512 variants and group sizes that are multiples of 64; elsewhere (and
    for int8 weights) the float32 path runs. Deterministic and thread-count independent like the
    float path; decode and prefill give the same bits.
    """
    global _int8_act
    _int8_act = on


def _set_q8_multirow(bint on):
    """Benchmarks and bit tests only: False runs int8 decode through the one-row loops (the kernel
    before the multi-row one, same bits). Returns the previous setting."""
    global coli_q8_multirow
    cdef bint old = coli_q8_multirow != 0
    coli_q8_multirow = 1 if on else 0
    return old


def _set_q4_multirow(bint on):
    """Benchmarks and bit tests only: False runs AVX-512 int4 decode through the one-row loop (the
    kernel before the two-row one, same bits). Returns the previous setting."""
    global coli_q4_multirow
    cdef bint old = coli_q4_multirow != 0
    coli_q4_multirow = 1 if on else 0
    return old


def int8_activations():
    """True when the opt-in int8-activation path for int4 weights is on."""
    return bool(_int8_act)


cdef int _threads_for(Py_ssize_t rows):
    cdef int nt = get_num_threads()
    if nt > rows:
        nt = <int>rows
    return nt if nt > 0 else 1


cdef inline Py_ssize_t _up(Py_ssize_t n, Py_ssize_t m) noexcept nogil:
    return (n + m - 1) // m * m


cdef void* _amalloc(size_t n) noexcept nogil:
    """n bytes aligned to 64 (a cache line; free with _afree). The kernels read x in 32-byte
    vectors: from malloc's 16-byte alignment every other one straddled two cache lines, which
    cost the int8 kernel 15-20 % depending on where the buffer happened to land."""
    cdef char* p = <char*>malloc(n + 64 + sizeof(void*))
    cdef size_t a
    if p == NULL:
        return NULL
    a = (<size_t>(p + sizeof(void*)) + 63) & ~(<size_t>63)
    (<void**>a - 1)[0] = p     # the block malloc returned, just before
    return <void*>a


cdef void _afree(void* q) noexcept nogil:
    if q != NULL:
        free((<void**>q - 1)[0])


# --- int4 -------------------------------------------------------------------------------------

cdef inline Py_ssize_t _owner(const Py_ssize_t* bstart, int nmat, Py_ssize_t b) noexcept nogil:
    """The matrix whose row blocks include global block b (bstart: first block of each)."""
    cdef int m = nmat - 1
    while bstart[m] > b:
        m -= 1
    return m


cdef int _q4_run(const float* x, Py_ssize_t Tx, Py_ssize_t cols, Py_ssize_t gs, int nmat,
                 const uint8_t** ws, const float** ss, float** ys, Py_ssize_t* Os,
                 const Py_ssize_t* t0s, const Py_ssize_t* Ts) except -1:
    """y_m = x[t0s[m] : t0s[m] + Ts[m]] @ dequant(W_m).T for nmat int4 matrices with the same cols
    and group size: x (Tx rows) is laid out once and one parallel loop runs over the row blocks of
    every matrix (gate and up of an expert, q/k/v of a layer, or all the experts of a MoE layer).
    Each output row is computed by exactly the code a single-matrix call runs: grouping never
    changes the bits."""
    cdef Py_ssize_t nb = (cols + 1) // 2
    cdef Py_ssize_t ng = (cols + gs - 1) // gs
    cdef Py_ssize_t L = ng * gs
    cdef int lv = coli_q4_level(_level, gs)
    cdef int cb = coli_q4_cb(_level, gs)
    cdef Py_ssize_t b, r0, r1, O, T, nblk = 0, rows = 0, tmax = 1, per, gst = coli_q4_gstride(gs)
    cdef Py_ssize_t rbm, rbd, rbp = max(1, min(16, (256 * 1024) // (4 * L)))
    cdef int m, nt
    for m in range(nmat):
        rows += Os[m]
        tmax = max(tmax, Ts[m])
    nt = _threads_for(rows)
    if _int8_act and coli_q4i8_ok(_level, gs):
        return _q4i8_run(x, Tx, cols, gs, nmat, ws, ss, ys, Os, t0s, Ts, nt, coli_decode_rows(rows, nt))
    cdef Py_ssize_t* bstart = <Py_ssize_t*>malloc(<size_t>(2 * nmat + 1) * sizeof(Py_ssize_t))
    if bstart == NULL:
        raise MemoryError()
    cdef Py_ssize_t* rb = bstart + nmat
    # rows per block: prefill keeps a block of unpacked rows (<= ~256 KiB) in L2 while the token
    # blocks stream over it; decode: see coli_decode_rows (qkern.h)
    rbd = coli_decode_rows(rows, nt)
    for m in range(nmat):
        rb[m] = rbd if Ts[m] == 1 else rbp
        bstart[m] = nblk
        nblk += (Os[m] + rb[m] - 1) // rb[m] if Ts[m] > 0 else 0
    bstart[2 * nmat] = nblk
    rbm = rbd if tmax == 1 else rbp
    per = _up(coli_q4_scratch_floats(lv, tmax, rbm, L), 16)   # floats per thread
    cdef float* xp = <float*>_amalloc(<size_t>(Tx * L) * sizeof(float))
    cdef float* gi = <float*>_amalloc(<size_t>(Tx * ng * gst) * sizeof(float))
    cdef float* base = <float*>_amalloc(<size_t>(nt * per) * sizeof(float))
    if xp == NULL or gi == NULL or base == NULL:
        _afree(xp)
        _afree(gi)
        _afree(base)
        free(bstart)
        raise MemoryError()
    try:
        coli_q4_prep(cb, x, Tx, cols, gs, ng, xp, gi)
        for b in prange(nblk, nogil=True, num_threads=nt, schedule="dynamic"):
            m = <int>_owner(bstart, nmat, b)
            r0 = (b - bstart[m]) * rb[m]
            O = Os[m]
            T = Ts[m]
            r1 = r0 + rb[m]
            if r1 > O:
                r1 = O
            coli_q4_rows(lv, ws[m], ss[m], xp + t0s[m] * L, gi + t0s[m] * ng * gst, ys[m],
                         base + threadid() * per, r0, r1, T, O, nb, ng, gs)
    finally:
        _afree(base)
        _afree(gi)
        _afree(xp)
        free(bstart)
    return 0


cdef int _q4i8_run(const float* x, Py_ssize_t Tx, Py_ssize_t cols, Py_ssize_t gs, int nmat,
                   const uint8_t** ws, const float** ss, float** ys, Py_ssize_t* Os,
                   const Py_ssize_t* t0s, const Py_ssize_t* Ts, int nt, Py_ssize_t rb) except -1:
    """The opt-in int8-activation path of _q4_run (gs % 64 == 0, AVX2 / AVX-512); rb rows per
    block."""
    cdef Py_ssize_t nb = (cols + 1) // 2
    cdef Py_ssize_t ng = (cols + gs - 1) // gs
    cdef Py_ssize_t L = ng * gs
    cdef Py_ssize_t b, r0, r1, O, nblk = 0
    cdef Py_ssize_t d8 = (L // 64) * 8
    cdef int m
    cdef Py_ssize_t* bstart = <Py_ssize_t*>malloc(<size_t>(nmat + 1) * sizeof(Py_ssize_t))
    cdef int8_t* xq = <int8_t*>_amalloc(<size_t>(Tx * L + 64))
    cdef float* xd = <float*>_amalloc(<size_t>(Tx * d8) * sizeof(float))
    cdef int32_t* xc = <int32_t*>_amalloc(<size_t>(Tx * d8) * sizeof(int32_t))
    if xq == NULL or xd == NULL or xc == NULL or bstart == NULL:
        _afree(xq)
        _afree(xd)
        _afree(xc)
        free(bstart)
        raise MemoryError()
    for m in range(nmat):
        bstart[m] = nblk
        nblk += (Os[m] + rb - 1) // rb if Ts[m] > 0 else 0
    try:
        coli_q4i8_prep(x, Tx, cols, L, xq, xd, xc)
        for b in prange(nblk, nogil=True, num_threads=nt, schedule="dynamic"):
            m = <int>_owner(bstart, nmat, b)
            r0 = (b - bstart[m]) * rb
            O = Os[m]
            r1 = r0 + rb
            if r1 > O:
                r1 = O
            coli_q4i8_rows(ws[m], ss[m], xq + t0s[m] * L, xd + t0s[m] * d8, xc + t0s[m] * d8,
                           ys[m], r0, r1, Ts[m], O, nb, ng, gs)
    finally:
        _afree(xc)
        _afree(xd)
        _afree(xq)
        free(bstart)
    return 0


cdef int _q4_impl(const float[:, ::1] x, const unsigned char[:, ::1] w, const float[:, ::1] s,
                  float[:, ::1] y, Py_ssize_t cols, Py_ssize_t gs) except -1:
    cdef const uint8_t* ws[1]
    cdef const float* ss[1]
    cdef float* ys[1]
    cdef Py_ssize_t Os[1]
    cdef Py_ssize_t t0s[1]
    cdef Py_ssize_t Ts[1]
    ws[0] = &w[0, 0]
    ss[0] = &s[0, 0]
    ys[0] = &y[0, 0]
    Os[0] = w.shape[0]
    t0s[0] = 0
    Ts[0] = x.shape[0]
    return _q4_run(&x[0, 0], x.shape[0], cols, gs, 1, ws, ss, ys, Os, t0s, Ts)


cdef int _q4_pair(const float[:, ::1] x, const unsigned char[:, ::1] w0, const float[:, ::1] s0,
                  float[:, ::1] y0, const unsigned char[:, ::1] w1, const float[:, ::1] s1,
                  float[:, ::1] y1, Py_ssize_t cols, Py_ssize_t gs) except -1:
    cdef const uint8_t* ws[2]
    cdef const float* ss[2]
    cdef float* ys[2]
    cdef Py_ssize_t Os[2]
    cdef Py_ssize_t t0s[2]
    cdef Py_ssize_t Ts[2]
    ws[0] = &w0[0, 0]
    ss[0] = &s0[0, 0]
    ys[0] = &y0[0, 0]
    Os[0] = w0.shape[0]
    ws[1] = &w1[0, 0]
    ss[1] = &s1[0, 0]
    ys[1] = &y1[0, 0]
    Os[1] = w1.shape[0]
    t0s[0] = t0s[1] = 0
    Ts[0] = Ts[1] = x.shape[0]
    return _q4_run(&x[0, 0], x.shape[0], cols, gs, 2, ws, ss, ys, Os, t0s, Ts)


cdef int _q4_many(const float[:, ::1] x, list mats, list outs, const Py_ssize_t[::1] t0,
                  const Py_ssize_t[::1] tn, Py_ssize_t cols, Py_ssize_t gs) except -1:
    """Pointers for _q4_run from Python lists of (w, s) pairs and outputs (validated by the
    caller); the lists keep the arrays alive for the call."""
    cdef int nmat = len(mats), m
    cdef const unsigned char[:, ::1] w
    cdef const float[:, ::1] s
    cdef float[:, ::1] y
    cdef void** p = <void**>malloc(<size_t>(3 * nmat) * sizeof(void*))
    cdef Py_ssize_t* Os = <Py_ssize_t*>malloc(<size_t>nmat * sizeof(Py_ssize_t))
    if p == NULL or Os == NULL:
        free(p)
        free(Os)
        raise MemoryError()
    try:
        for m in range(nmat):
            w = mats[m][0]
            s = mats[m][1]
            y = outs[m]
            p[m] = <void*>&w[0, 0]
            p[nmat + m] = <void*>&s[0, 0]
            p[2 * nmat + m] = <void*>&y[0, 0]
            Os[m] = w.shape[0]
        return _q4_run(&x[0, 0], x.shape[0], cols, gs, nmat, <const uint8_t**>p,
                       <const float**>(p + nmat), <float**>(p + 2 * nmat), Os, &t0[0], &tn[0])
    finally:
        free(Os)
        free(p)


# --- int8 -------------------------------------------------------------------------------------

cdef int _q8_impl(const float[:, ::1] x, const signed char[:, ::1] w, const float[::1] s,
                  float[:, ::1] y) except -1:
    cdef Py_ssize_t T = x.shape[0]
    cdef Py_ssize_t O = w.shape[0]
    cdef Py_ssize_t cols = w.shape[1]
    cdef int lv = _level
    cdef Py_ssize_t Lp = _up(cols, coli_q8_block(lv))
    cdef int nt = _threads_for(O)
    cdef Py_ssize_t rb = 64
    cdef Py_ssize_t nblk = (O + rb - 1) // rb
    cdef Py_ssize_t per = _up(coli_q8_scratch_floats(lv, T, Lp), 16)
    cdef Py_ssize_t b, r1
    cdef float* xp = <float*>_amalloc(<size_t>(T * Lp) * sizeof(float))
    cdef float* base = <float*>_amalloc(<size_t>(nt * per) * sizeof(float))
    if xp == NULL or base == NULL:
        _afree(xp)
        _afree(base)
        raise MemoryError()
    try:
        coli_q8_prep(&x[0, 0], T, cols, Lp, xp)
        for b in prange(nblk, nogil=True, num_threads=nt, schedule="dynamic"):
            r1 = b * rb + rb
            if r1 > O:
                r1 = O
            coli_q8_rows(lv, <const int8_t*>&w[0, 0], &s[0], xp, &y[0, 0],
                         base + threadid() * per, b * rb, r1, T, O, cols, Lp)
    finally:
        _afree(base)
        _afree(xp)
    return 0


# --- Python API -------------------------------------------------------------------------------

def _as_x(x):
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        return x.reshape(1, -1), True
    if x.ndim != 2:
        raise ValueError(f"x must be [T, cols] (or [cols]), got shape {x.shape}")
    return x, False


def _as_bytes(w, dtype, name):
    w = np.ascontiguousarray(w)
    if w.dtype.itemsize != 1 or w.dtype.kind not in "ui":
        raise TypeError(f"{name} must be uint8 or int8, got {w.dtype}")
    return w.view(dtype)


def _out(out, T, O, squeeze):
    shape = (O,) if squeeze else (T, O)
    if out is None:
        return np.empty(shape, dtype=np.float32)
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or not out.flags.c_contiguous
            or not out.flags.writeable or out.shape != shape):
        raise ValueError(f"out must be a writeable C-contiguous float32 array of shape {shape}")
    return out


def q4_matmul(x, w, s, int cols, int group_size, out=None):
    """y = x @ dequant(W).T for int4 grouped W.

    x: float32 [T, cols] (a 1-D [cols] gives a 1-D [O] result); w: uint8 [O, ceil(cols/2)];
    s: float32 [O, ceil(cols/group_size)]; out: optional float32 [T, O] to write into.
    Returns float32 [T, O].
    """
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be even and >= 2, got {group_size}")
    if cols < 0:
        raise ValueError(f"cols must be >= 0, got {cols}")
    x, squeeze = _as_x(x)
    w = _as_bytes(w, np.uint8, "w")
    s = np.ascontiguousarray(s, dtype=np.float32)
    nb = (cols + 1) // 2
    ng = (cols + group_size - 1) // group_size
    if x.shape[1] != cols:
        raise ValueError(f"x has {x.shape[1]} columns, expected cols={cols}")
    if w.ndim != 2 or w.shape[1] != nb:
        raise ValueError(f"w must be [O, {nb}] for cols={cols}, got shape {w.shape}")
    O = w.shape[0]
    if s.ndim != 2 or s.shape[0] != O or s.shape[1] != ng:
        raise ValueError(f"s must be [{O}, {ng}] for cols={cols}, group_size={group_size}, "
                         f"got shape {s.shape}")
    T = x.shape[0]
    y = _out(out, T, O, squeeze)
    if T == 0 or O == 0:
        return y
    if cols == 0:
        y[...] = 0
        return y
    _q4_impl(x, w, s, y.reshape(T, O), cols, group_size)
    return y


def q8_matmul(x, w, s, out=None):
    """y = x @ dequant(W).T for int8 per-row W.

    x: float32 [T, I] (a 1-D [I] gives a 1-D [O] result); w: int8 (or uint8 holding
    two's-complement int8) [O, I]; s: float32 [O]; out: optional float32 [T, O].
    Returns float32 [T, O].
    """
    x, squeeze = _as_x(x)
    w = _as_bytes(w, np.int8, "w")
    s = np.ascontiguousarray(s, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D [O, I], got shape {w.shape}")
    O, cols = w.shape
    if x.shape[1] != cols:
        raise ValueError(f"x has {x.shape[1]} columns, w has {cols}")
    if s.ndim != 1 or s.shape[0] != O:
        raise ValueError(f"s must be [{O}], got shape {s.shape}")
    T = x.shape[0]
    y = _out(out, T, O, squeeze)
    if T == 0 or O == 0:
        return y
    if cols == 0:
        y[...] = 0
        return y
    _q8_impl(x, w, s, y.reshape(T, O))
    return y


def _q4_args(w, s, cols, group_size, rows, name):
    """Validated (w uint8 [O, ceil(cols/2)], s float32 [O, ceil(cols/gs)]) for an int4 matrix."""
    w = _as_bytes(w, np.uint8, name)
    s = np.ascontiguousarray(s, dtype=np.float32)
    nb = (cols + 1) // 2
    ng = (cols + group_size - 1) // group_size
    if w.ndim != 2 or w.shape[1] != nb or (rows is not None and w.shape[0] != rows):
        want = f"[{rows if rows is not None else 'O'}, {nb}]"
        raise ValueError(f"{name} must be {want} for cols={cols}, got shape {w.shape}")
    if s.ndim != 2 or s.shape[0] != w.shape[0] or s.shape[1] != ng:
        raise ValueError(f"{name} scales must be [{w.shape[0]}, {ng}] for cols={cols}, "
                         f"group_size={group_size}, got shape {s.shape}")
    return w, s


def q4_matmul_many(x, mats, int cols, int group_size, rows=None, outs=None):
    """Several int4 products in one parallel pass: out_m = x[t0:t0+n] @ dequant(W_m).T.

    x: float32 [T, cols]; mats: list of (w uint8 [O_m, ceil(cols/2)], s float32 [O_m, ng]) with
    the same cols and group size; rows: optional list of (t0, n) per matrix (default: all of x);
    outs: optional list of float32 [n_m, O_m] arrays to write into. Returns the list of outputs.
    x is laid out once and one OpenMP loop covers the row blocks of every matrix -- q/k/v of a
    layer, or gate and up (then down) of all the experts a MoE layer routed to -- with the bits
    of separate ``q4_matmul`` calls.
    """
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be even and >= 2, got {group_size}")
    x, _ = _as_x(x)
    if x.shape[1] != cols or cols <= 0:
        raise ValueError(f"x has {x.shape[1]} columns, expected cols={cols} (> 0)")
    n = len(mats)
    T = x.shape[0]
    rows = [(0, T)] * n if rows is None else [(int(a), int(b)) for a, b in rows]
    if len(rows) != n or (outs is not None and len(outs) != n):
        raise ValueError("mats, rows and outs must have the same length")
    checked, res = [], []
    for m, (w, s) in enumerate(mats):
        t0, tn = rows[m]
        if t0 < 0 or tn < 0 or t0 + tn > T:
            raise ValueError(f"rows {t0}:{t0 + tn} are outside x's {T} rows")
        w, s = _q4_args(w, s, cols, group_size, None, f"mats[{m}]")
        checked.append((w, s))
        res.append(_out(None if outs is None else outs[m], tn, w.shape[0], False))
    live = [m for m in range(n) if rows[m][1] > 0 and checked[m][0].shape[0] > 0]
    if live and T > 0:
        t0s = np.array([rows[m][0] for m in live], dtype=np.intp)
        tns = np.array([rows[m][1] for m in live], dtype=np.intp)
        _q4_many(x, [checked[m] for m in live], [res[m] for m in live], t0s, tns, cols, group_size)
    return res


def q4_dequantize(w, s, int cols, int group_size, out=None, int threads=0):
    """float32 [O, cols] = (nibble - 8) * scale, in parallel over rows (the bits of
    core.quant.dequantize_int4). out: optional float32 [O, cols] to write into; threads: at
    most this many (0: the kernels' setting)."""
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be even and >= 2, got {group_size}")
    if cols <= 0:
        raise ValueError(f"cols must be > 0, got {cols}")
    w, s = _q4_args(w, s, cols, group_size, None, "w")
    W = _out(out, w.shape[0], cols, False)
    _q4_dequant(w, s, W, cols, group_size, threads)
    return W


cdef int _q4_dequant(const unsigned char[:, ::1] w, const float[:, ::1] s, float[:, ::1] W,
                     Py_ssize_t cols, Py_ssize_t gs, int threads) except -1:
    cdef Py_ssize_t O = w.shape[0], nb = w.shape[1], ng = s.shape[1], rb = 16, b, r1
    cdef Py_ssize_t nblk = (O + rb - 1) // rb
    cdef int nt = _threads_for(nblk)
    if 0 < threads < nt:
        nt = threads
    if O == 0:
        return 0
    for b in prange(nblk, nogil=True, num_threads=nt, schedule="static"):
        r1 = b * rb + rb
        if r1 > O:
            r1 = O
        coli_q4_dequant_rows(&w[0, 0], &s[0, 0], &W[0, 0], b * rb, r1, cols, nb, ng, gs)
    return 0


def expert_swiglu(x, gate_w, gate_s, up_w, up_s, down_w, down_s, int cols_in, int inter,
                  int group_size, out=None):
    """One SwiGLU expert on int4 weights: y = down(silu(gate(x)) * up(x)).

    x: float32 [T, cols_in] (or [cols_in] -> [H]); gate_w / up_w: uint8 [inter, ceil(cols_in/2)]
    with scales [inter, ceil(cols_in/gs)]; down_w: uint8 [H, ceil(inter/2)] with scales
    [H, ceil(inter/gs)]. Returns float32 [T, H] (or writes ``out``).

    Gate and up run in one parallel pass over x (laid out once); silu(g) = g * (1 / (1 + exp(-g)))
    in float32 numpy, exactly as core.engine. The result is bit-identical to
    ``q4_matmul(silu(q4_matmul(x, gate)) * q4_matmul(x, up), down)`` with the same settings.
    """
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be even and >= 2, got {group_size}")
    if cols_in <= 0 or inter <= 0:
        raise ValueError(f"cols_in and inter must be > 0, got {cols_in}, {inter}")
    x, squeeze = _as_x(x)
    if x.shape[1] != cols_in:
        raise ValueError(f"x has {x.shape[1]} columns, expected cols_in={cols_in}")
    gate_w, gate_s = _q4_args(gate_w, gate_s, cols_in, group_size, inter, "gate_w")
    up_w, up_s = _q4_args(up_w, up_s, cols_in, group_size, inter, "up_w")
    down_w, down_s = _q4_args(down_w, down_s, inter, group_size, None, "down_w")
    T = x.shape[0]
    H = down_w.shape[0]
    y = _out(out, T, H, squeeze)
    if T == 0 or H == 0:
        return y
    g = np.empty((T, inter), dtype=np.float32)
    u = np.empty((T, inter), dtype=np.float32)
    _q4_pair(x, gate_w, gate_s, g, up_w, up_s, u, cols_in, group_size)
    with np.errstate(over="ignore"):
        h = g * (np.float32(1.0) / (np.float32(1.0) + np.exp(-g)))
    h *= u
    _q4_impl(h, down_w, down_s, y.reshape(T, H), inter, group_size)
    return y


# --- decode: the routed experts of one row ------------------------------------------------------

cdef inline char* _arr2(object a, int typenum, Py_ssize_t d0, Py_ssize_t d1, int i, str what) except NULL:
    """Data pointer of a C-contiguous 2-D array of the given type and shape [d0, d1]."""
    cdef cnp.ndarray arr
    if not cnp.PyArray_Check(a):
        raise TypeError(f"experts[{i}]: {what} is not a numpy array")
    arr = <cnp.ndarray>a
    if (cnp.PyArray_NDIM(arr) != 2 or not cnp.PyArray_IS_C_CONTIGUOUS(arr)
            or (cnp.PyArray_TYPE(arr) != typenum and not (typenum == cnp.NPY_UINT8 and cnp.PyArray_TYPE(arr) == cnp.NPY_INT8))
            or cnp.PyArray_DIM(arr, 0) != d0 or cnp.PyArray_DIM(arr, 1) != d1):
        raise ValueError(f"experts[{i}]: {what} must be a C-contiguous "
                         f"{'uint8' if typenum == cnp.NPY_UINT8 else 'float32'} [{d0}, {d1}] array")
    return <char*>cnp.PyArray_DATA(arr)


def swiglu_one(x, list experts, int group_size, out, rows):
    """Decode's MoE block for one row: out[rows[i]] = down_i(silu(gate_i(x)) * up_i(x)).

    x: float32 [1, cols_in]; experts: list of int4 (gate_w, gate_s, up_w, up_s, down_w, down_s)
    with one group size (gate / up [inter, ...], down [H, ...]); out: float32 [k, H]; rows: the
    row of out for each expert. Gate and up of every expert run as one parallel pass, silu is the
    numpy float32 expression of core.kernels.silu (same bits), then every down as one pass: the
    bits of ``core.kernels.swiglu_many`` over the same experts, without its per-matrix Python work
    (~0.1 ms per layer, 2 ms of a 16-layer token).
    """
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be even and >= 2, got {group_size}")
    cdef int n = len(experts), i, k
    if not cnp.PyArray_Check(x) or not cnp.PyArray_Check(out):
        raise TypeError("x and out must be numpy arrays")
    cdef cnp.ndarray xa = <cnp.ndarray>x, oa = <cnp.ndarray>out
    if (cnp.PyArray_NDIM(xa) != 2 or cnp.PyArray_DIM(xa, 0) != 1 or cnp.PyArray_TYPE(xa) != cnp.NPY_FLOAT32
            or not cnp.PyArray_IS_C_CONTIGUOUS(xa)):
        raise ValueError("x must be a C-contiguous float32 [1, cols] array")
    if (cnp.PyArray_NDIM(oa) != 2 or cnp.PyArray_TYPE(oa) != cnp.NPY_FLOAT32
            or not cnp.PyArray_IS_C_CONTIGUOUS(oa) or not cnp.PyArray_ISWRITEABLE(oa)):
        raise ValueError("out must be a writeable C-contiguous float32 [k, H] array")
    if len(rows) != n:
        raise ValueError("experts and rows must have the same length")
    if len(set(rows)) != n:     # two experts writing one row would race between threads
        raise ValueError("rows must be distinct")
    if n == 0:
        return out
    cdef Py_ssize_t cols = cnp.PyArray_DIM(xa, 1), H = cnp.PyArray_DIM(oa, 1), kout = cnp.PyArray_DIM(oa, 0)
    first = experts[0]
    if not cnp.PyArray_Check(first[0]) or cnp.PyArray_NDIM(<cnp.ndarray>first[0]) != 2:
        raise ValueError("experts[0]: gate_w must be a 2-D numpy array")
    cdef Py_ssize_t inter = cnp.PyArray_DIM(<cnp.ndarray>first[0], 0)
    cdef Py_ssize_t nb_in = (cols + 1) // 2, ng_in = (cols + group_size - 1) // group_size
    cdef Py_ssize_t nb_mid = (inter + 1) // 2, ng_mid = (inter + group_size - 1) // group_size
    if cols <= 0 or inter <= 0 or H <= 0:
        raise ValueError("swiglu_one: empty shapes")
    cdef void** p = <void**>malloc(<size_t>(9 * n) * sizeof(void*))
    cdef Py_ssize_t* dims = <Py_ssize_t*>malloc(<size_t>(6 * n) * sizeof(Py_ssize_t))
    if p == NULL or dims == NULL:
        free(p)
        free(dims)
        raise MemoryError()
    # p: gate/up weights [2n] | gate/up scales [2n] | gate/up outputs [2n] | down w, s, out [3n]
    # dims: gate/up rows [2n] | gate/up t0 [2n] (zeros) | T = 1 per matrix [2n] (down reads n)
    cdef Py_ssize_t* Os = dims
    cdef Py_ssize_t* t0 = dims + 2 * n
    cdef Py_ssize_t* Ts = dims + 4 * n          # 2n ones (gate/up), the down pass reads n of them
    g = np.empty((2 * n, inter), np.float32)
    t = np.empty((n, inter), np.float32)
    cdef float* gp = <float*>cnp.PyArray_DATA(<cnp.ndarray>g)
    cdef float* outp = <float*>cnp.PyArray_DATA(oa)
    cdef Py_ssize_t* downO = <Py_ssize_t*>malloc(<size_t>(2 * n) * sizeof(Py_ssize_t))
    if downO == NULL:
        free(p)
        free(dims)
        raise MemoryError()
    cdef Py_ssize_t* downT0 = downO + n
    try:
        for i in range(n):
            e = experts[i]
            if len(e) != 6:
                raise ValueError(f"experts[{i}] must be (gate_w, gate_s, up_w, up_s, down_w, down_s)")
            k = rows[i]
            if not 0 <= k < kout:
                raise ValueError(f"rows[{i}] = {k} is outside out's {kout} rows")
            p[2 * i] = _arr2(e[0], cnp.NPY_UINT8, inter, nb_in, i, "gate_w")
            p[2 * n + 2 * i] = _arr2(e[1], cnp.NPY_FLOAT32, inter, ng_in, i, "gate_s")
            p[2 * i + 1] = _arr2(e[2], cnp.NPY_UINT8, inter, nb_in, i, "up_w")
            p[2 * n + 2 * i + 1] = _arr2(e[3], cnp.NPY_FLOAT32, inter, ng_in, i, "up_s")
            p[4 * n + 2 * i] = gp + i * inter                 # gate rows 0..n-1 of g
            p[4 * n + 2 * i + 1] = gp + (n + i) * inter       # up rows n..2n-1
            p[6 * n + i] = _arr2(e[4], cnp.NPY_UINT8, H, nb_mid, i, "down_w")
            p[7 * n + i] = _arr2(e[5], cnp.NPY_FLOAT32, H, ng_mid, i, "down_s")
            p[8 * n + i] = outp + k * H
            Os[2 * i] = Os[2 * i + 1] = inter
            t0[2 * i] = t0[2 * i + 1] = 0
            Ts[2 * i] = Ts[2 * i + 1] = 1
            downO[i] = H
            downT0[i] = i
        _q4_run(<const float*>cnp.PyArray_DATA(xa), 1, cols, group_size, 2 * n,
                <const uint8_t**>p, <const float**>(p + 2 * n), <float**>(p + 4 * n), Os, t0, Ts)
        # silu(g) * u with core.kernels.silu's float32 operations, in place
        gate, up = g[:n], g[n:]
        np.negative(gate, out=t)
        with np.errstate(over="ignore"):
            np.exp(t, out=t)
        np.add(_ONE, t, out=t)
        np.divide(_ONE, t, out=t)
        np.multiply(gate, t, out=t)
        np.multiply(t, up, out=t)
        _q4_run(<const float*>cnp.PyArray_DATA(<cnp.ndarray>t), n, inter, group_size, n,
                <const uint8_t**>(p + 6 * n), <const float**>(p + 7 * n), <float**>(p + 8 * n),
                downO, downT0, Ts)
    finally:
        free(downO)
        free(dims)
        free(p)
    return out


_ONE = np.float32(1.0)


# --- the per-layer operations around the products (rms_norm, rope_, attend_one, softmax_topk) ---
include "layer_ops.pxi"
include "mla_ops.pxi"
include "linear_ops.pxi"
include "kda_ops.pxi"
include "prefill.pxi"
include "dense.pxi"
include "fp4.pxi"


# --- positioned reads without the GIL, on every OS (fileio.h; core.fileio picks it where Python's
# os module has no preadv, i.e. on Windows) ---
cdef extern from "fileio.h":
    long long coli_pread(int fd, void* buf, long long n, long long offset, int* err) noexcept nogil


def pread_into(int fd, unsigned char[::1] view, long long offset):
    """Fill ``view`` from byte ``offset`` of the open descriptor ``fd``; returns the bytes read
    (fewer than ``len(view)`` only at end of file). The GIL is released during the read. Raises
    OSError on failure (with ``winerror`` set on Windows)."""
    cdef int err = 0
    cdef long long n = view.shape[0], got = 0
    if offset < 0:
        raise ValueError("negative offset")
    if n == 0:
        return 0
    with nogil:
        got = coli_pread(fd, &view[0], n, offset, &err)
    if got < 0:
        import os, sys
        if sys.platform == "win32":
            raise OSError(0, "ReadFile failed", None, err)   # winerror: Python maps it to errno
        raise OSError(err, os.strerror(err))
    return got
