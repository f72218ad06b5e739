"""Manifold-constrained hyper-connections (mHC; DeepSeek V4, GLM-5.3-Flash): the residual is
``n`` streams [T, n, H]. Before each sublayer a learned projection of the normed, flattened
streams gives three mixes -- ``pre`` (collapse the streams into the sublayer's input), ``post``
(spread its output back over the streams) and ``comb`` (mix the streams themselves, made doubly
stochastic by Sinkhorn-Knopp) -- as transformers' ``DeepseekV4HyperConnection``; the head
collapses the streams once more (``DeepseekV4HyperHead``, StreamHead). Everything here is float32 numpy
(no compiled path yet)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import kernels
from .common import Need, norm_weight
from .embed import Embedding, EmbeddingBlock


def unweighted_rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) over the last axis (transformers' UnweightedRMSNorm)."""
    var = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return x * (np.float32(1.0) / np.sqrt(var + np.float32(eps)))


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def collapse(x: np.ndarray, pre: np.ndarray) -> np.ndarray:
    """sum_j pre[t, j] * x[t, j, :]: the streams [T, n, H] weighted into one row [T, H]."""
    return np.einsum("tj,tjh->th", pre, x, dtype=np.float32)


class HyperConnection:
    """One sublayer's mixes: ``fn`` [(2 + n) n, n H], ``base`` [(2 + n) n], ``scale`` [3]."""

    def __init__(self, fn: np.ndarray, base: np.ndarray, scale: np.ndarray, n: int, iters: int,
                 hc_eps: float, norm_eps: float):
        self.fn, self.base, self.scale = fn, base, scale
        self.n, self.iters, self.hc_eps, self.norm_eps = n, iters, np.float32(hc_eps), norm_eps

    def mixes(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pre [T, n], post [T, n], comb [T, n, n]) for the streams x [T, n, H]."""
        T, n = x.shape[0], self.n
        flat = unweighted_rms_norm(x.reshape(T, -1), self.norm_eps) @ self.fn.T
        b, s, eps = self.base, self.scale, self.hc_eps
        pre = sigmoid(flat[:, :n] * s[0] + b[:n]) + eps
        post = np.float32(2.0) * sigmoid(flat[:, n: 2 * n] * s[1] + b[n: 2 * n])
        comb = kernels.softmax(flat[:, 2 * n:].reshape(T, n, n) * s[2] + b[2 * n:].reshape(n, n)) + eps
        # Sinkhorn-Knopp: columns first, then (rows, columns) iters - 1 times
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
            comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
        return pre, post, comb.astype(np.float32)


def mix_back(x: np.ndarray, y: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """The streams after a sublayer with output y [T, H]: post[t, k] y[t] + sum_j comb[t, j, k]
    x[t, j] (comb is consumed transposed: Sinkhorn's matrix is not symmetric)."""
    return post[:, :, None] * y[:, None, :] + np.matmul(comb.transpose(0, 2, 1), x)


@dataclass(frozen=True)
class MHC:
    """A layer with the mHC residual around ``mixer`` and ``ffn``: per sublayer the mixes
    (``hc_attn_{fn,base,scale}`` / ``hc_ffn_*``) and a weighted RMSNorm of the collapsed input
    (``attn_norm`` / ``ffn_norm``), as transformers' DeepseekV4DecoderLayer; the names are the
    ones its save_pretrained writes (DeepSeek's). ``mixer`` / ``ffn`` are declarations with
    ``tensors(prefix)`` and ``build(c, prefix[, eps])``."""
    n: int                  # hc_mult
    iters: int              # hc_sinkhorn_iters
    hc_eps: float
    mixer: object
    ffn: object
    mixer_prefix: str = "attn."
    ffn_prefix: str = "ffn."

    @property
    def kind(self) -> str:
        return "moe" if hasattr(self.ffn, "num_experts") else "dense"

    def tensors(self, p: str, hidden: int) -> list[Need]:
        mixes, width = (2 + self.n) * self.n, self.n * hidden
        out = [Need(p + "attn_norm.weight", (hidden,)), Need(p + "ffn_norm.weight", (hidden,))]
        for hc in ("hc_attn_", "hc_ffn_"):
            out += [Need(p + hc + "fn", (mixes, width), float32=True), Need(p + hc + "base", (mixes,)),
                    Need(p + hc + "scale", (3,))]
        return out + self.mixer.tensors(p + self.mixer_prefix) + self.ffn.tensors(p + self.ffn_prefix)

    def cache_kind(self):
        return self.mixer.cache_kind()

    def build(self, c, p: str, eps: float) -> "MHCLayer":
        def hc(name):
            parts = [kernels.vector(c.load(p + name + part)) for part in ("fn", "base", "scale")]
            return HyperConnection(*parts, self.n, self.iters, self.hc_eps, eps)
        return MHCLayer(hc("hc_attn_"), norm_weight(c, p + "attn_norm.weight"),
                        self.mixer.build(c, p + self.mixer_prefix, eps),
                        hc("hc_ffn_"), norm_weight(c, p + "ffn_norm.weight"),
                        self.ffn.build(c, p + self.ffn_prefix), eps)


class MHCLayer:
    """L(i, x, step) -> x for the streams x [T, n, H], calling ``step.mixed(i, x)`` between the
    halves (the engine's clock and lookahead, as core.blocks.residual's PreNorm does);
    ``router_input`` is what this layer's router sees given the streams arriving at its ffn (the
    ffn_hc collapse, then the norm)."""

    def __init__(self, attn_hc, attn_norm, mixer, ffn_hc, ffn_norm, ffn, eps: float):
        self.attn_hc, self.attn_norm, self.mixer = attn_hc, attn_norm, mixer
        self.ffn_hc, self.ffn_norm, self.ffn, self.eps = ffn_hc, ffn_norm, ffn, eps
        self.kind = getattr(ffn, "kind", "dense")
        self.router = getattr(ffn, "router", None)
        if hasattr(ffn, "known_experts"):        # hash routing: the experts follow from the ids
            self.known_experts = ffn.known_experts

    def _sublayer(self, i, x, step, hc, norm, block):
        pre, post, comb = hc.mixes(x)
        return mix_back(x, block(i, kernels.rms_norm(collapse(x, pre), norm, self.eps), step), post, comb)

    def __call__(self, i: int, x: np.ndarray, step) -> np.ndarray:
        x = self._sublayer(i, x, step, self.attn_hc, self.attn_norm, self.mixer)
        step.mixed(i, x)
        return self._sublayer(i, x, step, self.ffn_hc, self.ffn_norm, self.ffn)

    def router_input(self, x: np.ndarray, step) -> np.ndarray:
        pre, _, _ = self.ffn_hc.mixes(x)
        return kernels.rms_norm(collapse(x, pre), self.ffn_norm, self.eps)


def expand(h: np.ndarray, n: int) -> np.ndarray:
    """The embedding [T, H] as n equal streams [T, n, H]."""
    return np.ascontiguousarray(np.broadcast_to(h[:, None, :], (h.shape[0], n, h.shape[1])), dtype=np.float32)


@dataclass(frozen=True)
class StreamEmbedding(Embedding):
    """The token embedding (core.blocks.embed.Embedding) copied into ``n`` streams."""
    n: int = 1

    def build(self, c, p: str) -> "StreamEmbeddingBlock":
        return StreamEmbeddingBlock(self, c, p)


class StreamEmbeddingBlock(EmbeddingBlock):
    def __init__(self, decl: StreamEmbedding, c, p: str):
        super().__init__(decl, c, p)
        self.n = decl.n

    def __call__(self, ids: np.ndarray, step) -> np.ndarray:
        return expand(super().__call__(ids, step), self.n)


@dataclass(frozen=True)
class StreamHead:
    """The head after mHC layers (transformers' DeepseekV4HyperHead, then the final norm and the
    head): the streams collapsed by sigmoid(hc_fn x * hc_scale + hc_base) + hc_eps
    (``{prefix}hc_head.hc_fn`` [n, n H], ``hc_base`` [n], ``hc_scale`` [1], x RMS-normed and
    flattened), ``{prefix}norm.weight``, then ``head`` [vocab, hidden] or the embedding (tied)."""
    vocab: int
    hidden: int
    n: int
    hc_eps: float
    tied: bool = False
    head: str = "lm_head.weight"        # DeepSeek V4's checkpoints: head.weight

    def tensors(self, p: str) -> list[Need]:
        n, H = self.n, self.hidden
        out = [Need(p + "hc_head.hc_fn", (n, n * H), float32=True), Need(p + "hc_head.hc_base", (n,)),
               Need(p + "hc_head.hc_scale", (1,)), Need(p + "norm.weight", (H,))]
        return out + ([] if self.tied else [Need(self.head, (self.vocab, H))])

    def build(self, c, p: str, eps: float, embedding) -> "StreamHeadBlock":
        return StreamHeadBlock(self, c, p, eps, embedding)


class StreamHeadBlock:
    def __init__(self, decl: StreamHead, c, p: str, eps: float, embedding):
        self.fn, self.base, self.scale = (kernels.vector(c.load(p + "hc_head." + k)) for k in ("hc_fn", "hc_base", "hc_scale"))
        self.hc_eps, self.eps = np.float32(decl.hc_eps), eps
        self.norm = norm_weight(c, p + "norm.weight")
        self.weight = embedding.weight if decl.tied else c.load(decl.head)

    def collapse(self, x: np.ndarray) -> np.ndarray:
        flat = unweighted_rms_norm(x.reshape(x.shape[0], -1), self.eps) @ self.fn.T
        return collapse(x, sigmoid(flat * self.scale[0] + self.base) + self.hc_eps)

    def __call__(self, x: np.ndarray, step) -> np.ndarray:
        return kernels.matmul(kernels.rms_norm(self.collapse(x), self.norm, self.eps), self.weight)
