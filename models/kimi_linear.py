"""Kimi-Linear / Kimi K3 (transformers' ``KimiLinearForCausalLM``): a hybrid of KDA layers (Kimi
Delta Attention, core.blocks.linear_attention.KDA: the delta rule with a per-channel decay, a
fixed-size conv and recurrent state) and full layers of MLA with NoPE (core.blocks.mla with
``rope`` off: the shared ``qk_rope_head_dim`` key part is used unrotated; a plain ``q_proj`` or
q-LoRA; scale (qk_nope + qk_rope)^-0.5, no yarn).

* Layer types: ``layer_types`` if given; else ``linear_attn_config``'s ``full_attn_layers`` and
  ``kda_layers`` (both needed), which are **1-indexed**; else every layer i with i > 0 and
  i % 4 == 0 full (KimiLinearConfig.__post_init__). ``linear_attn_config``'s ``head_dim`` /
  ``num_heads`` / ``short_conv_kernel_size`` override ``linear_head_dim`` / ``linear_num_heads`` /
  ``linear_conv_kernel_dim``.
* MLP types: ``mlp_layer_types`` (dense | sparse) if given, else the first
  ``first_k_dense_replace`` (1 by default) dense. Sparse: the sigmoid group-limited router with
  ``e_score_correction_bias`` (models.glm4_moe.sigmoid_moe) + ``n_shared_experts`` shared experts.
* Aliases (the config class's attribute_map): ``num_experts`` (num_local_experts),
  ``num_expert_group`` (n_group), ``moe_renormalize`` (norm_topk_prob), ``num_experts_per_token``
  (num_experts_per_tok), ``num_shared_experts`` (n_shared_experts), ``model_max_length``
  (max_position_embeddings) -- save_pretrained writes the aliases.
* Checkpoints (what save_pretrained writes, transformers' conversion mapping reversed): the ffn of
  every layer under ``block_sparse_moe.`` (the dense one too: ``gate_proj`` / ``up_proj`` /
  ``down_proj``), routed experts ``experts.E.w1`` (gate) / ``w3`` (up) / ``w2`` (down), the KDA's
  forget gate (``f_a_proj``, ``f_b_proj``, ``dt_bias``, ``A_log``) and its three convs
  (``q_conv1d``, ``k_conv1d``, ``v_conv1d``) directly under ``self_attn.``.
"""
from __future__ import annotations

from core.arch import ArchSpec, ConfigReader, common_spec
from core.blocks.residual import PreNorm
from core.blocks.linear_attention import KDA
from core.blocks.mla import MLA
from core.blocks.mlp import SwiGLU
from core.errors import ColiError

from .glm4_moe import sigmoid_moe

# KimiLinearConfig's defaults (transformers 5.24)
DEFAULTS = dict(vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
                num_hidden_layers=27, num_attention_heads=32, num_key_value_heads=32, n_shared_experts=1,
                routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=8,
                norm_topk_prob=True, hidden_act="silu", max_position_embeddings=1048576, rms_norm_eps=1e-5,
                tie_word_embeddings=False, attention_bias=False, num_experts=256, linear_head_dim=128,
                linear_num_heads=32, linear_conv_kernel_dim=4, first_k_dense_replace=1)
# attribute_map, reversed: our key -> the config.json spellings
ALIASES = {"num_experts": ("num_local_experts",), "n_group": ("num_expert_group",),
           "norm_topk_prob": ("moe_renormalize",), "num_experts_per_tok": ("num_experts_per_token",),
           "n_shared_experts": ("num_shared_experts",), "max_position_embeddings": ("model_max_length",)}
LAYER_TYPES = ("linear_attention", "full_attention")
FFN_PREFIX = "block_sparse_moe."
EXPERT_PARTS = ("w1", "w3", "w2")       # gate, up, down (the conversion mapping: gate_up = [w1 | w3])


def _linear_config(r: ConfigReader) -> dict:
    lin = r.config.get("linear_attn_config")
    if lin is None:
        return {}
    if not isinstance(lin, dict):
        raise ColiError(f"kimi_linear config: linear_attn_config must be a JSON object, got {lin!r}")
    return lin


def layer_types(r: ConfigReader, layers: int) -> list[str]:
    given = r.get("layer_types")
    lin = _linear_config(r)
    if given is None and "full_attn_layers" in lin and "kda_layers" in lin:
        types: list = [None] * layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            idx = lin[key]
            if not isinstance(idx, list) or not all(isinstance(j, int) and not isinstance(j, bool)
                                                    and 1 <= j <= layers for j in idx):
                raise ColiError(f"kimi_linear config: linear_attn_config.{key} must list layers 1..{layers} "
                                f"(1-indexed), got {idx!r}")
            for j in idx:
                types[j - 1] = kind
        given = types
    elif given is None:
        return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    if not isinstance(given, list) or len(given) != layers or not all(t in LAYER_TYPES for t in given):
        raise ColiError(f"kimi_linear config: layer_types must give 'linear_attention' or 'full_attention' "
                        f"for each of the {layers} layers, got {given!r}")
    return list(given)


def mlp_types(r: ConfigReader, layers: int) -> list[str]:
    given = r.get("mlp_layer_types")
    if given is None:
        k = r.int("first_k_dense_replace")
        return ["dense" if i < k else "sparse" for i in range(layers)]
    if not isinstance(given, list) or len(given) != layers or not all(t in ("dense", "sparse") for t in given):
        raise ColiError(f"kimi_linear config: mlp_layer_types must give 'dense' or 'sparse' for each of the "
                        f"{layers} layers, got {given!r}")
    return list(given)


class KimiLinear:
    model_type = "kimi_linear"

    @staticmethod
    def spec(config: dict, generation_config: dict | None = None) -> ArchSpec:
        r = ConfigReader("kimi_linear", config, DEFAULTS, ALIASES)
        spec = common_spec(r, generation_config)
        r.refuse(spec.num_kv_heads != spec.num_heads, "num_key_value_heads different from num_attention_heads")
        H, L = spec.hidden_size, spec.num_layers
        nope, rope, v = r.positive_int("qk_nope_head_dim"), r.int("qk_rope_head_dim"), r.positive_int("v_head_dim")
        q_rank = r.positive_int("q_lora_rank", optional=True) or 0
        mla = MLA(hidden=H, heads=spec.num_heads, q_lora_rank=q_rank, kv_lora_rank=r.positive_int("kv_lora_rank"),
                  qk_nope=nope, qk_rope=rope, v_head_dim=v, scale=(nope + rope) ** -0.5,
                  bias=spec.attention_bias, rope=False)
        # NoPE: no RoPE table is read; the engine still builds one (2 dims, never used)
        spec.head_dim, spec.rope_dim = nope + rope, 2
        lin = _linear_config(r)

        def lin_int(key: str, top: str) -> int:
            value = lin.get(key, r.get(top))
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ColiError(f"kimi_linear config: {top} (linear_attn_config.{key}) must be a positive "
                                f"integer, got {value!r}")
            return value
        kda = KDA(H, lin_int("num_heads", "linear_num_heads"), lin_int("head_dim", "linear_head_dim"),
                  lin_int("short_conv_kernel_size", "linear_conv_kernel_dim"))
        types, mlps = layer_types(r, L), mlp_types(r, L)
        spec.mlp_kinds = ["moe" if t == "sparse" else "dense" for t in mlps]
        spec.dense_intermediate = r.positive_int("intermediate_size")
        moe = None
        if "moe" in spec.mlp_kinds:
            r.refuse(spec.num_experts == 0, "num_experts = 0 with sparse layers")
            r.refuse(r.int("n_shared_experts") == 0, "n_shared_experts = 0 (an empty shared MLP)")
            base = sigmoid_moe(r, spec)
            from dataclasses import replace
            moe = replace(base, expert_parts=EXPERT_PARTS)
        dense = SwiGLU(H, spec.dense_intermediate)
        spec.layers = [PreNorm(mla if t == "full_attention" else kda, moe if k == "moe" else dense, ffn_prefix=FFN_PREFIX)
                       for t, k in zip(types, spec.mlp_kinds)]
        spec.cache_kinds = [layer.cache_kind() for layer in spec.layers]
        spec.expert_parts = EXPERT_PARTS
        return spec
