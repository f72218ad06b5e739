"""Shared-KV multi-query attention (DeepSeek V4; transformers' ``DeepseekV4Attention``): one
key head that is also the value (K = V = norm(kv_proj x)), queries from a low-rank q
(q_a -> weighted norm -> q_b -> unweighted norm per head), interleaved RoPE (pairs -> pairs) on
the *last* rope dims of q and kv, a per-head learned sink in the softmax, a sliding window over
a ring of the last keys (core.cache_kinds.Ring), the rope slice of the output rotated back at the query's
position (V was rotated with K), and a grouped low-rank output projection (``o_a`` per group of
heads, then ``o_b``). ``extra``: a block that adds keys the window does not hold (DeepSeek V4's
compressed entries) with the rows each query may see. float32 numpy (no compiled path yet)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import kernels
from ..cache_kinds import Ring
from .common import Need, load_needs
from .linear_attention import check_folded
from .mhc import unweighted_rms_norm


def rope_pairs_tail(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Interleaved RoPE on the last 2 * cos.shape[-1] dims of x [T, heads, D]: pair (2i, 2i+1)
    of the slice turned by the angle of cos[:, i] / sin[:, i] ([T, rope / 2]); a new array."""
    r = 2 * cos.shape[-1]
    even, odd = x[..., x.shape[-1] - r:: 2], x[..., x.shape[-1] - r + 1:: 2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.array(x, dtype=np.float32)
    out[..., x.shape[-1] - r:: 2] = even * c - odd * s
    out[..., x.shape[-1] - r + 1:: 2] = odd * c + even * s
    return out


def pair_tables(cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """core.rope's tables ([T, rope], each frequency twice: [f | f]) as one column per pair."""
    half = cos.shape[-1] // 2
    return cos[:, :half], sin[:, :half]


def attend_with_sinks(q: np.ndarray, keys: np.ndarray, allowed: np.ndarray, sinks: np.ndarray,
                      scale: np.float32) -> np.ndarray:
    """softmax([q.k * scale | sink_h]) without the sink's column, times keys (K = V): q [T, heads,
    D], keys [S, D], allowed [T, S] (every row sees at least one key); returns [T, heads, D]."""
    out = np.empty(q.shape, np.float32)
    B = kernels.ATTENTION_QUERY_BLOCK
    sink = sinks[:, None, None]
    for t in range(0, q.shape[0], B):         # bounded scores: [heads, block, S] at a time
        s = np.matmul(q[t: t + B].transpose(1, 0, 2), keys.T) * scale               # [heads, b, S]
        s = np.where(allowed[None, t: t + B], s, np.float32(-np.inf))
        m = np.maximum(s.max(axis=-1, keepdims=True), sink)
        e = np.exp(s - m)
        p = e / (e.sum(axis=-1, keepdims=True) + np.exp(sink - m))
        out[t: t + B] = np.matmul(p, keys).transpose(1, 0, 2)
    return out


@dataclass(frozen=True)
class SharedKV:
    hidden: int
    heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    rope: str = "main"          # the named rotary table (step.rope) of q and kv
    # declaration of a block adding keys (tensors(p) / build(c, p, eps) / cache_kinds(), under
    # the attention's own prefix)
    extra: object = None

    def cache_kind(self):
        """The window's shared keys (core.cache_kinds.Ring, one ``kv`` row per position), then what
        ``extra`` keeps."""
        return (Ring(1, self.head_dim, self.window, ("kv",)),) + (tuple(self.extra.cache_kinds()) if self.extra else ())

    def tensors(self, p: str) -> list[Need]:
        return self.own_tensors(p) + (self.extra.tensors(p) if self.extra else [])

    def own_tensors(self, p: str) -> list[Need]:
        """DeepSeek's names (what transformers' save_pretrained writes): wq_a, q_norm (of the q
        LoRA), wq_b, wkv, norm (of kv), wo_a, wo_b, attn_sink."""
        H, D, G = self.hidden, self.head_dim, self.o_groups
        return [Need(p + "wq_a.weight", (self.q_lora_rank, H)), Need(p + "q_norm.weight", (self.q_lora_rank,)),
                Need(p + "wq_b.weight", (self.heads * D, self.q_lora_rank)),
                Need(p + "wkv.weight", (D, H)), Need(p + "norm.weight", (D,)),
                Need(p + "wo_a.weight", (G * self.o_lora_rank, self.heads * D // G)),
                Need(p + "wo_b.weight", (H, G * self.o_lora_rank)), Need(p + "attn_sink", (self.heads,))]

    def build(self, c, p: str, eps: float) -> "SharedKVAttention":
        return SharedKVAttention(self, c, p, eps)


class SharedKVAttention:
    def __init__(self, spec: SharedKV, c, p: str, eps: float):
        self.spec, self.eps = spec, eps
        w = load_needs(c, spec.own_tensors(p), p)
        self.q_a, self.q_b, self.kv, self.o_b = (w[n + ".weight"] for n in ("wq_a", "wq_b", "wkv", "wo_b"))
        self.q_a_norm, self.kv_norm = kernels.vector(w["q_norm.weight"]), kernels.vector(w["norm.weight"])
        # o_a [G * R, heads * D / G] as G row blocks [R, heads * D / G], in the container's scheme
        o_a, R = w["wo_a.weight"], spec.o_lora_rank
        self.o_a = [kernels.weight_rows(o_a, g * R, (g + 1) * R) for g in range(spec.o_groups)]
        self.sinks = kernels.vector(w["attn_sink"])
        self.extra = spec.extra.build(c, p, eps) if spec.extra else None
        self.scale = np.float32(1.0 / math.sqrt(spec.head_dim))

    def __call__(self, i: int, h: np.ndarray, step) -> np.ndarray:
        s, T = self.spec, h.shape[0]
        cos, sin = pair_tables(*step.rope(s.rope))
        q_res = kernels.rms_norm(kernels.matmul(h, self.q_a), self.q_a_norm, self.eps)
        q = unweighted_rms_norm(kernels.matmul(q_res, self.q_b).reshape(T, s.heads, s.head_dim), self.eps)
        q = rope_pairs_tail(q, cos, sin)
        kv = kernels.rms_norm(kernels.matmul(h, self.kv), self.kv_norm, self.eps)
        kv = rope_pairs_tail(kv[:, None, :], cos, sin)[:, 0]
        cache = step.cache
        check_folded(i, cache.folded, cache)        # the ring and compressors fold positions in
        rows, start = cache.append_part(i, "kv", kv[:, None, :])
        keys = np.asarray(rows[0], dtype=np.float32)
        kpos = start + np.arange(len(keys))
        allowed = (kpos[None, :] <= step.pos[:, None]) & (kpos[None, :] > step.pos[:, None] - s.window)
        if self.extra is not None:
            more, sees = self.extra(i, h, q_res, step)
            keys, allowed = np.concatenate([keys, more]), np.concatenate([allowed, sees], axis=1)
        cache.folded[i] = cache.length + T
        out = attend_with_sinks(q, keys, allowed, self.sinks, self.scale)
        out = rope_pairs_tail(out, cos, -sin)            # V's rotation undone at the query's position
        out = out.reshape(T, s.o_groups, -1)
        grouped = np.concatenate([kernels.matmul(np.ascontiguousarray(out[:, g]), w) for g, w in enumerate(self.o_a)], axis=1)
        return kernels.matmul(grouped, self.o_b)
