"""Routing traces: which routed experts each layer asked for, position by position.

A trace is what ``coli run --trace FILE`` records and what ``coli replay`` scores cache policies
on. Text, so it diffs and greps::

    # colibri-trace 1 layers=<L> experts=<E> top_k=<k>
    <pos> <layer> <e1> <e2> ... <ek>
    ...

one line per (position, layer), experts in the router's rank order (best first). Blank lines and
further ``#`` lines are ignored by the reader.

Prefill runs a whole batch of positions through a layer at once (one store request for the union
of their experts), but the trace still gets one line per position, so a replay treats the prompt
as if it had been decoded token by token (see :func:`requests_per_layer`).

The writer streams into a temporary file next to the target and moves it into place with
``os.replace`` on :meth:`TraceWriter.close`, so a reader never sees half a trace.
"""
from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from core.errors import ColiError

FORMAT = "colibri-trace"
VERSION = 1
_HEADER = re.compile(r"^#\s*colibri-trace\s+(\S+)((?:\s+\S+=\S+)*)\s*$")


@dataclass
class Trace:
    layers: int
    experts: int
    top_k: int
    records: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    """(position, layer, experts in rank order), in file order."""

    @property
    def positions(self) -> int:
        """Number of distinct positions recorded."""
        return len({pos for pos, _, _ in self.records})


def _check_dims(layers: int, experts: int, top_k: int) -> None:
    for name, v in (("layers", layers), ("experts", experts), ("top_k", top_k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"trace {name} must be a positive integer, got {v!r}")
    if top_k > experts:
        raise ValueError(f"trace top_k={top_k} exceeds experts={experts}")


def _check_record(layers: int, experts: int, top_k: int, pos: int, layer: int,
                  ids: tuple[int, ...]) -> str | None:
    """The reason a record is invalid, or None."""
    if pos < 0:
        return f"position {pos} is negative"
    if not 0 <= layer < layers:
        return f"layer {layer} is outside 0..{layers - 1}"
    if not ids:
        return "no experts listed"
    if len(ids) > top_k:
        return f"{len(ids)} experts listed, top_k is {top_k}"
    for e in ids:
        if not 0 <= e < experts:
            return f"expert {e} is outside 0..{experts - 1}"
    if len(set(ids)) != len(ids):
        return f"expert listed twice in {' '.join(map(str, ids))}"
    return None


class TraceWriter:
    """Records routing decisions; the file appears (atomically) on :meth:`close`.

    Usable as a context manager; leaving the block closes the writer even on an exception (a
    trace of an interrupted generation is still a valid trace). :meth:`abort` discards it.
    """

    def __init__(self, path: str | os.PathLike, layers: int, experts: int, top_k: int):
        _check_dims(layers, experts, top_k)
        self.path = Path(path)
        self.layers, self.experts, self.top_k = layers, experts, top_k
        self.count = 0
        parent = self.path.parent
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=parent)
        except OSError as e:
            raise ColiError(f"cannot write trace {self.path}: {e.strerror or e}") from None
        self._tmp = Path(tmp)
        self._f = os.fdopen(fd, "w", encoding="ascii", newline="\n")
        self._f.write(f"# {FORMAT} {VERSION} layers={layers} experts={experts} top_k={top_k}\n")

    @property
    def closed(self) -> bool:
        return self._f is None

    def record(self, pos: int, layer: int, experts: Iterable[int]) -> None:
        """One position's routed experts for one layer, in router rank order."""
        if self._f is None:
            raise ValueError(f"trace {self.path} is already closed")
        pos, layer = int(pos), int(layer)
        ids = tuple(int(e) for e in experts)
        why = _check_record(self.layers, self.experts, self.top_k, pos, layer, ids)
        if why:
            raise ValueError(f"bad trace record (pos {pos}, layer {layer}): {why}")
        self._f.write(f"{pos} {layer} {' '.join(map(str, ids))}\n")
        self.count += 1

    def close(self) -> None:
        """Flush and move the trace into place. Idempotent."""
        if self._f is None:
            return
        f, self._f = self._f, None
        try:
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.chmod(self._tmp, 0o644)          # mkstemp makes it private; a trace is shareable
            os.replace(self._tmp, self.path)
        except OSError as e:
            f.close()
            self._tmp.unlink(missing_ok=True)
            raise ColiError(f"cannot write trace {self.path}: {e.strerror or e}") from None

    def abort(self) -> None:
        """Discard everything recorded; the target file is left untouched."""
        if self._f is None:
            return
        f, self._f = self._f, None
        f.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _parse_header(path: Path, line: str) -> tuple[int, int, int]:
    m = _HEADER.match(line.strip())
    if not m:
        raise ColiError(f"{path}:1: not a colibri trace (expected a first line "
                        f"'# {FORMAT} {VERSION} layers=L experts=E top_k=K')")
    if m.group(1) != str(VERSION):
        raise ColiError(f"{path}:1: trace format version {m.group(1)} is not supported "
                        f"(this build reads version {VERSION})")
    fields = dict(kv.split("=", 1) for kv in m.group(2).split())
    dims = []
    for key in ("layers", "experts", "top_k"):
        if key not in fields:
            raise ColiError(f"{path}:1: trace header lacks {key}=")
        try:
            v = int(fields[key])
        except ValueError:
            raise ColiError(f"{path}:1: trace header {key}={fields[key]!r} is not an integer") from None
        if v < 1:
            raise ColiError(f"{path}:1: trace header {key}={v} must be positive")
        dims.append(v)
    if dims[2] > dims[1]:
        raise ColiError(f"{path}:1: trace header top_k={dims[2]} exceeds experts={dims[1]}")
    return dims[0], dims[1], dims[2]


def read_trace(path: str | os.PathLike) -> Trace:
    """Parse a trace file. Anything wrong raises ColiError naming the file and line."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ColiError(f"cannot read trace {path}: {e.strerror or e}") from None
    trace = None
    try:
        with f:
            for lineno, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise ColiError(f"{path}:{lineno}: not a colibri trace (not text)") from None
                if trace is None:
                    trace = Trace(*_parse_header(path, line))
                    continue
                s = line.strip()
                if not s or s.startswith("#"):
                    continue
                parts = s.split()
                if len(parts) < 3:
                    raise ColiError(f"{path}:{lineno}: expected '<pos> <layer> <expert> ...', "
                                    f"got {s[:60]!r}")
                try:
                    nums = [int(p) for p in parts]
                except ValueError:
                    raise ColiError(f"{path}:{lineno}: non-integer field in {s[:60]!r}") from None
                pos, layer, ids = nums[0], nums[1], tuple(nums[2:])
                why = _check_record(trace.layers, trace.experts, trace.top_k, pos, layer, ids)
                if why:
                    raise ColiError(f"{path}:{lineno}: {why}")
                trace.records.append((pos, layer, ids))
    except OSError as e:
        raise ColiError(f"cannot read trace {path}: {e.strerror or e}") from None
    if trace is None:
        raise ColiError(f"{path}: empty file, not a colibri trace")
    return trace


def requests_per_layer(trace: Trace) -> dict[int, list[tuple[int, ...]]]:
    """Each layer's sequence of store requests, as the engine makes them while DECODING: one
    request (the position's top-k experts, rank order) per recorded position, in file order.

    Prefill batches are recorded per position too, so a prompt replays as if it had been decoded
    token by token (the live store sees one request per batch instead — the union of its
    positions' experts). File order, not sorted positions, so a trace holding several
    generations (positions restarting at 0) replays them one after the other. Only layers that
    have records appear (dense layers route nothing), in ascending order.
    """
    out: dict[int, list[tuple[int, ...]]] = {}
    for _, layer, ids in trace.records:
        out.setdefault(layer, []).append(ids)
    return dict(sorted(out.items()))
