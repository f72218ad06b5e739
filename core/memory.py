"""Process memory figures, portable across Linux, macOS and Windows."""
from __future__ import annotations

import mmap
import sys

import numpy as np
import psutil


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux: VmHWM, which unlike ru_maxrss is
    not inherited from the parent across fork+exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)
    except ImportError:  # Windows
        info = psutil.Process().memory_info()
        return int(getattr(info, "peak_wset", info.rss))


def rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def lazy_array(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """A zero-filled array in an anonymous mapping: its pages are mapped on first touch, 4 KiB at
    a time, so untouched parts cost address space only. (numpy's allocator asks for transparent
    huge pages on arrays of 4 MiB and more: a head-major KV cache touching one position per head
    then faulted -- and zeroed -- 2 MiB per head at once.)"""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=dtype, count=int(np.prod(shape))).reshape(shape)
