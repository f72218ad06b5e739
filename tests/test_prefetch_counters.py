"""The tier panel's "prefetch used U/I" comes from the store's counters: within one generation
a prefetch is counted issued when its read starts and used when a request first finds it, so
used can never exceed issued (the panel once showed "used 15/7": slots prefetched during the
previous reply were claimed after the counters were reset)."""
from __future__ import annotations

import pytest

from core.events import Stats
from core.sampling import SamplingParams


def test_prefetch_used_never_exceeds_issued_across_replies():
    from models import default_model, open_model
    path = default_model()
    if path is None:
        pytest.skip("no demo model")
    engine = open_model(str(path), threads=1, cap=6, prefetch=True)    # 6 of 32 experts per layer
    params = SamplingParams(temperature=1.0, seed=5)
    seen = []
    for prompt in ("Tell me a fortune", "What does the zen of Python say?", "Once upon a time"):
        for ev in engine.generate(prompt, params, max_new_tokens=24):
            if isinstance(ev, Stats):
                used, issued = ev.extra["prefetch_used"], ev.extra["prefetch_issued"]
                assert 0 <= used <= issued, f"prefetch used {used}/{issued}"
                seen.append((used, issued))
    assert seen[-1][1] > 0 and any(u for u, _ in seen)       # prefetch did run, and was used
