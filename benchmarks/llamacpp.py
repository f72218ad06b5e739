"""llama.cpp's llama-bench beside our engine on the same geometry, interleaved (issue 5).

    python benchmarks/llamacpp.py --llama-bench PATH --gguf FILE [FILE ...] [--threads 1,2]
                                  [--prompt 512] [--gen 64] [--rounds 2] [--layers N] [--vocab N]
                                  [--dir DIR] [--lock FILE]

You supply a built ``llama-bench`` and GGUF files (this script builds and downloads nothing). For
each round, thread count and file it runs ``llama-bench -o json -p PROMPT -n GEN -t T`` and, next
to it, our engine on a random-weight container with the same geometry (OLMoE-1B-7B's layer
shapes; layer count and vocabulary taken from the first GGUF unless ``--layers`` / ``--vocab``
say otherwise), timed by benchmarks/decode.py's child (decode GEN greedy tokens after a warm-up
run, then one PROMPT-token prefill). The order flips every round, because this VM drifts 10-40 %
between runs minutes apart: only interleaved figures compare.

Speed does not depend on the weights' values, only on the bytes a token reads and the work per
byte, so random weights are enough. Bytes per decoded token are counted the same way for both:
every tensor once, the expert tensors for top-k of n experts only, one row of the embedding.
For a GGUF they come from the file's own tensor table (its quantization types as stored); for
ours from the container (int4-g64 layers, int8 lm_head). Ratio = decode tok/s x bytes per token
/ numpy read bandwidth at the same thread count (benchmarks/common.py, best of the run).

``--lock FILE`` holds an exclusive flock on FILE around each timed run, so that benchmarks of
other people on a shared machine do not overlap ours. Prints numbers; asserts nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROG = "llamacpp.py"


def fail(msg: str) -> SystemExit:
    """A one-line error and a non-zero exit, no traceback (bad input is not a bug)."""
    return SystemExit(f"{PROG}: error: {msg}")


def log(*m) -> None:
    print(*m, file=sys.stderr, flush=True)


# --- GGUF: enough of the header to count bytes per token ------------------------------------------
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Reader:
    def __init__(self, f):
        self.f = f

    def unpack(self, fmt: str):
        s = struct.Struct("<" + fmt)
        b = self.f.read(s.size)
        if len(b) < s.size:
            raise ValueError("truncated header")
        return s.unpack(b)

    def string(self) -> str:
        (n,) = self.unpack("Q")
        return self.f.read(n).decode("utf-8", "replace")

    def value(self, vtype: int):
        if vtype == 8:
            return self.string()
        if vtype == 9:                                   # array: only its scalar items are kept
            itype, n = self.unpack("IQ")
            if itype in _SCALARS:
                return list(self.unpack(f"{n}{_SCALARS[itype]}"))
            return [self.value(itype) for _ in range(n)]
        return self.unpack(_SCALARS[vtype])[0]


def read_gguf(path: Path) -> dict:
    """{'kv': metadata, 'tensors': {name: (dims, nbytes)}}; a tensor's size is the distance to the
    next tensor's offset (so no table of quantization block sizes is needed; padding < alignment)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise fail(f"{path}: not a GGUF file")
        r = _Reader(f)
        try:
            version, n_tensors, n_kv = r.unpack("IQQ")
            kv = {}
            for _ in range(n_kv):
                key = r.string()
                kv[key] = r.value(r.unpack("I")[0])
            infos = []
            for _ in range(n_tensors):
                name = r.string()
                (nd,) = r.unpack("I")
                dims = r.unpack(f"{nd}Q")
                _, offset = r.unpack("IQ")
                infos.append((offset, name, dims))
        except (ValueError, KeyError, struct.error, MemoryError) as e:
            raise fail(f"{path}: unreadable GGUF header: {e}")
        align = int(kv.get("general.alignment", 32))
        data_start = -(-f.tell() // align) * align
    end = os.path.getsize(path) - data_start
    infos.sort()
    tensors = {}
    for i, (off, name, dims) in enumerate(infos):
        nxt = infos[i + 1][0] if i + 1 < len(infos) else end
        tensors[name] = (dims, nxt - off)
    return {"kv": kv, "tensors": tensors}


def gguf_geometry(g: dict) -> dict:
    kv, t = g["kv"], g["tensors"]
    arch = kv.get("general.architecture", "?")
    emb = t.get("token_embd.weight")
    return {"arch": arch, "layers": int(kv.get(f"{arch}.block_count", 0)),
            "vocab": int(emb[0][1]) if emb and len(emb[0]) > 1 else 0,
            "experts": int(kv.get(f"{arch}.expert_count", 0)),
            "top_k": int(kv.get(f"{arch}.expert_used_count", 0))}


def gguf_touched_bytes(g: dict) -> int:
    """Bytes a decoded token reads: all tensors, top-k/n of the merged expert tensors, one
    embedding row."""
    geo = gguf_geometry(g)
    total = 0
    for name, (dims, nbytes) in g["tensors"].items():
        if "_exps." in name and geo["experts"]:
            total += nbytes * geo["top_k"] // geo["experts"]
        elif name == "token_embd.weight" and geo["vocab"]:
            total += nbytes // geo["vocab"]
        else:
            total += nbytes
    return total


# --- llama.cpp -------------------------------------------------------------------------------------
def llama_bench(binary: Path, gguf: Path, threads: int, prompt: int, gen: int, reps: int) -> dict:
    """{'pp': prefill tok/s, 'tg': decode tok/s, 'model_type': ...} from one llama-bench run."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen),
           "-r", str(reps), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    try:
        rows = json.loads(r.stdout)
    except json.JSONDecodeError:
        rows = None
    if r.returncode or not rows:
        why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        return {"error": f"llama-bench failed: {why}"}
    out = {"model_type": rows[0].get("model_type", "?"), "build": rows[0].get("build_commit", "?")}
    for row in rows:
        out["tg" if row.get("n_gen") else "pp"] = float(row["avg_ts"])
    return out


# --- our engine -------------------------------------------------------------------------------------
def our_container(directory: Path | None, layers: int, vocab: int, seed: int = 0) -> Path:
    """benchmarks/streaming.py's OLMoE-geometry random container with ``layers`` layers and a
    ``vocab``-row embedding / lm_head, made once and reused."""
    from benchmarks.streaming import DEFAULT_DIR, OLMOE_GEOMETRY
    from core.synthetic import container_bytes, write_random_container
    from models import family_for

    config = dict(OLMOE_GEOMETRY, num_hidden_layers=layers, vocab_size=vocab)
    directory = directory or DEFAULT_DIR.parent / f"olmoe-geom-{layers}L-v{vocab}"   # beside decode.py's
    if not (directory / "colibri.json").exists():
        log(f"generating our random container: {container_bytes(config, family_for(config))['total'] / 1e9:.2f} GB "
            f"into {directory}")
    directory.parent.mkdir(parents=True, exist_ok=True)
    write_random_container(directory, config, family_for(config), seed=seed)   # returns at once when already made
    return directory


def our_touched_bytes(path: Path) -> int:
    """As benchmarks/decode.py counts it: top-k experts per layer + dense tensors, one embedding row."""
    from benchmarks.streaming import expert_geometry, lookup_tables, weight_bytes

    return weight_bytes(expert_geometry(path), lookup_tables(path))


OURS, OURS_INT8 = "int4-g64 (ours)", "int4-g64 x int8 act (ours)"


def our_bench(path: Path, threads: int, prompt: int, gen: int, int8: bool = False) -> dict:
    """decode.py's child in a fresh process: {'pp', 'tg'} tok/s (int8: the opt-in int8
    activations, the precision class of llama.cpp's Q4_0 x Q8_0 products)."""
    from benchmarks.decode import build_parser, run_child

    a = build_parser().parse_args([])       # decode.py's defaults for every option it has
    a.dir, a.tokens, a.prompt_len, a.prefill, a.int8_activations = path, gen, 8, prompt, int8
    r = run_child(a, threads)
    if "error" in r:
        return {"error": f"our engine failed: {r['error']}"}
    return {"tg": r["tok_s"], "pp": (r.get("prefill") or {}).get("tok_s", float("nan"))}


# --- the run --------------------------------------------------------------------------------------
@contextlib.contextmanager
def locked(path: Path | None):
    """Hold an exclusive flock on ``path`` (if given) while timing."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_inputs(a) -> None:
    if not a.llama_bench.is_file() or not os.access(a.llama_bench, os.X_OK):
        raise fail(f"--llama-bench {a.llama_bench}: not an executable file")
    for g in a.gguf:
        if not g.is_file():
            raise fail(f"--gguf {g}: no such file")
    try:
        a.threads_list = [int(v) for v in a.threads.split(",")]
    except ValueError:
        raise fail(f"--threads {a.threads!r}: want comma-separated integers, e.g. 1,2")
    if a.lock is not None and not a.lock.parent.is_dir():
        raise fail(f"--lock {a.lock}: its folder does not exist")
    if min(a.threads_list) < 1 or a.prompt < 1 or a.gen < 2 or a.rounds < 1:
        raise fail("--threads, --prompt and --rounds must be >= 1, --gen >= 2")


def measure(a, ggufs: list[dict], ours: Path) -> tuple[dict, dict]:
    """results[(engine, label, threads)] = [per-round dicts]; bandwidth[threads] = best GB/s."""
    from benchmarks.common import ram_read_gbps

    jobs = [("ours", None)] + ([("ours", "int8")] if a.int8_activations else []) \
        + [("llama.cpp", g) for g in ggufs]
    results, bandwidth = {}, {}
    for rnd in range(a.rounds):
        for t in a.threads_list:
            with locked(a.lock):
                bandwidth[t] = max(bandwidth.get(t, 0.0), ram_read_gbps(t))
            for engine, g in (jobs if rnd % 2 == 0 else jobs[::-1]):    # flip order: drift cancels
                with locked(a.lock):
                    if engine == "ours":
                        r = our_bench(ours, t, a.prompt, a.gen, int8=g == "int8")
                    else:
                        r = llama_bench(a.llama_bench, g["path"], t, a.prompt, a.gen, a.reps)
                label = OURS if g is None else OURS_INT8 if g == "int8" else g["path"].name
                log(f"round {rnd + 1} threads {t} {engine:9s} {label}: {r}")
                if "error" in r:
                    raise fail(r["error"])
                if engine == "llama.cpp":
                    g["model_type"] = r["model_type"]
                results.setdefault((engine, label, t), []).append(r)
    return results, bandwidth


def print_table(a, results: dict, bandwidth: dict, touched: dict) -> None:
    print(f"\n{'engine':9s} {'file / format':34s} {'threads':>7} {'prefill tok/s':>13} "
          f"{'decode tok/s':>12} {'MB/token':>9} {'eff. GB/s':>9} {'RAM GB/s':>8} {'ratio':>6}  "
          f"decode, each round")
    for (engine, label, t), runs in sorted(results.items(), key=lambda kv: (kv[0][2], kv[0][0] != "ours")):
        pp = max(r["pp"] for r in runs)
        tg = max(r["tg"] for r in runs)
        b = touched[label]
        eff = tg * b / 1e9
        print(f"{engine:9s} {label[:34]:34s} {t:7d} {pp:13.1f} {tg:12.2f} {b / 1e6:9.1f} "
              f"{eff:9.1f} {bandwidth[t]:8.1f} {eff / bandwidth[t]:6.2f}  "
              + " ".join(f"{r['tg']:.1f}" for r in runs))        # the spread shows the noise
    print(f"(best of {a.rounds} interleaved rounds; prefill = {a.prompt}-token prompt, decode = "
          f"{a.gen} tokens; llama-bench -r {a.reps}; MB/token = bytes read per decoded token; "
          f"eff. GB/s = decode tok/s x MB/token; ratio = eff. / numpy read bandwidth at that thread "
          f"count, best of the run)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", type=Path, required=True, help="path of a built llama-bench")
    ap.add_argument("--gguf", type=Path, nargs="+", required=True, help="GGUF file(s) to time")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prompt", type=int, default=512, help="prefill length (llama-bench -p)")
    ap.add_argument("--gen", type=int, default=64, help="decoded tokens (llama-bench -n)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="llama-bench -r")
    ap.add_argument("--layers", type=int, default=0, help="our model's layers (default: the GGUF's)")
    ap.add_argument("--vocab", type=int, default=0, help="our model's vocabulary (default: the GGUF's)")
    ap.add_argument("--dir", type=Path, default=None, help="our container (default: beside decode.py's)")
    ap.add_argument("--lock", type=Path, default=None, help="flock this file around each timed run")
    ap.add_argument("--int8-activations", action="store_true",
                    help="also time our engine with the opt-in int8 activations")
    a = ap.parse_args(argv)
    check_inputs(a)

    ggufs, touched = [], {}
    for path in a.gguf:
        g = read_gguf(path)
        ggufs.append({"path": path, "geo": gguf_geometry(g)})
        touched[path.name] = gguf_touched_bytes(g)
        log(f"{path.name}: {ggufs[-1]['geo']}, {touched[path.name] / 1e6:.1f} MB per decoded token")
    geo = ggufs[0]["geo"]
    layers, vocab = a.layers or geo["layers"], a.vocab or geo["vocab"]
    if layers < 1 or vocab < 1:
        raise fail(f"{a.gguf[0]}: no layer count / vocabulary found; give --layers and --vocab")
    ours = our_container(a.dir, layers, vocab)
    touched[OURS] = touched[OURS_INT8] = our_touched_bytes(ours)
    log(f"ours: {layers} layers, vocab {vocab}, {touched[OURS] / 1e6:.1f} MB per decoded token")

    results, bandwidth = measure(a, ggufs, ours)
    build = next((r[0].get("build") for (e, _, _), r in results.items() if e == "llama.cpp"), "?")
    print(f"llama.cpp build {build}; ours: {ours} ({layers} layers, vocab {vocab}); "
          f"GGUF: " + ", ".join(f"{g['path'].name} = {g.get('model_type', '?')}" for g in ggufs))
    print_table(a, results, bandwidth, touched)
    return 0


if __name__ == "__main__":
    sys.exit(main())
