"""Machine limits measured in the same run as a benchmark: RAM read bandwidth, cold disk read
bandwidth, and a summary of the machine. Decode is bandwidth-bound, so every benchmark reports
its speed as a fraction of these limits (DESIGN.md, "measure against the limit").

    python benchmarks/common.py [PATH]     # print the summary, RAM bandwidth, disk bandwidth of PATH
"""
from __future__ import annotations

import mmap
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from multiprocessing.pool import ThreadPool
from pathlib import Path

import numpy as np

GiB = 1 << 30
MiB = 1 << 20


# --- RAM -------------------------------------------------------------------------------------------
def ram_read_gbps(threads: int = 1, nbytes: int = GiB, repeats: int = 5) -> float:
    """Read bandwidth in GB/s (1e9 B/s): best of ``repeats`` ``a.sum()`` over a ``nbytes`` float32
    array (1 GiB: far beyond any cache). With several threads each sums its own slice (numpy
    releases the GIL in reductions)."""
    a = np.ones(nbytes // 4, dtype=np.float32)       # written once, so every page is mapped
    parts = np.array_split(a, max(1, threads))
    best = float("inf")
    with ThreadPool(max(1, threads)) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            if threads > 1:
                pool.map(np.sum, parts)
            else:
                a.sum()
            best = min(best, time.perf_counter() - t0)
    del a, parts
    return nbytes / best / 1e9


# --- disk ------------------------------------------------------------------------------------------
def drop_page_cache() -> bool:
    """Write back dirty pages and drop the whole page cache (needs root). False if not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict_file(path: str | Path) -> bool:
    """Ask the kernel to drop one file's clean cached pages (no root needed; Linux honours it)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@dataclass
class DiskRead:
    gbps: float          # GB/s (1e9 B/s)
    method: str          # 'drop_caches+read' | 'O_DIRECT' | 'warm (page cache)' | ...
    nbytes: int
    seconds: float
    block: int
    files: int
    pattern: str = "sequential"

    def __str__(self) -> str:
        return (f"{self.gbps:.2f} GB/s ({self.method}, {self.pattern} {self.block / MiB:g} MiB reads, "
                f"{self.nbytes / 1e9:.2f} GB from {self.files} file{'s' * (self.files != 1)})")

    def as_dict(self) -> dict:
        return asdict(self)


def _files(path: Path, max_bytes: int) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted((p for p in path.iterdir() if p.is_file() and p.suffix == ".safetensors"),
                   key=lambda p: p.name) or sorted(p for p in path.iterdir() if p.is_file())
    chosen, total = [], 0
    for p in files:
        if total >= max_bytes:
            break
        chosen.append(p)
        total += p.stat().st_size
    return chosen


def _read_buffered(files: list[Path], block: int, max_bytes: int) -> int:
    buf = bytearray(block)
    view, done = memoryview(buf), 0
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while done < max_bytes:
                n = f.readinto(view)
                if not n:
                    break
                done += n
    return done


def _read_direct(files: list[Path], block: int, max_bytes: int) -> int:
    buf = mmap.mmap(-1, block)                    # page-aligned, as O_DIRECT needs
    view, done = memoryview(buf), 0
    try:
        for p in files:
            fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
            try:
                off = 0
                while done < max_bytes:
                    n = os.preadv(fd, [view], off)
                    if not n:
                        break
                    off += n
                    done += n
                    if n < block:
                        break
            finally:
                os.close(fd)
    finally:
        view.release()
        buf.close()
    return done


def disk_read_gbps(path: str | Path, max_bytes: int = 4 * GiB, block: int = 16 * MiB,
                   method: str = "auto") -> DiskRead:
    """Cold sequential read bandwidth of an existing big file (or of a directory's files in name
    order), ``block``-sized reads, at most ``max_bytes``.

    ``method``: 'auto' drops the page cache (root) and reads normally, else falls back to
    O_DIRECT (bypasses the cache; page-aligned mmap buffer); 'drop', 'direct' force one;
    'warm' reads without evicting anything (the page-cache speed if the files are cached)."""
    path = Path(path)
    files = _files(path, max_bytes)
    if not files:
        raise FileNotFoundError(f"{path}: nothing to read")
    use = method
    if method in ("auto", "drop"):
        if drop_page_cache():
            use = "drop_caches+read"
        elif method == "drop":
            raise PermissionError("cannot drop the page cache (needs root)")
        else:
            use = "O_DIRECT"
    elif method == "direct":
        use = "O_DIRECT"
    elif method == "warm":
        use = "warm (page cache)"
        _read_buffered(files, block, max_bytes)      # fill the cache first (if it fits in RAM)
    else:
        raise ValueError(f"unknown method {method!r}")
    if use == "O_DIRECT" and not hasattr(os, "O_DIRECT"):
        for p in files:
            evict_file(p)
        use = "fadvise(DONTNEED)+read"
    t0 = time.perf_counter()
    try:
        n = _read_direct(files, block, max_bytes) if use == "O_DIRECT" else \
            _read_buffered(files, block, max_bytes)
    except OSError as e:   # a filesystem without O_DIRECT (tmpfs): best effort without it
        if use != "O_DIRECT":
            raise
        for p in files:
            evict_file(p)
        use = f"fadvise(DONTNEED)+read (O_DIRECT failed: {e.strerror})"
        t0 = time.perf_counter()
        n = _read_buffered(files, block, max_bytes)
    dt = time.perf_counter() - t0
    return DiskRead(n / dt / 1e9, use, n, dt, block, len(files))


def disk_parallel_read_gbps(path: str | Path, block: int, threads: int = 4, max_bytes: int = GiB,
                            o_direct: bool = True, seed: int = 0) -> DiskRead:
    """Cold random reads of ``block`` bytes (e.g. one expert) at 4 KiB-aligned offsets spread
    over the files, ``threads`` at a time: the access pattern of the expert store's I/O pool.
    O_DIRECT (cache bypassed) by default, else after dropping the page cache."""
    import random

    path = Path(path)
    files = _files(path, 1 << 62)
    sizes = [p.stat().st_size for p in files]
    count = max(threads, max_bytes // block)
    rnd = random.Random(seed)
    jobs = []
    for _ in range(count):
        k = rnd.randrange(len(files))
        span = max(0, sizes[k] - block)
        jobs.append((k, rnd.randrange(0, span + 1) // 4096 * 4096))
    method = f"O_DIRECT, {threads} threads" if o_direct else f"drop_caches+read, {threads} threads"
    if not o_direct and not drop_page_cache():
        method = f"warm? (cannot drop the cache), {threads} threads"
    flags = os.O_RDONLY | (os.O_DIRECT if o_direct else 0)
    fds = [os.open(p, flags) for p in files]
    bufs = [mmap.mmap(-1, -(-block // 4096) * 4096) for _ in range(threads)]

    def work(t: int) -> int:
        view, n = memoryview(bufs[t]), 0
        for k, off in jobs[t::threads]:
            n += os.preadv(fds[k], [view], off)
        view.release()
        return n

    try:
        t0 = time.perf_counter()
        with ThreadPool(threads) as pool:
            n = sum(pool.map(work, range(threads)))
        dt = time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)
        for b in bufs:
            b.close()
    return DiskRead(n / dt / 1e9, method, n, dt, block, len(files), "random")


# --- the machine -----------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    want = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "neon", "asimd")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in want if w in have]
    except OSError:
        pass
    return []


def _disk_of(path: str | Path) -> str:
    """Block device and filesystem holding ``path`` (Linux), e.g. '/dev/vda ext4'."""
    try:
        path = os.path.realpath(path)
        best = ("", "", "")
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fs = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                    best = (dev, mnt, fs)
        return f"{best[0]} {best[2]} (mounted on {best[1]})" if best[0] else "?"
    except OSError:
        return "?"


def machine_summary(path: str | Path | None = None) -> dict:
    """CPU model and cores, RAM, OS, Python/numpy, and the disk holding ``path``."""
    import psutil

    vm = psutil.virtual_memory()
    d = {
        "cpu": _cpu_model(),
        "cores": f"{psutil.cpu_count(logical=False) or '?'} physical / {os.cpu_count()} logical",
        "cpu_flags": " ".join(_cpu_flags()) or "-",
        "ram": f"{vm.total / GiB:.1f} GiB ({vm.available / GiB:.1f} GiB available)",
        "os": platform.platform(),
        "python": f"{platform.python_version()}, numpy {np.__version__}",
    }
    if path is not None:
        d["disk"] = _disk_of(path)
    return d


def format_summary(d: dict) -> str:
    w = max(len(k) for k in d)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in d.items())


def main(argv: list[str]) -> None:
    path = Path(argv[0]) if argv else None
    print("machine:")
    print(format_summary(machine_summary(path)))
    for t in (1, 2):
        print(f"RAM read, {t} thread{'s' * (t > 1)}: {ram_read_gbps(t):.1f} GB/s")
    if path is not None:
        print(f"disk read, cold: {disk_read_gbps(path)}")
        print(f"disk read, O_DIRECT: {disk_read_gbps(path, method='direct')}")
        print(f"page cache read (warm): {disk_read_gbps(path, method='warm')}")
        for t in (1, 4):
            print(f"disk random 4 MiB reads: {disk_parallel_read_gbps(path, 4 * MiB, threads=t)}")


if __name__ == "__main__":
    main(sys.argv[1:])


def parse_shape(text: str) -> tuple[int, int]:
    """ROWSxCOLS (a --shapes item) as (rows, cols); one clear line otherwise."""
    o, _, i = text.partition("x")
    if not (o.isdigit() and i.isdigit()):
        raise SystemExit(f"error: a shape is ROWSxCOLS, got {text!r}")
    return int(o), int(i)
