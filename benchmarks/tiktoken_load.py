"""Time to build Kimi's tokenizer from tiktoken.model (core/tiktoken_bpe.py) at its real size.

Kimi-K2 / Kimi-Linear / K3 have 163,584 ranks + 256 special slots. Their tiktoken.model is not
on this machine, so ranks of the same count are made here: each new token joins two earlier ones
(a BPE's shape), at most ``--max-len`` bytes. Reports the median of ``--repeats`` builds of each
step, and, for comparison, loading the same tokenizer from a tokenizer.json (what writing one out
at convert time would cost at every open instead).

    python benchmarks/tiktoken_load.py [--ranks 163584] [--max-len 16] [--repeats 3]
"""
from __future__ import annotations

import argparse
import base64
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenizers import Tokenizer  # noqa: E402

from core.tiktoken_bpe import (KIMI_PATTERN, bpe_vocab_merges, read_ranks, special_slots,  # noqa: E402
                               tokenizer_from_ranks)


def synthetic_ranks(n: int, max_len: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    toks = [bytes([b]) for b in range(256)]
    seen = set(toks)
    while len(toks) < n:
        t = toks[int(len(toks) * rng.random() ** 2)] + toks[int(len(toks) * rng.random() ** 3)]
        if len(t) <= max_len and t not in seen:
            seen.add(t)
            toks.append(t)
    return toks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=163584)
    ap.add_argument("--max-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    toks = synthetic_ranks(a.ranks, a.max_len)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "tiktoken.model")
        with open(path, "wb") as f:
            f.writelines(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(toks))
        times = {"read tiktoken.model": [], "vocab + merges": [], "whole build": [], "tokenizer.json load": []}
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            ranks = read_ranks(path)
            t1 = time.perf_counter()
            bpe_vocab_merges(ranks)
            t2 = time.perf_counter()
            tok = tokenizer_from_ranks(read_ranks(path), KIMI_PATTERN, special_slots(len(ranks), {}, 256))
            t3 = time.perf_counter()
            text = tok.to_str()
            t4 = time.perf_counter()
            Tokenizer.from_str(text)
            t5 = time.perf_counter()
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t5 - t4)):
                times[k].append(v)
    mean = sum(map(len, toks)) / len(toks)
    print(f"{len(toks)} ranks (mean {mean:.1f} bytes) + 256 special slots, median of {a.repeats}:")
    for k, v in times.items():
        print(f"  {k:22s} {statistics.median(v):6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
