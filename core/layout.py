"""Where a family's tensors sit in its checkpoint (``Layout``, declared once by the family, issue
26), and the tensors an ArchSpec needs, with their shapes.

The ``Layout`` is read by everything that handles a checkpoint or a container by tensor name: the
converter applies it (renames, fused-expert splits, what it sets aside, each tensor's class), the
container finds the routed experts by the pattern the converter recorded in the manifest, the
planner, ``core.synthetic`` and the catalog take their names from it. Its defaults are the Hugging
Face convention most families follow; a family changes only what differs.

The tensors are checked before conversion (against the source's tensors) and at open (against the
container's logical shapes), so that a config that disagrees with its weights --
``num_key_value_heads`` 2 where the weights have 4 heads' rows, a tensor that is missing -- is one
clear error naming the tensor, never a complete-looking container that fails later or computes
nonsense. Sizes the config does not fix (an MLP's intermediate width) are checked for consistency
between the tensors that share them.

Numpy-free (core.arch holds a Layout): core.quant is imported when a class is asked for.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from .errors import ColiError

if TYPE_CHECKING:
    from .arch import ArchSpec

# a routed expert's tensors: layer and expert captured (searched in the name, so an MTP module's
# ``mtp.layers.K....experts.E.`` is found as well)
EXPERT_REGEX = r"(?:^|\.)layers\.(?P<layer>\d+)\.(?:.*?\.)?experts\.(?P<expert>\d+)\."
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
# MTP modules at the top level (Qwen3.5's ``mtp.*``, ``model.mtp.*``): the groups, joined by ".",
# name the MTP group (one shard each)
MTP_MODULES = (r"^((?:model\.)?mtp)\.(?:(layers\.\d+)\.)?",)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor belongs to (``layers.N.``), None for the rest."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ExpertPattern:
    """The routed experts: ``regex`` captures ``layer`` and ``expert`` from a tensor name;
    ``parts`` are the (gate, up, down) names under ``experts.E.`` (Kimi: w1, w3, w2)."""
    regex: str = EXPERT_REGEX
    parts: tuple[str, str, str] = EXPERT_PARTS

    def place(self, name: str) -> tuple[int, int] | None:
        """(layer, expert) of a routed expert's tensor, None for any other."""
        parsed = self.parse(name)
        return parsed[:2] if parsed else None

    def parse(self, name: str) -> tuple[int, int, str] | None:
        """(layer, expert, the name's rest after the match: ``gate_proj.weight``) or None."""
        m = re.search(self.regex, name)
        return (int(m.group("layer")), int(m.group("expert")), name[m.end():]) if m else None


@dataclass(frozen=True)
class FusedExperts:
    """One 3-D tensor holding every expert of a layer (transformers 5's in-memory layout):
    ``...experts.{name}`` [E, k x rows, cols], each expert's ``parts`` (k of them) one after the
    other along dim 1, split by the converter into ``...experts.E.{part}.weight``. ``hidden_in``:
    cols are the hidden size (gate_up_proj [E, 2I, H]); else rows are (down_proj [E, H, I])."""
    name: str
    parts: tuple[str, ...]
    hidden_in: bool


@dataclass(frozen=True)
class Layout:
    """A family's checkpoint layout. Names are the family's (after ``renames``)."""
    prefix: str = "model."                # the language model's tensors: {prefix}layers.N. ...
    embed: str = "embed_tokens.weight"    # under the prefix
    final_norm: str = "norm.weight"       # under the prefix
    head: str = "lm_head.weight"          # at the top level
    experts: ExpertPattern = ExpertPattern()
    # fused 3-D expert tensors the converter splits; None: transformers 5's gate_up_proj and
    # down_proj over the expert parts
    fused: tuple[FusedExperts, ...] | None = None
    # set aside by the converter: MTP modules (regexes, see MTP_MODULES; decoder layers numbered
    # from num_hidden_layers are MTP layers too), and tensor-name prefixes that are no part of the
    # language model (a vision tower), left out; the manifest records both (coli info)
    mtp: tuple[str, ...] = MTP_MODULES
    dropped: tuple[str, ...] = ()
    # a release's own names -> the family's: (regex, replacement) pairs applied in order (re.sub)
    # to every tensor name of the checkpoint before anything else (DeepSeek's original names)
    renames: tuple[tuple[str, str], ...] = ()
    # tensor classes beyond core.quant.default_class: name suffixes kept float32, and regexes of
    # tensors kept in their source encoding at any --bits
    f32: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()

    @property
    def embed_name(self) -> str:
        return self.prefix + self.embed

    @property
    def norm_name(self) -> str:
        return self.prefix + self.final_norm

    @property
    def fused_rules(self) -> tuple[FusedExperts, ...]:
        if self.fused is not None:
            return self.fused
        gate, up, down = self.experts.parts
        return (FusedExperts("gate_up_proj", (gate, up), True), FusedExperts("down_proj", (down,), False))

    def rename(self, name: str) -> str:
        for pattern, repl in self.renames:
            name = re.sub(pattern, repl, name)
        return name

    def tensor_class(self, name: str, ndim: int) -> str:
        """'f32' | 'int8' | 'int4' | 'keep' (core.quant.scheme_at turns it into the scheme at --bits)."""
        from . import quant
        if any(re.search(k, name) for k in self.keep):
            return quant.KEEP
        int8 = tuple(n.rsplit(".", 1)[0] for n in (self.embed, self.head))
        return quant.default_class(name, ndim, self.f32, int8)

    def scheme(self, name: str, ndim: int, bits: int, float32: bool = False) -> str:
        """The scheme ``coli convert --bits`` gives a float tensor: its class at ``bits``, or F32
        where a block reads it as numbers (``float32``: core.blocks.common.Need.float32) and bits
        quantize (at --bits 16 every tensor keeps its source dtype)."""
        from . import quant
        return quant.F32 if float32 and bits != 16 else quant.scheme_at(self.tensor_class(name, ndim), bits)

    def mtp_group(self, name: str, num_layers: int | None) -> str | None:
        """The MTP group (shard) a tensor belongs to -- ``{prefix}layers.N`` for N >= ``num_layers``
        (transformers' ``_keys_to_ignore_on_load_unexpected``: GLM-4.5's layer 46/92, DeepSeek-V3's
        61, GLM-5's 78), a top-level MTP module's (``mtp.layers.K`` / ``mtp``, ``model.mtp``) -- or
        None for a tensor of the language model."""
        if name.startswith(self.prefix + "layers."):
            n = layer_of(name[len(self.prefix) - 1:])
            return (f"{self.prefix}layers.{n}" if isinstance(num_layers, int) and n is not None
                    and n >= num_layers else None)
        for pattern in self.mtp:
            m = re.match(pattern, name)
            if m:
                return ".".join(g for g in m.groups() if g)
        return None


def check_recorded_pattern(regex, where: str) -> str:
    """A manifest's recorded expert pattern, refused in one line unless it is a regex that
    captures ``layer`` and ``expert``."""
    try:
        ok = isinstance(regex, str) and {"layer", "expert"} <= set(re.compile(regex).groupindex)
    except re.error:
        ok = False
    if not ok:
        raise ColiError(f"{where}: expert_pattern must be a regular expression capturing layer and "
                        f"expert, got {regex!r}")
    return regex


def expected_tensors(spec: ArchSpec) -> list:
    """Every tensor the spec's layers need (core.blocks.common.Need), the embedding, final norm
    and head included: the one list of the checkpoint's tensors, read by this check, the
    converter, synthetic checkpoints and size estimates."""
    from .blocks.embed import ends
    H, p = spec.hidden_size, spec.prefix
    embedding, head = ends(spec)
    out = embedding.tensors(p) + head.tensors(p)
    for i, layer in enumerate(spec.layers):
        out += layer.tensors(f"{p}layers.{i}.", H)
    return out


def check_layout(spec: ArchSpec, shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """``shapes``: tensor name -> logical shape ([O, I] for quantized tensors). ``where`` names
    what is checked in the message ("the source", a container path)."""
    from .blocks.mlp import check_mlp_shapes
    H = spec.hidden_size
    unsized = set()
    for need in expected_tensors(spec):
        got = shapes.get(need.name)
        if got is None:
            if need.optional:
                continue
            raise ColiError(f"{where}: tensor {need.name} is missing (the config's architecture needs it)")
        got = tuple(got)
        if need.shape is None:
            unsized.add(need.name.rsplit(".", 2)[0] + ".")
        elif got != need.shape:
            raise ColiError(f"{where}: tensor {need.name} has shape {list(got)}, but the config needs "
                            f"{list(need.shape)} (hidden_size {H}, {spec.num_heads} heads, "
                            f"{spec.num_kv_heads} kv heads of {spec.head_dim})")
    for prefix in sorted(unsized):          # SwiGLUs whose width the config leaves to the tensors
        check_mlp_shapes(shapes, prefix, H, where)
