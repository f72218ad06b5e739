"""Engine.cancel() reaches a prefill (between layers and expert batches), ends generate() with
Done("cancelled"), and changes nothing for the next generation. On the demo model."""
from __future__ import annotations

import threading
import time

import pytest

from core.events import Done, Stats, Token
from core.sampling import SamplingParams




def open_demo(path):
    from models import open_model
    return open_model(str(path), threads=1)


def test_cancel_stops_a_prefill_and_leaves_no_trace(demo):
    engine = open_demo(demo)
    prompt = list(range(5, 905))                     # 900 positions: most of the demo's context
    greedy = SamplingParams(greedy=True)

    def cancel_once_prefill_runs():
        t0 = time.monotonic()
        while engine.counters["attention_s"] <= 0 and time.monotonic() - t0 < 30:
            time.sleep(0.0005)
        engine.cancel()
    watcher = threading.Thread(target=cancel_once_prefill_runs)
    t0 = time.perf_counter()
    watcher.start()
    events = list(engine.generate(prompt, greedy, max_new_tokens=8))
    watcher.join()
    assert isinstance(events[-1], Done) and events[-1].reason == "cancelled"
    assert not [e for e in events if isinstance(e, Token)]
    final = [e for e in events if isinstance(e, Stats)][-1]
    assert final.extra["final"] and final.new_tokens == 0 and final.prompt_tokens == 900
    assert engine._kv_spare is not None              # the cache went back for the next reply
    # stopped inside the prefill: fewer layer passes than a whole one (8 layers x 1 chunk)
    assert len(engine.routed) < 8

    # the next generation on the same engine is the one a fresh engine gives, bit for bit
    again = [e.id for e in engine.generate(prompt, greedy, max_new_tokens=8) if isinstance(e, Token)]
    fresh = [e.id for e in open_demo(demo).generate(prompt, greedy, max_new_tokens=8) if isinstance(e, Token)]
    assert again == fresh and len(again) == 8
    print(f"cancelled prefill ended after {time.perf_counter() - t0:.3f} s")


def test_cancel_during_decode_and_checks_only_while_generating(demo):
    engine = open_demo(demo)
    got = []
    for ev in engine.generate("Tell me a fortune", SamplingParams(greedy=True), max_new_tokens=200):
        if isinstance(ev, Token) and ev.id >= 0:
            got.append(ev.id)
            if len(got) == 3:
                engine.cancel()
        last = ev
    assert last.reason == "cancelled" and 3 <= len(got) <= 4
    # a set flag outside generate() never stops logits() (teacher forcing)
    engine.cancel()
    assert engine.logits([1, 2, 3]).shape[0] == 3


def test_cancellable_prefill_gives_the_same_bits(demo):
    """While generate() runs, a prefill's attention goes block by block (to see a cancel between
    blocks): the logits are the bits of the one-call path, float32 and float16 KV alike."""
    import numpy as np
    from models import open_model
    for kv in ("float32", "float16"):
        engine = open_model(str(demo), threads=1, kv_cache=kv)
        ids = list(range(7, 7 + 700))                 # three query blocks of 256 and a part
        plain = engine.prefill(ids, engine.new_cache())
        engine._cancel_checks = True                  # as inside generate()
        blocked = engine.prefill(ids, engine.new_cache())
        engine._cancel_checks = False
        assert plain.dtype == np.float32 and np.array_equal(plain, blocked), kv
