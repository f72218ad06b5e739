"""A decoder layer as the families compose it: pre-norm residual, ``x + mixer(norm(x))`` then
``x + ffn(norm(x))`` (every family up to GLM-5). ``Layer`` is the declaration (its tensors and
its cache kind follow from its blocks); ``DecoderLayer`` holds the loaded weights."""
from __future__ import annotations

from dataclasses import dataclass

from .common import Need, norm_weight


@dataclass(frozen=True)
class Layer:
    mixer: object       # core.blocks.attention.GQA | core.blocks.mla.MLA | core.blocks.linear_attention.GatedDeltaNet
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

    def build(self, c, p: str, eps: float) -> "DecoderLayer":
        return DecoderLayer(self, c, p, eps)


class DecoderLayer:
    def __init__(self, decl: Layer, c, p: str, eps: float):
        self.input_norm = norm_weight(c, p + "input_layernorm.weight", decl.norm_offset)
        self.post_norm = norm_weight(c, p + "post_attention_layernorm.weight", decl.norm_offset)
        self.attn = decl.mixer.build(c, p + decl.mixer_prefix, eps)
        self.ffn = decl.ffn.build(c, p + decl.ffn_prefix)
        self.kind = self.ffn.kind
        self.router = getattr(self.ffn, "router", None)
        # decode's attention block (and a softmax router) in one compiled call, or None (the
        # step-by-step path); chosen by weight scheme and shape only, never by placement. MLA has
        # no compiled_block here: the engine's protocol passes KV views, not the latent cache, so
        # its compiled step (MLAAttention.fast) runs inside the mixer's call at T == 1
        routes = self.router is not None and getattr(self.router, "kind", "") == "softmax_topk"
        make = getattr(self.attn, "compiled_block", None)
        self.attention_block = None if make is None else make(
            self.input_norm, self.router.weight if routes else None, self.post_norm if routes else None,
            self.router.top_k if routes else 0, self.router.norm_topk_prob if routes else False)
        self.block_routes = routes
