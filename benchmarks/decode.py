"""Decode speed with every expert resident, against the RAM-bandwidth bound (issue 5).

    python benchmarks/decode.py [--dir DIR] [--tokens 32] [--threads 1,2] [--prompt-len 8]
                                [--prefill 512] [--no-torch] [--layers N]
                                [--kv-cache float32|float16] [--int8-activations] [--repeats 1]
                                [--busy N] [--model DIR] [--geometry glm45air|glm5|qwen36|dsv4flash]
                                [--context 0,4096] [--fill synthetic|prefill]

Uses the random-weight OLMoE-1B-7B-geometry container of benchmarks/streaming.py (made once under
DIR, default /work/bench_models/olmoe-geom, and kept), opens it with every expert allowed in RAM
(cap = all experts per layer, prefetch off), decodes ``--tokens`` greedy tokens per thread count,
each run in a fresh process, and prints decode tok/s next to the bandwidth bound:

    bound = numpy read bandwidth (same thread count) / bytes touched per decoded token,
    bytes touched = layers x top-k x expert bytes (as stored: int4 + scales, FP4 + scale bytes)
    + dense bytes (attention, norms, router, lm_head; the embedding and any integer index table
    count one row) + the cache reads at the timed steps' mean context (--prompt-len + --tokens / 2
    positions: negligible at the default 8-token prompt, most of the bytes at a few thousand;
    --kv-cache float16 for the opt-in cache; ``cache_read_bytes``).

Each run (a fresh process per thread count) first decodes the same prompt once to load the
experts it routes to into RAM, then decodes again, timed: the figures are that second run's
decode steps (its Stats: decode tok/s, and attention / experts / lm_head seconds).

``--repeats N`` (default 1) runs the decode measurement N times per thread count, the thread
counts alternating and the bandwidth measured right before and after each run (the best of the
two is that run's bound), and reports the medians and the range of the per-run ratios: on a
machine whose speed drifts (the project's 2-core VM moves 10-40 % within minutes) one run's ratio
moves by +-0.1, the median of interleaved runs much less. Prefill and PyTorch run once.

``--model DIR`` benchmarks any converted container instead (the demo model, a real checkpoint).

``--geometry glm45air|glm5`` (issue 17): a random container with GLM-4.5-Air's or GLM-5's real
per-layer sizes, a few layers deep (benchmarks/families.py; made once under /work/bench_models/
and kept, or at ``--dir``). Every expert is loaded into RAM before the timed decode (--preload,
implied), and the model line breaks the bytes touched per token into routed experts, lm_head,
the rest of the dense weights and the cache attention reads (KV for GQA; the MLA latent, plus
the DSA index keys on "full" layers, for GLM-5: core.cache_kinds' bytes per position x context).

``--geometry qwen36`` (issue 18): Qwen3.6-35B-A3B's layers, 3 Gated DeltaNet + 1 gated
attention. The bytes touched per token count the linear layers' fixed state (conv + recurrent,
float32) read and written each step, whatever the context; only the full layer's KV grows. Each
run also times one decode position of a Gated DeltaNet core three ways (the compiled one-call
block, the compiled pieces step by step, the numpy composition).

``--geometry dsv4flash`` (issue 26): DeepSeek-V4-Flash's first 4 layers (2 sliding-window, 1
CSA, 1 HCA; 3 hash-routed) with FP4 routed experts. Its cache reads per step: each layer's ring
(the last min(context, 128) shared-KV rows), the compressed entries (one per 4 / 128 positions;
attention reads at most index_topk = 512 of the CSA layer's, the HCA layer's all) with their open
block's rows, and the CSA layer's indexer keys (all of them). Each hash layer's tid2eid is a
lookup table: one row a token.

``--context 0,4096``: context lengths to decode at, each a row of the tables (thread counts and
contexts interleave under --repeats). 0 is the short case above (the --prompt-len prompt through
generate()); N > 0 decodes --tokens greedy tokens after N positions already in the cache, step
by step through Engine.forward (after 2 untimed steps), so the mean context is N + 2 + tokens/2.
``--fill`` says how the N positions get there: ``prefill`` runs Engine.prefill over N random ids
(real, and timed: fill s in the table); ``synthetic`` (default) writes random unit-RMS rows of
the very arrays and shapes the layers' cache kinds keep (KV / latent / index keys, rings, DeepSeek
V4's compressed entries and open blocks) and sets the length, which takes a second instead of minutes: attention then reads the same bytes at the same
shapes (DSA's top-k selection runs on random scores, so which positions it picks differs, not
how many). ``--prefill 4096`` still times one real prefill of that length in the first run.

``--busy N`` starts N busy-loop processes (one core each, as another program would) for the
decode runs and adds ``default`` to the thread counts: the engine without ``--threads``, whose
count follows the machine's load (core.threads). It then prints each count's median tok/s and
the default's against the best fixed count of the same run. ``--threads`` takes ``default`` as
a count too (``--threads 1,2,default``). Prefill is skipped with ``--busy``.

Prefill (``--prefill T``, default 512, 0 skips): the same process then loads every expert, and
times Engine.prefill (one forward pass per 1024 positions) over a T-token random prompt with a fresh KV cache -> prefill tok/s and
GFLOP/s = 2 x (attention projections + router + top-k experts) params x T + 2 x lm_head params
(the engine computes logits for the last position only) / s; attention scores (QK^T, PV) are
left out of the count. Next to it, numpy sgemm's GFLOP/s in that process (float32
[T, 2048] @ [2048, 1024]); each child runs with OPENBLAS_NUM_THREADS = its thread count, so
numpy's BLAS (sgemm, and the engine's few numpy matmuls) uses the same number of threads.

PyTorch (when ``import torch, transformers`` works; ``--no-torch`` skips): a further fresh
process builds ``transformers.OlmoeForCausalLM`` from the container's config.json on the meta
device and assigns it the SAME weights, every tensor dequantized from the container (int4/int8
-> float32 -> bfloat16; bfloat16 because float32 needs 27.6 GB for the full model), then per
thread count (torch.set_num_threads) decodes the same prompt greedily (manual loop over the KV
cache, the first 2 steps a warm-up, untimed) and times a T-token prefill. Correctness check: the
argmax of its logits at every position of the decode prompt against our engine's (the first
engine process saves them), the cosine of the last position's logits, and the common prefix of
the two greedy continuations. Random weights give flat logits, so bfloat16 noise can flip some
argmaxes; a wrong weight mapping shows up as near-zero cosine and total disagreement.

``--layers N``: benchmark the first N layers only (a temporary container of symlinks to the
first N layer shards, with num_hidden_layers = N), for quick runs (torch then needs ~1 GB/layer).

Prints numbers; asserts nothing. Timings on a shared machine are noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import core  # noqa: E402,F401  (first: core/__init__.py sets OpenBLAS's spin timeout before numpy loads)
from benchmarks.common import format_summary, machine_summary, ram_read_gbps  # noqa: E402
from benchmarks.families import FP4_EXPERTS, GEOMETRIES, LABELS, default_dir, ensure, geometry  # noqa: E402
from benchmarks.streaming import (DEFAULT_DIR, ensure_container, expert_geometry, lookup_tables,  # noqa: E402
                                 weight_bytes)
from core.arch import KV_CACHES  # noqa: E402


DEFAULT = "default"              # a --threads entry: the engine's own, load-following count
SGEMM_SHAPE = (2048, 1024)      # (I, O) of the sgemm next to prefill: x [T, I] @ W[O, I].T
TORCH_WARMUP = 2                 # untimed decode steps before PyTorch's timed ones
CONTEXT_WARMUP = 2               # untimed decode steps after a --context fill


def sgemm_gflops(T: int, min_time: float = 1.0) -> float:
    """numpy float32 x [T, I] @ W.T [I, O], best of several batches (BLAS threads: the env's)."""
    import numpy as np

    I, O = SGEMM_SHAPE
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, I), dtype=np.float32)
    w = rng.standard_normal((O, I), dtype=np.float32)
    x @ w.T
    best, t_end = float("inf"), time.perf_counter() + min_time
    while time.perf_counter() < t_end or best == float("inf"):
        t0 = time.perf_counter()
        x @ w.T
        best = min(best, time.perf_counter() - t0)
    return 2.0 * T * I * O / best / 1e9


def child(a) -> None:
    import numpy as np

    from models import open_model

    geo = expert_geometry(a.dir)
    if a.int8_activations:
        from core import kernels
        kernels.set_int8_activations(True)
    engine = open_model(a.dir, cap=geo["experts_per_layer"], prefetch=False, threads=a.threads,
                        kv_cache=a.kv_cache)
    from core import kernels
    if a.preload or a.context:
        load_all_experts(engine, geo)
    keep = ("attention_s", "experts_s", "lm_head_s")
    step = linear_step_ms(engine)
    if a.context:
        res = context_decode(a, engine, geo)
        res["threads_used"] = kernels.get_threads()
    else:
        res = prompt_decode(a, engine, geo, keep)
    if a.prefill > 0:
        load_all_experts(engine, geo)                  # every expert resident before timing
        ids = [int(v) for v in np.random.default_rng(a.seed + 1).integers(1, geo["vocab_size"], a.prefill)]
        engine.reset_counters()
        t0 = time.perf_counter()
        engine.prefill(ids, engine.new_cache())        # Engine.PREFILL_CHUNK positions a pass
        dt = time.perf_counter() - t0
        res["prefill"] = {"tokens": a.prefill, "s": dt, "tok_s": a.prefill / dt,
                          **{k: engine.counters[k] for k in keep}}
        res["sgemm_gflops"] = sgemm_gflops(a.prefill)
    if step:
        res["linear_step_ms"] = step
    print(json.dumps(res, default=str))


def linear_step_ms(engine, repeats: int = 20) -> dict | None:
    """One decode position of the first Gated DeltaNet layer's core (conv update, l2norms, gates,
    delta-rule step, gated norm; not its projections), ms: the one compiled call the engine makes
    ("fused"), the compiled pieces one by one (engine.fused_attention False: "pieces") and the
    numpy composition ("numpy"). Best of ``repeats``; None without such a layer."""
    import numpy as np

    from core import kernels
    from core.blocks.linear_attention import GatedDeltaNetMixer

    mixer = next((L.mixer for L in engine.layers if isinstance(L.mixer, GatedDeltaNetMixer)), None)
    if mixer is None:
        return None
    s, rng = mixer.spec, np.random.default_rng(0)
    qkv = rng.standard_normal((1, s.conv_channels), dtype=np.float32)
    z = rng.standard_normal((1, s.v_heads * s.v_dim), dtype=np.float32)
    b, a_ = (rng.standard_normal((1, s.v_heads), dtype=np.float32) for _ in range(2))
    state = {"conv": 0.1 * rng.standard_normal((s.conv_channels, s.conv_kernel - 1), dtype=np.float32),
             "recurrent": 0.1 * rng.standard_normal((s.v_heads, s.k_dim, s.v_dim), dtype=np.float32)}
    qm = kernels.linear_attention_kernels()
    ways = {"numpy": lambda: mixer.core_steps(None, qkv, z, b, a_, state)}
    if qm is not None:
        ways["pieces"] = lambda: mixer.core_steps(qm, qkv, z, b, a_, state)
        ways["fused"] = lambda: qm.gdn_block(qkv, z, b, a_, mixer.conv_w, state["conv"], state["recurrent"],
                                             mixer.dt_bias, mixer.neg_a, mixer.norm_w, mixer.eps, mixer.scale,
                                             s.k_heads, s.v_heads, s.k_dim, s.v_dim)
    out = {}
    for name, f in ways.items():
        f()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t0)
        out[name] = 1e3 * best
    return out


def prompt_decode(a, engine, geo: dict, keep) -> dict:
    """The short case: the --prompt-len prompt decoded through generate() twice (warm-up, timed)."""
    import numpy as np

    from core import kernels
    from core.events import Stats
    from core.sampling import SamplingParams

    prompt = [int(v) for v in np.random.default_rng(a.seed).integers(1, geo["vocab_size"], a.prompt_len)]
    out = {}
    for name in ("warm-up", "timed"):
        first = last = None
        t0 = time.perf_counter()
        for ev in engine.generate(prompt, SamplingParams(greedy=True), max_new_tokens=a.tokens):
            if isinstance(ev, Stats):
                d = ev.as_dict()
                first = d if first is None else first
                last = d
        out[name] = {"wall_s": time.perf_counter() - t0, "first": first, "last": last}
    f, l = out["timed"]["first"], out["timed"]["last"]
    steps = max(1, l["new_tokens"] - 1)
    res = {"tok_s": l["decode_tok_s"], "steps": steps, "hit_rate": l.get("hit_rate"),
           "threads_used": kernels.get_threads(),
           "others_busy": engine.governor.others_busy if engine.governor is not None else None,
           **{k: (l.get(k, 0.0) - f.get(k, 0.0)) / steps for k in keep}}
    if a.ref:
        # reference for the PyTorch check: logits at every prompt position, greedy continuation
        logits = engine.logits(prompt)
        np.savez(a.ref, prompt=np.asarray(prompt), argmax=logits.argmax(axis=1), last=logits[-1],
                 greedy=np.asarray(l.get("ids") or [], dtype=np.int64))
    return res


def load_all_experts(engine, geo: dict) -> None:
    for i, L in enumerate(engine.layers):
        if L.kind == "moe":
            for _ in engine.store.request(i, range(geo["experts_per_layer"])):
                pass


def fill_cache(engine, cache, n: int, how: str, seed: int, vocab: int) -> float:
    """n positions into a fresh cache: 'prefill' (Engine.prefill over n random ids) or
    'synthetic' (random unit-RMS rows written into the arrays the layers' cache kinds keep, at
    their shapes, and a compressor's n // ratio entries and open block; the length set). Seconds
    taken."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    if how == "prefill":
        engine.prefill([int(v) for v in rng.integers(1, vocab, n)], cache)
    else:
        for i in range(len(cache.arrays)):
            cache.ensure(i, n)
            for arr in cache.arrays[i].values():          # [lead, capacity, width]
                for h in range(arr.shape[0]):
                    arr[h, :n] = rng.standard_normal((n, arr.shape[2]), dtype=np.float32)
        for fixed in getattr(cache, "state", ()):            # conv + recurrent state, rings
            for arr in fixed.values():                         # (fixed size: any values, same work)
                arr[...] = 0.1 * rng.standard_normal(arr.shape, dtype=np.float32)
        for i, kinds in enumerate(cache.kinds):
            for kind in kinds:
                if hasattr(kind, "ratio"):     # compressed entries (DeepSeek V4): one per ratio positions
                    m, d, w = kind.ratio, kind.dim, kind.dim * (2 if kind.overlap else 1)
                    rows = rng.standard_normal((n // m, d), dtype=np.float32)
                    kv, gate = (rng.standard_normal((n % m, w), dtype=np.float32) for _ in range(2))
                    prior = tuple(rng.standard_normal((m, d), dtype=np.float32) for _ in range(2)) \
                        if kind.overlap and n >= m else None
                    cache[i][kind.name].commit(0, rows, kv, gate, prior)    # entries, the open block
        cache.length = n
        if hasattr(cache, "folded"):
            cache.folded = [n] * len(cache.folded)             # the state "holds" the n positions
    return time.perf_counter() - t0


def context_decode(a, engine, geo: dict) -> dict:
    """--tokens greedy decode steps after a.context positions (fill_cache), CONTEXT_WARMUP
    untimed steps first; per-step seconds from the engine's counters."""
    import numpy as np

    cache = engine.new_cache()
    fill_s = fill_cache(engine, cache, a.context, a.fill, a.seed + 2, geo["vocab_size"])
    tok = int(np.random.default_rng(a.seed).integers(1, geo["vocab_size"]))
    for _ in range(CONTEXT_WARMUP):
        tok = int(engine.forward([tok], cache)[-1].argmax())
    engine.reset_counters()
    t0 = time.perf_counter()
    for _ in range(a.tokens):
        tok = int(engine.forward([tok], cache)[-1].argmax())
    dt = time.perf_counter() - t0
    keep = ("attention_s", "experts_s", "lm_head_s")
    return {"tok_s": a.tokens / dt, "steps": a.tokens, "fill": a.fill, "fill_s": fill_s,
            "context_end": cache.length, **{k: engine.counters[k] / a.tokens for k in keep}}


def _last_json(r: subprocess.CompletedProcess) -> dict:
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        return {"error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]}
    return json.loads(lines[-1])


def run_child(a, t: int, ref: Path | None = None, context: int = 0) -> dict:
    """One decode measurement in a fresh process; ``t`` a thread count or DEFAULT (none given)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--dir", str(a.dir),
           "--tokens", str(a.tokens), "--prompt-len", str(a.prompt_len), "--seed", str(a.seed),
           "--threads", str(t), "--prefill", str(a.prefill)]
    if context:
        cmd += ["--context", str(context), "--fill", getattr(a, "fill", "synthetic")]
    if getattr(a, "preload", False):
        cmd.append("--preload")
    if ref is not None:
        cmd += ["--ref", str(ref)]
    if a.int8_activations:
        cmd.append("--int8-activations")
    cmd += ["--kv-cache", a.kv_cache]
    env = dict(os.environ)
    if t != DEFAULT:
        env["OPENBLAS_NUM_THREADS"] = str(t)
    return _last_json(subprocess.run(cmd, capture_output=True, text=True, env=env))


# --- PyTorch (transformers) on the same weights ---------------------------------------------------
def torch_model(path: Path, log=print):
    """OlmoeForCausalLM in bfloat16 holding the container's weights (dequantized), built on the
    meta device and filled tensor by tensor, so peak memory stays near the bfloat16 size."""
    import gc

    import numpy as np
    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM
    from transformers.models.olmoe.modeling_olmoe import OlmoeRotaryEmbedding

    from core import quant
    from core.container import Container, tensor_place

    config = OlmoeConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = OlmoeForCausalLM(config).to(torch.bfloat16)
    c = Container(path)

    def deq(name: str) -> np.ndarray:
        w = c.load(name)
        if w.scheme == "int4":
            return quant.dequantize_int4(w.data, w.scales, w.shape[1], w.group_size)
        if w.scheme == "int8":
            return quant.dequantize_int8(w.data, w.scales)
        return np.asarray(w.data, dtype=np.float32)

    def bf16(a: np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(a)).to(torch.bfloat16)

    t0 = time.perf_counter()
    try:
        sd = {}
        for name in c.names():
            if name.endswith(".qs") or tensor_place(name)[1] is not None:
                continue
            sd[name] = bf16(deq(name))
        E, I, H = config.num_experts, config.intermediate_size, config.hidden_size
        for i in range(config.num_hidden_layers):
            gate_up = torch.empty((E, 2 * I, H), dtype=torch.bfloat16)     # [gate; up] per expert
            down = torch.empty((E, H, I), dtype=torch.bfloat16)
            p = f"model.layers.{i}.mlp.experts."
            for e in range(E):
                gate_up[e, :I] = bf16(deq(f"{p}{e}.gate_proj.weight"))
                gate_up[e, I:] = bf16(deq(f"{p}{e}.up_proj.weight"))
                down[e] = bf16(deq(f"{p}{e}.down_proj.weight"))
            sd[p + "gate_up_proj"], sd[p + "down_proj"] = gate_up, down
            gc.collect()
    finally:
        c.close()
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    del sd
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.model.rotary_emb = OlmoeRotaryEmbedding(config)      # non-persistent buffers: off meta
    meta = [n for n, b in model.named_buffers() if b.is_meta]
    if meta:
        raise RuntimeError(f"buffers left on the meta device: {meta[:4]}")
    model.eval()
    log(f"torch model built in {time.perf_counter() - t0:.1f} s "
        f"(attention {model.config._attn_implementation}, experts {model.config._experts_implementation})")
    return model


def torch_child(a) -> None:
    import numpy as np
    import torch

    from core.memory import peak_rss_bytes

    def log(*m):
        print(*m, file=sys.stderr, flush=True)

    model = torch_model(a.dir, log)
    ref = np.load(a.ref) if a.ref else None
    vocab = model.config.vocab_size
    prompt = [int(v) for v in (ref["prompt"] if ref is not None else
                               np.random.default_rng(a.seed).integers(1, vocab, a.prompt_len))]

    def step(ids, cache):
        o = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
        return int(o.logits[0, -1].float().argmax()), o.cache

    res = {"runs": {}, "peak_rss_bytes": 0, "attn": model.config._attn_implementation,
           "experts": model.config._experts_implementation}
    with torch.inference_mode():
        o = model(input_ids=torch.tensor([prompt]), use_cache=False)
        logits = o.logits[0].float().numpy()
        if ref is not None:
            last, rlast = logits[-1].astype(np.float64), ref["last"].astype(np.float64)
            res["check"] = {
                "agree": int((logits.argmax(axis=1) == ref["argmax"]).sum()), "positions": len(prompt),
                "cosine_last": float(last @ rlast / (np.linalg.norm(last) * np.linalg.norm(rlast))),
                "max_abs_last": float(np.abs(last - rlast).max()), "ref_abs_max": float(np.abs(rlast).max())}
        for t in a.threads_list:
            torch.set_num_threads(t)
            tok, cache = step(prompt, None)
            greedy, times = [tok], []
            for k in range(a.tokens - 1 + TORCH_WARMUP):
                t0 = time.perf_counter()
                tok, cache = step([tok], cache)
                if k >= TORCH_WARMUP:
                    times.append(time.perf_counter() - t0)
                greedy.append(tok)
            run = {"tok_s": len(times) / sum(times) if times else 0.0, "steps": len(times)}
            if ref is not None and len(ref["greedy"]):
                g, rg = greedy[: len(ref["greedy"])], ref["greedy"].tolist()
                run["greedy_prefix"] = next((k for k, (x, y) in enumerate(zip(g, rg)) if x != y), len(rg))
                run["greedy_len"] = len(rg)
            if a.prefill > 0:
                ids = [int(v) for v in np.random.default_rng(a.seed + 1).integers(1, vocab, a.prefill)]
                t0 = time.perf_counter()
                step(ids, None)
                run["prefill_tok_s"] = a.prefill / (time.perf_counter() - t0)
            res["runs"][str(t)] = run
            log(f"torch threads {t}: {run}")
    res["peak_rss_bytes"] = peak_rss_bytes()
    print(json.dumps(res, default=str))


def run_torch_child(a, threads: list[int], ref: Path | None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--torch-child", "--dir", str(a.dir),
           "--tokens", str(a.tokens), "--prompt-len", str(a.prompt_len), "--seed", str(a.seed),
           "--threads", ",".join(map(str, threads)), "--prefill", str(a.prefill)]
    if ref is not None and ref.exists():
        cmd += ["--ref", str(ref)]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True)  # its log goes to ours
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        return {"error": f"exit {r.returncode} (see its messages above)"}
    return json.loads(lines[-1])


def torch_available() -> str | None:
    """None when torch and transformers import (in a throwaway process), else why not."""
    r = subprocess.run([sys.executable, "-c", "import torch, transformers; "
                        "from transformers import OlmoeForCausalLM"], capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["import failed"])[-1]


# --- the model ------------------------------------------------------------------------------------
def describe_tables(tables: dict[str, tuple[int, int]]) -> str:
    """"embedding 0.53 GB + 3 index tables 0.019 GB"."""
    emb = sum(t for n, (t, _) in tables.items() if "embed_tokens" in n)
    other = [t for n, (t, _) in tables.items() if "embed_tokens" not in n]
    return f"embedding {emb / 1e9:.2f} GB" + (f" + {len(other)} index table{'s' * (len(other) > 1)} "
                                              f"{sum(other) / 1e9:.3f} GB" if other else "")


def cache_read_bytes(spec, n: float, dtype: str, topk: int | None = None) -> dict[str, int]:
    """Cache bytes one decode step at a context of n positions touches, by kind name: a growing
    kind (KV, latent, index keys) every position; a ring its last min(n, window) positions;
    compressed entries (DeepSeek V4) one per ratio positions -- of which attention reads at most
    ``topk`` where the layer's indexer selects them -- plus the open block's rows, read and written
    back (about the kind's fixed bytes); any other fixed state (conv, recurrent) read and written
    whole."""
    from core import cache_kinds

    out: dict[str, int] = {}
    for entry in spec.cache_kinds:
        kinds = cache_kinds.layer_kinds(entry)
        selects = topk is not None and any(k.name == "indexer" for k in kinds)
        for k in kinds:
            if k.growing:
                b = k.bytes_per_position(dtype) * n
            elif hasattr(k, "window"):
                b = k.fixed_bytes(dtype) * min(n, k.window) / k.window
            elif hasattr(k, "ratio"):
                entries = n // k.ratio
                if selects and k.name != "indexer":
                    entries = min(entries, topk)
                b = entries * k.dim * 4 + k.fixed_bytes(dtype)
            else:
                b = 2 * k.fixed_bytes(dtype)
            out[k.name] = out.get(k.name, 0) + int(b)
    return out


def active_params(path: Path, head_name: str = "lm_head.weight") -> tuple[int, int]:
    """(params a token multiplies through in the decoder layers: attention projections, router,
    top-k experts; lm_head params)."""
    import math

    from core.container import Container, tensor_place

    c = Container(path)
    try:
        top_k = c.config.get("num_experts_per_tok", 8)

        def params(name):
            q = c.quant.get(name)
            return math.prod(q.shape if q is not None else c.index[name][1].shape)

        layer = head = 0
        for name in c.names():
            if name.endswith(".qs") or not name.endswith(".weight") or name.endswith("norm.weight"):
                continue
            li, e = tensor_place(name)
            if name == head_name:
                head = params(name)
            elif li is None:
                continue                                   # embedding: a row lookup
            elif e is None:
                layer += params(name)                      # attention, router, dense MLP
            elif e < top_k:
                layer += params(name)                      # top_k experts' worth (all the same size)
        return layer, head or params("model.embed_tokens.weight")
    finally:
        c.close()


def truncated_copy(path: Path, layers: int) -> Path:
    """A temporary container holding the first ``layers`` layers of ``path``: symlinks to their
    shards and the non-layer shards, a manifest listing only those, num_hidden_layers = layers."""
    from core.container import MANIFEST, Container, tensor_place

    c = Container(path)
    try:
        if not 1 <= layers <= c.config["num_hidden_layers"]:
            raise SystemExit(f"--layers must be 1..{c.config['num_hidden_layers']}")
        keep = []
        for f in c.files:
            places = {tensor_place(n)[0] for n in f.tensors}
            if all(p is None or p < layers for p in places):
                keep.append(f.path.name)
            elif any(p is None or p < layers for p in places):
                raise SystemExit(f"{f.path}: a shard mixes layers below and above {layers}")
        manifest, config = dict(c.manifest), dict(c.config)
    finally:
        c.close()
    out = Path(tempfile.mkdtemp(prefix=f"decode-{layers}L-"))
    manifest["shards"] = [s for s in manifest["shards"] if s in keep]
    manifest["tensors"] = {n: q for n, q in manifest.get("tensors", {}).items()
                           if (tensor_place(n)[0] is None or tensor_place(n)[0] < layers)}
    config["num_hidden_layers"] = layers
    for s in manifest["shards"]:
        (out / s).symlink_to(path.resolve() / s)
    for extra in path.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (
                MANIFEST, "config.json") and not extra.name.startswith("."):
            shutil.copy(extra, out / extra.name)
    (out / MANIFEST).write_text(json.dumps(manifest))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None,
                    help="where the random container is made once and kept (default "
                         f"{DEFAULT_DIR}, or /work/bench_models/NAME-geom-<layers>L with --geometry)")
    ap.add_argument("--model", type=Path, default=None,
                    help="benchmark this container instead (e.g. models/demo/qwen3-moe-demo)")
    ap.add_argument("--geometry", choices=("olmoe",) + tuple(GEOMETRIES), default="olmoe",
                    help="the random container's geometry (benchmarks/families.py): OLMoE-1B-7B "
                         "(default), GLM-4.5-Air, GLM-5, Qwen3.6 or DeepSeek-V4-Flash layers, a few deep")
    ap.add_argument("--context", default="0",
                    help="context lengths to decode at, comma-separated (0: the --prompt-len prompt)")
    ap.add_argument("--fill", choices=("synthetic", "prefill"), default="synthetic",
                    help="how --context positions get into the cache (see the docstring)")
    ap.add_argument("--preload", action="store_true",
                    help="load every expert into RAM before the timed decode (implied by --geometry)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--threads", default="1,2",
                    help="thread counts, comma-separated; 'default' = the engine's load-following count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill", type=int, default=512, help="prefill prompt length (0: skip prefill)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch (transformers) runs")
    ap.add_argument("--layers", type=int, default=0, help="benchmark only the first N layers")
    ap.add_argument("--int8-activations", action="store_true",
                    help="our engine with the opt-in int8-activation kernels (llama.cpp's Q4_0 x Q8_0 kind)")
    ap.add_argument("--kv-cache", choices=KV_CACHES, default="float32",
                    help="our engine's KV cache precision (float16: the opt-in half-precision cache)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="decode runs per thread count, interleaved; medians reported (default 1)")
    ap.add_argument("--busy", type=int, default=0,
                    help="N busy-loop processes during the decode runs; adds the 'default' count")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--torch-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ref", type=Path, default=None, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.child:
        a.threads = None if a.threads == DEFAULT else int(a.threads)
        a.context = int(a.context)
        child(a)
        return 0
    if a.torch_child:
        a.threads_list = [int(v) for v in a.threads.split(",")]
        torch_child(a)
        return 0
    if a.model is not None:          # any container, used as it is
        a.dir = path = a.model.resolve()
    elif a.geometry != "olmoe":
        a.preload = True
        a.dir = a.dir or default_dir(a.geometry)
        path, _, _ = ensure(a.dir, geometry(a.geometry), a.seed, LABELS[a.geometry],
                            fp4_experts=a.geometry in FP4_EXPERTS)
        print(f"geometry: {LABELS[a.geometry]}, {path}")
    else:
        a.dir = a.dir or DEFAULT_DIR
        path, _, _ = ensure_container(a.dir, a.seed)
    tmp = Path(tempfile.mkdtemp(prefix="decode-bench-"))
    try:
        if a.layers:
            path = truncated_copy(path, a.layers)
            a.dir = path
        return bench(a, path, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if a.layers:
            shutil.rmtree(path, ignore_errors=True)


def bench(a, path: Path, tmp: Path) -> int:
    geo = expert_geometry(path)
    tables = lookup_tables(path)
    weights = weight_bytes(geo, tables)
    from models import family_for
    config = json.loads((path / "config.json").read_text())
    spec = family_for(config).spec(config)
    contexts = parse_contexts(getattr(a, "context", "0"))
    a.contexts = contexts
    touched, kv, cache_parts = {}, {}, {}
    for n in contexts:
        cache_parts[n] = cache_read_bytes(spec, mean_context(a, n), a.kv_cache, config.get("index_topk"))
        kv[n] = sum(cache_parts[n].values())
        touched[n] = weights + kv[n]
    layer_params, head_params = active_params(path, spec.layout.head)
    print("machine:")
    print(format_summary(machine_summary(path)))
    n0 = contexts[0]
    print(f"model: {geo['layers']} layers x {geo['experts_per_layer']} experts of "
          f"{geo['expert_bytes'] / 1e6:.2f} MB (top-{geo['top_k']}), dense {geo['dense_bytes'] / 1e9:.2f} GB "
          f"({describe_tables(tables)}, one row each touched); touched per token {touched[n0] / 1e9:.3f} GB = "
          f"weights {weights / 1e9:.3f} + "
          f"{a.kv_cache} cache {kv[n0] / 1e9:.3f} (~{mean_context(a, n0):.0f} positions)")
    if contexts != [0]:
        print_breakdown(path, spec, geo, tables, weights, a, contexts, cache_parts)
    if a.layers:
        print(f"(--layers {a.layers}: the first {a.layers} layers only)")
    threads = [v.strip() if v.strip() == DEFAULT else int(v) for v in a.threads.split(",")]
    if a.repeats < 1 or a.busy < 0:
        print("--repeats must be >= 1 and --busy >= 0", file=sys.stderr)
        return 2
    if a.busy:
        a.prefill = 0
        if DEFAULT not in threads:
            threads.append(DEFAULT)
    busy = start_busy(a.busy)
    try:
        return measure(a, path, tmp, threads, touched, weights, kv, layer_params, head_params, geo,
                       config.get("model_type"))
    finally:
        for p in busy:
            p.kill()
            p.wait()


def parse_contexts(text) -> list[int]:
    out = [int(v) for v in str(text).split(",") if v.strip()]
    if not out or any(n < 0 for n in out):
        raise SystemExit("--context takes context lengths >= 0 (0: the --prompt-len prompt)")
    return out


def mean_context(a, n: int) -> float:
    """The timed decode steps' mean context: the prompt (n = 0) or n filled positions and the
    untimed steps, plus half the timed tokens."""
    return (a.prompt_len if n == 0 else n + CONTEXT_WARMUP) + a.tokens / 2


def print_breakdown(path, spec, geo, tables, weights, a, contexts, cache_parts) -> None:
    """Bytes touched per decoded token, by part, and what each layer's cache keeps."""
    from core import cache_kinds
    from core.container import Container

    c = Container(path)
    try:
        head_name = spec.layout.head
        head = sum(info.nbytes for name, (_, info) in c.index.items() if name in (head_name, head_name + ".qs"))
    finally:
        c.close()
    experts = geo["layers"] * geo["top_k"] * geo["expert_bytes"]
    rows = sum(r for _, r in tables.values())
    rest = weights - experts - head - rows
    kinds = {}
    for entry in spec.cache_kinds:
        key = " + ".join(f"{k.name} {k.bytes_per_position(a.kv_cache)} B" for k in cache_kinds.layer_kinds(entry))
        kinds[key] = kinds.get(key, 0) + 1
    print("bytes touched per decoded token: routed experts "
          f"{geo['layers']} MoE layers x top-{geo['top_k']} x {geo['expert_bytes'] / 1e6:.2f} MB = "
          f"{experts / 1e9:.3f} GB; {head_name} {head / 1e9:.3f} GB; other dense (attention, dense / shared "
          f"MLPs, routers, norms) {rest / 1e9:.3f} GB; a row of each lookup table {rows / 1e3:.1f} kB")
    print(f"cache per position ({a.kv_cache}): {cache_kinds.bytes_per_position(spec.cache_kinds, a.kv_cache)} B = "
          + ", ".join(f"{n} layer{'s' * (n > 1)} x ({k})" for k, n in kinds.items()))
    fixed = {k.name: k for e in spec.cache_kinds for k in cache_kinds.layer_kinds(e)
             if not k.growing and not hasattr(k, "window") and not hasattr(k, "ratio")}
    whole = cache_kinds.fixed_bytes([k for e in spec.cache_kinds for k in cache_kinds.layer_kinds(e)
                                     if k.name in fixed], a.kv_cache)
    if whole:
        print(f"fixed state (linear layers, whatever the context): {cache_kinds.describe(spec.cache_kinds, a.kv_cache)}"
              f"; read + written each step: 2 x {whole:,} B = {2 * whole / 1e9:.4f} GB per token "
              "(in the cache column below)")
    for n in contexts:
        parts = cache_parts[n]
        print(f"  context {n or f'{a.prompt_len}-token prompt'}: mean {mean_context(a, n):.0f} positions "
              f"-> cache {sum(parts.values()) / 1e9:.3f} GB read per token"
              + (f" ({', '.join(f'{k} {v / 1e6:.2f} MB' for k, v in parts.items())})" if len(parts) > 1 else "")
              + f"; touched {(weights + sum(parts.values())) / 1e9:.3f} GB")


def start_busy(n: int) -> list[subprocess.Popen]:
    """n processes that each keep one core busy (a Python loop), as a desktop's other programs do."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    if procs:
        time.sleep(1.0)     # running before the first measurement
    return procs


def _bw_threads(t) -> int:
    if t == DEFAULT:
        from core.kernels import default_threads
        return default_threads()
    return t


def measure(a, path, tmp, threads, touched, weights, kv, layer_params, head_params, geo,
            model_type="olmoe") -> int:
    if a.busy:
        print(f"(--busy {a.busy}: {a.busy} busy-loop process(es) run during the decode runs)")
    ref = tmp / "engine_ref.npz"
    contexts = a.contexts
    show = contexts != [0]           # a context column (absent from the default tables)
    pre = (lambda n: f"{n:>7} ") if show else (lambda n: "")
    hpre = f"{'context':>7} " if show else ""
    rows, runs = [], {(n, t): [] for n in contexts for t in threads}
    for rep in range(a.repeats):
        for n in contexts:
            # prefill once: in the first run of each thread count
            later = argparse.Namespace(**{**vars(a), "prefill": 0}) if rep or n != contexts[0] else a
            for t in threads:
                bw = ram_read_gbps(_bw_threads(t))
                res = run_child(later, t, ref if not rows and not rep and t != DEFAULT and n == 0 else None,
                                context=n)
                bw = max(bw, ram_read_gbps(_bw_threads(t)))
                if "error" in res:
                    print(f"{'context ' + str(n) + ', ' if show else ''}threads {t}: FAILED: {res['error']}")
                    continue
                runs[n, t].append((res["tok_s"], bw, res.get("threads_used")))
                if not rep:
                    rows.append((t, res, bw, bw * 1e9 / touched[n], n))
    print(f"\n{hpre}{'threads':>7} {'tok/s':>7} {'RAM GB/s':>9} {'bound tok/s':>12} {'ratio':>6} "
          f"{'eff. GB/s':>9} {'attn ms':>8} {'experts ms':>10} {'lm_head ms':>10} {'other ms':>9}"
          + (f" {'fill s':>7}" if show else ""))
    for t, r, bw, bound, n in rows:
        step = 1e3 / r["tok_s"]
        parts = [1e3 * r[k] for k in ("attention_s", "experts_s", "lm_head_s")]
        print(f"{pre(n)}{t!s:>7} {r['tok_s']:7.2f} {bw:9.1f} {bound:12.1f} {r['tok_s'] / bound:6.2f} "
              f"{r['tok_s'] * touched[n] / 1e9:9.1f} {parts[0]:8.1f} {parts[1]:10.1f} {parts[2]:10.1f} "
              f"{step - sum(parts):9.1f}"
              + ((f" {r['fill_s']:7.1f}" if "fill_s" in r else f" {'-':>7}") if show else ""))
    print("(second run's decode steps, experts resident; eff. GB/s = tok/s x bytes touched per "
          "token; per-step ms from the engine's Stats, 'other' = the rest of a step)")
    steps = [(t, n, r["linear_step_ms"]) for t, r, _, _, n in rows if r.get("linear_step_ms")]
    if steps:
        print(f"\nGated DeltaNet core, one decode position of one layer (ms, best of 20; projections "
              f"not included): {hpre}threads, " + ", ".join(steps[0][2]))
        for t, n, st in steps:
            print(f"  {pre(n)}{t!s:>7} " + "  ".join(f"{k} {v:.3f}" for k, v in st.items())
                  + (f"  (numpy / fused {st['numpy'] / st['fused']:.1f}x)" if "fused" in st else ""))
        print("(fused: the one compiled call decode makes; pieces: the compiled steps one by one, "
              "engine.fused_attention False; numpy: the reference composition)")
    if show:
        print(f"(context 0: the {a.prompt_len}-token prompt; N > 0: {a.tokens} steps after N cached "
              f"positions ({a.fill} fill, fill s = its time) and {CONTEXT_WARMUP} untimed steps)")
    if a.repeats > 1:
        print(f"\n{hpre}{'threads':>7} {'runs':>4} {'median tok/s':>12} {'median RAM GB/s':>15} "
              f"{'median ratio':>12} {'ratios (run order)':>s}")
        for n in contexts:
            for t in threads:
                ratios = [tok * touched[n] / (bw * 1e9) for tok, bw, _ in runs[n, t]]
                if ratios:
                    print(f"{pre(n)}{t!s:>7} {len(ratios):4d} {statistics.median(r[0] for r in runs[n, t]):12.2f} "
                          f"{statistics.median(r[1] for r in runs[n, t]):15.1f} "
                          f"{statistics.median(ratios):12.2f} {' '.join(f'{r:.2f}' for r in ratios)}")
        print("(each run's ratio against the bandwidth measured around it; thread counts "
              "alternate between runs)")
    n0 = contexts[0]
    if DEFAULT in threads and runs[n0, DEFAULT]:
        fixed = {t: statistics.median(r[0] for r in runs[n0, t]) for t in threads if t != DEFAULT and runs[n0, t]}
        got = statistics.median(r[0] for r in runs[n0, DEFAULT])
        used = [r[2] for r in runs[n0, DEFAULT]]
        print(f"\ndefault threads (load-following; used {', '.join(map(str, used))}): median "
              f"{got:.2f} tok/s" + (f" = {got / max(fixed.values()):.2f} x the best fixed count "
                                    f"({max(fixed, key=fixed.get)} threads, {max(fixed.values()):.2f} "
                                    f"tok/s)" if fixed else "")
              + (f", with {a.busy} busy process(es)" if a.busy else ""))

    tres = None
    if a.no_torch:
        print("\nPyTorch: skipped (--no-torch)")
    elif model_type != "olmoe":
        print(f"\nPyTorch: skipped (the side-by-side builds OlmoeForCausalLM; this is {model_type})")
    elif (why := torch_available()) is not None:
        print(f"\nPyTorch: skipped (torch/transformers not importable: {why}; install the oracle extra)")
    else:
        n = _total_params(path)
        print(f"\nPyTorch: transformers OlmoeForCausalLM, bfloat16: {n / 1e9:.2f} G params = "
              f"{2 * n / 1e9:.1f} GB (float32 would need {4 * n / 1e9:.1f} GB), the same weights "
              f"dequantized from the container; building it ...", flush=True)
        tres = run_torch_child(a, [t for t in threads if t != DEFAULT], ref)
        if "error" in tres:
            print(f"PyTorch: FAILED: {tres['error']}")
            tres = None
        else:
            print(f"PyTorch: attention {tres['attn']}, experts {tres['experts']}, "
                  f"peak RSS {tres['peak_rss_bytes'] / 2**30:.1f} GiB")
            ck = tres.get("check")
            if ck:
                print(f"check vs our engine ({a.prompt_len}-token prompt): argmax agrees at "
                      f"{ck['agree']}/{ck['positions']} positions; last-position logits cosine "
                      f"{ck['cosine_last']:.4f}, max |diff| {ck['max_abs_last']:.3g} "
                      f"(ours max |logit| {ck['ref_abs_max']:.3g})")
                for t, run in tres["runs"].items():
                    if "greedy_prefix" in run:
                        print(f"  threads {t}: greedy continuation identical for the first "
                              f"{run['greedy_prefix']}/{run['greedy_len']} tokens")

    flops_tok = 2 * layer_params
    print(f"\n{hpre}{'threads':>7} {'tok/s':>7} {'bound':>7} {'ratio':>6} {'pf tok/s':>9} {'pf GFLOP/s':>10} "
          f"{'sgemm GFLOP/s':>13} {'pf/sgemm':>8} {'torch tok/s':>11} {'torch pf tok/s':>14}")
    for t, r, bw, bound, n in rows:
        pf = r.get("prefill")
        tr = (tres or {}).get("runs", {}).get(str(t), {})
        if pf:
            gf = (flops_tok * pf["tokens"] + 2 * head_params) / pf["s"] / 1e9
            pcols = f"{pf['tok_s']:9.1f} {gf:10.1f} {r['sgemm_gflops']:13.1f} {gf / r['sgemm_gflops']:8.2f}"
        else:
            pcols = f"{'-':>9} {'-':>10} {'-':>13} {'-':>8}"
        tcols = (f"{tr['tok_s']:11.2f} " + (f"{tr['prefill_tok_s']:14.1f}" if "prefill_tok_s" in tr else f"{'-':>14}")
                 if tr else f"{'-':>11} {'-':>14}")
        print(f"{pre(n)}{t!s:>7} {r['tok_s']:7.2f} {bound:7.1f} {r['tok_s'] / bound:6.2f} {pcols} {tcols}")
    for t, r, bw, bound, n in rows:
        pf = r.get("prefill")
        if pf and a.contexts != [0]:
            print(f"{t!s:>7} threads: prefill of {pf['tokens']} positions {pf['s']:.1f} s (attention "
                  f"{pf['attention_s']:.1f} s, experts {pf['experts_s']:.1f} s, lm_head {pf['lm_head_s']:.2f} s)")
    acts = "int8 activations (opt-in)" if a.int8_activations else "float32 activations"
    print(f"(ours: {geo['expert_scheme']} experts, int4 attention, int8 lm_head, {acts}; pf = one {a.prefill}-token "
          f"prefill, fresh KV cache, every expert resident; GFLOP/s counts 2 x "
          f"{layer_params / 1e9:.3f} G active params per token (attention projections, router, "
          f"top-{geo['top_k']} experts) + the lm_head once, no attention scores; sgemm = numpy float32 "
          f"[{a.prefill}, {SGEMM_SHAPE[0]}] @ [{SGEMM_SHAPE[0]}, {SGEMM_SHAPE[1]}] at the same thread "
          f"count; torch = transformers bfloat16 on the same (dequantized) weights, decode after "
          f"{TORCH_WARMUP} warm-up steps; shared 2-core machine: timings are noisy)")
    return 0


def _total_params(path: Path) -> int:
    import math

    from core.container import Container

    c = Container(path)
    try:
        return sum(math.prod(c.quant[n].shape if n in c.quant else info.shape)
                   for n, (_, info) in c.index.items() if not n.endswith(".qs"))
    finally:
        c.close()


if __name__ == "__main__":
    sys.exit(main())
