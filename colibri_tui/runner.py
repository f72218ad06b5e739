"""Runs one generation in a worker thread and hands the UI batches, not single tokens.

``run_generation`` consumes the engine's events and calls ``post(batch)`` at most every
``interval`` seconds (plus once at the end). A batch is a plain dict:

    text       the reply text added since the previous batch
    tokens     how many new tokens it covers
    stats      the latest Stats as a dict (``as_dict()``, without ids/text), or None
    rate       tokens/s over this batch (decode only), or None
    placement  engine.placement() snapshot (every ``snapshot_interval`` s and at the end), or None
    heat       engine.heat() snapshot, same cadence, or None
    routed     experts of the latest token {layer: [experts]}, or None
    final      True for the last batch; then ``reason`` ('eos' | 'stop' | 'length' | 'cancelled')
    error      one line when generation failed, else None
"""
from __future__ import annotations

import time
from typing import Callable

from core.errors import ColiError
from core.events import Done, Stats, Token


class _StoppedEarly(Exception):
    pass


def snapshot(engine) -> tuple[dict | None, dict | None]:
    """placement and heat, read between two engine steps (retried if a prefetch thread races)."""
    for _ in range(3):
        try:
            placement = {int(l): dict(es) for l, es in engine.placement().items()}
            heat = dict(engine.heat())
            return placement, heat
        except RuntimeError:          # dict changed size during iteration
            time.sleep(0.001)
    return None, None


def _light(stats: Stats) -> dict:
    d = stats.as_dict()
    d.pop("ids", None)
    d.pop("text", None)
    return d


def run_generation(engine, messages, sampling, max_new_tokens: int, post: Callable[[dict], None],
                   cancelled: Callable[[], bool] = lambda: False, stop=(), interval: float = 0.15,
                   snapshot_interval: float = 0.25, ready: Callable[[], bool] = lambda: True,
                   after: Callable[[str], None] | None = None) -> dict:
    """Generate and post batches; returns the summary {"text", "reason", "stats", "error"}.
    While ``ready()`` is False (the UI has not applied the previous batch) events keep
    accumulating instead: a slow terminal gets bigger batches, never a growing queue.
    ``after(reason)``: called on this thread once the engine is done and before the final batch
    (the app saves the chat's cache there: no next turn can start while the cache is written).
    ``interval`` 0.15 s, not less: every batch costs the UI thread a layout and a repaint (0.98 s
    of its CPU for a 33-batch reply, ~30 ms a batch, on the loaded 2-core VM: benchmarks/
    user_path.py app-ui), and that thread shares the cores with the kernel threads; a batch every
    0.05 s at full decode speed would take most of a core from them."""
    text_all, pending, tokens = [], [], 0
    latest: Stats | None = None
    final: Stats | None = None
    reason, error = "error", None
    last_post = last_snap = time.monotonic()
    rate_t0, rate_n = None, 0
    cancel_sent = False

    def flush(final_batch: bool = False) -> None:
        nonlocal pending, tokens, last_post, last_snap, rate_t0, rate_n, latest
        now = time.monotonic()
        rate = None
        if rate_t0 is not None and tokens and now > rate_t0:
            rate = rate_n / (now - rate_t0) if rate_n else None
        placement = heat = None
        if final_batch or now - last_snap >= snapshot_interval:
            placement, heat = snapshot(engine)
            last_snap = now
        st = final if (final_batch and final is not None) else latest
        d = _light(st) if st is not None else None
        post({"text": "".join(pending), "tokens": tokens, "stats": d, "rate": rate,
              "placement": placement, "heat": heat, "routed": (d or {}).get("routed"),
              "final": final_batch, "reason": reason if final_batch else None,
              "error": error if final_batch else None})
        pending, tokens, last_post = [], 0, now
        latest = None
        rate_t0, rate_n = now, 0

    try:
        if cancelled():               # stopped before it began (each generation has its own flag)
            raise _StoppedEarly()
        for ev in engine.generate(messages, sampling, stop=list(stop), max_new_tokens=max_new_tokens):
            if cancelled() and not cancel_sent:
                engine.cancel()
                cancel_sent = True
            if isinstance(ev, Token):
                if ev.text:
                    pending.append(ev.text)
                    text_all.append(ev.text)
                if ev.id >= 0:
                    tokens += 1
                    if rate_t0 is None:            # the first token: decode speed starts here
                        rate_t0 = time.monotonic()
                    else:
                        rate_n += 1
            elif isinstance(ev, Stats):
                if ev.extra.get("final"):
                    final = ev
                else:
                    latest = ev
            elif isinstance(ev, Done):
                reason = ev.reason
            if time.monotonic() - last_post >= interval and (pending or latest is not None) and ready():
                flush()
    except _StoppedEarly:
        reason = "cancelled"
    except ColiError as e:
        error = str(e)
    except Exception as e:                     # still one line in the UI, never a traceback
        error = f"{e.__class__.__name__}: {e}"
    if cancelled() and reason not in ("eos", "stop", "error"):
        reason = "cancelled"
    if after is not None and error is None:
        try:
            after(reason)
        except Exception as e:                 # a cache that cannot be saved never loses the reply
            error = f"{e.__class__.__name__}: {e}"
    flush(final_batch=True)
    return {"text": "".join(text_all), "reason": reason,
            "stats": _light(final) if final is not None else None, "error": error}
