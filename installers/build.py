"""Build the one-file executable: ``python installers/build.py`` -> dist/coli-<version>-<os>-<arch>[.exe].

Needs PyInstaller (``pip install .[build]``) and an installed colibri (``pip install .`` or
``pip install -e .``) whose compiled kernels import. The PyInstaller options are generated here
(``--print-args`` shows them; PyInstaller writes the equivalent .spec into the work directory):

* our packages (core, models, cython_kernels, colibri_tui) from wherever Python imports them, every
  submodule, and the compiled kernels (cython_kernels/qmatmul.*.so|pyd);
* Textual's lazily imported widgets and its data (``--collect-submodules textual`` covers
  ``textual.widgets._*``; without it the app dies with ``No module named textual.widgets._tab_pane``),
  rich's lazily imported unicode tables, tokenizers, jinja2, platformdirs, psutil, huggingface_hub;
* data: colibri_tui/**/*.tcss, models/catalog.*, the embedded demo model models/demo/**;
* package metadata (``coli --version`` reads colibri's through importlib.metadata).

The kernels are compiled by setup.py for the baseline of the architecture and pick their SIMD
variant at run time, so the binary runs on any CPU of its architecture. This script refuses to
build when CFLAGS (or similar) ask for ``-march=native``/``-mcpu=native``.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
ENTRY = HERE / "launcher.py"
OUR_PACKAGES = ("core", "models", "cython_kernels", "colibri_tui")
# Packages with imports PyInstaller cannot see (lazy/by-name): every submodule goes in.
COLLECT_SUBMODULES = ("textual", "rich", "tokenizers", "huggingface_hub", "platformdirs", "jinja2",
                      # coli serve: uvicorn loads its protocol, loop and logging classes by name,
                      # anyio its asyncio backend
                      "uvicorn", "starlette", "anyio", "h11")
COLLECT_DATA = ("textual", "rich")
HIDDEN = ("jinja2", "jinja2.ext", "jinja2.sandbox", "platformdirs", "psutil", "huggingface_hub",
          "tokenizers", "numpy", "tomllib")
METADATA = ("colibri", "textual", "rich", "tokenizers", "huggingface_hub", "numpy", "jinja2",
            "platformdirs", "psutil")
# Installed for tests/oracle/building but never needed at run time; some are huge (torch); click
# stays in: `import uvicorn` imports it (its command line). The
# huggingface_hub parts are its CLI and webhook server (downloads, HfApi and InferenceClient import
# fine without them; pydantic is optional there).
EXCLUDE = ("torch", "transformers", "safetensors", "tensorflow", "jax", "flax", "tkinter",
           "matplotlib", "scipy", "pandas", "IPython", "pytest", "_pytest", "Cython", "tests",
           "PIL", "sympy", "networkx", "pyarrow", "setuptools", "pkg_resources", "pydantic",
           "pydantic_core", "gradio", "fastapi", "huggingface_hub.cli",
           "huggingface_hub.commands", "huggingface_hub._webhooks_server")
NATIVE_FLAGS = re.compile(r"-m(arch|cpu|tune)=native|/arch:native", re.I)


def log(msg: str) -> None:
    print(f"build: {msg}", flush=True)


def fail(msg: str, code: int = 2) -> None:
    print(f"build: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def project_version() -> str:
    """colibri's version: the installed metadata, else pyproject.toml."""
    try:
        from importlib.metadata import version
        return version("colibri")
    except Exception:
        m = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
        if not m:
            fail("cannot determine colibri's version (install it: pip install .)")
        return m.group(1)


def os_name(plat: str | None = None) -> str:
    p = sys.platform if plat is None else plat
    if p.startswith("win"):
        return "windows"
    if p == "darwin":
        return "macos"
    return "linux" if p.startswith("linux") else p


def arch_name(machine: str | None = None) -> str:
    m = (platform.machine() if machine is None else machine).lower()
    return {"amd64": "x86_64", "x64": "x86_64", "x86-64": "x86_64", "aarch64": "arm64",
            "arm64": "arm64", "i686": "x86", "i386": "x86"}.get(m, m or "unknown")


def binary_name(version: str, osn: str | None = None, arch: str | None = None) -> str:
    osn = os_name() if osn is None else osn
    arch = arch_name() if arch is None else arch
    return f"coli-{version}-{osn}-{arch}" + (".exe" if osn == "windows" else "")


def check_no_native_flags(env=os.environ) -> None:
    for var in ("CFLAGS", "CPPFLAGS", "CXXFLAGS", "LDFLAGS", "ARCHFLAGS", "CL", "_CL_"):
        if NATIVE_FLAGS.search(env.get(var, "")):
            fail(f"{var} contains a -march=native style flag; the binary must run on any CPU of "
                 f"its architecture (the kernels dispatch SIMD at run time). Unset it and rebuild "
                 f"the kernels (pip install .).")
    setup_py = ROOT / "setup.py"
    if setup_py.exists() and native_flags_in_code(setup_py.read_text()):
        fail("setup.py passes a -march=native style flag; the binary would crash older CPUs")


def native_flags_in_code(source: str) -> list[str]:
    """String literals of a Python file (docstrings and comments aside) with a native-CPU flag."""
    import ast
    tree = ast.parse(source)
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
            and NATIVE_FLAGS.search(n.value)]


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        fail(f"package {name!r} is not importable; install colibri first (pip install .)")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def our_modules(pkg: str, pkg_dir: Path) -> list[str]:
    """Every Python module of one of our packages (editable installs hide them from PyInstaller's
    collect_submodules, so list the files)."""
    mods = []
    for f in sorted(pkg_dir.rglob("*.py")):
        if "__pycache__" in f.parts or any(p.startswith(".") for p in f.relative_to(pkg_dir).parts):
            continue
        rel = f.relative_to(pkg_dir).with_suffix("")
        parts = [pkg, *rel.parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods.append(".".join(parts))
    return mods


def kernel_extension() -> Path:
    """The compiled kernels' file; fails when they do not import (the binary must carry them)."""
    code = ("import cython_kernels.qmatmul as q; print(q.__file__); "
            "print(getattr(q, 'simd_level', lambda: '?')())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE)
    if r.returncode != 0:
        fail("the compiled kernels do not import (build them first: pip install . or "
             "python setup.py build_ext --inplace):\n" + r.stderr.strip()[-2000:])
    path, simd = r.stdout.split()[:2]
    log(f"kernels: {path} (SIMD on this machine: {simd})")
    return Path(path)


def extra_runtime_libraries(kernels: Path, osn: str | None = None, env=os.environ) -> list[Path]:
    """Runtime DLLs the kernels need that PyInstaller would leave out.

    Windows: MSVC's OpenMP runtime (vcomp140.dll) lives in System32 when the VC++ redistributable
    is installed, and PyInstaller never collects DLLs from the Windows directory, so a machine
    without the redistributable could not load the kernels. Linux's libgomp and Homebrew's libomp
    are collected by PyInstaller's own dependency analysis."""
    if (os_name() if osn is None else osn) != "windows":
        return []
    try:
        blob = kernels.read_bytes().lower()
    except OSError:
        return []
    out = []
    for dll in ("vcomp140.dll",):
        if dll.encode() not in blob:
            continue
        dirs = [Path(sys.executable).parent, Path(env.get("SystemRoot", r"C:\Windows")) / "System32",
                *[Path(p) for p in env.get("PATH", "").split(os.pathsep) if p]]
        for d in dirs:
            if (d / dll).is_file():
                out.append(d / dll)
                break
        else:
            log(f"warning: the kernels need {dll} but it was not found; the binary will need the "
                f"Visual C++ redistributable")
    return out


def data_files(dirs: dict[str, Path]) -> list[tuple[Path, str]]:
    """(source, destination folder inside the bundle) for our data files."""
    out: list[tuple[Path, str]] = []
    for pkg in ("colibri_tui", "models"):
        base = dirs[pkg]
        fallback = ROOT / pkg  # declared-as-package-data or not: take it from the checkout too
        for pattern in ("**/*.tcss", "catalog.*"):
            found = sorted(base.glob(pattern)) or (sorted(fallback.glob(pattern))
                                                   if fallback != base else [])
            for f in found:
                if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".py", ".pyc"):
                    root = base if f.is_relative_to(base) else fallback
                    out.append((f, str(Path(pkg, f.relative_to(root).parent).as_posix())))
    demo = dirs["models"] / "demo"
    if not demo.is_dir() and (ROOT / "models" / "demo").is_dir():
        demo = ROOT / "models" / "demo"
    if demo.is_dir() and any(demo.rglob("*")):
        out.append((demo, "models/demo"))
    return out


def pyinstaller_args(name: str, dist: Path, work: Path, dirs: dict[str, Path], kernels: Path | None,
                     datas: list[tuple[Path, str]], strip: bool = False, clean: bool = False,
                     binaries: list[Path] = ()) -> list[str]:
    sep = os.pathsep  # PyInstaller's SRC<sep>DEST separator (';' on Windows, ':' elsewhere)
    roots = sorted({str(d.parent) for d in dirs.values()})
    args = ["--noconfirm", *(["--clean"] if clean else []), "--onefile", "--console", "--name", name,
            "--distpath", str(dist), "--workpath", str(work / "work"), "--specpath", str(work)]
    for r in roots:
        args += ["--paths", r]
    for pkg, d in dirs.items():
        for m in our_modules(pkg, d):
            args += ["--hidden-import", m]
    if kernels is not None:
        args += ["--hidden-import", "cython_kernels.qmatmul",
                 "--add-binary", f"{kernels}{sep}cython_kernels"]
    for b in binaries:
        args += ["--add-binary", f"{b}{sep}."]
    for p in COLLECT_SUBMODULES:
        args += ["--collect-submodules", p]
    args += ["--collect-submodules", "textual.widgets"]  # explicit, per the known failure
    for p in COLLECT_DATA:
        args += ["--collect-data", p]
    for p in HIDDEN:
        args += ["--hidden-import", p]
    for p in METADATA:
        args += ["--copy-metadata", p]
    for p in EXCLUDE:
        args += ["--exclude-module", p]
    for src, dest in datas:
        args += ["--add-data", f"{src}{sep}{dest}"]
    if strip:
        args.append("--strip")
    args.append(str(ENTRY))
    return args


def smoke(exe: Path) -> float:
    t = time.perf_counter()
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLI_NO_RELAUNCH": "1"})
    dt = time.perf_counter() - t
    out = (r.stdout + r.stderr).strip()
    if r.returncode != 0 or "colibri" not in out:
        fail(f"{exe.name} --version failed (status {r.returncode}): {out}")
    log(f"{exe.name} --version -> {out!r} in {dt:.2f} s")
    return dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dist", type=Path, default=ROOT / "dist", help="output folder (default: dist/)")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "pyinstaller",
                    help="PyInstaller's work folder (default: build/pyinstaller/)")
    ap.add_argument("--name", help="executable name (default: coli-<version>-<os>-<arch>)")
    ap.add_argument("--strip", action="store_true", help="strip symbols (Linux/macOS; smaller)")
    ap.add_argument("--clean", action="store_true", help="drop PyInstaller's cache first")
    ap.add_argument("--no-smoke", action="store_true", help="do not run `--version` afterwards")
    ap.add_argument("--print-args", action="store_true", help="print PyInstaller's arguments and stop")
    args = ap.parse_args(argv)

    check_no_native_flags()
    version = project_version()
    name = args.name or binary_name(version)
    if name.endswith(".exe"):
        name = name[:-4]
    dirs = {p: package_dir(p) for p in OUR_PACKAGES}
    kernels = kernel_extension()
    datas = data_files(dirs)
    for src, dest in datas:
        log(f"data: {src} -> {dest}/")
    if not any(dest == "models/demo" for _, dest in datas):
        log("note: no embedded demo model (models/demo/ is absent); the binary will need --model")
    pargs = pyinstaller_args(name, args.dist.resolve(), args.work.resolve(), dirs, kernels, datas,
                             strip=args.strip, clean=args.clean,
                             binaries=extra_runtime_libraries(kernels))
    if args.print_args:
        print(shlex.join(["pyinstaller", *pargs]))
        return 0
    if importlib.util.find_spec("PyInstaller") is None:
        fail("PyInstaller is not installed: pip install '.[build]' (or pip install pyinstaller)")
    args.work.mkdir(parents=True, exist_ok=True)
    log(f"building {name} with PyInstaller (this takes a few minutes)")
    t = time.perf_counter()
    # cwd = the work folder, so that the checkout is not put on the search path by accident:
    # only --paths decide where our packages come from.
    r = subprocess.run([sys.executable, "-m", "PyInstaller", *pargs], cwd=args.work)
    if r.returncode != 0:
        fail(f"PyInstaller failed (status {r.returncode})", r.returncode)
    exe = args.dist.resolve() / (name + (".exe" if os_name() == "windows" else ""))
    if not exe.exists():
        fail(f"PyInstaller finished but {exe} is missing")
    log(f"built {exe} ({exe.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t:.0f} s")
    if not args.no_smoke:
        smoke(exe)
    print(exe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
