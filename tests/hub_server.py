"""A loopback HTTP server that speaks enough of the Hugging Face Hub API for the real
``huggingface_hub`` client (``HfApi.model_info``, ``hf_hub_download``, ``get_hf_file_metadata``).

Routes (what huggingface_hub 1.x/2.x asks for):
- ``GET /api/models/{repo}[/revision/{rev}]`` -> ``{"id", "sha", "siblings": [{"rfilename", "size",
  "blobId", "lfs"}]}``; unknown repo: 404 with ``X-Error-Code: RepoNotFound``; unknown revision:
  404 ``RevisionNotFound``.
- ``GET /api/models/{repo}/tree/{rev}`` -> the file list ``snapshot_download`` asks for (one page).
- ``HEAD|GET /{repo}/resolve/{rev}/{path}`` -> ``ETag``, ``X-Repo-Commit``, ``Content-Length``,
  ``Accept-Ranges``; for LFS-like files (``*.safetensors``) also ``X-Linked-Etag`` (sha256) and
  ``X-Linked-Size`` as the Hub sends them; ``Range: bytes=a-[b]`` gives 206 + ``Content-Range``;
  missing file: 404 ``EntryNotFound``.

With ``cdn = True`` LFS files are served as the real Hub does: ``/resolve/`` answers 302 (with the
X-Linked-* headers) to another host (``localhost`` instead of ``127.0.0.1``), ``/cdn/...``.

Fault injection: ``drop_after[filename] = n`` sends the headers and only ``n`` bytes of the body,
then closes the connection (once); ``delay[filename] = s`` sleeps ``s`` between 16 KiB chunks;
``corrupt`` (a set of names) flips one byte of the body, once; ``gated`` (repo ids) answers the
model info with 403 ``GatedRepo``.
``requests`` records ``(method, path, range)`` of every request, ``auth`` the paths of requests
that carried an Authorization header.
"""
from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

CHUNK = 16 << 10
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")


class _Repo:
    def __init__(self, directory: Path, sha: str):
        self.dir, self.sha = Path(directory), sha
        self._meta: dict[str, dict] = {}

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.dir)) for p in self.dir.rglob("*")
                      if p.is_file() and not any(part.startswith(".") for part in p.relative_to(self.dir).parts))

    def meta(self, name: str) -> dict:
        if name not in self._meta:
            data = (self.dir / name).read_bytes()
            sha1 = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            m = {"size": len(data), "sha1": sha1}
            if name.endswith(LFS_SUFFIXES):
                m["sha256"] = hashlib.sha256(data).hexdigest()
            self._meta[name] = m
        return self._meta[name]


class HubServer:
    def __init__(self):
        self.repos: dict[str, _Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.drop_after: dict[str, int] = {}
        self.delay: dict[str, float] = {}
        self.corrupt: set[str] = set()
        self.gated: set[str] = set()          # repo ids that answer 403 GatedRepo, as the Hub does
        self.cdn = False
        self.auth: list[str] = []
        self._lock = threading.Lock()
        self._conns: set = set()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- setup ---------------------------------------------------------------------------------
    def add_repo(self, repo_id: str, directory: Path, sha: str | None = None) -> str:
        sha = sha or hashlib.sha1(repo_id.encode()).hexdigest()
        self.repos[repo_id] = _Repo(directory, sha)
        return sha

    @property
    def endpoint(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HubServer":
        server = self

        class Handler(_Handler):
            hub = server
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and cut every open (keep-alive) connection: the Hub is gone."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- inspection ----------------------------------------------------------------------------
    def gets(self, filename: str) -> list[str | None]:
        """The Range header (None = whole file) of every GET of ``filename``."""
        with self._lock:
            return [rng for m, p, rng in self.requests if m == "GET" and p.endswith("/" + filename)
                    and ("/resolve/" in p or p.startswith("/cdn/"))]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:      # quiet
        pass

    def setup(self) -> None:
        super().setup()
        with self.hub._lock:
            self.hub._conns.add(self.connection)

    def finish(self) -> None:
        with self.hub._lock:
            self.hub._conns.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def _record(self) -> None:
        with self.hub._lock:
            self.hub.requests.append((self.command, urlsplit(self.path).path, self.headers.get("Range")))
            if self.headers.get("Authorization"):
                self.hub.auth.append(urlsplit(self.path).path)

    def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _find_repo(self, parts: list[str]) -> tuple[str | None, list[str]]:
        """The longest known repo id at the start of ``parts`` (ids are ``org/name`` or ``name``)."""
        for n in (2, 1):
            rid = "/".join(parts[:n])
            if rid in self.hub.repos:
                return rid, parts[n:]
        return None, parts

    def do_GET(self) -> None:
        self._record()
        path = unquote(urlsplit(self.path).path)
        if path.startswith("/api/models/"):
            return self._model_info(path[len("/api/models/"):].strip("/").split("/"))
        return self._resolve(path, body=True)

    def do_HEAD(self) -> None:
        self._record()
        return self._resolve(unquote(urlsplit(self.path).path), body=False)

    def _model_info(self, parts: list[str]) -> None:
        rid, rest = self._find_repo(parts)
        if rid is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        repo = self.hub.repos[rid]
        if rid in self.hub.gated:
            return self._error(403, "GatedRepo", "Access to this model is restricted")
        if len(rest) == 2 and rest[0] == "tree" and rest[1] in ("main", repo.sha):
            return self._tree(repo)
        if rest and (len(rest) != 2 or rest[0] != "revision" or rest[1] not in ("main", repo.sha)):
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {'/'.join(rest[1:])}")
        siblings = []
        for name in repo.files():
            m = repo.meta(name)
            s = {"rfilename": name, "size": m["size"], "blobId": m["sha1"]}
            if "sha256" in m:
                s["lfs"] = {"size": m["size"], "sha256": m["sha256"], "pointerSize": 134}
            siblings.append(s)
        body = json.dumps({"_id": rid, "id": rid, "modelId": rid, "sha": repo.sha, "private": False,
                           "gated": False, "disabled": False, "tags": [], "siblings": siblings}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _tree(self, repo: _Repo) -> None:
        """``/api/models/{repo}/tree/{rev}?recursive=true`` (snapshot_download's listing), one page."""
        entries = []
        for name in repo.files():
            m = repo.meta(name)
            e = {"type": "file", "oid": m["sha1"], "size": m["size"], "path": name}
            if "sha256" in m:
                e["lfs"] = {"oid": m["sha256"], "size": m["size"], "pointerSize": 134}
            entries.append(e)
        body = json.dumps(entries).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _resolve(self, path: str, body: bool) -> None:
        parts = path.strip("/").split("/")
        if parts[0] == "cdn":                          # /cdn/{repo}/{name}: the "CDN" host
            rid, rest = self._find_repo(parts[1:])
            if rid is None or not rest or "/".join(rest) not in self.hub.repos[rid].files():
                return self._error(404, "EntryNotFound", "not found")
            return self._serve(self.hub.repos[rid], "/".join(rest), body, cdn=True)
        if "resolve" not in parts:
            return self._error(404, "RepoNotFound", "Not found")
        i = parts.index("resolve")
        rid, _ = self._find_repo(parts[:i])
        if rid is None or len(parts) < i + 3:
            return self._error(404, "RepoNotFound", "Repository not found")
        repo = self.hub.repos[rid]
        rev, name = parts[i + 1], "/".join(parts[i + 2:])
        if rev not in ("main", repo.sha):
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if name not in repo.files():
            return self._error(404, "EntryNotFound", f"{name} does not exist", commit=repo.sha)
        m = repo.meta(name)
        if self.hub.cdn and "sha256" in m:
            port = self.hub._httpd.server_address[1]
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{port}/cdn/{rid}/{name}")
            self.send_header("ETag", f'"{m["sha1"]}"')
            self.send_header("X-Linked-Etag", f'"{m["sha256"]}"')
            self.send_header("X-Linked-Size", str(m["size"]))
            self.send_header("X-Repo-Commit", repo.sha)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        return self._serve(repo, name, body)

    def _serve(self, repo: _Repo, name: str, body: bool, cdn: bool = False) -> None:
        m = repo.meta(name)
        size = m["size"]
        start, end = 0, size - 1
        rng = self.headers.get("Range")
        status = 200
        if rng and rng.startswith("bytes="):
            a, _, b = rng[len("bytes="):].partition("-")
            start = int(a or 0)
            end = min(int(b), size - 1) if b else size - 1
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        etag = m.get("sha256", m["sha1"])
        self.send_header("ETag", f'"{etag if cdn else m["sha1"]}"')
        if "sha256" in m and not cdn:
            self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("X-Linked-Size", str(size))
        if not cdn:
            self.send_header("X-Repo-Commit", repo.sha)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if not body:
            return
        with self.hub._lock:
            drop = self.hub.drop_after.pop(name, None)
            flip = name in self.hub.corrupt
            self.hub.corrupt.discard(name)
        delay = self.hub.delay.get(name, 0.0)
        sent = 0
        with open(repo.dir / name, "rb") as f:
            f.seek(start)
            left = end - start + 1
            while left > 0:
                n = min(CHUNK, left)
                if drop is not None:
                    n = min(n, drop - sent)
                    if n <= 0:
                        self.wfile.flush()
                        self.close_connection = True
                        try:
                            self.connection.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass
                        return
                data = f.read(n)
                if flip and data:
                    data, flip = bytes([data[0] ^ 0xFF]) + data[1:], False
                try:
                    self.wfile.write(data)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                    return
                sent += len(data)
                left -= len(data)
                if delay:
                    time.sleep(delay)


# --- a tiny real model to serve --------------------------------------------------------------

def build_tiny_repo(directory: Path, shards: int = 2, **config) -> Path:
    """A tiny real Hugging Face-format MoE checkpoint (tokenizer, sharded safetensors, index) plus a
    README and a .bin file that the downloader must skip."""
    from tests.conftest import tiny_config, tokenizer_files, write_hf_model
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = tokenizer_files(directory, 300)
    write_hf_model(directory, tiny_config(vocab_size=vocab, **config), shards=shards)
    (directory / "README.md").write_text("# tiny\n")
    (directory / "pytorch_model.bin").write_bytes(b"\0" * 1000)
    return directory
