"""Matrix products over container weights: the compiled kernels, or the numpy reference.

``COLI_KERNELS=numpy`` forces the reference path (tests compare the two). If the compiled
extension is missing (a broken build), we fall back to numpy with a warning rather than fail.
"""
from __future__ import annotations

import os
import sys
import threading

import numpy as np

from . import quant
from .container import Weight

# OpenMP threads spin only briefly (10,000 polls, tens of microseconds) at the end of a parallel
# region before they sleep. libgomp's default (300,000) keeps the team spinning between regions:
# when other processes keep the cores busy the spinners and a descheduled team member make every
# region wait for a time slice, and 2-thread decode fell to 0.2-1.2 tok/s (1 thread: 6.5).
# Sleeping at once (OMP_WAIT_POLICY=passive) avoids that but costs a wake-up per region, which
# on a VM is slow: measured 67-71 ms/token quiet vs 60 ms with the short spin, and 160 ms vs
# 167 ms under load (benchmarks/README.md). Read by libgomp when the extension loads; a user's
# own OMP_WAIT_POLICY / GOMP_SPINCOUNT wins. (LLVM's libomp, e.g. macOS: KMP_BLOCKTIME.)
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

_compiled = None
if os.environ.get("COLI_KERNELS", "").lower() != "numpy":
    try:
        from cython_kernels import qmatmul as _compiled
    except ImportError as e:  # pragma: no cover - depends on the build
        print(f"colibri: compiled kernels unavailable ({e}); using the slow numpy path",
              file=sys.stderr)


def backend() -> str:
    return "cython" if _compiled is not None else "numpy"


def default_threads() -> int:
    """Physical cores: decode is bandwidth-bound and SMT siblings only contend for it."""
    import psutil
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def set_threads(n: int | None) -> None:
    """Compute threads for the kernels (None: physical cores). numpy's BLAS (the prefill sgemm,
    the router, attention scores) keeps its own default on purpose: OpenBLAS's results depend on
    its thread count, so tying it to ``--threads`` made logits differ between 1 and 2 threads
    (tried with threadpoolctl; tests/test_store.py caught it)."""
    if _compiled is not None:
        _compiled.set_num_threads(int(n) if n else default_threads())


def thread_governor():
    """The default thread count that follows the machine's load (core.threads), or None without
    the compiled kernels (the numpy path has no thread count of ours)."""
    if _compiled is None:
        return None
    import psutil

    from .threads import ThreadGovernor
    return ThreadGovernor(default_threads(), psutil.cpu_count(logical=True) or default_threads(),
                          lambda n: _compiled.set_num_threads(n))


def get_threads() -> int:
    return _compiled.get_num_threads() if _compiled is not None else 1


def set_int8_activations(on: bool) -> None:
    """The opt-in int8-activation path of the compiled int4 products (see qmatmul)."""
    if _compiled is not None:
        _compiled.set_int8_activations(bool(on))


def simd_level() -> str:
    return _compiled.simd_level() if _compiled is not None else "numpy"


def openmp_enabled() -> bool:
    return bool(_compiled is not None and _compiled.openmp_enabled())


# Prefill: an int4 matrix applied to at least this many rows runs in the prefill GEMM
# (PREFILL_GEMM, below) or, without it, is dequantized to float32 and handed to numpy's sgemm
# (OpenBLAS); either runs at several times the FLOP rate of the widen-and-FMA kernel once the
# unpacking is shared by enough rows (benchmarks/README.md). The choice depends on
# the row count only -- never on placement -- so it cannot make output depend on where experts
# live. COLI_SGEMM_ROWS overrides it (0: never).
SGEMM_MIN_ROWS = int(os.environ.get("COLI_SGEMM_ROWS", "32") or 0)


def _sgemm_rows(n: int) -> bool:
    return _compiled is not None and SGEMM_MIN_ROWS > 0 and n >= SGEMM_MIN_ROWS


_scratch = threading.local()


def _dequantized(w: Weight) -> np.ndarray:
    """W as float32 in a per-thread buffer reused across calls (fresh pages cost more than the
    unpacking itself); valid until the thread's next call. Unpacked on the calling thread alone:
    after each sgemm OpenBLAS's worker threads keep spinning for a while, and an OpenMP team on
    the same cores then waits for time slices (1024x2048: 0.16 ms with 2 threads on an idle
    machine, 0.83 ms between sgemm calls, 0.36 ms on one thread; 512-token prefill of the OLMoE
    geometry 8-10 % faster, benchmarks/README.md)."""
    n = w.shape[0] * w.shape[1]
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n:
        buf = _scratch.buf = np.empty(n, np.float32)
    return _compiled.q4_dequantize(w.data, w.scales, w.shape[1], w.group_size,
                                   out=buf[:n].reshape(w.shape), threads=1)


def _dense_compiled() -> bool:
    """Whether dense float32 products (bits-16 weights, routers) run in the compiled row-invariant
    kernel (cython_kernels/dense.h): y[t, o] summed in 16 fused multiply-add lanes over k and a
    fixed tree, the same bits for one row and many, any thread count and every SIMD variant, so
    a bits-16 model's decode gives the bits of its prefill (numpy sends one row to sgemv and many
    to sgemm, which sum in other orders: ~1e-4 of the logits apart on the Qwen3.5 fixtures). On
    x86 without hardware FMA (the portable variant: fmaf is a library call) numpy runs instead,
    as the int4 prefill GEMM does. The choice depends on the CPU, never on placement."""
    return (_compiled is not None and hasattr(_compiled, "dense_matmul")
            and _compiled.dense_level() != "portable")


def matmul(x: np.ndarray, w: Weight) -> np.ndarray:
    """y = x @ W.T for x float32 [T, I]; returns float32 [T, O]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if w.scheme == "dense":
        if _dense_compiled():
            return _compiled.dense_matmul(x, w.data)
        return x @ w.data.T
    if w.scheme == "int4":
        cols = w.shape[1]
        if _gemm_rows(x.shape[0]):
            return _compiled.q4_prefill_many(x, [(w.data, w.scales)], cols, w.group_size)[0]
        if _sgemm_rows(x.shape[0]):
            return x @ _dequantized(w).T
        if _compiled is not None:
            return _compiled.q4_matmul(x, w.data, w.scales, cols, w.group_size)
        return quant.matmul_int4_ref(x, w.data, w.scales, cols, w.group_size)
    if w.scheme == "int8":
        if _compiled is not None:
            return _compiled.q8_matmul(x, w.data, w.scales)
        return quant.matmul_int8_ref(x, w.data, w.scales)
    if w.scheme == quant.FP4:
        if _fp4_compiled():
            return _compiled.fp4_matmul(x, w.data, w.scales, w.shape[1])
        return quant.matmul_fp4_ref(x, w.data, w.scales, w.shape[1])
    raise ValueError(f"unknown weight scheme {w.scheme}")


def _fp4_compiled() -> bool:
    """Whether FP4 products run in the compiled kernels (cython_kernels/fp4.h: dense.h's summation
    order over the decoded weights, the same bits for every row count, thread count and variant);
    like the dense products, not on x86's portable variant (no hardware FMA), where numpy runs
    x @ dequant(W).T. The choice depends on the CPU, never on placement."""
    return _compiled is not None and hasattr(_compiled, "fp4_matmul") and _compiled.fp4_level() != "portable"


def rows(w: Weight, ids: np.ndarray) -> np.ndarray:
    """Rows of a matrix as float32 (embedding lookup)."""
    if w.scheme == "dense":
        return w.data[ids].astype(np.float32)
    if w.scheme == "int8":
        return quant.dequantize_int8(w.data[ids], w.scales[ids])
    if w.scheme == "int4":
        return quant.dequantize_int4(w.data[ids], w.scales[ids], w.shape[1], w.group_size)
    if w.scheme == quant.FP4:
        return quant.dequantize_fp4(w.data[ids], w.scales[ids], w.shape[1])
    raise ValueError(f"unknown weight scheme {w.scheme}")


def vector(w: Weight) -> np.ndarray:
    if w.scheme != "dense":
        raise ValueError("expected an unquantized vector")
    return w.data.astype(np.float32, copy=False)


def _same_int4(ws: list[Weight]) -> bool:
    """All int4 with one column count and group size: one compiled pass can run them."""
    w0 = ws[0]
    return _compiled is not None and all(
        w.scheme == "int4" and w.shape[1] == w0.shape[1] and w.group_size == w0.group_size for w in ws)


# Int4 products of at least SGEMM_MIN_ROWS rows (prefill) run in the compiled prefill GEMM
# (cython_kernels/prefill.h) instead of dequantize + sgemm: the MoE block's experts (each over
# the few dozen tokens routed to it) all in one OpenMP region, q/k/v in another, each block of
# weight rows dequantized next to its multiply, no OpenBLAS pool between the kernels' regions
# (a 512-token prefill of the OLMoE geometry: benchmarks/README.md). Its bits are the same for
# every SIMD variant, thread count and grouping (one fused multiply-add chain per output), not
# sgemm's. Where the CPU has no hardware FMA for it (the portable variant on x86) sgemm runs
# instead. Like the sgemm choice it depends on the row count only, never on placement.
# COLI_PREFILL_GEMM=0: dequantize + sgemm as before.
PREFILL_GEMM = os.environ.get("COLI_PREFILL_GEMM", "1") != "0"


def _gemm_rows(n: int) -> bool:
    return (PREFILL_GEMM and _sgemm_rows(n) and hasattr(_compiled, "q4_prefill_many")
            and _compiled.prefill_level() != "portable")


def matmul_many(x: np.ndarray, ws: list[Weight], rows: list[tuple[int, int]] | None = None,
                outs: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """[x[t0:t0+n] @ W.T for each W] (rows: (t0, n) per matrix, default all of x; outs: arrays to
    write into). Int4 matrices sharing a shape run as one parallel pass -- one OpenMP region
    instead of one per matrix: the int4 loops below SGEMM_MIN_ROWS rows, the prefill GEMM from
    there; FP4 matrices in one pass too -- with the same bits as separate ``matmul`` calls."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows = rows or [(0, x.shape[0])] * len(ws)
    res = list(outs) if outs is not None else [None] * len(ws)
    done = set()
    for group, call in ((_small_group(ws, rows), "q4_matmul_many"),
                        (_gemm_group(ws, rows), "q4_prefill_many")):
        if not group:
            continue
        w0 = ws[group[0]]
        got = getattr(_compiled, call)(x, [(ws[m].data, ws[m].scales) for m in group], w0.shape[1],
                                       w0.group_size, [rows[m] for m in group],
                                       None if outs is None else [outs[m] for m in group])
        for m, y in zip(group, got):
            res[m] = y
        done.update(group)
    fp4 = _fp4_group(ws)
    if fp4:         # FP4 matrices of one column count: one pass whatever their row counts
        got = _compiled.fp4_matmul_many(x, [(ws[m].data, ws[m].scales) for m in fp4], ws[fp4[0]].shape[1],
                                        [rows[m] for m in fp4], None if outs is None else [outs[m] for m in fp4])
        for m, y in zip(fp4, got):
            res[m] = y
        done.update(fp4)
    for m in range(len(ws)):
        if m in done:
            continue
        t0, n = rows[m]
        y = matmul(x[t0: t0 + n], ws[m])
        if outs is None:
            res[m] = y
        else:
            outs[m][...] = y
    return res


def _small_group(ws: list[Weight], rows) -> list[int]:
    """The matrices below the sgemm row count, when several can share one compiled pass."""
    group = [m for m, (_, n) in enumerate(rows) if not _sgemm_rows(n)]
    return group if len(group) >= 2 and _same_int4([ws[m] for m in group]) else []


def _fp4_group(ws: list[Weight]) -> list[int]:
    """The FP4 matrices, when they share a column count and run compiled."""
    group = [m for m, w in enumerate(ws) if w.scheme == quant.FP4]
    return group if group and _fp4_compiled() and len({ws[m].shape[1] for m in group}) == 1 else []


def _gemm_group(ws: list[Weight], rows) -> list[int]:
    """The int4 matrices (of one column count and group size) for the prefill GEMM."""
    group = [m for m, (_, n) in enumerate(rows) if _gemm_rows(n) and ws[m].scheme == "int4"]
    return group if group and _same_int4([ws[m] for m in group]) else []


def spans(counts) -> list[tuple[int, int]]:
    """(start, count) of consecutive blocks of the given row counts, stacked in order."""
    out, at = [], 0
    for n in counts:
        out.append((at, n))
        at += n
    return out


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) in float32 (exp overflows to inf for very negative x: the result is -0)."""
    with np.errstate(over="ignore"):
        return x * (np.float32(1.0) / (np.float32(1.0) + np.exp(-x)))


def sigmoid_gate(out: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """out * sigmoid(gate), float32 [T, n] (gated attention's output gate; out may be overwritten).
    With the extension, at every length: the compiled attention block's own function (libm's
    expf), so the step-by-step decode has the block's bits and prefill the decode's (decode vs
    prefill is then the products' rounding alone); otherwise numpy's 1 / (1 + exp(-gate))."""
    if _compiled is not None:
        out = np.ascontiguousarray(out, dtype=np.float32)
        _compiled.sigmoid_gate(out, np.ascontiguousarray(gate, dtype=np.float32))
        return out
    with np.errstate(over="ignore"):
        return out * (np.float32(1.0) / (np.float32(1.0) + np.exp(-gate)))


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u with silu's float32 operations (the same bits), computed in place: u is
    overwritten with the result, one temporary instead of five (a 512-token prefill's [4096,
    1024] per layer: 18-20 -> 11 ms)."""
    t = np.negative(g)
    with np.errstate(over="ignore"):
        np.exp(t, out=t)
    np.add(np.float32(1.0), t, out=t)
    np.divide(np.float32(1.0), t, out=t)
    np.multiply(g, t, out=t)
    return np.multiply(t, u, out=u)


def swiglu_many(x: np.ndarray, ffns: list, rows: list[tuple[int, int]],
                out: np.ndarray | None = None, limit: float | None = None) -> np.ndarray:
    """down(silu(gate(x_e)) * up(x_e)) for each expert e over its rows x[t0:t0+n], stacked in
    expert order ([sum n, H], written into ``out`` when given): gate and up of every expert in one
    pass, silu once over all of them, then every down in one pass. Per row the same operations as
    ``expert_ffn`` (below SGEMM_MIN_ROWS rows; from there the prefill GEMM's). ``limit``: the
    clamped SwiGLU (DeepSeek V4, GLM-5.3-Flash): gate to <= limit, up to [-limit, limit]."""
    stacked = spans(n for _, n in rows)
    total = sum(n for _, n in rows)
    inter = ffns[0].gate.shape[0] if ffns else 0
    g = np.empty((total, inter), np.float32)
    u = np.empty((total, inter), np.float32)
    matmul_many(x, [w for f in ffns for w in (f.gate, f.up)], [r for r in rows for _ in (0, 1)],
                [a[t: t + n] for t, n in stacked for a in (g, u)])
    if limit is not None:
        np.minimum(g, np.float32(limit), out=g)
        np.clip(u, np.float32(-limit), np.float32(limit), out=u)
    h = silu_mul(g, u)
    y = np.empty((total, ffns[0].down.shape[0] if ffns else 0), np.float32) if out is None else out
    matmul_many(h, [f.down for f in ffns], stacked, [y[t: t + n] for t, n in stacked])
    return y


def rank_combine(y: np.ndarray, slots: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The MoE block's prefill sum: [T, H] with out[t] = y[slots[t, 0]] w[t, 0] + y[slots[t, 1]]
    w[t, 1] + ... in rank order -- contrib = y[slots] * w, then added rank by rank (numpy's
    add.reduce over the ranks, the reference) -- compiled and parallel over tokens without the
    [T, k, H] array in between; the same bits."""
    if _compiled is not None and hasattr(_compiled, "rank_combine"):
        return _compiled.rank_combine(y, np.ascontiguousarray(slots, dtype=np.int64),
                                      np.ascontiguousarray(weights, dtype=np.float32))
    return np.add.reduce(y[slots] * weights[:, :, None], axis=1)


def swiglu_one(x: np.ndarray, ffns: list, out: np.ndarray, at: list[int], limit: float | None = None) -> None:
    """Decode: out[at[i]] = down_i(silu(gate_i(x)) * up_i(x)) for the one row x [1, H] -- the
    values of ``swiglu_many`` over the same experts. Int4 experts (every container we write) run
    as one compiled call (cython_kernels.qmatmul.swiglu_one), without swiglu_many's per-matrix
    Python work (~0.1 ms per layer)."""
    if _compiled is not None and ffns and limit is None and all(
            f.gate.scheme == f.up.scheme == f.down.scheme == "int4"
            and f.gate.group_size == f.down.group_size == ffns[0].gate.group_size for f in ffns):
        _compiled.swiglu_one(x, [(f.gate.data, f.gate.scales, f.up.data, f.up.scales, f.down.data,
                                  f.down.scales) for f in ffns], ffns[0].gate.group_size, out, at)
        return
    out[at] = swiglu_many(x, ffns, [(0, 1)] * len(ffns), limit=limit)


def attention_block(proj: list, biases: list, in_norm: np.ndarray, qk_norm: str, q_norm, k_norm,
                    eps: float, clip, heads: int, kv_heads: int, head_dim: int, router=None,
                    post_norm=None, top_k: int = 0, norm_topk: bool = False, rope_dim: int = 0,
                    gated: bool = False):
    """A layer's attention block for one decode position as one compiled call
    (cython_kernels/attention_block.h), or None where it does not apply: no extension, or q, k,
    v, o not all int4 with one group size. Called as block(x, cos, sin, keys, values, pos, lo,
    scale) -> x + the block's output, with the same bits as rms_norm, matmul_many, the q/k
    norms, rope, the KV append, attention and matmul called one by one. With a router (float32
    [experts, hidden]) the block also returns the MoE input rms_norm(x', post_norm) and the
    router's softmax_topk: (x', h, top, weights). With the opt-in int8 activations on, its
    products take that path as matmul's do. gated: q's rows per head [q_h | gate_h], the
    attention times sigmoid_gate's sigmoid(gate) before o."""
    if _compiled is None or not all(w.scheme == "int4" and w.group_size == proj[0].group_size
                                    for w in proj):
        return None
    try:
        partial = {"rope_dim": rope_dim} if rope_dim else {}     # RoPE on the first dims only
        if gated:
            partial["gated"] = True
        return _compiled.AttentionBlock([(w.data, w.scales) for w in proj], proj[0].group_size,
                                        biases, in_norm, qk_norm, q_norm, k_norm, eps, clip, heads,
                                        kv_heads, head_dim, post_norm, router, top_k, norm_topk,
                                        **partial)
    except ValueError:      # shapes the block does not take: the step-by-step path reports them
        return None


def rank_sum(c: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[1, H] = c[0] w[0] + c[1] w[1] + ... in rank order (c [k, H], w [k]): the decode MoE block's
    output, one compiled call instead of two numpy passes (same bits)."""
    if _compiled is not None:
        return _compiled.rank_sum(c, np.ascontiguousarray(w, dtype=np.float32))
    return np.add.reduce(c * w[:, None], axis=0, keepdims=True)


# --- the per-layer operations around the products ----------------------------------------------
# Compiled (cython_kernels/layer_ops.h) when the extension is there; the numpy expressions below
# are the reference (COLI_KERNELS=numpy, and what the tests compare against).

def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """w * x / sqrt(mean(x^2) + eps) over the last axis."""
    if _compiled is None:
        var = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
        return w * (x * (np.float32(1.0) / np.sqrt(var + np.float32(eps))))
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    return _compiled.rms_norm(x2, np.ascontiguousarray(w, dtype=np.float32), eps).reshape(x.shape)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary embedding of x [T, heads, D] (cos / sin [T, D]), rotate_half convention. May
    overwrite x (callers pass a temporary); the same bits either way."""
    if _compiled is None:
        half = x.shape[-1] // 2
        rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos[:, None, :] + rot * sin[:, None, :]
    x = np.ascontiguousarray(x, dtype=np.float32)
    _compiled.rope_(x, np.ascontiguousarray(cos, dtype=np.float32),
                    np.ascontiguousarray(sin, dtype=np.float32))
    return x


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def window_start(pos: int, window: int | None) -> int:
    """The first cache position a query at ``pos`` attends to (a sliding window, or 0)."""
    return max(0, pos - window + 1) if window is not None else 0


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: np.float32,
              pos: np.ndarray, window: int | None, allowed: np.ndarray | None = None) -> np.ndarray:
    """Causal attention (optionally a sliding window) of q [T, heads, D] at positions pos against
    the cache keys / values [kv_heads, S, D]; returns [T, heads * D]. Query head h reads kv head
    h // (heads // kv_heads). ``allowed`` [T, S] (bool): the positions each query row sees
    instead of the causal / window rule (a sparse-attention selection; numpy path)."""
    T, H, D = q.shape
    KV = keys.shape[0]
    if T == 1 and _compiled is not None and allowed is None:
        lo = window_start(int(pos[0]), window)
        q1 = np.ascontiguousarray(q[0], dtype=np.float32)
        if keys.dtype == np.float16:       # an opt-in float16 cache: widened in the kernel
            return _compiled.attend_one_f16(q1, keys.view(np.uint16), values.view(np.uint16),
                                            float(scale), lo)
        return _compiled.attend_one(q1, keys, values, float(scale), lo)
    if keys.dtype != np.float32:
        keys, values = keys.astype(np.float32), values.astype(np.float32)
    if T > ATTENTION_QUERY_BLOCK:     # bounded scores: [kv, G, block, S] at a time
        B = ATTENTION_QUERY_BLOCK
        return np.concatenate([attention(q[t: t + B], keys, values, scale, pos[t: t + B], window,
                                         None if allowed is None else allowed[t: t + B])
                               for t in range(0, T, B)])
    qg = q.reshape(T, KV, H // KV, D).transpose(1, 2, 0, 3)                             # [kv, G, T, D]
    scores = np.matmul(qg, keys.transpose(0, 2, 1)[:, None])                            # [kv, G, T, S]
    scores *= scale
    if allowed is None:
        kpos = np.arange(keys.shape[1])
        allowed = kpos[None, :] <= pos[:, None]
        if window is not None:
            allowed &= kpos[None, :] > pos[:, None] - window
    # softmax in place (the values of softmax(np.where(allowed, scores, -inf)), without its four
    # [kv, G, T, S] temporaries: a 512-token prompt spent ~25 ms per layer in them)
    np.copyto(scores, -np.inf, where=~allowed[None, None])
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, values[:, None])                                            # [kv, G, T, D]
    return out.transpose(2, 0, 1, 3).reshape(T, H * D)


# Query rows per block of a prefill's attention: the scores are heads x rows x S floats (256 rows
# x 8192 positions x 16 heads = 128 MiB), whatever the prompt's length.
ATTENTION_QUERY_BLOCK = 256


# Router logits of fewer rows than this (decode, short prompts) are computed on the calling
# thread: OpenBLAS threads a [16, 2048] x [2048, 64] product, and its workers keep spinning
# afterwards while the experts' OpenMP region needs the cores (a 16-token prefill of the OLMoE
# geometry took 1.2 s instead of 0.8). The route depends on the row count only.
ROUTER_C_ROWS = 32


def router_logits(h: np.ndarray, router: np.ndarray) -> np.ndarray:
    """h [T, H] @ router.T (float32 [E, H]): the row-invariant dense kernel at every row count
    (one thread below ROUTER_C_ROWS; the compiled attention block's router has its bits), so
    decode and prefill route from the same logits; on the portable variant (see _dense_compiled)
    the C dot products below ROUTER_C_ROWS and numpy above."""
    if _dense_compiled():
        return _compiled.dense_matmul(h, router, threads=1 if h.shape[0] < ROUTER_C_ROWS else 0)
    if _compiled is not None and h.shape[0] < ROUTER_C_ROWS:
        return _compiled.router_logits(np.ascontiguousarray(h, dtype=np.float32),
                                       np.ascontiguousarray(router, dtype=np.float32))
    return h @ router.T


def softmax_topk(logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """Router: softmax per row of logits [T, E], the k most probable experts (ties: the lower
    index first) and their probabilities, renormalised to sum 1 when norm."""
    if _compiled is not None:
        return _compiled.softmax_topk(np.ascontiguousarray(logits, dtype=np.float32), k, norm)
    probs = softmax(logits)
    top = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, top, axis=1)
    if norm:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return top, weights.astype(np.float32)


# --- multi-head latent attention (core.blocks.mla; cython_kernels/mla_block.h) -----------------

def weight_rows(w: Weight, r0: int, r1: int) -> Weight:
    """Rows [r0, r1) of a matrix, in its own scheme (views of its bytes and scales, no copy)."""
    if w.scheme == "dense":
        return Weight("dense", (r1 - r0, w.shape[1]), w.data[r0:r1])
    if w.scheme in ("int4", "int8", quant.FP4):
        return Weight(w.scheme, (r1 - r0, w.shape[1]), w.data[r0:r1], w.scales[r0:r1], w.group_size)
    raise ValueError(f"unknown weight scheme {w.scheme}")


def matmul_t(x: np.ndarray, w: Weight) -> np.ndarray:
    """y = x @ W for x float32 [T, O] and W [O, I] (the transposed product of ``matmul``);
    returns float32 [T, I]. Compiled int4 / int8 (the same bits for every SIMD variant and thread
    count: each column sums its O terms in order); from SGEMM_MIN_ROWS rows an int4 W is
    dequantized and handed to sgemm, as matmul does; dense: the compiled kernel (one fused
    multiply-add chain per column over O in order, the same bits at every row count; see
    _dense_compiled), else x @ W; the numpy path: x @ dequant(W)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if w.scheme == "dense":
        if _dense_compiled():
            return _compiled.dense_matmul_t(x, w.data)
        return x @ np.asarray(w.data, dtype=np.float32)
    if w.scheme == "int4":
        if _compiled is not None and not _sgemm_rows(x.shape[0]):
            return _compiled.q4_matmul_t(x, w.data, w.scales, w.shape[1], w.group_size)
        if _compiled is not None:
            return x @ _dequantized(w)
        return x @ quant.dequantize_int4(w.data, w.scales, w.shape[1], w.group_size)
    if w.scheme == "int8":
        if _compiled is not None:
            return _compiled.q8_matmul_t(x, w.data, w.scales)
        return x @ quant.dequantize_int8(w.data, w.scales)
    raise ValueError(f"unknown weight scheme {w.scheme}")


def attend_latent(q: np.ndarray, rows: np.ndarray, scale: np.float32, dv: int) -> np.ndarray:
    """One position's attention of q [heads, D] over the latent rows [S, D] (keys and values
    alike, float32 or the opt-in float16): [heads, dv], each head's first dv output values.
    Compiled: the rows are read once for all heads (cython_kernels/mla_block.h); numpy: the
    one-kv-head case of ``attention``."""
    if _compiled is not None:
        return _compiled.attend_latent(np.ascontiguousarray(q, dtype=np.float32), rows, float(scale), dv)
    H, D = q.shape
    out = attention(q[None], rows[None], rows[None], scale, np.array([rows.shape[0] - 1]), None)
    return out.reshape(H, D)[:, :dv]


def mla_block(mats: dict, biases: tuple, in_norm, q_a_norm, kv_a_norm, eps: float, hidden: int,
              heads: int, q_lora_rank: int, kv_lora_rank: int, qk_nope: int, qk_rope: int,
              v_head_dim: int):
    """Multi-head latent attention for one decode position as one compiled call
    (cython_kernels/mla_block.h), or None where it does not apply: no extension, or the matrices
    (mats: q_a (with a q-LoRA), q (q_b or q_proj), kv_a, kv_b, o) not all int4 with one group
    size. Called as block(x, cos, sin, latent, pos, scale) -> [1, hidden]: with in_norm, x + the
    block; without, o_proj's output of the normed input x. The same bits as
    core.blocks.mla.MLAAttention's step-by-step composition of these kernels."""
    ws = [w for w in mats.values() if w is not None]
    if _compiled is None or not all(w.scheme == "int4" and w.group_size == ws[0].group_size for w in ws):
        return None
    pair = lambda w: None if w is None else (w.data, w.scales)
    try:
        return _compiled.MLABlock(pair(mats.get("q_a")), pair(mats["q"]), pair(mats["kv_a"]),
                                  pair(mats["kv_b"]), pair(mats["o"]), ws[0].group_size, biases,
                                  in_norm, q_a_norm, kv_a_norm, eps, hidden, heads, q_lora_rank,
                                  kv_lora_rank, qk_nope, qk_rope, v_head_dim)
    except ValueError:      # shapes the block does not take: the step-by-step path runs instead
        return None


# --- linear attention (core.blocks.linear_attention; cython_kernels/linear_attention.h) ----------

def linear_attention_kernels():
    """The compiled Gated DeltaNet core (``gdn_block`` and its pieces ``gdn_conv``,
    ``l2norm_rows``, ``gdn_gates``, ``delta_rule``, ``gated_norm``), or None: no extension, or one
    built before it (the numpy reference runs instead)."""
    return _compiled if _compiled is not None and hasattr(_compiled, "gdn_block") else None


def kda_kernels():
    """The compiled KDA core (Kimi-Linear; cython_kernels/kda_block.h: ``kda_block`` and its pieces
    ``gdn_conv``, ``kda_l2norm_rows``, ``kda_gates``, ``kda_delta_rule``, ``kda_norm``), or None: no
    extension, or one built before it (the numpy reference runs instead)."""
    return _compiled if _compiled is not None and hasattr(_compiled, "kda_block") else None
