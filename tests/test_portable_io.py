"""Positioned reads on every OS (core.fileio): Windows' Python has no os.pread / os.preadv /
os.pwrite, so the expert store reads through the compiled ``pread_into`` there (fileio.h: pread on
POSIX, ReadFile with an OVERLAPPED offset on Windows). On Linux the same fallback runs when those
functions are deleted before the package is imported, which is what the subprocess tests do:
convert, run with a pool small enough that experts stream from disk, same tokens."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from core import fileio
from tests.conftest import ROOT, tiny_config, write_hf_model

qmatmul = pytest.importorskip("cython_kernels.qmatmul")

# What Windows' os module lacks of the positional I/O Linux has.
POSIX_ONLY = ("pread", "preadv", "pwrite", "pwritev")
NO_POSIX_IO = "import os\nfor _n in %r:\n    if hasattr(os, _n): delattr(os, _n)\n" % (POSIX_ONLY,)


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(7).integers(0, 256, 3 * 4096 + 123, dtype=np.uint8).tobytes()
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("path_kind", ["preadv", "compiled", "seek"])
def test_every_read_path_reads_the_same_bytes(data_file, monkeypatch, path_kind):
    path, data = data_file
    if path_kind != "preadv":
        monkeypatch.setattr(fileio, "_preadv", None)
    if path_kind == "seek":
        monkeypatch.setattr(fileio, "_compiled_pread", None)
    elif path_kind == "compiled":
        monkeypatch.setattr(fileio, "_compiled_pread", qmatmul.pread_into)
    rng = np.random.default_rng(1)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        cases = [(0, len(data)), (5, 0), (len(data) - 10, 64), (len(data), 8), (len(data) + 100, 8)]
        cases += [(int(rng.integers(0, len(data))), int(rng.integers(1, 9000))) for _ in range(50)]
        for offset, n in cases:
            buf = bytearray(n)
            got = fileio.read_at(fd, memoryview(buf), offset)
            want = data[offset: offset + n]
            assert got == len(want) and bytes(buf[:got]) == want, (path_kind, offset, n)
        with open(path, "rb") as f:        # the file-object form the safetensors reader uses
            buf = bytearray(100)
            assert fileio.pread_into(f, memoryview(buf), 4000) == 100 and bytes(buf) == data[4000:4100]
    finally:
        os.close(fd)


def test_compiled_read_reports_os_errors(data_file):
    path, _ = data_file
    fd = os.open(path, os.O_RDONLY)
    os.close(fd)
    with pytest.raises(OSError) as e:
        qmatmul.pread_into(fd, memoryview(bytearray(16)), 0)
    assert e.value.errno == errno.EBADF
    with pytest.raises(ValueError):
        qmatmul.pread_into(0, memoryview(bytearray(16)), -1)


def test_compiled_reads_run_in_parallel_threads(data_file):
    """No shared file pointer: many threads reading one descriptor each get their own range."""
    path, data = data_file
    fd = os.open(path, os.O_RDONLY)
    bad = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(300):
            off, n = int(rng.integers(0, len(data))), int(rng.integers(1, 5000))
            buf = bytearray(n)
            got = qmatmul.pread_into(fd, memoryview(buf), off)
            if bytes(buf[:got]) != data[off: off + n]:
                bad.append((off, n))
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    assert not bad


def _coli_without_posix_io(args: list[str], **env_extra) -> subprocess.CompletedProcess:
    code = (NO_POSIX_IO +
            "import sys\nfrom core import fileio\nprint('read path', fileio.READ_PATH, file=sys.stderr)\n"
            "from colibri_tui.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("COLI_MODEL", "COLI_RAM_GB")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)


def test_convert_and_run_without_posix_positional_io(tmp_path, capsys):
    """The Windows path on Linux: convert (pwrite's fallback) and a run whose experts stream
    from disk (one slot per layer) give the tokens of the normal path."""
    from colibri_tui.cli import main as coli
    src = write_hf_model(tmp_path / "src", tiny_config(num_hidden_layers=2, num_experts=6))
    r = _coli_without_posix_io(["convert", str(src), str(tmp_path / "c"), "--bits", "4"])
    assert r.returncode == 0, r.stderr
    assert "read path compiled" in r.stderr
    assert coli(["convert", str(src), str(tmp_path / "ref"), "--bits", "4"]) == 0
    for name in ("layer-000.safetensors", "layer-001.safetensors", "model-other.safetensors"):
        assert (tmp_path / "c" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name
    args = ["run", "--model", str(tmp_path / "c"), "--ids", "1,2,3,4,5", "--max-new-tokens", "8",
            "--greedy", "--cap", "1", "--threads", "1", "--json"]
    r = _coli_without_posix_io(args)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    capsys.readouterr()
    assert coli(args) == 0
    want = json.loads(capsys.readouterr().out)
    assert got["ids"] == want["ids"] and len(got["ids"]) == 8
    assert got["stats"]["bytes_read"] > 0 and got["stats"]["bytes_read"] == want["stats"]["bytes_read"]


def test_demo_model_runs_without_posix_positional_io(tmp_path):
    from models import default_model
    if default_model() is None:
        pytest.skip("no embedded demo model in this checkout")
    r = _coli_without_posix_io(["run", "Hello", "--max-new-tokens", "4", "--seed", "1", "--cap", "2",
                                "--json"], COLI_DATA_DIR=str(tmp_path / "data"),
                               COLI_CONFIG_DIR=str(tmp_path / "cfg"))
    assert r.returncode == 0, r.stderr
    assert "internal error" not in r.stderr
    assert json.loads(r.stdout)["stats"]["new_tokens"] >= 1


@pytest.mark.parametrize("target", ["native", "windows"])
def test_fileio_header_on_its_own(tmp_path, target):
    """fileio.h compiled on its own and run: natively (POSIX pread), and for Windows with
    mingw-w64 under Wine where both are installed (apt-get install gcc-mingw-w64-x86-64 wine64),
    the only way its ReadFile branch runs on Linux. A sparse file past 4 GiB checks the offset's
    high half."""
    cc = "cc" if target == "native" else "x86_64-w64-mingw32-gcc"
    wine = shutil.which("wine64") or shutil.which("wine") or next(
        (p for p in ("/usr/lib/wine/wine64", "/usr/lib/wine/wine") if os.path.exists(p)), None)
    if shutil.which(cc) is None or (target == "windows" and wine is None):
        pytest.skip(f"needs {cc}" + (" and wine" if target == "windows" else ""))
    exe = tmp_path / ("check.exe" if target == "windows" else "check")
    r = subprocess.run([cc, "-O2", "-Wall", "-Wextra", "-Werror", "-I", str(ROOT / "cython_kernels"),
                        str(ROOT / "tests" / "native" / "pread_check.c"), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    size = (1 << 32) + 12345
    data = tmp_path / "sparse.bin"
    with open(data, "wb") as f:
        f.write(bytes(((i * 7 + i // 4096) & 255) for i in range(65536)))
        f.seek(size - 7)
        f.write(b"colibri")
    if target == "windows":
        cmd = [wine, str(exe), "Z:" + str(data).replace("/", "\\"), str(size)]
        env = dict(os.environ, WINEDEBUG="-all", WINEPREFIX=str(tmp_path / "wine"))
    else:
        cmd, env = [str(exe), str(data), str(size)], None
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr
