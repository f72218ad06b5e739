"""DeepSeek V4 (``deepseek_v4``; V4 Flash / Pro), as transformers 5.25's
``models/deepseek_v4/``: mHC residual streams (core.blocks.mhc) around shared-KV MQA with sinks
(core.blocks.shared_kv); three attention kinds per layer -- a sliding window only, compressed
sparse attention (CSA: overlapping windows of ``ratio`` tokens compressed into one entry each, of
which a Lightning indexer picks the top ``index_topk`` per query) and heavily compressed
attention (HCA: one entry per ``ratio`` tokens, all visible); two rotary tables ("main" for
sliding layers, "compress" -- yarn -- for compressed layers and their compressors); routed
experts behind a sqrt-softplus score + bias router, or on the first ``num_hash_layers`` layers
chosen by token id (``tid2eid``), plus a shared expert, both with the clamped SwiGLU.

Here live the family-only pieces: the config reader, the compressors, the indexer, the hash
router and the composition. float32 numpy throughout (no compiled path yet)."""
from __future__ import annotations

import functools
import math
from pathlib import Path
from dataclasses import dataclass

import numpy as np

from core import kernels
from core.arch import ArchSpec, ConfigReader, common_spec
from core.blocks.common import Need, load_needs
from core.blocks.mhc import MHC, StreamEmbedding, StreamHead
from core.blocks.mlp import MoE, SwiGLU
from core.blocks.routers import ScoreRouter, _router_weight, chosen_weights, route_scores
from core.blocks.shared_kv import SharedKV, pair_tables, rope_pairs_tail
from core.errors import ColiError
from core.layout import ExpertPattern, Layout
from core.rope import Rope

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# DeepseekV4Config's defaults (transformers 5.25)
DEFAULTS = dict(vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
                num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024,
                num_experts_per_tok=6, num_experts=256, scoring_func="sqrtsoftplus",
                routed_scaling_factor=1.5, max_position_embeddings=1048576, rope_theta=10000.0,
                compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1.0e-6,
                swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64,
                index_head_dim=128, index_topk=512, hidden_act="silu", rms_norm_eps=1.0e-6,
                tie_word_embeddings=False, mlp_bias=False, norm_topk_prob=True)
ALIASES = {"num_experts": ("n_routed_experts", "num_local_experts")}
DEFAULT_RATES = {CSA: 4, HCA: 128}
DEFAULT_HASH_LAYERS = 3
SCORES = ("sqrtsoftplus", "sigmoid")     # transformers' ACT2FN has no "softmax": it cannot build one
W123 = ("w1", "w3", "w2")       # the experts' gate, up, down

# The Hub release's own tensor names -> the names transformers 5.25's save_pretrained writes (which
# the blocks read): save_pretrained reverses its conversion mapping (conversion_mapping.py,
# "deepseek_v4"), so a transformers-layout checkpoint also says attn / ffn / w1 / wq_a per expert,
# under ``model.`` and with four leftovers of the in-memory names. Anchored and exclusive: the
# first match or all in order give the same name (tests/test_oracle_dsv4.py checks them on the
# fixtures' two layouts); a ``.scale`` companion follows its weight. The MTP blocks (``mtp.*``)
# are set aside by the layout's default MTP rule.
RENAMES: tuple[tuple[str, str], ...] = (
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.(\d+)\.attn\.kv_norm\.", r"model.layers.\1.attn.norm."),
    (r"^layers\.", "model.layers."),
) + tuple(
    # transformers' in-memory names (a state dict saved as it is, as save_pretrained without its
    # reverse mapping writes it) -> the same saved names; the experts' fused gate_up_proj / down_proj
    # are then split into w1 / w3 / w2 by the layout's fused rule. Applied in order: the
    # compressors' prefixes first, then their parts.
    (rf"^(model\.layers\.\d+)\.{old}", rf"\1.{new}") for old, new in (
        (r"(attn|ffn)_hc\.(fn|base|scale)$", r"hc_\2_\3"),
        (r"input_layernorm\.", "attn_norm."), (r"post_attention_layernorm\.", "ffn_norm."),
        (r"mlp\.gate\.e_score_correction_bias$", "ffn.gate.bias"),
        (r"mlp\.shared_experts\.gate_proj\.", "ffn.shared_experts.w1."),
        (r"mlp\.shared_experts\.up_proj\.", "ffn.shared_experts.w3."),
        (r"mlp\.shared_experts\.down_proj\.", "ffn.shared_experts.w2."), (r"mlp\.", "ffn."),
        (r"self_attn\.compressor\.indexer\.scorer\.weights_proj\.", "attn.indexer.weights_proj."),
        (r"self_attn\.compressor\.indexer\.q_b_proj\.", "attn.indexer.wq_b."),
        (r"self_attn\.compressor\.indexer\.", "attn.indexer.compressor."),
        (r"self_attn\.compressor\.", "attn.compressor."),
        (r"(attn\.(?:indexer\.)?compressor)\.gate_proj\.", r"\2.wgate."),
        (r"(attn\.(?:indexer\.)?compressor)\.kv_proj\.", r"\2.wkv."),
        (r"(attn\.(?:indexer\.)?compressor)\.kv_norm\.", r"\2.norm."),
        (r"(attn\.(?:indexer\.)?compressor)\.position_bias$", r"\2.ape"),
        (r"self_attn\.q_a_proj\.", "attn.wq_a."), (r"self_attn\.q_b_proj\.", "attn.wq_b."),
        (r"self_attn\.kv_proj\.", "attn.wkv."), (r"self_attn\.o_a_proj\.", "attn.wo_a."),
        (r"self_attn\.o_b_proj\.", "attn.wo_b."), (r"self_attn\.q_a_norm\.", "attn.q_norm."),
        (r"self_attn\.kv_norm\.", "attn.norm."), (r"self_attn\.sinks$", "attn.attn_sink"))
) + ((r"^lm_head\.weight$", "head.weight"),)
LAYOUT = Layout(head="head.weight", experts=ExpertPattern(parts=W123), renames=RENAMES)


# --- config ---------------------------------------------------------------------------------------
def attention_kinds(r: ConfigReader, n: int) -> list[tuple[str, int]]:
    """(layer type, compression ratio) per layer, as DeepseekV4Config.__post_init__ reads them:
    ``layer_types`` with ``compress_rates`` (or the legacy ``compress_rate_csa`` / ``_hca``), else
    DeepSeek's own per-layer ``compress_ratios`` (0 sliding, 4 CSA, any other ratio HCA; entries
    past the layers are the MTP layers'), else V4-Pro's default (2 HCA, then CSA / HCA)."""
    c = r.config
    rates = dict(DEFAULT_RATES)
    if c.get("compress_rates") is not None:
        if not isinstance(c["compress_rates"], dict):
            raise ColiError(f"deepseek_v4 config: compress_rates must be an object, got {c['compress_rates']!r}")
        rates.update(c["compress_rates"])
    for kind, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        if c.get(legacy) is not None:
            rates[kind] = c[legacy]
    for kind in (CSA, HCA):
        v = rates[kind]
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ColiError(f"deepseek_v4 config: the compression rate of {kind} must be a positive integer, got {v!r}")
    types = c.get("layer_types")
    if types is None and c.get("compress_ratios") is not None:
        ratios = r.int_list("compress_ratios")
        r.refuse(len(ratios) < n, f"compress_ratios of {len(ratios)} entries for {n} layers")
        r.refuse(any(v < 0 for v in ratios), "a negative entry of compress_ratios")
        return [(SLIDING, 0) if v == 0 else (CSA if v == 4 else HCA, v) for v in ratios[:n]]
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    if not isinstance(types, list) or len(types) < n or any(t not in (SLIDING, CSA, HCA) for t in types[:n]):
        raise ColiError(f"deepseek_v4 config: layer_types must list {n} of {SLIDING}, {CSA}, {HCA}; got {types!r}")
    return [(t, 0 if t == SLIDING else rates[t]) for t in types[:n]]


def mlp_kinds(r: ConfigReader, n: int) -> list[str]:
    """'hash_moe' | 'moe' per layer: ``mlp_layer_types``, else the first ``num_hash_layers``
    (default 3) hash-routed."""
    kinds = r.config.get("mlp_layer_types")
    if kinds is None:
        n_hash = r.config.get("num_hash_layers")
        n_hash = DEFAULT_HASH_LAYERS if n_hash is None else n_hash
        if not isinstance(n_hash, int) or isinstance(n_hash, bool) or n_hash < 0:
            raise ColiError(f"deepseek_v4 config: num_hash_layers must be a non-negative integer, got {n_hash!r}")
        kinds = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    if not isinstance(kinds, list) or len(kinds) < n or any(k not in ("hash_moe", "moe") for k in kinds[:n]):
        raise ColiError(f"deepseek_v4 config: mlp_layer_types must list {n} of hash_moe, moe; got {kinds!r}")
    return list(kinds[:n])


def rope_tables(r: ConfigReader, rope_dim: int, head_dim: int) -> dict[str, Rope]:
    """The "main" and "compress" rotary tables over the rope dims: nested as transformers saves them, or built
    from ``rope_theta`` (main, plain) and ``compress_rope_theta`` with the flat ``rope_parameters``
    / ``rope_scaling`` (compress; yarn there multiplies cos / sin by nothing: attention_factor 1)."""
    c = r.config
    flat = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(flat, dict):
        raise ColiError(f"deepseek_v4 config: rope_parameters must be an object, got {flat!r}")
    if isinstance(flat.get("main"), dict) and isinstance(flat.get("compress"), dict):
        tables = {"main": dict(flat["main"]), "compress": dict(flat["compress"])}
    else:
        yarn = {k: v for k, v in flat.items() if k not in ("main", "compress")}
        yarn.setdefault("rope_type", yarn.get("type", "default"))
        compress = {**yarn, "rope_theta": r.number("compress_rope_theta")}
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
        tables = {"main": {"rope_type": "default", "rope_theta": r.number("rope_theta")}, "compress": compress}
    for name, table in tables.items():
        prf = table.get("partial_rotary_factor")      # transformers sizes each table by its own
        r.refuse(isinstance(prf, (int, float)) and int(head_dim * prf) != rope_dim,
                 f"a {name} rotary table over {prf} of the head while queries turn {rope_dim} dims")
        table.setdefault("rope_type", table.get("type", "default"))
        table.setdefault("rope_theta", r.get("rope_theta"))
        table.pop("truncate", None)      # transformers reads it from the top level, where V4 has none
        if table["rope_type"] in ("yarn", "llama3", "longrope"):
            table.setdefault("original_max_position_embeddings", r.get("max_position_embeddings"))
        table["partial_rotary_factor"] = 1.0   # the tables below are built over the rope dims alone
    return {name: Rope({"rope_parameters": t, "max_position_embeddings": r.get("max_position_embeddings")},
                       rope_dim, partial=True) for name, t in tables.items()}


# --- the compressors' cache kind (to join core/cache_kinds.py when a second family needs it) ----
OPEN = ("kv", "gate", "prior_kv", "prior_gate")     # a compressor's state besides its entries


@dataclass(frozen=True)
class Compressed:
    """A compressor's state, kept as an object of its own (core.cache: ``cache[i][name]``): its
    entries (one of ``dim`` values per ``ratio`` positions, doubling storage), the projected rows
    of the block not complete yet and, with ``overlap`` (CSA), the last complete block's first
    half (the next entry's window starts there). How many entries and open rows count follows from
    the cache's length. Positions folded into entries cannot be dropped (not truncatable); a
    checkpoint copies the open rows and the overlap (entries never change once written). Saved
    sessions (core.sessions) write ``to_arrays`` and read them back with ``from_arrays``."""
    ratio: int
    dim: int
    overlap: bool
    name: str           # "compressor" | "indexer"
    truncatable = False
    growing = False

    def bytes_per_position(self, dtype: str = "float32") -> int:
        return math.ceil(self.dim * 4 / self.ratio)

    def fixed_bytes(self, dtype: str = "float32") -> int:
        width = self.dim * (2 if self.overlap else 1)
        return 4 * 2 * self.ratio * (width + (self.dim if self.overlap else 0))

    def describe(self) -> str:
        what = "indexer keys" if self.name == "indexer" else "compressed entries"
        return f"{what} ({self.dim} per {self.ratio} positions)"

    def make(self, dtype, recycled: dict) -> "CompressedState":
        old = recycled.get(self.name)
        return CompressedState(self, old._rows if isinstance(old, CompressedState) else None)

    def checkpoint(self, st: "CompressedState") -> dict:
        return {name: getattr(st, name).copy() for name in OPEN}

    def restore(self, st: "CompressedState", saved: dict) -> None:
        for name in OPEN:
            setattr(st, name, saved[name].copy())

    # saved sessions: the entries so far and the open block, float32; ``version`` names this
    # layout in the file (a change of it makes older files computed again, never misread)
    version = 1

    def saved_arrays(self, length: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, dtype) of what ``to_arrays`` gives at ``length`` positions."""
        m, d = self.ratio, self.dim
        w, o = d * (2 if self.overlap else 1), m if self.overlap else 0
        shapes = {"entries": (length // m, d), "kv": (m, w), "gate": (m, w), "prior_kv": (o, d), "prior_gate": (o, d)}
        return {name: (shape, "float32") for name, shape in shapes.items()}

    def to_arrays(self, st: "CompressedState", length: int) -> dict:
        return {"entries": st.entries(length), **{name: getattr(st, name) for name in OPEN}}

    def from_arrays(self, st: "CompressedState", arrays: dict, length: int) -> None:
        """Continue from saved arrays (shapes as saved_arrays(length) says: the caller checked)."""
        st._rows = arrays["entries"]          # later entries grow it by doubling
        for name in OPEN:
            setattr(st, name, arrays[name])



class CompressedState:
    def __init__(self, kind: Compressed, entries: np.ndarray | None = None):
        m, d, w = kind.ratio, kind.dim, kind.dim * (2 if kind.overlap else 1)
        self.ratio = m
        self.kv, self.gate = np.zeros((m, w), np.float32), np.zeros((m, w), np.float32)
        # (CSA) the last complete block's first half; before the first block: gate -inf, softmax
        # weight 0. HCA keeps none (Compressed.fixed_bytes counts what is here)
        o = m if kind.overlap else 0
        self.prior_kv, self.prior_gate = np.zeros((o, d), np.float32), np.full((o, d), -np.inf, np.float32)
        self._rows = entries if entries is not None else np.zeros((0, d), np.float32)   # old rows: dead

    def entries(self, length: int) -> np.ndarray:
        return self._rows[: length // self.ratio]

    def pending(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        r = length % self.ratio
        return self.kv[:r], self.gate[:r]

    def commit(self, length: int, entries: np.ndarray, kv: np.ndarray, gate: np.ndarray, prior=None) -> None:
        """After a pass from ``length``: the new entries, the rows of the block still open and (CSA)
        the last complete block's first half."""
        count = length // self.ratio
        n = count + len(entries)
        if n > len(self._rows):          # doubling: no copy of every entry per block
            grown = np.zeros((max(n, 2 * len(self._rows)), self._rows.shape[1]), np.float32)
            grown[:count] = self._rows[:count]
            self._rows = grown
        self._rows[count: n] = entries
        self.kv[: len(kv)], self.gate[: len(gate)] = kv, gate
        if prior is not None:
            self.prior_kv[...], self.prior_gate[...] = prior


# --- compressors and the indexer --------------------------------------------------------------------
@dataclass(frozen=True)
class Compressor:
    """Each complete block of ``ratio`` positions becomes one entry: softmax over the block of
    (gate + position_bias) weighting kv, an RMSNorm, RoPE ("compress") at the block's first
    position. ``overlap`` (CSA): kv / gate are twice ``dim`` wide, [Ca | Cb]; entry w is the
    softmax over 2 ratio rows -- block w-1's Ca and block w's Cb (transformers'
    DeepseekV4CSACompressor / HCACompressor / the indexer's own)."""
    hidden: int
    dim: int
    ratio: int
    overlap: bool
    rope: Rope              # the "compress" table (entries turn at their block's first position)
    name: str = "compressor"

    def tensors(self, p: str) -> list[Need]:
        w = self.dim * (2 if self.overlap else 1)
        # float32 as transformers keeps them (they decide the entries every later query reads)
        return [Need(p + "wkv.weight", (w, self.hidden), float32=True),
                Need(p + "wgate.weight", (w, self.hidden), float32=True),
                Need(p + "ape", (self.ratio, w), float32=True), Need(p + "norm.weight", (self.dim,))]

    def cache_kind(self) -> Compressed:
        return Compressed(self.ratio, self.dim, self.overlap, self.name)

    def build(self, c, p: str, eps: float) -> "CompressorBlock":
        return CompressorBlock(self, c, p, eps)


class CompressorBlock:
    def __init__(self, spec: Compressor, c, p: str, eps: float):
        self.spec, self.eps = spec, eps
        w = load_needs(c, spec.tensors(p), p)
        self.kv, self.gate = w["wkv.weight"], w["wgate.weight"]
        self.bias, self.norm = kernels.vector(w["ape"]), kernels.vector(w["norm.weight"])

    def update(self, h: np.ndarray, cache, i: int) -> np.ndarray:
        """Fold the rows of h [T, hidden] (positions from cache.length on) into layer i's state;
        returns every entry so far [N, dim]."""
        s, m, d = self.spec, self.spec.ratio, self.spec.dim
        st, length = cache[i][s.name], cache.length
        old_kv, old_gate = st.pending(length)
        kv = np.concatenate([old_kv, kernels.matmul(h, self.kv)])
        gate = np.concatenate([old_gate, kernels.matmul(h, self.gate)])
        n = len(kv) // m
        if n == 0:
            st.commit(length, kv[:0, :d], kv, gate)
            return st.entries(length + len(h))
        rest_kv, rest_gate = kv[n * m:], gate[n * m:]
        kv, gate = kv[: n * m].reshape(n, m, -1), gate[: n * m].reshape(n, m, -1) + self.bias
        prior = None
        if s.overlap:        # [block w-1's Ca | block w's Cb]; before the first block: weight 0
            ca_kv, ca_gate = np.empty((n, m, d), np.float32), np.empty((n, m, d), np.float32)
            ca_kv[1:], ca_gate[1:] = kv[:-1, :, :d], gate[:-1, :, :d]
            ca_kv[0], ca_gate[0] = st.prior_kv, st.prior_gate
            prior = (kv[-1, :, :d], gate[-1, :, :d])
            kv = np.concatenate([ca_kv, kv[:, :, d:]], axis=1)
            gate = np.concatenate([ca_gate, gate[:, :, d:]], axis=1)
        w = np.exp(gate - gate.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        entries = kernels.rms_norm((kv * w).sum(axis=1, dtype=np.float32), self.norm, self.eps)
        first = (length // m) * m
        cos, sin = pair_tables(*s.rope.cos_sin(first + m * np.arange(n)))
        entries = rope_pairs_tail(entries[:, None, :], cos, sin)[:, 0]
        st.commit(length, entries, rest_kv, rest_gate, prior)
        return st.entries(length + len(h))


def visible(pos: np.ndarray, n: int, ratio: int) -> np.ndarray:
    """[T, n]: entry w holds positions [w ratio, (w + 1) ratio), seen once all are."""
    return np.arange(n)[None, :] < ((pos + 1) // ratio)[:, None]


@dataclass(frozen=True)
class Indexer:
    """The Lightning indexer: its own overlapping compressor at ``dim`` (index_head_dim), queries
    ``q_b_proj(q_residual)`` per head with the "compress" RoPE at the query's position, score
    sum_h w_h relu(q_h . k) / sqrt(dim) with w = weights_proj(x) / sqrt(heads), the ``topk`` best
    visible entries (ties to the lower index)."""
    compressor: Compressor
    heads: int
    q_lora_rank: int
    topk: int

    def tensors(self, p: str) -> list[Need]:
        return self.compressor.tensors(p + "compressor.") + self.own_tensors(p)

    def own_tensors(self, p: str) -> list[Need]:
        return [Need(p + "wq_b.weight", (self.heads * self.compressor.dim, self.q_lora_rank)),
                Need(p + "weights_proj.weight", (self.heads, self.compressor.hidden), float32=True)]

    def build(self, c, p: str, eps: float) -> "IndexerBlock":
        return IndexerBlock(self, c, p, eps)


class IndexerBlock:
    def __init__(self, spec: Indexer, c, p: str, eps: float):
        self.spec, self.compressor = spec, spec.compressor.build(c, p + "compressor.", eps)
        w = load_needs(c, spec.own_tensors(p), p)
        self.q_b, self.weights = w["wq_b.weight"], w["weights_proj.weight"]

    def select(self, h, q_res, pos, cache, i: int, cos, sin) -> np.ndarray:
        """[T, N] bool: the entries each query attends to."""
        s, d = self.spec, self.spec.compressor.dim
        keys = self.compressor.update(h, cache, i)
        q = rope_pairs_tail(kernels.matmul(q_res, self.q_b).reshape(len(h), s.heads, d), cos, sin)
        w = kernels.matmul(h, self.weights) * np.float32(s.heads ** -0.5)
        score = np.empty((len(h), len(keys)), np.float32)
        B = kernels.ATTENTION_QUERY_BLOCK
        for t in range(0, len(h), B):      # bounded: [block, heads, N] at a time
            heads = np.maximum(np.einsum("thd,nd->thn", q[t: t + B], keys, dtype=np.float32), 0)
            score[t: t + B] = np.einsum("thn,th->tn", heads * np.float32(d ** -0.5), w[t: t + B], dtype=np.float32)
        seen = visible(pos, len(keys), s.compressor.ratio)
        score = np.where(seen, score, -np.inf)
        top = np.argsort(-score, axis=1, kind="stable")[:, : s.topk]
        chosen = np.zeros_like(seen)
        np.put_along_axis(chosen, top, True, axis=1)
        return chosen & seen


@dataclass(frozen=True)
class CompressedKeys:
    """The keys a CSA / HCA layer adds to its window: the compressor's entries, all of the
    visible ones (HCA) or the indexer's choice of them (CSA)."""
    compressor: Compressor
    indexer: Indexer | None = None

    def cache_kinds(self) -> tuple:
        return (self.compressor.cache_kind(),) + ((self.indexer.compressor.cache_kind(),) if self.indexer else ())

    def tensors(self, p: str) -> list[Need]:
        """Under the attention's prefix: ``compressor.*``, and ``indexer.*`` (CSA)."""
        return self.compressor.tensors(p + "compressor.") + (self.indexer.tensors(p + "indexer.") if self.indexer else [])

    def build(self, c, p: str, eps: float) -> "CompressedKeysBlock":
        return CompressedKeysBlock(self, c, p, eps)


class CompressedKeysBlock:
    def __init__(self, spec: CompressedKeys, c, p: str, eps: float):
        self.compressor = spec.compressor.build(c, p + "compressor.", eps)
        self.indexer = spec.indexer.build(c, p + "indexer.", eps) if spec.indexer else None
        self.ratio = spec.compressor.ratio

    def __call__(self, i: int, h, q_res, step) -> tuple[np.ndarray, np.ndarray]:
        entries = self.compressor.update(h, step.cache, i)
        if self.indexer is None:
            return entries, visible(step.pos, len(entries), self.ratio)
        cos, sin = pair_tables(*step.rope("compress"))
        chosen = self.indexer.select(h, q_res, step.pos, step.cache, i, cos, sin)
        cols = np.flatnonzero(chosen.any(axis=0))    # only what some query attends to (decode: <= topk)
        return entries[cols], chosen[:, cols]


# --- routing ----------------------------------------------------------------------------------------
class HashTopK:
    """Hash routing (transformers' DeepseekV4HashRouter): the experts are ``tid2eid[token id]``;
    their weights are the router's scores, renormalised and times ``scaling`` as ScoreTopK's."""
    kind = "hash"

    def __init__(self, weight, tid2eid: np.ndarray, fn: str, scaling: float):
        self.weight, self.tid2eid, self.fn, self.scaling = weight, tid2eid, fn, np.float32(scaling)
        self.top_k = tid2eid.shape[1]

    def route(self, h: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        top = self.tid2eid[ids]
        return top, chosen_weights(route_scores(kernels.router_logits(h, self.weight), self.fn), top, self.scaling)

    def known(self, ids: np.ndarray) -> list[int]:
        """The experts these tokens use here, each once: known before layer 0."""
        return list(dict.fromkeys(int(e) for e in self.tid2eid[ids].reshape(-1)))


@dataclass(frozen=True)
class HashRouter:
    """Declares a HashTopK router: ``gate.weight`` [experts, hidden], ``gate.tid2eid`` [vocab, k]."""
    top_k: int
    fn: str
    scaling: float
    vocab: int

    def tensors(self, p: str, experts: int, hidden: int) -> list[Need]:
        return [Need(p + "gate.weight", (experts, hidden), float32=True),
                Need(p + "gate.tid2eid", (self.vocab, self.top_k), index_range=experts)]

    def build(self, c, p: str, experts: int, hidden: int) -> HashTopK:
        table = c.load_ints(p + "gate.tid2eid")
        if table.shape != (self.vocab, self.top_k):
            raise ColiError(f"{p}gate.tid2eid: shape {list(table.shape)}, the config needs [{self.vocab}, {self.top_k}]")
        srt = np.sort(table, axis=1)
        if table.min(initial=0) < 0 or table.max(initial=0) >= experts or (srt[:, 1:] == srt[:, :-1]).any():
            raise ColiError(f"{p}gate.tid2eid: each row must name {self.top_k} distinct experts in 0..{experts - 1}")
        return HashTopK(_router_weight({"gate.weight": c.load(p + "gate.weight")}, p, experts, hidden),
                        table, self.fn, self.scaling)


@dataclass(frozen=True)
class V4MoE:
    """core.blocks.mlp.MoE whose hash-routed layers route by the step's token ids."""
    moe: MoE
    kind = "moe"

    @property
    def num_experts(self) -> int:
        return self.moe.num_experts

    def tensors(self, p: str) -> list[Need]:
        return self.moe.tensors(p)

    def build(self, c, p: str) -> "V4MoEBlock":
        return V4MoEBlock(self.moe.build(c, p))


class V4MoEBlock:
    kind = "moe"

    def __init__(self, block):
        self.block, self.router = block, block.router
        if isinstance(self.router, HashTopK):      # the engine prefetches these before layer 0
            self.known_experts = lambda step: self.router.known(step.ids)

    def __call__(self, i: int, h: np.ndarray, step, routed=None) -> np.ndarray:
        if routed is None and isinstance(self.router, HashTopK):
            routed = self.router.route(h, step.ids)
        return self.block(i, h, step, routed)


@functools.lru_cache(maxsize=1)
def chat_template() -> str:
    """Our Jinja form of the release's Python chat encoder (models/templates/deepseek_v4.jinja)."""
    return (Path(__file__).parent / "templates" / "deepseek_v4.jinja").read_text(encoding="utf-8")


# --- the family -------------------------------------------------------------------------------------
class DeepseekV4:
    model_type = "deepseek_v4"

    @staticmethod
    def spec(config: dict, generation_config: dict | None = None) -> ArchSpec:
        r = ConfigReader("deepseek_v4", config, DEFAULTS, ALIASES)
        spec = common_spec(r, generation_config)
        r.refuse(r.flag("mlp_bias"), "mlp_bias")
        fn = r.get("scoring_func")
        r.refuse(fn not in SCORES, f"scoring_func {fn!r} (supported: {', '.join(SCORES)})")
        n, H, D = spec.num_layers, spec.hidden_size, spec.head_dim
        prf = config.get("partial_rotary_factor")
        if prf is None:
            qk_rope = config.get("qk_rope_head_dim")
            prf = qk_rope / D if isinstance(qk_rope, int) and not isinstance(qk_rope, bool) else 64 / 512
        rope_dim = int(D * prf) if isinstance(prf, (int, float)) and not isinstance(prf, bool) else -1
        r.refuse(not 0 < rope_dim <= D or rope_dim % 2, f"a rope dimension of {rope_dim} in a head of {D}")
        heads, G = spec.num_heads, r.positive_int("o_groups")
        r.refuse((heads * D) % G != 0, f"o_groups {G} not dividing {heads} x {D}")
        tables = rope_tables(r, rope_dim, D)
        compress = tables["compress"]
        limit = r.number("swiglu_limit")
        I, E, k = r.positive_int("moe_intermediate_size"), spec.num_experts, spec.top_k
        r.refuse(E == 0, "a model without routed experts")
        scaling = r.number("routed_scaling_factor")
        q_rank = r.positive_int("q_lora_rank")
        window = r.positive_int("sliding_window")
        layers = []
        for (kind, ratio), mlp in zip(attention_kinds(r, n), mlp_kinds(r, n)):
            extra = None
            if kind != SLIDING:
                indexer = None
                if kind == CSA:
                    idx = Compressor(H, r.positive_int("index_head_dim"), ratio, True, compress, "indexer")
                    r.refuse(idx.dim < rope_dim, f"index_head_dim {idx.dim} below the rope dims ({rope_dim})")
                    indexer = Indexer(idx, r.positive_int("index_n_heads"), q_rank, r.positive_int("index_topk"))
                extra = CompressedKeys(Compressor(H, D, ratio, kind == CSA, compress), indexer)
            mixer = SharedKV(H, heads, D, rope_dim, q_rank, G, r.positive_int("o_lora_rank"), window,
                             "main" if kind == SLIDING else "compress", extra)
            router = (HashRouter(k, fn, scaling, spec.vocab_size) if mlp == "hash_moe"
                      else ScoreRouter(k, fn, scaling, bias_name="bias"))
            ffn = V4MoE(MoE(H, E, router, I, shared=SwiGLU(H, I, W123), limit=limit, expert_parts=W123))
            layers.append(MHC(r.positive_int("hc_mult"), r.positive_int("hc_sinkhorn_iters"),
                              r.number("hc_eps"), mixer, ffn))
        spec.layers = layers
        spec.mlp_kinds = ["moe"] * n
        spec.cache_kinds = [layer.cache_kind() for layer in layers]
        spec.num_kv_heads, spec.rope_dim, spec.rope_partial = 1, rope_dim, True
        spec.expert_intermediate = I
        spec.layout = LAYOUT
        n_hc = layers[0].n if layers else r.positive_int("hc_mult")
        spec.embedding = StreamEmbedding(spec.vocab_size, H, spec.tie_word_embeddings, n=n_hc)
        spec.head = StreamHead(spec.vocab_size, H, n_hc, r.number("hc_eps"), spec.tie_word_embeddings, LAYOUT.head)
        spec.rope_tables = tables
        spec.chat_template = chat_template()
        return spec

    @staticmethod
    def mtp_tensors(spec: ArchSpec, config: dict) -> list[Need]:
        """The release's MTP blocks (``mtp.K.``, for the catalog's sizes): a sliding layer with a
        score-routed gate (vLLM gives it no compressor; its compress_ratios entry is 0), e_proj /
        h_proj [H, H], enorm / hnorm / norm and its own hc head."""
        n = config.get("num_nextn_predict_layers") or 0
        if not isinstance(n, int) or n <= 0:
            return []
        H = spec.hidden_size
        rates = {**DEFAULT_RATES, **{t: m for t, m in attention_kinds(
            ConfigReader("deepseek_v4", config, DEFAULTS, ALIASES), spec.num_layers) if m}}
        one = {k: v for k, v in config.items() if k not in ("compress_ratios", "num_hash_layers")}
        one.update(num_hidden_layers=1, layer_types=[SLIDING], mlp_layer_types=["moe"], compress_rates=rates)
        layer = DeepseekV4.spec(one).layers[0]
        out = []
        for k in range(n):
            p = f"mtp.{k}."
            out += [t for t in layer.tensors(p, H) if t.synthetic and t.shape]
            out += [Need(p + w + ".weight", (H, H)) for w in ("e_proj", "h_proj")]
            out += [Need(p + w + ".weight", (H,)) for w in ("enorm", "hnorm")]
            out += StreamHead(spec.vocab_size, H, layer.n, 0.0, True, LAYOUT.head).tensors(p)   # + its norm
        return out
