# Prefill int4 products of many rows (prefill.h), included by qmatmul.pyx so the binary ships one
# extension: every matrix of a call in one OpenMP region, the tokens of each row span transposed
# once, each work block dequantizing a panel of its weights next to the multiply.
from cython.parallel cimport parallel
from libc.stdint cimport int64_t

cdef extern from "prefill.h":
    int COLI_PF_OB
    coli_idx coli_pf_np(coli_idx n) noexcept nogil
    size_t coli_pf_scratch_floats(coli_idx gs, coli_idx npad) noexcept nogil
    int coli_pf_level(int level) noexcept nogil
    void coli_pf_pack(const float* x, coli_idx ldx, coli_idx n, coli_idx npad, coli_idx k0,
                      coli_idx k1, float* xt, coli_idx cols) noexcept nogil
    void coli_pf_block(int level, const float* xt, coli_idx n, coli_idx npad, const uint8_t* w,
                       const float* s, coli_idx cols, coli_idx gs, coli_idx o0, coli_idx o1,
                       float* y, coli_idx ldy, float* scratch) noexcept nogil
    void coli_pf_rank_combine(const float* y, coli_idx H, const int64_t* slot, const float* w,
                              coli_idx k, float* out) noexcept nogil

cdef Py_ssize_t _PF_PACK_K = 256     # k per packing job


def prefill_level():
    """The SIMD variant the prefill products run (NEON: the portable loops, the same bits)."""
    return coli_level_names[coli_pf_level(_level)].decode()


def q4_prefill_many(x, mats, int cols, int group_size, rows=None, outs=None):
    """Several int4 products of many rows in one parallel pass: out_m = x[t0:t0+n] @ dequant(W_m).T.

    Arguments as ``q4_matmul_many``. Each output is one fused multiply-add chain over the columns
    in order (prefill.h), so the bits are the same for every SIMD variant, thread count and
    grouping of the matrices -- but not those of ``q4_matmul`` nor of an sgemm.
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
    if not live:
        return res
    spans, span_of = {}, []
    for m in live:                      # matrices on the same rows (gate and up) share one layout
        span_of.append(spans.setdefault(rows[m], len(spans)))
    st = np.array([r for r, _ in spans.items()], dtype=np.intp).reshape(-1, 2)
    _pf_many(x, [checked[m] for m in live], [res[m] for m in live],
             np.ascontiguousarray(st[:, 0]), np.ascontiguousarray(st[:, 1]),
             np.array(span_of, dtype=np.intp), cols, group_size)
    return res


cdef int _pf_many(const float[:, ::1] x, list mats, list outs, const Py_ssize_t[::1] st0,
                  const Py_ssize_t[::1] stn, const Py_ssize_t[::1] span_of, Py_ssize_t cols,
                  Py_ssize_t gs) except -1:
    cdef int nmat = len(mats), nspan = st0.shape[0], m, nt, lv = _level
    cdef const unsigned char[:, ::1] w
    cdef const float[:, ::1] s
    cdef float[:, ::1] y
    cdef Py_ssize_t i, b, j, o0, o1, sp, kc0, kc1, npmax = 0, xtot = 0, per
    cdef Py_ssize_t nblk = 0, njob = 0, kchunks = (cols + _PF_PACK_K - 1) // _PF_PACK_K
    cdef void** p = <void**>malloc(<size_t>(3 * nmat) * sizeof(void*))
    cdef Py_ssize_t* ix = <Py_ssize_t*>malloc(<size_t>(3 * nmat + 2 * nspan + 2) * sizeof(Py_ssize_t))
    cdef float* xt = NULL
    cdef float* base = NULL
    if p == NULL or ix == NULL:
        free(p)
        free(ix)
        raise MemoryError()
    cdef Py_ssize_t* Os = ix
    cdef Py_ssize_t* bstart = ix + nmat            # first block of each matrix, then the total
    cdef Py_ssize_t* xoff = ix + 2 * nmat + 1      # each span's xt offset (floats)
    cdef Py_ssize_t* snp = ix + 2 * nmat + 1 + nspan
    try:
        for m in range(nmat):
            w = mats[m][0]
            s = mats[m][1]
            y = outs[m]
            p[m] = <void*>&w[0, 0]
            p[nmat + m] = <void*>&s[0, 0]
            p[2 * nmat + m] = <void*>&y[0, 0]
            Os[m] = w.shape[0]
            bstart[m] = nblk
            nblk += (Os[m] + COLI_PF_OB - 1) // COLI_PF_OB
        bstart[nmat] = nblk
        for i in range(nspan):
            snp[i] = coli_pf_np(stn[i])
            xoff[i] = xtot
            xtot += snp[i] * cols
            npmax = max(npmax, snp[i])
        njob = nspan * kchunks
        nt = _threads_for(nblk)
        per = _up(<Py_ssize_t>coli_pf_scratch_floats(gs, npmax), 16)
        xt = <float*>_amalloc(<size_t>xtot * sizeof(float))
        base = <float*>_amalloc(<size_t>(nt * per) * sizeof(float))
        if xt == NULL or base == NULL:
            raise MemoryError()
        with nogil, parallel(num_threads=nt):
            for j in prange(njob, schedule="dynamic"):   # dynamic: a descheduled thread holds one job
                sp = j // kchunks
                kc0 = (j % kchunks) * _PF_PACK_K
                kc1 = min(kc0 + _PF_PACK_K, cols)
                coli_pf_pack(&x[0, 0] + st0[sp] * cols, cols, stn[sp], snp[sp], kc0, kc1,
                             xt + xoff[sp], cols)
            for b in prange(nblk, schedule="dynamic"):
                m = <int>_owner(bstart, nmat, b)
                sp = span_of[m]
                o0 = (b - bstart[m]) * COLI_PF_OB
                o1 = min(o0 + COLI_PF_OB, Os[m])
                coli_pf_block(lv, xt + xoff[sp], stn[sp], snp[sp], <const uint8_t*>p[m],
                              <const float*>p[nmat + m], cols, gs, o0, o1, <float*>p[2 * nmat + m],
                              Os[m], base + threadid() * per)
    finally:
        _afree(base)
        _afree(xt)
        free(ix)
        free(p)
    return 0


def rank_combine(const float[:, ::1] y, const int64_t[:, ::1] slots, const float[:, ::1] weights):
    """[T, H]: out[t] = y[slots[t, 0]] * weights[t, 0] + y[slots[t, 1]] * weights[t, 1] + ... in
    rank order (the MoE block's prefill sum, with numpy's bits for contrib * w then add.reduce),
    in parallel over tokens. y: float32 [rows, H]; slots: int64 [T, k], each < rows."""
    cdef Py_ssize_t T = slots.shape[0], k = slots.shape[1], H = y.shape[1], t, r
    if weights.shape[0] != T or weights.shape[1] != k:
        raise ValueError(f"weights must be [{T}, {k}], got [{weights.shape[0]}, {weights.shape[1]}]")
    if k < 1 and T:
        raise ValueError("slots must have at least one rank")
    for t in range(T):
        for r in range(k):
            if slots[t, r] < 0 or slots[t, r] >= y.shape[0]:
                raise ValueError(f"slots[{t}, {r}] = {slots[t, r]} is outside y's {y.shape[0]} rows")
    out = np.empty((T, H), np.float32)
    cdef float[:, ::1] o = out
    cdef int nt = _threads_for(T)
    if T and H:
        for t in prange(T, nogil=True, num_threads=nt, schedule="dynamic", chunksize=16):
            coli_pf_rank_combine(&y[0, 0], H, &slots[t, 0], &weights[t, 0], k, &o[t, 0])
    return out
