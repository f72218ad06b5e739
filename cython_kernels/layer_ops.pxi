# The per-layer operations of a decode step (layer_ops.h), included by qmatmul.pyx so the binary
# ships one extension. Arguments are C-contiguous float32 (core.kernels makes them so).
from libc.stdint cimport int64_t, uint16_t

cdef extern from "layer_ops.h":
    void coli_rms_norm(const float* x, const float* w, float* y, Py_ssize_t rows, Py_ssize_t n,
                       float eps) noexcept nogil
    void coli_rope(float* x, const float* cs, const float* sn, Py_ssize_t T, Py_ssize_t H,
                   Py_ssize_t D) noexcept nogil
    int coli_attend_one(const float* q, const void* K, const void* V, Py_ssize_t ks,
                        Py_ssize_t vs, float* out, Py_ssize_t H, Py_ssize_t KV, Py_ssize_t D,
                        Py_ssize_t lo, Py_ssize_t S, float scale, int nt, int level,
                        int half) noexcept nogil
    void coli_matvec_rows(const float* x, const float* W, float* out, Py_ssize_t T, Py_ssize_t E,
                          Py_ssize_t D, int level) noexcept nogil
    void coli_softmax_topk(const float* logits, Py_ssize_t T, Py_ssize_t E, Py_ssize_t k,
                           int norm, float* probs, int64_t* top, float* wts) noexcept nogil
    void coli_h2f_rows(const uint16_t* h, float* f, Py_ssize_t n, int avx2) noexcept nogil
    float coli_h2f(uint16_t h) noexcept nogil

    int coli_ops_avx2(int level, Py_ssize_t D) noexcept nogil
    int coli_h2f_avx2_int(const uint16_t* h, float* f, Py_ssize_t n) noexcept nogil
    void coli_rank_sum(const float* c, const float* w, Py_ssize_t k, Py_ssize_t H,
                       float* out) noexcept nogil


def rms_norm(const float[:, ::1] x, const float[::1] w, float eps):
    """w * x / sqrt(mean(x^2) + eps) per row of x [rows, n]; a new array."""
    cdef Py_ssize_t rows = x.shape[0], n = x.shape[1]
    if w.shape[0] != n:
        raise ValueError(f"rms_norm: weight has {w.shape[0]} elements, rows have {n}")
    y = np.empty((rows, n), np.float32)
    cdef float[:, ::1] yv = y
    if rows and n:
        with nogil:
            coli_rms_norm(&x[0, 0], &w[0], &yv[0, 0], rows, n, eps)
    return y


def rope_(float[:, :, ::1] x, const float[:, ::1] cos, const float[:, ::1] sin):
    """Rotary embedding in place: x [T, heads, D], cos / sin [T, D]."""
    cdef Py_ssize_t T = x.shape[0], H = x.shape[1], D = x.shape[2]
    if cos.shape[0] != T or sin.shape[0] != T or cos.shape[1] != D or sin.shape[1] != D or D % 2:
        raise ValueError("rope: cos / sin must be [T, D] for x [T, heads, D] with D even")
    if T and H and D:
        with nogil:
            coli_rope(&x[0, 0, 0], &cos[0, 0], &sin[0, 0], T, H, D)


def attend_one(const float[:, ::1] q, const float[:, :, :] keys, const float[:, :, :] values,
               float scale, Py_ssize_t lo):
    """Attention of one query position: q [heads, D] against the cache keys / values
    [kv_heads, S, D] (each head's rows contiguous, any stride between heads) at positions lo..S-1; returns
    [1, heads * D]."""
    cdef Py_ssize_t H = q.shape[0], D = q.shape[1], KV = keys.shape[0], S = keys.shape[1]
    cdef int nt = get_num_threads(), rc = 0
    if (keys.shape[2] != D or values.shape[0] != KV or values.shape[1] != S
            or values.shape[2] != D or KV == 0 or H % KV or not 0 <= lo <= S
            or keys.strides[1] != D * 4 or values.strides[1] != D * 4
            or keys.strides[2] != 4 or values.strides[2] != 4):
        raise ValueError("attend_one: shapes of q, keys and values do not match")
    out = np.empty((1, H * D), np.float32)
    cdef float[:, ::1] ov = out
    cdef Py_ssize_t ks = keys.strides[0] // 4, vs = values.strides[0] // 4
    if H and D:
        with nogil:
            rc = coli_attend_one(&q[0, 0], &keys[0, 0, 0] if S else NULL,
                                 &values[0, 0, 0] if S else NULL, ks, vs, &ov[0, 0], H, KV, D,
                                 lo, S, scale, nt, _level, 0)
    if rc:
        raise MemoryError()
    return out


def attend_one_f16(const float[:, ::1] q, const uint16_t[:, :, :] keys,
                   const uint16_t[:, :, :] values, float scale, Py_ssize_t lo):
    """attend_one over a float16 KV cache (keys / values: float16 arrays viewed as uint16): the
    bits of attend_one over the same values widened to float32."""
    cdef Py_ssize_t H = q.shape[0], D = q.shape[1], KV = keys.shape[0], S = keys.shape[1]
    cdef int nt = get_num_threads(), rc = 0
    if (keys.shape[2] != D or values.shape[0] != KV or values.shape[1] != S
            or values.shape[2] != D or KV == 0 or H % KV or not 0 <= lo <= S
            or keys.strides[1] != D * 2 or values.strides[1] != D * 2
            or keys.strides[2] != 2 or values.strides[2] != 2):
        raise ValueError("attend_one_f16: shapes of q, keys and values do not match")
    out = np.empty((1, H * D), np.float32)
    cdef float[:, ::1] ov = out
    cdef Py_ssize_t ks = keys.strides[0] // 2, vs = values.strides[0] // 2
    if H and D:
        with nogil:
            rc = coli_attend_one(&q[0, 0], &keys[0, 0, 0] if S else NULL,
                                 &values[0, 0, 0] if S else NULL, ks, vs, &ov[0, 0], H, KV, D,
                                 lo, S, scale, nt, _level, 1)
    if rc:
        raise MemoryError()
    return out


def f16_to_f32(const uint16_t[::1] h, str path="auto"):
    """float16 values (viewed as uint16) widened to float32 by the kernels' conversion (exact).
    path: "auto" (what attention uses: F16C, else AVX2 integer operations, else scalar), or one
    of "avx2" (the integer one; 0-length result where AVX2 is missing) and "scalar" (for tests)."""
    cdef Py_ssize_t i, n = h.shape[0]
    out = np.empty(n, np.float32)
    cdef float[::1] ov = out
    if path not in ("auto", "avx2", "scalar"):
        raise ValueError(f"path must be auto, avx2 or scalar, got {path!r}")
    if n == 0:
        return out
    if path == "auto":
        with nogil:
            coli_h2f_rows(&h[0], &ov[0], n, coli_ops_avx2(_level, 8))
    elif path == "avx2":
        if not coli_h2f_avx2_int(&h[0], &ov[0], n):
            return out[:0]
    else:
        for i in range(n):
            ov[i] = coli_h2f(h[i])
    return out


def router_logits(const float[:, ::1] x, const float[:, ::1] W):
    """x [T, D] @ W.T for a float32 router W [E, D], on the calling thread (for the few rows of
    decode and short prompts, where a multi-threaded sgemm's spinning workers would slow the
    OpenMP regions that follow). Returns [T, E]."""
    cdef Py_ssize_t T = x.shape[0], D = x.shape[1], E = W.shape[0]
    if W.shape[1] != D:
        raise ValueError(f"router_logits: x has {D} columns, W has {W.shape[1]}")
    out = np.empty((T, E), np.float32)
    cdef float[:, ::1] ov = out
    if T and E and D:
        with nogil:
            coli_matvec_rows(&x[0, 0], &W[0, 0], &ov[0, 0], T, E, D, _level)
    return out


def softmax_topk(const float[:, ::1] logits, Py_ssize_t k, bint norm):
    """Per row: softmax, then the k most probable experts (ties: lower index first) and their
    probabilities (divided by their sum when norm). Returns (top int64 [T, k], weights [T, k])."""
    cdef Py_ssize_t T = logits.shape[0], E = logits.shape[1]
    if not 0 < k <= E:
        raise ValueError(f"softmax_topk: k={k} with {E} experts")
    probs = np.empty((T, E), np.float32)
    top = np.empty((T, k), np.int64)
    wts = np.empty((T, k), np.float32)
    cdef float[:, ::1] pv = probs, wv = wts
    cdef int64_t[:, ::1] tv = top
    if T:
        with nogil:
            coli_softmax_topk(&logits[0, 0], T, E, k, norm, &pv[0, 0], &tv[0, 0], &wv[0, 0])
    return top, wts


def rank_sum(const float[:, ::1] c, const float[::1] w):
    """c[0] * w[0] + c[1] * w[1] + ..., in that order (numpy's bits for
    np.add.reduce(c * w[:, None], axis=0)); returns [1, H]."""
    cdef Py_ssize_t k = c.shape[0], H = c.shape[1]
    if w.shape[0] != k or k == 0:
        raise ValueError(f"rank_sum: {k} rows and {w.shape[0]} weights")
    out = np.empty((1, H), np.float32)
    cdef float[:, ::1] ov = out
    if H:
        with nogil:
            coli_rank_sum(&c[0, 0], &w[0], k, H, &ov[0, 0])
    return out
