"""MoE routers. Each router kind routes a layer's hidden states to its experts and predicts, from
an earlier hidden state, which experts the layer will want (lookahead prefetch) with its own rule,
so the store can start reading them -- a prediction decides speed only, never which experts run.
"""
from __future__ import annotations

import numpy as np

from .. import kernels
from .common import load_needs


class SoftmaxTopK:
    """OLMoE / Qwen3-MoE: softmax over every expert's logit, the ``top_k`` largest, renormalised
    to sum to 1 when ``norm_topk_prob`` (transformers' ``OlmoeTopKRouter`` / ``Qwen3MoeTopKRouter``)."""
    kind = "softmax_topk"

    def __init__(self, weight: np.ndarray, top_k: int, norm_topk_prob: bool):
        self.weight, self.top_k, self.norm_topk_prob = weight, top_k, norm_topk_prob

    def route(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(experts [T, top_k], weights [T, top_k]) for each row of h, strongest first."""
        return kernels.softmax_topk(kernels.router_logits(h, self.weight), self.top_k, self.norm_topk_prob)

    def predict(self, h: np.ndarray) -> list[int]:
        """The experts h would be routed to, strongest predictions first, each once."""
        top, weights = self.route(h)
        order = np.argsort(-weights, axis=None, kind="stable")
        return list(dict.fromkeys(int(e) for e in top.reshape(-1)[order]))


class SigmoidGroupTopK:
    """DeepSeek-V3 / GLM-4.5 / GLM-5 (transformers' ``DeepseekV3TopkRouter``): sigmoid scores; the
    choice adds ``e_score_correction_bias``; experts come in ``n_group`` groups, a group scores
    the sum of its two best choices, and only the ``topk_group`` best groups take part; the
    ``top_k`` best choices there are routed with their *scores* (without the bias), renormalised
    when ``norm_topk_prob`` (+1e-20) and times ``routed_scaling_factor``. Ties go to the lower
    index (transformers' topk is unsorted; the rank order is ours: choice descending)."""
    kind = "sigmoid_group"

    def __init__(self, weight: np.ndarray, bias: np.ndarray, top_k: int, n_group: int,
                 topk_group: int, norm_topk_prob: bool, scaling: float):
        self.weight, self.bias = weight, np.asarray(bias, np.float32)
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, np.float32(scaling)

    def route(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits = kernels.router_logits(h, self.weight).astype(np.float32, copy=False)
        scores = (np.float32(1) / (np.float32(1) + np.exp(-logits))).astype(np.float32)
        choice = scores + self.bias
        T, E = choice.shape
        if self.n_group > 1 and self.topk_group < self.n_group:
            grouped = choice.reshape(T, self.n_group, E // self.n_group)
            best2 = -np.sort(-grouped, axis=-1)[..., :2]
            group_score = best2[..., 0] + best2[..., 1] if best2.shape[-1] > 1 else best2[..., 0]
            keep = np.argsort(-group_score, axis=1, kind="stable")[:, : self.topk_group]
            allowed = np.zeros((T, self.n_group), bool)
            np.put_along_axis(allowed, keep, True, axis=1)
            choice = np.where(np.repeat(allowed, E // self.n_group, axis=1), choice, np.float32(-np.inf))
        top = np.argsort(-choice, axis=1, kind="stable")[:, : self.top_k]
        weights = np.take_along_axis(scores, top, axis=1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(axis=1, keepdims=True) + np.float32(1e-20))
        return top.astype(np.int64), (weights * self.scaling).astype(np.float32)

    predict = SoftmaxTopK.predict


def route_scores(logits: np.ndarray, fn: str) -> np.ndarray:
    """A router's per-expert scores: ``sqrtsoftplus`` sqrt(softplus(l)) (DeepSeek V4) or
    ``sigmoid``."""
    logits = logits.astype(np.float32, copy=False)
    if fn == "sqrtsoftplus":      # torch's softplus: x itself above 20
        return np.sqrt(np.where(logits > 20, logits, np.logaddexp(np.float32(0), logits))).astype(np.float32)
    return (np.float32(1) / (np.float32(1) + np.exp(-logits))).astype(np.float32)


def chosen_weights(scores: np.ndarray, top: np.ndarray, scaling: np.float32) -> np.ndarray:
    """The chosen experts' scores, renormalised (+1e-20) and times ``scaling``."""
    w = np.take_along_axis(scores, top, axis=1)
    return (w / (w.sum(axis=1, keepdims=True) + np.float32(1e-20)) * scaling).astype(np.float32)


class ScoreTopK:
    """DeepSeek V4 / Inkling: a score per expert (route_scores), ``bias`` added only to choose the
    ``top_k`` (no groups), the chosen scores renormalised and times ``scaling`` (transformers'
    ``DeepseekV4TopKRouter``). Ties go to the lower index."""
    kind = "score_topk"

    def __init__(self, weight: np.ndarray, bias: np.ndarray, top_k: int, fn: str, scaling: float):
        self.weight, self.bias, self.top_k, self.fn = weight, np.asarray(bias, np.float32), top_k, fn
        self.scaling = np.float32(scaling)

    def route(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        scores = route_scores(kernels.router_logits(h, self.weight), self.fn)
        top = np.argsort(-(scores + self.bias), axis=1, kind="stable")[:, : self.top_k]
        return top.astype(np.int64), chosen_weights(scores, top, self.scaling)

    predict = SoftmaxTopK.predict


# --- what a family declares (the tensors follow from it) ------------------------------------------
class SoftmaxRouter:
    """Declares a SoftmaxTopK router: ``mlp.gate.weight`` [experts, hidden]."""

    def __init__(self, top_k: int, norm_topk_prob: bool):
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def tensors(self, p: str, experts: int, hidden: int):
        from .common import Need
        return [Need(p + "gate.weight", (experts, hidden))]

    def build(self, c, p: str, experts: int, hidden: int):
        w = load_needs(c, self.tensors(p, experts, hidden), p)
        return SoftmaxTopK(_router_weight(w, p, experts, hidden), self.top_k, self.norm_topk_prob)


class SigmoidGroupRouter:
    """Declares a SigmoidGroupTopK router: ``mlp.gate.weight`` [experts, hidden] and
    ``mlp.gate.e_score_correction_bias`` [experts]."""

    def __init__(self, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float):
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, scaling

    def tensors(self, p: str, experts: int, hidden: int):
        from .common import Need
        return [Need(p + "gate.weight", (experts, hidden)), Need(p + "gate.e_score_correction_bias", (experts,))]

    def build(self, c, p: str, experts: int, hidden: int):
        w = load_needs(c, self.tensors(p, experts, hidden), p)
        bias = kernels.vector(w["gate.e_score_correction_bias"])
        return SigmoidGroupTopK(_router_weight(w, p, experts, hidden), bias, self.top_k, self.n_group,
                                self.topk_group, self.norm_topk_prob, self.scaling)


class ScoreRouter:
    """Declares a ScoreTopK router: ``gate.weight`` [experts, hidden] and its bias [experts],
    ``gate.{bias_name}`` (DeepSeek V4's checkpoints: ``gate.bias``)."""

    def __init__(self, top_k: int, fn: str, scaling: float, bias_name: str = "e_score_correction_bias"):
        self.top_k, self.fn, self.scaling, self.bias_name = top_k, fn, scaling, bias_name

    def tensors(self, p: str, experts: int, hidden: int):
        from .common import Need
        return [Need(p + "gate.weight", (experts, hidden), float32=True), Need(p + "gate." + self.bias_name, (experts,))]

    def build(self, c, p: str, experts: int, hidden: int):
        w = load_needs(c, self.tensors(p, experts, hidden), p)
        bias = kernels.vector(w["gate." + self.bias_name])
        return ScoreTopK(_router_weight(w, p, experts, hidden), bias, self.top_k, self.fn, self.scaling)


def _router_weight(w: dict, p: str, experts: int, hidden: int) -> np.ndarray:
    from ..errors import ColiError
    weight = kernels.vector(w["gate.weight"])
    if weight.shape != (experts, hidden):
        raise ColiError(f"{p}gate.weight: router shape {weight.shape} does not match the config")
    return weight
