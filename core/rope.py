"""Rotary position embeddings, computed the way transformers does (float32, rotate_half)."""
from __future__ import annotations

import numpy as np

from .errors import ColiError

DEFAULT_THETA = 10_000.0
SUPPORTED_ROPE_TYPES = ("default", "linear")


def rope_parameters(config: dict) -> dict:
    """The standardised ``rope_parameters`` dict (transformers 5), also from older configs that
    keep ``rope_theta`` / ``rope_scaling`` at the top level."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ColiError("per-layer-type rope_parameters are not supported for this model type")
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta", DEFAULT_THETA))
    if "partial_rotary_factor" in config:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    return params


class Rope:
    def __init__(self, config: dict, head_dim: int):
        p = rope_parameters(config)
        kind = p["rope_type"]
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ColiError(f"rope type '{kind}' is not supported (supported: "
                            f"{', '.join(SUPPORTED_ROPE_TYPES)})")
        if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ColiError("partial_rotary_factor != 1 is not supported for this model type")
        dim = head_dim
        exps = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        inv_freq = (np.float32(1.0) / (np.float32(p["rope_theta"]) ** exps)).astype(np.float32)
        if kind == "linear":
            inv_freq = (inv_freq / np.float32(p["factor"])).astype(np.float32)
        self.inv_freq = inv_freq
        self.attention_scaling = np.float32(1.0)
        self.head_dim = head_dim

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        return np.cos(emb) * self.attention_scaling, np.sin(emb) * self.attention_scaling

    @staticmethod
    def apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x [T, heads, D]; cos/sin [T, D]."""
        half = x.shape[-1] // 2
        rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos[:, None, :] + rot * sin[:, None, :]
