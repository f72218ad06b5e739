"""Time to first token of a conversation's turn N against the tokens turn N adds (issue 19):
with prompt-prefix reuse, without it (``--no-prefix-cache``), and after a restart (the chat's
cache saved after turn N-1, the engine's memory emptied, the file read back: core.sessions).

    python benchmarks/turns.py [--model DIR] [--turns 9] [--user-tokens 100] [--reply-tokens 16]
                               [--threads N] [--cap N] [--kv-cache float32|float16]

The conversation is token ids (any container, no tokenizer needed): turn N's prompt is turn
N-1's prompt, its greedy reply and ``--user-tokens`` new random ids; the other modes measure the
same prompts (one new token each: TTFT is what is measured), medians of ``--repeats``.
``restart``'s file is evicted from the page cache before it is read where the OS allows
(benchmarks/common.evict_file), so its time includes a disk read; ``save s`` is the app's write
after the turn (temporary file, fsync, rename). Prints a table; no asserts
(timings are not tests).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _first(engine, ids, n):
    """(reply ids, Stats) of one greedy generation."""
    from core.events import Stats, Token
    from core.sampling import SamplingParams
    reply, stats = [], None
    for ev in engine.generate(ids, SamplingParams(greedy=True), max_new_tokens=n):
        if isinstance(ev, Token) and ev.id >= 0:
            reply.append(ev.id)
        elif isinstance(ev, Stats):
            stats = ev
    return reply, stats


def run(args, report=None) -> list[dict]:
    """One engine for the three modes (a big container is opened once): ``recompute`` turns
    reuse off for the pass; ``restart`` empties the engine's pool and reads turn N-1's saved
    cache (timed); ``reuse`` continues turn N-1's cache in memory -- put back from the same
    file, untimed, so that every repeat starts from the state turn N-1 left."""
    import statistics

    import numpy as np

    from benchmarks.common import evict_file
    from core.sessions import SessionStore
    from models import default_model, open_model
    path = args.model or default_model()
    e = open_model(path, threads=args.threads, cap=args.cap, kv_cache=args.kv_cache)
    e.usage_file = None
    spec = e.spec
    rng = np.random.default_rng(args.seed)
    eos = set(spec.eos_token_ids)
    words = [t for t in range(3, spec.vocab_size) if t not in eos]
    store = SessionStore(tempfile.mkdtemp(prefix="coli-turns-"), budget_bytes=10 ** 12)
    saved = store.path("bench")
    med = statistics.median
    conv: list[int] = []
    rows = []
    limit = spec.max_position_embeddings or 10 ** 9
    _first(e, [int(t) for t in rng.choice(words, 8)], 2)       # warm-up: first-call costs
    e.prefixes.clear()

    def back_to_turn_before():
        e.prefixes.clear()
        if saved.exists():
            store.restore(e, "bench", conv)

    for turn in range(1, args.turns + 1):
        conv = conv + [int(t) for t in rng.choice(words, args.user_tokens)]
        if len(conv) + args.reply_tokens > limit:
            break
        row = {"turn": turn, "prompt": len(conv)}
        e.prefix_cache = False
        row["recompute_s"] = med(_first(e, conv, 1)[1].ttft_s for _ in range(args.repeats))
        e.prefix_cache = True
        if saved.exists():
            times, reads = [], []
            for _ in range(args.repeats):
                e.prefixes.clear()
                evict_file(saved)
                t0 = time.perf_counter()
                store.restore(e, "bench", conv)
                reads.append(time.perf_counter() - t0)
                times.append(reads[-1] + _first(e, conv, 1)[1].ttft_s)
            row.update(restart_s=med(times), restore_s=med(reads), file_bytes=saved.stat().st_size)
        warm = []
        for _ in range(args.repeats - 1):
            back_to_turn_before()
            warm.append(_first(e, conv, 1)[1].ttft_s)
        back_to_turn_before()
        reply, st = _first(e, conv, args.reply_tokens)
        warm.append(st.ttft_s)
        row.update(reuse_s=med(warm), new=st.prompt_tokens - st.cached_tokens, cached=st.cached_tokens)
        t0 = time.perf_counter()
        store.save(e, "bench")
        row["save_s"] = time.perf_counter() - t0
        rows.append(row)
        if report is not None:
            report(row)
        conv = conv + reply
    e.store.close()
    return rows


HEADER = (f"{'turn':>4} {'prompt':>6} {'new':>5} {'reuse s':>8} {'recompute s':>11} {'restart s':>9} "
          f"{'(read s)':>8} {'file':>9} {'save s':>7}")


def line(r: dict) -> str:
    rs = f"{r['restart_s']:9.3f}" if "restart_s" in r else f"{'-':>9}"
    rd = f"{r['restore_s']:8.3f}" if "restore_s" in r else f"{'-':>8}"
    fb = f"{r['file_bytes'] / 1e6:7.1f}MB" if "file_bytes" in r else f"{'-':>9}"
    return (f"{r['turn']:>4} {r['prompt']:>6} {r['new']:>5} {r['reuse_s']:8.3f} {r['recompute_s']:11.3f} "
            f"{rs} {rd} {fb} {r['save_s']:7.3f}")


def table(rows: list[dict]) -> str:
    return "\n".join([HEADER] + [line(r) for r in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a container (default: the demo model)")
    ap.add_argument("--turns", type=int, default=9)
    ap.add_argument("--user-tokens", type=int, default=100, help="new ids each turn adds (default 100)")
    ap.add_argument("--reply-tokens", type=int, default=16, help="reply length (default 16)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cap", type=int, default=None, help="routed experts per layer in RAM (default: automatic)")
    ap.add_argument("--kv-cache", default="float32", choices=("float32", "float16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement; the median is shown")
    args = ap.parse_args(argv)
    from benchmarks.common import format_summary, machine_summary
    print(format_summary(machine_summary(args.model)))
    print(f"model {args.model or 'demo'}, threads {args.threads or 'automatic'}, cap {args.cap or 'auto'}, "
          f"kv {args.kv_cache}, {args.user_tokens} new ids + a {args.reply_tokens}-token reply per turn, "
          f"median of {args.repeats}")
    print(HEADER, flush=True)
    run(args, report=lambda r: print(line(r), flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
