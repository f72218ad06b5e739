"""Engine events: plain dataclasses. The engine yields them; whoever listens decides what to show."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Token:
    id: int            # -1: no new token, only text held back until the end (a final flush)
    text: str          # newly completed text (may be "" while a UTF-8 sequence is incomplete)
    # only when generate(logprobs=N) asked: (log-probability of this token, [(id, log-probability)
    # of the N most likely tokens, most likely first]) under the model's distribution at this step
    # (log_softmax of the raw logits: before temperature, top-k, top-p)
    logprobs: tuple[float, list[tuple[int, float]]] | None = None


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    hit_rate: float = 1.0
    bytes_read: int = 0
    peak_rss_bytes: int = 0
    cached_tokens: int = 0     # prompt positions a previous generation's cache held (prefix reuse)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("prompt_tokens", "new_tokens", "ttft_s", "prefill_tok_s",
                                          "decode_tok_s", "hit_rate", "bytes_read", "peak_rss_bytes",
                                          "cached_tokens")}
        d.update(self.extra)
        return d


@dataclass
class Done:
    reason: str        # 'eos' | 'stop' | 'length' | 'cancelled' | 'context' (the model's context is full)
    stop: str | None = None    # reason 'stop': the stop string that matched (the text ends before it)
