"""Streaming benchmark: decode with most experts on disk, against the disk-bound limit.

    python benchmarks/streaming.py [--dir DIR] [--budget-frac 0.25] [--tokens 64] [--keep]
                                   [--geometry olmoe|glm45air|glm5|qwen36|dsv4flash]

1. Makes (once) a random-weight container with OLMoE-1B-7B's geometry (16 layers, 64 experts,
   top-8, hidden 2048, expert intermediate 1024, 16 heads, vocab 50304, int4-g64: ≈ 3.6 GB of
   experts) under DIR (default /work/bench_models/olmoe-geom) with ``core.synthetic``. A
   container already there is reused and never deleted; one made by this run is deleted at the
   end unless ``--keep`` (``--generate-only`` makes it and keeps it).
2. Measures this machine's limits in the same run: RAM read bandwidth (1 and 2 threads) and cold
   sequential disk read bandwidth of the container's files.
3. With a cold page cache and an expert RAM budget of ``--budget-frac`` of the expert bytes,
   decodes ``--tokens`` tokens greedily, prefetch off then on, each run in a fresh process (so
   peak RSS is the engine's own), and prints tok/s, hit rate, bytes read per token, and the
   ratio of tok/s to the disk-bound limit (disk bandwidth ÷ bytes read per decoded token).

The weights are random, so the routing is not a real model's: hit rates here measure the store
and the prefetcher on random-ish routing, not what OLMoE's real routing would give.

``--geometry NAME`` uses one of benchmarks/families.py's containers instead (GLM-4.5-Air's, GLM-5's,
Qwen3.6's or DeepSeek-V4-Flash's real layer sizes, a few layers deep; default DIR
/work/bench_models/NAME-geom-<L>L), made and kept by the same rules.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (disk_parallel_read_gbps, disk_read_gbps,  # noqa: E402
                               drop_page_cache, format_summary, machine_summary, ram_read_gbps)

DEFAULT_DIR = Path("/work/bench_models/olmoe-geom")

# OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924) geometry; no eos_token_id, so decoding never stops early
OLMOE_GEOMETRY = {
    "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"],
    "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024,
    "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
    "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
    "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "clip_qkv": None,
    "tie_word_embeddings": False, "router_aux_loss_coef": 0.01, "output_router_logits": False,
}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# --- the container ---------------------------------------------------------------------------------
def ensure_container(directory: Path, seed: int) -> tuple[Path, bool, float | None]:
    """(path, made_now, generation GB/s). Reuses a finished container made with these settings."""
    from core.synthetic import container_bytes, write_random_container
    from models import family_for

    if (directory / "colibri.json").exists():
        write_random_container(directory, OLMOE_GEOMETRY, family_for(OLMOE_GEOMETRY), seed=seed)   # verifies the parameters
        return directory, False, None
    need = container_bytes(OLMOE_GEOMETRY, family_for(OLMOE_GEOMETRY))["total"]
    directory.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory.parent).free
    log(f"generating a random OLMoE-geometry container: {need / 1e9:.2f} GB into {directory} "
        f"({free / 1e9:.1f} GB free)")
    last = [0.0]

    def progress(p) -> None:
        if not p.tensor and time.perf_counter() - last[0] > 2:
            last[0] = time.perf_counter()
            log(f"  {p.done_bytes / 1e9:5.2f} / {p.total_bytes / 1e9:.2f} GB  {p.shard}")

    t0 = time.perf_counter()
    write_random_container(directory, OLMOE_GEOMETRY, family_for(OLMOE_GEOMETRY), seed=seed, progress=progress)
    dt = time.perf_counter() - t0
    log(f"  done in {dt:.1f} s ({need / dt / 1e9:.2f} GB/s including fsync)")
    return directory, True, need / dt / 1e9


def expert_geometry(path: Path) -> dict:
    from core.container import Container, tensor_place

    c = Container(path)
    try:
        sizes = [loc.end - loc.start for loc in c.experts.values()]
        layers = sorted({l for l, _ in c.experts})
        per_layer = len(sizes) // max(1, len(layers))
        dense = sum(info.nbytes for name, (_, info) in c.index.items() if ".experts." not in name)
        top_k = c.config.get("num_experts_per_tok", 8)
        scheme = next((q.scheme for n, q in c.quant.items() if tensor_place(n)[1] is not None), "dense")
        return {"experts": len(sizes), "expert_bytes": max(sizes), "total_expert_bytes": sum(sizes),
                "expert_scheme": scheme,
                "layers": len(layers), "experts_per_layer": per_layer, "top_k": top_k,
                "dense_bytes": dense, "vocab_size": c.config["vocab_size"]}
    finally:
        c.close()


def lookup_tables(path: Path) -> dict[str, tuple[int, int]]:
    """Tables a token reads one row of, name -> (bytes, bytes of one row): the embedding (codes
    and row scales) and integer index tables (a hash router's token -> experts)."""
    from core.container import Container

    c = Container(path)
    try:
        out = {}
        for name, (_, info) in c.index.items():
            base = name.removesuffix(".qs")
            if "embed_tokens" in base or (info.dtype.startswith("I") and base not in c.quant):
                total, row = out.get(base, (0, 0))
                out[base] = (total + info.nbytes, row + info.nbytes // max(1, info.shape[0]))
        return out
    finally:
        c.close()


def weight_bytes(geo: dict, tables: dict[str, tuple[int, int]]) -> int:
    """Weight bytes a decoded token touches: top-k experts per MoE layer, every dense tensor but
    the lookup tables (``lookup_tables``), of which one row each."""
    return (geo["layers"] * geo["top_k"] * geo["expert_bytes"] + geo["dense_bytes"]
            - sum(t for t, _ in tables.values()) + sum(r for _, r in tables.values()))


# --- one measured run (a child process) -------------------------------------------------------------
def child(args) -> None:
    import numpy as np

    from core.events import Stats
    from core.sampling import SamplingParams
    from models import open_model

    kw = dict(ram_gb=args.ram_gb, cap=args.cap, policy=args.policy, prefetch=bool(args.prefetch),
              o_direct=bool(args.o_direct), threads=args.threads)
    t0 = time.perf_counter()
    try:
        engine = open_model(args.dir, **kw)
    except TypeError as e:
        print(json.dumps({"error": f"open_model does not take this API yet: {e}"}))
        return
    open_s = time.perf_counter() - t0
    vocab = expert_geometry(Path(args.dir))["vocab_size"]
    prompt = np.random.default_rng(args.seed).integers(1, vocab, args.prompt_len).tolist()
    sampling = SamplingParams(greedy=True) if args.temperature == 0 else \
        SamplingParams(temperature=args.temperature, seed=args.seed)
    first = last = None
    t0 = time.perf_counter()
    for ev in engine.generate(prompt, sampling, max_new_tokens=args.tokens):
        if isinstance(ev, Stats):
            d = ev.as_dict()
            if first is None:
                first = d          # right after the first token, before the first decode step
            last = d
    wall = time.perf_counter() - t0
    ids = last.get("ids") or []
    out = {"open_s": open_s, "wall_s": wall, "first": {k: v for k, v in first.items() if k not in ("ids", "text")},
           "final": {k: v for k, v in last.items() if k != "text"},
           "distinct_tokens": len(set(ids))}
    print(json.dumps(out, default=str))


def run_child(args, path: Path, ram_gb: float | None, cap: int | None, prefetch: bool) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--dir", str(path),
           "--tokens", str(args.tokens), "--prompt-len", str(args.prompt_len), "--seed", str(args.seed),
           "--policy", args.policy, "--prefetch", str(int(prefetch)), "--o-direct", str(int(args.o_direct)),
           "--temperature", str(args.temperature)]
    if ram_gb is not None:
        cmd += ["--ram-gb", repr(ram_gb)]
    if cap is not None:
        cmd += ["--cap", str(cap)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode or not lines:
        return {"error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]}
    return json.loads(lines[-1])


def derive(res: dict, disk_gbps: float, geo: dict) -> dict:
    """Decode-only figures: the first Stats comes before the first decode step, so differences
    between the last and the first are the decode steps' own."""
    f, l = res["first"], res["final"]
    steps = max(1, l["new_tokens"] - 1)
    read = l["bytes_read"] - f["bytes_read"]
    per_tok = read / steps
    if "hits" in l and "misses" in l:
        def total(x):
            return sum(x.values()) if isinstance(x, dict) else x
        dh, dm = total(l["hits"]) - total(f["hits"]), total(l["misses"]) - total(f["misses"])
        hit = dh / (dh + dm) if dh + dm else float("nan")
    else:
        hit = l["hit_rate"]
    limit = disk_gbps * 1e9 / per_tok if per_tok > 0 else float("inf")
    tok_s = l["decode_tok_s"]
    if l.get("disk_wait_s") is not None:
        l = {**l, "disk_wait_s": l["disk_wait_s"] - f.get("disk_wait_s", 0.0)}
    return {"tok_s": tok_s, "hit_rate": hit, "hit_rate_run": l["hit_rate"], "mb_per_token": per_tok / 1e6,
            "disk_limit_tok_s": limit, "ratio": tok_s / limit if limit not in (0, float("inf")) else float("nan"),
            "disk_wait_s": l.get("disk_wait_s"), "prefetch_issued": l.get("prefetch_issued"),
            "prefetch_used": l.get("prefetch_used"), "prefetch_recall": l.get("prefetch_recall"),
            "cap": l.get("cap"), "compute_s": sum(l.get(k, 0.0) - f.get(k, 0.0) for k in
                                                  ("attention_s", "experts_s", "lm_head_s")),
            "decode_s": steps / tok_s if tok_s else None, "peak_rss_gb": l["peak_rss_bytes"] / 1e9, "new_tokens": l["new_tokens"],
            "ttft_s": l["ttft_s"], "open_s": res["open_s"], "distinct_tokens": res["distinct_tokens"],
            "all_miss_mb_per_token": geo["layers"] * geo["top_k"] * geo["expert_bytes"] / 1e6}


def fmt(v, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and v != v:
        return "nan"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def main(argv=None) -> int:
    from benchmarks import families

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=None,
                    help=f"the container (default {DEFAULT_DIR}, or benchmarks/families.py's with --geometry)")
    ap.add_argument("--geometry", choices=("olmoe",) + tuple(families.GEOMETRIES), default="olmoe",
                    help="the random container's geometry: OLMoE-1B-7B (default) or a family's layers")
    ap.add_argument("--budget-frac", type=float, default=0.25,
                    help="expert RAM budget as a fraction of all expert bytes")
    ap.add_argument("--cap", type=int, default=None, help="experts per layer instead of --budget-frac")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--keep", action="store_true", help="keep a container this run generated")
    ap.add_argument("--generate-only", action="store_true", help="make the container (kept) and stop")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--o-direct", type=int, default=0, choices=(0, 1))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", action="store_true",
                    help="also run with every expert resident (cap = all): the compute-bound ceiling")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prefetch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--ram-gb", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0

    if args.geometry == "olmoe":
        args.dir = args.dir or DEFAULT_DIR
        path, made, gen_gbps = ensure_container(args.dir, args.seed)
    else:
        args.dir = args.dir or families.default_dir(args.geometry)
        path, made, gen_gbps = families.ensure(args.dir, families.geometry(args.geometry), args.seed,
                                               families.LABELS[args.geometry],
                                               fp4_experts=args.geometry in families.FP4_EXPERTS)
        print(f"geometry: {families.LABELS[args.geometry]}")
    try:
        if args.generate_only:
            made = False        # keep it
            return 0
        geo = expert_geometry(path)
        print("machine:")
        print(format_summary(machine_summary(path)))
        ram1, ram2 = ram_read_gbps(1), ram_read_gbps(2)
        seq = disk_read_gbps(path, max_bytes=2 << 30)
        cold = seq.method == "drop_caches+read"
        direct = disk_read_gbps(path, max_bytes=2 << 30, method="direct")
        par = disk_parallel_read_gbps(path, geo["expert_bytes"], threads=4, max_bytes=1 << 30)
        disk = max((seq, direct, par), key=lambda d: d.gbps)
        print(f"RAM read: {ram1:.1f} GB/s (1 thread), {ram2:.1f} GB/s (2 threads)")
        print(f"disk read, cold: {seq}")
        print(f"disk read, cold: {direct}")
        print(f"disk read, cold: {par}")
        print(f"disk bandwidth used for the limit: the best of these, {disk.gbps:.2f} GB/s")
        if gen_gbps:
            print(f"container generated at {gen_gbps:.2f} GB/s")
        budget = args.budget_frac * geo["total_expert_bytes"]
        ram_gb = None if args.cap else budget * 1.0001 / 1e9
        print(f"model: {path} — {geo['layers']} layers × {geo['experts_per_layer']} experts of "
              f"{geo['expert_bytes'] / 1e6:.2f} MB (top-{geo['top_k']}), experts {geo['total_expert_bytes'] / 1e9:.2f} GB, "
              f"dense {geo['dense_bytes'] / 1e9:.2f} GB")
        print(f"budget: " + (f"cap {args.cap} experts/layer" if args.cap else
                            f"{ram_gb:.3f} GB of experts ({args.budget_frac:.0%}, "
                            f"≈ {int(args.budget_frac * geo['experts_per_layer'])} per layer)")
              + f"; {args.tokens} tokens, prompt {args.prompt_len}, policy {args.policy}, "
                f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}")
        touched = weight_bytes(geo, lookup_tables(path))
        ram = max(ram1, ram2)
        print(f"RAM-bound limit (every expert a hit): {ram * 1e9 / touched:.1f} tok/s "
              f"({touched / 1e9:.2f} GB touched per token at {ram:.1f} GB/s)")
        results = {"machine": machine_summary(path), "ram_gbps": {"1": ram1, "2": ram2},
                   "disk": {"sequential": seq.as_dict(), "o_direct": direct.as_dict(),
                            "expert_reads": par.as_dict(), "limit_gbps": disk.gbps},
                   "geometry": geo, "runs": {}}
        rows = []
        runs = [(f"prefetch {'on' if p else 'off'}", ram_gb, args.cap, p) for p in (False, True)]
        if args.baseline:
            runs.append(("all resident", None, geo["experts_per_layer"], False))
        for name, gb, cap, prefetch in runs:
            if not (cold and drop_page_cache()) and not args.o_direct:
                log("warning: cannot drop the page cache; rerun with --o-direct 1 for cold reads")
            res = run_child(args, path, gb, cap, prefetch)
            if "error" in res:
                print(f"{name}: FAILED: {res['error']}")
                results["runs"][name] = res
                continue
            d = derive(res, disk.gbps, geo)
            results["runs"][name] = {**d, "raw": res}
            rows.append((name, d))
        if rows:
            head = ("run", "tok/s", "hit", "MB/tok", "disk-bound tok/s", "ratio", "decode s", "compute s",
                    "disk wait s",
                    "prefetch used/issued", "recall", "cap", "peak RSS GB", "distinct toks")
            table = [head] + [(n, fmt(d["tok_s"]), fmt(d["hit_rate"], ".1%"), fmt(d["mb_per_token"], ".0f"),
                               fmt(d["disk_limit_tok_s"]), fmt(d["ratio"], ".0%"), fmt(d["decode_s"], ".1f"),
                               fmt(d["compute_s"], ".1f"), fmt(d["disk_wait_s"], ".1f"),
                               f"{fmt(d['prefetch_used'], 'd')}/{fmt(d['prefetch_issued'], 'd')}",
                               fmt(d["prefetch_recall"], ".0%"), fmt(d["cap"]), fmt(d["peak_rss_gb"]),
                               f"{d['distinct_tokens']}/{d['new_tokens']}") for n, d in rows]
            widths = [max(len(r[i]) for r in table) for i in range(len(head))]
            for k, r in enumerate(table):
                print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
                if k == 0:
                    print("  ".join("-" * w for w in widths))
            print(f"(decode steps only; every expert a miss would read "
                  f"{rows[0][1]['all_miss_mb_per_token']:.0f} MB/token; disk-bound = {disk.gbps:.2f} GB/s "
                  f"÷ MB read per decoded token; compute = attention + experts + lm_head time, "
                  f"disk wait = time blocked on reads)")
            if any(d["distinct_tokens"] < d["new_tokens"] / 2 for _, d in rows):
                print("warning: the decode repeats tokens, so routing repeats and hit rates are inflated")
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))
        return 0
    finally:
        if made and not args.keep:
            shutil.rmtree(path, ignore_errors=True)
            log(f"removed {path} (pass --keep to keep it)")


if __name__ == "__main__":
    sys.exit(main())
