"""Process memory figures, portable across Linux, macOS and Windows."""
from __future__ import annotations

import sys

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
