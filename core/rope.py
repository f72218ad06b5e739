"""Rotary position embeddings, computed the way transformers does (float32, rotate_half); applied by
``core.kernels.rope``."""
from __future__ import annotations

import math

import numpy as np

from .arch import is_positive_number
from .errors import ColiError

DEFAULT_THETA = 10_000.0
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: dict) -> dict:
    """The standardised ``rope_parameters`` dict (transformers 5), also from older configs that
    keep ``rope_theta`` / ``rope_scaling`` at the top level."""
    raw = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(raw, dict):
        raise ColiError(f"rope_parameters must be a JSON object, got {raw!r}")
    params = dict(raw)
    if any(isinstance(v, dict) for v in params.values()):
        raise ColiError("per-layer-type rope_parameters are not supported for this model type")
    params.setdefault("rope_type", params.get("type", "default"))
    if not isinstance(params["rope_type"], str):
        raise ColiError(f"rope_parameters: rope_type must be a string, got {params['rope_type']!r}")
    if params.get("rope_theta") is None:        # absent or null: the top level's, else the default
        top = config.get("rope_theta")
        params["rope_theta"] = DEFAULT_THETA if top is None else top
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings",
                          config.get("original_max_position_embeddings", config.get("max_position_embeddings")))
    if "partial_rotary_factor" in config:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    return params


# the rope_parameters fields that must be finite numbers > 0 where present (0, negative, NaN or
# inf give NaN or meaningless angles); which of them a rope type needs is checked where it is read
POSITIVE_FIELDS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                   "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow")


def check_numbers(p: dict) -> None:
    for key in POSITIVE_FIELDS:
        if p.get(key) is not None and not is_positive_number(p[key]):
            raise ColiError(f"rope_parameters: {key} must be a finite number > 0, got {p[key]!r}")
    for key in ("mscale", "mscale_all_dim"):
        v = p.get(key)
        if v is not None and not (is_positive_number(v) or v == 0):
            raise ColiError(f"rope_parameters: {key} must be a finite number >= 0, got {v!r}")


class Rope:
    """The cos / sin table of ``head_dim`` dims. ``partial``: the family rotates only the first
    partial_rotary_factor x head_dim dims of each head and passes that many as ``head_dim`` (the
    frequencies follow transformers: computed over the rotated dims)."""

    def __init__(self, config: dict, head_dim: int, partial: bool = False):
        p = rope_parameters(config)
        kind = p["rope_type"]
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ColiError(f"rope type '{kind}' is not supported (supported: "
                            f"{', '.join(SUPPORTED_ROPE_TYPES)})")
        check_numbers(p)
        if not partial and float(p.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ColiError("partial_rotary_factor != 1 is not supported for this model type")
        dim = head_dim
        exps = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        inv_freq = (np.float32(1.0) / (np.float32(p["rope_theta"]) ** exps)).astype(np.float32)
        self.attention_scaling = np.float32(1.0)
        try:
            if kind == "linear":
                inv_freq = (inv_freq / np.float32(p["factor"])).astype(np.float32)
            elif kind == "llama3":
                inv_freq = _llama3(inv_freq, p)
            elif kind == "yarn":
                inv_freq, scaling = _yarn(p, dim, config)
                self.attention_scaling = np.float32(scaling)
        except (KeyError, TypeError) as e:
            raise ColiError(f"rope_parameters for '{kind}' lack a field: {e}") from None
        self.inv_freq = inv_freq
        self.head_dim = head_dim

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        return np.cos(emb) * self.attention_scaling, np.sin(emb) * self.attention_scaling


def _llama3(inv_freq: np.ndarray, p: dict) -> np.ndarray:
    """transformers' _compute_llama3_parameters, in float32."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    low_wl, high_wl = old / low, old / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wl, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
    smooth = ((old / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(p: dict, dim: int, config: dict) -> tuple[np.ndarray, float]:
    """transformers' _compute_yarn_parameters, in float32."""
    base = p["rope_theta"]
    original = p["original_max_position_embeddings"]
    factor = p.get("factor")
    if factor is None:
        factor = config["max_position_embeddings"] / original

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = (get_mscale(factor, ms) / get_mscale(factor, ms_all)) if ms and ms_all else get_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr(rot):
        return (dim * math.log(original / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = corr(beta_fast), corr(beta_slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    pos = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrap, interp = np.float32(1.0) / pos, np.float32(1.0) / (np.float32(factor) * pos)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(lo)) / np.float32(hi - lo), 0, 1)
    keep = np.float32(1.0) - ramp
    return (interp * (1 - keep) + extrap * keep).astype(np.float32), float(attention)
