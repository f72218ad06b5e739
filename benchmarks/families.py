"""Real per-layer geometries of the newer families, a few layers deep, for the decode and
streaming benchmarks (issues 17, 18, 26): random-weight containers (core.synthetic) with
GLM-4.5-Air's, GLM-5's, Qwen3.6-35B-A3B's and DeepSeek-V4-Flash's layer sizes, made once under
/work/bench_models/ and kept.

    python benchmarks/families.py [glm45air|glm5|qwen36|dsv4flash ...]   # make (or verify) them

``benchmarks/decode.py --geometry NAME`` and ``benchmarks/streaming.py --geometry NAME`` use them.
Every layer has the real model's sizes; only the depth is cut (GLM-4.5-Air: 4 of 46 layers, the
first dense as in the model; GLM-5: 2 of 78, one dense + one MoE, one "full" DSA indexer layer +
one "shared"; DeepSeek-V4-Flash: the release's first 4 of 43 layers), so per-token bytes are
dominated more by the lm_head than in the full model.
No eos_token_id: random weights never stop a decode early. MTP layers are left out (decode does
not use them).
"""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BENCH_MODELS = Path("/work/bench_models")

# zai-org/GLM-4.5-Air config.json (the fields models/catalog.toml lists for it; transformers'
# Glm4MoeConfig defaults for the rest), 4 layers: 1 dense (first_k_dense_replace) + 3 MoE
GLM45_AIR = {
    "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"],
    "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 96,
    "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5,
    "attention_bias": True, "use_qk_norm": False, "n_routed_experts": 128, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "norm_topk_prob": True, "num_nextn_predict_layers": 0,
    "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "tie_word_embeddings": False,
}

# transformers' GlmMoeDsaConfig defaults = zai-org/GLM-5 (models/catalog.toml), 2 layers:
# a dense layer with the "full" indexer, then an MoE layer sharing its selection
GLM5 = {
    "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"],
    "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
    "moe_intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 64,
    "num_key_value_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
    "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "rope_interleave": True,
    "index_head_dim": 128, "index_n_heads": 32, "index_topk": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "num_nextn_predict_layers": 0,
    "mlp_layer_types": ["dense", "sparse"], "indexer_types": ["full", "shared"],
    "hidden_act": "silu", "max_position_embeddings": 202752, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
}

# transformers' Qwen3_5MoeTextConfig defaults = Qwen/Qwen3.6-35B-A3B's text model (the model card's
# layout; models/catalog.toml), 4 of its 40 layers: 3 Gated DeltaNet + 1 gated attention, as the
# model's 10 x (3 + 1) pattern; the text-only form (no vision tower, no MTP)
QWEN36 = {
    "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts": 256, "num_experts_per_tok": 8,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "hidden_act": "silu", "max_position_embeddings": 262144, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
}

# deepseek-ai/DeepSeek-V4-Flash config.json, the release's first 4 of its 43 layers: compress_ratios
# [0, 0, 4, 128] (2 sliding-window layers, 1 CSA with its Lightning indexer, 1 HCA) and its 3
# hash-routed layers, routed experts in FP4 as shipped (EXPERT_SCHEMES); the rest int4 / int8 as
# `coli convert --bits 4` (the release's FP8 dense widened to F32 at its default --bits 16 would
# be 4 B a parameter). Every layer type and both routings, but not the model's proportions:
# the full model has 2 sliding, 21 CSA, 20 HCA layers and 3 of 43 hash-routed (whose experts the
# engine prefetches with certainty), so streaming's prefetch gains here are an upper bound.
DSV4_FLASH = {
    "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 4, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8,
    "qk_rope_head_dim": 64, "n_routed_experts": 256, "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048, "n_shared_experts": 1, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "sliding_window": 128, "num_hash_layers": 3, "compress_ratios": [0, 0, 4, 128],
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "swiglu_limit": 10.0, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-06, "rms_norm_eps": 1e-06, "hidden_act": "silu",
    "max_position_embeddings": 1048576, "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
}

# tiny versions with the same structure, for tests (seconds)
TINY = {
    "glm45air": {**GLM45_AIR, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
                 "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2},
    "glm5": {**GLM5, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
             "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
             "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
             "v_head_dim": 8, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8,
             "n_routed_experts": 8, "num_experts_per_tok": 2},
    "qwen36": {**QWEN36, "vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "linear_key_head_dim": 16,
               "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
               "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 8,
               "num_experts_per_tok": 2},
    "dsv4flash": {**DSV4_FLASH, "vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4,
                  "head_dim": 32, "q_lora_rank": 32, "o_lora_rank": 16, "o_groups": 2, "qk_rope_head_dim": 8,
                  "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "index_n_heads": 2, "index_head_dim": 16, "index_topk": 3, "sliding_window": 8,
                  "compress_ratios": [0, 0, 4, 8]},
}

GEOMETRIES = {"glm45air": GLM45_AIR, "glm5": GLM5, "qwen36": QWEN36, "dsv4flash": DSV4_FLASH}
LABELS = {"glm45air": "GLM-4.5-Air (4 of 46 layers: 1 dense + 3 MoE)",
          "glm5": "GLM-5 (2 of 78 layers: dense + MoE; DSA full + shared)",
          "qwen36": "Qwen3.6-35B-A3B (4 of 40 layers: 3 Gated DeltaNet + 1 gated attention, all MoE)",
          "dsv4flash": "DeepSeek-V4-Flash (4 of 43 layers: 2 sliding + CSA + HCA, 3 hash-routed; FP4 experts)"}
# the routed experts' scheme where it is not --bits 4's int4 (core.synthetic's fp4_experts)
FP4_EXPERTS = {"dsv4flash"}


def geometry(name: str, tiny: bool = False) -> dict:
    table = TINY if tiny else GEOMETRIES
    if name not in table:
        raise SystemExit(f"unknown geometry {name!r}: one of {', '.join(GEOMETRIES)}")
    return dict(table[name])


def default_dir(name: str) -> Path:
    return BENCH_MODELS / f"{name}-geom-{GEOMETRIES[name]['num_hidden_layers']}L"


def ensure(directory: Path, config: dict, seed: int = 0, label: str = "",
           fp4_experts: bool = False) -> tuple[Path, bool, float | None]:
    """(path, made_now, generation GB/s): a random container of ``config`` at ``directory``,
    made now or reused (write_random_container verifies an existing one's parameters)."""
    from core.synthetic import container_bytes, write_random_container
    from models import family_for

    if (directory / "colibri.json").exists():
        write_random_container(directory, config, family_for(config), seed=seed, fp4_experts=fp4_experts)
        return directory, False, None
    need = container_bytes(config, family_for(config), fp4_experts=fp4_experts)["total"]
    directory.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory.parent).free
    if need > free - (2 << 30):
        raise SystemExit(f"{directory}: needs {need / 1e9:.2f} GB, {free / 1e9:.1f} GB free")
    print(f"generating a random {label or config['model_type']} container: {need / 1e9:.2f} GB into "
          f"{directory} ({free / 1e9:.1f} GB free)", file=sys.stderr, flush=True)
    last = [0.0]

    def progress(p) -> None:
        if not p.tensor and time.perf_counter() - last[0] > 5:
            last[0] = time.perf_counter()
            print(f"  {p.done_bytes / 1e9:5.2f} / {p.total_bytes / 1e9:.2f} GB  {p.shard}",
                  file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    write_random_container(directory, config, family_for(config), seed=seed, progress=progress,
                           fp4_experts=fp4_experts)
    dt = time.perf_counter() - t0
    print(f"  done in {dt:.1f} s ({need / dt / 1e9:.2f} GB/s including fsync)", file=sys.stderr, flush=True)
    return directory, True, need / dt / 1e9


def main(argv=None) -> int:
    from core.synthetic import container_bytes
    from models import family_for

    for name in (argv if argv is not None else sys.argv[1:]) or list(GEOMETRIES):
        cfg = geometry(name)
        b = container_bytes(cfg, family_for(cfg), fp4_experts=name in FP4_EXPERTS)
        print(f"{name}: {LABELS[name]}: {b['total'] / 1e9:.2f} GB ({b['experts'] / 1e9:.2f} GB experts) "
              f"at {default_dir(name)}", flush=True)
        ensure(default_dir(name), cfg, label=LABELS[name], fp4_experts=name in FP4_EXPERTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
