"""The OS page cache as a tier: buffered expert reads that the kernel serves from memory.

Nobody budgets it: the memory the RAM budget leaves free is the OS's, and it keeps recently read
file pages there. With a small expert pool most of the speed can come from it (issue 20: 61.5 %
of the misses of one run never reached the disk). We say when it does, measured:

* Linux: ``/proc/self/io`` ``read_bytes``, the bytes this process (all its threads) caused to be
  fetched from storage, against the bytes the store asked for;
* elsewhere (no per-process storage counter: macOS has none psutil exposes, Windows' counts
  cached reads too): each read's speed -- one faster than CACHED_READ_GBPS came from memory.
"""
from __future__ import annotations

# A 3 MB expert read at queue depth <= 4 from a fast NVMe SSD runs at 1-3.5 GB/s; a page-cache
# copy at 5-20 GB/s. Only the fallback uses it.
CACHED_READ_GBPS = 5.0
# the share of misses served from memory above which coli plan / the tier panel call the page
# cache a tier
TIER_SHARE = 0.10


def disk_read_bytes() -> int | None:
    """Bytes this process has had fetched from storage so far, or None where the OS does not say."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def served_share(requested: int, from_disk: int) -> float:
    """The share of ``requested`` bytes that did not come from the disk (readahead can make
    from_disk exceed requested: then 0)."""
    if requested <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - from_disk / requested))


def describe(share: float | None, source: str | None) -> str:
    """One line for coli run / the tier panel."""
    if share is None:
        return "unknown"
    how = " (io counters)" if source == "io" else " (read times)" if source == "timing" else ""
    return f"{share:.0%} of missed bytes from the OS page cache{how}"
