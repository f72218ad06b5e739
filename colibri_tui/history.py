"""Conversations, kept in SQLite under platformdirs' user data dir (``COLI_DATA_DIR`` moves it).

Every change is one SQLite transaction, so a crash never leaves half a write behind.
"""
from __future__ import annotations

import json
import re
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from .settings import Sampling, data_dir, export_dir

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


def strip_thinking(text: str) -> str:
    return THINK_RE.sub("", text).strip()


class History:
    def __init__(self, path: str | Path | None = None):
        if path is None:
            path = data_dir() / "history.sqlite3"
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def _tx(self, sql: str, args=()) -> sqlite3.Cursor:
        with self.db:
            self.db.execute("BEGIN")
            return self.db.execute(sql, args)

    # --- chats ---------------------------------------------------------------------------------
    def _chat(self, row) -> Chat:
        try:
            sampling = Sampling.from_dict(json.loads(row[3]))
        except (ValueError, TypeError):
            sampling = Sampling()
        return Chat(id=row[0], title=row[1], system_prompt=row[2], sampling=sampling, model=row[4],
                    created=row[5], updated=row[6])

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
        rows = self.db.execute("SELECT id, role, content, stats FROM messages WHERE chat_id = ? ORDER BY id",
                               (chat_id,)).fetchall()
        out = []
        for r in rows:
            try:
                stats = json.loads(r[3])
            except ValueError:
                stats = {}
            out.append(Message(r[0], r[1], r[2], stats))
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
            content = strip_thinking(m.content) if m.role == "assistant" else m.content
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
