"""model_type -> family. A family is one file in models/ that turns config.json into an ArchSpec."""
from __future__ import annotations

from core.errors import ColiError
from core.layout import check_layout
from core.rope import Rope

from .deepseek_v3 import DeepseekV3
from .deepseek_v4 import DeepseekV4
from .glm4_moe import Glm4Moe
from .glm_moe_dsa import GlmMoeDsa
from .kimi_linear import KimiLinear
from .olmoe import Olmoe
from .qwen3_moe import Qwen3Moe
from .qwen3_5_moe import Qwen3_5Moe

FAMILIES = {f.model_type: f for f in (Olmoe, Qwen3Moe, Glm4Moe, DeepseekV3, GlmMoeDsa, Qwen3_5Moe, KimiLinear,
                                      DeepseekV4)}
# Kimi-K2's config.json says "kimi_k2": its remote-code config class is DeepseekV3Config under
# another name, and its architectures DeepseekV3ForCausalLM (transformers 5.24 has no kimi_k2)
FAMILIES["kimi_k2"] = DeepseekV3
# Qwen3.5 / 3.6: the composite image-text type and its text-only form, one family
FAMILIES["qwen3_5_moe_text"] = Qwen3_5Moe

# Types people will try that are not a family yet, and why (one line instead of "unsupported").
NOT_YET = {
    # Kimi K3 is its own type, not kimi_linear: llama.cpp's converter (conversion/kimi_k3.py)
    # lists what it adds; transformers 5.24 has no implementation to check ours against.
    "kimi_k3": "Kimi K3 (model_type kimi_k3) is not kimi_linear: it adds cross-layer attention "
               "residuals, a latent MoE, the situ activation, an MLA output gate, a full-rank KDA "
               "gate and MXFP4 experts, and transformers 5.24 has no implementation to check them "
               "against; Kimi-Linear-48B-A3B (kimi_linear) runs",
}


def supported_types() -> list[str]:
    return sorted(FAMILIES)


def family_for(config: dict):
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in NOT_YET:
        raise ColiError(f"unsupported model_type {model_type!r}: {NOT_YET[model_type]}")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ColiError(f"unsupported model_type {model_type!r} (supported: {', '.join(supported_types())})")
    return FAMILIES[model_type]


def validate_config(config: dict, shapes: dict | None = None, where: str = "the source checkpoint"):
    """Refuse, before any work, a config we could not run (used by the converter); with
    ``shapes`` (tensor name -> logical shape), also weights that disagree with the config.
    Returns the ArchSpec (the converter reads the tensors the family drops from it)."""
    spec = family_for(config).spec(config)
    if shapes is not None:
        check_layout(spec, shapes, where)
    if "main" not in spec.rope_tables:         # a family that builds its tables checked them
        Rope(spec.text_config or config, spec.rope_dim or spec.head_dim, partial=spec.rope_partial)
    return spec
