"""DeepSeek-V3 / V3.1 / V3.2-style checkpoints and Kimi-K2, which shares the type (transformers'
``DeepseekV3ForCausalLM``): multi-head latent attention (q-LoRA or a plain ``q_proj``; the cache
keeps the compressed latent, core.blocks.mla), interleaved RoPE over ``qk_rope_head_dim`` dims,
yarn with the mscale² softmax scale; the first ``first_k_dense_replace`` layers dense, then the
sigmoid group-limited MoE with shared experts GLM-4.5 has (models.glm4_moe.sigmoid_moe). MTP
layers (``num_nextn_predict_layers``, layer 61 of the real model) are not part of the language
model: the converter writes them aside."""
from __future__ import annotations

import math

from core.arch import ArchSpec, ConfigReader, common_spec
from core.blocks.residual import PreNorm
from core.blocks.mla import MLA
from core.blocks.mlp import SwiGLU
from core.errors import ColiError
from core.rope import check_numbers as check_rope_numbers, rope_parameters

from .glm4_moe import dense_first, sigmoid_moe

# DeepseekV3Config's defaults (transformers 5.24)
DEFAULTS = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, num_experts=256,
                routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu",
                max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_interleave=True, attention_bias=False)
ALIASES = {"num_experts": ("n_routed_experts", "num_local_experts")}


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config: dict, qk_head_dim: int) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)² under a scaled RoPE
    (transformers' yarn_apply_mscale)."""
    scale = qk_head_dim ** -0.5
    p = rope_parameters(config)
    check_rope_numbers(p)          # a malformed field is one clear line, here as in core.rope
    if p.get("rope_type", "default") != "default" and p.get("mscale_all_dim"):
        factor = p.get("factor")
        if factor is None:         # as core.rope's yarn: the context's growth over the original
            original = p.get("original_max_position_embeddings")
            if not original or not config.get("max_position_embeddings"):
                raise ColiError("deepseek_v3 config: rope_parameters has mscale_all_dim but no factor")
            factor = config["max_position_embeddings"] / original
        m = yarn_mscale(factor, p["mscale_all_dim"])
        scale = scale * m * m
    return scale


def mla_spec(r: ConfigReader, generation_config: dict | None, reads_interleave: bool = True,
             **mla_extra) -> tuple[ArchSpec, dict]:
    """The ArchSpec fields MLA families share, and the MLA block's sizes. ``reads_interleave``:
    the family honours ``rope_interleave`` (DeepSeek-V3; GLM-5 always interleaves)."""
    spec = common_spec(r, generation_config)
    r.refuse(spec.num_kv_heads != spec.num_heads, "num_key_value_heads different from num_attention_heads")
    interleave = r.flag("rope_interleave") if reads_interleave and r.get("rope_interleave") is not None else True
    nope, rope, v = r.positive_int("qk_nope_head_dim"), r.positive_int("qk_rope_head_dim"), r.positive_int("v_head_dim")
    r.refuse(rope % 2 != 0, f"an odd qk_rope_head_dim ({rope})")
    # q_lora_rank null means a plain q_proj (the reader would give an absent or null field the default)
    plain_q = "q_lora_rank" in r.config and r.config["q_lora_rank"] is None
    sizes = dict(hidden=spec.hidden_size, heads=spec.num_heads, q_lora_rank=0 if plain_q else r.positive_int("q_lora_rank"),
                 kv_lora_rank=r.positive_int("kv_lora_rank"), qk_nope=nope, qk_rope=rope, v_head_dim=v,
                 scale=softmax_scale(r.config, nope + rope), bias=spec.attention_bias, interleave=interleave)
    sizes.update(mla_extra)
    # transformers points head_dim at the rope dims (the rotary table reads it); ours says the
    # query/key width and keeps the table's size apart
    spec.head_dim, spec.rope_dim = nope + rope, rope
    spec.dense_intermediate = r.positive_int("intermediate_size")
    return spec, sizes


class DeepseekV3:
    model_type = "deepseek_v3"

    @staticmethod
    def spec(config: dict, generation_config: dict | None = None) -> ArchSpec:
        r = ConfigReader("deepseek_v3", config, DEFAULTS, ALIASES)
        spec, sizes = mla_spec(r, generation_config)
        spec.mlp_kinds = dense_first(r, spec)
        attention = MLA(**sizes)
        moe = sigmoid_moe(r, spec) if spec.num_experts else None
        spec.layers = [PreNorm(attention, moe if kind == "moe" else SwiGLU(spec.hidden_size, spec.dense_intermediate))
                       for kind in spec.mlp_kinds]
        spec.cache_kinds = [layer.cache_kind() for layer in spec.layers]
        return spec
