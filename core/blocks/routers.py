"""MoE routers. Each router kind routes a layer's hidden states to its experts and predicts, from
an earlier hidden state, which experts the layer will want (lookahead prefetch) with its own rule,
so the store can start reading them -- a prediction decides speed only, never which experts run.
"""
from __future__ import annotations

import numpy as np

from .. import kernels


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
