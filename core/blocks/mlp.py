"""Feed-forward blocks: the dense SwiGLU MLP, and the MoE block (a router, routed SwiGLU experts
served by the expert store, optional shared experts kept with the dense weights).

The MoE block asks the engine's store for the experts its router chose and sums their outputs in
rank order into fixed (token, rank) slots, so the order in which experts arrive -- which depends
on where they live -- can never change the output (DESIGN.md's one law).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import kernels
from ..errors import ColiError
from ..store import ExpertFFN
from .common import Need, load_needs


def expert_ffn(x: np.ndarray, ffn: ExpertFFN, limit: float | None = None) -> np.ndarray:
    """down(silu(gate x) * up x); with ``limit`` the clamped SwiGLU of DeepSeek V4 / GLM-5.3-Flash
    (gate clamped to <= limit, up to [-limit, limit]: kernels.swiglu_many clamps the same way)."""
    g, u = kernels.matmul(x, ffn.gate), kernels.matmul(x, ffn.up)
    if limit is not None:
        g, u = np.minimum(g, np.float32(limit)), np.clip(u, np.float32(-limit), np.float32(limit))
    return kernels.matmul(kernels.silu(g) * u, ffn.down)


@dataclass(frozen=True)
class SwiGLU:
    """down(silu(gate x) * up x); ``intermediate`` None: whatever the tensors say (consistently)."""
    hidden: int
    intermediate: int | None = None
    parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")   # DeepSeek V4: w1, w3, w2

    def tensors(self, p: str) -> list[Need]:
        I, H = self.intermediate, self.hidden
        gate, up, down = (p + n + ".weight" for n in self.parts)
        if I is None:
            return [Need(gate, None), Need(up, None), Need(down, None)]
        return [Need(gate, (I, H)), Need(up, (I, H)), Need(down, (H, I))]

    def build(self, c, p: str) -> "DenseMLP":
        w = load_needs(c, self.tensors(p), p)
        return DenseMLP(ExpertFFN(*(w[n + ".weight"] for n in self.parts)))


class DenseMLP:
    kind = "dense"

    def __init__(self, ffn: ExpertFFN):
        self.mlp = ffn

    def __call__(self, i, h, step, routed=None):
        return expert_ffn(h, self.mlp)


@dataclass(frozen=True)
class MoE:
    """Routed experts ``mlp.experts.E.{gate,up,down}_proj`` (each of ``intermediate``, None: from
    the tensors) behind ``router`` (core.blocks.routers' SoftmaxRouter / SigmoidGroupRouter), and
    ``shared``, an always-resident SwiGLU added to every position (``mlp.shared_experts.``)."""
    hidden: int
    num_experts: int
    router: object
    intermediate: int | None = None
    shared: SwiGLU | None = None
    shared_prefix: str = "shared_experts."     # Qwen's one shared expert: "shared_expert."
    # Qwen's sigma-gated shared expert: its output times sigmoid(shared_expert_gate x) ([1, hidden])
    shared_gate: bool = False
    # the routed experts' tensor names (gate, up, down) as the checkpoint has them: Kimi's
    # ``w1`` / ``w3`` / ``w2``; the container maps them back (manifest ``expert_parts``)
    expert_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    limit: float | None = None      # the clamped SwiGLU (expert_ffn) of routed and shared experts

    def tensors(self, p: str) -> list[Need]:
        out = list(self.router.tensors(p, self.num_experts, self.hidden))
        expert = SwiGLU(self.hidden, self.intermediate)
        names = dict(zip(("gate_proj", "up_proj", "down_proj"), self.expert_parts))
        for e in range(self.num_experts):
            for need in expert.tensors(p + f"experts.{e}."):
                head, part, tail = need.name.rsplit(".", 2)
                out.append(Need(f"{head}.{names[part]}.{tail}", need.shape, need.optional, need.synthetic))
        if self.shared is not None:
            out += self.shared.tensors(p + self.shared_prefix)
            if self.shared_gate:
                out.append(Need(p + "shared_expert_gate.weight", (1, self.hidden)))
        return out

    def build(self, c, p: str) -> "MoEBlock":
        shared = self.shared.build(c, p + self.shared_prefix).mlp if self.shared is not None else None
        gate = c.load(p + "shared_expert_gate.weight") if shared is not None and self.shared_gate else None
        return MoEBlock(self.router.build(c, p, self.num_experts, self.hidden), shared, gate, self.limit)


class MoEBlock:
    kind = "moe"

    def __init__(self, router, shared: ExpertFFN | None = None, shared_gate=None, limit: float | None = None):
        self.router, self.shared, self.shared_gate, self.limit = router, shared, shared_gate, limit

    def __call__(self, i: int, h: np.ndarray, step, routed=None) -> np.ndarray:
        """routed: (top, weights) of h when the attention block computed them already. ``step``
        (core.step.Step) gives the store and records routing (usage, trace, prefetch recall)."""
        top, weights = routed if routed is not None else self.router.route(h)
        ids, used = step.record_routing(i, top, step.pos)
        # Each unique expert of the batch is fetched once; whatever is ready (all hits, then
        # misses as they arrive) runs as one kernel pass; results land in fixed (token, rank)
        # slots and are summed in rank order, so arrival and grouping cannot change the output.
        if h.shape[0] == 1:    # decode: every expert reads the one row (laid out once)
            contrib = np.empty((1, top.shape[1], h.shape[1]), np.float32)
            for batch in step.store.request_batches(i, used):
                kernels.swiglu_one(h, [ffn for _, ffn in batch], contrib[0], [ids.index(e) for e, _ in batch],
                                   self.limit)
            out = kernels.rank_sum(contrib[0], weights[0])
        else:
            # prefill: each batch's expert outputs go to the next rows of y (expert after expert);
            # slots[t, r] records the row holding token t's rank-r expert output
            T, k = top.shape
            y = np.empty((T * k, h.shape[1]), np.float32)
            slots = np.full((T, k), -1, np.int64)     # a slot left unset fails the combine
            at = 0
            for batch in step.store.request_batches(i, used):
                picks = [np.nonzero(top == e) for e, _ in batch]
                rows = np.concatenate([r for r, _ in picks])
                ranks = np.concatenate([r for _, r in picks])
                kernels.swiglu_many(h[rows], [ffn for _, ffn in batch], kernels.spans(len(r) for r, _ in picks),
                                    out=y[at: at + len(rows)], limit=self.limit)
                slots[rows, ranks] = np.arange(at, at + len(rows))
                at += len(rows)
                step.check_cancel()     # a prefill batch of experts can take a while
            out = kernels.rank_combine(y, slots, weights)   # rank 0 + rank 1 + ..., in that order
        if self.shared is not None:
            y = expert_ffn(h, self.shared, self.limit)
            if self.shared_gate is not None:     # sigmoid(gate x) per position
                with np.errstate(over="ignore"):
                    y = (np.float32(1.0) / (np.float32(1.0) + np.exp(-kernels.matmul(h, self.shared_gate)))) * y
            out = out + y
        return out


def check_mlp_shapes(shapes, p: str, hidden: int, where: str) -> None:
    """gate/up [I, H], down [H, I], the same I (for a SwiGLU whose I the config does not fix)."""
    gate = tuple(shapes[p + "gate_proj.weight"])
    if len(gate) != 2 or gate[1] != hidden:
        raise ColiError(f"{where}: tensor {p}gate_proj.weight has shape {list(gate)}, but "
                        f"the config needs [intermediate, {hidden}]")
    for name, want in (("up_proj.weight", gate), ("down_proj.weight", (hidden, gate[0]))):
        got = tuple(shapes[p + name])
        if got != want:
            raise ColiError(f"{where}: tensor {p}{name} has shape {list(got)}, but the config needs {list(want)}")
