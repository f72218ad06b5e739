"""Multi-head latent attention (DeepSeek-V3, Kimi-K2, GLM-5; transformers' ``DeepseekV3Attention``)
and GLM-5's DSA token indexer (``GlmMoeDsaIndexer``).

q: ``q_b(rms(q_a x))`` (q-LoRA) or ``q_proj x``, per head [nope | rope]. kv: ``kv_a_proj_with_mqa x``
= [latent (kv_lora_rank) | shared RoPE key], the latent RMS-normed (eps fixed at 1e-6, as
transformers has it), ``kv_b_proj`` expanding it per head to [k_nope | v]. RoPE is DeepSeek's
interleaved layout: pairs in, halves out.

The cache keeps the compressed latent and the roped key, one row of rank + rope per position
(core.cache_kinds.Latent), and attention runs in the *absorbed* form at every length: each head's
query is taken into latent space (q_nope @ W_kb, ``kernels.matmul_t``), attends over the latent
rows as one key/value head (MQA: the values are the same rows; the rope tail of the output is
dropped), and the result comes back through W_vb (``kernels.matmul``). W_kb / W_vb are per-head
row views of kv_b_proj in the container's scheme (int4: 8.3 MB per GLM-5 layer where float32
took 58.7). The same formula for prefill and decode; against transformers' expanded keys and
values it differs by float rounding only.

Decode (one position) runs as one compiled call where the weights are int4 with one group size
(cython_kernels/mla_block.h, ``kernels.mla_block``): the bits of the step-by-step composition
below with the same kernels (tests/test_mla_block.py). The residual layer reaches it through
``compiled`` (off with the engine's ``fused_attention``).

DSA (GLM-5): on "full" layers an indexer scores every visible position -- Σ_h w_h relu(q_h·k / √d),
w = weights_proj(x) / √H, with its own LayerNorm-ed keys cached per position and interleaved RoPE
on their *first* rope dims -- and attention sees only the ``index_topk`` best (ties: the lower
position first); "shared" layers reuse the selection of the layer before. With no more visible
positions than ``index_topk`` this is dense causal attention, and is run as such: the indexer
only caches its key (the selection is None, its scores are not computed), so decode below
index_topk positions takes the compiled block on full and shared layers alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import kernels
from ..cache_kinds import IndexKeys, Latent
from .common import Need, linear

LATENT_NORM_EPS = 1e-6      # DeepseekV3RMSNorm's default: q_a / kv_a layernorms never get rms_norm_eps
INDEX_NORM_EPS = 1e-6       # the indexer's nn.LayerNorm(eps=1e-6)


def rope_interleaved(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """DeepSeek's RoPE on x [T, n, r] (cos / sin [T, r], each half the same angles): pairs
    (x0, x1), (x2, x3)... turned by one angle each, written out as [evens' | odds'] halves
    (transformers' apply_rotary_pos_emb_interleave)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope_rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """The usual RoPE (rotate-half) on x [T, n, r]: DeepSeek-V3 with ``rope_interleave`` false."""
    return kernels.rope(np.array(x, dtype=np.float32, order="C"), cos, sin)


def no_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """NoPE: the rope dims as they are (Kimi-Linear's MLA keeps a shared, unrotated key part)."""
    return np.ascontiguousarray(x, dtype=np.float32)


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    d = x - mean
    var = (d * d).mean(axis=-1, keepdims=True)
    return d / np.sqrt(var + np.float32(eps)) * w + b


@dataclass(frozen=True)
class Indexer:
    """GLM-5's DSA indexer: ``heads`` x ``head_dim`` queries from the q-LoRA residual, one key per
    position, the ``topk`` best positions attended."""
    hidden: int
    q_lora_rank: int
    heads: int
    head_dim: int
    rope: int
    topk: int

    def tensors(self, p: str) -> list[Need]:
        d = self.head_dim
        return [Need(p + "wq_b.weight", (self.heads * d, self.q_lora_rank)), Need(p + "wk.weight", (d, self.hidden)),
                Need(p + "k_norm.weight", (d,)), Need(p + "k_norm.bias", (d,)),
                Need(p + "weights_proj.weight", (self.heads, self.hidden))]


@dataclass(frozen=True)
class MLA:
    hidden: int
    heads: int
    q_lora_rank: int            # 0: a plain q_proj
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head_dim: int
    scale: float                # the softmax scale (qk_head_dim^-0.5, x mscale^2 under yarn)
    bias: bool = False          # attention_bias: q_a / kv_a / o biases
    indexer: Indexer | None = None    # DSA on this layer ("full")
    shared_index: bool = False        # DSA, reusing the previous layer's selection ("shared")
    interleave: bool = True           # DeepSeek's RoPE layout; False: rotate-half (rope_interleave)
    rope: bool = True                 # False: NoPE (Kimi-Linear): the qk_rope dims are used unrotated

    def cache_kind(self):
        latent = Latent(self.kv_lora_rank, self.qk_rope)
        return (latent, IndexKeys(self.indexer.head_dim)) if self.indexer is not None else latent

    def tensors(self, p: str) -> list[Need]:
        H, n, qk = self.hidden, self.heads, self.qk_nope + self.qk_rope
        opt = lambda name, shape: Need(p + name, shape, optional=True, synthetic=self.bias)
        if self.q_lora_rank:
            out = [Need(p + "q_a_proj.weight", (self.q_lora_rank, H)), opt("q_a_proj.bias", (self.q_lora_rank,)),
                   Need(p + "q_a_layernorm.weight", (self.q_lora_rank,)),
                   Need(p + "q_b_proj.weight", (n * qk, self.q_lora_rank))]
        else:
            out = [Need(p + "q_proj.weight", (n * qk, H))]
        out += [Need(p + "kv_a_proj_with_mqa.weight", (self.kv_lora_rank + self.qk_rope, H)),
                opt("kv_a_proj_with_mqa.bias", (self.kv_lora_rank + self.qk_rope,)),
                Need(p + "kv_a_layernorm.weight", (self.kv_lora_rank,)),
                Need(p + "kv_b_proj.weight", (n * (self.qk_nope + self.v_head_dim), self.kv_lora_rank)),
                Need(p + "o_proj.weight", (H, n * self.v_head_dim)), opt("o_proj.bias", (H,))]
        if self.indexer is not None:
            out += self.indexer.tensors(p + "indexer.")
        return out

    def build(self, c, p: str, eps: float) -> "MLAAttention":
        return MLAAttention(self, c, p, eps)


class MLAAttention:
    window = None

    def __init__(self, spec: MLA, c, p: str, eps: float):
        self.spec, self._eps = spec, eps      # eps: the layer's input norm (the compiled path)
        opt = lambda n: kernels.vector(c.load(p + n)) if (p + n) in c else None
        if spec.q_lora_rank:
            self.q_a, self.q_a_bias = c.load(p + "q_a_proj.weight"), opt("q_a_proj.bias")
            self.q_a_norm = kernels.vector(c.load(p + "q_a_layernorm.weight"))
            self.q_b = c.load(p + "q_b_proj.weight")
        else:
            self.q = c.load(p + "q_proj.weight")
        self.kv_a, self.kv_a_bias = c.load(p + "kv_a_proj_with_mqa.weight"), opt("kv_a_proj_with_mqa.bias")
        self.kv_a_norm = kernels.vector(c.load(p + "kv_a_layernorm.weight"))
        self.o, self.o_bias = c.load(p + "o_proj.weight"), opt("o_proj.bias")
        # the absorbed form's per-head matrices, kept in the container's scheme (row views of
        # kv_b_proj, no copy): W_kb_h [nope, rank] takes head h's query into latent space
        # (matmul_t), W_vb_h [v, rank] brings the attended latent back (matmul)
        self.kv_b = c.load(p + "kv_b_proj.weight")
        per, nope = spec.qk_nope + spec.v_head_dim, spec.qk_nope
        self.w_kb = [kernels.weight_rows(self.kv_b, h * per, h * per + nope) for h in range(spec.heads)]
        self.w_vb = [kernels.weight_rows(self.kv_b, h * per + nope, (h + 1) * per) for h in range(spec.heads)]
        self.scale = np.float32(spec.scale)
        ix = spec.indexer
        if ix is not None:
            q = p + "indexer."
            self.ix_q, self.ix_k = c.load(q + "wq_b.weight"), c.load(q + "wk.weight")
            self.ix_norm_w = kernels.vector(c.load(q + "k_norm.weight"))
            self.ix_norm_b = kernels.vector(c.load(q + "k_norm.bias"))
            self.ix_weights = c.load(q + "weights_proj.weight")
        # decode's compiled step (input already normed, no residual: the engine's step-by-step
        # call), or None (weights not all int4 with one group size, no extension)
        self.fast = self._compiled(None, 0.0) if spec.interleave and spec.rope else None
        self.rope = (rope_interleaved if spec.interleave else rope_rotate_half) if spec.rope else no_rope

    def _compiled(self, input_norm, eps: float):
        s = self.spec
        mats = {"q_a": self.q_a if s.q_lora_rank else None, "q": self.q_b if s.q_lora_rank else self.q,
                "kv_a": self.kv_a, "kv_b": self.kv_b, "o": self.o}
        return kernels.mla_block(mats, (getattr(self, "q_a_bias", None), self.kv_a_bias, self.o_bias),
                                 input_norm, getattr(self, "q_a_norm", None), self.kv_a_norm, eps,
                                 s.hidden, s.heads, s.q_lora_rank, s.kv_lora_rank, s.qk_nope,
                                 s.qk_rope, s.v_head_dim)

    def decode_block(self, input_norm, eps: float):
        """The whole decode step of the layer's attention -- input norm, this block, the residual
        add -- as one compiled call block(x, cos, sin, latent, pos, scale) -> x + attn(norm(x)),
        or None. (The residual layer's compiled path runs ``self.fast`` on the normed input
        instead, whose bits the step-by-step composition's are; see compiled.)"""
        return self._compiled(input_norm, eps)

    def compiled(self, input_norm, router=None, post_norm=None):
        """The residual layer's compiled path (core.blocks.residual): one decode position through
        ``self.fast`` on the normed input, or None where it does not apply. DSA: when every
        visible position is selected (full layer: pos + 1 <= index_topk; shared layer: the layer
        before chose "all") the layer is dense attention; the indexer's key for this position
        is still computed and cached by the numpy step (_select, which then skips the scores)."""
        if self.fast is None:
            return None

        def run(i, x, step):
            s, pos, cache = self.spec, step.pos, step.cache
            if not step.decode or (s.indexer is not None and int(pos[0]) + 1 > s.indexer.topk) or (
                    s.indexer is None and s.shared_index and step.state.get("dsa_allowed") is not None):
                return None
            h = kernels.rms_norm(x, input_norm, self._eps)
            if s.indexer is not None:
                step.state["dsa_allowed"] = self._select(i, h, None, step)
            cos, sin = step.rope()
            cache.ensure(i, cache.length + 1)
            out = self.fast(np.ascontiguousarray(h, dtype=np.float32), np.ascontiguousarray(cos, dtype=np.float32),
                            np.ascontiguousarray(sin, dtype=np.float32), cache.arrays[i]["latent"],
                            cache.length, self.scale)
            return x + out, None, None
        return run

    def __call__(self, i: int, h, step):
        cos, sin, cache, pos = *step.rope(), step.cache, step.pos
        s, T = self.spec, h.shape[0]
        if s.q_lora_rank:
            q_resid = kernels.rms_norm(linear(h, self.q_a, self.q_a_bias), self.q_a_norm, LATENT_NORM_EPS)
            q = kernels.matmul(q_resid, self.q_b)
        else:
            q_resid, q = None, kernels.matmul(h, self.q)
        q = q.reshape(T, s.heads, s.qk_nope + s.qk_rope)
        q_nope, q_rot = q[..., : s.qk_nope], self.rope(q[..., s.qk_nope:], cos, sin)
        kv = linear(h, self.kv_a, self.kv_a_bias)
        latent = kernels.rms_norm(kv[:, : s.kv_lora_rank], self.kv_a_norm, LATENT_NORM_EPS)
        k_rot = self.rope(kv[:, None, s.kv_lora_rank:], cos, sin)[:, 0]
        rows = cache.append_part(i, "latent", np.concatenate([latent, k_rot], axis=-1)[:, None, :])
        allowed = None
        if s.indexer is not None:
            allowed = self._select(i, h, q_resid, step)
            step.state["dsa_allowed"] = allowed
        elif s.shared_index:
            allowed = step.state["dsa_allowed"]
        # absorbed: queries into latent space, one key/value head over the latent rows
        rank = s.kv_lora_rank
        qq = np.empty((T, s.heads, rank + s.qk_rope), np.float32)
        for hd in range(s.heads):
            qq[:, hd, :rank] = kernels.matmul_t(q_nope[:, hd], self.w_kb[hd])
        qq[..., rank:] = q_rot
        if T == 1 and allowed is None:
            o = kernels.attend_latent(qq[0], rows[0], self.scale, rank)[None]             # [1, heads, rank]
        else:
            o = self._attend(qq, rows, pos, allowed)[..., :rank]                         # [T, heads, rank]
        out = np.empty((T, s.heads, s.v_head_dim), np.float32)
        for hd in range(s.heads):
            out[:, hd] = kernels.matmul(o[:, hd], self.w_vb[hd])
        return linear(out.reshape(T, s.heads * s.v_head_dim), self.o, self.o_bias)

    def _attend(self, q: np.ndarray, rows: np.ndarray, pos: np.ndarray, allowed) -> np.ndarray:
        """q [T, heads, D] over the latent rows [1, S, D] (keys and values alike): [T, heads, D];
        allowed: DSA's selection [T, S], or None (causal)."""
        T, H, D = q.shape
        return kernels.attention(q, rows, rows, self.scale, pos, None, allowed).reshape(T, H, D)

    def _select(self, i, h, q_resid, step):
        """The indexer's choice for each query row: allowed [T, S] (causal and among the top-k),
        or None when no row sees more than top-k positions (every visible one is selected: dense
        causal attention; the scores are then not computed). This position's index key is
        cached either way."""
        ix, T = self.spec.indexer, h.shape[0]
        cos, sin, cache, pos = *step.rope(), step.cache, step.pos
        r = ix.rope
        k = layer_norm(kernels.matmul(h, self.ix_k), self.ix_norm_w, self.ix_norm_b, INDEX_NORM_EPS)
        k = np.concatenate([rope_interleaved(k[:, None, :r], cos, sin)[:, 0], k[:, r:]], axis=-1)
        keys = cache.append_part(i, "index", k[:, None, :])[0].astype(np.float32, copy=False)   # [S, d]
        if int(pos.max()) + 1 <= ix.topk:
            return None
        q = kernels.matmul(q_resid, self.ix_q).reshape(T, ix.heads, ix.head_dim)
        q = np.concatenate([rope_interleaved(q[..., :r], cos, sin), q[..., r:]], axis=-1)
        S = keys.shape[0]
        scores = np.maximum(np.matmul(q, keys.T) * np.float32(ix.head_dim ** -0.5), np.float32(0))  # [T, heads, S]
        w = kernels.matmul(h, self.ix_weights) * np.float32(ix.heads ** -0.5)                # [T, heads]
        index = np.matmul(w[:, None, :], scores)[:, 0]                                       # [T, S]
        causal = np.arange(S)[None, :] <= pos[:, None]
        allowed = causal.copy()
        for t in range(T):
            visible = int(pos[t]) + 1
            if visible > ix.topk:
                best = np.argsort(-index[t, :visible], kind="stable")[: ix.topk]
                allowed[t] = False
                allowed[t, best] = True
        return allowed
