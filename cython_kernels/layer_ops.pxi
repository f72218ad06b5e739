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
    uint16_t coli_f2h(float x) noexcept nogil

    int coli_ops_avx2(int level, Py_ssize_t D) noexcept nogil
    int coli_h2f_avx2_int(const uint16_t* h, float* f, Py_ssize_t n) noexcept nogil
    void coli_rank_sum(const float* c, const float* w, Py_ssize_t k, Py_ssize_t H,
                       float* out) noexcept nogil
    float coli_softmax_unnorm_lv(float* p, Py_ssize_t n, float scale, int level) noexcept nogil


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


cdef object _attend(const float[:, ::1] q, const void* K, const void* V, Py_ssize_t* kshape,
                    Py_ssize_t* vshape, Py_ssize_t* kstrides, Py_ssize_t* vstrides, Py_ssize_t item,
                    float scale, Py_ssize_t lo, int half, str name):
    """attend_one / attend_one_f16 after their typed arguments: the checks and the call for a
    cache of `item`-byte values (K / V: the first key / value, NULL when S == 0)."""
    cdef Py_ssize_t H = q.shape[0], D = q.shape[1], KV = kshape[0], S = kshape[1]
    cdef int nt = get_num_threads(), rc = 0
    if (kshape[2] != D or vshape[0] != KV or vshape[1] != S
            or vshape[2] != D or KV == 0 or H % KV or not 0 <= lo <= S
            or kstrides[1] != D * item or vstrides[1] != D * item
            or kstrides[2] != item or vstrides[2] != item):
        raise ValueError(f"{name}: shapes of q, keys and values do not match")
    out = np.empty((1, H * D), np.float32)
    cdef float[:, ::1] ov = out
    cdef Py_ssize_t ks = kstrides[0] // item, vs = vstrides[0] // item
    if H and D:
        with nogil:
            rc = coli_attend_one(&q[0, 0], K, V, ks, vs, &ov[0, 0], H, KV, D, lo, S, scale, nt,
                                 _level, half)
    if rc:
        raise MemoryError()
    return out


def attend_one(const float[:, ::1] q, const float[:, :, :] keys, const float[:, :, :] values,
               float scale, Py_ssize_t lo):
    """Attention of one query position: q [heads, D] against the cache keys / values
    [kv_heads, S, D] (each head's rows contiguous, any stride between heads) at positions
    lo..S-1; returns [1, heads * D]."""
    cdef bint S = keys.shape[1] > 0
    return _attend(q, &keys[0, 0, 0] if S else NULL, &values[0, 0, 0] if S else NULL,
                   keys.shape, values.shape, keys.strides, values.strides, 4, scale, lo, 0,
                   "attend_one")


def attend_one_f16(const float[:, ::1] q, const uint16_t[:, :, :] keys,
                   const uint16_t[:, :, :] values, float scale, Py_ssize_t lo):
    """attend_one over a float16 KV cache (keys / values: float16 arrays viewed as uint16): the
    bits of attend_one over the same values widened to float32."""
    cdef bint S = keys.shape[1] > 0
    return _attend(q, &keys[0, 0, 0] if S else NULL, &values[0, 0, 0] if S else NULL,
                   keys.shape, values.shape, keys.strides, values.strides, 2, scale, lo, 1,
                   "attend_one_f16")


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


def f32_to_f16(const float[::1] x):
    """float32 values rounded to float16 (returned as uint16 bits) by the attention block's
    conversion of a new cache row, which follows numpy's astype(np.float16)."""
    cdef Py_ssize_t i, n = x.shape[0]
    out = np.empty(n, np.uint16)
    cdef uint16_t[::1] ov = out
    with nogil:
        for i in range(n):
            ov[i] = coli_f2h(x[i])
    return out


def router_logits(const float[:, ::1] x, const float[:, ::1] W):
    """x [T, D] @ W.T for a float32 router W [E, D], on the calling thread (for the few rows of
    decode and short prompts, where a multi-threaded sgemm's spinning workers would slow the
    OpenMP regions that follow), in the attention block's router order (layer_ops.h's
    coli_matvec_rows: dense_matmul's bits where the dense kernel runs). Returns [T, E]."""
    cdef Py_ssize_t T = x.shape[0], D = x.shape[1], E = W.shape[0]
    if W.shape[1] != D:
        raise ValueError(f"router_logits: x has {D} columns, W has {W.shape[1]}")
    out = np.empty((T, E), np.float32)
    cdef float[:, ::1] ov = out
    if T and E and D:
        with nogil:
            coli_matvec_rows(&x[0, 0], &W[0, 0], &ov[0, 0], T, E, D, _level)
    return out


def softmax_unnorm_(float[::1] p, float scale):
    """In place, p -> exp(scale * p - max(scale * p)) with the SIMD variant in use (the
    attention's softmax numerator, every variant the same bits); returns the sum of the new p
    (summed in the kernel's fixed order)."""
    cdef float s = 0
    if p.shape[0]:
        with nogil:
            s = coli_softmax_unnorm_lv(&p[0], p.shape[0], scale, _level)
    return s


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


cdef extern from "attention_block.h":
    int COLI_QK_NONE, COLI_QK_FULL, COLI_QK_PER_HEAD
    ctypedef struct coli_attn_w:
        const uint8_t* w[4]
        const float* s[4]
        const float* bias[4]
        const float* in_norm
        const float* q_norm
        const float* k_norm
        int qk_norm
        float eps
        float clip
        Py_ssize_t gs, hidden, H, KV, D
        Py_ssize_t R
        const float* post_norm
        const float* router
        Py_ssize_t E, top_k
        int norm_topk
        int gated
    void coli_sigmoid_gate(float* y, const float* g, Py_ssize_t n) noexcept nogil
    size_t coli_attention_block_floats(const coli_attn_w* W, Py_ssize_t S, int half,
                                       int nt) noexcept nogil
    void coli_attention_block(const coli_attn_w* W, const float* x, const float* cs,
                              const float* sn, void* K, void* V, Py_ssize_t ks, Py_ssize_t vs,
                              int half,
                              Py_ssize_t pos, Py_ssize_t lo, float scale, float* out, float* h,
                              int64_t* top, float* wts, int nt, int level, int i8,
                              float* work) noexcept nogil


cdef const float* _vec_ptr(object a, Py_ssize_t n, str name) except? NULL:
    """Pointer to a C-contiguous float32 vector of n elements (None: NULL)."""
    if a is None:
        return NULL
    cdef const float[::1] v = a
    if v.shape[0] != n:
        raise ValueError(f"attention block: {name} has {v.shape[0]} elements, expected {n}")
    return &v[0]


def sigmoid_gate(float[:, ::1] out, const float[:, ::1] gate):
    """out *= sigmoid(gate) in place (out, gate [T, n] float32): gated attention's output gate,
    out * (1 / (1 + exp(-gate))) with libm's expf -- the function the compiled attention block
    runs, so the one-position step path has the block's bits."""
    if out.shape[0] != gate.shape[0] or out.shape[1] != gate.shape[1]:
        raise ValueError("sigmoid_gate: out and gate differ in shape")
    if out.shape[0] * out.shape[1] == 0:
        return
    with nogil:
        coli_sigmoid_gate(&out[0, 0], &gate[0, 0], out.shape[0] * out.shape[1])


cdef class AttentionBlock:
    """A layer's attention block for one decode position as one compiled call
    (attention_block.h): x [1, hidden] -> x + o(attention(...)), writing this position's key
    and value into the layer's float32 or float16 cache (the products take the opt-in int8
    activations when they are on, as q4_matmul does); with a router, also the MoE block's input (the
    post-attention norm) and its top-k. The same bits as the separate calls (rms_norm,
    q4_matmul_many, the biases / q-k norms / clip, rope_, attend_one, q4_matmul, the residual
    add, rms_norm, router_logits, softmax_topk); gated: q's rows per head [q_h | gate_h] and the
    attention times sigmoid(gate) (sigmoid_gate) before o. Built once per layer; each argument
    array is kept alive here."""
    cdef coli_attn_w w
    cdef object _keep

    def __init__(self, proj, Py_ssize_t group_size, biases, in_norm, str qk_norm, q_norm, k_norm,
                 float eps, clip, Py_ssize_t heads, Py_ssize_t kv_heads, Py_ssize_t head_dim,
                 post_norm=None, router=None, Py_ssize_t top_k=0, bint norm_topk=False,
                 Py_ssize_t rope_dim=0, bint gated=False):
        """proj: (data, scales) of the int4 q, k, v, o projections; biases: 4 vectors or None;
        qk_norm: "none", "full" or "per_head"; clip: a float or None; router: float32
        [experts, hidden] (None: no router) with its post_norm [hidden] and top_k; rope_dim: the
        first dims of each head RoPE turns (0: all of them); gated: q (and its bias) has 2 x heads
        x head_dim rows, per head [q_h | gate_h]."""
        cdef const float[:, ::1] rv
        cdef Py_ssize_t hidden, m, HD = heads * head_dim, KD = kv_heads * head_dim
        cdef const unsigned char[:, ::1] wv
        cdef const float[:, ::1] sv
        if heads <= 0 or kv_heads <= 0 or heads % kv_heads or head_dim <= 0 or head_dim % 2:
            raise ValueError("attention block: bad head counts or head size")
        if group_size < 2 or group_size % 2:
            raise ValueError(f"attention block: group_size must be even and >= 2, got {group_size}")
        if rope_dim == 0:
            rope_dim = head_dim
        if rope_dim < 2 or rope_dim % 2 or rope_dim > head_dim:
            raise ValueError(f"attention block: rope_dim must be even and in 2..{head_dim}, got {rope_dim}")
        if len(proj) != 4 or len(biases) != 4:
            raise ValueError("attention block: expected q, k, v and o")
        hidden = np.asarray(in_norm).shape[0]
        rows = (2 * HD if gated else HD, KD, KD, hidden)
        cols = (hidden, hidden, hidden, HD)
        self._keep = (proj, biases, in_norm, q_norm, k_norm, post_norm, router)
        for m in range(4):
            wv = proj[m][0]
            sv = proj[m][1]
            if (wv.shape[0] != rows[m] or wv.shape[1] != (cols[m] + 1) // 2
                    or sv.shape[0] != rows[m]
                    or sv.shape[1] != (cols[m] + group_size - 1) // group_size):
                raise ValueError(f"attention block: projection {'qkvo'[m]} has the wrong shape")
            self.w.w[m] = <const uint8_t*>&wv[0, 0]
            self.w.s[m] = &sv[0, 0]
            self.w.bias[m] = _vec_ptr(biases[m], rows[m], f"bias {'qkvo'[m]}")
        self.w.in_norm = _vec_ptr(in_norm, hidden, "input norm")
        if qk_norm == "none":
            self.w.qk_norm = COLI_QK_NONE
            self.w.q_norm = self.w.k_norm = NULL
        elif qk_norm == "full":
            self.w.qk_norm = COLI_QK_FULL
            self.w.q_norm = _vec_ptr(q_norm, HD, "q norm")
            self.w.k_norm = _vec_ptr(k_norm, KD, "k norm")
        elif qk_norm == "per_head":
            self.w.qk_norm = COLI_QK_PER_HEAD
            self.w.q_norm = _vec_ptr(q_norm, head_dim, "q norm")
            self.w.k_norm = _vec_ptr(k_norm, head_dim, "k norm")
        else:
            raise ValueError(f"attention block: unknown qk_norm {qk_norm!r}")
        if self.w.qk_norm != COLI_QK_NONE and (self.w.q_norm == NULL or self.w.k_norm == NULL):
            raise ValueError("attention block: q / k norm weights missing")
        self.w.eps = eps
        self.w.clip = -1.0 if clip is None else float(clip)
        if clip is not None and not clip >= 0:
            raise ValueError(f"attention block: clip must be >= 0, got {clip}")
        self.w.router = NULL
        self.w.post_norm = NULL
        self.w.E = self.w.top_k = 0
        if router is not None:
            rv = router
            if rv.shape[1] != hidden or not 0 < top_k <= rv.shape[0]:
                raise ValueError("attention block: the router does not match")
            self.w.router = &rv[0, 0]
            self.w.post_norm = _vec_ptr(post_norm, hidden, "post-attention norm")
            if self.w.post_norm == NULL:
                raise ValueError("attention block: the router needs its post-attention norm")
            self.w.E = rv.shape[0]
            self.w.top_k = top_k
            self.w.norm_topk = norm_topk
        self.w.gs = group_size
        self.w.hidden = hidden
        self.w.H = heads
        self.w.KV = kv_heads
        self.w.D = head_dim
        self.w.R = rope_dim
        self.w.gated = gated

    def __call__(self, const float[:, ::1] x, const float[:, ::1] cos, const float[:, ::1] sin,
                 keys, values, Py_ssize_t pos, Py_ssize_t lo, float scale):
        """x [1, hidden]; cos / sin [1, rope_dim] (the rotary angles of pos); keys / values: the
        layer's cache [kv_heads, capacity, head_dim], C-contiguous float32 or float16, with
        capacity > pos. Attends to positions
        lo..pos. Returns x + the block's output, [1, hidden]; with a router, (that, the MoE input
        h [1, hidden], top int64 [1, top_k], weights float32 [1, top_k])."""
        cdef Py_ssize_t D = self.w.D, R = self.w.R
        cdef int nt = get_num_threads()
        cdef bint half = keys.dtype == np.float16
        cdef float[:, :, ::1] kf, vf
        cdef uint16_t[:, :, ::1] kh, vh
        cdef void* kp
        cdef void* vp
        if x.shape[0] != 1 or x.shape[1] != self.w.hidden:
            raise ValueError(f"attention block: x must be [1, {self.w.hidden}]")
        if cos.shape[0] != 1 or sin.shape[0] != 1 or cos.shape[1] != R or sin.shape[1] != R:
            raise ValueError(f"attention block: cos / sin must be [1, {R}]")
        if (keys.shape[0] != self.w.KV or keys.shape[2] != D or values.shape[0] != self.w.KV
                or values.shape[1] != keys.shape[1] or values.shape[2] != D
                or not 0 <= pos < keys.shape[1] or not 0 <= lo <= pos):
            raise ValueError("attention block: the cache does not match (or pos is outside it)")
        if values.dtype != keys.dtype:
            raise ValueError("attention block: keys and values differ in type")
        cdef Py_ssize_t ks = keys.shape[1] * D, vs = values.shape[1] * D
        if half:
            kh = keys.view(np.uint16)
            vh = values.view(np.uint16)
            kp, vp = <void*>&kh[0, 0, 0], <void*>&vh[0, 0, 0]
        else:
            kf = keys
            vf = values
            kp, vp = <void*>&kf[0, 0, 0], <void*>&vf[0, 0, 0]
        out = np.empty((1, self.w.hidden), np.float32)
        cdef float[:, ::1] ov = out
        cdef float[:, ::1] hv
        cdef int64_t[:, ::1] tv
        cdef float[:, ::1] wv
        cdef bint routed = self.w.router != NULL
        if routed:
            h = np.empty((1, self.w.hidden), np.float32)
            top = np.empty((1, self.w.top_k), np.int64)
            wts = np.empty((1, self.w.top_k), np.float32)
            hv = h
            tv = top
            wv = wts
        cdef float* work = <float*>_amalloc(coli_attention_block_floats(&self.w, pos + 1, half, nt)
                                            * sizeof(float))
        if work == NULL:
            raise MemoryError()
        with nogil:
            coli_attention_block(&self.w, &x[0, 0], &cos[0, 0], &sin[0, 0], kp, vp,
                                 ks, vs, half, pos,
                                 lo, scale, &ov[0, 0], &hv[0, 0] if routed else NULL,
                                 &tv[0, 0] if routed else NULL, &wv[0, 0] if routed else NULL,
                                 nt, _level, _int8_act and coli_q4i8_ok(_level, self.w.gs),
                                 work)
        _afree(work)
        return (out, h, top, wts) if routed else out
