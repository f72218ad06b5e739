"""GLM-5 / 5.1 / 5.2 / 5.3 (transformers' ``GlmMoeDsaForCausalLM``): DeepSeek-V3's latent attention
(q-LoRA) plus DSA, a token indexer choosing the ``index_topk`` positions each query attends
(core.blocks.mla.Indexer): "full" layers run it and cache its keys, "shared" ones reuse the layer
before's choice (``indexer_types``, or ``index_topk_pattern`` "FSS...", or ``index_topk_freq`` /
``index_skip_topk_offset``); dense layers by ``mlp_layer_types`` (first 3 by default), then the
sigmoid group-limited MoE with shared experts. MTP (layer 78 of the real model) is written aside
by the converter."""
from __future__ import annotations

from core.arch import ArchSpec, ConfigReader
from core.blocks.residual import PreNorm
from core.blocks.mla import MLA, Indexer
from core.blocks.mlp import SwiGLU
from core.errors import ColiError

from .deepseek_v3 import mla_spec
from .glm4_moe import sigmoid_moe

# GlmMoeDsaConfig's defaults (transformers 5.24)
DEFAULTS = dict(vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
                num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
                num_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048,
                qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1,
                num_experts_per_tok=8, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=202752,
                rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, index_topk=2048,
                index_head_dim=128, index_n_heads=32, first_k_dense_replace=3)
ALIASES = {"num_experts": ("n_routed_experts", "num_local_experts")}


def indexer_types(r: ConfigReader, layers: int) -> list[str]:
    """Per layer "full" | "shared", as GlmMoeDsaConfig.__post_init__ derives it."""
    given = r.get("indexer_types")
    if given is None:
        pattern = r.get("index_topk_pattern")
        if isinstance(pattern, str):
            if set(pattern) - {"F", "S"}:
                raise ColiError(f"glm_moe_dsa config: index_topk_pattern must be made of F and S, got {pattern!r}")
            given = [{"F": "full", "S": "shared"}[ch] for ch in pattern]
        elif pattern is not None:
            given = pattern
        else:
            freq, offset = r.get("index_topk_freq"), r.get("index_skip_topk_offset")
            freq, offset = (1 if freq is None else freq), (2 if offset is None else offset)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (freq, offset)):
                raise ColiError("glm_moe_dsa config: index_topk_freq and index_skip_topk_offset must be integers")
            freq = max(freq, 1)
            given = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(layers)]
    if not isinstance(given, list) or len(given) != layers or set(given) - {"full", "shared"}:
        raise ColiError(f"glm_moe_dsa config: indexer_types must list 'full' or 'shared' for each of the "
                        f"{layers} layers, got {given!r}")
    if given and given[0] != "full":
        raise ColiError("glm_moe_dsa config: layer 0 must run the indexer ('full'): a shared layer reuses "
                        "the previous layer's selection")
    return given


def mlp_layer_types(r: ConfigReader, layers: int) -> list[str]:
    given = r.get("mlp_layer_types")
    if given is None:
        k = min(r.int("first_k_dense_replace"), layers)
        return ["dense"] * k + ["moe"] * (layers - k)
    if not isinstance(given, list) or len(given) != layers or set(given) - {"dense", "sparse"}:
        raise ColiError(f"glm_moe_dsa config: mlp_layer_types must list 'dense' or 'sparse' for each of the "
                        f"{layers} layers, got {given!r}")
    return ["moe" if t == "sparse" else "dense" for t in given]


class GlmMoeDsa:
    model_type = "glm_moe_dsa"

    @staticmethod
    def spec(config: dict, generation_config: dict | None = None) -> ArchSpec:
        r = ConfigReader("glm_moe_dsa", config, DEFAULTS, ALIASES)
        spec, sizes = mla_spec(r, generation_config, reads_interleave=False)
        r.refuse(not sizes["q_lora_rank"], "q_lora_rank = null (the indexer reads the q-LoRA residual)")
        types = r.get("layer_types")
        r.refuse(types is not None and (not isinstance(types, list) or set(types) - {"indexed_attention"}),
                 f"layer_types {types!r} (every layer is indexed_attention)")
        ix = Indexer(spec.hidden_size, sizes["q_lora_rank"], r.positive_int("index_n_heads"),
                     r.positive_int("index_head_dim"), sizes["qk_rope"], r.positive_int("index_topk"))
        r.refuse(ix.head_dim < ix.rope, "index_head_dim below qk_rope_head_dim")
        spec.mlp_kinds = mlp_layer_types(r, spec.num_layers)
        r.refuse("moe" in spec.mlp_kinds and spec.num_experts == 0, "sparse layers with no experts")
        moe = sigmoid_moe(r, spec) if spec.num_experts else None
        spec.layers = [PreNorm(MLA(**sizes, indexer=ix if t == "full" else None, shared_index=t == "shared"),
                             moe if kind == "moe" else SwiGLU(spec.hidden_size, spec.dense_intermediate))
                       for t, kind in zip(indexer_types(r, spec.num_layers), spec.mlp_kinds)]
        spec.cache_kinds = [layer.cache_kind() for layer in spec.layers]
        return spec
