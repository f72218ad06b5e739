"""Entry point of the one-file binaries (PyInstaller): the `coli` command line, plus what a
double-click needs.

A double-clicked executable has no terminal: on Linux and macOS its stdin/stdout are not ttys; on
Windows Explorer gives it a fresh console window that vanishes the moment the program exits (the
"flashes and closes" complaint). So:

* started without a terminal and without arguments -> reopen ourselves in one
  (Linux: the first terminal emulator found on PATH; macOS: Terminal.app; Windows: ``cmd /k``),
  with ``COLI_RELAUNCHED=1`` in the child's environment so that it never reopens again;
* no terminal emulator (or no display) -> a clear message on stderr and in a log file under the
  user log directory, exit status 1;
* the reopened copy gets a clean environment (``child_environment``): a one-file binary's
  bootloader leaves private ``_PYI_*`` variables and an ``LD_LIBRARY_PATH`` into its unpack folder
  in our environment, and a copy that inherits them runs from that folder, which is deleted when we
  exit (``Failed to execute script 'pyi_rth_pkgutil'``);
* in a window we opened ourselves (or Windows' own console from a double-click) -> run the app and,
  if it fails or ends within a few seconds, keep the window open until Enter is pressed;
* anything else (a terminal, a pipe, arguments) -> exactly ``coli`` (``colibri_tui.cli.main``).

Everything up to ``main`` is pure logic over explicit arguments (argv, environment, platform, PATH,
isatty results), so tests/test_launcher.py checks it without a GUI. ``COLI_NO_RELAUNCH=1`` turns the
relaunch off; ``COLI_FORCE_RELAUNCH=1`` forces it (manual testing from a terminal).
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

GUARD = "COLI_RELAUNCHED"
NO_RELAUNCH = "COLI_NO_RELAUNCH"
FORCE_RELAUNCH = "COLI_FORCE_RELAUNCH"

# In order of preference; each entry is (program, arguments placed before the command to run).
LINUX_TERMINALS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("x-terminal-emulator", ("-e",)),   # Debian/Ubuntu alternatives; all of them accept -e CMD ARGS
    ("gnome-terminal", ("--",)),
    ("konsole", ("-e",)),
    ("xfce4-terminal", ("-x",)),        # -x: the rest of the line is the command (-e takes one string)
    ("kitty", ()),
    ("alacritty", ("-e",)),
    ("xterm", ("-e",)),
)

# A run that ends sooner than this (help text, an early error) keeps its window open.
FLASH_SECONDS = 3.0

# PyInstaller (>= 6.10) documents this for starting an independent copy of a one-file program: its
# bootloader then ignores the parent's unpack folder and unpacks afresh.
RESET_ENVIRONMENT = "PYINSTALLER_RESET_ENVIRONMENT"
# The bootloader's own variables (_MEIPASS2: PyInstaller < 6).
PRIVATE_PREFIXES = ("_PYI_", "_MEIPASS")
# Library search paths the bootloader points into its unpack folder; it keeps the user's value, if
# there was one, in NAME_ORIG (LIBPATH: AIX).
LIBRARY_PATHS = ("LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH", "LIBPATH")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def platform_kind(platform: str | None = None) -> str:
    """'windows', 'macos' or 'linux' (any other Unix counts as linux: X11/Wayland emulators)."""
    p = sys.platform if platform is None else platform
    if p.startswith("win") or p == "cygwin":
        return "windows"
    if p == "darwin":
        return "macos"
    return "linux"


def stream_is_tty(stream) -> bool:
    """isatty() that survives the streams a GUI launch gives us (None, closed, detached)."""
    if stream is None:
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def user_args(argv: Sequence[str]) -> list[str]:
    """The arguments a user gave; drops macOS Finder's process serial number (``-psn_0_1234``)."""
    return [a for a in argv if not a.startswith("-psn_")]


def has_display(env: Mapping[str, str], kind: str) -> bool:
    """Whether a graphical session exists to open a terminal window in."""
    if kind != "linux":
        return True
    return bool(env.get("DISPLAY") or env.get("WAYLAND_DISPLAY"))


def owns_console(process_count: int, frozen: bool) -> bool:
    """Windows: is the console ours alone (made by Explorer for a double-click)?

    ``GetConsoleProcessList`` counts the processes attached to the console. From cmd.exe or
    PowerShell the shell is one of them. A one-file PyInstaller binary runs as two processes (the
    bootloader and its child), so alone means <= 2 frozen, <= 1 as a plain script."""
    return 0 < process_count <= (2 if frozen else 1)


def windows_console_process_count() -> int:
    """Number of processes attached to our console (0 when there is none or not on Windows)."""
    if platform_kind() != "windows":
        return 0
    try:
        import ctypes
        buf = (ctypes.c_uint32 * 16)()
        return int(ctypes.windll.kernel32.GetConsoleProcessList(buf, 16))
    except Exception:
        return 0


@dataclass(frozen=True)
class Decision:
    action: str        # "run": call the CLI here; "relaunch": reopen in a terminal window
    hold: bool         # keep the window open when the run fails or flashes by
    reason: str


def decide(argv: Sequence[str], env: Mapping[str, str], stdin_tty: bool, stdout_tty: bool,
           kind: str, windows_own_console: bool = False) -> Decision:
    """What to do for this start. ``argv`` excludes the program name."""
    args = user_args(argv)
    relaunched = env.get(GUARD) == "1"
    if relaunched:
        # A window we opened: never reopen again (even if it somehow has no tty), and keep it
        # open on error so the message can be read (Windows' `cmd /k` keeps it open anyway).
        return Decision("run", kind != "windows", f"{GUARD}=1: already relaunched")
    if _truthy(env.get(NO_RELAUNCH)):
        return Decision("run", False, f"{NO_RELAUNCH} set")
    if _truthy(env.get(FORCE_RELAUNCH)):
        return Decision("relaunch", False, f"{FORCE_RELAUNCH} set")
    if kind == "windows" and windows_own_console and not args:
        # Explorer made this console for us; it closes when we exit. Run here and hold on error.
        return Decision("run", True, "own Windows console (double-click)")
    if args:
        return Decision("run", False, "arguments given: command-line use")
    if stdin_tty or stdout_tty:
        return Decision("run", False, "a terminal is attached")
    return Decision("relaunch", False, "no terminal and no arguments (double-click)")


def find_linux_terminal(path: str | None, which: Callable[..., str | None] = shutil.which
                        ) -> tuple[str, tuple[str, ...]] | None:
    """The first terminal emulator of LINUX_TERMINALS found on ``path``: (full path, prefix args)."""
    for name, prefix in LINUX_TERMINALS:
        found = which(name, path=path)
        if found:
            return found, prefix
    return None


def self_command(frozen: bool | None = None, executable: str | None = None,
                 script: str | None = None) -> list[str]:
    """How to start this program again: the binary itself, or python + this file."""
    frozen = bool(getattr(sys, "frozen", False)) if frozen is None else frozen
    executable = sys.executable if executable is None else executable
    if frozen:
        return [os.path.abspath(executable)]
    return [executable, os.path.abspath(script or __file__)]


def relaunch_command(kind: str, cmd: Sequence[str], env: Mapping[str, str],
                     which: Callable[..., str | None] = shutil.which) -> list[str] | None:
    """The command line that opens a terminal window running ``cmd`` with the relaunch guard,
    or None when this system has no terminal to open."""
    if kind == "windows":
        comspec = env.get("COMSPEC") or "cmd.exe"
        # /k keeps the window open after the program ends, whatever happened.
        return [comspec, "/k", subprocess.list2cmdline(list(cmd))]
    guarded = ["/usr/bin/env", f"{GUARD}=1", *cmd]   # the guard travels on the command line too
    if kind == "macos":
        osascript = which("osascript", path=env.get("PATH"))
        if osascript:
            line = "exec " + shlex.join(guarded)
            script = 'tell application "Terminal" to do script "{}"'.format(
                line.replace("\\", "\\\\").replace('"', '\\"'))
            return [osascript, "-e", script, "-e", 'tell application "Terminal" to activate']
        opener = which("open", path=env.get("PATH"))
        if opener and len(cmd) == 1:  # Terminal.app runs a plain executable (no guard, no args)
            return [opener, "-a", "Terminal", cmd[0]]
        return None
    if not has_display(env, kind):
        return None
    term = find_linux_terminal(env.get("PATH"), which)
    if term is None:
        return None
    exe, prefix = term
    return [exe, *prefix, *guarded]


def _inside(entry: str, folder: str, kind: str) -> bool:
    if kind == "windows":
        entry, folder = entry.lower().replace("/", "\\"), folder.lower().replace("/", "\\")
    return folder in entry


def _without_bundle(value: str, bundle_dir: str, kind: str) -> str | None:
    """``value`` without its path-list entries inside the unpack folder; None when none is left."""
    if not _inside(value, bundle_dir, kind):
        return value
    sep = ";" if kind == "windows" else ":"
    kept = [e for e in value.split(sep) if not _inside(e, bundle_dir, kind)]
    return sep.join(kept) if any(kept) else None


def child_environment(env: Mapping[str, str], bundle_dir: str | None, kind: str) -> dict[str, str]:
    """The environment for a fresh, independent copy of this program (and for the terminal
    emulator that starts it, which passes its environment on).

    ``bundle_dir`` is the one-file unpack folder (``sys._MEIPASS``) or None when not frozen. Drops
    the bootloader's private variables, restores each library path from its ``_ORIG`` copy (or
    drops it when the bootloader made it up), drops anything else that points into the unpack
    folder (it is deleted when we exit), and asks the next bootloader for a reset."""
    def norm(k: str) -> str:
        return k.upper() if kind == "windows" else k   # Windows' variable names ignore case
    saved = {norm(k)[:-len("_ORIG")]: k for k in env
             if norm(k).endswith("_ORIG") and norm(k)[:-len("_ORIG")] in LIBRARY_PATHS}
    out: dict[str, str] = {}
    for k, v in env.items():
        n = norm(k)
        if n.startswith(PRIVATE_PREFIXES) or n == RESET_ENVIRONMENT or k in saved.values():
            continue
        if n in LIBRARY_PATHS and n in saved:
            continue             # restored below
        if bundle_dir:
            v = _without_bundle(v, bundle_dir, kind)
            if v is None:
                continue
        out[k] = v
    for name, key in saved.items():
        out[name] = env[key]     # the user's own value, as the bootloader saved it
    out[RESET_ENVIRONMENT] = "1"
    return out


def log_path() -> Path:
    """launcher.log under the user log directory (platformdirs), or the temp dir without it."""
    try:
        import platformdirs
        base = Path(platformdirs.user_log_dir("colibri", appauthor=False))
    except Exception:
        import tempfile
        base = Path(tempfile.gettempdir()) / "colibri"
    return base / "launcher.log"


def no_terminal_message(kind: str, cmd: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    env = {} if env is None else env
    exe = cmd[-1] if cmd else "coli"
    if kind == "linux" and not has_display(env, kind):
        how = "there is no graphical display (DISPLAY and WAYLAND_DISPLAY are unset)"
    elif kind == "linux":
        how = ("no terminal emulator was found on PATH (looked for " +
               ", ".join(n for n, _ in LINUX_TERMINALS) + ")")
    elif kind == "macos":
        how = "Terminal.app could not be opened"
    else:
        how = "no console window could be opened"
    name = Path(exe).name
    return (f"colibri needs a terminal window, but {how}.\n"
            f"Open a terminal and run:\n    {exe if kind == 'windows' else shlex.join(list(cmd))}\n"
            f"(`{name} --help` lists the commands; `{name} run --help` generates without the "
            f"full-screen app.)")


def notify_desktop(message: str, env: Mapping[str, str],
                   which: Callable[..., str | None] = shutil.which,
                   popen: Callable[..., object] = subprocess.Popen) -> bool:
    """Linux, best effort: show the message where a double-clicking user can see it."""
    if not has_display(env, "linux"):
        return False
    for prog, args in (("notify-send", ("colibri",)), ("zenity", ("--error", "--text")),
                       ("kdialog", ("--error",))):
        exe = which(prog, path=env.get("PATH"))
        if exe:
            try:
                popen([exe, *args, message], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL, start_new_session=True)
                return True
            except OSError:
                continue
    return False


def report_no_terminal(message: str, stderr=None, path: Path | None = None) -> Path | None:
    """Print the message to stderr and append it, timestamped, to the log; returns the log path."""
    stderr = sys.stderr if stderr is None else stderr
    try:
        if stderr is not None:
            print(message, file=stderr)
    except Exception:
        pass
    path = log_path() if path is None else path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(time.strftime("%Y-%m-%d %H:%M:%S ") + message + "\n")
        return path
    except OSError:
        return None


def windows_command_line(line: Sequence[str]) -> str:
    """``"cmd.exe" /k ""C:\\path with spaces\\coli.exe" args"`` as one string: cmd.exe strips the
    outer quotes after /k and does not understand the backslash escapes a list would get."""
    comspec, switch, inner = line
    return f'"{comspec}" {switch} "{inner}"'


def relaunch(kind: str, cmd: Sequence[str], env: Mapping[str, str],
             popen: Callable[..., object] = subprocess.Popen, bundle_dir: str | None = None) -> int:
    """Open the terminal window (without waiting for it). 0 on success, 1 with a message if not.
    ``bundle_dir``: see ``child_environment``."""
    line = relaunch_command(kind, cmd, env)
    if line is None:
        message = no_terminal_message(kind, cmd, env)
        log = report_no_terminal(message)
        if kind == "linux":
            notify_desktop(message + (f"\n(also written to {log})" if log else ""), env)
        return 1
    child_env = child_environment(env, bundle_dir, kind)
    child_env[GUARD] = "1"
    kwargs = {"env": child_env, "stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL,
              "stderr": subprocess.DEVNULL}
    target: list[str] | str = line
    if kind == "windows":
        kwargs = {"env": child_env, "creationflags": getattr(subprocess, "CREATE_NEW_CONSOLE", 0x10)}
        target = windows_command_line(line)
    else:
        kwargs["start_new_session"] = True
    try:
        popen(target, **kwargs)
    except OSError as e:
        report_no_terminal(no_terminal_message(kind, cmd, env) + f"\n({line[0]}: {e})")
        return 1
    return 0


def should_pause(rc: int, elapsed_s: float) -> bool:
    """In a held window: pause when the run failed, or ended so fast it would just flash by."""
    return rc != 0 or elapsed_s < FLASH_SECONDS


def run_cli(argv: Sequence[str], hold: bool, clock: Callable[[], float] = time.monotonic,
            wait: Callable[[str], object] = input) -> int:
    """Run ``coli``; in a held window, keep it open on error until Enter."""
    start = clock()
    try:
        from colibri_tui.cli import main as coli_main
        rc = coli_main(list(argv))
        rc = 0 if rc is None else int(rc)
    except SystemExit as e:  # argparse --help/--version/errors
        code = e.code
        rc = code if isinstance(code, int) else (0 if code is None else 1)
        if not isinstance(code, int) and code is not None:
            print(code, file=sys.stderr)
    except BaseException as e:
        if not hold:
            raise
        import traceback
        traceback.print_exc()
        print(f"coli: crashed: {e.__class__.__name__}: {e}", file=sys.stderr)
        rc = 2
    if hold and should_pause(rc, clock() - start):
        try:
            wait(f"\n[colibri exited with status {rc}] press Enter to close this window ")
        except (EOFError, KeyboardInterrupt, OSError, RuntimeError):
            pass
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = os.environ
    kind = platform_kind()
    own = False
    if kind == "windows":
        own = owns_console(windows_console_process_count(), bool(getattr(sys, "frozen", False)))
    d = decide(argv, env, stream_is_tty(sys.stdin), stream_is_tty(sys.stdout), kind, own)
    if d.action == "relaunch":
        bundle = getattr(sys, "_MEIPASS", None) if getattr(sys, "frozen", False) else None
        return relaunch(kind, self_command() + user_args(argv), env, bundle_dir=bundle)
    return run_cli(user_args(argv), d.hold)


if __name__ == "__main__":
    import multiprocessing
    multiprocessing.freeze_support()
    sys.exit(main())
