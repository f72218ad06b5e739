"""OLMoE (allenai): every layer MoE; q/k RMSNorm over the whole projection (all heads at once);
optional clip_qkv applied after that norm; router softmax top-k, no renormalisation by default."""
from __future__ import annotations

from core.arch import ArchSpec, ConfigReader, common_spec

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
        spec = common_spec(r, generation_config, qk_norm="full")
        # q_norm is sized hidden_size and k_norm (hidden/heads)*kv_heads in transformers, which only
        # fits the projections when head_dim == hidden/heads
        r.refuse(spec.head_dim * spec.num_heads != spec.hidden_size,
                 "head_dim different from hidden_size / num_attention_heads")
        r.refuse(spec.num_experts == 0, "num_experts = 0")
        spec.clip_qkv = r.number("clip_qkv", optional=True)
        spec.expert_intermediate = r.positive_int("intermediate_size")
        return spec
