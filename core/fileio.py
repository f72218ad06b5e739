"""Positioned reads and writes that work on every OS (os.pread/pwrite are POSIX-only)."""
from __future__ import annotations

import os
import threading

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
