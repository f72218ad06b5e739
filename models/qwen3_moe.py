"""Qwen3-MoE: q/k RMSNorm per head (over head_dim); dense MLP layers where ``mlp_only_layers``
or ``decoder_sparse_step`` say so; optional sliding-window attention on every layer when
``use_sliding_window`` is set."""
from __future__ import annotations

from core.arch import ArchSpec, ConfigReader, common_spec
from core.blocks.attention import GQA
from core.blocks.mlp import MoE, SwiGLU
from core.blocks.residual import PreNorm
from core.blocks.routers import SoftmaxRouter

# Qwen3MoeConfig's defaults (transformers 5), used for fields absent from config.json
DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                num_attention_heads=32, num_key_value_heads=4, hidden_act="silu",
                max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                attention_bias=False, use_sliding_window=False, sliding_window=4096,
                decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8,
                num_experts=128, norm_topk_prob=False, mlp_only_layers=[])
ALIASES = {"num_experts": ("num_local_experts",)}   # the config class's attribute_map


class Qwen3Moe:
    model_type = "qwen3_moe"

    @staticmethod
    def spec(config: dict, generation_config: dict | None = None) -> ArchSpec:
        r = ConfigReader("qwen3_moe", config, DEFAULTS, ALIASES)
        spec = common_spec(r, generation_config)
        step = r.int("decoder_sparse_step")
        r.refuse(step == 0 and spec.num_experts > 0, "decoder_sparse_step = 0")
        dense_only = set(r.int_list("mlp_only_layers"))
        spec.mlp_kinds = ["moe" if (i not in dense_only and spec.num_experts > 0 and (i + 1) % step == 0)
                          else "dense" for i in range(spec.num_layers)]
        spec.expert_intermediate = r.positive_int("moe_intermediate_size")
        spec.dense_intermediate = r.positive_int("intermediate_size")
        window = r.positive_int("sliding_window") if r.flag("use_sliding_window") and r.get("sliding_window") else None
        H = spec.hidden_size
        attention = GQA(H, spec.num_heads, spec.num_kv_heads, spec.head_dim, "per_head", None, window,
                        bias=spec.attention_bias)
        moe = MoE(H, spec.num_experts, SoftmaxRouter(spec.top_k, spec.norm_topk_prob), spec.expert_intermediate)
        dense = SwiGLU(H, spec.dense_intermediate)
        spec.layers = [PreNorm(attention, moe if kind == "moe" else dense) for kind in spec.mlp_kinds]
        spec.cache_kinds = [layer.cache_kind() for layer in spec.layers]
        return spec
