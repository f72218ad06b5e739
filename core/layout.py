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


def check_layout(spec: ArchSpec, shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """``shapes``: tensor name -> logical shape ([O, I] for quantized tensors). ``where`` names
    what is checked in the message ("the source", a container path)."""
    H, V = spec.hidden_size, spec.vocab_size
    qd, kvd = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim

    def need(name: str, shape: tuple[int, ...] | None, optional: bool = False) -> tuple[int, ...] | None:
        got = shapes.get(name)
        if got is None:
            if optional:
                return None
            raise ColiError(f"{where}: tensor {name} is missing (the config's architecture needs it)")
        got = tuple(got)
        if shape is not None and got != shape:
            raise ColiError(f"{where}: tensor {name} has shape {list(got)}, but the config needs "
                            f"{list(shape)} (hidden_size {H}, {spec.num_heads} heads, "
                            f"{spec.num_kv_heads} kv heads of {spec.head_dim})")
        return got

    def mlp(prefix: str) -> None:
        """gate/up [I, H], down [H, I], the same I."""
        gate = need(prefix + "gate_proj.weight", None)
        if len(gate) != 2 or gate[1] != H:
            raise ColiError(f"{where}: tensor {prefix}gate_proj.weight has shape {list(gate)}, but "
                            f"the config needs [intermediate, {H}]")
        need(prefix + "up_proj.weight", gate)
        need(prefix + "down_proj.weight", (H, gate[0]))

    need("model.embed_tokens.weight", (V, H))
    need("model.norm.weight", (H,))
    if not spec.tie_word_embeddings:
        need("lm_head.weight", (V, H))
    norm = {"per_head": (spec.head_dim, spec.head_dim), "full": (qd, kvd)}.get(spec.qk_norm)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        need(p + "input_layernorm.weight", (H,))
        need(p + "post_attention_layernorm.weight", (H,))
        for n, rows in (("q", qd), ("k", kvd), ("v", kvd)):
            need(p + f"self_attn.{n}_proj.weight", (rows, H))
            need(p + f"self_attn.{n}_proj.bias", (rows,), optional=True)
        need(p + "self_attn.o_proj.weight", (H, qd))
        need(p + "self_attn.o_proj.bias", (H,), optional=True)
        if norm is not None:
            need(p + "self_attn.q_norm.weight", (norm[0],))
            need(p + "self_attn.k_norm.weight", (norm[1],))
        if spec.mlp_kinds[i] == "moe":
            need(p + "mlp.gate.weight", (spec.num_experts, H))
            for e in range(spec.num_experts):
                mlp(p + f"mlp.experts.{e}.")
        else:
            mlp(p + "mlp.")
