"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (transformers' ``Glm4MoeForCausalLM``): grouped-query
attention with q/k/v biases (no o_proj bias), optional per-head q/k RMSNorm (``use_qk_norm``),
rotate-half RoPE on the first ``partial_rotary_factor`` (0.5 by default) of each head; the first
``first_k_dense_replace`` layers dense, the rest MoE with a sigmoid, group-limited router
(``e_score_correction_bias``, ``n_group`` / ``topk_group``, ``routed_scaling_factor``) and
``n_shared_experts`` shared experts as one SwiGLU. MTP layers (``num_nextn_predict_layers``) are
not part of the language model: the converter writes them aside."""
from __future__ import annotations

from core.arch import ArchSpec, ConfigReader, common_spec
from core.blocks.attention import GQA
from core.blocks.residual import PreNorm
from core.blocks.mlp import MoE, SwiGLU
from core.blocks.routers import SigmoidGroupRouter
from core.rope import rope_parameters

# Glm4MoeConfig's defaults (transformers 5.24), used for fields absent from config.json
DEFAULTS = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
                num_attention_heads=96, num_key_value_heads=8, hidden_act="silu",
                max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                attention_bias=False, moe_intermediate_size=1408, num_experts_per_tok=8,
                n_shared_experts=1, num_experts=128, routed_scaling_factor=1.0, n_group=1,
                topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False)
# attribute_map (num_local_experts -> n_routed_experts), and the key the Hub's configs use
ALIASES = {"num_experts": ("n_routed_experts", "num_local_experts")}
MAX_SCALING = 1e4       # real models use 1-2.5; far larger overflows float32 activations


def sigmoid_moe(r: ConfigReader, spec: ArchSpec) -> MoE:
    """The DeepSeek-V3-style MoE block GLM-4.5, DeepSeek-V3 and GLM-5 share: a sigmoid
    group-limited router and ``n_shared_experts`` x ``moe_intermediate_size`` shared experts."""
    E, n_group, topk_group = spec.num_experts, r.positive_int("n_group"), r.positive_int("topk_group")
    r.refuse(E % n_group != 0, f"n_group {n_group} not dividing {E} experts")
    r.refuse(topk_group > n_group, f"topk_group {topk_group} > n_group {n_group}")
    r.refuse(n_group > 1 and E // n_group < 2, "groups of one expert (the group score sums the top 2)")
    r.refuse(n_group > 1 and topk_group * (E // n_group) < spec.top_k,
             f"num_experts_per_tok {spec.top_k} above the experts of {topk_group} groups")
    inter, shared = r.positive_int("moe_intermediate_size"), r.int("n_shared_experts")
    scaling = r.number("routed_scaling_factor")
    r.refuse(scaling > MAX_SCALING, f"routed_scaling_factor {scaling:g} (implausibly large: the logits overflow)")
    router = SigmoidGroupRouter(spec.top_k, n_group, topk_group, spec.norm_topk_prob, scaling)
    return MoE(spec.hidden_size, E, router, inter, SwiGLU(spec.hidden_size, inter * shared) if shared else None)


def dense_first(r: ConfigReader, spec: ArchSpec) -> list[str]:
    """'dense' for the first ``first_k_dense_replace`` layers, 'moe' after."""
    k = r.int("first_k_dense_replace")
    return ["dense" if i < k or spec.num_experts == 0 else "moe" for i in range(spec.num_layers)]


class Glm4Moe:
    model_type = "glm4_moe"

    @staticmethod
    def spec(config: dict, generation_config: dict | None = None) -> ArchSpec:
        r = ConfigReader("glm4_moe", config, DEFAULTS, ALIASES)
        spec = common_spec(r, generation_config)
        factor = rope_parameters(config).get("partial_rotary_factor", 0.5)   # the config class's default
        rope_dim = int(spec.head_dim * factor) if isinstance(factor, (int, float)) and 0 < factor <= 1 else 0
        r.refuse(rope_dim < 2 or rope_dim % 2, f"partial_rotary_factor {factor!r} with head_dim {spec.head_dim}")
        spec.rope_dim, spec.rope_partial = rope_dim, True
        spec.mlp_kinds = dense_first(r, spec)
        spec.dense_intermediate = r.positive_int("intermediate_size")
        attention = GQA(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                        "per_head" if r.flag("use_qk_norm") else "none",
                        rope_dim=rope_dim, o_bias=False, bias=spec.attention_bias)
        moe = sigmoid_moe(r, spec) if spec.num_experts else None
        spec.layers = [PreNorm(attention, moe if kind == "moe" else SwiGLU(spec.hidden_size, spec.dense_intermediate))
                       for kind in spec.mlp_kinds]
        spec.cache_kinds = [layer.cache_kind() for layer in spec.layers]
        return spec
