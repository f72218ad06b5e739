"""Reading and writing safetensors files ourselves.

Why not only the ``safetensors`` package: its numpy loader cannot return BF16 or FP8 tensors, it
reads whole tensors (we stream row blocks so conversion memory stays bounded), and its writer
orders tensors by dtype, which would split an expert's U8 weights from its F32 scales. The format is
small (8-byte little-endian header length, a JSON header, a flat data buffer) and the files we write
open with any safetensors reader (tests check this with the stock package).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ColiError
from .fileio import pread_into, pwrite

# safetensors dtype -> (numpy storage dtype, bytes per element)
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"), "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "U16": np.dtype("<u2"), "U32": np.dtype("<u4"), "U64": np.dtype("<u8"),
    "BOOL": np.dtype("?"), "F8_E8M0": np.dtype("u1"),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
MAX_HEADER = 256 * 1024 * 1024


def _fp8_e4m3_table() -> np.ndarray:
    """float32 value of every E4M3 (fn: no inf, 0x7F/0xFF = NaN) byte."""
    b = np.arange(256, dtype=np.int32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).astype(np.float64)
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = sign * val
    val[(b & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


def _fp8_e5m2_table() -> np.ndarray:
    # E5M2 is the top byte of an IEEE half.
    return (np.arange(256, dtype=np.uint16) << 8).view(np.float16).astype(np.float32)


def _e8m0_table() -> np.ndarray:
    """float32 value of every UE8M0 byte (a scale: 2^(b - 127), 255 = NaN; 2^-127 is subnormal)."""
    val = np.full(256, np.nan, dtype=np.float32)
    val[:255] = np.ldexp(np.float64(1.0), np.arange(255) - 127)
    return val


# F8_E8M0 (UE8M0) is a scale format only (DeepSeek V4's block scales): decoded, never a weight's
_FP8_TABLES = {"F8_E4M3": _fp8_e4m3_table(), "F8_E5M2": _fp8_e5m2_table(), "F8_E8M0": _e8m0_table()}


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Decode stored elements of a float dtype to float32 (exact for every dtype but F64)."""
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype in _FP8_TABLES:
        return _FP8_TABLES[dtype][raw]
    if dtype in FLOAT_DTYPES:
        return raw.astype(np.float32)
    raise ColiError(f"tensor dtype {dtype} is not a floating-point type")


def bf16_from_float32(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> BF16 bits (uint16)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + np.uint32(0x7FFF) + ((u >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int   # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """Random access to one safetensors file with a validated header (no mmap: pread only)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._f = open(self.path, "rb", buffering=0)
        except FileNotFoundError:
            raise ColiError(f"{self.path}: file not found") from None
        except OSError as e:
            raise ColiError(f"{self.path}: cannot open ({e.strerror})") from None
        try:
            self._parse_header()
        except BaseException:
            self._f.close()
            raise

    def _parse_header(self) -> None:
        size = os.fstat(self._f.fileno()).st_size
        head = bytes(self.pread(min(8, size), 0))
        if len(head) < 8:
            raise ColiError(f"{self.path.name} is truncated or not a safetensors file ({size} bytes)")
        n = int.from_bytes(head, "little")
        if n <= 0 or n > MAX_HEADER or 8 + n > size:
            raise ColiError(f"{self.path.name} is corrupt or truncated: bad header length {n} "
                            f"for a {size}-byte file")
        blob = bytes(self.pread(n, 8))
        # the header's digest: a container records it per shard (core.integrity) and checks it at
        # open, so an edited header cannot change what is read even where it stays consistent
        self.header_sha256 = hashlib.sha256(head + blob).hexdigest()
        try:
            header = json.loads(blob, object_pairs_hook=_no_duplicate_keys)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, _DuplicateKey) as e:
            why = f"names {e} twice" if isinstance(e, _DuplicateKey) else "is not valid JSON"
            raise ColiError(f"{self.path.name} is corrupt: its header {why}") from None
        if not isinstance(header, dict):
            raise ColiError(f"{self.path.name} is corrupt: its header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise ColiError(f"{self.path.name} is corrupt: its __metadata__ is not a JSON object")
        self.metadata: dict = meta
        base = 8 + n
        self.data_start = base
        self.tensors: dict[str, TensorInfo] = {}
        for name, h in header.items():
            dtype, shape, (a, b) = self._entry(name, h)
            self.tensors[name] = TensorInfo(name, dtype, shape, base + a, base + b)
        # As the stock reader validates: the tensors tile the data buffer exactly -- in order of
        # their offsets, each starting where the previous one ended, the last ending at the end of
        # the file. Anything else (a header length a few bytes short that the JSON's padding
        # absorbs, two tensors on one byte range, a gap) would read wrong bytes in silence.
        at = base
        for t in sorted(self.tensors.values(), key=lambda t: (t.start, t.end)):
            if t.start != at:
                raise ColiError(f"{self.path.name} is corrupt: tensor {t.name} starts at data byte "
                                f"{t.start - base}, expected {at - base} ("
                                + ("overlaps the previous tensor)" if t.start < at else "a gap before it)"))
            at = t.end
        if at != size:
            raise ColiError(f"{self.path.name} is " + ("truncated" if at > size else "corrupt")
                            + f": its header describes {at} bytes, the file has {size}")

    def _entry(self, name: str, h) -> tuple[str, tuple[int, ...], tuple[int, int]]:
        """(dtype, shape, (begin, end)) of one header entry, every field type-checked."""
        def bad(why: str) -> ColiError:
            return ColiError(f"{self.path.name} is corrupt: tensor {name}: {why}")
        if not isinstance(h, dict) or not {"dtype", "shape", "data_offsets"} <= h.keys():
            raise bad("needs dtype, shape and data_offsets")
        dtype, shape, offsets = h["dtype"], h["shape"], h["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ColiError(f"{self.path.name}: tensor {name} has unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise bad(f"shape {shape!r} is not a list of non-negative integers")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
            raise bad(f"data_offsets {offsets!r} is not two non-negative integers")
        a, b = offsets
        want = int(np.prod(shape, dtype=object)) * DTYPES[dtype].itemsize
        if b < a or b - a != want:
            raise bad(f"offsets {a}..{b} but its dtype and shape need {want} bytes")
        return dtype, tuple(shape), (a, b)

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def pread(self, nbytes: int, offset: int) -> bytearray:
        buf = bytearray(nbytes)
        got = pread_into(self._f, memoryview(buf), offset)
        if got < nbytes:
            raise ColiError(f"{self.path.name} is truncated: read past end at byte {offset + got}")
        return buf

    def raw(self, name: str, row_start: int = 0, row_end: int | None = None) -> np.ndarray:
        """Stored elements of a tensor (or a block of its leading-dimension rows)."""
        t = self.tensors[name]
        dt = DTYPES[t.dtype]
        if not t.shape:
            return np.frombuffer(self.pread(t.nbytes, t.start), dtype=dt).reshape(())
        rows = t.shape[0]
        row_end = rows if row_end is None else min(row_end, rows)
        row_bytes = t.nbytes // rows if rows else 0
        buf = self.pread((row_end - row_start) * row_bytes, t.start + row_start * row_bytes)
        return np.frombuffer(buf, dtype=dt).reshape((row_end - row_start,) + t.shape[1:])

    def float32(self, name: str, row_start: int = 0, row_end: int | None = None) -> np.ndarray:
        return to_float32(self.raw(name, row_start, row_end), self.tensors[name].dtype)


class SafetensorsWriter:
    """Writes one safetensors file whose tensor order we choose, atomically (temp file + rename).

    Every tensor's size is known up front, so the header is written first and data is placed with
    positioned writes, a row block at a time.
    """

    def __init__(self, path: str | os.PathLike, entries: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        self.offsets: dict[str, tuple[int, int]] = {}
        for name, dtype, shape in entries:
            n = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            self.offsets[name] = (offset, offset + n)
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.data_start = 8 + len(blob)
        self.size = self.data_start + offset
        self._f = open(self.tmp, "w+b", buffering=0)
        self._write_at(len(blob).to_bytes(8, "little") + blob, 0)

    @staticmethod
    def planned_size(entries: list[tuple[str, str, tuple[int, ...]]]) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) * DTYPES[d].itemsize for _, d, s in entries)

    def _write_at(self, data, offset: int) -> None:
        pwrite(self._f, data, offset)

    def write(self, name: str, array: np.ndarray, byte_offset: int = 0) -> None:
        """Write ``array``'s bytes into tensor ``name`` starting ``byte_offset`` bytes into it."""
        a, b = self.offsets[name]
        data = np.ascontiguousarray(array)
        if a + byte_offset + data.nbytes > b:
            raise ValueError(f"write past the end of tensor {name}")
        self._write_at(data, self.data_start + a + byte_offset)

    def commit(self) -> None:
        self._f.truncate(self.size)
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self._f.close()
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass
