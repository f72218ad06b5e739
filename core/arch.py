"""What a family tells the engine about its architecture: read from config.json once, validated."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .cache_kinds import KV
from .errors import ColiError
from .layout import Layout


# KV cache precisions the engine keeps (float16 is opt-in: outputs change slightly). Here, not in
# core.engine, so the command line and the app settings can name them without importing numpy.
KV_CACHES = ("float32", "float16")
MAX_LAYERS = 100_000      # far past any model; a corrupt count must not size per-layer lists
MAX_WIDTH = 1 << 20       # hidden_size, head_dim, heads: likewise
MAX_EXPERTS = 1 << 16     # per layer (the largest real models route over 384): the layout lists each


@dataclass
class ArchSpec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    mlp_kinds: list[str]                 # per layer: 'moe' | 'dense'
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    cache_kinds: list = field(default_factory=list)     # per layer: what it keeps (core.cache_kinds)
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 0
    # per layer, the blocks it is composed of (a residual kind of core.blocks.residual): the
    # family's declaration, from which the engine loads it and the layout check, synthetic
    # checkpoints and estimates take its tensors
    layers: list = field(default_factory=list)
    attention_bias: bool = False        # the config's: q/k/v/o biases (optional in checks)
    rope_dim: int = 0                   # dims the RoPE table covers; 0 = head_dim
    rope_partial: bool = False          # the table covers partial_rotary_factor x head_dim
    dense_intermediate: int | None = None    # the default composition's MLP sizes (None: the
    expert_intermediate: int | None = None   #   tensors say, consistently)
    norm_offset: float = 0.0            # the final norm multiplies by weight + this ((1+w) RMSNorm: 1)
    # config.json's language-model part when it nests one (a composite model's text_config: RoPE
    # and the sizes are read there); None: config.json itself
    text_config: dict | None = None
    # where its tensors sit in the checkpoint, what the converter sets aside, each tensor's class
    # (core.layout.Layout: the family's declaration, read by the converter, container, planner,
    # synthetic checkpoints and the catalog)
    layout: Layout = field(default_factory=Layout)
    # rotary tables by name, each with cos_sin(positions) (core.rope.Rope); blocks ask a pass for
    # one by name (core.step.Step.rope). "main", unless given here, is built from the fields above
    rope_tables: dict = field(default_factory=dict)
    # the ends (core.blocks.embed's Embedding / LMHead, or a family's own); None: from the fields above
    embedding: object = None
    head: object = None
    # the family's chat template (Jinja) for a release that ships none (DeepSeek V4 ships a Python
    # encoder, which colibrì never runs): the converter writes it beside the tokenizer
    chat_template: str | None = None

    @property
    def prefix(self) -> str:
        """The language model's tensors: {prefix}embed_tokens.weight, {prefix}layers.N. ..."""
        return self.layout.prefix

    def __post_init__(self):
        if not self.cache_kinds:            # the layers' (a spec built by hand: full attention)
            self.cache_kinds = ([l.cache_kind() for l in self.layers] if self.layers else
                                [KV(self.num_kv_heads, self.head_dim)] * self.num_layers)


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

    def positive_int(self, key: str, optional: bool = False) -> int | None:
        """An integer > 0 (None allowed, and returned, when ``optional`` and the value is absent)."""
        value = self.get(key)
        if optional and value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ColiError(f"{self.model_type} config: {key} must be a positive integer, got {value!r}")
        return value

    def number(self, key: str, optional: bool = False) -> float | None:
        """A finite number > 0: epsilons, scales, clip values (0, negative, NaN or inf make the
        forward pass meaningless)."""
        value = self.get(key)
        if optional and value is None:
            return None
        if not is_positive_number(value):
            raise ColiError(f"{self.model_type} config: {key} must be a finite number > 0, got {value!r}")
        return float(value)

    def flag(self, key: str) -> bool:
        """A JSON boolean; the string "False" is not one (Python would read it as true)."""
        value = self.get(key)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise ColiError(f"{self.model_type} config: {key} must be true or false, got {value!r}")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ColiError(f"{self.model_type} config: {key} must be a list of integers, got {value!r}")
        return value

    def refuse(self, condition: bool, what: str) -> None:
        if condition:
            raise ColiError(f"{self.model_type} config: {what} is not supported")


def language_config(config: dict) -> dict:
    """The part of config.json that describes the language model: a composite (image-text)
    model's ``text_config`` (transformers' get_text_config), else config.json itself."""
    nested = config.get("text_config") if isinstance(config, dict) else None
    return nested if isinstance(nested, dict) else config


def is_positive_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


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
    kv = r.positive_int("num_key_value_heads", optional=True) or heads
    if heads % kv:
        raise ColiError(f"{r.model_type} config: num_attention_heads ({heads}) is not a multiple of "
                        f"num_key_value_heads ({kv})")
    head_dim = r.positive_int("head_dim", optional=True) or hidden // heads
    for name, value, most in (("hidden_size", hidden, MAX_WIDTH), ("head_dim", head_dim, MAX_WIDTH),
                              ("num_attention_heads", heads, MAX_WIDTH)):
        if value > most:     # sizes tables (RoPE, norms) before any weight is read: refuse first
            raise ColiError(f"{r.model_type} config: {name} ({value}) is implausibly large")
    top_k, experts = r.int("num_experts_per_tok"), r.int("num_experts")
    if experts > MAX_EXPERTS:
        raise ColiError(f"{r.model_type} config: num_experts ({experts}) is implausibly large")
    if experts and not 0 < top_k <= experts:
        raise ColiError(f"{r.model_type} config: num_experts_per_tok ({top_k}) must be in 1..{experts}")
    layers = r.int("num_hidden_layers")
    if layers > MAX_LAYERS:     # per-layer lists are built from it: refuse before allocating
        raise ColiError(f"{r.model_type} config: num_hidden_layers ({layers}) is implausibly large")
    spec = dict(vocab_size=r.int("vocab_size"), hidden_size=hidden, num_layers=layers,
                num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                rms_norm_eps=r.number("rms_norm_eps"), num_experts=experts, top_k=top_k,
                norm_topk_prob=r.flag("norm_topk_prob"),
                tie_word_embeddings=r.flag("tie_word_embeddings"),
                attention_bias=r.flag("attention_bias"),
                eos_token_ids=eos_ids(r.config, generation_config),
                max_position_embeddings=r.positive_int("max_position_embeddings", optional=True) or 0,
                mlp_kinds=["moe"] * layers)
    spec.update(kw)
    return ArchSpec(**spec)
