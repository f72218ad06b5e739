"""Log-probabilities in the OpenAI shapes: a token's text and its bytes from the tokenizer.

The engine reports, when asked, log_softmax of the step's raw logits (the model's distribution,
before temperature / top-k / top-p, as OpenAI and vLLM's default report it) for the sampled token
and the N most likely ones (core.events.Token.logprobs). A token's bytes are its own: for a
byte-level BPE (GPT-2 / Qwen / Llama 3) the vocabulary entry mapped back through the byte table,
so a token holding half of a UTF-8 character has those bytes and its text shows U+FFFD.
"""
from __future__ import annotations

from functools import lru_cache

MAX_TOP_LOGPROBS = 20


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable stand-in character -> the byte."""
    from core.tiktoken_bpe import bytes_to_unicode
    return {c: b for b, c in bytes_to_unicode().items()}


class TokenText:
    """id -> (text, bytes), cached, for one tokenizer (a core.tokenizer.ChatTokenizer or None)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}
        inner = getattr(tokenizer, "tokenizer", None)
        dec = getattr(inner, "decoder", None)
        self.byte_level = dec is not None and type(dec).__name__ == "ByteLevel"
        try:
            self.added = {int(i): t.content for i, t in inner.get_added_tokens_decoder().items()} if inner else {}
        except Exception:
            self.added = {}

    def __call__(self, i: int) -> tuple[str, list[int]]:
        got = self.cache.get(i)
        if got is None:
            got = self.cache[i] = self._compute(i)
        return got

    def _compute(self, i: int) -> tuple[str, list[int]]:
        if self.tok is None:
            b = f"<{i}>".encode()
        elif i in self.added:
            b = self.added[i].encode("utf-8")
        else:
            piece = self.tok.id_to_token(i)
            table = _byte_decoder()
            if piece is None:
                b = b""
            elif self.byte_level and all(c in table for c in piece):
                b = bytes(table[c] for c in piece)
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                b = bytes([int(piece[3:5], 16)])          # SentencePiece byte fallback
            else:
                b = piece.replace("\u2581", " ").encode("utf-8")
        return b.decode("utf-8", errors="replace"), list(b)


def chat_entries(tt: TokenText, ev_logprobs, tok_id: int) -> dict:
    """One chat ``logprobs.content`` entry."""
    lp, top = ev_logprobs
    text, b = tt(tok_id)
    return {"token": text, "logprob": lp, "bytes": b,
            "top_logprobs": [{"token": tt(j)[0], "logprob": v, "bytes": tt(j)[1]} for j, v in top]}


class CompletionLogprobs:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (dicts), text_offset."""

    def __init__(self, tt: TokenText):
        self.tt, self.offset = tt, 0

    def take(self, entries: list[tuple[int, tuple]]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok_id, (lp, top) in entries:
            text = self.tt(tok_id)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            d = {}
            for j, v in top:
                d.setdefault(self.tt(j)[0], v)
            out["top_logprobs"].append(d)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out
