# FP4 products (fp4.h: E2M1 codes, a UE8M0 scale byte per 32; core.quant.FP4), included by
# qmatmul.pyx so the binary ships one extension: every matrix of a call in one OpenMP region,
# x laid out once, dense.h's summation order over the exactly decoded weights.
cdef extern from "fp4.h":
    int COLI_F4_RB
    coli_idx coli_f4_ldx(coli_idx K) noexcept nogil
    void coli_f4_lay_x(const float* x, coli_idx K, coli_idx t0, coli_idx t1, float* X,
                       coli_idx ldx) noexcept nogil
    void coli_f4_rows(int level, const float* xp, const uint8_t* W, const uint8_t* S, coli_idx K,
                      coli_idx o0, coli_idx o1, float* y) noexcept nogil
    void coli_f4_block(int level, const float* X, coli_idx ldx, const uint8_t* W, const uint8_t* S,
                       coli_idx K, coli_idx t0, coli_idx t1, coli_idx o0, coli_idx o1, float* y,
                       coli_idx ldy, float* scratch) noexcept nogil
    void coli_f4_init() noexcept nogil

coli_f4_init()      # the scale table, before any product


def fp4_level():
    """The SIMD variant the FP4 products run (dense_level's: 'portable' on x86 without hardware
    FMA, where core.kernels uses numpy; NEON runs the portable loops, the same bits)."""
    return dense_level()


def _fp4_args(w, s, cols, name):
    """Validated (codes uint8 [O, ceil(cols/2)], scale bytes uint8 [O, ceil(cols/32)])."""
    w = _as_bytes(w, np.uint8, name)
    s = _as_bytes(s, np.uint8, name + " scales")
    nb, ng = (cols + 1) // 2, (cols + 31) // 32
    if w.ndim != 2 or w.shape[1] != nb:
        raise ValueError(f"{name} must be [O, {nb}] for cols={cols}, got shape {w.shape}")
    if s.ndim != 2 or s.shape[0] != w.shape[0] or s.shape[1] != ng:
        raise ValueError(f"{name} scales must be [{w.shape[0]}, {ng}] for cols={cols}, got shape {s.shape}")
    return w, s


def fp4_matmul(x, w, s, int cols, out=None):
    """y = x @ dequant(W).T for FP4 W: x float32 [T, cols], w uint8 [O, ceil(cols/2)] (E2M1
    codes, low nibble the even column), s uint8 [O, ceil(cols/32)] (UE8M0). Returns float32
    [T, O] (or fills out). The bits of dense_matmul over x and W in fp4.h's positions, for any T,
    thread count and SIMD variant."""
    return fp4_matmul_many(x, [(w, s)], cols, None, None if out is None else [out])[0]


def fp4_matmul_many(x, mats, int cols, rows=None, outs=None):
    """Several FP4 products in one parallel pass: out_m = x[t0:t0+n] @ dequant(W_m).T (arguments
    as q4_matmul_many): gate and up, then down, of every expert a MoE layer routed to. A matrix on
    one row runs the fused decode kernel, on more the panel kernel: the same bits, so neither the
    grouping nor the row count changes any."""
    x, _ = _as_x(x)
    if x.shape[1] != cols or cols <= 0:
        raise ValueError(f"x has {x.shape[1]} columns, expected cols={cols} (> 0)")
    n, T = len(mats), x.shape[0]
    rows = [(0, T)] * n if rows is None else [(int(a), int(b)) for a, b in rows]
    if len(rows) != n or (outs is not None and len(outs) != n):
        raise ValueError("mats, rows and outs must have the same length")
    checked, res = [], []
    for m, (w, s) in enumerate(mats):
        t0, tn = rows[m]
        if t0 < 0 or tn < 0 or t0 + tn > T:
            raise ValueError(f"rows {t0}:{t0 + tn} are outside x's {T} rows")
        w, s = _fp4_args(w, s, cols, f"mats[{m}]")
        checked.append((w, s))
        res.append(_out(None if outs is None else outs[m], tn, w.shape[0], False))
    live = [m for m in range(n) if rows[m][1] > 0 and checked[m][0].shape[0] > 0]
    if live:
        _fp4_run(x, [checked[m] for m in live], [res[m] for m in live],
                 np.array([rows[m] for m in live], dtype=np.intp).reshape(-1, 2), cols)
    return res


cdef int _fp4_run(const float[:, ::1] x, list mats, list outs, const Py_ssize_t[:, ::1] rows,
                  Py_ssize_t K) except -1:
    """Work blocks: a matrix on one row in COLI_F4_RB weight rows (the fused kernel), on more in
    dense.h's blocks of COLI_DN_TB rows x COLI_DN_OB outputs; block b belongs to the matrix whose
    range of block numbers (bstart) holds it."""
    cdef int nmat = len(mats), m, lv = _level, nt
    cdef Py_ssize_t T = x.shape[0], ldx = coli_f4_ldx(K), nb = 0, b, per
    cdef bint many = False
    cdef const unsigned char[:, ::1] w
    cdef const unsigned char[:, ::1] s
    cdef float[:, ::1] y
    cdef void** p = <void**>malloc(<size_t>(3 * nmat) * sizeof(void*))
    cdef Py_ssize_t* meta = <Py_ssize_t*>malloc(<size_t>(3 * nmat) * sizeof(Py_ssize_t))
    cdef float* X = <float*>_amalloc(<size_t>(T * ldx) * sizeof(float))
    cdef float* base = NULL
    try:
        if p == NULL or meta == NULL or X == NULL:
            raise MemoryError()
        for m in range(nmat):       # meta: O, token blocks, first block number of each matrix
            w = mats[m][0]
            s = mats[m][1]
            y = outs[m]
            p[m] = <void*>&w[0, 0]
            p[nmat + m] = <void*>&s[0, 0]
            p[2 * nmat + m] = <void*>&y[0, 0]
            meta[m] = w.shape[0]
            meta[nmat + m] = 1 if rows[m, 1] == 1 else (rows[m, 1] + COLI_DN_TB - 1) // COLI_DN_TB
            meta[2 * nmat + m] = nb
            nb += meta[nmat + m] * ((w.shape[0] + COLI_F4_RB - 1) // COLI_F4_RB if rows[m, 1] == 1
                                    else (w.shape[0] + COLI_DN_OB - 1) // COLI_DN_OB)
            many = many or rows[m, 1] > 1
        nt = _threads_for(nb)
        # each thread's lanes between k panels and its decoded W panel (dense.h); none for one row
        per = _up(<Py_ssize_t>coli_dn_scratch_floats(2 if many else 1, K), 16) + 16
        base = <float*>_amalloc(<size_t>(nt * per) * sizeof(float))
        if base == NULL:
            raise MemoryError()
        if nt == 1:
            with nogil:
                coli_f4_lay_x(&x[0, 0], K, 0, T, X, ldx)
                for b in range(nb):
                    _fp4_block(lv, b, X, ldx, K, p, nmat, meta, rows, base)
        else:
            with nogil, parallel(num_threads=nt):
                for b in prange(T, schedule="static"):
                    coli_f4_lay_x(&x[0, 0], K, b, b + 1, X, ldx)
                for b in prange(nb, schedule="dynamic"):
                    _fp4_block(lv, b, X, ldx, K, p, nmat, meta, rows, base + threadid() * per)
    finally:
        _afree(base)
        _afree(X)
        free(meta)
        free(p)
    return 0


cdef inline void _fp4_block(int lv, Py_ssize_t b, const float* X, Py_ssize_t ldx, Py_ssize_t K,
                            void** p, int nmat, const Py_ssize_t* meta,
                            const Py_ssize_t[:, ::1] rows, float* scratch) noexcept nogil:
    cdef Py_ssize_t m = _owner(meta + 2 * nmat, nmat, b), O = meta[m], ntb = meta[nmat + m]
    cdef Py_ssize_t local = b - meta[2 * nmat + m], tn = rows[m, 1], t0, o0
    cdef const float* xm = X + rows[m, 0] * ldx
    cdef const uint8_t* W = <const uint8_t*>p[m]
    cdef const uint8_t* S = <const uint8_t*>p[nmat + m]
    cdef float* y = <float*>p[2 * nmat + m]
    if tn == 1:
        o0 = local * COLI_F4_RB
        coli_f4_rows(lv, xm, W, S, K, o0, min(o0 + COLI_F4_RB, O), y)
    else:
        t0 = (local % ntb) * COLI_DN_TB
        o0 = (local // ntb) * COLI_DN_OB
        coli_f4_block(lv, xm, ldx, W, S, K, t0, min(t0 + COLI_DN_TB, tn), o0, min(o0 + COLI_DN_OB, O),
                      y, O, scratch)
