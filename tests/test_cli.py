"""The command line as a user meets it: real subprocesses, real files."""
import json
import subprocess
import sys

import numpy as np
import pytest

from core.sampling import Sampler, SamplingParams
from tests.conftest import ROOT, tiny_config, tokenizer_files, write_hf_model

def coli(*args, check_rc=None):
    r = subprocess.run([sys.executable, "-m", "colibri_tui", *map(str, args)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    if check_rc is not None:
        assert r.returncode == check_rc, r.stderr
    return r


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    src = d / "src"
    src.mkdir()
    vocab = tokenizer_files(src, 300)
    write_hf_model(src, tiny_config(vocab_size=vocab))
    coli("convert", src, d / "c", check_rc=0)
    return d / "c"


def test_run_json_is_one_object_and_deterministic(container):
    args = ("run", "--model", container, "hello", "--max-new-tokens", 12, "--seed", 7, "--json")
    a = coli(*args, check_rc=0)
    b = coli(*args, check_rc=0)
    out = json.loads(a.stdout)
    assert out == {**json.loads(b.stdout), "stats": out["stats"]}
    assert set(out["stats"]) >= {"prompt_tokens", "new_tokens", "ttft_s", "prefill_tok_s", "decode_tok_s",
                                 "hit_rate", "bytes_read", "peak_rss_bytes"}
    assert len(out["ids"]) == out["stats"]["new_tokens"] <= 12
    assert out["stats"]["prompt_tokens"] > 3     # the chat template was applied


def test_run_streams_text_and_greedy_ids(container):
    r = coli("run", "--model", container, "--ids", "5,6,7", "--greedy", "--max-new-tokens", 8, check_rc=0)
    assert "tokens" in r.stderr and "decode" in r.stderr
    g = json.loads(coli("run", "--model", container, "--ids", "5,6,7", "--greedy", "--max-new-tokens", 8,
                        "--json", check_rc=0).stdout)
    from models import open_model
    engine = open_model(container)
    logits = engine.logits([5, 6, 7] + g["ids"][:-1])
    assert g["ids"] == logits[2:].argmax(1).tolist()[: len(g["ids"])]


def test_logits_cli_writes_float32(container, tmp_path):
    out = tmp_path / "l.npy"
    coli("logits", "--model", container, "--ids", "1,2,3,4", "--out", out, check_rc=0)
    a = np.load(out)
    info = json.loads(coli("info", "--model", container, "--json", check_rc=0).stdout)
    assert a.shape == (4, info["vocab_size"]) and a.dtype == np.float32
    assert info["model_type"] == "qwen3_moe" and info["experts"] == 6 and info["bytes_experts"] > 0


@pytest.mark.parametrize("args, message", [
    (("run", "--model", "/nonexistent", "hi"), "no such model directory"),
    (("run", "--model", "{c}", "--ids", "1,x"), "--ids must be comma-separated integers"),
    (("run", "--model", "{c}", "--ids", "1,99999"), "token id out of range"),
    (("run", "--model", "{c}"), "give either PROMPT or --ids"),
    (("run", "--model", "{c}", "hi", "--top-p", "0"), "top-p must be in"),
    (("logits", "--model", "{c}", "--ids", "1", "--out", "/no/such/dir/x.npy"), "does not exist"),
    (("convert", "/nonexistent", "/tmp/x"), "no such directory"),
    (("convert", "{c}", "/tmp/x", "--bits", "3"), "invalid choice"),
    (("run", "--model", "{c}", "hi", "--threads", "0"), "--threads must be >= 1"),
])
def test_bad_input_is_one_line_and_nonzero(container, args, message):
    r = coli(*(a.format(c=container) for a in args))
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_no_model_and_no_demo(monkeypatch, tmp_path, capsys):
    import models
    from colibri_tui.cli import main
    monkeypatch.delenv("COLI_MODEL", raising=False)
    monkeypatch.setattr(models, "DEMO_MODEL", tmp_path / "absent")
    assert main(["run", "hi"]) == 1
    assert "no model given" in capsys.readouterr().err


def test_not_a_container(tmp_path):
    write_hf_model(tmp_path / "hf", tiny_config())
    r = coli("run", "--model", tmp_path / "hf", "--ids", "1")
    assert r.returncode == 1 and "not a colibrì container" in r.stderr


def test_stop_strings_and_cancel(container):
    from core.events import Done, Token
    from models import open_model
    engine = open_model(container)
    params = SamplingParams(temperature=1.0, seed=3)
    full = [e for e in engine.generate("hello", params, max_new_tokens=30)]
    text = "".join(e.text for e in full if isinstance(e, Token))
    assert isinstance(full[-1], Done)
    if len(text) > 4:
        stop = text[2:4]
        ev = list(engine.generate("hello", SamplingParams(temperature=1.0, seed=3), stop=[stop],
                                  max_new_tokens=30))
        got = "".join(e.text for e in ev if isinstance(e, Token))
        assert ev[-1].reason == "stop" and got == text[: text.find(stop)]
    gen = engine.generate("hello", params, max_new_tokens=30)
    next(e for e in gen if isinstance(e, Token))
    engine.cancel()
    assert [e for e in gen if isinstance(e, Done)][0].reason == "cancelled"


def test_sampler_is_seeded_and_respects_top_k_top_p():
    logits = np.array([3.0, 2.9, 0.0, -1.0, -5.0], dtype=np.float32)
    draw = lambda p: [s(logits) for s in [Sampler(p)] for _ in range(200)]
    assert draw(SamplingParams(temperature=1.0, seed=1)) == draw(SamplingParams(temperature=1.0, seed=1))
    assert set(draw(SamplingParams(temperature=5.0, top_k=2, seed=2))) == {0, 1}
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.5, seed=3))) == {0}
    assert Sampler(SamplingParams(greedy=True))(logits) == 0
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


def test_int8_activations_flag_is_close_not_identical(tmp_path):
    """--int8-activations (opt-in) changes logits by a fraction of a percent on the demo model."""
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    ids = "1,300,301,302,303,304,305,306"
    coli("logits", "--ids", ids, "--out", a, check_rc=0)
    coli("logits", "--ids", ids, "--out", b, "--int8-activations", check_rc=0)
    x, y = np.load(a), np.load(b)
    assert not np.array_equal(x, y)
    assert np.sqrt(np.mean((x - y) ** 2)) < 0.05 * np.sqrt(np.mean(x ** 2))
