"""Bad command lines get one `coli: error:` line and exit 1, never an internal error (issue 16)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from colibri_tui.cli import main as coli
from tests.conftest import ROOT, one_error_line, tiny_config, write_hf_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-input")
    src = write_hf_model(d / "src", tiny_config())
    assert coli(["convert", str(src), str(d / "c")]) == 0
    return d


@pytest.mark.parametrize("flags, match", [
    (["--seed", "-1"], "seed must be an integer in 0.."),
    (["--seed", str(2 ** 70)], "seed must be"),
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--temperature", "inf"], "temperature"),
    (["--top-p", "nan"], "top-p"),
    (["--ram-gb", "nan"], "--ram-gb must be a finite number > 0"),
    (["--ram-gb", "inf"], "--ram-gb must be a finite number > 0"),
    (["--ram-gb", "-1"], "--ram-gb"),
])
def test_bad_run_values(model, capsys, flags, match):
    line = one_error_line(capsys, ["run", "--model", str(model / "c"), "--ids", "1,2", "--max-new-tokens", "2", *flags])
    assert match in line, line


def test_plan_with_a_nan_budget(model, capsys):
    assert "--ram-gb must be a finite" in one_error_line(capsys, ["plan", "--model", str(model / "c"), "--ram-gb", "nan"])


def test_logits_out_is_a_directory(model, capsys, tmp_path):
    line = one_error_line(capsys, ["logits", "--model", str(model / "c"), "--ids", "1,2", "--out", str(tmp_path)])
    assert "is a directory" in line


def test_convert_into_a_file_or_the_source(model, capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert "is not a directory" in one_error_line(capsys, ["convert", str(model / "src"), str(f)])
    assert "is or contains the source" in one_error_line(capsys, ["convert", str(model / "src"), str(model / "src")])
    assert "is or contains the source" in one_error_line(capsys, ["convert", str(model / "src"), str(model)])
    assert not (model / "colibri.json").exists() and not (model / "src" / "colibri.json").exists()


def test_a_prompt_that_is_not_utf8(model):
    """Undecodable bytes in argv (POSIX) reach Python as lone surrogates."""
    if sys.platform == "win32":
        pytest.skip("Windows passes the command line as UTF-16")
    prompt = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")
    r = subprocess.run([sys.executable, "-m", "colibri_tui", "run", "--model", str(model / "c"), prompt,
                        "--max-new-tokens", "2"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={k: v for k, v in os.environ.items() if k != "COLI_DEBUG"})
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == ["coli: error: PROMPT is not valid UTF-8 text"]
