"""The one-file executable (installers/build.py): build it, then run it as a user would.

Slow (a PyInstaller build takes minutes): ``pytest -m "not slow"`` leaves it out. Skipped, with the
reason, when PyInstaller is not installed (``pip install .[build]``). ``COLI_TEST_BINARY=PATH``
tests an already built executable instead of building one (the release workflow does that).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest

from tests.conftest import tiny_config, write_hf_model

ROOT = Path(__file__).resolve().parents[1]

with warnings.catch_warnings():  # the marker is not registered in pyproject.toml: no warning
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
    pytestmark = pytest.mark.slow

BUILD_TIMEOUT_S = 1800


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("COLI_MODEL", "COLI_RAM_GB")}
    env.update(COLI_NO_RELAUNCH="1", **extra)
    return env


def _run(cmd, timeout=300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          env=kw.pop("env", None) or _env(), **kw)


@pytest.fixture(scope="module")
def binary(tmp_path_factory) -> Path:
    given = os.environ.get("COLI_TEST_BINARY")
    if given:
        p = Path(given)
        if not p.is_file():
            pytest.fail(f"COLI_TEST_BINARY={given} does not exist")
        return p.resolve()
    try:
        import PyInstaller  # noqa: F401
    except ImportError:
        pytest.skip("PyInstaller is not installed (pip install '.[build]'); the binary is not built")
    dist = tmp_path_factory.mktemp("dist")
    # the default work folder (build/pyinstaller): PyInstaller's cache is shared with build.py
    r = subprocess.run([sys.executable, str(ROOT / "installers" / "build.py"), "--dist", str(dist),
                        "--no-smoke"],
                       capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert r.returncode == 0, f"build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    exe = Path(r.stdout.strip().splitlines()[-1])
    assert exe.is_file() and exe.parent == dist, r.stdout[-2000:]
    print(f"\nbinary {exe.name}: {exe.stat().st_size / 1e6:.1f} MB")
    return exe


@pytest.fixture(scope="module")
def container(tmp_path_factory) -> Path:
    from colibri_tui.cli import main as coli
    d = tmp_path_factory.mktemp("bin-model")
    src = write_hf_model(d / "src", tiny_config(num_hidden_layers=2, num_experts=6))
    assert coli(["convert", str(src), str(d / "c"), "--bits", "4"]) == 0
    return d / "c"


def _build_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("coli_build", ROOT / "installers" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_version_and_startup_time(binary):
    b = _build_module()
    version = b.project_version()
    if not os.environ.get("COLI_TEST_BINARY"):
        assert binary.name == b.binary_name(version)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        r = _run([binary, "--version"])
        times.append(time.perf_counter() - t)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"colibri {version}"
    print(f"\n{binary.name}: {binary.stat().st_size / 1e6:.1f} MB; `--version` "
          f"first {times[0]:.2f} s, then {min(times[1:]):.2f} s")


def test_help_lists_the_commands(binary):
    r = _run([binary, "--help"])
    assert r.returncode == 0
    for cmd in ("convert", "run", "info", "plan"):
        assert cmd in r.stdout


def test_info_uses_the_compiled_kernels(binary, container):
    r = _run([binary, "info", "--model", container, "--json"])
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["kernels"] == "cython", "the binary lost the compiled kernels: " + r.stderr
    assert info["layers"] == 2 and info["experts"] == 6


def test_run_matches_the_source_tree(binary, container, capsys):
    args = ["run", "--model", str(container), "--ids", "1,2,3", "--max-new-tokens", "5",
            "--seed", "1", "--threads", "1", "--json"]
    r = _run([binary, *args])
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    from colibri_tui.cli import main as coli
    capsys.readouterr()
    assert coli(args) == 0
    want = json.loads(capsys.readouterr().out)
    assert got["ids"] == want["ids"] and got["stats"]["new_tokens"] == 5


def test_bad_input_is_one_line(binary, tmp_path):
    r = _run([binary, "info", "--model", tmp_path / "nope"])
    assert r.returncode == 1
    assert r.stderr.strip().startswith("coli: error:") and len(r.stderr.strip().splitlines()) == 1


def test_archive_carries_kernels_and_data(binary):
    pytest.importorskip("PyInstaller", reason="reading the archive needs PyInstaller")
    from PyInstaller.archive.readers import CArchiveReader
    names = {n.replace("\\", "/") for n in CArchiveReader(str(binary)).toc}
    assert any(n.startswith("cython_kernels/qmatmul") for n in names), "compiled kernels missing"
    for f in sorted((ROOT / "colibri_tui").rglob("*.tcss")) + sorted((ROOT / "models").glob("catalog.toml")):
        assert f.relative_to(ROOT).as_posix() in names, f"{f.name} missing"
    demo = ROOT / "models" / "demo" / "qwen3-moe-demo"
    if demo.is_dir():
        for f in demo.rglob("*"):
            if f.is_file() and f.name != ".coli_usage":
                assert f.relative_to(ROOT).as_posix() in names, f"demo file {f.name} missing"


def test_download_reaches_huggingface_hub(binary, tmp_path):
    # a closed local port: huggingface_hub and its HTTP stack load, the connection is refused
    env = _env(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    env.pop("HF_HUB_OFFLINE", None)
    r = _run([binary, "download", "nobody/nothing", "--dir", tmp_path / "dl"], env=env, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("coli: error:") and "internal error" not in r.stderr, r.stderr
    assert "No module named" not in r.stderr


def test_demo_model_generation(binary, tmp_path):
    from models import default_model
    if default_model() is None:
        pytest.skip("no embedded demo model in this checkout yet (models/demo/qwen3-moe-demo)")
    env = _env(COLI_DATA_DIR=str(tmp_path / "data"), COLI_CONFIG_DIR=str(tmp_path / "cfg"))
    r = _run([binary, "run", "Hello", "--max-new-tokens", "5", "--seed", "1", "--json"], env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stats"]["new_tokens"] >= 1
    assert "demo model" in r.stderr


def _tmux(*args, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=30, check=check)


def _screen(session: str) -> str:
    r = _tmux("capture-pane", "-p", "-t", session, check=False)
    return r.stdout if r.returncode == 0 else ""


def _wait_screen(session: str, cond, timeout: float) -> str:
    t0 = time.monotonic()
    while True:
        s = _screen(session)
        if cond(s):
            return s
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out; screen:\n{s}")
        time.sleep(0.3)


def test_app_starts_and_quits_in_tmux(binary, container, tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    help_text = _run([binary, "--help"]).stdout
    if "chat" not in help_text:
        pytest.skip("the full-screen app is not wired into `coli` yet (no `chat` command)")
    session = f"coli-bin-{uuid.uuid4().hex[:8]}"
    env = (f"COLI_NO_RELAUNCH=1 COLI_DATA_DIR={tmp_path / 'data'} COLI_CONFIG_DIR={tmp_path / 'cfg'} "
           f"TERM=xterm-256color")
    shell = f"env {env} '{binary}' chat --model '{container}'; echo COLI-EXITED-$?; sleep 60"
    _tmux("new-session", "-d", "-s", session, "-x", "120", "-y", "36", shell)
    try:
        t0 = time.monotonic()
        # a whole frame: the title and the footer with its key bindings
        screen = _wait_screen(session, lambda s: "colibr" in s and "palette" in s or "COLI-EXITED" in s,
                              timeout=120)
        assert "COLI-EXITED" not in screen, f"the app did not start:\n{screen}"
        first = time.monotonic() - t0
        # then the model opened in the app: the status line says "ready", or the brain map shows
        # the tiny model's geometry (2 layers x 6 experts)
        screen = _wait_screen(session, lambda s: re.search(r"\bready\b|\b2 layers\b", s)
                              or "COLI-EXITED" in s, timeout=120)
        assert "COLI-EXITED" not in screen, f"the app died:\n{screen}"
        print(f"\napp: first frame after {first:.1f} s, model ready after "
              f"{time.monotonic() - t0:.1f} s:\n{screen}")
        _tmux("send-keys", "-t", session, "C-q")
        screen = _wait_screen(session, lambda s: "COLI-EXITED" in s, timeout=30)
        assert "COLI-EXITED-0" in screen, screen
    finally:
        _tmux("kill-session", "-t", session, check=False)


# --- the double-click path: no terminal, no arguments -> reopened in a terminal emulator -----------

STAND_IN_EMULATOR = """#!/bin/sh
# A stand-in x-terminal-emulator: like a real one, it runs `-e CMD ARGS...` in a new terminal (a
# detached tmux session on its own server, so that the session sees this environment) and passes
# its environment through. It also records that environment.
env > '{env_file}'
[ "$1" = "-e" ] && shift
exec tmux -L '{socket}' -f /dev/null new-session -d -s coli -x 120 -y 36 \\
  sh -c 'TERM=xterm-256color; export TERM; "$@"; echo COLI-EXITED-$?; sleep 60' sh "$@"
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="x-terminal-emulator is Linux's")
def test_double_click_reopens_in_a_terminal_and_the_app_starts(binary, tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    socket = f"coli-relaunch-{uuid.uuid4().hex[:8]}"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    env_file = tmp_path / "emulator-env.txt"
    emulator = bindir / "x-terminal-emulator"
    emulator.write_text(STAND_IN_EMULATOR.format(env_file=env_file, socket=socket))
    emulator.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("COLI_MODEL", "COLI_RAM_GB", "COLI_NO_RELAUNCH", "COLI_FORCE_RELAUNCH",
                        "COLI_RELAUNCHED", "TMUX", "TMUX_PANE")}
    env.update(DISPLAY=":99", PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
               COLI_DATA_DIR=str(tmp_path / "data"), COLI_CONFIG_DIR=str(tmp_path / "cfg"),
               # the user's own library path, which the bootloader replaces and keeps aside
               LD_LIBRARY_PATH=str(tmp_path / "user-lib"))

    def tmux(*args, check=False):
        return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True,
                              timeout=30, check=check)

    def screen() -> str:
        r = tmux("capture-pane", "-p", "-t", "coli")
        return r.stdout if r.returncode == 0 else ""

    def wait(cond, timeout: float) -> str:
        t0 = time.monotonic()
        while not cond(s := screen()):
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"timed out; the terminal shows:\n{s}")
            time.sleep(0.3)
        return s

    try:
        # as a file manager starts it: no tty anywhere, no controlling terminal, no arguments
        t0 = time.monotonic()
        r = subprocess.run([str(binary)], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=120, start_new_session=True)
        assert r.returncode == 0, f"the launcher did not open a terminal:\n{r.stderr}"
        # the reopened copy: the app's first whole frame (title and footer), not a bootloader error
        died = ("COLI-EXITED", "colibri exited with status")    # the launcher's held window
        s = wait(lambda s: ("colibr" in s and "palette" in s) or any(d in s for d in died),
                 timeout=120)
        assert not any(d in s for d in died), f"the reopened binary died:\n{s}"
        # (the emulator wrote its environment before starting tmux, so it is complete by now)
        seen = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
        assert not [k for k in seen if k.startswith("_PYI_")], "the bootloader's variables leaked"
        assert seen.get("LD_LIBRARY_PATH") == env["LD_LIBRARY_PATH"], seen.get("LD_LIBRARY_PATH")
        assert seen.get("COLI_RELAUNCHED") == "1" and seen.get("PYINSTALLER_RESET_ENVIRONMENT") == "1"
        print(f"\nreopened in the stand-in terminal, first frame after "
              f"{time.monotonic() - t0:.1f} s:\n{s}")
        tmux("send-keys", "-t", "coli", "C-q")
        # a run shorter than the launcher's FLASH_SECONDS waits for Enter before its window closes
        s = wait(lambda s: "COLI-EXITED" in s or "press Enter" in s, timeout=30)
        if "COLI-EXITED" not in s:
            tmux("send-keys", "-t", "coli", "Enter")
            s = wait(lambda s: "COLI-EXITED" in s, timeout=30)
        assert "COLI-EXITED-0" in s, s
    finally:
        tmux("kill-server")


def test_smoke_mode_starts_and_quits_headless(binary, tmp_path):
    # what the Windows release job runs (no tmux there): COLI_SMOKE=1 `chat` without a terminal
    from models import default_model
    env = _env(COLI_SMOKE="1", COLI_DATA_DIR=str(tmp_path / "data"),
               COLI_CONFIG_DIR=str(tmp_path / "cfg"))
    r = _run([binary, "chat"], env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert line.startswith("coli: smoke: OK") and "after" in line, line
    if default_model() is not None:
        assert "ChatScreen" in line and "model qwen3-moe-demo ready" in line, line
    else:
        assert "SetupWizard" in line and "no model configured" in line, line
    print(f"\n{line}")
