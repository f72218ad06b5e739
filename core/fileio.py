"""Positioned reads and writes that work on every OS (os.pread/pwrite are POSIX-only)."""
from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

from .errors import ColiError

_HAVE_PREAD = hasattr(os, "preadv") and hasattr(os, "pwrite")
_seek_lock = threading.Lock()


def pread_into(f, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset``; returns bytes read (short only at end of file)."""
    got = 0
    while got < len(view):
        if _HAVE_PREAD:
            k = os.preadv(f.fileno(), [view[got:]], offset + got)
        else:  # Windows: seek + readinto under a lock
            with _seek_lock:
                f.seek(offset + got)
                k = f.readinto(view[got:])
        if not k:
            break
        got += k
    return got


def pwrite(f, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        if _HAVE_PREAD:
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
