# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True, nonecheck=False
"""Quantized matmul kernels (int4 grouped, int8 per row), OpenMP-parallel over output rows.

Formats are those of ``core.quant``. Every output row is computed by exactly one thread, in a
fixed order that depends neither on the thread count nor on T (decode and prefill give the same
bits per row), so results are bit-identical for any number of threads:

* decode (T == 1) reads the packed row directly; prefill (T > 1) unpacks the row to float
  (int4: ``nibble - 8``; int8: ``q``) once, into a thread-local buffer, and dots it with every
  x row, with the same arithmetic;
* sums run in 16 float32 lanes, in a fixed order (see the inner loops), folded by a fixed tree;
* int4: every group's lanes are scaled by s[o, g] and added to the row's lanes;
  int8: y = fold(lanes) * s[o].

No numpy C-API is used (numpy is imported only at Python level, to allocate outputs).
"""
from cython.parallel cimport prange, threadid
from libc.stdlib cimport malloc, free

import numpy as np

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

cdef enum:
    LANES = 16

cdef int _num_threads = 0   # 0: OpenMP default (omp_get_max_threads, i.e. OMP_NUM_THREADS)


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


# --- inner loops ------------------------------------------------------------------------------
# int4 rows are processed "de-interleaved": byte k of a row holds elements 2k (low nibble) and
# 2k+1 (high nibble); x is split once per call into xe[k] = x[2k] and xo[k] = x[2k+1] (xo is 0
# past an odd cols), so a byte's two products go to the same lane. Lane l of a group takes the
# bytes k with (k - first byte of the group) % LANES == l, in order (a last partial chunk is
# padded with zero weights and zero x, which adds exact zeros); each lane of the group is scaled
# and added to the row's lane; the row's lanes are folded by a fixed tree at the end.

cdef inline float _fold(float* acc) noexcept nogil:
    cdef Py_ssize_t l
    for l in range(8):
        acc[l] = acc[l] + acc[l + 8]
    for l in range(4):
        acc[l] = acc[l] + acc[l + 4]
    return (acc[0] + acc[2]) + (acc[1] + acc[3])


cdef inline void _q4_chunk(const unsigned char* w, const float* xe, const float* xo,
                           float* acc) noexcept nogil:
    """acc[l] += (lo(w[l]) - 8) * xe[l] + (hi(w[l]) - 8) * xo[l] for the LANES bytes of w."""
    cdef Py_ssize_t l
    cdef int b
    for l in range(LANES):
        b = w[l]
        acc[l] = acc[l] + (<float>((b & 15) - 8) * xe[l] + <float>((b >> 4) - 8) * xo[l])


cdef inline void _q4_chunk_f(const float* lo, const float* hi, const float* xe, const float* xo,
                             float* acc) noexcept nogil:
    """_q4_chunk on a row already unpacked to floats (same arithmetic, same bits)."""
    cdef Py_ssize_t l
    for l in range(LANES):
        acc[l] = acc[l] + (lo[l] * xe[l] + hi[l] * xo[l])


cdef inline void _q4_part(const unsigned char* w, const float* xe, const float* xo,
                          Py_ssize_t m, float* acc) noexcept nogil:
    """A chunk of m < LANES bytes: padded with zero weights (0x88) and zero x."""
    cdef unsigned char wp[LANES]
    cdef float ep[LANES]
    cdef float op[LANES]
    cdef Py_ssize_t l
    for l in range(LANES):
        wp[l] = 0x88
        ep[l] = 0
        op[l] = 0
    for l in range(m):
        wp[l] = w[l]
        ep[l] = xe[l]
        op[l] = xo[l]
    _q4_chunk(wp, ep, op, acc)


cdef inline void _q4_part_f(const float* lo, const float* hi, const float* xe, const float* xo,
                            Py_ssize_t m, float* acc) noexcept nogil:
    cdef float lp[LANES]
    cdef float hp[LANES]
    cdef float ep[LANES]
    cdef float op[LANES]
    cdef Py_ssize_t l
    for l in range(LANES):
        lp[l] = 0
        hp[l] = 0
        ep[l] = 0
        op[l] = 0
    for l in range(m):
        lp[l] = lo[l]
        hp[l] = hi[l]
        ep[l] = xe[l]
        op[l] = xo[l]
    _q4_chunk_f(lp, hp, ep, op, acc)


cdef inline void _q4_row(const unsigned char* wr, const float* sr, const float* xs, float* y,
                         float* buf, Py_ssize_t T, Py_ssize_t O, Py_ssize_t nb,
                         Py_ssize_t ng, Py_ssize_t gb) noexcept nogil:
    """One output row o: y[t * O] for all t. xs: T rows of [xe (nb) | xo (nb)]; gb = gs / 2."""
    cdef Py_ssize_t t, g, j, k, l, start, n
    cdef const float* xe
    cdef const float* xo
    cdef float* lo = buf
    cdef float* hi = buf + nb
    cdef float racc[LANES]
    cdef float gacc[LANES]
    cdef float sc
    cdef int b
    if T > 1:
        for k in range(nb):
            b = wr[k]
            lo[k] = <float>((b & 15) - 8)
            hi[k] = <float>((b >> 4) - 8)
    for t in range(T):
        xe = xs + 2 * nb * t
        xo = xe + nb
        for l in range(LANES):
            racc[l] = 0
        for g in range(ng):
            start = g * gb
            n = nb - start
            if n > gb:
                n = gb
            n = start + n
            for l in range(LANES):
                gacc[l] = 0
            j = start
            if T > 1:
                while j + LANES <= n:
                    _q4_chunk_f(lo + j, hi + j, xe + j, xo + j, gacc)
                    j += LANES
                if j < n:
                    _q4_part_f(lo + j, hi + j, xe + j, xo + j, n - j, gacc)
            else:
                while j + LANES <= n:
                    _q4_chunk(wr + j, xe + j, xo + j, gacc)
                    j += LANES
                if j < n:
                    _q4_part(wr + j, xe + j, xo + j, n - j, gacc)
            sc = sr[g]
            for l in range(LANES):
                racc[l] = racc[l] + gacc[l] * sc
        y[t * O] = _fold(racc)


cdef inline void _q8_chunk(const signed char* w, const float* x, float* acc) noexcept nogil:
    cdef Py_ssize_t l
    for l in range(LANES):
        acc[l] = acc[l] + <float>w[l] * x[l]


cdef inline void _q8_chunk_f(const float* w, const float* x, float* acc) noexcept nogil:
    cdef Py_ssize_t l
    for l in range(LANES):
        acc[l] = acc[l] + w[l] * x[l]


cdef inline void _q8_part(const signed char* w, const float* x, Py_ssize_t m,
                          float* acc) noexcept nogil:
    cdef signed char wp[LANES]
    cdef float xp[LANES]
    cdef Py_ssize_t l
    for l in range(LANES):
        wp[l] = 0
        xp[l] = 0
    for l in range(m):
        wp[l] = w[l]
        xp[l] = x[l]
    _q8_chunk(wp, xp, acc)


cdef inline void _q8_part_f(const float* w, const float* x, Py_ssize_t m, float* acc) noexcept nogil:
    cdef float wp[LANES]
    cdef float xp[LANES]
    cdef Py_ssize_t l
    for l in range(LANES):
        wp[l] = 0
        xp[l] = 0
    for l in range(m):
        wp[l] = w[l]
        xp[l] = x[l]
    _q8_chunk_f(wp, xp, acc)


cdef inline void _q8_row(const signed char* wr, float scale, const float* x, float* y,
                         float* buf, Py_ssize_t T, Py_ssize_t O, Py_ssize_t cols) noexcept nogil:
    """Lane l takes elements j with j % LANES == l, in order; fixed fold; times the scale."""
    cdef Py_ssize_t t, j, l
    cdef const float* xr
    cdef float acc[LANES]
    if T > 1:
        for j in range(cols):
            buf[j] = <float>wr[j]
    for t in range(T):
        xr = x + cols * t
        for l in range(LANES):
            acc[l] = 0
        j = 0
        if T > 1:
            while j + LANES <= cols:
                _q8_chunk_f(buf + j, xr + j, acc)
                j += LANES
            if j < cols:
                _q8_part_f(buf + j, xr + j, cols - j, acc)
        else:
            while j + LANES <= cols:
                _q8_chunk(wr + j, xr + j, acc)
                j += LANES
            if j < cols:
                _q8_part(wr + j, xr + j, cols - j, acc)
        y[t * O] = _fold(acc) * scale


cdef int _threads_for(Py_ssize_t rows):
    cdef int nt = get_num_threads()
    if nt > rows:
        nt = <int>rows
    return nt if nt > 0 else 1


cdef int _q4_impl(const float[:, ::1] x, const unsigned char[:, ::1] w, const float[:, ::1] s,
                  float[:, ::1] y, Py_ssize_t cols, Py_ssize_t gs) except -1:
    cdef Py_ssize_t T = x.shape[0]
    cdef Py_ssize_t O = w.shape[0]
    cdef Py_ssize_t nb = w.shape[1]
    cdef Py_ssize_t ng = s.shape[1]
    cdef Py_ssize_t stride = (2 * nb + 15) & ~(<Py_ssize_t>15)   # 64-byte multiples per thread
    cdef int nt = _threads_for(O)
    cdef Py_ssize_t o, t, k
    cdef const float* xp = &x[0, 0]
    cdef const unsigned char* wp = &w[0, 0]
    cdef const float* sp = &s[0, 0]
    cdef float* yp = &y[0, 0]
    cdef float* xs
    cdef float* bufs = NULL
    xs = <float*>malloc(<size_t>(T * 2 * nb) * sizeof(float))
    if xs == NULL:
        raise MemoryError()
    for t in range(T):
        for k in range(cols // 2):
            xs[2 * nb * t + k] = xp[cols * t + 2 * k]
            xs[2 * nb * t + nb + k] = xp[cols * t + 2 * k + 1]
        if cols % 2:
            xs[2 * nb * t + nb - 1] = xp[cols * t + cols - 1]
            xs[2 * nb * t + 2 * nb - 1] = 0
    if T > 1:
        bufs = <float*>malloc(<size_t>(nt * stride) * sizeof(float))
        if bufs == NULL:
            free(xs)
            raise MemoryError()
    try:
        for o in prange(O, nogil=True, num_threads=nt, schedule="static"):
            _q4_row(wp + o * nb, sp + o * ng, xs, yp + o,
                    (bufs + threadid() * stride) if T > 1 else NULL, T, O, nb, ng, gs // 2)
    finally:
        free(bufs)
        free(xs)
    return 0


cdef int _q8_impl(const float[:, ::1] x, const signed char[:, ::1] w, const float[::1] s,
                  float[:, ::1] y) except -1:
    cdef Py_ssize_t T = x.shape[0]
    cdef Py_ssize_t O = w.shape[0]
    cdef Py_ssize_t cols = w.shape[1]
    cdef Py_ssize_t stride = (cols + 15) & ~(<Py_ssize_t>15)
    cdef int nt = _threads_for(O)
    cdef Py_ssize_t o
    cdef const float* xp = &x[0, 0]
    cdef const signed char* wp = &w[0, 0]
    cdef const float* sp = &s[0]
    cdef float* yp = &y[0, 0]
    cdef float* bufs = NULL
    if T > 1:
        bufs = <float*>malloc(<size_t>(nt * stride) * sizeof(float))
        if bufs == NULL:
            raise MemoryError()
    try:
        for o in prange(O, nogil=True, num_threads=nt, schedule="static"):
            _q8_row(wp + o * cols, sp[o], xp, yp + o,
                    (bufs + threadid() * stride) if T > 1 else NULL, T, O, cols)
    finally:
        free(bufs)
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
    ng = -(-cols // group_size)
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
