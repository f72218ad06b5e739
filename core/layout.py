"""The tensors an ArchSpec needs, with their shapes: checked before conversion (against the
source's tensors) and at open (against the container's logical shapes), so that a config that
disagrees with its weights -- ``num_key_value_heads`` 2 where the weights have 4 heads' rows, a
tensor that is missing -- is one clear error naming the tensor, never a complete-looking container
that fails later or computes nonsense.

Tensor names follow the Hugging Face convention the engine reads (core/engine.py's ``_Layer``).
Sizes the config does not fix (an MLP's intermediate width) are checked for consistency between
the tensors that share them.
"""
from __future__ import annotations

from typing import Mapping

from .arch import ArchSpec
from .errors import ColiError


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
