"""Persisted sessions: a conversation's cache saved to disk, so that reopening the app continues
a long chat without prefilling it again.

One file per conversation (``SessionStore.path(key)``), written atomically (a temporary file
beside it, fsync, ``os.replace``), in a versioned format:

    b"COLIKVC\\n"                    8 bytes, the magic
    format version                   u32 little-endian (FORMAT)
    header length                    u64 little-endian
    header                           UTF-8 JSON (below)
    sha256 of the header             32 bytes
    payload                          each layer's arrays in order, each [lead, length, width] in
                                     the cache's dtype, C order; then the prompt's last logits
                                     (float32 [vocab]) when the header says so; then the state
                                     and the objects (below)

The header binds the cache to what computed it: ``model`` (a hash of the container's manifest
``colibri.json``, which holds every shard's sha256, and its ``config.json``), ``kv_cache`` (the
cache precision), ``kernels`` (the int8-activation mode changes every position's bits), the
layers' array names and shapes; it holds the ids the positions hold, the prompt length of the
turn that made it, and the payload's size and sha256. Loading checks all of it: another model,
another precision, a damaged, truncated or foreign file is never used -- the conversation is
computed again and the caller gets one line saying why (``Restored.warning``), never a wrong
reply. The bits of a restored cache are the bits saved, so a reply after a restart is the one
the same turn gives without the restart.

The files live in one directory under a disk budget (``budget_bytes``): after each save the least
recently used files (by modification time: loading one touches it) are deleted until the total
fits; a cache larger than the whole budget is not saved. A cache with fixed-size state (a
linear-attention layer's conv and recurrent arrays, ``KVCache.state``, float32) saves it after
the rows (``state`` in the header names each array's shape), and the state's checkpoint at the
prompt's end when the turn took one (``checkpoint``: core.prefix_cache), so that a restored
chat is continued where the same session would continue it.

A kind that keeps an object of its own (DeepSeek V4's compressors: entries, the open block, the
overlap) writes it as named arrays (``kind.to_arrays(kept, length)``, shapes and dtypes as
``kind.saved_arrays(length)`` declares them; read back with ``kind.from_arrays``) after the state:
``objects`` in the header lists per layer [kind name, kind.version, [[array, shape, dtype], ...]]
(None when no kind keeps an object), and its checkpoint (a dict of arrays whose shapes do not
depend on the length) follows when ``checkpoint`` is set, ``object_checkpoint`` naming them the
same way. Loading compares both with what the model's kinds declare: another kind version is
another layout, computed again. Format 2 (this one) added them; format 1 files (no objects) are
read as before.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .prefix_cache import cache_parts, common_prefix

MAGIC = b"COLIKVC\n"
FORMAT = 2
READS = (1, 2)                   # format 1: no objects (it reads as format 2 without them)
SUFFIX = ".kvc"
MAX_HEADER = 64 << 20            # ids of a very long chat fit many times over; more is garbage
DEFAULT_BUDGET_BYTES = 2 * 10 ** 9


def model_key(path) -> str:
    """A hash naming the model a cache belongs to: the manifest (every shard's checksum) and the
    config; a container without a manifest adds its shards' names, sizes and times."""
    path = Path(path)
    h = hashlib.sha256()
    for name in ("colibri.json", "config.json"):
        p = path / name
        h.update(name.encode() + b"\0")
        if p.is_file():
            h.update(p.read_bytes())
    if not (path / "colibri.json").is_file():
        for p in sorted(path.glob("*.safetensors")):
            st = p.stat()
            h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def _kernel_mode() -> dict:
    """The kernel options that change a position's bits (not the thread count or SIMD level,
    which the placement law and the golden hashes cover)."""
    from . import kernels
    compiled = getattr(kernels, "_compiled", None)
    probe = getattr(compiled, "int8_activations", None)
    return {"int8_activations": bool(probe()) if callable(probe) else False}


def _bytes(a: np.ndarray) -> memoryview:
    """A contiguous array's bytes, writable when the array is (float16 has no memoryview cast)."""
    return memoryview(a.reshape(-1).view(np.uint8))


def _layout(cache) -> list[list]:
    return [[[name, int(a.shape[0]), int(a.shape[2])] for name, a in parts.items()] for parts in cache_parts(cache)]


def _state_layout(cache) -> list[list] | None:
    """Per layer [name, shape, dtype] of the fixed-size state arrays; None when there are none."""
    state = getattr(cache, "state", None)
    if not state or not any(state):
        return None
    return [[[name, [int(d) for d in a.shape], np.dtype(a.dtype).name] for name, a in layer.items()]
            for layer in state]


def _state_bytes(layout) -> int:
    return sum(int(np.prod(shape)) * np.dtype(dt).itemsize for layer in layout or () for _, shape, dt in layer)


def _objects(cache) -> list[list]:
    return cache.objects() if hasattr(cache, "objects") else []


def _object_layout(cache, n: int) -> list[list] | None:
    """Per layer [kind name, version, [[array, shape, dtype], ...]] of the kinds keeping an object,
    as they declare their arrays at n positions; None when no kind does."""
    objects = _objects(cache)
    if not any(objects):
        return None
    return [[[k.name, k.version, [[a, [int(d) for d in shape], dt] for a, (shape, dt) in k.saved_arrays(n).items()]]
             for k, _ in layer] for layer in objects]


def _object_checkpoint_layout(cache, checkpoint) -> list[list]:
    """Per layer [kind name, [[array, shape, dtype], ...]] of the objects' part of ``checkpoint``
    (per layer {kind name: {array: ndarray}}, KVCache.checkpoint)."""
    return [[[k.name, [[a, [int(d) for d in x.shape], np.dtype(x.dtype).name] for a, x in ck[k.name].items()]]
             for k, _ in layer] for layer, ck in zip(_objects(cache), checkpoint)]


def _object_bytes(layout) -> int:
    return sum(_state_bytes([arrays]) for layer in layout or () for *_, arrays in layer)


class Corrupt(Exception):
    """Not a cache this version can use (the message says why)."""


@dataclass
class Restored:
    loaded: bool                 # a cache went into the engine's pool
    positions: int = 0           # how many positions of the prompt it gives
    warning: str | None = None   # one line when a saved cache could not be used


class SessionStore:
    def __init__(self, directory, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        self.directory = Path(directory)
        self.budget_bytes = int(budget_bytes)

    def path(self, key) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(key))
        return self.directory / f"chat-{safe}{SUFFIX}"

    # --- what is on disk -------------------------------------------------------------------------
    def files(self) -> list[Path]:
        try:
            return sorted(p for p in self.directory.glob(f"*{SUFFIX}") if p.is_file())
        except OSError:
            return []

    def size(self) -> tuple[int, int]:
        """(bytes, files) of the saved caches."""
        total = n = 0
        for p in self.files():
            try:
                total += p.stat().st_size
                n += 1
            except OSError:
                pass
        return total, n

    def delete(self, key) -> None:
        self.path(key).unlink(missing_ok=True)

    def evict(self, keep: Path | None = None) -> list[Path]:
        """Delete the least recently used files until the total fits the budget (``keep`` last)."""
        entries = []
        for p in self.files():
            try:
                st = p.stat()
            except OSError:
                continue
            entries.append((p == keep, st.st_mtime_ns, p, st.st_size))
        entries.sort(key=lambda e: (e[0], e[1]))
        total = sum(e[3] for e in entries)
        gone = []
        for _, _, p, size in entries:
            if total <= self.budget_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
            gone.append(p)
        return gone

    # --- save ------------------------------------------------------------------------------------
    def save(self, engine, key, entry=None) -> Path | None:
        """Write the engine's latest finished cache (or ``entry``, a core.prefix_cache.Entry) as
        conversation ``key``'s; None when there is none or it is larger than the budget. OSError
        when the file cannot be written (nothing half-written is left)."""
        entry = entry if entry is not None else engine.prefixes.latest()
        target = self.path(key)
        if entry is None or not entry.ids:
            return None
        cache, n = entry.cache, entry.cache.length
        if not getattr(cache, "savable", True):      # a kind keeps an object of its own (core.cache)
            target.unlink(missing_ok=True)
            return None
        parts = cache_parts(cache)
        state_layout, objects = _state_layout(cache), _object_layout(cache, n)
        folded = getattr(cache, "folded", None)
        if state_layout is not None and folded is not None and \
                any(f != n for f, layer in zip(folded, cache.state) if layer):
            target.unlink(missing_ok=True)      # a state ahead of the rows: nothing to continue
            return None
        payload = sum(a.shape[0] * n * a.shape[2] * a.itemsize for p in parts for a in p.values())
        logits = None
        if entry.logits is not None and entry.prompt_len <= n:
            logits = np.ascontiguousarray(entry.logits, dtype=np.float32)
            payload += logits.nbytes
        fixed = state_layout is not None or objects is not None
        checkpoint = entry.checkpoint if fixed and logits is not None else None
        object_checkpoint = _object_checkpoint_layout(cache, checkpoint) if objects and checkpoint else None
        payload += _state_bytes(state_layout) * (2 if checkpoint is not None else 1)
        payload += _object_bytes(objects) + _object_bytes(object_checkpoint)
        if payload > self.budget_bytes:
            target.unlink(missing_ok=True)      # the old one is stale: the chat moved on
            return None
        digest = hashlib.sha256()
        chunks = []
        for p in parts:
            for a in p.values():
                for h in range(a.shape[0]):
                    chunks.append(np.ascontiguousarray(a[h, :n]))
        if logits is not None:
            chunks.append(logits)
        for layers in ([cache.state] + ([checkpoint] if checkpoint is not None else [])
                       if state_layout is not None else []):
            for names, layer in zip(cache.state, layers):
                chunks.extend(np.ascontiguousarray(layer[name]) for name in names)
        for layer in _objects(cache) if objects is not None else ():
            chunks.extend(np.ascontiguousarray(a) for k, kept in layer for a in k.to_arrays(kept, n).values())
        for layer, ck in zip(_objects(cache), checkpoint) if object_checkpoint is not None else ():
            chunks.extend(np.ascontiguousarray(a) for k, _ in layer for a in ck[k.name].values())
        for c in chunks:
            digest.update(_bytes(c))
        header = {"format": FORMAT, "model": engine_model_key(engine), "kv_cache": np.dtype(cache.dtype).name,
                  "kernels": _kernel_mode(), "length": n, "ids": list(map(int, entry.ids)),
                  "prompt_len": int(entry.prompt_len) if logits is not None else 0,
                  "logits": None if logits is None else int(logits.size), "layers": _layout(cache),
                  "state": state_layout, "checkpoint": checkpoint is not None,
                  "objects": objects, "object_checkpoint": object_checkpoint,
                  "payload_bytes": payload, "sha256": digest.hexdigest(), "saved": time.time()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + struct.pack("<IQ", FORMAT, len(raw)) + raw + hashlib.sha256(raw).digest())
                for c in chunks:
                    f.write(_bytes(c))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.evict(keep=target)
        return target

    # --- load ------------------------------------------------------------------------------------
    @staticmethod
    def _header(f) -> dict:
        head = f.read(len(MAGIC) + 12)
        if len(head) < len(MAGIC) + 12 or head[: len(MAGIC)] != MAGIC:
            raise Corrupt("not a colibrì cache file")
        version, size = struct.unpack("<IQ", head[len(MAGIC):])
        if version not in READS:
            raise Corrupt(f"format version {version}; this colibrì reads versions {', '.join(map(str, READS))}")
        if size > MAX_HEADER:
            raise Corrupt("damaged header")
        raw = f.read(size)
        check = f.read(32)
        if len(raw) != size or len(check) != 32:
            raise Corrupt("truncated")
        if hashlib.sha256(raw).digest() != check:
            raise Corrupt("checksum mismatch (header)")
        try:
            h = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise Corrupt("damaged header") from None
        if not isinstance(h, dict) or not isinstance(h.get("ids"), list) or \
                not all(isinstance(i, int) and not isinstance(i, bool) for i in h["ids"]) or \
                not isinstance(h.get("length"), int) or h["length"] != len(h["ids"]):
            raise Corrupt("damaged header")
        return h

    def restore(self, engine, key, ids) -> Restored:
        """Put conversation ``key``'s saved cache into the engine's pool when it gives more of
        ``ids`` (the next prompt) than the pool has already. Never raises for what is in the
        file: a cache that cannot be used gives ``warning`` (and a damaged file is deleted)."""
        path = self.path(key)
        ids = list(ids)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return Restored(False)
        except OSError as e:
            return Restored(False, warning=f"the saved cache {path.name} cannot be read ({e.strerror or e}): "
                                           f"the conversation is computed again")
        damaged = None
        try:
            with f:
                try:
                    h = self._header(f)
                except Corrupt as e:
                    damaged = str(e)
                    raise
                want = min(common_prefix(h["ids"], ids), len(ids))
                _, have = engine.prefixes.best(ids)
                if want <= have:
                    return Restored(False)           # memory holds as much (the same session)
                why = self._mismatch(engine, h)
                if why:
                    return Restored(False, warning=f"the saved cache of this chat {why}: the "
                                                   f"conversation is computed again")
                try:
                    cache, logits, checkpoint = self._payload(engine, f, h)
                except Corrupt as e:
                    damaged = str(e)
                    raise
        except Corrupt:
            path.unlink(missing_ok=True)
            return Restored(False, warning=f"the saved cache of this chat is damaged ({damaged}): the "
                                           f"conversation is computed again")
        except OSError as e:
            return Restored(False, warning=f"the saved cache {path.name} cannot be read ({e.strerror or e}): "
                                           f"the conversation is computed again")
        engine.prefixes.put(h["ids"], cache, h.get("prompt_len") or 0, logits, checkpoint)
        try:
            os.utime(path)                       # recently used: the last to be evicted
        except OSError:
            pass
        return Restored(True, positions=engine.prefixes.best(ids)[1])

    @staticmethod
    def _mismatch(engine, h) -> str | None:
        if h.get("model") != engine_model_key(engine):
            return "was made by another model"
        if h.get("kv_cache") != engine.kv_dtype.name:
            return f"has a {h.get('kv_cache')} KV cache, this run uses {engine.kv_dtype.name} (--kv-cache)"
        if h.get("kernels") != _kernel_mode():
            return "was computed with other kernel options (--int8-activations)"
        return None

    @staticmethod
    def _payload(engine, f, h):
        cache = engine.new_cache()
        ok = False
        try:
            n = h["length"]
            if h.get("layers") != _layout(cache):
                raise Corrupt("its layers do not match the model's")
            vocab = h.get("logits")
            if vocab is not None and vocab != engine.spec.vocab_size:
                raise Corrupt("damaged header")
            state_layout, objects = _state_layout(cache), _object_layout(cache, n)
            fixed = state_layout is not None or objects is not None
            if h.get("state") != state_layout or h.get("objects") != objects or \
                    (h.get("checkpoint") and (not fixed or vocab is None)):
                raise Corrupt("its layers do not match the model's")
            object_checkpoint = None          # what the model's kinds' checkpoints are
            if objects is not None and h.get("checkpoint"):
                object_checkpoint = _object_checkpoint_layout(
                    cache, [{k.name: k.checkpoint(kept) for k, kept in layer} for layer in _objects(cache)])
            if h.get("object_checkpoint") != object_checkpoint:
                raise Corrupt("its layers do not match the model's")
            itemsize = engine.kv_dtype.itemsize
            expect = sum(lead * n * width * itemsize for layer in h["layers"] for _, lead, width in layer)
            expect += 4 * vocab if vocab is not None else 0
            expect += _state_bytes(state_layout) * (2 if h.get("checkpoint") else 1)
            expect += _object_bytes(objects) + _object_bytes(object_checkpoint)
            if h.get("payload_bytes") != expect:
                raise Corrupt("damaged header")
            if n > engine.spec.max_position_embeddings > 0:
                raise Corrupt("longer than the model's context")
            for layer in range(len(cache_parts(cache))):
                cache.ensure(layer, n)
            digest = hashlib.sha256()
            for parts in cache_parts(cache):
                for a in parts.values():
                    for row in range(a.shape[0]):
                        dst = a[row, :n]
                        view = _bytes(dst)
                        if f.readinto(view) != len(view):
                            raise Corrupt("truncated")
                        digest.update(view)
            logits = None
            if vocab is not None:
                logits = np.empty(vocab, np.float32)
                view = _bytes(logits)
                if f.readinto(view) != len(view):
                    raise Corrupt("truncated")
                digest.update(view)
            checkpoint = [{} for _ in cache_parts(cache)] if h.get("checkpoint") else None
            targets = []
            if state_layout is not None:
                targets = [list(layer.values()) for layer in cache.state]
                if checkpoint is not None:
                    for ck, layer in zip(checkpoint, cache.state):
                        ck.update({name: np.empty_like(a) for name, a in layer.items()})
                    targets += [[ck[name] for name in layer] for ck, layer in zip(checkpoint, cache.state)]
            # the objects' arrays, then their checkpoints: read here, handed to the kinds once
            # the checksum holds
            live = [[{a: np.empty(shape, dt) for a, shape, dt in arrays} for _, _, arrays in layer]
                    for layer in objects or ()]
            targets += [list(arrays.values()) for layer in live for arrays in layer]
            for layer, ck in zip(object_checkpoint or (), checkpoint or ()):
                for name, arrays in layer:
                    ck[name] = {a: np.empty(shape, dt) for a, shape, dt in arrays}
                    targets.append(list(ck[name].values()))
            for layer in targets:
                for a in layer:
                    view = _bytes(a)
                    if f.readinto(view) != len(view):
                        raise Corrupt("truncated")
                    digest.update(view)
            if f.read(1):
                raise Corrupt("trailing bytes")
            if digest.hexdigest() != h.get("sha256"):
                raise Corrupt("checksum mismatch")
            for layer, arrays in zip(_objects(cache), live):
                for (kind, kept), a in zip(layer, arrays):
                    kind.from_arrays(kept, a, n)
            if fixed and hasattr(cache, "folded"):
                cache.folded = [n] * len(cache.folded)
            cache.length = n
            ok = True
            return cache, logits, checkpoint
        finally:
            if not ok:
                engine.recycle_cache(cache)


def engine_model_key(engine) -> str:
    """model_key of the engine's container, computed once."""
    key = getattr(engine, "_model_key", None)
    if key is None:
        key = engine._model_key = model_key(engine.container.path)
    return key
