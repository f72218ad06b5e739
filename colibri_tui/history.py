"""Conversations, kept in SQLite under platformdirs' user data dir (``COLI_DATA_DIR`` moves it).

Every change is one SQLite transaction, so a crash never leaves half a write behind.

The file is untrusted: one that is not a history (garbage, truncated, a directory, another
schema version) is moved aside -- kept, named in ``History.notices`` -- and a fresh history is
started; a row of the wrong type (a BLOB content, stats that are not an object, sampling that is
a list) is skipped or falls back to defaults, with a notice; the app shows the notices. Nothing
in the file is changed by reading it.
"""
from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from .settings import Sampling, aside_name, data_dir, export_dir, show_value

SCHEMA_VERSION = 1          # PRAGMA user_version; 0 = a history from before it was set (same schema)
COLUMNS = {"chats": {"id", "title", "system_prompt", "sampling", "model", "created", "updated"},
           "messages": {"id", "chat_id", "role", "content", "stats", "created"}}
ROLES = ("user", "assistant")
# the stats a message's meta line formats (fmt_meta): numbers, or the row's stats are dropped
META_KEYS = ("new_tokens", "decode_tok_s", "ttft_s", "hit_rate", "bytes_read")

SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    sampling TEXT NOT NULL DEFAULT '{}',
    model TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    stats TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_chat ON messages(chat_id, id);
"""

THINK_RE = re.compile(r"<think>.*?(</think>|$)", re.S)


@dataclass
class Message:
    id: int
    role: str
    content: str
    stats: dict = field(default_factory=dict)


@dataclass
class Chat:
    id: int
    title: str
    system_prompt: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    model: str = ""
    created: float = 0.0
    updated: float = 0.0


def strip_thinking(text: str, opened: bool = False) -> str:
    """The reply without its thinking: <think>…</think> blocks, and the thinking before a
    </think> that the prompt opened (``opened``, or a </think> with no <think> before it)."""
    close = text.find("</think>")
    if close >= 0 and (opened or "<think>" not in text[:close]):
        text = text[close + len("</think>"):]
    elif opened:
        return ""                        # stopped while still thinking: no answer
    return THINK_RE.sub("", text).strip()


class _Damaged(Exception):
    """The file is not a usable history: move it aside."""


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _clean_stats(d) -> dict | None:
    """A message's stored stats as fmt_meta reads them, or None when they are damaged."""
    if not isinstance(d, dict):
        return None
    st, reason = d.get("stats"), d.get("reason")
    if st is not None and not (isinstance(st, dict) and all(_number(st[k]) for k in META_KEYS if k in st)):
        return None
    if reason is not None and not isinstance(reason, str):
        return None
    return d


class History:
    def __init__(self, path: str | Path | None = None):
        if path is None:
            path = data_dir() / "history.sqlite3"
        self.path = Path(path)
        self.notices: list[str] = []          # what went wrong reading the history (the app shows them)
        self._reported: set = set()           # (what, row id): each damaged row noticed once
        self.db = self._open()

    def _open(self) -> sqlite3.Connection:
        """The history, checked; a damaged one moved aside for a fresh one; when the file
        cannot be used at all (locked, read-only, no space), an in-memory history, said so."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                return self._connect(self.path)
            except _Damaged as e:
                try:
                    aside = self._move_aside()
                except OSError as err:            # a read-only folder: leave it, use memory
                    raise OSError(f"{e}; it could not be moved aside: {err.strerror or err}") from None
                self.notices.append(f"the chat history {self.path} could not be read ({e}): it is kept "
                                    f"as {aside}, and a fresh history was started")
                return self._connect(self.path)
        except (OSError, sqlite3.Error, _Damaged) as e:
            why = getattr(e, "strerror", None) or str(e) or e.__class__.__name__
            self.notices.append(f"the chat history {self.path} cannot be used ({why}): chats of this "
                                f"session are not saved")
            return self._connect(":memory:")

    @staticmethod
    def _connect(path) -> sqlite3.Connection:
        """Open and check a history file; _Damaged when it is not one this version can use.
        Other sqlite3 errors (locked, read-only, I/O) are raised as they are: not damage."""
        if path != ":memory:":
            try:
                mode = os.stat(path).st_mode
            except FileNotFoundError:
                mode = None
            if mode is not None and not stat.S_ISREG(mode):    # a directory; a FIFO would block
                raise _Damaged("not a regular file")
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA foreign_keys = ON")
            check = db.execute("PRAGMA quick_check").fetchall()      # a truncated or damaged file
            if check != [("ok",)]:
                raise _Damaged(f"damaged: {show_value(check[0][0] if check else '?')}")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise _Damaged(f"schema version {version}; this colibrì reads version {SCHEMA_VERSION}")
            for table, cols in COLUMNS.items():
                have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
                if have and not cols <= have:
                    raise _Damaged(f"another schema: table {table} has no {', '.join(sorted(cols - have))}")
            db.executescript(SCHEMA)
            if version != SCHEMA_VERSION:
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            db.execute("PRAGMA journal_mode = WAL")
            return db
        except sqlite3.DatabaseError as e:
            db.close()
            if getattr(e, "sqlite_errorname", "") in ("SQLITE_CORRUPT", "SQLITE_NOTADB") or \
                    type(e) is sqlite3.DatabaseError:
                raise _Damaged(str(e)) from None
            raise
        except BaseException:
            db.close()
            raise

    def _move_aside(self) -> Path:
        """Rename the damaged file (and its WAL, which may hold committed rows) beside it."""
        aside = aside_name(self.path)
        os.replace(self.path, aside)
        for suffix in ("-wal", "-shm", "-journal"):
            side = Path(str(self.path) + suffix)
            if os.path.lexists(side):
                os.replace(side, Path(str(aside) + suffix))
        return aside

    def _report(self, key, text: str) -> None:
        if key not in self._reported:
            self._reported.add(key)
            self.notices.append(text)

    def take_notices(self) -> list[str]:
        """The notices not shown yet (the app calls this after reading the history)."""
        out, self.notices = self.notices, []
        return out

    def close(self) -> None:
        self.db.close()

    def _tx(self, sql: str, args=()) -> sqlite3.Cursor:
        with self.db:
            self.db.execute("BEGIN")
            return self.db.execute(sql, args)

    # --- chats ---------------------------------------------------------------------------------
    def _chat(self, row) -> Chat:
        """A chat row; a damaged field falls back to its default (the row is kept as it is)."""
        cid, title, system, raw, model, created, updated = row
        bad: list[str] = []
        if not isinstance(title, str):
            title = "Untitled"
            bad.append("its title is not text")
        where = f"chat {cid} {show_value(title)}"
        if not isinstance(system, str):
            system = ""
            bad.append("its system prompt is not text (not used)")
        data = None
        try:
            if not isinstance(raw, str):
                raise ValueError
            data = json.loads(raw)
        except (ValueError, RecursionError):
            bad.append("its sampling settings are not JSON (the defaults are used)")
        notes: list[str] = []
        sampling = Sampling.from_dict(data, notes)
        bad += notes
        for b in bad:
            self._report(("chat", cid, b), f"history: {where}: {b}")
        return Chat(id=cid, title=title, system_prompt=system, sampling=sampling,
                    model=model if isinstance(model, str) else "",
                    created=created if _number(created) else 0.0, updated=updated if _number(updated) else 0.0)

    _COLS = "id, title, system_prompt, sampling, model, created, updated"

    def chats(self) -> list[Chat]:
        """All chats, the most recently updated first."""
        rows = self.db.execute(f"SELECT {self._COLS} FROM chats ORDER BY updated DESC, id DESC").fetchall()
        return [self._chat(r) for r in rows]

    def get(self, chat_id: int) -> Chat | None:
        row = self.db.execute(f"SELECT {self._COLS} FROM chats WHERE id = ?", (chat_id,)).fetchone()
        return self._chat(row) if row else None

    def new_chat(self, title: str = "New chat", system_prompt: str = "", sampling: Sampling | None = None,
                 model: str = "") -> Chat:
        now = time.time()
        cur = self._tx("INSERT INTO chats (title, system_prompt, sampling, model, created, updated) "
                       "VALUES (?, ?, ?, ?, ?, ?)",
                       (title, system_prompt, json.dumps((sampling or Sampling()).as_dict()), model, now, now))
        return self.get(cur.lastrowid)

    def rename(self, chat_id: int, title: str) -> None:
        title = " ".join(title.split()) or "Untitled"
        self._tx("UPDATE chats SET title = ? WHERE id = ?", (title, chat_id))

    def update_chat(self, chat_id: int, system_prompt: str | None = None, sampling: Sampling | None = None) -> None:
        if system_prompt is not None:
            self._tx("UPDATE chats SET system_prompt = ? WHERE id = ?", (system_prompt, chat_id))
        if sampling is not None:
            self._tx("UPDATE chats SET sampling = ? WHERE id = ?", (json.dumps(sampling.as_dict()), chat_id))

    def delete(self, chat_id: int) -> None:
        self._tx("DELETE FROM chats WHERE id = ?", (chat_id,))

    # --- messages ------------------------------------------------------------------------------
    def messages(self, chat_id: int) -> list[Message]:
        """The chat's messages; a damaged row is skipped (content or role not text) or shown
        without its stats, each with a notice once. The same list reaches the model."""
        rows = self.db.execute("SELECT id, role, content, stats FROM messages WHERE chat_id = ? ORDER BY id",
                               (chat_id,)).fetchall()
        out = []
        for mid, role, content, raw in rows:
            where = f"history: chat {chat_id}, message {mid}"
            if role not in ROLES or not isinstance(content, str):
                why = (f"its role {show_value(role)} is not user or assistant" if role not in ROLES else
                       f"its content is {'binary data' if isinstance(content, bytes) else 'not text'}")
                self._report(("message", mid), f"{where} skipped: {why}")
                continue
            try:
                stats = _clean_stats(json.loads(raw)) if isinstance(raw, str) else None
            except (ValueError, RecursionError):
                stats = None
            if stats is None:
                self._report(("stats", mid), f"{where}: its statistics are damaged (not shown)")
                stats = {}
            out.append(Message(mid, role, content, stats))
        return out

    def add_message(self, chat_id: int, role: str, content: str, stats: dict | None = None) -> int:
        now = time.time()
        with self.db:
            self.db.execute("BEGIN")
            cur = self.db.execute("INSERT INTO messages (chat_id, role, content, stats, created) VALUES (?, ?, ?, ?, ?)",
                                  (chat_id, role, content, json.dumps(stats or {}, default=str), now))
            self.db.execute("UPDATE chats SET updated = ? WHERE id = ?", (now, chat_id))
        return cur.lastrowid

    def delete_message(self, message_id: int) -> None:
        self._tx("DELETE FROM messages WHERE id = ?", (message_id,))

    def engine_messages(self, chat_id: int) -> list[dict]:
        """What the model's chat template gets: the system prompt, then the turns (thinking dropped)."""
        chat = self.get(chat_id)
        out = []
        if chat and chat.system_prompt.strip():
            out.append({"role": "system", "content": chat.system_prompt})
        for m in self.messages(chat_id):
            content = (strip_thinking(m.content, bool(m.stats.get("think_open"))) if m.role == "assistant"
                       else m.content)
            out.append({"role": m.role, "content": content})
        return out

    def export_markdown(self, chat_id: int) -> str:
        chat = self.get(chat_id)
        if chat is None:
            raise KeyError(chat_id)
        lines = [f"# {chat.title}", ""]
        if chat.system_prompt.strip():
            lines += ["**System:**", "", chat.system_prompt.strip(), ""]
        for m in self.messages(chat_id):
            lines += [f"## {m.role.capitalize()}", "", m.content.strip(), ""]
        return "\n".join(lines)


def export_path(chat: Chat, directory: Path | None = None) -> Path:
    directory = directory or export_dir()
    slug = re.sub(r"[^A-Za-z0-9]+", "-", chat.title).strip("-").lower()[:40] or "chat"
    return directory / f"{chat.id:04d}-{slug}.md"


def title_from(text: str, n: int = 40) -> str:
    t = " ".join(text.split())
    return t if len(t) <= n else t[: n - 1].rstrip() + "…"
