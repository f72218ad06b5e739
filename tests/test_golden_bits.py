"""Golden bits: sha256 of the engine's outputs, so a refactor can show it changed no bit (issue 17).

Over the ten foundation oracle fixtures (``conftest.FOUNDATION_FIXTURES``, ``--bits 4/8/16``)
and the demo model (int4), for each kernel variant this machine runs -- the compiled kernels
with each SIMD variant forced in turn (``portable``, ``avx2``, ``avx512`` / ``neon``) and the
numpy kernels (``COLI_KERNELS=numpy``, one subprocess for all their cases) -- and each option
mode (the fused decode attention block on and off, the float16 KV cache, int8 activations, and
combinations), it hashes

* ``logits``: teacher-forced logits over 32 ids (one batched pass: the prefill path -- the
  prefill GEMM for int4, the dense kernel for float32, sgemm on the portable variant and the
  numpy kernels -- for the dense matrices, the int4/int8 loops for the experts);
* ``decode``: the logits of a 6-id prompt's prefill and 7 incremental steps fed their argmax
  (the one-position decode paths, the KV cache);
* ``generate``: the ids (and, for the demo model, the text) of ``engine.generate`` with greedy
  sampling, 8 new tokens (the demo: a chat-template prompt).

Bits depend on the machine in known ways (the SIMD variant's summation order, OpenBLAS's CPU
kernel and thread count, numpy's dispatched SIMD loops, libm's expf, the compiler), so the
committed hashes (``tests/golden/hashes.json``) are keyed by a fingerprint of those; where no
hashes match this machine's fingerprint the test skips and says how to record them::

    python -m pytest tests/test_golden_bits.py --golden-record -p no:cacheprovider

Record on the code BEFORE changing it, then change it and run the test without the flag.
The placement law is checked in the same run, with no stored hash: 2 threads and ``--cap 1``
give the bits of 1 thread with every expert resident. See tests/golden/README.md.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
HASHES = ROOT / "tests" / "golden" / "hashes.json"
DEMO = ROOT / "models" / "demo" / "qwen3-moe-demo"
FIXTURES = ROOT / "tests" / "oracle" / "fixtures"
RECORD_CMD = "python -m pytest tests/test_golden_bits.py --golden-record -p no:cacheprovider"

BITS = (4, 8, 16)
DEMO_PROMPT = "Tell me a fortune about a cat."
DEMO_TEXT = "The quick brown fox jumps over the lazy dog. " * 4    # 32 ids: the sgemm path
DECODE_PROMPT, DECODE_STEPS, NEW_TOKENS = 6, 8, 8

# option modes: (fused attention block, KV cache dtype, int8 activations)
MODES = {
    "base": (True, "float32", False),
    "unfused": (False, "float32", False),
    "kv16": (True, "float16", False),
    "kv16-unfused": (False, "float16", False),
    "int8act": (True, "float32", True),
    "int8act-kv16": (True, "float16", True),
}
# the numpy kernels have no compiled attention block and no int8-activation path; int8
# activations change only int4 products, so --bits 8/16 skip those modes
NUMPY_MODES = ("base", "kv16")
# the placement law, checked against the mode's 1-thread all-resident bits
PLACEMENTS = {"threads2": dict(threads=2), "cap1": dict(threads=1, cap=1)}
PLACEMENT_MODES = ("base", "int8act-kv16")
VARIANTS = ("portable", "avx2", "avx512", "neon", "numpy")


# --- the machine's fingerprint -----------------------------------------------------------------

def _openblas_call(what: str):
    """openblas_get_corename / get_num_threads of the OpenBLAS numpy loaded, or None."""
    paths = []
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if "openblas" in ln.lower() and "/" in ln})
    except OSError:
        pass
    base = Path(np.__file__).parent
    for pat in ("../numpy.libs/*openblas*", ".dylibs/*openblas*", "../numpy.libs/*.dll"):
        paths += glob.glob(str(base / pat))
    for p in paths:
        try:
            lib = ctypes.CDLL(p)
        except OSError:
            continue
        for name in (f"scipy_openblas_{what}64_", f"scipy_openblas_{what}", f"openblas_{what}64_",
                     f"openblas_{what}"):
            fn = getattr(lib, name, None)
            if fn is not None:
                if what == "get_corename":
                    fn.restype = ctypes.c_char_p
                    return fn().decode()
                fn.restype = ctypes.c_int
                return int(fn())
    return None


def _compiler_of(path: str | None) -> str | None:
    """The compiler that built the extension, from its .comment section (gcc/clang stamp it)."""
    if not path:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    found = sorted({m.decode(errors="replace") for m in
                    re.findall(rb"(?:GCC: \([^)]*\) [0-9][0-9.]*|clang version [0-9][0-9.]*)", data)})
    return "; ".join(found) or None


def _cpu_flags() -> list[str]:
    want = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
            "avx_vnni", "asimd", "asimdhp", "fphp", "sve"}
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith(("flags", "Features")):
                    return sorted(want & set(ln.split(":", 1)[1].split()))
    except OSError:
        pass
    return []


def fingerprint() -> dict:
    """What the bits depend on besides the code: CPU, numpy and its BLAS, libm, the compiler."""
    from core import kernels
    fp = {"machine": platform.machine(), "system": platform.system(),
          "libc": " ".join(platform.libc_ver()).strip() or None, "numpy": np.__version__,
          "cpu_flags": _cpu_flags()}
    try:
        cfg = np.show_config(mode="dicts")
        blas = cfg["Build Dependencies"]["blas"]
        fp["blas"] = f"{blas.get('name')} {blas.get('version')}"
        simd = cfg.get("SIMD Extensions", {})
        fp["numpy_simd"] = sorted(set(simd.get("baseline") or []) | set(simd.get("found") or []))
    except Exception:               # older numpy: no dict form
        fp["blas"] = None
    fp["blas_core"] = _openblas_call("get_corename")
    fp["blas_threads"] = _openblas_call("get_num_threads")
    for var in ("NPY_DISABLE_CPU_FEATURES", "NPY_ENABLE_CPU_FEATURES", "OPENBLAS_CORETYPE"):
        if os.environ.get(var):
            fp[var] = os.environ[var]
    if kernels.backend() == "cython":
        from cython_kernels import qmatmul
        fp["kernels_compiler"] = _compiler_of(getattr(qmatmul, "__file__", None))
        fp["simd_variants"] = qmatmul.simd_variants()
        fp["openmp"] = kernels.openmp_enabled()
    return fp


def fingerprint_id(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


# --- the cases ---------------------------------------------------------------------------------

def _sha(a) -> str:
    h = hashlib.sha256()
    if isinstance(a, np.ndarray):
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    else:
        h.update(json.dumps(a, sort_keys=True).encode())
    return h.hexdigest()


def _inputs(label: str) -> tuple[list[int], object]:
    """(teacher-forcing ids, the generate prompt) of a model label ("olmoe-a/b4", "demo/b4")."""
    name = label.split("/")[0]
    if name == "demo":
        return None, DEMO_PROMPT
    ids = np.load(FIXTURES / name / "reference.npz")["ids"].tolist()
    return ids, ids[:DECODE_PROMPT]


def _outputs(engine, label: str, generate: bool = True) -> dict[str, str]:
    from core.events import Token
    from core.sampling import SamplingParams
    ids, prompt = _inputs(label)
    if ids is None:                 # the demo: ids from its own tokenizer
        ids = engine.prompt_ids(DEMO_TEXT, raw=True)[:32]
        assert len(ids) == 32
        dec_prompt = engine.prompt_ids(DEMO_PROMPT)
    else:
        dec_prompt = prompt
    out = {"logits": _sha(engine.logits(ids))}
    cache = engine.new_cache()      # the engine's KV precision
    steps = [engine.forward(dec_prompt, cache)[-1]]
    for _ in range(DECODE_STEPS - 1):
        steps.append(engine.forward([int(np.argmax(steps[-1]))], cache)[-1])
    engine.recycle_cache(cache)
    out["decode"] = _sha(np.stack(steps))
    if not generate:
        return out
    toks = [e for e in engine.generate(prompt, SamplingParams(greedy=True), max_new_tokens=NEW_TOKENS)
            if isinstance(e, Token)]
    gen = {"ids": [t.id for t in toks]}
    if label.startswith("demo"):
        gen["text"] = "".join(t.text for t in toks)
    out["generate"] = _sha(gen)
    return out


def _run(path, label, fused, kv, generate=True, **open_kw) -> dict[str, str]:
    from models import open_model
    engine = open_model(path, kv_cache=kv, **{"threads": 1, **open_kw})
    try:
        engine.usage_file = None    # write no routing history into the containers
        engine.fused_attention = fused
        return _outputs(engine, label, generate)
    finally:
        engine.store.close()


def compute(containers: dict[str, str], variant: str) -> tuple[dict[str, str], list[str]]:
    """Hashes of every (model, mode, output) under one kernel variant, and the placement-law
    violations found on the way (machine-independent: they must be empty)."""
    from core import kernels
    hashes, broken = {}, []
    try:
        for label, path in containers.items():
            modes = NUMPY_MODES if variant == "numpy" else tuple(MODES)
            if not label.endswith("/b4"):
                modes = tuple(m for m in modes if not MODES[m][2])
            for mode in modes:
                fused, kv, int8 = MODES[mode]
                kernels.set_int8_activations(int8)
                got = _run(path, label, fused, kv)
                hashes.update({f"{label}/{mode}/{k}": v for k, v in got.items()})
                if mode not in PLACEMENT_MODES:
                    continue
                for pname, kw in PLACEMENTS.items():
                    if variant == "numpy" and "threads" in kw and kw["threads"] != 1:
                        continue    # the numpy path has no thread count of ours
                    other = _run(path, label, fused, kv, generate=False, **kw)
                    broken += [f"{label}/{mode}/{k}: {pname} differs from 1 thread, all resident"
                               for k in other if other[k] != got[k]]
    finally:
        kernels.set_int8_activations(False)
    return hashes, broken


def _numpy_main() -> None:
    """Subprocess entry (COLI_KERNELS=numpy): containers as JSON on stdin, result on stdout."""
    from core import kernels
    assert kernels.backend() == "numpy", kernels.backend()
    containers = json.loads(sys.stdin.read())
    hashes, broken = compute(containers, "numpy")
    print("GOLDEN-RESULT " + json.dumps({"hashes": hashes, "broken": broken,
                                         "fingerprint": fingerprint()}))


# --- the test ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def golden_models(containers, fixture_root):
    """label -> container path: each foundation oracle fixture at --bits 4/8/16, the demo (int4)."""
    from tests.conftest import COMMITTED, FOUNDATION_FIXTURES
    if fixture_root != COMMITTED:
        pytest.skip("--oracle-fresh: fresh random fixtures have no golden hashes")
    # a fixed list: fixtures added later (new families) must not change the recorded hash set
    out = {f"{n}/b{b}": str(containers(n, b)) for n in FOUNDATION_FIXTURES for b in BITS}
    if (DEMO / "colibri.json").exists():
        out["demo/b4"] = str(DEMO)
    return out


def _load() -> dict:
    if HASHES.exists():
        return json.loads(HASHES.read_text())
    return {"format": 1, "machines": {}}


def _git_head() -> str | None:
    """HEAD, with "+dirty" when the engine's code (core, models, cython_kernels) has changes."""
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                                        timeout=10).stdout.strip()
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--", "core", "models", "cython_kernels")
        return (head + ("+dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def _record(fp: dict, variant: str, hashes: dict[str, str]) -> None:
    data = _load()
    entry = data["machines"].setdefault(fingerprint_id(fp), {"fingerprint": fp, "variants": {}})
    entry["fingerprint"] = fp
    entry["variants"][variant] = {"recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                  "code": _git_head(), "hashes": dict(sorted(hashes.items()))}
    HASHES.parent.mkdir(parents=True, exist_ok=True)
    tmp = HASHES.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, HASHES)


def _check(request, variant: str, hashes: dict[str, str], broken: list[str], fp: dict) -> None:
    assert not broken, "the placement law is broken:\n" + "\n".join(broken[:20])
    if request.config.getoption("--golden-record"):
        _record(fp, variant, hashes)
        return
    fid = fingerprint_id(fp)
    entry = _load()["machines"].get(fid)
    recorded = entry and entry["variants"].get(variant)
    if not recorded:
        short = {k: fp.get(k) for k in ("machine", "numpy", "blas", "blas_core", "blas_threads",
                                        "simd_variants", "kernels_compiler")}
        pytest.skip(f"no golden hashes recorded for {variant} on this machine (fingerprint {fid}: "
                    f"{json.dumps(short)}); to record them, on the code BEFORE a change: {RECORD_CMD}")
    want = recorded["hashes"]
    missing = sorted(set(want) - set(hashes))
    differ = sorted(k for k in want if k in hashes and hashes[k] != want[k])
    new = sorted(set(hashes) - set(want))
    if new:
        warnings.warn(f"{len(new)} golden-bits cases have no recorded hash yet (e.g. {new[0]}); "
                      f"re-record on unchanged code: {RECORD_CMD}")
    assert not missing, f"{len(missing)} recorded cases were not computed: {missing[:10]}"
    assert not differ, (f"{len(differ)} of {len(want)} hashes differ from those recorded at "
                        f"{recorded['code']} ({variant}, fingerprint {fid}):\n" + "\n".join(differ[:30]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_golden_bits(variant, golden_models, request, kernel_settings, monkeypatch):
    from core import kernels
    fp = fingerprint()
    if variant == "numpy":
        env = {**os.environ, "COLI_KERNELS": "numpy"}
        p = subprocess.run([sys.executable, "-c", "from tests.test_golden_bits import _numpy_main; "
                            "_numpy_main()"], input=json.dumps(golden_models), cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("GOLDEN-RESULT ")]
        assert p.returncode == 0 and line, f"numpy-kernel subprocess failed:\n{p.stderr[-3000:]}"
        res = json.loads(line[-1].split(" ", 1)[1])
        hashes, broken = res["hashes"], res["broken"]
        sub = res["fingerprint"]
        assert sub == {k: fp.get(k) for k in sub}, f"the subprocess's machine differs: {sub} vs {fp}"
    else:
        if kernels.backend() != "cython":
            pytest.skip("no compiled kernels")
        from cython_kernels import qmatmul
        if variant not in qmatmul.simd_variants():
            pytest.skip(f"this CPU/build runs no {variant} variant ({qmatmul.simd_variants()})")
        monkeypatch.setattr(kernels, "SGEMM_MIN_ROWS", 32)    # COLI_SGEMM_ROWS would move it
        qmatmul.set_simd(variant)
        hashes, broken = compute(golden_models, variant)
    _check(request, variant, hashes, broken, fp)


def _flip_byte(container: Path, tensor: str) -> None:
    """XOR one data byte of ``tensor`` (both nibbles of an int4 byte) in its shard, in place."""
    for shard in sorted(container.glob("*.safetensors")):
        with open(shard, "r+b") as f:
            n = int.from_bytes(f.read(8), "little")
            entry = json.loads(f.read(n)).get(tensor)
            if entry is None:
                continue
            at = 8 + n + entry["data_offsets"][0] + 3
            f.seek(at)
            b = f.read(1)[0]
            f.seek(at)
            f.write(bytes([b ^ 0x11]))
            return
    raise AssertionError(f"{tensor} not found in {container}")


def test_the_hashes_see_one_flipped_weight_byte_and_the_int8_switch(golden_models, tmp_path,
                                                                    kernel_settings):
    """The test can fail: one weight byte of a scratch copy of a converted container, or int8
    activations switched on, change the hashes (machine-independent: no stored hash needed)."""
    import shutil
    from core import kernels
    label = next(k for k in golden_models if k.endswith("/b4") and not k.startswith("demo"))
    variant = "numpy" if kernels.backend() != "cython" else kernels.simd_level()
    pristine, _ = compute({label: golden_models[label]}, variant)
    copy = tmp_path / "c"
    shutil.copytree(golden_models[label], copy)
    _flip_byte(copy, "model.layers.0.self_attn.q_proj.weight")
    damaged, _ = compute({label: str(copy)}, variant)
    for k in pristine:
        if k.endswith(("/logits", "/decode")):
            assert damaged[k] != pristine[k], k
    if variant != "numpy":
        for what in ("logits", "decode"):
            assert pristine[f"{label}/int8act/{what}"] != pristine[f"{label}/base/{what}"]
