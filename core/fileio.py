"""Positioned reads and writes that work on every OS (os.pread/preadv/pwrite are POSIX-only).

Reads, by what the platform has (``READ_PATH`` names the one in use):

* ``preadv``: Python's ``os.preadv`` (Linux, macOS, BSD); releases the GIL;
* ``compiled``: ``cython_kernels.qmatmul.pread_into`` (``fileio.h``: ``pread`` on POSIX, ``ReadFile``
  with an OVERLAPPED offset on Windows), also without the GIL and without a shared file pointer,
  so the expert store's I/O threads read in parallel on Windows too;
* ``seek``: seek + read under a lock, only if the compiled kernels are missing (a broken build).
"""
from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

from .errors import ColiError

_preadv = getattr(os, "preadv", None)
_compiled_pread = None
if _preadv is None:
    try:
        from cython_kernels.qmatmul import pread_into as _compiled_pread
    except ImportError:  # pragma: no cover - a broken build; the seek path still works
        _compiled_pread = None
READ_PATH = "preadv" if _preadv is not None else "compiled" if _compiled_pread is not None else "seek"
_HAVE_PWRITE = hasattr(os, "pwrite")
_seek_lock = threading.Lock()


def _seek_read(fd: int, view: memoryview, offset: int) -> int:
    with _seek_lock:
        os.lseek(fd, offset, os.SEEK_SET)
        data = os.read(fd, len(view))
    view[: len(data)] = data
    return len(data)


def read_at(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` (writable, bytes) from byte ``offset`` of descriptor ``fd``; returns the bytes
    read, fewer than ``len(view)`` only at end of file. OSError as the OS reports it."""
    view = memoryview(view).cast("B")
    got = 0
    while got < len(view):
        rest = view[got:]
        if _preadv is not None:
            k = _preadv(fd, [rest], offset + got)
        elif _compiled_pread is not None:
            k = _compiled_pread(fd, rest, offset + got)
        else:
            k = _seek_read(fd, rest, offset + got)
        if not k:
            break
        got += k
    return got


def pread_into(f, view: memoryview, offset: int) -> int:
    """``read_at`` on an open file object."""
    return read_at(f.fileno(), view, offset)


def pwrite(f, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        if _HAVE_PWRITE:
            k = os.pwrite(f.fileno(), view, offset)
        else:
            with _seek_lock:
                f.seek(offset)
                k = f.write(view)
        view, offset = view[k:], offset + k


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync, ``os.replace``: readers see the
    old file or the new one, never a half-written one. ColiError on failure (temp file removed)."""
    path = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise ColiError(f"cannot write {path}: {e.strerror or e}") from None
