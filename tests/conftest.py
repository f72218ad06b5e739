"""Shared test helpers: tiny Hugging Face-format MoE checkpoints written without torch."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from core.safetensors_io import SafetensorsWriter, bf16_from_float32

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "tests" / "oracle" / "fixtures"


def pytest_addoption(parser):
    parser.addoption("--oracle-fresh", action="store_true",
                     help="regenerate the oracle fixtures with fresh seeds (needs the oracle extra) "
                          "and check against those instead of the committed ones")
    parser.addoption("--fuzz-seconds", type=float, default=25.0,
                     help="time budget of the mutation fuzz test (tests/test_fuzz.py)")
    parser.addoption("--fuzz-seed", type=int, default=None,
                     help="seed of the mutation fuzz test (default: a fixed seed)")
    parser.addoption("--golden-record", action="store_true",
                     help="record this machine's golden hashes (tests/test_golden_bits.py) instead of checking them")


def tiny_config(model_type: str = "qwen3_moe", **over) -> dict:
    cfg = dict(model_type=model_type, vocab_size=97, hidden_size=40, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
               rms_norm_eps=1e-6, hidden_act="silu", norm_topk_prob=True, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if model_type == "qwen3_moe":
        cfg.update(moe_intermediate_size=24, intermediate_size=48, head_dim=12)
    else:
        cfg.update(intermediate_size=24)
    cfg.update(over)
    return cfg


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer_files(d: Path, vocab: int = 300) -> int:
    """A real byte-level BPE tokenizer (trained here) with a ChatML template in ``d``; returns
    its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, ciao mondo, the quick brown fox"] * 20, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return tok.get_vocab_size()


def tiny_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights with the Hugging Face names of the supported families."""
    rng = np.random.default_rng(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or H // nh
    qwen = cfg["model_type"] == "qwen3_moe"
    inter = cfg["moe_intermediate_size"] if qwen else cfg["intermediate_size"]
    w = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)
    norm = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    t = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": norm(H)}
    if not cfg.get("tie_word_embeddings"):
        t["lm_head.weight"] = w(V, H)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(H)
        t[p + "post_attention_layernorm.weight"] = norm(H)
        t[p + "self_attn.q_proj.weight"] = w(nh * D, H)
        t[p + "self_attn.k_proj.weight"] = w(nkv * D, H)
        t[p + "self_attn.v_proj.weight"] = w(nkv * D, H)
        t[p + "self_attn.o_proj.weight"] = w(H, nh * D)
        t[p + "self_attn.q_norm.weight"] = norm(D if qwen else nh * D)
        t[p + "self_attn.k_norm.weight"] = norm(D if qwen else nkv * D)
        t[p + "mlp.gate.weight"] = w(cfg["num_experts"], H)
        for e in range(cfg["num_experts"]):
            q = f"{p}mlp.experts.{e}."
            t[q + "gate_proj.weight"] = w(inter, H)
            t[q + "up_proj.weight"] = w(inter, H)
            t[q + "down_proj.weight"] = w(H, inter)
    return t


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "F32") -> None:
    """Write with our writer so BF16 sources can be produced without torch."""
    entries, data = [], {}
    for name, a in tensors.items():
        if dtype == "BF16":
            entries.append((name, "BF16", a.shape))
            data[name] = bf16_from_float32(a)
        else:
            entries.append((name, "F32", a.shape))
            data[name] = a
    w = SafetensorsWriter(path, entries)
    for name, a in data.items():
        w.write(name, a)
    w.commit()


def write_hf_model(directory: Path, cfg: dict, tensors: dict[str, np.ndarray] | None = None,
                   shards: int = 1, dtype: str = "F32", seed: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tensors = tensors if tensors is not None else tiny_tensors(cfg, seed)
    (directory / "config.json").write_text(json.dumps(cfg))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    if shards == 1:
        write_safetensors(directory / "model.safetensors", tensors, dtype)
        return directory
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        write_safetensors(directory / fname, part, dtype)
        weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def tiny_app_container(d: Path, name: str, unreachable_eos: bool = False) -> Path:
    """The small int8 container the app's tests run (3 layers, 8 experts, a real tokenizer),
    converted into d / name. unreachable_eos: generation_config.json names an eos id outside the
    vocabulary, so replies run until max_new_tokens or Esc."""
    from core.converter import convert
    from models import validate_config
    src = d / "src"
    src.mkdir()
    vocab = tokenizer_files(src, 300)
    write_hf_model(src, tiny_config(vocab_size=vocab, num_hidden_layers=3, num_experts=8))
    if unreachable_eos:
        (src / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab + 50}))
    return convert(src, d / name, bits=8, validate_config=validate_config)


async def wait_for(pilot, cond, timeout=20.0):
    """Let a Textual app run (Pilot) until cond() holds; fail after timeout seconds."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out waiting")
        await pilot.pause(0.02)


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """The app's data and config under tmp_path (created), no model or RAM budget from the
    environment: the user's own files are never touched."""
    monkeypatch.setenv("COLI_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("COLI_CONFIG_DIR", str(tmp_path / "config"))
    for k in ("COLI_MODEL", "COLI_RAM_GB"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "config").mkdir(exist_ok=True)
    return tmp_path


def server_env(tmp_path_factory, name: str):
    """For a module-scoped fixture of a server's tests: the app's data, config and log folders
    in a fresh temporary folder, no model or API key from the environment (yields the folder)."""
    d = tmp_path_factory.mktemp(name)
    with pytest.MonkeyPatch.context() as mp:
        for k in ("data", "config", "logs"):
            (d / k).mkdir()
        mp.setenv("COLI_DATA_DIR", str(d / "data"))
        mp.setenv("COLI_CONFIG_DIR", str(d / "config"))
        mp.setenv("COLI_LOG_DIR", str(d / "logs"))
        mp.delenv("COLI_MODEL", raising=False)
        mp.delenv("COLI_API_KEY", raising=False)
        yield d


@pytest.fixture
def kernel_settings():
    """Restore the compiled kernels' global settings (threads, SIMD variant, int8 activations)
    that a test changed."""
    yield
    from cython_kernels import qmatmul
    qmatmul.set_num_threads(0)
    qmatmul.set_simd("auto")
    qmatmul.set_int8_activations(False)


@pytest.fixture
def tiny_model(tmp_path) -> Path:
    return write_hf_model(tmp_path / "src", tiny_config())


# --- oracle fixtures (tests/oracle) ------------------------------------------------------------

# The fixtures the foundation was built on. They come first in oracle_names() (tests that take
# "the first fixture" or the first two or three keep taking these), and tests/test_golden_bits.py
# hashes exactly these, so adding fixtures never moves a recorded hash.
FOUNDATION_FIXTURES = ("olmoe-a", "olmoe-b", "olmoe-c", "olmoe-d", "olmoe-e",
                       "qwen3moe-a", "qwen3moe-b", "qwen3moe-c", "qwen3moe-d", "qwen3moe-e")


def _fixture_model_type(name: str):
    try:
        return json.loads((COMMITTED / name / "model" / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def _all_oracle_names() -> list[str]:
    names = [p.name for p in COMMITTED.iterdir() if (p / "reference.npz").exists()]
    return sorted(names, key=lambda n: (n not in FOUNDATION_FIXTURES, n))


def oracle_pending() -> dict[str, str]:
    """Committed fixtures of a model_type the engine does not support yet -> why they are left out."""
    from models.registry import supported_types
    ok = set(supported_types())
    return {n: f"model_type {_fixture_model_type(n)!r} is not supported by the engine yet"
            for n in _all_oracle_names() if _fixture_model_type(n) not in ok}


def oracle_names():
    """The committed fixtures whose model_type the engine supports (models.registry.supported_types()):
    FOUNDATION_FIXTURES first, then the rest by name. A fixture of a family not yet registered is
    left out (pytest's header lists it) and joins every oracle test once its family lands."""
    pending = oracle_pending()
    return [n for n in _all_oracle_names() if n not in pending]


def pytest_report_header(config):
    pending = oracle_pending()
    if pending:
        return ["oracle fixtures skipped (family not supported yet): "
                + ", ".join(f"{n} ({_fixture_model_type(n)})" for n in pending)]
    return None


@pytest.fixture(scope="session")
def fixture_root(request, tmp_path_factory) -> Path:
    if not request.config.getoption("--oracle-fresh"):
        return COMMITTED
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("oracle-fresh")
    seed = random.SystemRandom().randrange(1, 2**31)
    print(f"\nregenerating oracle fixtures with seed {seed} into {out}")
    subprocess.run([sys.executable, "-m", "tests.oracle.generate", "--out", str(out), "--seed", str(seed)],
                   cwd=ROOT, check=True)
    return out


@pytest.fixture(scope="session")
def containers(fixture_root, tmp_path_factory):
    """Each fixture converted once per bit width through the command line."""
    made = {}

    def get(name: str, bits: int) -> Path:
        if (name, bits) not in made:
            out = tmp_path_factory.mktemp(f"{name}-{bits}") / "c"
            from colibri_tui.cli import main as coli
            assert coli(["convert", str(fixture_root / name / "model"), str(out), "--bits", str(bits)]) == 0
            made[(name, bits)] = out
        return made[(name, bits)]
    return get




def one_error_line(capsys, args: list[str]) -> str:
    """Run ``coli args`` in process: it must exit 1 with exactly one ``coli: error:`` line on
    stderr, which is returned."""
    from colibri_tui.cli import main as coli
    capsys.readouterr()
    assert coli(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("coli: error:"), err
    return err[0]


@pytest.fixture(scope="module")
def demo():
    """The embedded demo model's path (skips where this install has none)."""
    from models import default_model
    path = default_model()
    if path is None:
        pytest.skip("no demo model")
    return str(path)


def open_engine(path, **kw):
    """An engine on one thread that writes no routing history."""
    from models import open_model
    e = open_model(path, **{"threads": 1, **kw})
    e.usage_file = None
    return e


def assert_block_has_the_bits_of_its_steps(m, x, base, block, qm):
    """A linear-attention mixer's one compiled core call (``block(m, x, state)``) against its
    compiled steps (``m.core_steps(qm, ...)``): the same output and state bits; and against the
    numpy composition (``core_steps(None, ...)``) to float32 rounding. ``base``: the starting state."""
    s_block = {k: v.copy() for k, v in base.items()}
    s_steps = {k: v.copy() for k, v in base.items()}
    s_numpy = {k: v.copy() for k, v in base.items()}
    got = block(m, x, s_block)
    want = m.core_steps(qm, *x, s_steps)
    np.testing.assert_array_equal(got, want)
    for part in base:
        np.testing.assert_array_equal(s_block[part], s_steps[part])
    ref = m.core_steps(None, *x, s_numpy)
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)
    for part in base:
        np.testing.assert_allclose(s_block[part], s_numpy[part], atol=2e-5, rtol=1e-5)


def simde_include():
    """The directory holding simde/ (x86 and arm headers): $SIMDE_INCLUDE, the simde-py package of
    the test extra (pip, no system packages needed), then the usual system locations."""
    import os
    dirs = [os.environ.get("SIMDE_INCLUDE", "")]
    try:
        import simde_py
        dirs.append(simde_py.get_include())
    except Exception:   # not installed (or a broken install): the system headers, if any
        pass
    dirs += ["/usr/include", "/usr/local/include", "/opt/homebrew/include"]
    for d in dirs:
        if d and all(os.path.exists(os.path.join(d, "simde", *p))
                     for p in (("x86", "avx512.h"), ("arm", "neon.h"))):
            return d
    return None


def run_emulated(tmp_path: Path, source: str, flags: tuple[str, ...] = ()) -> None:
    """Build a C program over cython_kernels' headers with SIMDe standing in for AVX2 / AVX-512 /
    NEON (-DCOLI_SIMDE_TEST), run it, and require it to print OK. Under AddressSanitizer where
    the toolchain has it (-O0: a quick build): a kernel reading past a row's last byte gives the
    right numbers (x is zero there), so only a sanitizer sees it. Skips without a gcc/clang-style
    compiler or the SIMDe headers."""
    import os
    import shutil
    import subprocess
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    inc = simde_include()
    if sys.platform == "win32":
        pytest.skip("the emulated-variant harness is built with a gcc/clang-style C compiler")
    if cc is None:
        pytest.skip("no C compiler (cc / gcc / clang) on PATH")
    if inc is None:
        pytest.skip("no SIMDe headers (pip install simde-py, or libsimde-dev; or set SIMDE_INCLUDE)")
    kdir = str(Path(__file__).resolve().parents[1] / "cython_kernels")
    src, exe = tmp_path / "emu.c", tmp_path / "emu"
    src.write_text(source)
    cmd = [cc, "-O1", *flags, "-DCOLI_SIMDE_TEST", "-I", kdir, "-I", inc, str(src), "-o", str(exe), "-lm"]
    r = subprocess.run(cmd[:1] + ["-O0", "-fsanitize=address"] + cmd[2:], capture_output=True, text=True)
    if r.returncode != 0:
        r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-3000:] + r.stderr[-2000:]


def attention_one_row_at_a_time(attention):
    """``kernels.attention`` whose many-row calls run one query row at a time, each over the
    positions it may see, as decode computes them (one-row and masked calls unchanged): with it
    prefill's attention has decode's bits."""
    def per_row(q, keys, values, scale, pos, window, allowed=None):
        if q.shape[0] == 1 or allowed is not None:
            return attention(q, keys, values, scale, pos, window, allowed)
        return np.concatenate([attention(q[t: t + 1], keys[:, : p + 1], values[:, : p + 1], scale,
                                         pos[t: t + 1], window) for t, p in enumerate(pos.tolist())])
    return per_row


def decode_and_prefill(engine, ids: list[int], first: int = 5):
    """The logits of positions first-1.. as decode gives them (a prefill of the first ``first``
    ids, then one id a step) and as one prefill of all the ids gives them."""
    cache = engine.new_cache()
    step = [engine.forward(ids[:first], cache)[-1]] + [engine.forward([t], cache)[-1] for t in ids[first:]]
    return np.stack(step), engine.logits(ids)[first - 1:]
