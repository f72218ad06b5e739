"""Qwen3.5 / Qwen3.6 MoE (transformers' ``Qwen3_5MoeForCausalLM`` for ``qwen3_5_moe_text``, and the
language model of ``Qwen3_5MoeForConditionalGeneration`` for the composite ``qwen3_5_moe``, whose
``text_config`` holds the fields below): a hybrid of linear-attention layers (Gated DeltaNet,
core.blocks.linear_attention, with a fixed-size conv and recurrent state) and full-attention
layers, by ``layer_types`` (or every ``full_attention_interval``-th layer full, 4 by default).

* Full layers: gated attention -- ``q_proj`` rows per head [q_h | gate_h], the output times
  sigmoid(gate) -- with per-head q/k norms, rotate-half RoPE on the first
  ``partial_rotary_factor`` (0.25 by default) of each head. The multimodal RoPE (``mrope_section``)
  turns text positions, equal on its three axes, into plain RoPE: the interleaving only chooses
  which axis each frequency reads, and all three hold the same position.
* Every layer MoE: softmax top-k, always renormalised (``Qwen3_5MoeTopKRouter`` has no
  ``norm_topk_prob``), plus one shared expert (``mlp.shared_expert.``) times
  sigmoid(``mlp.shared_expert_gate`` x).
* Norms are (1 + w) RMSNorms (the decoder's two, the final one, q/k): +1 folded at load; the
  linear layers' gated norm is a plain-weight RMSNorm times silu(z).
* Checkpoints: the text-only form under ``model.``; the composite under ``model.language_model.``
  with a vision tower ``model.visual.*`` (left out by the converter) and the head at
  ``lm_head.weight`` (tied by the top-level ``tie_word_embeddings``); MTP under ``mtp.*`` (set
  aside by the converter, core.converter.mtp_group).
"""
from __future__ import annotations

from core.arch import ArchSpec, ConfigReader, common_spec, eos_ids
from core.blocks.attention import GQA
from core.blocks.residual import PreNorm
from core.blocks.linear_attention import GatedDeltaNet
from core.blocks.mlp import MoE, SwiGLU
from core.blocks.routers import SoftmaxRouter
from core.errors import ColiError
from core.rope import rope_parameters

# Qwen3_5MoeTextConfig's defaults (transformers 5.24), used for fields absent from config.json
DEFAULTS = dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                num_key_value_heads=2, hidden_act="silu", max_position_embeddings=32768,
                rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, head_dim=256,
                linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512,
                shared_expert_intermediate_size=512, num_experts_per_tok=8, num_experts=256,
                layer_types=None, full_attention_interval=4, norm_topk_prob=True)
ALIASES: dict = {}
PARTIAL_ROTARY_DEFAULT = 0.25     # Qwen3_5MoeTextConfig.__post_init__'s
COMPOSITE_PREFIX = "model.language_model."
TEXT_PREFIX = "model."
VISION_PREFIX = "model.visual."
LAYER_TYPES = ("linear_attention", "full_attention")


def layer_types(r: ConfigReader, layers: int) -> list[str]:
    """Per layer "linear_attention" | "full_attention", as Qwen3_5MoeTextConfig derives it."""
    given = r.get("layer_types")
    if given is None:
        interval = r.get("full_attention_interval")
        if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
            raise ColiError(f"qwen3_5_moe config: full_attention_interval must be a positive integer, got {interval!r}")
        return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if not isinstance(given, list) or len(given) != layers or not all(t in LAYER_TYPES for t in given):
        raise ColiError(f"qwen3_5_moe config: layer_types must list 'linear_attention' or 'full_attention' "
                        f"for each of the {layers} layers, got {given!r}")
    return list(given)


class Qwen3_5Moe:
    model_type = "qwen3_5_moe"
    model_types = ("qwen3_5_moe", "qwen3_5_moe_text")

    @staticmethod
    def spec(config: dict, generation_config: dict | None = None) -> ArchSpec:
        composite = "text_config" in config
        text = config.get("text_config") if composite else config
        if not isinstance(text, dict):
            raise ColiError(f"qwen3_5_moe config: text_config must be a JSON object, got {text!r}")
        r = ConfigReader("qwen3_5_moe", text, DEFAULTS, ALIASES)
        spec = common_spec(r, generation_config)
        if composite:        # the composite model's head is tied (or not) by its own field
            top = config.get("tie_word_embeddings", False)
            if not isinstance(top, bool):
                raise ColiError(f"qwen3_5_moe config: tie_word_embeddings must be true or false, got {top!r}")
            spec.tie_word_embeddings = top
            spec.eos_token_ids = spec.eos_token_ids or eos_ids(config, generation_config)
        r.refuse(spec.num_experts == 0, "num_experts = 0 (every layer is MoE)")
        spec.norm_topk_prob = True           # the router always renormalises its top-k
        H, hd = spec.hidden_size, spec.head_dim
        factor = rope_parameters(text).get("partial_rotary_factor", PARTIAL_ROTARY_DEFAULT)
        rope_dim = int(hd * factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) \
            and 0 < factor <= 1 else 0
        r.refuse(rope_dim < 2 or rope_dim % 2, f"partial_rotary_factor {factor!r} with head_dim {hd}")
        spec.rope_dim, spec.rope_partial = rope_dim, True
        types = layer_types(r, spec.num_layers)
        kh, vh = r.positive_int("linear_num_key_heads"), r.positive_int("linear_num_value_heads")
        r.refuse(vh % kh != 0, f"linear_num_value_heads {vh} not a multiple of linear_num_key_heads {kh}")
        gdn = GatedDeltaNet(H, kh, vh, r.positive_int("linear_key_head_dim"), r.positive_int("linear_value_head_dim"),
                            r.positive_int("linear_conv_kernel_dim"))
        attention = GQA(H, spec.num_heads, spec.num_kv_heads, hd, "per_head", rope_dim=rope_dim,
                        bias=spec.attention_bias, gated=True, norm_offset=1.0)
        spec.expert_intermediate = r.positive_int("moe_intermediate_size")
        shared = SwiGLU(H, r.positive_int("shared_expert_intermediate_size"))
        moe = MoE(H, spec.num_experts, SoftmaxRouter(spec.top_k, True), spec.expert_intermediate, shared,
                  shared_prefix="shared_expert.", shared_gate=True)
        spec.mlp_kinds = ["moe"] * spec.num_layers
        spec.layers = [PreNorm(gdn if t == "linear_attention" else attention, moe, norm_offset=1.0) for t in types]
        spec.cache_kinds = [layer.cache_kind() for layer in spec.layers]
        spec.norm_offset = 1.0
        spec.prefix = COMPOSITE_PREFIX if composite else TEXT_PREFIX
        spec.text_config = text if composite else None
        spec.dropped = (VISION_PREFIX,)
        return spec
