from cython.parallel cimport parallel

# Dense float32 products (dense.h), included by qmatmul.pyx so the binary ships one extension:
# y = x @ W.T and y = x @ W with one summation order for every row count, thread count and SIMD
# variant, so decode (one row) and prefill (many) of a bits-16 model give the same bits.
cdef extern from "dense.h":
    int COLI_DN_TB, COLI_DN_OB, COLI_DN_KC, COLI_DNT_IB
    size_t coli_dn_scratch_floats(coli_idx T, coli_idx K) noexcept nogil
    int coli_dn_level(int level) noexcept nogil
    coli_idx coli_dn_ldx(coli_idx K) noexcept nogil
    void coli_dn_lay_x(const float* x, coli_idx K, coli_idx t0, coli_idx t1, float* X,
                       coli_idx ldx) noexcept nogil
    void coli_dn_block(int level, const float* x, coli_idx ldx, int xpad, const float* W,
                       coli_idx K, coli_idx t0, coli_idx t1, coli_idx o0, coli_idx o1, float* y,
                       coli_idx ldy, float* scratch) noexcept nogil
    void coli_dnt_block(int level, const float* x, const float* W, coli_idx O, coli_idx I,
                        coli_idx T, coli_idx i0, coli_idx i1, float* y) noexcept nogil


def dense_level():
    """The SIMD variant the dense products run ('portable' also on x86 without hardware FMA,
    where fmaf is a library call: core.kernels then uses numpy; NEON runs the portable loops,
    the same bits)."""
    return coli_level_names[coli_dn_level(_level)].decode()


def _dense_args(x, W, name):
    x = np.ascontiguousarray(x, dtype=np.float32)
    W = np.ascontiguousarray(W, dtype=np.float32)
    if x.ndim != 2 or W.ndim != 2:
        raise ValueError(f"{name}: x and W must be 2-D, got shapes {x.shape} and {W.shape}")
    return x, W


def dense_matmul(x, W, out=None, int threads=0):
    """y = x @ W.T for float32 x [T, K] and W [O, K]; returns float32 [T, O] (or fills out).

    Each y[t, o] is 16 fused multiply-add lanes over k (lane j: k = j mod 16, in order) folded
    by a fixed pairwise tree (dense.h): the same bits for any T, any thread count (threads <= 0:
    the kernels' count) and every SIMD variant -- row t of a many-row call is the one-row call's.
    """
    x, W = _dense_args(x, W, "dense_matmul")
    if W.shape[1] != x.shape[1]:
        raise ValueError(f"dense_matmul: x has {x.shape[1]} columns, W has {W.shape[1]}")
    y = _out(out, x.shape[0], W.shape[0], False)
    if x.shape[0] and W.shape[0]:
        _dense_run(x, W, y, threads)
    return y


cdef int _dense_run(const float[:, ::1] x, const float[:, ::1] W, float[:, ::1] y,
                    int threads) except -1:
    cdef Py_ssize_t T = x.shape[0], K = x.shape[1], O = W.shape[0]
    cdef Py_ssize_t ntb = (T + COLI_DN_TB - 1) // COLI_DN_TB, nob = (O + COLI_DN_OB - 1) // COLI_DN_OB
    cdef Py_ssize_t nblk = ntb * nob, b, t0, o0, per, ldx = K
    cdef int lv = _level, nt = _threads_for(nblk), xpad = 0
    cdef float* base = NULL
    cdef float* X = NULL
    cdef const float* xs = &x[0, 0]
    if 0 < threads < nt:
        nt = threads
    # each thread's lanes between k panels and W panels (dense.h; decode: little or none)
    per = _up(<Py_ssize_t>coli_dn_scratch_floats(T, K), 16) + 16
    base = <float*>_amalloc(<size_t>(nt * per) * sizeof(float))
    if base == NULL:
        raise MemoryError()
    try:
        if T > 1:           # many rows: x laid out once, padded (coli_dn_ldx)
            ldx = coli_dn_ldx(K)
            X = <float*>_amalloc(<size_t>(T * ldx) * sizeof(float))
            if X == NULL:
                raise MemoryError()
            xpad = 1
            xs = X
        if nt == 1:         # no parallel region for one thread (the router, small matrices)
            with nogil:
                if X != NULL:
                    coli_dn_lay_x(&x[0, 0], K, 0, T, X, ldx)
                for b in range(nblk):
                    o0 = (b // ntb) * COLI_DN_OB
                    t0 = (b % ntb) * COLI_DN_TB
                    coli_dn_block(lv, xs, ldx, xpad, &W[0, 0], K, t0, min(t0 + COLI_DN_TB, T),
                                  o0, min(o0 + COLI_DN_OB, O), &y[0, 0], O, base)
        else:
            with nogil, parallel(num_threads=nt):
                if X != NULL:
                    for b in prange(ntb, schedule="static"):
                        coli_dn_lay_x(&x[0, 0], K, b * COLI_DN_TB, min(b * COLI_DN_TB + COLI_DN_TB, T),
                                      X, ldx)
                # block b: weight rows (b // ntb), token rows (b % ntb): neighbouring blocks
                # share W
                for b in prange(nblk, schedule="dynamic"):
                    o0 = (b // ntb) * COLI_DN_OB
                    t0 = (b % ntb) * COLI_DN_TB
                    coli_dn_block(lv, xs, ldx, xpad, &W[0, 0], K, t0, min(t0 + COLI_DN_TB, T),
                                  o0, min(o0 + COLI_DN_OB, O), &y[0, 0], O,
                                  base + threadid() * per)
    finally:
        _afree(X)
        _afree(base)
    return 0


def dense_matmul_t(x, W, out=None, int threads=0):
    """y = x @ W for float32 x [T, O] and W [O, I]; returns float32 [T, I] (or fills out).

    Each y[t, i] is one fused multiply-add chain over o in order (dense.h): the same bits for any
    T, thread count and SIMD variant."""
    x, W = _dense_args(x, W, "dense_matmul_t")
    if W.shape[0] != x.shape[1]:
        raise ValueError(f"dense_matmul_t: x has {x.shape[1]} columns, W has {W.shape[0]} rows")
    y = _out(out, x.shape[0], W.shape[1], False)
    if x.shape[0] and W.shape[1]:
        if W.shape[0] == 0:
            y[...] = 0
        else:
            _dense_t_run(x, W, y, threads)
    return y


cdef int _dense_t_run(const float[:, ::1] x, const float[:, ::1] W, float[:, ::1] y,
                      int threads) except -1:
    cdef Py_ssize_t T = x.shape[0], O = x.shape[1], I = W.shape[1]
    cdef Py_ssize_t nblk = (I + COLI_DNT_IB - 1) // COLI_DNT_IB, b, i0
    cdef int lv = _level, nt = _threads_for(nblk)
    if 0 < threads < nt:
        nt = threads
    if nt == 1:
        with nogil:
            for b in range(nblk):
                i0 = b * COLI_DNT_IB
                coli_dnt_block(lv, &x[0, 0], &W[0, 0], O, I, T, i0, min(i0 + COLI_DNT_IB, I),
                               &y[0, 0])
    else:
        for b in prange(nblk, nogil=True, num_threads=nt, schedule="dynamic"):
            i0 = b * COLI_DNT_IB
            coli_dnt_block(lv, &x[0, 0], &W[0, 0], O, I, T, i0, min(i0 + COLI_DNT_IB, I),
                           &y[0, 0])
    return 0
