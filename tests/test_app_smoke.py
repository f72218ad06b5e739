"""``COLI_SMOKE=1 coli chat`` (colibri_tui/smoke.py): the app started headless and quit, for CI
machines without a terminal (the Windows release build). tests/test_binary.py runs the same mode
against the one-file binary."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_app_container

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def container(tmp_path_factory) -> Path:
    return tiny_app_container(tmp_path_factory.mktemp("smoke"), "tiny-smoke")


def _coli(args, tmp_path, **extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("COLI_MODEL", "COLI_RAM_GB")}
    env.update(COLI_DATA_DIR=str(tmp_path / "data"), COLI_CONFIG_DIR=str(tmp_path / "cfg"), **extra)
    # no terminal at all: stdin and stdout are pipes, as on a CI runner
    return subprocess.run([sys.executable, "-m", "colibri_tui", *args], cwd=ROOT, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)


def test_smoke_starts_the_app_without_a_terminal_and_quits(container, tmp_path):
    r = _coli(["chat", "--model", str(container), "--threads", "1"], tmp_path, COLI_SMOKE="1")
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert line.startswith("coli: smoke: OK") and "ChatScreen" in line, line
    assert "model tiny-smoke ready" in line, line
    assert r.stderr == ""
    print(f"\n{line}")


def test_without_smoke_it_still_needs_a_terminal(container, tmp_path):
    r = _coli(["chat", "--model", str(container)], tmp_path, COLI_SMOKE="0")
    assert r.returncode == 1
    assert r.stderr.strip() == "coli: error: coli chat needs a terminal (for scripts use `coli run`)"


def test_smoke_fails_in_one_line_when_the_model_does_not_open(tmp_path):
    r = _coli(["chat", "--model", str(tmp_path / "nope")], tmp_path, COLI_SMOKE="1")
    assert r.returncode == 1 and r.stdout == ""
    err = r.stderr.strip()
    assert err.startswith("coli: error: smoke: the model did not open:") and "nope" in err, err
    assert len(err.splitlines()) == 1, err


def test_smoke_with_no_model_shows_the_setup_wizard(tmp_path, monkeypatch):
    import models
    from colibri_tui import smoke
    from colibri_tui.app import ColiApp
    from colibri_tui.settings import Settings
    monkeypatch.setenv("COLI_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("COLI_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setattr(models, "DEMO_MODEL", tmp_path / "no-demo")  # an install without the demo
    out, err = io.StringIO(), io.StringIO()
    app = ColiApp(settings=Settings(), history_path=tmp_path / "h.sqlite", setup_wizard=True)
    assert smoke.run(app, out=out, err=err) == 0, err.getvalue()
    assert "SetupWizard" in out.getvalue() and "no model configured" in out.getvalue()


def test_smoke_switch_and_ascii_output():
    from colibri_tui import smoke
    assert smoke.requested({"COLI_SMOKE": "1"}) and smoke.requested({"COLI_SMOKE": "yes"})
    assert not smoke.requested({}) and not smoke.requested({"COLI_SMOKE": "0"})
    assert smoke._printable("colibrì\x1b[2J·x") == "colibr??[2J?x"


def test_release_workflow_smoke_step_runs_on_windows(tmp_path):
    # the release job's start-and-quit step: present (not commented out), not kept off Windows,
    # and the command it runs passes here with `coli` from source in place of the binary
    yaml = pytest.importorskip("yaml")
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yml").read_text())
    build = wf["jobs"]["build"]
    assert any(m["os"].startswith("windows") for m in build["strategy"]["matrix"]["include"])
    steps = [s for s in build["steps"] if 'COLI_SMOKE=1 "$BIN" chat' in s.get("run", "")]
    assert len(steps) == 1, "the headless start-and-quit step is missing"
    assert "Windows" in steps[0].get("if", "runner.os == 'Windows'")
    assert "!=" not in steps[0].get("if", "")
    r = _coli(["chat"], tmp_path, COLI_SMOKE="1", COLI_NO_RELAUNCH="1", PYTHONUTF8="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("coli: smoke: OK"), r.stdout
