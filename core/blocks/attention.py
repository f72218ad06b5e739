"""Grouped-query attention (OLMoE, Qwen3-MoE, GLM-4.5): q/k/v/o projections with optional biases,
q/k RMSNorm (per head or over all heads), optional clipping, RoPE on each head's first
``rope_dim`` dims (rotate-half), causal or sliding-window attention over a KV cache.

``GQA`` is what a family declares for a layer (sizes and options; the tensors it needs follow from
it, ``tensors()``); ``GQA.build`` loads the weights into a ``GQAAttention``, whose ``__call__`` is
the numpy reference for any number of positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import kernels
from ..cache_kinds import KV
from ..errors import ColiError
from .common import Need, biased, linear


@dataclass(frozen=True)
class GQA:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: str = "none"           # 'none' | 'per_head' (over head_dim) | 'full' (over all heads)
    clip: float | None = None
    window: int | None = None       # sliding window; None = full causal
    rope_dim: int = 0               # the first dims of each head that RoPE turns; 0 = all of them
    o_bias: bool = True             # whether o_proj may carry a bias (GLM-4.5's never does)
    bias: bool = False              # the config's attention_bias (a synthetic checkpoint has them)
    # gated attention (Qwen3.5 / 3.6): q_proj's rows are per head [q_h | gate_h] and the output
    # is multiplied by sigmoid(gate) before o_proj
    gated: bool = False
    norm_offset: float = 0.0        # q/k norms multiply by weight + this ((1+w) RMSNorm: 1)

    def cache_kind(self) -> KV:
        return KV(self.kv_heads, self.head_dim)

    def tensors(self, p: str) -> list[Need]:
        H, qd, kvd = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = []
        for n, rows in (("q", qd * (2 if self.gated else 1)), ("k", kvd), ("v", kvd)):
            out += [Need(p + f"{n}_proj.weight", (rows, H)), Need(p + f"{n}_proj.bias", (rows,), optional=True, synthetic=self.bias)]
        out.append(Need(p + "o_proj.weight", (H, qd)))
        if self.o_bias:
            out.append(Need(p + "o_proj.bias", (H,), optional=True, synthetic=self.bias))
        norm = {"per_head": (self.head_dim, self.head_dim), "full": (qd, kvd)}.get(self.qk_norm)
        if norm is not None:
            out += [Need(p + "q_norm.weight", (norm[0],)), Need(p + "k_norm.weight", (norm[1],))]
        return out

    def build(self, c, p: str, eps: float) -> "GQAAttention":
        return GQAAttention(self, c, p, eps)


class GQAAttention:
    def __init__(self, spec: GQA, c, p: str, eps: float):
        self.spec, self.eps = spec, eps
        opt = lambda n: kernels.vector(c.load(p + n)) if (p + n) in c else None
        self.q, self.k, self.v, self.o = (c.load(p + f"{n}_proj.weight") for n in "qkvo")
        self.q_bias, self.k_bias, self.v_bias, self.o_bias = (opt(f"{n}_proj.bias") for n in "qkvo")
        self.q_norm, self.k_norm = opt("q_norm.weight"), opt("k_norm.weight")
        if spec.norm_offset:
            self.q_norm, self.k_norm = (None if w is None else (w + np.float32(spec.norm_offset)).astype(np.float32)
                                        for w in (self.q_norm, self.k_norm))
        if spec.qk_norm != "none" and (self.q_norm is None or self.k_norm is None):
            raise ColiError(f"{p}: q_norm/k_norm weights are missing from the container")
        self.window = spec.window
        self.rope_dim = spec.rope_dim or spec.head_dim
        self.scale = np.float32(spec.head_dim ** -0.5)

    def compiled_block(self, input_norm, router=None, post_norm=None, top_k: int = 0, norm_topk: bool = False):
        """The layer's decode step (input norm, this attention, the residual and, with a softmax
        router, the MoE input and its routing) as one compiled call, or None where it does not
        apply (weights not all int4 with one group size, no extension). Partial RoPE (GLM-4.5,
        Qwen3.5) turns the first rope_dim dims in the block as _rope does; gated attention splits
        q's rows per head and multiplies by kernels.sigmoid_gate's sigmoid(gate) as __call__
        does at one position."""
        s = self.spec
        return kernels.attention_block(
            [self.q, self.k, self.v, self.o], [self.q_bias, self.k_bias, self.v_bias, self.o_bias],
            input_norm, s.qk_norm, self.q_norm, self.k_norm, self.eps, s.clip, s.heads, s.kv_heads,
            s.head_dim, router, post_norm, top_k, norm_topk,
            rope_dim=self.rope_dim if self.rope_dim != s.head_dim else 0, gated=s.gated)

    def compiled(self, input_norm, router=None, post_norm=None):
        """The residual layer's compiled path (core.blocks.residual): one decode position through
        compiled_block, which runs a softmax router's tail too; None where it does not apply."""
        routes = router is not None and getattr(router, "kind", "") == "softmax_topk"
        block = self.compiled_block(input_norm, router.weight if routes else None, post_norm if routes else None,
                                    router.top_k if routes else 0, router.norm_topk_prob if routes else False)
        if block is None:
            return None

        def run(i, x, step):
            if not step.decode:
                return None
            cache = step.cache
            cos, sin = step.rope()
            cache.ensure(i, cache.length + 1)
            out = block(x, cos, sin, cache.k[i], cache.v[i], cache.length,
                        kernels.window_start(cache.length, self.window), self.scale)
            if routes:           # the block ran the router too
                x, h, *routed = out
                return x, h, routed
            return out, None, None
        return run

    def _rope(self, x, cos, sin):
        if self.rope_dim == x.shape[-1]:
            return kernels.rope(x, cos, sin)
        r = self.rope_dim
        return np.concatenate([kernels.rope(np.ascontiguousarray(x[..., :r]), cos, sin), x[..., r:]], axis=-1)

    def __call__(self, i: int, h, step):
        s, eps, T = self.spec, self.eps, h.shape[0]
        cos, sin, cache, pos = *step.rope(), step.cache, step.pos
        q, k, v = kernels.matmul_many(h, [self.q, self.k, self.v])       # one pass over x for all three
        q, k, v = biased(q, self.q_bias), biased(k, self.k_bias), biased(v, self.v_bias)
        gate = None
        if s.gated:              # per head [q_h | gate_h]
            both = q.reshape(T, s.heads, 2, s.head_dim)
            q = np.ascontiguousarray(both[:, :, 0]).reshape(T, s.heads * s.head_dim)
            gate = np.ascontiguousarray(both[:, :, 1]).reshape(T, s.heads * s.head_dim)
        if s.qk_norm == "full":
            q, k = kernels.rms_norm(q, self.q_norm, eps), kernels.rms_norm(k, self.k_norm, eps)
        if s.clip is not None:
            c = np.float32(s.clip)
            q, k, v = np.clip(q, -c, c), np.clip(k, -c, c), np.clip(v, -c, c)
        q = q.reshape(T, s.heads, s.head_dim)
        k = k.reshape(T, s.kv_heads, s.head_dim)
        v = v.reshape(T, s.kv_heads, s.head_dim)
        if s.qk_norm == "per_head":
            q, k = kernels.rms_norm(q, self.q_norm, eps), kernels.rms_norm(k, self.k_norm, eps)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        keys, values = cache.append(i, k, v)
        B = kernels.ATTENTION_QUERY_BLOCK
        if T > B and step.cancel_checks:
            # kernels.attention's own blocks of query rows, called one by one so that a cancel
            # is seen between them (a long prompt's attention is most of a layer): the same bits
            if keys.dtype != np.float32:
                keys, values = keys.astype(np.float32), values.astype(np.float32)
            parts = []
            for t in range(0, T, B):
                parts.append(kernels.attention(q[t: t + B], keys, values, self.scale, pos[t: t + B], self.window))
                step.check_cancel()
            out = np.concatenate(parts)
        else:
            out = kernels.attention(q, keys, values, self.scale, pos, self.window)
        if gate is not None:         # the compiled block's sigmoid (its bits) at every length
            out = kernels.sigmoid_gate(out, gate)
        return linear(out, self.o, self.o_bias)
