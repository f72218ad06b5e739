"""Linear attention with a recurrent state (Qwen3.5 / Qwen3.6's Gated DeltaNet; Kimi's KDA reuses
the pieces): a causal depthwise convolution with state, the gated delta rule, the two l2norms and
the gated RMSNorm, and the ``GatedDeltaNet`` mixer built from them (transformers'
``Qwen3_5MoeGatedDeltaNet``).

Each piece is the numpy reference for any number of positions, and it is **token-serial**: the
delta rule folds one position at a time into the state, with the same float32 operations on the
same shapes whatever the number of positions in the call, so a prompt prefilled in one pass, in
chunks, or position by position (decode) leaves the same bits in the state and gives the same
outputs. (transformers prefills with a chunked form of the rule, ``torch_chunk_gated_delta_rule``,
and decodes with the recurrent one: the two differ by ~2e-5; ours is the recurrent one throughout.)

The layer's state lives in the cache (core.cache_kinds ``Conv`` and ``Recurrent``, float32, fixed
size whatever the context: ``cache.state[i]``) and is updated in place.

Compiled (cython_kernels/linear_attention.h, ``kernels.linear_attention_kernels``): the mixer's
core -- conv update + SiLU, l2norms, gates, the delta rule, the gated norm -- runs as one call for
any number of positions (prefill and decode alike: 0.29 ms per layer at Qwen3.6's geometry where
the numpy composition takes ~0.9-1.4 ms), with the bits of the same steps called one by one
(``core_steps``; the engine's ``fused_attention`` False runs those). The one call is the
residual layer's compiled path (``compiled``, core.blocks.residual), tested in
tests/test_linear_attention_block.py. The numpy reference (no extension) agrees to float32
rounding (its exp is numpy's).

KDA's core likewise (cython_kernels/kda_block.h, ``kernels.kda_kernels``: ``kda_block`` -- the three
convs + SiLU, the divide-form l2norms, the per-channel forget gate and beta, the per-channel delta
rule, the sigmoid-gated o_norm -- in one call for any number of positions, with the bits of
``KDAMixer.core_steps``' compiled pieces; tests/test_kda_block.py): 0.37 ms per layer and position
at Kimi-Linear-48B's geometry (32 heads x 128) where the numpy composition takes ~0.9 ms.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import kernels
from ..cache_kinds import Conv, Recurrent
from ..errors import ColiError
from .common import Need, linear

L2NORM_EPS = 1e-6         # transformers' l2norm(eps=1e-6) (use_qk_l2norm_in_kernel)


# --- the pieces (shared with KDA) -----------------------------------------------------------------
def causal_conv(x: np.ndarray, state: np.ndarray, weight: np.ndarray, activation: bool = True) -> np.ndarray:
    """Depthwise causal convolution of x [T, C] with ``weight`` [C, K] (tap K-1 on the newest
    input), continuing ``state`` [C, K-1] (the previous K-1 inputs, oldest first; zeros at the
    start), then SiLU (``activation``). ``state`` is updated in place to the last K-1 inputs.
    Each output is the taps' products summed oldest first, the same operations whatever T."""
    T, C = x.shape
    K = weight.shape[1]
    window = np.concatenate([state.T, x.astype(np.float32, copy=False)], axis=0)      # [K-1+T, C]
    y = window[0:T] * weight[:, 0]
    for j in range(1, K):
        y += window[j: j + T] * weight[:, j]
    if K > 1:
        state[...] = window[T:].T
    return kernels.silu(y) if activation else y


def l2norm(x: np.ndarray, eps: float = L2NORM_EPS, divide: bool = False) -> np.ndarray:
    """x / ||x|| over the last axis. Two roundings exist: Qwen's (FLA-aligned in transformers)
    x * rsqrt(Σx² + eps), and (``divide``) Kimi's x / sqrt(Σx² + eps)."""
    ss = np.sum(x * x, axis=-1, keepdims=True, dtype=np.float32) + np.float32(eps)
    if divide:
        return x / np.sqrt(ss)
    return x * (np.float32(1.0) / np.sqrt(ss))


def softplus(x: np.ndarray) -> np.ndarray:
    """torch's softplus (beta 1, threshold 20): x above 20, else log(1 + e^x)."""
    with np.errstate(over="ignore"):
        return np.where(x > np.float32(20), x, np.log1p(np.exp(np.minimum(x, np.float32(20))))).astype(np.float32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray, beta: np.ndarray,
               state: np.ndarray) -> np.ndarray:
    """The gated delta rule, one position after another, over ``state`` S [H, dk, dv] (updated in
    place). q, k [T, H, dk] (normed, q scaled), v [T, H, dv], beta [T, H]; ``decay`` the state's
    factor per position: [T, H] (one per head: Gated DeltaNet's e^g) or [T, H, dk] (per key
    channel: KDA's). Per position: S <- decay S; S += k (x) beta (v - S^T k); o = S^T q.
    Returns o [T, H, dv]."""
    T, H, dk = k.shape
    out = np.empty((T, H, v.shape[-1]), np.float32)
    per_channel = decay.ndim == 3
    for t in range(T):
        if per_channel:
            state *= decay[t][:, :, None]
        else:
            state *= decay[t][:, None, None]
        kt = k[t][:, None, :]                                     # [H, 1, dk]
        mem = np.matmul(kt, state)[:, 0]                          # S^T k: [H, dv]
        delta = (v[t] - mem) * beta[t][:, None]
        state += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.matmul(q[t][:, None, :], state)[:, 0]
    return out


def gated_rms_norm(x: np.ndarray, w: np.ndarray, gate: np.ndarray, eps: float, act: str = "silu") -> np.ndarray:
    """RMSNormGated: w * x / sqrt(mean(x^2) + eps), times silu(gate) (or sigmoid(gate), ``act``),
    over the last axis, in float32 (transformers' ``Qwen3_5MoeRMSNormGated``: norm before gate)."""
    var = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    normed = w * (x * (np.float32(1.0) / np.sqrt(var + np.float32(eps))))
    return normed * (kernels.silu(gate) if act == "silu" else sigmoid(gate))


def check_folded(i: int, folded: list, cache) -> None:
    if folded[i] != cache.length:
        raise ColiError(f"layer {i}: the recurrent state holds {folded[i]} positions but the cache "
                        f"{cache.length} (a pass that did not finish): start a new cache")


def whole_core(mixer, input_norm, compiled_kernels):
    """A linear-attention mixer's compiled path for the residual layer (core.blocks.residual):
    its core as one compiled call at any number of positions (prefill and decode alike); the
    call declines (None) while ``compiled_kernels()`` has no extension (the numpy reference)."""
    def run(i, x, step):
        if compiled_kernels() is None:
            return None
        return x + mixer(i, kernels.rms_norm(x, input_norm, mixer.eps), step, fused=True), None, None
    return run


# --- Gated DeltaNet (Qwen3.5 / Qwen3.6 linear-attention layers) ----------------------------------
@dataclass(frozen=True)
class GatedDeltaNet:
    """A linear-attention layer: ``in_proj_qkv`` -> causal conv (``conv_kernel``) + SiLU -> q, k
    (``k_heads`` x ``k_dim``, l2-normed, q / sqrt(k_dim)) and v (``v_heads`` x ``v_dim``); k heads
    repeated over v heads (repeat-interleave); beta = sigmoid(in_proj_b x), g = -exp(A_log) *
    softplus(in_proj_a x + dt_bias); the gated delta rule; RMSNormGated(o, in_proj_z x) over
    v_dim; out_proj. Its tensors sit under ``linear_attn.``."""
    hidden: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    prefix = "linear_attn."

    @property
    def conv_channels(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def cache_kind(self):
        return (Conv(self.conv_channels, self.conv_kernel - 1), Recurrent(self.v_heads, self.k_dim, self.v_dim))

    def tensors(self, p: str) -> list[Need]:
        H, C, Hv, vd = self.hidden, self.conv_channels, self.v_heads, self.v_heads * self.v_dim
        return [Need(p + "in_proj_qkv.weight", (C, H)), Need(p + "in_proj_z.weight", (vd, H)),
                Need(p + "in_proj_b.weight", (Hv, H)), Need(p + "in_proj_a.weight", (Hv, H)),
                Need(p + "conv1d.weight", (C, 1, self.conv_kernel)), Need(p + "dt_bias", (Hv,)),
                Need(p + "A_log", (Hv,)), Need(p + "norm.weight", (self.v_dim,)),
                Need(p + "out_proj.weight", (H, vd))]

    def build(self, c, p: str, eps: float) -> "GatedDeltaNetMixer":
        return GatedDeltaNetMixer(self, c, p, eps)


class GatedDeltaNetMixer:
    window = None

    def __init__(self, spec: GatedDeltaNet, c, p: str, eps: float):
        self.spec, self.eps = spec, eps
        self.qkv, self.z, self.b, self.a, self.out = (
            c.load(p + n + ".weight") for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"))
        conv = c.load(p + "conv1d.weight")
        self.conv_w = np.ascontiguousarray(np.asarray(conv.data, np.float32).reshape(spec.conv_channels, spec.conv_kernel))
        self.dt_bias = kernels.vector(c.load(p + "dt_bias"))
        # g = -exp(A_log) * softplus(.): exp(A_log) in float32, once (transformers: A_log.float().exp())
        self.neg_a = -np.exp(kernels.vector(c.load(p + "A_log")).astype(np.float32))
        self.norm_w = kernels.vector(c.load(p + "norm.weight"))
        if spec.v_heads % spec.k_heads:
            raise ColiError(f"{p}: {spec.v_heads} value heads are not a multiple of {spec.k_heads} key heads")
        self.scale = np.float32(spec.k_dim ** -0.5)

    def compiled(self, input_norm, router=None, post_norm=None):
        return whole_core(self, input_norm, kernels.linear_attention_kernels)

    def __call__(self, i: int, h, step, fused: bool = False):
        """fused: the core as one compiled call (the extension is there: ``compiled``)."""
        s, T = self.spec, h.shape[0]
        cache = step.cache
        state = cache.state[i]
        folded = cache.folded
        check_folded(i, folded, cache)
        qkv, z, b, a = kernels.matmul_many(h, [self.qkv, self.z, self.b, self.a])
        qm = kernels.linear_attention_kernels()
        if fused:
            # conv + l2norms + gates + delta rule + gated norm in one compiled call, at any T
            o = qm.gdn_block(qkv, z, b, a, self.conv_w, state["conv"], state["recurrent"], self.dt_bias,
                             self.neg_a, self.norm_w, self.eps, self.scale, s.k_heads, s.v_heads, s.k_dim, s.v_dim)
        else:
            o = self.core_steps(qm, qkv, z, b, a, state)
        folded[i] = cache.length + T
        return linear(o.reshape(T, s.v_heads * s.v_dim), self.out)

    def core_steps(self, qm, qkv, z, b, a, state) -> np.ndarray:
        """The core step by step: with the compiled pieces (``qm``: the bits of its one-call
        block), or the numpy reference (None). Returns [T, v_heads * v_dim]."""
        s, T = self.spec, qkv.shape[0]
        kd = s.k_heads * s.k_dim
        if qm is not None:
            y = qm.gdn_conv(qkv, state["conv"], self.conv_w)
            q = qm.l2norm_rows(y[:, :kd].reshape(T, s.k_heads, s.k_dim), self.scale)
            k = qm.l2norm_rows(y[:, kd: 2 * kd].reshape(T, s.k_heads, s.k_dim))
            decay, beta = qm.gdn_gates(a, b, self.dt_bias, self.neg_a)
            o = qm.delta_rule(q, k, y[:, 2 * kd:].reshape(T, s.v_heads, s.v_dim), decay, beta, state["recurrent"])
            return qm.gated_norm(o, z.reshape(T, s.v_heads, s.v_dim), self.norm_w, self.eps).reshape(T, -1)
        y = causal_conv(qkv, state["conv"], self.conv_w)
        q = l2norm(y[:, :kd].reshape(T, s.k_heads, s.k_dim)) * self.scale
        k = l2norm(y[:, kd: 2 * kd].reshape(T, s.k_heads, s.k_dim))
        v = np.ascontiguousarray(y[:, 2 * kd:].reshape(T, s.v_heads, s.v_dim))
        rep = s.v_heads // s.k_heads
        if rep > 1:
            q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
        decay = np.exp(self.neg_a * softplus(a + self.dt_bias))
        o = delta_rule(q, k, v, decay, sigmoid(b), state["recurrent"])
        return gated_rms_norm(o, self.norm_w, z.reshape(T, s.v_heads, s.v_dim), self.eps).reshape(T, -1)


# --- KDA (Kimi-Linear's linear-attention layers) --------------------------------------------------
def softplus_exp(x: np.ndarray) -> np.ndarray:
    """KimiLinearForgetGate's softplus as it is written there: x above 20, else log(1 + e^x) (not
    log1p: the rounding differs from torch's softplus for small e^x)."""
    with np.errstate(over="ignore"):
        e = np.exp(np.minimum(x, np.float32(20)))
        return np.where(x > np.float32(20), x, np.log(np.float32(1.0) + e)).astype(np.float32)


@dataclass(frozen=True)
class KDA:
    """Kimi Delta Attention (transformers' ``KimiLinearDeltaAttention``): q/k/v_proj, each through
    its own causal conv (``{q,k,v}_conv1d``, concatenated in memory: one conv state of 3 x heads x
    head_dim channels, [q | k | v]) + SiLU; q, k l2-normed as x / sqrt(Σx² + 1e-6), q / sqrt(head_dim);
    beta = sigmoid(b_proj x); a per-channel decay g = -exp(A_log_h) * softplus(f_b(f_a x) + dt_bias)
    (``softplus_exp``); the delta rule with decay e^g per key channel; o_norm(o) * sigmoid(g_b(g_a x))
    per head (weight over head_dim, eps rms_norm_eps); o_proj. Its tensors sit under ``self_attn.``."""
    hidden: int
    heads: int
    head_dim: int
    conv_kernel: int

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    def cache_kind(self):
        return (Conv(3 * self.width, self.conv_kernel - 1), Recurrent(self.heads, self.head_dim, self.head_dim))

    def tensors(self, p: str) -> list[Need]:
        H, W, d, n = self.hidden, self.width, self.head_dim, self.heads
        return ([Need(p + f"{x}_proj.weight", (W, H)) for x in "qkv"]
                + [Need(p + f"{x}_conv1d.weight", (W, 1, self.conv_kernel)) for x in "qkv"]
                + [Need(p + "f_a_proj.weight", (d, H)), Need(p + "f_b_proj.weight", (W, d)),
                   Need(p + "dt_bias", (W,)), Need(p + "A_log", (1, 1, n, 1)), Need(p + "b_proj.weight", (n, H)),
                   Need(p + "g_a_proj.weight", (d, H)), Need(p + "g_b_proj.weight", (W, d)),
                   Need(p + "o_norm.weight", (d,)), Need(p + "o_proj.weight", (H, W))])

    def build(self, c, p: str, eps: float) -> "KDAMixer":
        return KDAMixer(self, c, p, eps)


class KDAMixer:
    window = None

    def __init__(self, spec: KDA, c, p: str, eps: float):
        self.spec, self.eps = spec, eps
        self.q, self.k, self.v, self.f_a, self.f_b, self.b, self.g_a, self.g_b, self.out = (
            c.load(p + n + ".weight") for n in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj",
                                                "g_a_proj", "g_b_proj", "o_proj"))
        convs = [np.asarray(c.load(p + f"{x}_conv1d.weight").data, np.float32).reshape(spec.width, spec.conv_kernel)
                 for x in "qkv"]
        self.conv_w = np.ascontiguousarray(np.concatenate(convs, axis=0))
        self.dt_bias = kernels.vector(c.load(p + "dt_bias")).astype(np.float32)
        # -exp(A_log) per head, broadcast over its channels (transformers: -A_log.float().exp() * ...)
        a = np.exp(kernels.vector(c.load(p + "A_log")).astype(np.float32).reshape(spec.heads))
        self.neg_a = (-a).astype(np.float32)[:, None]
        self.norm_w = kernels.vector(c.load(p + "o_norm.weight"))
        self.scale = np.float32(1 / (spec.head_dim ** 0.5))     # transformers: 1 / (d ** 0.5)

    def compiled(self, input_norm, router=None, post_norm=None):
        return whole_core(self, input_norm, kernels.kda_kernels)

    def __call__(self, i: int, h, step, fused: bool = False):
        """fused: the core as one compiled call (the extension is there: ``compiled``)."""
        s, T = self.spec, h.shape[0]
        cache = step.cache
        state = cache.state[i]
        folded = cache.folded
        check_folded(i, folded, cache)
        q, k, v, fa, b, ga = kernels.matmul_many(h, [self.q, self.k, self.v, self.f_a, self.b, self.g_a])
        f, gate = kernels.matmul(fa, self.f_b), kernels.matmul(ga, self.g_b)
        qkv = np.concatenate([q, k, v], axis=-1)
        qm = kernels.kda_kernels()
        if fused:
            # conv + l2norms + gates + per-channel delta rule + gated norm in one compiled call, at any T
            o = qm.kda_block(qkv, f, b, gate, self.conv_w, state["conv"], state["recurrent"], self.dt_bias,
                             self.neg_a, self.norm_w, self.eps, self.scale, s.heads, s.head_dim)
        else:
            o = self.core_steps(qm, qkv, f, b, gate, state)
        folded[i] = cache.length + T
        return linear(o, self.out)

    def core_steps(self, qm, qkv, f, b, gate, state) -> np.ndarray:
        """The core step by step from the projections (qkv [T, 3W] = [q | k | v], f the f_b
        projection, b, gate the g_b projection): with the compiled pieces (``qm``: the bits of its
        one-call ``kda_block``), or the numpy reference (None). Returns [T, W]."""
        s, T = self.spec, qkv.shape[0]
        W, n, d = s.width, s.heads, s.head_dim
        if qm is not None:
            y = qm.gdn_conv(qkv, state["conv"], self.conv_w)
            qn = qm.kda_l2norm_rows(y[:, :W].reshape(T, n, d), self.scale)
            kn = qm.kda_l2norm_rows(y[:, W: 2 * W].reshape(T, n, d))
            decay, beta = qm.kda_gates(f, b, self.dt_bias, self.neg_a)
            o = qm.kda_delta_rule(qn, kn, y[:, 2 * W:].reshape(T, n, d), decay, beta, state["recurrent"])
            return qm.kda_norm(o, gate.reshape(T, n, d), self.norm_w, self.eps).reshape(T, W)
        y = causal_conv(qkv, state["conv"], self.conv_w)
        qn = l2norm(y[:, :W].reshape(T, n, d), divide=True) * self.scale
        kn = l2norm(y[:, W: 2 * W].reshape(T, n, d), divide=True)
        vv = np.ascontiguousarray(y[:, 2 * W:].reshape(T, n, d))
        g = (f + self.dt_bias).reshape(T, n, d)
        decay = np.exp(self.neg_a * softplus_exp(g)).astype(np.float32)
        o = delta_rule(np.ascontiguousarray(qn, np.float32), np.ascontiguousarray(kn, np.float32), vv, decay,
                       sigmoid(b), state["recurrent"])
        return gated_rms_norm(o, self.norm_w, gate.reshape(T, n, d), self.eps, act="sigmoid").reshape(T, W)
