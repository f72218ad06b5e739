"""OLMoE (allenai): every layer MoE; q/k RMSNorm over the whole projection (all heads at once);
optional clip_qkv applied after that norm; router softmax top-k, no renormalisation by default."""
from __future__ import annotations

from core.arch import ArchSpec, ConfigReader, common_spec
from core.blocks.attention import GQA
from core.blocks.mlp import MoE
from core.blocks.residual import PreNorm
from core.blocks.routers import SoftmaxRouter

# OlmoeConfig's defaults (transformers 5), used for fields absent from config.json
DEFAULTS = dict(vocab_size=50304, hidden_size=2048, intermediate_size=2048, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=None, hidden_act="silu",
                max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                attention_bias=False, clip_qkv=None, num_experts_per_tok=8, num_experts=64,
                norm_topk_prob=False)
ALIASES = {"num_experts": ("num_local_experts",)}   # the config class's attribute_map


class Olmoe:
    model_type = "olmoe"

    @staticmethod
    def spec(config: dict, generation_config: dict | None = None) -> ArchSpec:
        r = ConfigReader("olmoe", config, DEFAULTS, ALIASES)
        spec = common_spec(r, generation_config)
        # q_norm is sized hidden_size and k_norm (hidden/heads)*kv_heads in transformers, which only
        # fits the projections when head_dim == hidden/heads
        r.refuse(spec.head_dim * spec.num_heads != spec.hidden_size,
                 "head_dim different from hidden_size / num_attention_heads")
        r.refuse(spec.num_experts == 0, "num_experts = 0")
        clip = r.number("clip_qkv", optional=True)
        spec.expert_intermediate = r.positive_int("intermediate_size")
        H = spec.hidden_size
        layer = PreNorm(GQA(H, spec.num_heads, spec.num_kv_heads, spec.head_dim, "full", clip, bias=spec.attention_bias),
                        MoE(H, spec.num_experts, SoftmaxRouter(spec.top_k, spec.norm_topk_prob), spec.expert_intermediate))
        spec.layers = [layer] * spec.num_layers
        spec.cache_kinds = [layer.cache_kind() for layer in spec.layers]
        return spec
