"""Residual kinds: how a decoder layer wires its mixer and its ffn into the residual stream. A
family composes its layers from these; the engine only calls them, ``L(i, x, step) -> x``.

``PreNorm`` is every family's layer so far: ``x + mixer(norm(x))`` then ``x + ffn(norm(x))``.
It is the declaration (its tensors and cache kind follow from its blocks); ``PreNormLayer`` holds
the loaded weights and owns

* the forward, ``__call__(i, x, step)``, calling ``step.mixed(i, x)`` between the two halves (the
  clock's split of attention from experts, and the lookahead prefetch);
* ``router_input(x, step)``: what its MoE router sees given the residual x arriving at its ffn
  (the lookahead asks the next MoE layer this of the current residual);
* its compiled path: at build it asks the mixer for ``compiled(input_norm, router, post_norm)``,
  a call ``fn(i, x, step) -> (x + mixer(norm x), h, routed)`` (h: the ffn's normed input and
  routed: (top, weights) when the call ran the router tail too, else None) that may decline a
  pass by returning None; the layer uses it while ``step.fused``, else the step-by-step mixer.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import kernels
from .common import Need, norm_weight


@dataclass(frozen=True)
class PreNorm:
    mixer: object       # core.blocks.attention.GQA | core.blocks.mla.MLA | core.blocks.linear_attention.GatedDeltaNet | KDA
    ffn: object         # core.blocks.mlp.SwiGLU | core.blocks.mlp.MoE
    norm_offset: float = 0.0    # the two norms multiply by weight + this ((1+w) RMSNorm: 1, folded at load)
    ffn_prefix: str = "mlp."    # where the ffn's tensors sit (Kimi: ``block_sparse_moe.``, dense layers too)

    @property
    def mixer_prefix(self) -> str:
        """Where the mixer's tensors sit in the layer: ``self_attn.`` (attention) unless the
        mixer says otherwise (``linear_attn.``)."""
        return getattr(self.mixer, "prefix", "self_attn.")

    @property
    def kind(self) -> str:
        return "moe" if hasattr(self.ffn, "num_experts") else "dense"

    def tensors(self, p: str, hidden: int) -> list[Need]:
        return ([Need(p + "input_layernorm.weight", (hidden,)), Need(p + "post_attention_layernorm.weight", (hidden,))]
                + self.mixer.tensors(p + self.mixer_prefix) + self.ffn.tensors(p + self.ffn_prefix))

    def cache_kind(self):
        return self.mixer.cache_kind()

    def build(self, c, p: str, eps: float) -> "PreNormLayer":
        return PreNormLayer(self, c, p, eps)


class PreNormLayer:
    def __init__(self, decl: PreNorm, c, p: str, eps: float):
        self.eps = eps
        self.input_norm = norm_weight(c, p + "input_layernorm.weight", decl.norm_offset)
        self.post_norm = norm_weight(c, p + "post_attention_layernorm.weight", decl.norm_offset)
        self.mixer = decl.mixer.build(c, p + decl.mixer_prefix, eps)
        self.ffn = decl.ffn.build(c, p + decl.ffn_prefix)
        self.kind = self.ffn.kind
        self.router = getattr(self.ffn, "router", None)
        # chosen by weight scheme and shape only, never by placement
        make = getattr(self.mixer, "compiled", None)
        self.compiled = None if make is None else make(self.input_norm, self.router, self.post_norm)

    def __call__(self, i: int, x, step):
        out = self.compiled(i, x, step) if self.compiled is not None and step.fused else None
        if out is None:
            x, h, routed = x + self.mixer(i, kernels.rms_norm(x, self.input_norm, self.eps), step), None, None
        else:
            x, h, routed = out
        step.mixed(i, x)
        if h is None:
            h = kernels.rms_norm(x, self.post_norm, self.eps)
        return x + self.ffn(i, h, step, routed)

    def router_input(self, x, step):
        return kernels.rms_norm(x, self.post_norm, self.eps)
