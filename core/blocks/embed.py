"""The ends of the decoder: the token embedding before layer 0 and the head after the last layer.

As for the layers, ``Embedding`` / ``LMHead`` are what a family declares (``ArchSpec.embedding`` /
``ArchSpec.head``; None: these, from the spec's fields) and ``build`` loads them. The engine calls
``embed(ids, step) -> x`` and ``head(x, step) -> logits`` (x: the rows whose logits are wanted);
a family whose ends differ (streams collapsed before the head, a soft-cap) declares its own.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import kernels
from ..errors import ColiError
from .common import Need, norm_weight


@dataclass(frozen=True)
class Embedding:
    """``{prefix}embed_tokens.weight`` [vocab, hidden]. Untied, one row per token is read from the
    file when needed (RAM for the experts; core.planner.dense_ram_bytes leaves it out); tied, it
    is the head too: in RAM."""
    vocab: int
    hidden: int
    tied: bool = False

    def tensors(self, p: str) -> list[Need]:
        return [Need(p + "embed_tokens.weight", (self.vocab, self.hidden))]

    def build(self, c, p: str) -> "EmbeddingBlock":
        return EmbeddingBlock(self, c, p)


class EmbeddingBlock:
    def __init__(self, decl: Embedding, c, p: str):
        self.weight = (c.load if decl.tied else c.load_rows)(p + "embed_tokens.weight")
        if self.weight.shape[0] != decl.vocab:
            raise ColiError(f"embedding has {self.weight.shape[0]} rows but vocab_size is {decl.vocab}")

    def __call__(self, ids, step):
        return kernels.rows(self.weight, ids)


@dataclass(frozen=True)
class LMHead:
    """The final norm ``{prefix}norm.weight`` (times weight + ``norm_offset``) and the head
    ``lm_head.weight`` [vocab, hidden], or the embedding's rows when ``tied``."""
    vocab: int
    hidden: int
    tied: bool = False
    norm_offset: float = 0.0

    def tensors(self, p: str) -> list[Need]:
        head = [] if self.tied else [Need("lm_head.weight", (self.vocab, self.hidden))]
        return [Need(p + "norm.weight", (self.hidden,))] + head

    def build(self, c, p: str, eps: float, embedding: EmbeddingBlock) -> "LMHeadBlock":
        return LMHeadBlock(self, c, p, eps, embedding)


class LMHeadBlock:
    def __init__(self, decl: LMHead, c, p: str, eps: float, embedding: EmbeddingBlock):
        if decl.tied:
            self.weight = embedding.weight
        elif "lm_head.weight" not in c:      # never the embedding in silence: the logits would be wrong
            raise ColiError(f"{c.path}: lm_head.weight is missing (tie_word_embeddings is false)")
        else:
            self.weight = c.load("lm_head.weight")
        self.norm, self.eps = norm_weight(c, p + "norm.weight", decl.norm_offset), eps

    def __call__(self, x, step):
        return kernels.matmul(kernels.rms_norm(x, self.norm, self.eps), self.weight)


def ends(spec) -> tuple:
    """(embedding, head) as the family declared them (ArchSpec.embedding / .head), else the
    defaults from the spec's fields."""
    tied = spec.tie_word_embeddings
    return (spec.embedding or Embedding(spec.vocab_size, spec.hidden_size, tied),
            spec.head or LMHead(spec.vocab_size, spec.hidden_size, tied, spec.norm_offset))
