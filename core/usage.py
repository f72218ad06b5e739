"""The expert usage history (``.coli_usage``), in colibrì's text format.

::

    -1 <layers> <experts>
    -2 1 <engine_id>
    <layer> <expert> <count>
    ...

Sparse: only experts with a non-zero count have a line. The header records have a negative
layer field so that colibrì's older readers (``fscanf("%d %d %u")`` guarded by ``layer >= 0``)
skip them. ``engine_id`` must be numeric for those readers, so, as colibrì does, we write the
FNV-1a 32-bit hash of the engine name (``engine_hash``). Counts are integers while they are
integral; after a save with ``decay`` < 1 they may become fractional and are then written as
floats (colibrì itself rounds them to integers; its C reader stops at the first fractional
count — see ``save_usage``).

Reading never raises: a missing file is an empty history; an unreadable, corrupt or mismatched
one (another model's dimensions) is ignored with one warning line on stderr. A file without the
``-1`` header (colibrì's legacy layout) is accepted when its records fit the model. Writes are
atomic (temporary file + ``os.replace``); an all-zero history is written as an empty file, as
colibrì does.
"""
from __future__ import annotations

import math
import os
import stat
import sys
from pathlib import Path

from core.fileio import atomic_write_text

FORMAT_VERSION = 1
DEFAULT_ENGINE = "colibri-py"


def engine_hash(name: str) -> int:
    """FNV-1a 32-bit of the engine name: colibrì's numeric engine id."""
    h = 2166136261
    for b in name.encode("utf-8"):
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h


def _warn(path, why: str) -> None:
    print(f"coli: warning: ignoring usage history {path}: {why}", file=sys.stderr)


def load_usage(path: str | os.PathLike, layers: int, experts: int) -> dict[tuple[int, int], float]:
    """``{(layer, expert): count}`` from a usage file (duplicate records add up).

    Missing file -> ``{}``. Unreadable, corrupt, or written for other dimensions -> ``{}`` plus a
    one-line warning on stderr. Never raises.
    """
    path = Path(path)
    try:
        if not stat.S_ISREG(path.stat().st_mode):     # a FIFO would block the read for ever
            _warn(path, "not a regular file")
            return {}
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        _warn(path, e.strerror or str(e))
        return {}
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        _warn(path, "not a text usage file")
        return {}
    counts: dict[tuple[int, int], float] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 3:
            _warn(path, f"line {lineno}: expected '<layer> <expert> <count>'")
            return {}
        try:
            layer = int(parts[0])
        except ValueError:
            _warn(path, f"line {lineno}: layer {parts[0]!r} is not an integer")
            return {}
        if layer < 0:
            if layer == -1:
                try:
                    dims = int(parts[1]), int(parts[2])
                except ValueError:
                    _warn(path, f"line {lineno}: bad dimension record")
                    return {}
                if dims != (layers, experts):
                    _warn(path, f"history is {dims[0]} layers x {dims[1]} experts, "
                                f"this model is {layers} x {experts}")
                    return {}
            elif layer == -2:
                try:
                    version = int(parts[1])
                except ValueError:
                    _warn(path, f"line {lineno}: bad format version {parts[1]!r}")
                    return {}
                if version > FORMAT_VERSION:
                    _warn(path, f"format version {version}, this build reads {FORMAT_VERSION}")
                    return {}
            continue  # other negative records: reserved for future headers, as in colibrì
        try:
            expert, count = int(parts[1]), float(parts[2])
        except ValueError:
            _warn(path, f"line {lineno}: bad record {line.strip()[:60]!r}")
            return {}
        if not 0 <= layer < layers or not 0 <= expert < experts:
            _warn(path, f"line {lineno}: expert ({layer}, {expert}) is outside "
                        f"{layers} layers x {experts} experts")
            return {}
        if not math.isfinite(count) or count < 0:
            _warn(path, f"line {lineno}: bad count {parts[2]!r}")
            return {}
        if count:
            counts[(layer, expert)] = counts.get((layer, expert), 0) + count
    if not math.isfinite(sum(counts.values())):     # each finite, their sum not: unusable
        _warn(path, "the counts add up to more than a float holds")
        return {}
    return counts


def save_usage(path: str | os.PathLike, counts: dict[tuple[int, int], float], layers: int,
               experts: int, engine_id: str | int = DEFAULT_ENGINE, decay: float = 1.0) -> None:
    """Write ``counts`` atomically, each multiplied by ``decay`` first when decay != 1.

    ``engine_id`` is a name (hashed with ``engine_hash``) or an already-numeric id. Zero counts are
    left out; an all-zero history gives an empty file. Counts are rounded to integers (colibrì's
    ``c*d+0.5``), which its C reader requires. Bad arguments raise ValueError; a failed write raises ColiError
    (and leaves the previous file untouched, no temporary file behind).
    """
    if not 0 < decay <= 1 or not math.isfinite(decay):
        raise ValueError(f"usage decay must be in (0, 1], got {decay}")
    eid = engine_id if isinstance(engine_id, int) else engine_hash(str(engine_id))
    rows = []
    for (layer, expert), c in sorted(counts.items()):
        if not 0 <= layer < layers or not 0 <= expert < experts:
            raise ValueError(f"usage count for ({layer}, {expert}) is outside "
                             f"{layers} layers x {experts} experts")
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"usage count for ({layer}, {expert}) is {c}")
        c = int(c * decay + 0.5)       # integers, rounded as colibrì does, so its reader loads them
        if c:
            rows.append(f"{layer} {expert} {c}\n")
    text = "" if not rows else (f"-1 {layers} {experts}\n-2 {FORMAT_VERSION} {eid}\n" + "".join(rows))
    atomic_write_text(path, text)


def counts_from_trace(trace) -> dict[tuple[int, int], int]:
    """``{(layer, expert): times routed}`` over every record of a ``core.trace.Trace``."""
    counts: dict[tuple[int, int], int] = {}
    for _, layer, ids in trace.records:
        for e in ids:
            counts[(layer, e)] = counts.get((layer, e), 0) + 1
    return counts


def usage_path(model_dir: str | os.PathLike, shipped: bool = False) -> Path:
    """Where a model's history lives: ``.coli_usage`` beside the model when that directory is
    writable (colibrì's place), else under the user data dir, keyed by the model's path.
    ``shipped``: a model installed with the program (the embedded demo) -- its folder belongs to
    the installation, so its history is always user data."""
    model_dir = Path(model_dir).resolve()
    bundle = getattr(sys, "_MEIPASS", None)      # a one-file binary unpacks to a new temp dir per run
    bundled = bundle is not None and model_dir.is_relative_to(Path(bundle).resolve())
    if os.access(model_dir, os.W_OK) and not bundled and not shipped:
        return model_dir / ".coli_usage"
    import hashlib

    from core.userdirs import data_dir
    key = "shipped" if bundled or shipped else hashlib.sha1(str(model_dir).encode()).hexdigest()[:16]
    d = data_dir() / "usage"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{model_dir.name}-{key}.coli_usage"
