"""What a family tells the engine about its architecture: read from config.json once, validated."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ColiError


# KV cache precisions the engine keeps (float16 is opt-in: outputs change slightly). Here, not in
# core.engine, so the command line and the app settings can name them without importing numpy.
KV_CACHES = ("float32", "float16")


@dataclass
class ArchSpec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qk_norm: str                         # 'none' | 'per_head' (over head_dim) | 'full' (over all heads)
    mlp_kinds: list[str]                 # per layer: 'moe' | 'dense'
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    clip_qkv: float | None = None
    sliding_windows: list[int | None] = field(default_factory=list)   # per layer; None = full causal
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 0


class ConfigReader:
    """Reads config.json the way a transformers config class does: absent fields take that
    class's defaults; fields that would change the forward pass and that we do not implement are
    refused with a clear message instead of being ignored."""

    def __init__(self, model_type: str, config: dict, defaults: dict, aliases: dict | None = None):
        self.model_type, self.config, self.defaults = model_type, config, defaults
        self.aliases = aliases or {}      # the config class's attribute_map, reversed

    def get(self, key: str):
        present = [k for k in (key, *self.aliases.get(key, ())) if k in self.config]
        value = self.config[present[0]] if present else self.defaults.get(key)
        return self.defaults.get(key) if value is None and key in self.defaults else value

    def int(self, key: str) -> int:
        value = self.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ColiError(f"{self.model_type} config: {key} must be a non-negative integer, got {value!r}")
        return value

    def refuse(self, condition: bool, what: str) -> None:
        if condition:
            raise ColiError(f"{self.model_type} config: {what} is not supported")


def eos_ids(config: dict, generation_config: dict | None) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (generation_config or {}, config):
        v = src.get("eos_token_id")
        for t in (v if isinstance(v, list) else [v]):
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return tuple(ids)


def common_spec(r: ConfigReader, generation_config: dict | None, **kw) -> ArchSpec:
    """The fields every supported family reads identically."""
    r.refuse(r.get("hidden_act") not in ("silu", "swish"), f"hidden_act {r.get('hidden_act')!r}")
    heads, hidden = r.int("num_attention_heads"), r.int("hidden_size")
    if heads == 0 or hidden == 0:
        raise ColiError(f"{r.model_type} config: hidden_size and num_attention_heads must be > 0")
    kv = r.get("num_key_value_heads") or heads
    if heads % kv:
        raise ColiError(f"{r.model_type} config: num_attention_heads ({heads}) is not a multiple of "
                        f"num_key_value_heads ({kv})")
    head_dim = r.get("head_dim") or hidden // heads
    top_k, experts = r.int("num_experts_per_tok"), r.int("num_experts")
    if experts and not 0 < top_k <= experts:
        raise ColiError(f"{r.model_type} config: num_experts_per_tok ({top_k}) must be in 1..{experts}")
    layers = r.int("num_hidden_layers")
    spec = dict(vocab_size=r.int("vocab_size"), hidden_size=hidden, num_layers=layers,
                num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                rms_norm_eps=float(r.get("rms_norm_eps")), num_experts=experts, top_k=top_k,
                norm_topk_prob=bool(r.get("norm_topk_prob")),
                tie_word_embeddings=bool(r.get("tie_word_embeddings")),
                eos_token_ids=eos_ids(r.config, generation_config),
                max_position_embeddings=int(r.get("max_position_embeddings") or 0),
                mlp_kinds=["moe"] * layers, sliding_windows=[None] * layers, qk_norm="none")
    spec.update(kw)
    return ArchSpec(**spec)
