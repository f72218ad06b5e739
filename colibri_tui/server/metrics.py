"""``/metrics``: counters and gauges in Prometheus' text exposition format (version 0.0.4)."""
from __future__ import annotations

import collections
import threading

BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _escape(v) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests = collections.Counter()          # (route, code) -> n
        self.durations: dict[str, list] = {}            # route -> [bucket counts..., sum, count]

    def request(self, route: str, code: int) -> None:
        with self._lock:
            self.requests[(route, int(code))] += 1

    def observe(self, route: str, seconds: float) -> None:
        """A generation request's duration (to its last byte)."""
        with self._lock:
            h = self.durations.setdefault(route, [0] * len(BUCKETS) + [0.0, 0])
            for i, b in enumerate(BUCKETS):
                if seconds <= b:
                    h[i] += 1
            h[-2] += seconds
            h[-1] += 1

    def render(self, state) -> str:
        from core.memory import peak_rss_bytes, rss_bytes
        w = state.worker
        q = w.queue_state()
        out = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                out.append(f"{name}{{{lab}}} {value}" if lab else f"{name} {value}")

        with self._lock:
            reqs = sorted(self.requests.items())
            hists = {r: list(h) for r, h in self.durations.items()}
        m = {"model": state.model_id}
        metric("coli_requests_total", "counter", "HTTP requests by route and status code.",
               [({"route": r, "code": str(c)}, n) for (r, c), n in reqs])
        metric("coli_generations_total", "counter", "Generations by outcome.",
               [({"outcome": k}, w.counts[k]) for k in ("served", "cancelled", "errors")])
        metric("coli_rejected_total", "counter", "Requests refused with 429 (the queue was full).",
               [({}, w.counts["rejected"])])
        metric("coli_prompt_tokens_total", "counter", "Prompt tokens (cached ones included).", [(m, w.counts["prompt_tokens"])])
        metric("coli_cached_prompt_tokens_total", "counter", "Prompt tokens a cached prefix gave (not prefilled).",
               [(m, w.counts["cached_tokens"])])
        metric("coli_completion_tokens_total", "counter", "Tokens generated.", [(m, w.counts["completion_tokens"])])
        metric("coli_prefill_seconds_total", "counter", "Seconds spent in prefill.", [(m, round(w.totals["prefill_s"], 6))])
        metric("coli_decode_seconds_total", "counter", "Seconds spent decoding.", [(m, round(w.totals["decode_s"], 6))])
        metric("coli_expert_hits_total", "counter", "Expert requests served from RAM.", [(m, w.totals["hits"])])
        metric("coli_expert_misses_total", "counter", "Expert requests read from disk.", [(m, w.totals["misses"])])
        metric("coli_expert_bytes_read_total", "counter", "Bytes of experts read from disk.", [(m, w.totals["bytes_read"])])
        metric("coli_queue_waiting", "gauge", "Requests waiting for the engine.", [({}, q["waiting"])])
        metric("coli_queue_max", "gauge", "Requests that may wait (--max-queue).", [({}, q["max_queue"])])
        metric("coli_decoding", "gauge", "1 while a request is being generated.", [({}, int(q["decoding"]))])
        metric("coli_context_tokens", "gauge", "The model's context (max_position_embeddings).", [(m, state.context)])
        metric("coli_rss_bytes", "gauge", "Resident memory of the server.", [({}, rss_bytes())])
        metric("coli_peak_rss_bytes", "gauge", "Peak resident memory of the server.", [({}, peak_rss_bytes())])
        out.append("# HELP coli_request_duration_seconds Generation requests, to their last byte.")
        out.append("# TYPE coli_request_duration_seconds histogram")
        for route, h in sorted(hists.items()):
            for b, n in zip(BUCKETS, h):
                out.append(f'coli_request_duration_seconds_bucket{{route="{route}",le="{b}"}} {n}')
            out.append(f'coli_request_duration_seconds_bucket{{route="{route}",le="+Inf"}} {h[-1]}')
            out.append(f'coli_request_duration_seconds_sum{{route="{route}"}} {round(h[-2], 6)}')
            out.append(f'coli_request_duration_seconds_count{{route="{route}"}} {h[-1]}')
        return "\n".join(out) + "\n"
