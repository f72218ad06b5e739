# Kimi Delta Attention's core (kda_block.h), included by qmatmul.pyx after linear_ops.pxi (its conv
# is gdn_conv): the pieces (divide-form l2norm, per-channel gates, per-channel delta rule,
# sigmoid-gated norm) and the whole core in one call, for any number of positions.

cdef extern from "kda_block.h":
    void coli_kda_l2norm(float* x, Py_ssize_t d, Py_ssize_t stride, float eps, float scale,
                         Py_ssize_t r0, Py_ssize_t r1) noexcept nogil
    void coli_kda_gates(Py_ssize_t T, Py_ssize_t H, Py_ssize_t d, const float* f, const float* b,
                        const float* dt, const float* neg_a, float* decay, float* beta,
                        Py_ssize_t h0, Py_ssize_t h1) noexcept nogil
    void coli_kda_delta(Py_ssize_t T, Py_ssize_t H, Py_ssize_t d, const float* q, const float* k,
                        const float* v, Py_ssize_t qs, const float* decay, const float* beta,
                        float* S, float* o, float* mem, Py_ssize_t h0, Py_ssize_t h1) noexcept nogil
    void coli_kda_norm(const float* x, const float* z, const float* w, Py_ssize_t d, float eps,
                       float* out, Py_ssize_t r0, Py_ssize_t r1) noexcept nogil
    ctypedef struct coli_kda_args:
        Py_ssize_t T, H, d, K
        const float* qkv
        const float* f
        const float* b
        const float* z
        const float* conv_w
        const float* dt
        const float* neg_a
        const float* norm_w
        float* conv_state
        float* S
        float eps, scale
        float* out
    size_t coli_kda_block_floats(Py_ssize_t T, Py_ssize_t H, Py_ssize_t d, int nt) noexcept nogil
    void coli_kda_block(const coli_kda_args* A, float* work, int nt) noexcept nogil


def kda_l2norm_rows(x, float scale=1.0):
    """(x [..., d] / sqrt(sum x^2 + 1e-6)) * scale per row (a new array): Kimi's divide form."""
    y = np.array(x, dtype=np.float32, order="C", copy=True)
    cdef Py_ssize_t d = y.shape[y.ndim - 1], rows = y.size // max(1, d)
    if y.size == 0:
        return y
    coli_kda_l2norm(_f32p(y, "x"), d, d, 1e-6, scale, 0, rows)
    return y


def kda_gates(f, b, dt, neg_a):
    """(decay [T, H, d], beta [T, H]): exp(neg_a[h] * softplus(f + dt)) per channel (f [T, H*d] the
    f_b projection, dt [H*d]; KimiLinearForgetGate's softplus) and sigmoid(b [T, H])."""
    f = np.ascontiguousarray(f, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    dt = np.ascontiguousarray(dt, dtype=np.float32)
    neg_a = np.ascontiguousarray(neg_a, dtype=np.float32).reshape(-1)
    cdef Py_ssize_t T = b.shape[0], H = b.shape[1]
    if H == 0 or f.ndim != 2 or f.shape[0] != T or f.shape[1] % H or neg_a.shape != (H,):
        raise ValueError("kda gates: f [T, H*d], b [T, H], dt [H*d], A [H]")
    cdef Py_ssize_t d = f.shape[1] // H
    if dt.shape != (H * d,):
        raise ValueError("kda gates: dt_bias [H*d]")
    decay, beta = np.empty((T, H, d), np.float32), np.empty((T, H), np.float32)
    if T == 0 or d == 0:
        return decay, beta
    coli_kda_gates(T, H, d, _f32p(f, "f"), _f32p(b, "b"), _f32p(dt, "dt"), _f32p(neg_a, "neg_a"),
                   _f32p(decay, "decay"), _f32p(beta, "beta"), 0, H)
    return decay, beta


def kda_delta_rule(q, k, v, decay, beta, S):
    """The delta rule with a per-key-channel decay, position after position: q, k, v [T, H, d]
    (q, k normed; q scaled), decay [T, H, d], beta [T, H]; S [H, d, d] (float32, C-contiguous)
    updated in place. Returns o [T, H, d]. Heads split between threads."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    k = np.ascontiguousarray(k, dtype=np.float32)
    v = np.ascontiguousarray(v, dtype=np.float32)
    decay = np.ascontiguousarray(decay, dtype=np.float32)
    beta = np.ascontiguousarray(beta, dtype=np.float32)
    cdef Py_ssize_t T = q.shape[0], H = q.shape[1], d = q.shape[2]
    if k.shape != q.shape or v.shape != q.shape or decay.shape != q.shape or beta.shape != (T, H):
        raise ValueError("kda delta rule: q, k, v, decay [T, H, d], beta [T, H]")
    cdef float* sp = _f32p(S, "S", (H, d, d))
    o = np.empty((T, H, d), np.float32)
    if T == 0:
        return o
    cdef int nt = <int>max(1, min(get_num_threads(), H)), t
    mem = np.empty((nt, 4 * d), np.float32)
    cdef float* qp = _f32p(q, "q")
    cdef float* kp = _f32p(k, "k")
    cdef float* vp = _f32p(v, "v")
    cdef float* dp = _f32p(decay, "decay")
    cdef float* bp = _f32p(beta, "beta")
    cdef float* op = _f32p(o, "o")
    cdef float* mp = _f32p(mem, "mem")
    for t in prange(nt, nogil=True, num_threads=nt, schedule="static"):
        coli_kda_delta(T, H, d, qp, kp, vp, H * d, dp, bp, sp, op, mp + t * 4 * d,
                       H * t // nt, H * (t + 1) // nt)
    return o


def kda_norm(x, z, w, float eps):
    """(w * x / sqrt(mean x^2 + eps)) * sigmoid(z) per row of d (x, z [..., d], w [d])."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    z = np.ascontiguousarray(z, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    cdef Py_ssize_t d = x.shape[x.ndim - 1], rows = x.size // max(1, d)
    if z.shape != x.shape or w.shape != (d,):
        raise ValueError("kda norm: x, z [..., d], w [d]")
    out = np.empty(x.shape, np.float32)
    if x.size == 0:
        return out
    coli_kda_norm(_f32p(x, "x"), _f32p(z, "z"), _f32p(w, "w"), d, eps, _f32p(out, "out"), 0, rows)
    return out


def kda_block(qkv, f, b, z, conv_w, conv_state, S, dt, neg_a, norm_w, float eps, float scale,
              Py_ssize_t H, Py_ssize_t d):
    """A KDA layer's core for T positions in one call: the three convs + SiLU (qkv [T, 3 H d] =
    [q | k | v], conv_state [3 H d, K-1] updated), the divide-form l2norms (q also times ``scale``),
    the per-channel forget gate (f [T, H d] the f_b projection, dt [H d], neg_a [H]) and beta
    (sigmoid(b [T, H])), the per-channel delta rule (S [H, d, d] updated), o_norm times sigmoid(z)
    (z [T, H d] the g_b projection). Returns [T, H d]: the bits of gdn_conv, kda_l2norm_rows,
    kda_gates, kda_delta_rule and kda_norm called one after another."""
    qkv = np.ascontiguousarray(qkv, dtype=np.float32)
    f = np.ascontiguousarray(f, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    z = np.ascontiguousarray(z, dtype=np.float32)
    conv_w = np.ascontiguousarray(conv_w, dtype=np.float32)
    neg_a = np.ascontiguousarray(neg_a, dtype=np.float32).reshape(-1)
    cdef Py_ssize_t T = qkv.shape[0], W = H * d, C = 3 * W, K = conv_w.shape[1]
    if H < 1 or d < 1 or qkv.shape[1] != C or conv_w.shape[0] != C or K < 1 or K > 65:
        raise ValueError("kda block: qkv [T, 3 H d], conv weight [3 H d, K <= 65]")
    if f.shape != (T, W) or z.shape != (T, W) or b.shape != (T, H):
        raise ValueError("kda block: f, z [T, H d], b [T, H]")
    out = np.empty((T, W), np.float32)
    if T == 0:
        return out
    cdef int nt = get_num_threads()
    nt = <int>max(1, min(nt, H))
    work = np.empty(coli_kda_block_floats(T, H, d, nt), np.float32)
    cdef coli_kda_args A
    A.T, A.H, A.d, A.K = T, H, d, K
    A.qkv, A.f, A.b, A.z = _f32p(qkv, "qkv"), _f32p(f, "f"), _f32p(b, "b"), _f32p(z, "z")
    A.conv_w = _f32p(conv_w, "conv weight")
    A.dt = _f32p(dt, "dt_bias", (W,))
    A.neg_a = _f32p(neg_a, "A", (H,))
    A.norm_w = _f32p(norm_w, "norm weight", (d,))
    A.conv_state = _f32p(conv_state, "conv state", (C, K - 1)) if K > 1 else NULL
    A.S = _f32p(S, "S", (H, d, d))
    A.eps, A.scale = eps, scale
    A.out = _f32p(out, "out")
    cdef float* wp = _f32p(work, "work")
    with nogil:
        coli_kda_block(&A, wp, nt)
    return out
