"""`coli download` and the wizard's download step: fetch what the converter needs from a Hugging
Face model repository, resumably.

What is fetched: ``config.json``, ``generation_config.json``, the tokenizer files the converter
copies, ``model.safetensors.index.json`` and the ``*.safetensors`` weights (only the shards the
index names, when there is one). Nothing else (no ``.bin``/``.pth``, no READMEs, no subfolders).

How: ``HfApi.model_info(files_metadata=True)`` pins the repo to one commit and gives every file's
size. Small files go through ``hf_hub_download(local_dir=...)``. Weights go through our own
ranged GET (the URL, ETag and size come from huggingface_hub's ``get_hf_file_metadata``, the
request from its HTTP session) into ``.cache/colibri/NAME.ETAG.part``: huggingface_hub (>= 1.x)
deletes a partial file when a download fails, so a multi-GB shard would start over after a
crash; ours continues from the bytes on disk. Finished weights are checked against the Hub's
sha256 and registered with huggingface_hub's local-dir metadata, so either path sees them as done.
Completed files are never fetched twice: once pinned, a finished file costs no request at all.

``HF_ENDPOINT`` is read at call time (huggingface_hub reads it once, at import), so tests can
point the downloader at a loopback server. Every failure the user can act on is a ``ColiError``
with one line: no network, no such repo, gated repo, disk full, unsupported model type (via the
``validate_config`` hook: core never names a family), corrupt download.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from .errors import ColiError
from .fileio import atomic_write_text

STATE = ".colibri_download.json"
PART_DIR = Path(".cache") / "colibri"
CHUNK = 1 << 20
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "tokenizer.model",
              "vocab.json", "merges.txt", "added_tokens.json", "model.safetensors.index.json",
              # Kimi's tokenizer: the tiktoken ranks, and the module whose pat_str splits the text
              "tiktoken.model", "tokenization_kimi.py")
DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT_S = 30.0
SHA256 = re.compile(r"^[0-9a-f]{64}$")


REPO_ID = re.compile(r"[\w.\-]+/[\w.\-]+")


def looks_like_repo_id(text: str) -> bool:
    return bool(REPO_ID.fullmatch(text.strip())) and ".." not in text and "--" not in text


def _login_hint(host: str) -> str:
    # the one-file binary has no `hf` command: the token goes in an environment variable
    return f"set HF_TOKEN to an access token from {host}/settings/tokens"


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, read at call time like ``HF_ENDPOINT`` (huggingface_hub reads
    ``HF_HOME`` once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants
    return Path(constants.HF_HUB_CACHE)


def cached_snapshot(repo: str, revision: str | None = None) -> Path | None:
    """The Hugging Face cache's snapshot of ``repo`` when it holds everything the converter needs
    (config.json and every weight shard the index names), else None. No network."""
    if not looks_like_repo_id(repo):
        return None
    from huggingface_hub import snapshot_download
    try:
        snap = Path(snapshot_download(repo.strip(), revision=revision, cache_dir=hf_cache_dir(),
                                      local_files_only=True))
    except Exception:                 # not cached (LocalEntryNotFoundError), or an unreadable cache
        return None
    return snap if _has_weights(snap) else None


def _has_weights(d: Path) -> bool:
    if not (d / "config.json").is_file():
        return False
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        return bool(shards) and all((d / s).is_file() for s in shards)   # a dangling link: not there
    return any(p.is_file() for p in d.glob("*.safetensors"))


def repo_from_cache_path(path: str | Path) -> str | None:
    """``owner/name`` for a folder inside a Hugging Face cache snapshot
    (``.../models--owner--name/snapshots/COMMIT``), else None."""
    parts = Path(path).expanduser().absolute().parts
    for i in range(len(parts) - 1, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--"):
            owner_name = parts[i - 1][len("models--"):].split("--")
            return "/".join(owner_name) if all(owner_name) else None
    return None


class DownloadCancelled(ColiError):
    """The user cancelled; what was downloaded stays and the next run continues from it."""


class NoSuchRepo(ColiError):
    """The Hub has no such repository (or hides it): there is nothing to resume."""


@dataclass
class RemoteFile:
    name: str
    size: int
    sha256: str | None = None        # LFS files: the Hub's content hash


@dataclass
class DownloadPlan:
    repo: str
    revision: str                    # the commit every file is fetched from
    files: list[RemoteFile] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass
class DownloadProgress:
    file: str
    file_done: int
    file_total: int
    done: int                        # all files, bytes on disk
    total: int
    file_index: int
    file_count: int
    skipped: bool = False            # the file was already complete


def _http():
    """The HTTP library huggingface_hub's session is built on: httpx2 (huggingface_hub 2.x) or httpx
    (1.x). 0.x (requests) is too old for this module."""
    try:
        import httpx2
        return httpx2
    except ImportError:
        pass
    import huggingface_hub
    try:
        import httpx
        if int(huggingface_hub.__version__.split(".")[0]) >= 1:
            return httpx
    except (ImportError, ValueError):
        pass
    raise ColiError(f"downloads need huggingface_hub >= 1.0 (installed: {huggingface_hub.__version__}); "
                    f"run `pip install -U huggingface_hub`")


def endpoint_url(endpoint: str | None = None) -> str:
    return (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def wanted(name: str) -> bool:
    return "/" not in name and (name in SIDE_FILES or name.endswith(".safetensors"))


def _host(endpoint: str) -> str:
    return urlsplit(endpoint).netloc or endpoint


class _Errors:
    """Turn huggingface_hub / network / disk exceptions into one-line ``ColiError``s."""

    def __init__(self, repo: str, endpoint: str, local_dir: Path, what: str = ""):
        self.repo, self.endpoint, self.local_dir, self.what = repo, endpoint, local_dir, what

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, ColiError) or not isinstance(e, Exception):
            return False
        raise self.translate(e) from None

    def translate(self, e: Exception) -> ColiError:
        from huggingface_hub import errors as hf
        host, repo = _host(self.endpoint), self.repo
        where = f" ({self.what})" if self.what else ""
        if isinstance(e, hf.GatedRepoError):
            return ColiError(f"{repo} is gated: accept its terms on {host}, then {_login_hint(self.endpoint)}")
        if isinstance(e, hf.RepositoryNotFoundError):
            return NoSuchRepo(f"{repo}: no such model on {host} (check the name; for a private model "
                              f"{_login_hint(self.endpoint)})")
        if isinstance(e, hf.RevisionNotFoundError):
            return ColiError(f"{repo}: that revision does not exist on {host}")
        if isinstance(e, hf.RemoteEntryNotFoundError):
            return ColiError(f"{repo}: a file listed by the Hub is missing{where}; try again later")
        if isinstance(e, hf.OfflineModeIsEnabled):
            return ColiError("HF_HUB_OFFLINE is set: downloads are disabled (unset it to download)")
        if isinstance(e, hf.HfHubHTTPError):
            status = getattr(getattr(e, "response", None), "status_code", "?")
            return ColiError(f"{host} answered HTTP {status} for {repo}{where}; try again later")
        if isinstance(e, (_http().TransportError, hf.LocalEntryNotFoundError, ConnectionError, TimeoutError)):
            return ColiError(f"cannot reach {host}: no network, or the connection dropped{where}; "
                             f"run the download again to resume")
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return ColiError(f"disk full while downloading into {self.local_dir}; free some space and "
                             f"run the download again to resume")
        if isinstance(e, OSError):
            return ColiError(f"{e.strerror or e}: {e.filename or self.local_dir}")
        return ColiError(f"download of {repo} failed{where}: {e.__class__.__name__}: {e}")


def read_state(local_dir: str | Path) -> dict | None:
    p = Path(local_dir) / STATE
    try:
        d = json.loads(p.read_text())
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def plan_download(repo: str, revision: str | None = None, endpoint: str | None = None,
                  local_dir: str | Path = ".") -> DownloadPlan:
    """Ask the Hub which files to fetch (pinned to one commit) and how big they are."""
    from huggingface_hub import HfApi
    ep = endpoint_url(endpoint)
    repo = repo.strip()
    if not re.fullmatch(r"[\w.\-]+(/[\w.\-]+)?", repo):
        raise ColiError(f"{repo!r} is not a Hugging Face repo id (expected owner/name)")
    with _Errors(repo, ep, Path(local_dir), "model info"):
        info = HfApi(endpoint=ep).model_info(repo, revision=revision, files_metadata=True, timeout=TIMEOUT_S)
    files = [RemoteFile(s.rfilename, int(s.size or (s.lfs.size if s.lfs else 0) or 0),
                        s.lfs.sha256 if s.lfs else None)
             for s in (info.siblings or []) if wanted(s.rfilename)]
    names = {f.name for f in files}
    if "config.json" not in names:
        raise ColiError(f"{repo}: no config.json (is this a Transformers model repository?)")
    if not any(n.endswith(".safetensors") for n in names):
        raise ColiError(f"{repo}: no .safetensors weights (colibrì converts safetensors checkpoints only)")
    order = {n: i for i, n in enumerate(SIDE_FILES)}
    files.sort(key=lambda f: (f.name.endswith(".safetensors"), order.get(f.name, 99), f.name))
    return DownloadPlan(repo, info.sha or revision or "main", files)


def is_complete(local_dir: str | Path, f: RemoteFile, revision: str) -> bool:
    """Finished from this commit, by huggingface_hub's local-dir metadata (no network)."""
    from huggingface_hub._local_folder import read_download_metadata
    local_dir = Path(local_dir)
    p = local_dir / f.name
    if not p.is_file() or p.stat().st_size != f.size:
        return False
    meta = read_download_metadata(local_dir, f.name)
    return meta is not None and meta.commit_hash == revision


def remaining_bytes(local_dir: str | Path, plan: DownloadPlan) -> int:
    left = 0
    for f in plan.files:
        if not is_complete(local_dir, f, plan.revision):
            part = _part_path(Path(local_dir), f)
            left += f.size - (part.stat().st_size if part is not None and part.exists() else 0)
    return left


def _part_path(local_dir: Path, f: RemoteFile) -> Path | None:
    if not f.sha256:
        return None
    return local_dir / PART_DIR / f"{f.name}.{f.sha256[:16]}.part"


def download(repo: str, local_dir: str | Path, revision: str | None = None,
             progress: Callable[[DownloadProgress], None] | None = None,
             cancel: threading.Event | None = None, endpoint: str | None = None,
             validate_config: Callable[[dict], None] | None = None, retries: int = 3) -> Path:
    """Download ``repo`` into ``local_dir`` (created), resuming whatever an earlier run left there.

    ``progress`` is called from this thread for every chunk; ``cancel`` is checked between files
    and between chunks (then ``DownloadCancelled`` is raised and the partial file stays for the next
    run). ``validate_config(config)`` runs as soon as config.json is on disk, before the weights.
    """
    local_dir = Path(local_dir).expanduser()
    ep = endpoint_url(endpoint)
    cancel = cancel or threading.Event()
    created = not local_dir.exists()
    try:
        local_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _Errors(repo, ep, local_dir).translate(e) from None
    state = read_state(local_dir)
    if state and state.get("repo") == repo and state.get("revision") and revision in (None, state["revision"]):
        revision = state["revision"]            # stay on the commit the first run started from
        if state.get("complete"):               # finished earlier: no network at all
            try:
                done = DownloadPlan(repo, revision, [RemoteFile(**f) for f in state.get("files", [])])
            except TypeError:
                done = None
            if done is not None and done.files and all(is_complete(local_dir, f, revision) for f in done.files):
                for k, f in enumerate(done.files):
                    if progress is not None:
                        before = sum(x.size for x in done.files[:k + 1])
                        progress(DownloadProgress(f.name, f.size, f.size, before, done.total_bytes, k,
                                                  len(done.files), True))
                return local_dir
    try:
        plan = plan_download(repo, revision, ep, local_dir)
    except ColiError:
        if created:                    # a mistyped repo id must not leave an empty folder behind
            try:
                local_dir.rmdir()
            except OSError:
                pass
        raise
    atomic_write_text(local_dir / STATE, json.dumps(
        {"repo": repo, "revision": plan.revision, "endpoint": ep, "complete": False,
         "files": [asdict(f) for f in plan.files]}, indent=1))
    left = remaining_bytes(local_dir, plan)
    free = shutil.disk_usage(local_dir).free
    if left > free:
        raise ColiError(f"not enough free space in {local_dir}: the download needs {left / 1e9:.2f} GB "
                        f"more, {free / 1e9:.2f} GB free")

    files = list(plan.files)
    total = plan.total_bytes
    done_before = 0                 # bytes of files finished in this loop
    i = 0
    while i < len(files):
        f = files[i]
        if cancel.is_set():
            raise DownloadCancelled("download cancelled; it continues from here next time")

        def report(n: int, skipped: bool = False, _f=f, _i=i) -> None:
            if progress is not None:
                progress(DownloadProgress(_f.name, n, _f.size, done_before + n, total, _i, len(files), skipped))

        if is_complete(local_dir, f, plan.revision):
            report(f.size, skipped=True)
        else:
            with _Errors(repo, ep, local_dir, f.name):
                if f.sha256:
                    _ranged_download(repo, plan.revision, f, local_dir, ep, report, cancel, retries)
                else:
                    _small_download(repo, plan.revision, f, local_dir, ep, report, cancel)
        done_before += f.size
        if f.name == "config.json" and validate_config is not None:
            try:
                cfg = json.loads((local_dir / f.name).read_text())
            except (OSError, ValueError):
                raise ColiError(f"{repo}: config.json is not valid JSON") from None
            validate_config(cfg)
        if f.name == "model.safetensors.index.json":
            files, total = _restrict_to_index(local_dir, files, repo)
        i += 1
    state = read_state(local_dir) or {}
    state["complete"] = True
    state["files"] = [asdict(f) for f in files]          # what was kept (the index may drop shards)
    atomic_write_text(local_dir / STATE, json.dumps(state, indent=1))
    _clean_parts(local_dir)
    return local_dir


def _restrict_to_index(local_dir: Path, files: list[RemoteFile], repo: str):
    try:
        shards = set(json.loads((local_dir / "model.safetensors.index.json").read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ColiError(f"{repo}: model.safetensors.index.json is not a valid index") from None
    missing = shards - {f.name for f in files}
    if missing:
        raise ColiError(f"{repo}: the index names {sorted(missing)[0]}, which the repository lacks")
    kept = [f for f in files if not f.name.endswith(".safetensors") or f.name in shards]
    return kept, sum(f.size for f in kept)


def _clean_parts(local_dir: Path) -> None:
    d = local_dir / PART_DIR
    if d.is_dir():
        for p in d.glob("*.part"):
            p.unlink(missing_ok=True)


def _small_download(repo, revision, f: RemoteFile, local_dir: Path, ep: str, report, cancel) -> None:
    """hf_hub_download into the local dir, progress and cancel through a tqdm-like hook."""
    from huggingface_hub import hf_hub_download

    class Hook:
        def __init__(self, *a, initial: int = 0, **kw):
            self.n = initial

        def update(self, n: int = 1) -> None:
            if cancel.is_set():
                raise DownloadCancelled("download cancelled; it continues from here next time")
            self.n += n or 0
            report(self.n)

        def close(self) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    hf_hub_download(repo, f.name, revision=revision, local_dir=local_dir, endpoint=ep,
                    tqdm_class=Hook, etag_timeout=TIMEOUT_S)
    report(f.size)


def _ranged_download(repo, revision, f: RemoteFile, local_dir: Path, ep: str, report, cancel,
                     retries: int) -> None:
    """GET with ``Range`` into a partial file that survives crashes; sha256-checked at the end."""
    httpx = _http()
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub._local_folder import write_download_metadata
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(repo, f.name, revision=revision, endpoint=ep)
    meta = get_hf_file_metadata(url, timeout=TIMEOUT_S, endpoint=ep)
    etag = (meta.etag or "").lower()
    sha = f.sha256 or (etag if SHA256.fullmatch(etag) else None)
    size = meta.size if meta.size is not None else f.size
    part = _part_path(local_dir, f)
    part.parent.mkdir(parents=True, exist_ok=True)
    for stale in part.parent.glob(f"{f.name}.*.part"):
        if stale != part:
            stale.unlink(missing_ok=True)       # a partial file of an older version of this file
    headers = build_hf_headers()
    if urlsplit(meta.location).netloc != urlsplit(ep).netloc:
        headers.pop("authorization", None)      # signed CDN url: the token stays on the Hub
    h = hashlib.sha256()
    have = part.stat().st_size if part.exists() else 0
    if have > size:
        part.unlink()
        have = 0
    if have:
        with open(part, "rb") as r:                # the hash must cover the bytes we already have
            while chunk := r.read(CHUNK * 8):
                h.update(chunk)
    report(have)
    attempt = 0
    while have < size:
        if cancel.is_set():
            raise DownloadCancelled("download cancelled; it continues from here next time")
        hdrs = dict(headers)
        if have:
            hdrs["Range"] = f"bytes={have}-"
        try:
            with get_session().stream("GET", meta.location, headers=hdrs, follow_redirects=True,
                                      timeout=httpx.Timeout(TIMEOUT_S)) as r:
                hf_raise_for_status(r)
                mode = "ab"
                if have and r.status_code == 200:      # the server ignored Range: start over
                    have, h, mode = 0, hashlib.sha256(), "wb"
                with open(part, mode) as out:
                    for chunk in r.iter_bytes():       # as it arrives: nothing buffered is lost on a drop
                        if cancel.is_set():
                            raise DownloadCancelled("download cancelled; it continues from here next time")
                        out.write(chunk)
                        h.update(chunk)
                        have += len(chunk)
                        attempt = 0                     # progress resets the retry budget
                        report(have)
            if have < size:
                raise httpx.RemoteProtocolError("the connection closed before the end of the file")
        except (httpx.TransportError, ConnectionError):
            attempt += 1
            if attempt > retries:
                raise
            time.sleep(min(4.0, 0.25 * 2 ** attempt))
            continue
    if have != size or (sha and h.hexdigest() != sha):
        part.unlink(missing_ok=True)
        raise ColiError(f"{repo}: {f.name} arrived corrupt (checksum mismatch); run the download "
                        f"again to fetch it anew")
    dest = local_dir / f.name
    os.replace(part, dest)
    write_download_metadata(local_dir, f.name, commit_hash=revision, etag=sha or etag)
