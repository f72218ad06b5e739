# Multi-head latent attention (mla_block.h), included by qmatmul.pyx: the transposed int4 / int8
# products, attention of many heads over one latent key/value head, and the one-position block.

cdef extern from "mla_block.h":
    void coli_q4t_cols(int level, const uint8_t* w, const float* s, const float* x, Py_ssize_t T,
                       Py_ssize_t O, Py_ssize_t I, Py_ssize_t gs, float* y, Py_ssize_t g0,
                       Py_ssize_t g1) noexcept nogil
    void coli_q8t_cols(int level, const int8_t* w, const float* s, const float* x, Py_ssize_t T,
                       Py_ssize_t O, Py_ssize_t I, float* y, Py_ssize_t c0,
                       Py_ssize_t c1) noexcept nogil
    size_t coli_latent_floats(Py_ssize_t H, Py_ssize_t D, Py_ssize_t S, int half,
                              int nt) noexcept nogil
    void coli_attend_latent(const float* q, const void* R, int half, Py_ssize_t H, Py_ssize_t D,
                            Py_ssize_t Dv, Py_ssize_t S, float scale, float* out, float* work,
                            int nt, int level) noexcept nogil
    ctypedef struct coli_mla_w:
        const uint8_t* wqa
        const uint8_t* wq
        const uint8_t* wkva
        const uint8_t* wkvb
        const uint8_t* wo
        const float* sqa
        const float* sq
        const float* skva
        const float* skvb
        const float* so
        const float* bqa
        const float* bkva
        const float* bo
        const float* in_norm
        const float* qa_norm
        const float* kva_norm
        float eps
        Py_ssize_t gs, hidden, H, Q, rank, nope, rope, v
    size_t coli_mla_block_floats(const coli_mla_w* W, Py_ssize_t S, int half, int nt) noexcept nogil
    void coli_mla_block(const coli_mla_w* W, const float* x, const float* cs, const float* sn,
                        void* R, int half, Py_ssize_t pos, float scale, float* out, int nt,
                        int level, int i8, float* work) noexcept nogil


cdef int _qt_threads(Py_ssize_t work, Py_ssize_t parts):
    """Threads for a transposed product (its bits never depend on them): one below ~1M weights
    (a head's W_kb, 192 x 512, took 0.02 ms on one thread and 0.36-0.45 ms on two: waking the
    team costs more than the product)."""
    cdef int nt = get_num_threads()
    if work < (1 << 20):
        return 1
    return <int>max(1, min(nt, parts))


def q4_matmul_t(x, w, s, int cols, int group_size, out=None):
    """y = x @ dequant(W) for int4 grouped W [O, cols] (the transposed product).

    x: float32 [T, O]; w: uint8 [O, ceil(cols/2)]; s: float32 [O, ceil(cols/group_size)].
    Returns float32 [T, cols]. Every column sums its O terms (x[o] * s[o, g]) * (q - 8) in order,
    one multiply and one add each: the same bits for every SIMD variant and thread count."""
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be even and >= 2, got {group_size}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"x must be [T, O], got shape {x.shape}")
    w, s = _q4_args(w, s, cols, group_size, x.shape[1], "w")
    cdef Py_ssize_t T = x.shape[0], O = x.shape[1], ng = (cols + group_size - 1) // group_size
    y = _out(out, T, cols, False)
    if T == 0 or cols == 0:
        return y
    if O == 0:
        y[...] = 0
        return y
    cdef const float[:, ::1] xv = x
    cdef const unsigned char[:, ::1] wv = w
    cdef const float[:, ::1] sv = s
    cdef float[:, ::1] yv = y
    cdef int nt = _qt_threads(O * cols * T, ng), t
    cdef Py_ssize_t gs = group_size, I = cols
    for t in prange(nt, nogil=True, num_threads=nt, schedule="static"):
        coli_q4t_cols(_level, <const uint8_t*>&wv[0, 0], &sv[0, 0], &xv[0, 0], T, O, I, gs,
                      &yv[0, 0], ng * t // nt, ng * (t + 1) // nt)
    return y


def q8_matmul_t(x, w, s, out=None):
    """y = x @ dequant(W) for int8 per-row W [O, I]: float32 [T, I], the transposed product
    (each column sums (x[o] * s[o]) * q[o, i] over o in order: the same bits for every SIMD
    variant and thread count)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    w = _as_bytes(w, np.int8, "w")
    s = np.ascontiguousarray(s, dtype=np.float32)
    if x.ndim != 2 or w.ndim != 2 or w.shape[0] != x.shape[1]:
        raise ValueError(f"x [T, O] and w [O, I] do not match: {x.shape}, {w.shape}")
    if s.ndim != 1 or s.shape[0] != w.shape[0]:
        raise ValueError(f"s must be [{w.shape[0]}], got shape {s.shape}")
    cdef Py_ssize_t T = x.shape[0], O = x.shape[1], I = w.shape[1], parts = (w.shape[1] + 63) // 64
    y = _out(out, T, I, False)
    if T == 0 or I == 0:
        return y
    if O == 0:
        y[...] = 0
        return y
    cdef const float[:, ::1] xv = x
    cdef const signed char[:, ::1] wv = w
    cdef const float[::1] sv = s
    cdef float[:, ::1] yv = y
    cdef int nt = _qt_threads(O * I * T, parts), t
    for t in prange(nt, nogil=True, num_threads=nt, schedule="static"):
        coli_q8t_cols(_level, <const int8_t*>&wv[0, 0], &sv[0], &xv[0, 0], T, O, I, &yv[0, 0],
                      min(I, parts * t // nt * 64), min(I, parts * (t + 1) // nt * 64))
    return y


cdef void* _rows_ptr(rows, Py_ssize_t D, int* half) except NULL:
    cdef const float[:, ::1] rf
    cdef const uint16_t[:, ::1] rh
    if rows.ndim != 2 or rows.shape[1] != D or rows.shape[0] == 0:
        raise ValueError(f"latent rows must be [S, {D}] with S > 0, got shape {rows.shape}")
    if rows.dtype == np.float16:
        half[0] = 1
        rh = rows.view(np.uint16)
        return <void*>&rh[0, 0]
    half[0] = 0
    rf = rows
    return <void*>&rf[0, 0]


def attend_latent(const float[:, ::1] q, rows, float scale, Py_ssize_t dv):
    """Attention of q [H, D] over latent rows [S, D] (keys and values alike, C-contiguous float32
    or float16, widened exactly): [H, dv], the first dv values of each head's output."""
    cdef Py_ssize_t H = q.shape[0], D = q.shape[1], S = rows.shape[0]
    cdef int half = 0, nt = get_num_threads()
    if not 0 < dv <= D:
        raise ValueError(f"attend_latent: dv must be in 1..{D}")
    cdef void* R = _rows_ptr(rows, D, &half)
    out = np.empty((H, dv), np.float32)
    cdef float[:, ::1] ov = out
    if H == 0:
        return out
    cdef float* work = <float*>_amalloc(coli_latent_floats(H, D, S, half, nt) * sizeof(float))
    if work == NULL:
        raise MemoryError()
    with nogil:
        coli_attend_latent(&q[0, 0], R, half, H, D, dv, S, scale, &ov[0, 0], work, nt, _level)
    _afree(work)
    return out


cdef class MLABlock:
    """Multi-head latent attention for one decode position as one compiled call (mla_block.h):
    x [1, hidden] -> (with in_norm) x + the block, or (in_norm None) o_proj's output of the
    normed input x; this position's latent row written into the cache. Int4 weights with one
    group size. The same bits as core.blocks.mla.MLAAttention's step-by-step composition with
    the compiled kernels (tests/test_mla_block.py). Built once per layer; arrays kept alive."""
    cdef coli_mla_w w
    cdef object _keep
    cdef float* _work         # scratch kept between calls (fresh pages cost more than the step)
    cdef size_t _cap
    cdef bint _busy

    def __dealloc__(self):
        _afree(self._work)

    def __init__(self, q_a, q, kv_a, kv_b, o, Py_ssize_t group_size, biases, in_norm, q_a_norm,
                 kv_a_norm, float eps, Py_ssize_t hidden, Py_ssize_t heads, Py_ssize_t q_lora_rank,
                 Py_ssize_t kv_lora_rank, Py_ssize_t qk_nope, Py_ssize_t qk_rope, Py_ssize_t v_head_dim):
        """q_a, q, kv_a, kv_b, o: (data, scales) of the int4 matrices (q_a None: q is q_proj);
        biases: (q_a, kv_a, o) vectors or None."""
        cdef Py_ssize_t qk = qk_nope + qk_rope, m
        cdef const unsigned char[:, ::1] wv
        cdef const float[:, ::1] sv
        if group_size < 2 or group_size % 2:
            raise ValueError(f"MLA block: group_size must be even and >= 2, got {group_size}")
        if heads <= 0 or kv_lora_rank <= 0 or qk_rope <= 0 or qk_rope % 2 or qk_nope <= 0 or v_head_dim <= 0:
            raise ValueError("MLA block: bad sizes")
        if (q_a is None) != (q_lora_rank == 0):
            raise ValueError("MLA block: q_a and q_lora_rank disagree")
        mats = [q_a, q, kv_a, kv_b, o]
        rows = (q_lora_rank, heads * qk, kv_lora_rank + qk_rope, heads * (qk_nope + v_head_dim), hidden)
        cols = (hidden, q_lora_rank if q_lora_rank else hidden, hidden, kv_lora_rank, heads * v_head_dim)
        cdef const uint8_t* wp[5]
        cdef const float* sp[5]
        for m in range(5):
            wp[m] = NULL
            sp[m] = NULL
            if mats[m] is None:
                continue
            wv = mats[m][0]
            sv = mats[m][1]
            if (wv.shape[0] != rows[m] or wv.shape[1] != (cols[m] + 1) // 2 or sv.shape[0] != rows[m]
                    or sv.shape[1] != (cols[m] + group_size - 1) // group_size):
                raise ValueError(f"MLA block: {('q_a', 'q', 'kv_a', 'kv_b', 'o')[m]} has the wrong shape")
            wp[m] = <const uint8_t*>&wv[0, 0]
            sp[m] = &sv[0, 0]
        self._keep = (mats, biases, in_norm, q_a_norm, kv_a_norm)
        self.w.wqa, self.w.wq, self.w.wkva, self.w.wkvb, self.w.wo = wp[0], wp[1], wp[2], wp[3], wp[4]
        self.w.sqa, self.w.sq, self.w.skva, self.w.skvb, self.w.so = sp[0], sp[1], sp[2], sp[3], sp[4]
        self.w.bqa = _vec_ptr(biases[0], q_lora_rank, "q_a bias") if q_lora_rank else NULL
        self.w.bkva = _vec_ptr(biases[1], kv_lora_rank + qk_rope, "kv_a bias")
        self.w.bo = _vec_ptr(biases[2], hidden, "o bias")
        self.w.in_norm = _vec_ptr(in_norm, hidden, "input norm")
        self.w.qa_norm = _vec_ptr(q_a_norm, q_lora_rank, "q_a norm") if q_lora_rank else NULL
        if q_lora_rank and self.w.qa_norm == NULL:
            raise ValueError("MLA block: the q_a norm is missing")
        self.w.kva_norm = _vec_ptr(kv_a_norm, kv_lora_rank, "kv_a norm")
        if self.w.kva_norm == NULL:
            raise ValueError("MLA block: the kv_a norm is missing")
        self.w.eps = eps
        self.w.gs = group_size
        self.w.hidden = hidden
        self.w.H = heads
        self.w.Q = q_lora_rank
        self.w.rank = kv_lora_rank
        self.w.nope = qk_nope
        self.w.rope = qk_rope
        self.w.v = v_head_dim

    def __call__(self, const float[:, ::1] x, const float[:, ::1] cos, const float[:, ::1] sin,
                 latent, Py_ssize_t pos, float scale):
        """x [1, hidden]; cos / sin [1, qk_rope] (the angles of pos); latent: the layer's cache
        [1, capacity, rank + rope], C-contiguous float32 or float16, capacity > pos. Returns
        [1, hidden]."""
        cdef Py_ssize_t D = self.w.rank + self.w.rope
        cdef int half = 0, nt = get_num_threads()
        if x.shape[0] != 1 or x.shape[1] != self.w.hidden:
            raise ValueError(f"MLA block: x must be [1, {self.w.hidden}]")
        if cos.shape[0] != 1 or sin.shape[0] != 1 or cos.shape[1] != self.w.rope or sin.shape[1] != self.w.rope:
            raise ValueError(f"MLA block: cos / sin must be [1, {self.w.rope}]")
        if latent.ndim != 3 or latent.shape[0] != 1 or not 0 <= pos < latent.shape[1]:
            raise ValueError("MLA block: the cache does not match (or pos is outside it)")
        if not latent.flags.c_contiguous or not latent.flags.writeable:
            raise ValueError("MLA block: the cache must be writeable and C-contiguous")
        cdef void* R = _rows_ptr(latent[0], D, &half)
        out = np.empty((1, self.w.hidden), np.float32)
        cdef float[:, ::1] ov = out
        cdef size_t need = coli_mla_block_floats(&self.w, pos + 1, half, nt)
        cdef float* work
        cdef bint own = self._busy      # a concurrent call (another thread): scratch of its own
        if own:
            work = <float*>_amalloc(need * sizeof(float))
        else:
            if need > self._cap:
                _afree(self._work)
                self._cap = 0
                self._work = <float*>_amalloc(need * 2 * sizeof(float))
                if self._work != NULL:
                    self._cap = need * 2
            work = self._work
            self._busy = True
        if work == NULL:
            self._busy = False if not own else self._busy
            raise MemoryError()
        try:
            with nogil:
                coli_mla_block(&self.w, &x[0, 0], &cos[0, 0], &sin[0, 0], R, half, pos, scale,
                               &ov[0, 0], nt, _level, _int8_act and coli_q4i8_ok(_level, self.w.gs),
                               work)
        finally:
            if own:
                _afree(work)
            else:
                self._busy = False
        return out
