"""The speed users see against the speed the benchmarks measure (issue 20, section 4).

    python benchmarks/user_path.py [--model DIR] [--tokens 64] [--prompt-len 8] [--rounds 3]
                                   [--threads 2] [--sampling greedy,default] [--paths ...]
                                   [--seed 0] [--json FILE]

The same container, the same prompt ids, the same number of new tokens and the same sampling
settings (greedy, or the CLI's and the app's default: temperature 0.7 with a fixed seed, so every
path yields the same tokens) through four paths, each in a fresh process, interleaved (the order
flips every round) because this VM drifts 10-40 % within minutes:

  bench     benchmarks/decode.py's child, the figure benchmarks/llamacpp.py reports: every expert
            allowed in RAM, prefetch off, a warm-up generation, then the timed one (greedy only:
            decode.py has no sampler option; with --sampling default the row is its greedy figure)
  generate  Engine.generate in-process, the engine opened exactly as `coli run` opens it
            (colibri_tui.cli._open with `coli run`'s parsed options), one generation, cold
  coli-run  `python -m colibri_tui run --model DIR --ids ... --json` as a subprocess, one generation
  app       the chat's generation worker (colibri_tui.runner.run_generation, the code the app
            runs in its "coli-generate" thread, posting batches every 50 ms) on an engine opened
            with the app's options (open_model with the settings' defaults), one generation, cold

What tok/s means, the same for all four: Stats.decode_tok_s of the generation's final Stats =
(new tokens - 1) / (seconds from the end of the prefill to the final Stats). The first new token
comes from the prefill's logits, so the N - 1 decode passes are counted, and the time includes
every sampling, detokenizing and event of those tokens. Next to it, "wall": the same N - 1
tokens over the time between the first and the last Token event as the listener saw them
(the engine's clock cannot hide what happens in the listener). Medians over the rounds.

The default container is the 4-layer OLMoE-1B-7B geometry with the 151,851-token vocabulary that
benchmarks/llamacpp.py times (made once under /work/bench_models/olmoe-4L and kept): there the
int8 lm_head is two thirds of the bytes a token reads, so per-token costs around it show.
Prints numbers; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROG = "user_path.py"
DEFAULT_MODEL = Path("/work/bench_models/olmoe-4L")
PATHS = ("bench", "generate", "coli-run", "app")
SAMPLINGS = ("greedy", "default")


def fail(msg: str) -> SystemExit:
    return SystemExit(f"{PROG}: error: {msg}")


def log(*m) -> None:
    print(*m, file=sys.stderr, flush=True)


def ensure_model(path: Path) -> Path:
    """The 4-layer OLMoE geometry with a 151,851-row vocabulary (benchmarks/llamacpp.py's)."""
    if (path / "colibri.json").exists():
        return path
    if path != DEFAULT_MODEL:
        raise fail(f"--model {path}: not a container (no colibri.json)")
    from benchmarks.llamacpp import our_container
    return our_container(path, 4, 151851)


def prompt_ids(model: Path, n: int, seed: int) -> list[int]:
    import numpy as np
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    return [int(v) for v in np.random.default_rng(seed).integers(1, vocab, n)]


def run_args(a, ids: list[int], sampling: str) -> list[str]:
    """`coli run`'s arguments for this measurement (also parsed in-process by the children)."""
    argv = ["run", "--model", str(a.model), "--ids", ",".join(map(str, ids)),
            "--max-new-tokens", str(a.tokens), "--json", "--seed", str(a.seed)]
    if a.threads:
        argv += ["--threads", str(a.threads)]
    if sampling == "greedy":
        argv.append("--greedy")
    return argv


# --- the children: one fresh process per measurement -------------------------------------------
class Listener:
    """The listener's own clock: when the first and the last Token event arrived."""

    def __init__(self):
        self.first = self.last = None
        self.tokens = 0

    def token(self) -> None:
        now = time.perf_counter()
        self.first = now if self.first is None else self.first
        self.last = now
        self.tokens += 1

    def tok_s(self) -> float:
        n = self.tokens - 1
        return n / (self.last - self.first) if n > 0 and self.last > self.first else 0.0


def child_generate(a, ids: list[int], sampling: str) -> dict:
    from colibri_tui.cli import _open, build_parser
    from core.events import Stats, Token
    from core.sampling import SamplingParams

    args = build_parser().parse_args(run_args(a, ids, sampling))
    engine = _open(args)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, greedy=args.greedy)
    lis, final = Listener(), None
    for ev in engine.generate(ids, params, max_new_tokens=args.max_new_tokens):
        if isinstance(ev, Token) and ev.id >= 0:
            lis.token()
        elif isinstance(ev, Stats) and ev.extra.get("final"):
            final = ev.as_dict()
    return {"tok_s": final["decode_tok_s"], "wall_tok_s": lis.tok_s(), "ids": final["ids"],
            "threads": final["threads"], "lm_head_s": final["lm_head_s"],
            "new_tokens": final["new_tokens"]}


def child_app(a, ids: list[int], sampling: str) -> dict:
    from colibri_tui import settings as settings_mod
    from colibri_tui.runner import run_generation
    from core.sampling import SamplingParams
    from models import open_model

    s = settings_mod.Settings()          # the app's defaults (this run's own config dir is empty)
    engine = open_model(a.model, threads=a.threads or s.threads, ram_gb=s.ram_gb, cap=None,
                        policy=s.policy, prefetch=s.prefetch, o_direct=s.o_direct, kv_cache=s.kv_cache)
    sp = s.sampling
    params = SamplingParams(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, seed=a.seed,
                            greedy=sampling == "greedy")
    batches, applied = [], threading.Event()
    applied.set()
    lis = Listener()

    def post(batch: dict) -> None:       # what the app's BatchReady carries; the UI applies it
        for _ in range(batch["tokens"]):
            lis.token()
        batches.append(batch)

    out = {}

    def worker() -> None:                # the app's "coli-generate" daemon thread
        out.update(run_generation(engine, ids, params, a.tokens, post, ready=applied.is_set))

    t = threading.Thread(target=worker, name="coli-generate", daemon=True)
    t.start()
    t.join()
    if out.get("error") is not None:
        return {"error": out["error"]}
    st = out["stats"] or {}
    return {"tok_s": st.get("decode_tok_s", 0.0), "wall_tok_s": lis.tok_s(), "batches": len(batches),
            "threads": st.get("threads"), "lm_head_s": st.get("lm_head_s"),
            "new_tokens": st.get("new_tokens")}


def child(a) -> None:
    ids = [int(v) for v in a.ids.split(",")]
    res = (child_generate if a.child == "generate" else child_app)(a, ids, a.sampling_one)
    print(json.dumps(res))


# --- the parent ---------------------------------------------------------------------------------
def _last_json(r: subprocess.CompletedProcess) -> dict:
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        return {"error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]}
    return json.loads(lines[-1])


def measure_one(a, path: str, ids: list[int], sampling: str, env: dict) -> dict:
    if path == "bench":
        from benchmarks.decode import build_parser as decode_parser, run_child
        d = decode_parser().parse_args([])
        d.dir, d.tokens, d.prompt_len, d.prefill, d.seed = a.model, a.tokens, a.prompt_len, 0, a.seed
        r = run_child(d, a.threads or "default")
        return {"tok_s": r["tok_s"], "threads": r.get("threads_used"),
                "lm_head_s": r.get("lm_head_s", 0.0) * r.get("steps", 0)} if "error" not in r else r
    if path == "coli-run":
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "colibri_tui"] + run_args(a, ids, sampling),
                           capture_output=True, text=True, env=env)
        res = _last_json(r)
        if "error" in res:
            return res
        st = res["stats"]
        return {"tok_s": st["decode_tok_s"], "ids": res["ids"], "threads": st["threads"],
                "lm_head_s": st["lm_head_s"], "new_tokens": st["new_tokens"],
                "process_s": time.perf_counter() - t0}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", path, "--model", str(a.model),
           "--ids", ",".join(map(str, ids)), "--tokens", str(a.tokens), "--seed", str(a.seed),
           "--threads", str(a.threads), "--sampling-one", sampling]
    return _last_json(subprocess.run(cmd, capture_output=True, text=True, env=env))


def isolated_env(tmp: Path) -> dict:
    """Every child with its own empty config / data / log folders: no user setting leaks in."""
    env = dict(os.environ)
    for k in ("COLI_CONFIG_DIR", "COLI_DATA_DIR", "COLI_LOG_DIR"):
        env[k] = str(tmp / k.lower())
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per generation")
    ap.add_argument("--prompt-len", type=int, default=8, help="random prompt ids")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="compute threads (0: the default, load-following)")
    ap.add_argument("--sampling", default="greedy,default", help=f"comma-separated: {', '.join(SAMPLINGS)}")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated: {', '.join(PATHS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write every measurement here")
    ap.add_argument("--child", choices=("generate", "app"), help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--sampling-one", choices=SAMPLINGS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a)
        return 0
    samplings, paths = a.sampling.split(","), a.paths.split(",")
    if any(s not in SAMPLINGS for s in samplings) or any(p not in PATHS for p in paths):
        raise fail(f"--sampling from {SAMPLINGS}, --paths from {PATHS}")
    if a.tokens < 2 or a.rounds < 1 or a.prompt_len < 1 or a.threads < 0:
        raise fail("--tokens >= 2, --rounds >= 1, --prompt-len >= 1, --threads >= 0")
    a.model = ensure_model(a.model)
    ids = prompt_ids(a.model, a.prompt_len, a.seed)
    from benchmarks.common import format_summary, machine_summary
    print(format_summary(machine_summary()))
    results: dict = {}
    jobs = [(p, s) for s in samplings for p in paths if not (p == "bench" and s != samplings[0])]
    with tempfile.TemporaryDirectory(prefix="user_path-") as tmp:
        env = isolated_env(Path(tmp))
        for rnd in range(a.rounds):
            for p, s in (jobs if rnd % 2 == 0 else jobs[::-1]):
                r = measure_one(a, p, ids, s, env)
                log(f"round {rnd + 1} {p:9s} {s:8s}: " + json.dumps({k: v for k, v in r.items() if k != "ids"}))
                if "error" in r:
                    raise fail(f"{p} ({s}): {r['error']}")
                results.setdefault((p, s), []).append(r)
    report(a, results, samplings)
    if a.json:
        rows = [{"path": p, "sampling": s, "runs": rs} for (p, s), rs in results.items()]
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


def report(a, results: dict, samplings: list[str]) -> None:
    bench = results.get(("bench", samplings[0]))
    ref = statistics.median(r["tok_s"] for r in bench) if bench else None
    print(f"\nmodel {a.model}, {a.tokens} new tokens after a {a.prompt_len}-id prompt, threads "
          f"{a.threads or 'default'}, {a.rounds} interleaved rounds; tok/s = (new tokens - 1) / "
          f"(end of prefill -> final Stats); wall = the same tokens between the listener's first "
          f"and last Token event")
    print(f"{'path':9s} {'sampling':8s} {'tok/s median':>12} {'wall median':>11} {'vs bench':>8}  "
          f"{'lm_head ms/tok':>14}  each round")
    for (p, s), rs in results.items():
        med = statistics.median(r["tok_s"] for r in rs)
        walls = [r["wall_tok_s"] for r in rs if r.get("wall_tok_s")]
        wall = f"{statistics.median(walls):11.1f}" if walls else f"{'-':>11}"
        heads = [1e3 * r["lm_head_s"] / max(1, (r.get("new_tokens") or a.tokens) - 1) for r in rs
                 if r.get("lm_head_s")]
        head = f"{statistics.median(heads):14.2f}" if heads else f"{'-':>14}"
        vs = f"{med / ref:8.3f}" if ref else f"{'-':>8}"
        print(f"{p:9s} {(s if p != 'bench' else 'greedy'):8s} {med:12.1f} {wall} {vs}  {head}  "
              + " ".join(f"{r['tok_s']:.1f}" for r in rs))
    same = {}
    for (p, s), rs in results.items():
        for r in rs:
            if r.get("ids") is not None:
                same.setdefault(s, set()).add(tuple(r["ids"]))
    for s, seqs in same.items():
        print(f"{s}: {'the same tokens on every path and round' if len(seqs) == 1 else f'{len(seqs)} different token sequences!'}")


if __name__ == "__main__":
    sys.exit(main())
