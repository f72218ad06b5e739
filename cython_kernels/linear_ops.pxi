# Linear attention with a recurrent state (linear_attention.h), included by qmatmul.pyx: the
# pieces of a Gated DeltaNet layer's core (conv + SiLU, gates, l2norm, delta rule, gated norm) and
# the whole core in one call, for any number of positions.

cdef extern from "linear_attention.h":
    void coli_gdn_conv(Py_ssize_t T, Py_ssize_t C, Py_ssize_t K, const float* x, float* state,
                       const float* w, float* y, Py_ssize_t c0, Py_ssize_t c1) noexcept nogil
    void coli_gdn_gates(Py_ssize_t T, Py_ssize_t H, const float* a, const float* b, const float* dt,
                        const float* neg_a, float* decay, float* beta) noexcept nogil
    void coli_l2norm(float* x, Py_ssize_t d, Py_ssize_t stride, float eps, float scale, Py_ssize_t r0,
                     Py_ssize_t r1) noexcept nogil
    void coli_gdn_delta(Py_ssize_t T, Py_ssize_t Hk, Py_ssize_t Hv, Py_ssize_t dk, Py_ssize_t dv,
                        const float* q, const float* k, Py_ssize_t qs, const float* v, Py_ssize_t vs,
                        const float* decay, const float* beta, float* S, float* o, float* mem,
                        Py_ssize_t h0, Py_ssize_t h1) noexcept nogil
    void coli_gated_norm(const float* x, const float* z, const float* w, Py_ssize_t d, float eps,
                         float* out, Py_ssize_t r0, Py_ssize_t r1) noexcept nogil
    ctypedef struct coli_gdn_args:
        Py_ssize_t T, Hk, Hv, dk, dv, K
        const float* qkv
        const float* z
        const float* a
        const float* b
        const float* conv_w
        const float* dt
        const float* neg_a
        const float* norm_w
        float* conv_state
        float* S
        float eps, scale
        float* out
    size_t coli_gdn_block_floats(Py_ssize_t T, Py_ssize_t Hk, Py_ssize_t Hv, Py_ssize_t dk,
                                 Py_ssize_t dv, int nt) noexcept nogil
    void coli_gdn_block(const coli_gdn_args* A, float* work, int nt) noexcept nogil


cdef float* _f32p(a, str what, tuple shape=None) except NULL:
    """The data pointer of a C-contiguous float32 array (refused otherwise: the state is written
    in place, a copy would lose the update)."""
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or not a.flags.c_contiguous:
        raise ValueError(f"{what} must be a C-contiguous float32 array")
    if shape is not None and a.shape != shape:
        raise ValueError(f"{what} must have shape {shape}, got {a.shape}")
    if a.size == 0:
        raise ValueError(f"{what} is empty")
    return <float*>cnp.PyArray_DATA(<cnp.ndarray>a)


def gdn_conv(x, state, w):
    """y = silu(causal depthwise conv of x [T, C] continuing state [C, K-1] with w [C, K]);
    state (float32, C-contiguous) is updated in place. Channels split between threads."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    cdef Py_ssize_t T = x.shape[0], C = x.shape[1], K = w.shape[1]
    if w.shape[0] != C or K < 1 or K > 65:
        raise ValueError(f"conv weight must be [{C}, K] with 1 <= K <= 65, got {w.shape}")
    y = np.empty((T, C), np.float32)
    if T == 0:
        return y
    cdef float* xp = _f32p(x, "x")
    cdef float* wp = _f32p(w, "w")
    cdef float* sp = _f32p(state, "state", (C, K - 1)) if K > 1 else NULL
    cdef float* yp = _f32p(y, "y")
    cdef Py_ssize_t parts = max(1, C // 256)
    cdef int nt = <int>max(1, min(get_num_threads(), parts)), t
    for t in prange(nt, nogil=True, num_threads=nt, schedule="static"):
        coli_gdn_conv(T, C, K, xp, sp, wp, yp, C * t // nt, C * (t + 1) // nt)
    return y


def gdn_gates(a, b, dt, neg_a):
    """(decay, beta) [T, H]: exp(neg_a * softplus(a + dt)) and sigmoid(b)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    dt = np.ascontiguousarray(dt, dtype=np.float32)
    neg_a = np.ascontiguousarray(neg_a, dtype=np.float32)
    cdef Py_ssize_t T = a.shape[0], H = a.shape[1]
    if b.shape != a.shape or dt.shape != (H,) or neg_a.shape != (H,):
        raise ValueError("gates: a, b [T, H], dt_bias and A [H]")
    decay, beta = np.empty((T, H), np.float32), np.empty((T, H), np.float32)
    if T == 0 or H == 0:
        return decay, beta
    coli_gdn_gates(T, H, _f32p(a, "a"), _f32p(b, "b"), _f32p(dt, "dt"), _f32p(neg_a, "neg_a"),
                   _f32p(decay, "decay"), _f32p(beta, "beta"))
    return decay, beta


def l2norm_rows(x, float scale=1.0):
    """x [..., d] * (1 / sqrt(sum x^2 + 1e-6)) * scale per row (a new array)."""
    y = np.array(x, dtype=np.float32, order="C", copy=True)
    cdef Py_ssize_t d = y.shape[y.ndim - 1], rows = y.size // max(1, d)
    if y.size == 0:
        return y
    coli_l2norm(_f32p(y, "x"), d, d, 1e-6, scale, 0, rows)
    return y


def delta_rule(q, k, v, decay, beta, S):
    """The gated delta rule, position after position: q, k [T, Hk, dk] (normed; q scaled), v
    [T, Hv, dv], decay / beta [T, Hv]; S [Hv, dk, dv] (float32, C-contiguous) updated in place;
    k / q head h // (Hv / Hk) serves v head h. Returns o [T, Hv, dv]. Heads split between threads."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    k = np.ascontiguousarray(k, dtype=np.float32)
    v = np.ascontiguousarray(v, dtype=np.float32)
    decay = np.ascontiguousarray(decay, dtype=np.float32)
    beta = np.ascontiguousarray(beta, dtype=np.float32)
    cdef Py_ssize_t T = q.shape[0], Hk = q.shape[1], dk = q.shape[2], Hv = v.shape[1], dv = v.shape[2]
    if k.shape != q.shape or v.shape[0] != T or Hv % Hk or decay.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError("delta rule: q, k [T, Hk, dk], v [T, Hv, dv] (Hv a multiple of Hk), decay / beta [T, Hv]")
    cdef float* sp = _f32p(S, "S", (Hv, dk, dv))
    o = np.empty((T, Hv, dv), np.float32)
    if T == 0:
        return o
    cdef int nt = <int>max(1, min(get_num_threads(), Hv)), t
    mem = np.empty((nt, 2 * dv), np.float32)
    cdef float* qp = _f32p(q, "q")
    cdef float* kp = _f32p(k, "k")
    cdef float* vp = _f32p(v, "v")
    cdef float* dp = _f32p(decay, "decay")
    cdef float* bp = _f32p(beta, "beta")
    cdef float* op = _f32p(o, "o")
    cdef float* mp = _f32p(mem, "mem")
    for t in prange(nt, nogil=True, num_threads=nt, schedule="static"):
        coli_gdn_delta(T, Hk, Hv, dk, dv, qp, kp, Hk * dk, vp, Hv * dv, dp, bp, sp, op, mp + t * 2 * dv,
                       Hv * t // nt, Hv * (t + 1) // nt)
    return o


def gated_norm(x, z, w, float eps):
    """(w * x / sqrt(mean x^2 + eps)) * silu(z) per row of d (x, z [..., d], w [d])."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    z = np.ascontiguousarray(z, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    cdef Py_ssize_t d = x.shape[x.ndim - 1], rows = x.size // max(1, d)
    if z.shape != x.shape or w.shape != (d,):
        raise ValueError("gated norm: x, z [..., d], w [d]")
    out = np.empty(x.shape, np.float32)
    if x.size == 0:
        return out
    coli_gated_norm(_f32p(x, "x"), _f32p(z, "z"), _f32p(w, "w"), d, eps, _f32p(out, "out"), 0, rows)
    return out


def gdn_block(qkv, z, b, a, conv_w, conv_state, S, dt, neg_a, norm_w, float eps, float scale,
              Py_ssize_t Hk, Py_ssize_t Hv, Py_ssize_t dk, Py_ssize_t dv):
    """A Gated DeltaNet layer's core for T positions in one call: conv + SiLU (conv_state [C, K-1]
    updated), l2norms (q also times ``scale``), gates, the delta rule (S [Hv, dk, dv] updated), the
    gated norm. qkv [T, C], z [T, Hv*dv], b / a [T, Hv]. Returns [T, Hv * dv]: the bits of
    gdn_conv, l2norm_rows, gdn_gates, delta_rule and gated_norm called one after another."""
    qkv = np.ascontiguousarray(qkv, dtype=np.float32)
    z = np.ascontiguousarray(z, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    a = np.ascontiguousarray(a, dtype=np.float32)
    conv_w = np.ascontiguousarray(conv_w, dtype=np.float32)
    cdef Py_ssize_t T = qkv.shape[0], C = 2 * Hk * dk + Hv * dv, K = conv_w.shape[1]
    if qkv.shape[1] != C or conv_w.shape[0] != C or K < 1 or K > 65 or Hv % Hk:
        raise ValueError("gdn block: qkv [T, 2 Hk dk + Hv dv], conv weight [C, K <= 65], Hv a multiple of Hk")
    if z.shape != (T, Hv * dv) or b.shape != (T, Hv) or a.shape != (T, Hv):
        raise ValueError("gdn block: z [T, Hv dv], a / b [T, Hv]")
    out = np.empty((T, Hv * dv), np.float32)
    if T == 0:
        return out
    cdef int nt = get_num_threads()
    nt = <int>max(1, min(nt, Hv))
    work = np.empty(coli_gdn_block_floats(T, Hk, Hv, dk, dv, nt), np.float32)
    cdef coli_gdn_args A
    A.T, A.Hk, A.Hv, A.dk, A.dv, A.K = T, Hk, Hv, dk, dv, K
    A.qkv, A.z, A.a, A.b = _f32p(qkv, "qkv"), _f32p(z, "z"), _f32p(a, "a"), _f32p(b, "b")
    A.conv_w = _f32p(conv_w, "conv weight")
    A.dt = _f32p(dt, "dt_bias", (Hv,))
    A.neg_a = _f32p(neg_a, "A", (Hv,))
    A.norm_w = _f32p(norm_w, "norm weight", (dv,))
    A.conv_state = _f32p(conv_state, "conv state", (C, K - 1)) if K > 1 else NULL
    A.S = _f32p(S, "S", (Hv, dk, dv))
    A.eps, A.scale = eps, scale
    A.out = _f32p(out, "out")
    cdef float* wp = _f32p(work, "work")
    with nogil:
        coli_gdn_block(&A, wp, nt)
    return out
