"""Checksums of a container's shards: a flipped bit in the weights is otherwise undetectable.

The converter records, per shard, the SHA-256 of the whole file and of its header in
``colibri.json`` (``checksums``: shard name -> {"sha256": hex, "header_sha256": hex}) as it
finishes the shard -- read back at once, while the file is most likely still in the page cache --
and keeps them in the resume journal, so a resumed conversion does not hash again.

* At open, every shard's header digest is checked (headers are small): an edited header is
  refused even where it stays self-consistent (two same-sized dtypes swapped, say).
* ``verify`` re-hashes every whole shard (the MTP shards listed under ``"mtp"`` too); ``coli
  verify`` and the setup wizard's verify step use it. The expert store does not hash the weights
  on the hot path (hashing runs at ~1-2 GB/s on one core, slower than a decode step's reads):
  damage to the weight bytes is ``coli verify``'s.

Containers converted before checksums existed have none: they open as before (their headers and
manifest are still validated) and ``verify`` says their checksums are unrecorded.
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import ColiError

ALGORITHM = "sha256"
CHUNK = 8 << 20


def shard_checksums(path: Path) -> dict[str, str]:
    """The manifest's record for one shard: the file's digest and its header's."""
    from .safetensors_io import SafetensorsFile
    with SafetensorsFile(path) as f:
        header = f.header_sha256
    return {ALGORITHM: shard_digest(path), "header_" + ALGORITHM: header}


def shard_digest(path: Path, progress: Callable[[int], None] | None = None,
                 cancel: threading.Event | None = None) -> str:
    """SHA-256 of a file, read in 8 MiB chunks (``progress(n)`` after each)."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            if cancel is not None and cancel.is_set():
                raise ColiError("verification cancelled")
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            if progress is not None:
                progress(n)
    return h.hexdigest()


@dataclass
class VerifyResult:
    checked: list[str] = field(default_factory=list)     # shards whose digest matched
    damaged: list[str] = field(default_factory=list)     # "name: why"
    unrecorded: bool = False                             # the container predates checksums

    @property
    def ok(self) -> bool:
        return not self.damaged and not self.unrecorded


def verify(directory: str | Path, progress: Callable[[int, int, str], None] | None = None,
           cancel: threading.Event | None = None) -> VerifyResult:
    """Re-hash every shard of the container in ``directory`` against colibri.json's checksums.
    ``progress(done_bytes, total_bytes, shard)``. ColiError when the manifest cannot be read."""
    from .container import MANIFEST
    d = Path(directory)
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except FileNotFoundError:
        raise ColiError(f"{d} is not a colibrì container (no {MANIFEST})") from None
    except (OSError, ValueError, RecursionError) as e:
        raise ColiError(f"{d}: cannot read {MANIFEST} ({e.__class__.__name__})") from None
    sums = manifest.get("checksums") if isinstance(manifest, dict) else None
    shards = manifest.get("shards") if isinstance(manifest, dict) else None
    if not isinstance(shards, list) or not all(isinstance(s, str) for s in shards):
        raise ColiError(f"{d}: {MANIFEST} has no valid list of shards")
    mtp = manifest.get("mtp")          # MTP layers set aside by the converter: checked the same
    aside = mtp.get("shards", []) if isinstance(mtp, dict) else []
    if not isinstance(aside, list) or not all(isinstance(s, str) for s in aside):
        raise ColiError(f"{d}: {MANIFEST} has no valid list of MTP shards")
    shards = shards + [s for s in aside if s not in shards]
    result = VerifyResult()
    if not isinstance(sums, dict) or not sums:
        result.unrecorded = True
        return result
    total = sum((d / s).stat().st_size for s in shards if (d / s).is_file())
    done = 0
    for s in shards:
        p, rec = d / s, sums.get(s)
        want = rec.get(ALGORITHM) if isinstance(rec, dict) else None
        if not isinstance(want, str):
            result.damaged.append(f"{s}: no checksum recorded")
            continue
        if Path(s).name != s or not p.is_file():
            result.damaged.append(f"{s}: missing")
            continue

        def step(n: int, _s=s) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(done, total, _s)
        got = shard_digest(p, step, cancel)
        (result.checked if got == want else result.damaged).append(
            s if got == want else f"{s}: checksum mismatch (the file's bytes changed)")
    return result
