"""Manifold-constrained hyper-connections (mHC; DeepSeek V4, GLM-5.3-Flash): the residual is
``n`` streams [T, n, H]. Before each sublayer a learned projection of the normed, flattened
streams gives three mixes -- ``pre`` (collapse the streams into the sublayer's input), ``post``
(spread its output back over the streams) and ``comb`` (mix the streams themselves, made doubly
stochastic by Sinkhorn-Knopp) -- as transformers' ``DeepseekV4HyperConnection``; the head
collapses the streams once more (``DeepseekV4HyperHead``). Everything here is float32 numpy
(no compiled path yet)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import kernels
from ..errors import ColiError
from .common import Need, norm_weight


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
    hidden: int
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

    def tensors(self, p: str) -> list[Need]:
        mixes, width = (2 + self.n) * self.n, self.n * self.hidden
        out = [Need(p + "attn_norm.weight", (self.hidden,)), Need(p + "ffn_norm.weight", (self.hidden,))]
        for hc in ("hc_attn_", "hc_ffn_"):
            out += [Need(p + hc + "fn", (mixes, width)), Need(p + hc + "base", (mixes,)),
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
    """L(i, x, step) -> x for the streams x [T, n, H]; ``router_input`` is what this layer's
    router sees given the streams arriving at its ffn (the ffn_hc collapse, then the norm)."""

    def __init__(self, attn_hc, attn_norm, mixer, ffn_hc, ffn_norm, ffn, eps: float):
        self.attn_hc, self.attn_norm, self.mixer = attn_hc, attn_norm, mixer
        self.ffn_hc, self.ffn_norm, self.ffn, self.eps = ffn_hc, ffn_norm, ffn, eps
        self.kind = getattr(ffn, "kind", "dense")
        self.router = getattr(ffn, "router", None)

    def _sublayer(self, i, x, step, hc, norm, block):
        pre, post, comb = hc.mixes(x)
        return mix_back(x, block(i, kernels.rms_norm(collapse(x, pre), norm, self.eps), step), post, comb)

    def __call__(self, i: int, x: np.ndarray, step) -> np.ndarray:
        x = self._sublayer(i, x, step, self.attn_hc, self.attn_norm, self.mixer)
        return self._sublayer(i, x, step, self.ffn_hc, self.ffn_norm, self.ffn)

    def router_input(self, x: np.ndarray, step) -> np.ndarray:
        pre, _, _ = self.ffn_hc.mixes(x)
        return kernels.rms_norm(collapse(x, pre), self.ffn_norm, self.eps)


def expand(h: np.ndarray, n: int) -> np.ndarray:
    """The embedding [T, H] as n equal streams [T, n, H]."""
    return np.ascontiguousarray(np.broadcast_to(h[:, None, :], (h.shape[0], n, h.shape[1])), dtype=np.float32)


class HyperHead:
    """The last collapse before the final norm: sigmoid(fn x * scale + base) + eps per stream
    (``hc_head.hc_fn`` [n, n H], ``hc_base`` [n], ``hc_scale`` [1])."""

    @staticmethod
    def tensors(p: str, n: int, hidden: int) -> list[Need]:
        return [Need(p + "hc_fn", (n, n * hidden)), Need(p + "hc_base", (n,)), Need(p + "hc_scale", (1,))]

    def __init__(self, c, p: str, n: int, hc_eps: float, norm_eps: float):
        self.fn, self.base, self.scale = (kernels.vector(c.load(p + k)) for k in ("hc_fn", "hc_base", "hc_scale"))
        if self.fn.shape[0] != n:
            raise ColiError(f"{p}hc_fn: {self.fn.shape[0]} streams, the config says {n}")
        self.hc_eps, self.norm_eps = np.float32(hc_eps), norm_eps

    def __call__(self, x: np.ndarray) -> np.ndarray:
        flat = unweighted_rms_norm(x.reshape(x.shape[0], -1), self.norm_eps) @ self.fn.T
        return collapse(x, sigmoid(flat * self.scale[0] + self.base) + self.hc_eps)
