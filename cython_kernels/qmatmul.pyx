# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True, nonecheck=False
"""Quantized matmul kernels (int4 grouped, int8 per row), OpenMP-parallel over output rows.

Formats are those of ``core.quant``. Every output row is computed by exactly one thread, in a
fixed order that depends neither on the thread count nor on T (decode, T == 1, and prefill,
T > 1, give the same bits), so results are bit-identical for any number of threads. setup.py
compiles with -ffp-contract=off (no FMA fusion), so on gcc/clang the bits follow from the
source order alone. No numpy C-API is used (numpy is imported at Python level only).

int4, per output row (all float32):
  * the row's packed bytes are copied into an aligned thread-local buffer of native uint32
    words, each group padded to whole words with 0x88 bytes (zero weights);
  * x is permuted once per call into 8 planes, X[i][k] = x of nibble i of word k (0 where
    padded), and every word gets its group's scale sw[k];
  * p[k] = ((((n0 * X0 + n1 * X1) + (n2 * X2 + n3 * X3)) + ((n4 * X4 + n5 * X5) + (n6 * X6 +
    n7 * X7))) * sw[k], with n_i = nibble i of word k minus 8 (bits 4i..4i+3);
  * y = 16 lanes (lane l sums p[k] for k % 16 == l, in order), folded by a fixed tree.
  Prefill unpacks the row once to floats n_i (8 planes) in a thread-local buffer and runs the
  same expression for every x row.
int8, per output row: 16 lanes, lane l sums q[j] * x[j] for j % 16 == l in order (a last partial
chunk is padded with zeros), folded by the same tree, times s[o].
"""
from cython.parallel cimport prange, threadid
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memset
from libc.stdint cimport uint32_t

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
    # restrict-qualified output pointer: lets the compiler vectorize without alias checks
    ctypedef float* f32_rp "float * __restrict"

cdef enum:
    LANES = 16

cdef int _num_threads = 0   # 0: OpenMP default (omp_get_max_threads, i.e. OMP_NUM_THREADS)
cdef int _byte_of_nibble[8]  # memory byte (0..3) of nibble i (bits 4i..4i+3) of a native word


cdef void _init_byte_order() noexcept:
    cdef uint32_t one = 1
    cdef bint little = (<unsigned char*>&one)[0] == 1
    cdef int i
    for i in range(8):
        _byte_of_nibble[i] = i // 2 if little else 3 - i // 2

_init_byte_order()


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


cdef int _threads_for(Py_ssize_t rows):
    cdef int nt = get_num_threads()
    if nt > rows:
        nt = <int>rows
    return nt if nt > 0 else 1


cdef inline Py_ssize_t _up16(Py_ssize_t n) noexcept nogil:
    return (n + 15) & ~(<Py_ssize_t>15)


cdef inline float _fold16(float* acc) noexcept nogil:
    cdef Py_ssize_t l
    for l in range(8):
        acc[l] = acc[l] + acc[l + 8]
    for l in range(4):
        acc[l] = acc[l] + acc[l + 4]
    return (acc[0] + acc[1]) + (acc[2] + acc[3])


cdef inline float _sum16(const float* p, Py_ssize_t n) noexcept nogil:
    """Fixed-order sum of p[0:n], n a multiple of 16."""
    cdef float acc[LANES]
    cdef Py_ssize_t j, l
    for l in range(LANES):
        acc[l] = 0
    j = 0
    while j < n:
        for l in range(LANES):
            acc[l] = acc[l] + p[j + l]
        j += LANES
    return _fold16(acc)


# --- int4 -------------------------------------------------------------------------------------

cdef inline void _q4_words(const uint32_t* wd, const float* X, const float* sw, f32_rp p,
                           Py_ssize_t nw, Py_ssize_t S) noexcept nogil:
    """p[k] for the packed words wd[0:nw] (decode). X: 8 planes of stride S."""
    cdef Py_ssize_t k
    cdef uint32_t v
    for k in range(nw):
        v = wd[k]
        p[k] = ((((<float>(<int>(v & 15) - 8) * X[k]
                   + <float>(<int>((v >> 4) & 15) - 8) * X[S + k])
                  + (<float>(<int>((v >> 8) & 15) - 8) * X[2 * S + k]
                     + <float>(<int>((v >> 12) & 15) - 8) * X[3 * S + k]))
                 + ((<float>(<int>((v >> 16) & 15) - 8) * X[4 * S + k]
                     + <float>(<int>((v >> 20) & 15) - 8) * X[5 * S + k])
                    + (<float>(<int>((v >> 24) & 15) - 8) * X[6 * S + k]
                       + <float>(<int>(v >> 28) - 8) * X[7 * S + k])))
                * sw[k])


cdef inline void _q4_unpack(const uint32_t* wd, float* B, Py_ssize_t nw, Py_ssize_t S) noexcept nogil:
    """B[i * S + k] = nibble i of wd[k] minus 8 (prefill). One plane per loop: vectorizes."""
    cdef Py_ssize_t k
    cdef int i
    cdef float* b
    for i in range(8):
        b = B + i * S
        for k in range(nw):
            b[k] = <float>(<int>((wd[k] >> (4 * i)) & 15) - 8)


cdef inline void _q4_floats(const float* B, const float* X, const float* sw, f32_rp p,
                            Py_ssize_t nw, Py_ssize_t S) noexcept nogil:
    """_q4_words on an unpacked row: the same expression, so the same bits."""
    cdef Py_ssize_t k
    for k in range(nw):
        p[k] = ((((B[k] * X[k] + B[S + k] * X[S + k])
                  + (B[2 * S + k] * X[2 * S + k] + B[3 * S + k] * X[3 * S + k]))
                 + ((B[4 * S + k] * X[4 * S + k] + B[5 * S + k] * X[5 * S + k])
                    + (B[6 * S + k] * X[6 * S + k] + B[7 * S + k] * X[7 * S + k])))
                * sw[k])


cdef inline void _q4_row(const unsigned char* wr, const float* sr, const float* xs, float* y,
                         char* scratch, Py_ssize_t T, Py_ssize_t O, Py_ssize_t nb,
                         Py_ssize_t ng, Py_ssize_t gb, Py_ssize_t nwg, Py_ssize_t S) noexcept nogil:
    """One output row: y[t * O] for all t. xs: T blocks of 8 planes of stride S (S >= nw)."""
    cdef Py_ssize_t nw = ng * nwg
    cdef Py_ssize_t t, g, j, off, m
    cdef uint32_t* wd = <uint32_t*>scratch                # S words
    cdef float* sw = <float*>(scratch + 4 * S)            # S floats
    cdef float* p = <float*>(scratch + 8 * S)             # S floats, zero past nw
    cdef float* B = <float*>(scratch + 12 * S)            # 8 * S floats (prefill only)
    # packed bytes -> group-aligned words (padding bytes 0x88 = zero weights)
    if gb % 4 == 0:
        memcpy(wd, wr, nb)
        memset((<unsigned char*>wd) + nb, 0x88, 4 * nw - nb)
    else:
        memset(wd, 0x88, 4 * nw)
        for g in range(ng):
            off = g * gb
            m = nb - off
            if m > gb:
                m = gb
            memcpy((<unsigned char*>wd) + 4 * nwg * g, wr + off, m)
    for g in range(ng):
        for j in range(nwg):
            sw[g * nwg + j] = sr[g]
    if T > 1:
        _q4_unpack(wd, B, nw, S)
        for t in range(T):
            _q4_floats(B, xs + 8 * S * t, sw, p, nw, S)
            y[t * O] = _sum16(p, _up16(nw))
    else:
        _q4_words(wd, xs, sw, p, nw, S)
        y[0] = _sum16(p, _up16(nw))


cdef int _q4_impl(const float[:, ::1] x, const unsigned char[:, ::1] w, const float[:, ::1] s,
                  float[:, ::1] y, Py_ssize_t cols, Py_ssize_t gs) except -1:
    cdef Py_ssize_t T = x.shape[0]
    cdef Py_ssize_t O = w.shape[0]
    cdef Py_ssize_t nb = w.shape[1]
    cdef Py_ssize_t ng = s.shape[1]
    cdef Py_ssize_t gb = gs // 2                 # bytes per group
    cdef Py_ssize_t nwg = (gb + 3) // 4          # words per group
    cdef Py_ssize_t nw = ng * nwg
    cdef Py_ssize_t S = _up16(nw)                # plane stride (floats / words)
    cdef Py_ssize_t per_thread = (12 + (8 if T > 1 else 0)) * S * 4   # bytes, 64-byte multiple
    cdef int nt = _threads_for(O)
    cdef Py_ssize_t o, t, g, j, k, i, e, r
    cdef float* xi
    cdef const float* xp = &x[0, 0]
    cdef const unsigned char* wp = &w[0, 0]
    cdef const float* sp = &s[0, 0]
    cdef float* yp = &y[0, 0]
    cdef float* xs = <float*>malloc(<size_t>(T * 8 * S) * sizeof(float))
    cdef char* scratch = <char*>malloc(<size_t>(nt * per_thread + 64))
    cdef char* base
    if xs == NULL or scratch == NULL:
        free(xs)
        free(scratch)
        raise MemoryError()
    base = scratch + (64 - (<size_t>scratch) % 64) % 64
    for t in range(nt):   # p is zero past nw (read by _sum16's last lanes)
        memset(base + t * per_thread + 8 * S, 0, 4 * S)
    for t in range(T):
        for i in range(8):
            xi = xs + t * 8 * S + i * S
            for g in range(ng):
                for j in range(nwg):
                    # word k = g * nwg + j holds bytes 4j..4j+3 of group g; nibble i of it is
                    # element e of the group, element r of the row
                    e = 8 * j + 2 * _byte_of_nibble[i] + (i & 1)
                    r = g * gs + e
                    xi[g * nwg + j] = xp[t * cols + r] if e < gs and r < cols else 0
            for k in range(nw, S):
                xi[k] = 0
    try:
        for o in prange(O, nogil=True, num_threads=nt, schedule="static"):
            _q4_row(wp + o * nb, sp + o * ng, xs, yp + o, base + threadid() * per_thread,
                    T, O, nb, ng, gb, nwg, S)
    finally:
        free(scratch)
        free(xs)
    return 0


# --- int8 -------------------------------------------------------------------------------------

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
        y[t * O] = _fold16(acc) * scale


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
