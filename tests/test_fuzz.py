"""Mutation fuzzing of a real converted container (issue 16): seeded random damage to shard
headers, the manifest, config.json, generation_config.json, tokenizer_config.json and the usage
history, then the real command line (``coli logits``, in process). Every outcome must be

* one ``coli: error:`` line and exit 1, or
* exit 0 with finite logits -- identical to the pristine container's for every mutation that is
  not a config value (headers, the manifest, side files, the usage history: placement and
  metadata decide speed, never output);

never exit 2, a traceback, a hang or NaN logits; and mutated converter inputs (config, side files,
source headers) convert to a container that opens or are refused cleanly, leaving no
complete-looking output. ``--fuzz-seconds`` (default 25; the converter part a third of it) bounds the run,
``--fuzz-seed`` picks other mutations; failures print the seed and case to replay.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import signal
import sys
import time

import numpy as np
import pytest

from colibri_tui.cli import main as coli
from core.container import MANIFEST
from tests.conftest import tiny_config, tokenizer_files, write_hf_model

DEFAULT_SEED = 20261201
CASE_TIMEOUT_S = 20
IDS = "1,2,3,4,5"
TARGETS = ("header_bytes", "header_json", "header_json_nodigest", "manifest", "config",
           "generation_config", "tokenizer_config", "usage")
WEIRD = [0, -1, 1, 2, 3.5, -0.0, 1e300, float("nan"), float("inf"), "", "x", "64", [], [1, 2],
         {}, {"a": 1}, None, True, False, 2 ** 31, 2 ** 63]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    src = write_hf_model(d / "src", tiny_config(num_experts=4))
    tokenizer_files(src, 97)
    assert coli(["convert", str(src), str(d / "c"), "--bits", "4"]) == 0
    out = d / "ref.npy"
    assert coli(["logits", "--model", str(d / "c"), "--ids", IDS, "--out", str(out), "--threads", "1",
                 "--cap", "2"]) == 0
    return d / "c", np.load(out)


def _header(data: bytes) -> tuple[int, dict]:
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8: 8 + n])


def _mutate_value(rng: random.Random, v):
    """Another value: a weird one, or a nearby one of the same kind."""
    if rng.random() < 0.5 or not isinstance(v, (int, float, list, str)) or isinstance(v, bool):
        return rng.choice(WEIRD)
    if isinstance(v, list):
        v = list(v)
        if v and rng.random() < 0.5:
            k = rng.randrange(len(v))
            v[k] = _mutate_value(rng, v[k])
        elif v and rng.random() < 0.5:
            v.pop(rng.randrange(len(v)))
        else:
            v.append(rng.choice(WEIRD))
        return v
    if isinstance(v, str):
        return v[:-1] if v and rng.random() < 0.5 else v + rng.choice(["0", " ", ".", "_"])
    return v + rng.choice([-1, 1, 8, -8]) if isinstance(v, int) else v * rng.choice([0.5, 2.0, -1.0])


def _mutate_json(rng: random.Random, obj, depth: int = 0):
    """One change somewhere in a JSON value: replace, delete or add a key, or mutate a leaf."""
    if isinstance(obj, dict) and obj:
        key = rng.choice(sorted(obj, key=str))
        r = rng.random()
        if r < 0.15:
            del obj[key]
        elif r < 0.25:
            obj[key + "_x"] = rng.choice(WEIRD)
        elif isinstance(obj[key], (dict, list)) and obj[key] and rng.random() < 0.7 and depth < 4:
            _mutate_json(rng, obj[key], depth + 1)
        else:
            obj[key] = _mutate_value(rng, obj[key])
    elif isinstance(obj, list) and obj:
        k = rng.randrange(len(obj))
        if isinstance(obj[k], (dict, list)) and obj[k] and rng.random() < 0.7 and depth < 4:
            _mutate_json(rng, obj[k], depth + 1)
        else:
            obj[k] = _mutate_value(rng, obj[k])
    return obj


def _diff(a, b, path="") -> list[str]:
    """Where two JSON values differ, as 'path: old -> new' (for failure messages)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in b:
                out.append(f"{path}/{k}: deleted")
            elif k not in a:
                out.append(f"{path}/{k}: added {b[k]!r}"[:200])
            else:
                out += _diff(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b or (a != a and b != b) else [f"{path}: {a!r} -> {b!r}"[:200]]


def _mutate_json_file(rng: random.Random, path) -> str:
    data = json.loads(path.read_text())
    before = json.loads(json.dumps(data))
    _mutate_json(rng, data)
    path.write_text(json.dumps(data))
    return f"{path.name}: {_diff(before, data)}"


def _rewrite_header(shard, data: bytes, n: int, header: dict, before: dict, delta: int) -> str:
    """The shard with ``header`` in place of its old one (``n`` bytes), the data unchanged and
    the length field off by ``delta``."""
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    shard.write_bytes((len(blob) + delta).to_bytes(8, "little") + blob + data[8 + n:])
    return f"{shard.name} header: {_diff(before, header)} (length field {delta:+d})"


def _edit_manifest(d, change):
    m = json.loads((d / MANIFEST).read_text())
    change(m)
    (d / MANIFEST).write_text(json.dumps(m))


def mutate(rng: random.Random, d, target: str) -> str:
    """Damage the container copy in ``d``; returns what was done (for the failure message)."""
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    if target == "header_bytes":
        s = d / rng.choice(shards)
        data = bytearray(s.read_bytes())
        n = int.from_bytes(data[:8], "little")
        k = rng.randrange(8 + n)
        data[k] = rng.randrange(256)
        s.write_bytes(bytes(data))
        return f"{s.name} byte {k} := {data[k]}"
    if target in ("header_json", "header_json_nodigest"):
        if target == "header_json_nodigest":          # an older container: the validator alone
            _edit_manifest(d, lambda m: m.pop("checksums", None))
        s = d / rng.choice(shards)
        data = s.read_bytes()
        n, header = _header(data)
        before = json.loads(json.dumps(header))
        _mutate_json(rng, header)
        if rng.random() < 0.2 and len(header) > 1:    # two tensors on one byte range
            a, b = rng.sample(sorted(k for k in header if k != "__metadata__"), 2)
            if isinstance(header[a], dict) and isinstance(header[b], dict):
                header[b] = dict(header[b], data_offsets=header[a].get("data_offsets"))
        return _rewrite_header(s, data, n, header, before, rng.choice([0, 0, 0, -1, -2, -3, 1]))
    if target == "manifest":
        return _mutate_json_file(rng, d / MANIFEST)
    if target in ("config", "generation_config", "tokenizer_config"):
        return _mutate_json_file(rng, d / f"{target}.json")
    if target == "usage":
        p = d / ".coli_usage"
        lines = ["-1 2 4", "-2 1 7"] + [f"{rng.randrange(-2, 3)} {rng.randrange(-1, 5)} "
                                        f"{rng.choice(['1', '7', '1e308', 'inf', 'nan', '-3', 'x', '0.5'])}"
                                        for _ in range(rng.randrange(1, 6))]
        if rng.random() < 0.3:
            p.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))))
            return "usage := random bytes"
        rng.shuffle(lines)
        p.write_text("\n".join(lines) + "\n")
        return "usage := " + " | ".join(lines)
    raise AssertionError(target)


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: int):
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def fire(*_):
        raise _Timeout()
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_case(container, out) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
            _deadline(CASE_TIMEOUT_S):
        try:
            rc = coli(["logits", "--model", str(container), "--ids", IDS, "--out", str(out),
                       "--threads", "1", "--cap", "2"])
        except _Timeout:
            rc = "hang"
        except BaseException as e:                          # noqa: BLE001 - that is the finding
            rc = f"raised {e.__class__.__name__}: {e}"
    return rc, err.getvalue()


def test_mutations_give_identical_output_or_one_clean_error(pristine, tmp_path, request):
    container, ref = pristine
    seed = request.config.getoption("--fuzz-seed") or DEFAULT_SEED
    budget = request.config.getoption("--fuzz-seconds")
    rng = random.Random(seed)
    t_end = time.monotonic() + budget
    outcomes = {t: {"same": 0, "error": 0, "changed": 0} for t in TARGETS}
    failures, case = [], 0
    os.environ.pop("COLI_DEBUG", None)
    while time.monotonic() < t_end and len(failures) < 5:
        case += 1
        target = TARGETS[case % len(TARGETS)]
        d = tmp_path / f"case{case % 2}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(container, d)
        what = mutate(rng, d, target)
        out = tmp_path / "l.npy"
        out.unlink(missing_ok=True)
        rc, err = run_case(d, out)
        lines = err.strip().splitlines()
        where = f"seed {seed} case {case} ({target}): {what}"
        if rc == 1:
            # warnings (an ignored usage history) may precede the error line; nothing else
            others = [l for l in lines if not l.startswith("coli: warning:")]
            if len(others) != 1 or not others[0].startswith("coli: error:") or "internal error" in err:
                failures.append(f"{where}\n  exit 1 without one clean line: {lines[-3:]}")
            outcomes[target]["error"] += 1
            continue
        if rc != 0:
            failures.append(f"{where}\n  outcome {rc!r}: {lines[-3:]}")
            continue
        if "Traceback" in err or any(not l.startswith(("coli: warning:", "colibri:")) for l in lines
                                     if l.startswith("coli")):
            failures.append(f"{where}\n  exit 0 but stderr: {lines[-3:]}")
        logits = np.load(out)
        if not np.isfinite(logits).all():
            failures.append(f"{where}\n  NaN/inf logits")
        elif logits.shape == ref.shape and np.array_equal(logits, ref):
            outcomes[target]["same"] += 1
        elif target == "config":
            outcomes[target]["changed"] += 1        # a valid config value may change the model
        else:
            failures.append(f"{where}\n  different logits from a change that is not a config value")
    print(f"\nfuzz: seed {seed}, {case} cases in {budget:.0f} s: " +
          ", ".join(f"{t} {o['same']} same / {o['error']} refused / {o['changed']} changed"
                    for t, o in outcomes.items()))
    assert not failures, "\n".join(failures)
    assert case >= len(TARGETS)


# --- converter inputs -----------------------------------------------------------------------------
SOURCE_TARGETS = ("config", "generation_config", "tokenizer_config", "source_header")


@pytest.fixture(scope="module")
def pristine_source(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz-src")
    src = write_hf_model(d / "src", tiny_config(num_experts=4, num_hidden_layers=1), shards=2)
    tokenizer_files(src, 97)
    return src


def mutate_source(rng: random.Random, src, target: str) -> str:
    if target == "source_header":
        s = src / rng.choice(sorted(p.name for p in src.glob("*.safetensors")))
        data = s.read_bytes()
        n, header = _header(data)
        before = json.loads(json.dumps(header))
        _mutate_json(rng, header)
        return _rewrite_header(s, data, n, header, before, rng.choice([0, 0, -1, -3]))
    return _mutate_json_file(rng, src / f"{target}.json")


def test_converter_inputs_convert_cleanly_or_are_refused(pristine_source, tmp_path, request):
    """Mutated Hugging Face sources: `coli convert` either writes a container that opens and gives
    finite logits, or refuses with one clean line and leaves no complete-looking container."""
    seed = (request.config.getoption("--fuzz-seed") or DEFAULT_SEED) + 1
    case = _fuzz_convert(pristine_source, SOURCE_TARGETS, seed, request.config.getoption("--fuzz-seconds") / 3,
                         tmp_path, "converter inputs")
    assert case >= len(SOURCE_TARGETS)


FAMILY_FIXTURES = ("glm4moe-a", "deepseekv3-b", "glmdsa-b",   # every config reader of issue 17
                   "qwen35moe-a", "qwen35moe-b",                  # and issue 18 (text-only, composite)
                   "kimilinear-a", "kimilinear-b")                # kimi_linear (1-indexed linear_attn_config)


@pytest.mark.parametrize("name", FAMILY_FIXTURES)
def test_family_configs_convert_cleanly_or_are_refused(name, tmp_path, request):
    """The same for the newer families' config readers (MLA sizes, routers' groups, DSA's
    indexer_types / index_topk_pattern, mlp_layer_types, partial RoPE): mutated config.json of
    a real tiny transformers checkpoint of each."""
    from tests.conftest import COMMITTED
    seed = (request.config.getoption("--fuzz-seed") or DEFAULT_SEED) + 7 + FAMILY_FIXTURES.index(name)
    case = _fuzz_convert(COMMITTED / name / "model", ("config",), seed,
                         request.config.getoption("--fuzz-seconds") / 6, tmp_path, f"{name} config")
    assert case >= 1


def _fuzz_convert(pristine, targets, seed: int, budget: float, tmp_path, label: str) -> int:
    rng = random.Random(seed)
    t_end = time.monotonic() + budget
    failures, case, counts = [], 0, {"converted": 0, "refused": 0}
    while time.monotonic() < t_end and len(failures) < 5:
        case += 1
        target = targets[case % len(targets)]
        src, out = tmp_path / f"src{case % 2}", tmp_path / f"out{case % 2}"
        for d in (src, out):
            shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(pristine, src)
        what = mutate_source(rng, src, target)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
                _deadline(CASE_TIMEOUT_S):
            try:
                rc = coli(["convert", str(src), str(out)])
            except _Timeout:
                rc = "hang"
            except BaseException as e:                      # noqa: BLE001 - that is the finding
                rc = f"raised {e.__class__.__name__}: {e}"
        where = f"seed {seed} case {case} ({target}): {what}"
        lines = [l for l in err.getvalue().strip().splitlines() if not l.startswith("coli: warning:")]
        if rc == 1:
            counts["refused"] += 1
            if [l for l in lines if l.startswith("coli")] != lines[-1:] or not lines[-1].startswith("coli: error:") \
                    or "internal error" in lines[-1]:
                failures.append(f"{where}\n  exit 1 without one clean line: {lines[-3:]}")
            if (out / MANIFEST).exists():
                failures.append(f"{where}\n  refused, but a complete-looking container was left")
            continue
        if rc != 0:
            failures.append(f"{where}\n  convert outcome {rc!r}: {lines[-3:]}")
            continue
        counts["converted"] += 1
        rc2, err2 = run_case(out, tmp_path / "l.npy")
        if rc2 == 1:
            other = [l for l in err2.strip().splitlines() if not l.startswith("coli: warning:")]
            if len(other) != 1 or not other[0].startswith("coli: error:") or "internal error" in err2:
                failures.append(f"{where}\n  converted, then logits exit 1 unclean: {other[-3:]}")
        elif rc2 != 0:
            failures.append(f"{where}\n  converted, then logits {rc2!r}: {err2.strip().splitlines()[-3:]}")
        elif not np.isfinite(np.load(tmp_path / "l.npy")).all():
            failures.append(f"{where}\n  converted, then NaN/inf logits")
    print(f"\nfuzz ({label}): seed {seed}, {case} cases in {budget:.0f} s: {counts}")
    assert not failures, "\n".join(failures)
    return case
