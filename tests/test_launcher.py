"""The double-click logic of the binaries (installers/launcher.py): pure functions, no GUI."""
from __future__ import annotations

import importlib.util
import io
import os
import stat
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("coli_launcher", ROOT / "installers" / "launcher.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


L = _load()


# --- when to relaunch ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["linux", "macos"])
def test_no_terminal_no_args_relaunches(kind):
    d = L.decide([], {}, stdin_tty=False, stdout_tty=False, kind=kind)
    assert d.action == "relaunch"


@pytest.mark.parametrize("stdin_tty,stdout_tty", [(True, True), (True, False), (False, True)])
def test_a_terminal_runs_here(stdin_tty, stdout_tty):
    d = L.decide([], {}, stdin_tty, stdout_tty, "linux")
    assert (d.action, d.hold) == ("run", False)


def test_arguments_mean_command_line_use_even_without_a_terminal():
    # `coli-… run --ids 1,2 > out.txt < /dev/null` from a script must never open a window
    d = L.decide(["run", "--ids", "1,2"], {}, False, False, "linux")
    assert (d.action, d.hold) == ("run", False)


def test_finder_process_serial_number_is_not_an_argument():
    assert L.user_args(["-psn_0_12345"]) == []
    assert L.decide(["-psn_0_12345"], {}, False, False, "macos").action == "relaunch"
    assert L.user_args(["-psn_0_1", "--version"]) == ["--version"]


@pytest.mark.parametrize("kind", ["linux", "macos", "windows"])
def test_relaunch_guard_stops_loops(kind):
    env = {L.GUARD: "1", L.FORCE_RELAUNCH: "1"}  # even a forced relaunch does not loop
    d = L.decide([], env, False, False, kind, windows_own_console=True)
    assert d.action == "run"
    assert d.hold == (kind != "windows")  # cmd /k already keeps Windows' window open


def test_env_switches():
    assert L.decide([], {L.NO_RELAUNCH: "1"}, False, False, "linux").action == "run"
    assert L.decide([], {L.NO_RELAUNCH: "0"}, False, False, "linux").action == "relaunch"
    assert L.decide([], {L.FORCE_RELAUNCH: "1"}, True, True, "linux").action == "relaunch"


def test_windows_double_click_runs_in_its_own_console_and_holds():
    d = L.decide([], {}, True, True, "windows", windows_own_console=True)
    assert (d.action, d.hold) == ("run", True)
    # from cmd.exe / PowerShell: an ordinary run
    d = L.decide([], {}, True, True, "windows", windows_own_console=False)
    assert (d.action, d.hold) == ("run", False)
    # no console at all (started detached): open one
    assert L.decide([], {}, False, False, "windows").action == "relaunch"


def test_owns_console_counts_the_onefile_bootloader():
    assert L.owns_console(1, frozen=False) and not L.owns_console(2, frozen=False)
    assert L.owns_console(2, frozen=True) and not L.owns_console(3, frozen=True)
    assert not L.owns_console(0, frozen=True)  # no console


def test_platform_kind_and_tty_detection():
    assert L.platform_kind("win32") == "windows"
    assert L.platform_kind("darwin") == "macos"
    assert L.platform_kind("linux") == L.platform_kind("freebsd14") == "linux"
    assert L.stream_is_tty(None) is False
    closed = io.StringIO()
    closed.close()
    assert L.stream_is_tty(closed) is False
    assert L.stream_is_tty(io.StringIO()) is False

    class Tty:
        def isatty(self):
            return True
    assert L.stream_is_tty(Tty()) is True


# --- which terminal -----------------------------------------------------------------------------

def _fake_bin(d: Path, *names: str) -> str:
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        p = d / n
        p.write_text("#!/bin/sh\nexit 0\n")
        p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(d)


@pytest.mark.skipif(sys.platform.startswith("win"), reason="executable bits")
def test_first_available_terminal_in_preference_order(tmp_path):
    a = _fake_bin(tmp_path / "a", "xterm", "kitty")
    b = _fake_bin(tmp_path / "b", "konsole")
    exe, prefix = L.find_linux_terminal(os.pathsep.join([a, b]))
    assert Path(exe).name == "konsole" and prefix == ("-e",)  # konsole ranks above kitty, xterm
    exe, prefix = L.find_linux_terminal(a)
    assert Path(exe).name == "kitty" and prefix == ()
    assert L.find_linux_terminal(str(tmp_path / "empty")) is None
    c = _fake_bin(tmp_path / "c", "x-terminal-emulator", "gnome-terminal")
    assert Path(L.find_linux_terminal(c)[0]).name == "x-terminal-emulator"


@pytest.mark.skipif(sys.platform.startswith("win"), reason="executable bits")
def test_linux_relaunch_command_carries_the_guard(tmp_path):
    path = _fake_bin(tmp_path / "bin", "gnome-terminal", "xfce4-terminal")
    env = {"PATH": path, "DISPLAY": ":0"}
    cmd = L.relaunch_command("linux", ["/opt/coli-0.1.0-linux-x86_64"], env)
    assert cmd == [str(tmp_path / "bin" / "gnome-terminal"), "--", "/usr/bin/env",
                   f"{L.GUARD}=1", "/opt/coli-0.1.0-linux-x86_64"]
    path = _fake_bin(tmp_path / "bin2", "xfce4-terminal")
    cmd = L.relaunch_command("linux", ["/x/coli"], {"PATH": path, "WAYLAND_DISPLAY": "wayland-0"})
    assert cmd[1] == "-x" and cmd[-1] == "/x/coli"


@pytest.mark.skipif(sys.platform.startswith("win"), reason="executable bits")
def test_linux_without_display_or_emulator_has_no_command(tmp_path):
    path = _fake_bin(tmp_path / "bin", "xterm")
    assert L.relaunch_command("linux", ["/x/coli"], {"PATH": path}) is None  # no display
    assert L.relaunch_command("linux", ["/x/coli"],
                              {"PATH": str(tmp_path / "none"), "DISPLAY": ":0"}) is None


def test_windows_relaunch_uses_cmd_k():
    cmd = L.relaunch_command("windows", [r"C:\Program Files\coli.exe"], {"COMSPEC": r"C:\cmd.exe"})
    assert cmd == [r"C:\cmd.exe", "/k", r'"C:\Program Files\coli.exe"']
    # one string, so that the quotes reach cmd.exe as they are: cmd /k ""C:\…\coli.exe""
    assert L.windows_command_line(cmd) == r'"C:\cmd.exe" /k ""C:\Program Files\coli.exe""'
    calls = []
    assert L.relaunch("windows", [r"C:\coli.exe"], {"COMSPEC": "cmd.exe"},
                      popen=lambda target, **kw: calls.append((target, kw))) == 0
    target, kw = calls[0]
    assert target == r'"cmd.exe" /k "C:\coli.exe"'
    assert kw["env"][L.GUARD] == "1" and kw["creationflags"] == 0x10


@pytest.mark.skipif(sys.platform.startswith("win"), reason="executable bits")
def test_macos_relaunch_via_terminal(tmp_path):
    path = _fake_bin(tmp_path / "bin", "osascript", "open")
    cmd = L.relaunch_command("macos", ["/Users/me/Downloads/coli it"], {"PATH": path})
    assert Path(cmd[0]).name == "osascript"
    assert 'tell application "Terminal" to do script' in cmd[2]
    assert f"{L.GUARD}=1" in cmd[2] and "'/Users/me/Downloads/coli it'" in cmd[2]
    path = _fake_bin(tmp_path / "bin2", "open")
    cmd = L.relaunch_command("macos", ["/x/coli"], {"PATH": path})
    assert cmd[1:] == ["-a", "Terminal", "/x/coli"]


def test_self_command():
    assert L.self_command(frozen=True, executable="coli.exe") == [os.path.abspath("coli.exe")]
    cmd = L.self_command(frozen=False, executable="/usr/bin/python3", script="installers/launcher.py")
    assert cmd == ["/usr/bin/python3", os.path.abspath("installers/launcher.py")]


# --- relaunching and the no-terminal message ----------------------------------------------------

@pytest.mark.skipif(sys.platform.startswith("win"), reason="executable bits")
def test_relaunch_spawns_with_guard_in_env(tmp_path):
    path = _fake_bin(tmp_path / "bin", "alacritty")
    calls = []
    rc = L.relaunch("linux", ["/x/coli"], {"PATH": path, "DISPLAY": ":1"},
                    popen=lambda line, **kw: calls.append((line, kw)))
    assert rc == 0 and len(calls) == 1
    line, kw = calls[0]
    assert Path(line[0]).name == "alacritty" and line[1] == "-e"
    assert kw["env"][L.GUARD] == "1" and kw["start_new_session"] is True


# What a one-file binary's bootloader leaves in our environment (PyInstaller 6.22 on Linux, read
# from a real binary's relaunch: the emulator saw exactly these besides the user's own variables).
MEI = "/tmp/_MEI0000abcdEF"
FROZEN_ENV = {"HOME": "/home/me", "DISPLAY": ":0", "PATH": "/usr/bin:/bin",
              "_PYI_ARCHIVE_FILE": "/opt/coli", "_PYI_APPLICATION_HOME_DIR": MEI,
              "_PYI_PARENT_PROCESS_LEVEL": "1", "_PYI_LINUX_PROCESS_NAME": "coli-0.1.0-linu",
              "LD_LIBRARY_PATH": MEI}


def test_child_environment_drops_the_bootloaders_state():
    env = L.child_environment(FROZEN_ENV, MEI, "linux")
    assert env == {"HOME": "/home/me", "DISPLAY": ":0", "PATH": "/usr/bin:/bin",
                   L.RESET_ENVIRONMENT: "1"}
    # the input is left alone (it is os.environ in main)
    assert FROZEN_ENV["_PYI_ARCHIVE_FILE"] == "/opt/coli"


def test_child_environment_restores_the_users_library_path():
    env = L.child_environment({**FROZEN_ENV, "LD_LIBRARY_PATH": f"{MEI}:/opt/cuda/lib64",
                               "LD_LIBRARY_PATH_ORIG": "/opt/cuda/lib64"}, MEI, "linux")
    assert env["LD_LIBRARY_PATH"] == "/opt/cuda/lib64" and "LD_LIBRARY_PATH_ORIG" not in env
    # an empty value the user had is theirs too
    env = L.child_environment({"LD_LIBRARY_PATH": MEI, "LD_LIBRARY_PATH_ORIG": ""}, MEI, "linux")
    assert env["LD_LIBRARY_PATH"] == ""
    # macOS: the bootloader may have cleared DYLD_LIBRARY_PATH and kept it aside
    env = L.child_environment({"DYLD_LIBRARY_PATH_ORIG": "/opt/lib"}, "/var/T/_MEIx", "macos")
    assert env == {"DYLD_LIBRARY_PATH": "/opt/lib", L.RESET_ENVIRONMENT: "1"}


def test_child_environment_drops_what_points_into_the_unpack_folder():
    env = L.child_environment({"PATH": f"/usr/bin:{MEI}/bin:/bin", "SSL_CERT_FILE": f"{MEI}/cacert.pem",
                               "LANG": "C.UTF-8", "_MEIPASS2": MEI}, MEI, "linux")
    assert env == {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", L.RESET_ENVIRONMENT: "1"}


def test_child_environment_from_source_keeps_the_users_variables():
    # not frozen: no unpack folder, and LD_LIBRARY_PATH is the user's own
    env = L.child_environment({"LD_LIBRARY_PATH": "/opt/lib", "PATH": "/bin"}, None, "linux")
    assert env == {"LD_LIBRARY_PATH": "/opt/lib", "PATH": "/bin", L.RESET_ENVIRONMENT: "1"}


def test_child_environment_on_windows_ignores_case():
    mei = r"C:\Users\me\AppData\Local\Temp\_MEI123"
    env = L.child_environment({"Path": rf"C:\Windows;{mei.lower()}\lib", "_pyi_archive_file": "x",
                               "PyInstaller_Reset_Environment": "0", "COMSPEC": "cmd.exe"},
                              mei, "windows")
    assert env == {"Path": r"C:\Windows", "COMSPEC": "cmd.exe", L.RESET_ENVIRONMENT: "1"}


@pytest.mark.parametrize("kind", ["linux", "windows"])
def test_relaunch_hands_the_terminal_a_clean_environment(tmp_path, kind):
    path = _fake_bin(tmp_path / "bin", "xterm")
    calls = []
    rc = L.relaunch(kind, ["/opt/coli"], {**FROZEN_ENV, "PATH": path},
                    popen=lambda line, **kw: calls.append(kw["env"]), bundle_dir=MEI)
    assert rc == 0
    env = calls[0]
    assert not [k for k in env if k.startswith("_PYI_")] and "LD_LIBRARY_PATH" not in env
    assert env[L.RESET_ENVIRONMENT] == "1" and env[L.GUARD] == "1" and env["HOME"] == "/home/me"


def test_no_terminal_prints_and_logs(tmp_path, monkeypatch, capsys):
    log = tmp_path / "logs" / "launcher.log"
    monkeypatch.setattr(L, "log_path", lambda: log)
    notes = []
    monkeypatch.setattr(L, "notify_desktop", lambda msg, env: notes.append(msg) or True)
    calls = []
    # a display but no emulator on PATH
    rc = L.relaunch("linux", ["/x/coli"], {"PATH": str(tmp_path / "none"), "DISPLAY": ":0"},
                    popen=lambda *a, **k: calls.append(a))
    assert rc == 1 and calls == []
    err = capsys.readouterr().err
    assert "needs a terminal window" in err and "xterm" in err and "/x/coli" in err
    assert "needs a terminal window" in log.read_text()
    assert len(notes) == 1 and str(log) in notes[0]
    # no display at all (ssh, cron)
    assert L.relaunch("linux", ["/x/coli"], {"PATH": str(tmp_path / "none")}) == 1
    assert "no graphical display" in capsys.readouterr().err
    assert log.read_text().count("needs a terminal window") == 2


@pytest.mark.skipif(sys.platform.startswith("win"), reason="executable bits")
def test_desktop_notice(tmp_path):
    calls = []
    path = _fake_bin(tmp_path / "bin", "zenity")
    assert L.notify_desktop("hi", {"PATH": path, "DISPLAY": ":0"},
                            popen=lambda line, **k: calls.append(line))
    assert Path(calls[0][0]).name == "zenity" and calls[0][1:] == ["--error", "--text", "hi"]
    assert not L.notify_desktop("hi", {"PATH": path}, popen=lambda line, **k: calls.append(line))
    assert not L.notify_desktop("hi", {"PATH": str(tmp_path / "none"), "DISPLAY": ":0"})


def test_popen_failure_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(L, "log_path", lambda: tmp_path / "l.log")

    def boom(*a, **k):
        raise OSError("cannot exec")
    assert L.relaunch("windows", ["coli.exe"], {}, popen=boom) == 1
    assert "cannot exec" in capsys.readouterr().err


def test_log_path_is_under_the_user_log_dir():
    import platformdirs
    assert L.log_path() == Path(platformdirs.user_log_dir("colibri", appauthor=False)) / "launcher.log"


# --- running the CLI and holding the window -----------------------------------------------------

def test_should_pause():
    assert L.should_pause(1, 100.0)
    assert L.should_pause(0, 0.5)       # would flash by
    assert not L.should_pause(0, 60.0)  # a normal session that the user ended


def test_run_cli_passes_through_and_holds_on_error(monkeypatch, capsys):
    import colibri_tui.cli as cli
    waits = []
    t = iter([0.0, 100.0, 0.0, 100.0, 0.0, 100.0])
    monkeypatch.setattr(cli, "main", lambda argv: 0 if argv == ["ok"] else 1)
    assert L.run_cli(["ok"], hold=True, clock=lambda: next(t), wait=waits.append) == 0
    assert waits == []
    assert L.run_cli(["bad"], hold=True, clock=lambda: next(t), wait=waits.append) == 1
    assert len(waits) == 1 and "status 1" in waits[0]
    assert L.run_cli(["bad"], hold=False, clock=lambda: next(t), wait=waits.append) == 1
    assert len(waits) == 1


def test_run_cli_version_and_crash(monkeypatch, capsys):
    waits = []
    assert L.run_cli(["--version"], hold=False, wait=waits.append) == 0
    assert "colibri" in capsys.readouterr().out
    import colibri_tui.cli as cli

    def crash(argv):
        raise RuntimeError("kaput")
    monkeypatch.setattr(cli, "main", crash)
    assert L.run_cli([], hold=True, wait=waits.append) == 2
    assert "kaput" in capsys.readouterr().err and len(waits) == 1
    with pytest.raises(RuntimeError):
        L.run_cli([], hold=False, wait=waits.append)


def test_main_with_a_terminal_or_arguments_is_plain_coli(monkeypatch):
    import colibri_tui.cli as cli
    seen = []
    monkeypatch.setattr(cli, "main", lambda argv: seen.append(argv) or 0)
    monkeypatch.delenv(L.GUARD, raising=False)
    monkeypatch.delenv(L.FORCE_RELAUNCH, raising=False)
    assert L.main(["info", "--json"]) == 0
    assert seen == [["info", "--json"]]


# --- installers/build.py helpers (fast; the real build is tests/test_binary.py) ------------------

def _load_build():
    spec = importlib.util.spec_from_file_location("coli_build", ROOT / "installers" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


B = _load_build()


def test_binary_names():
    assert B.binary_name("0.1.0", "linux", "x86_64") == "coli-0.1.0-linux-x86_64"
    assert B.binary_name("0.1.0", "windows", B.arch_name("AMD64")) == "coli-0.1.0-windows-x86_64.exe"
    assert B.binary_name("1.2", "macos", B.arch_name("arm64")) == "coli-1.2-macos-arm64"
    assert B.arch_name("aarch64") == "arm64"
    assert B.os_name("win32") == "windows" and B.os_name("darwin") == "macos"
    assert B.os_name("linux") == "linux"


def test_native_flags_are_refused():
    B.check_no_native_flags({"CFLAGS": "-O3 -march=x86-64-v2"})  # an explicit baseline is fine
    for env in ({"CFLAGS": "-O2 -march=native"}, {"CXXFLAGS": "-mcpu=native"}, {"CL": "/arch:native"}):
        with pytest.raises(SystemExit):
            B.check_no_native_flags(env)


def test_setup_py_never_asks_for_native():
    assert B.native_flags_in_code((ROOT / "setup.py").read_text()) == []
    bad = '"""Never -march=native."""\n# -march=native\nARGS = ["-O3", "-march=native"]\n'
    assert B.native_flags_in_code(bad) == ["-march=native"]


def test_data_files_and_pyinstaller_args(tmp_path, monkeypatch):
    tui, models = tmp_path / "colibri_tui", tmp_path / "models"
    (tui / "css").mkdir(parents=True)
    (tui / "app.tcss").write_text("Screen {}")
    (tui / "css" / "extra.tcss").write_text("Screen {}")
    (models / "demo" / "qwen3-moe-demo").mkdir(parents=True)
    (models / "demo" / "qwen3-moe-demo" / "colibri.json").write_text("{}")
    (models / "catalog.toml").write_text("")
    (models / "catalog.py").write_text("")  # a module, not data
    monkeypatch.setattr(B, "ROOT", tmp_path / "nowhere")
    dirs = {"core": tmp_path / "core", "models": models, "cython_kernels": tmp_path / "ck",
            "colibri_tui": tui}
    for d in dirs.values():
        d.mkdir(exist_ok=True)
        (d / "__init__.py").write_text("")
    (tui / "app.py").write_text("")
    datas = B.data_files(dirs)
    assert (tui / "app.tcss", "colibri_tui") in datas
    assert (tui / "css" / "extra.tcss", "colibri_tui/css") in datas
    assert (models / "catalog.toml", "models") in datas
    assert not any(src.suffix == ".py" for src, _ in datas)
    assert (models / "demo", "models/demo") in datas
    assert B.our_modules("colibri_tui", tui) == ["colibri_tui", "colibri_tui.app"]
    so = tmp_path / "ck" / "qmatmul.so"
    args = B.pyinstaller_args("coli-x", tmp_path / "dist", tmp_path / "work", dirs, so, datas)
    line = " ".join(args)
    assert "--onefile" in args and "--console" in args and args[-1].endswith("launcher.py")
    assert "--collect-submodules textual.widgets" in line and "--collect-submodules textual" in line
    assert "--hidden-import cython_kernels.qmatmul" in line
    assert f"--add-binary {so}{os.pathsep}cython_kernels" in line
    assert f"--add-data {models / 'demo'}{os.pathsep}models/demo" in line
    assert "--copy-metadata colibri" in line and "--exclude-module torch" in line
    for m in ("jinja2", "platformdirs", "psutil", "huggingface_hub", "tokenizers"):
        assert f"--hidden-import {m}" in line


def test_windows_openmp_runtime_is_carried(tmp_path):
    pyd = tmp_path / "qmatmul.pyd"
    pyd.write_bytes(b"MZ...VCOMP140.DLL\0...")
    sysroot = tmp_path / "Windows"
    (sysroot / "System32").mkdir(parents=True)
    (sysroot / "System32" / "vcomp140.dll").write_bytes(b"")
    env = {"SystemRoot": str(sysroot), "PATH": ""}
    assert B.extra_runtime_libraries(pyd, "windows", env) == [sysroot / "System32" / "vcomp140.dll"]
    assert B.extra_runtime_libraries(pyd, "linux", env) == []
    pyd.write_bytes(b"MZ serial build")
    assert B.extra_runtime_libraries(pyd, "windows", env) == []
