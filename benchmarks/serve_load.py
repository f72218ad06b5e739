"""Load test of ``coli serve`` on loopback: N concurrent clients for T seconds.

    python benchmarks/serve_load.py [--model DIR] [--clients 8] [--seconds 30] [--max-tokens 32]
                                    [--max-queue 4] [--json]

Starts ``coli serve --port 0`` (a child process, its data and config under a temporary folder),
then runs ``--clients`` threads, each sending chat completions one after another until
``--seconds`` have passed (every other request streamed; prompts from a fixed list; a 429 is
counted and the client waits its Retry-After, capped at 1 s, before the next). Meanwhile one
thread asks ``GET /health`` every 0.25 s and another samples the server's RSS. Prints: requests
served, 429s, other errors (there must be none), latency p50/p95 of served requests (to the last
byte), time to first token p50/p95 of the streamed ones, tokens generated and their rate, /health
polls answered and the slowest, and the server's peak RSS. Exit status 1 when a request failed
other than with 429, or /health failed to answer within 2 s.

The clients run on the same machine as the server and share its cores: this measures the server
under contention (one decode at a time, the queue, the event loop staying responsive), not the
engine's best speed (benchmarks/decode.py).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Tell me a fortune", "What is a Python list?", "Write a haiku about the sea",
           "Explain recursion in one sentence", "Say something wise", "How do I open a file?"]


def start_server(model: str | None, max_queue: int, home: Path):
    env = {**os.environ, "COLI_DATA_DIR": str(home / "data"), "COLI_CONFIG_DIR": str(home / "config"),
           "COLI_LOG_DIR": str(home / "logs")}
    env.pop("COLI_API_KEY", None)
    cmd = [sys.executable, "-m", "colibri_tui", "serve", "--port", "0", "--max-queue", str(max_queue)]
    if model:
        cmd += ["--model", model]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    t0 = time.monotonic()
    while True:
        line = p.stderr.readline()
        if not line:
            raise SystemExit(f"serve_load: the server did not start (exit {p.wait()})")
        if line.startswith("coli: serving "):
            model_id = line.split()[2]
            base = line.split(" at ")[1].split(" ")[0].rsplit("/v1", 1)[0]
            break
        if time.monotonic() - t0 > 120:
            p.kill()
            raise SystemExit("serve_load: the server did not start within 120 s")
    # keep draining stderr so the server never blocks on a full pipe
    threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
    return p, base, model_id


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def run(args) -> dict:
    home = Path(tempfile.mkdtemp(prefix="coli-serve-load-"))
    for d in ("data", "config", "logs"):
        (home / d).mkdir()
    proc, base, model_id = start_server(args.model, args.max_queue, home)
    server = psutil.Process(proc.pid)
    lock = threading.Lock()
    res = {"served": 0, "rejected": 0, "errors": [], "latency": [], "ttft": [], "tokens": 0,
           "health": [], "health_failures": 0, "peak_rss": 0}
    stop_at = time.monotonic() + args.seconds
    done = threading.Event()

    def client(k: int) -> None:
        with httpx.Client(base_url=base, timeout=120) as c:
            n = 0
            while time.monotonic() < stop_at:
                stream = (n + k) % 2 == 0
                body = {"model": model_id, "max_tokens": args.max_tokens, "temperature": 0.8, "seed": n,
                        "stream": stream, "stream_options": {"include_usage": True} if stream else None,
                        "messages": [{"role": "user", "content": PROMPTS[(n + k) % len(PROMPTS)]}]}
                n += 1
                t0 = time.monotonic()
                try:
                    status, tokens, ttft, retry = request(c, body)
                except Exception as e:                  # a connection error, a bad stream
                    with lock:
                        res["errors"].append(f"{e.__class__.__name__}: {e}")
                    continue
                dt = time.monotonic() - t0
                with lock:
                    if status == 200:
                        res["served"] += 1
                        res["latency"].append(dt)
                        res["tokens"] += tokens
                        if ttft is not None:
                            res["ttft"].append(ttft)
                    elif status == 429:
                        res["rejected"] += 1
                    else:
                        res["errors"].append(f"HTTP {status}")
                if status == 429:
                    time.sleep(min(1.0, retry))

    def request(c: httpx.Client, body: dict):
        t0 = time.monotonic()
        if not body["stream"]:
            r = c.post("/v1/chat/completions", json=body)
            if r.status_code == 200:
                return 200, r.json()["usage"]["completion_tokens"], None, 0
            return r.status_code, 0, None, float(r.headers.get("retry-after", 1))
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, 0, None, float(r.headers.get("retry-after", 1))
            ttft, tokens, finished = None, 0, False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    finished = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content") and ttft is None:
                    ttft = time.monotonic() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
            if not finished:
                raise RuntimeError("the stream ended without [DONE]")
            return 200, tokens, ttft, 0

    def health() -> None:
        with httpx.Client(base_url=base, timeout=2) as c:
            while not done.is_set():
                t0 = time.monotonic()
                try:
                    ok = c.get("/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                with lock:
                    if ok:
                        res["health"].append(time.monotonic() - t0)
                    else:
                        res["health_failures"] += 1
                done.wait(0.25)

    def rss() -> None:
        while not done.is_set():
            try:
                res["peak_rss"] = max(res["peak_rss"], server.memory_info().rss)
            except psutil.Error:
                return
            done.wait(0.1)

    helpers = [threading.Thread(target=f, daemon=True) for f in (health, rss)]
    clients = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
    t_start = time.monotonic()
    for t in helpers + clients:
        t.start()
    for t in clients:
        t.join()
    wall = time.monotonic() - t_start
    done.set()
    for t in helpers:
        t.join()
    try:
        final = httpx.get(base + "/health", timeout=5).json()
    except httpx.HTTPError:
        final = {}
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
    out = {"model": model_id, "clients": args.clients, "seconds": args.seconds, "wall_s": round(wall, 2),
           "max_tokens": args.max_tokens, "max_queue": args.max_queue,
           "served": res["served"], "rejected_429": res["rejected"], "errors": len(res["errors"]),
           "error_samples": res["errors"][:5],
           "latency_p50_s": pct(res["latency"], 0.5), "latency_p95_s": pct(res["latency"], 0.95),
           "ttft_p50_s": pct(res["ttft"], 0.5), "ttft_p95_s": pct(res["ttft"], 0.95),
           "tokens": res["tokens"], "tok_per_s": round(res["tokens"] / wall, 1) if wall else None,
           "health_polls": len(res["health"]), "health_failures": res["health_failures"],
           "health_max_s": max(res["health"]) if res["health"] else None,
           "health_p50_s": statistics.median(res["health"]) if res["health"] else None,
           "peak_rss_bytes": max(res["peak_rss"], int(final.get("peak_rss_bytes") or 0)),
           "server_counts": final.get("requests")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a container (default: the demo model)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-queue", type=int, default=4)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    r = run(args)
    if args.json:
        print(json.dumps(r))
    else:
        f = lambda v: "-" if v is None else f"{v:.3f}"
        print(f"model {r['model']}: {r['clients']} clients x {r['seconds']:g} s (wall {r['wall_s']} s), "
              f"max_tokens {r['max_tokens']}, --max-queue {r['max_queue']}")
        print(f"served {r['served']}  429 {r['rejected_429']}  other errors {r['errors']}")
        print(f"latency p50 {f(r['latency_p50_s'])} s  p95 {f(r['latency_p95_s'])} s;  "
              f"ttft (streamed) p50 {f(r['ttft_p50_s'])} s  p95 {f(r['ttft_p95_s'])} s")
        print(f"tokens {r['tokens']} ({r['tok_per_s']} tok/s over the run)")
        print(f"/health: {r['health_polls']} answered, {r['health_failures']} failed, "
              f"median {f(r['health_p50_s'])} s, slowest {f(r['health_max_s'])} s")
        print(f"server peak RSS {r['peak_rss_bytes'] / 2 ** 20:.1f} MiB")
        for e in r["error_samples"]:
            print(f"error: {e}")
    return 1 if r["errors"] or r["health_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
