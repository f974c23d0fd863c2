"""Durable service state in SQLite: sessions, training runs, futures, checkpoints and samplers.

A future is written before its work runs and its result (JSON or protobuf bytes) when the work
ends, so a finished result survives a restart. ``open`` fails whatever was still pending: that
work died with the old process, and the client is told so instead of polling forever.

Re-sent requests are recognised by a dedupe key (``model_id/seq_id`` for training calls,
``sampler/seq_id`` for samples, ``session/model_seq_id`` for model creation): the second copy gets
the first one's request id and is never applied again.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, created_at REAL, last_heartbeat_at REAL,
    user_metadata TEXT, finished INTEGER DEFAULT 0, owner TEXT DEFAULT '');
CREATE TABLE IF NOT EXISTS models (
    model_id TEXT PRIMARY KEY, session_id TEXT, base_model TEXT, lora_rank INTEGER,
    is_lora INTEGER, user_metadata TEXT, created_at REAL, last_request_at REAL);
CREATE TABLE IF NOT EXISTS futures (
    request_id INTEGER PRIMARY KEY AUTOINCREMENT, dedupe_key TEXT UNIQUE, request_type TEXT,
    model_id TEXT, status TEXT, result BLOB, content_type TEXT, created_at REAL, completed_at REAL,
    owner TEXT DEFAULT '');
CREATE TABLE IF NOT EXISTS checkpoints (
    model_id TEXT, checkpoint_id TEXT, kind TEXT, path TEXT, tinker_path TEXT, size_bytes INTEGER,
    created_at REAL, PRIMARY KEY (model_id, checkpoint_id, kind));
CREATE TABLE IF NOT EXISTS samplers (
    sampler_id TEXT PRIMARY KEY, session_id TEXT, base_model TEXT, model_path TEXT,
    model_id TEXT, created_at REAL);
CREATE INDEX IF NOT EXISTS sessions_by_owner ON sessions (owner, finished, last_heartbeat_at);
CREATE INDEX IF NOT EXISTS models_by_session ON models (session_id);
"""
#: columns added since the first schema: a state directory written by an older service gains them on open
_ADDED_COLUMNS = {"sessions": ("owner", "TEXT DEFAULT ''"), "futures": ("owner", "TEXT DEFAULT ''")}

RESTART_ERROR = ("the training service restarted while this request was in flight, so it never "
                 "finished; send it again (training clients must be re-created from a saved state)")


@dataclass
class Future:
    request_id: int
    request_type: str
    model_id: str | None
    status: str  # pending | completed | failed
    result: bytes | None
    content_type: str | None
    owner: str


class Store:
    """Thread-safe access to the service database (one connection, one lock, WAL journal)."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=30000")
        # WAL + NORMAL: a commit survives a crash of this process (what restarts need); only a power
        # loss can take back the last few, and no fsync per request slows every call down
        self._db.execute("PRAGMA synchronous=NORMAL")
        for table, (column, kind) in _ADDED_COLUMNS.items():
            if self._db.execute(f"SELECT 1 FROM sqlite_master WHERE name='{table}'").fetchone():
                names = [row[1] for row in self._db.execute(f"PRAGMA table_info({table})")]
                if column not in names:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        self.interrupted = self._fail_pending()

    def _run(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _fail_pending(self) -> int:
        body = json.dumps({"error": RESTART_ERROR, "category": "server"}).encode()
        with self._lock:
            cur = self._db.execute(
                "UPDATE futures SET status='failed', result=?, content_type='application/json', "
                "completed_at=? WHERE status='pending'", (body, time.time()))
            return cur.rowcount

    # -- sessions ------------------------------------------------------------------------------

    def add_session(self, session_id: str, owner: str, user_metadata: dict[str, Any]) -> None:
        now = time.time()
        self._run("INSERT INTO sessions (session_id, created_at, last_heartbeat_at, user_metadata, finished, owner) "
                  "VALUES (?, ?, ?, ?, 0, ?)", (session_id, now, now, json.dumps(user_metadata), owner))

    def heartbeat(self, session_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("UPDATE sessions SET last_heartbeat_at=? WHERE session_id=?",
                                   (time.time(), session_id))
            return cur.rowcount == 1

    def has_session(self, session_id: str) -> bool:
        return bool(self._run("SELECT 1 FROM sessions WHERE session_id=?", (session_id,)))

    def session_owner(self, session_id: str) -> str | None:
        """The owner (a digest of the API key) of a session; None for an unknown one."""
        rows = self._run("SELECT owner FROM sessions WHERE session_id=?", (session_id,))
        return str(rows[0][0]) if rows else None

    def live_sessions(self, owner: str, idle_s: float) -> int:
        """Sessions of ``owner`` neither finished nor silent for ``idle_s`` seconds."""
        rows = self._run("SELECT COUNT(*) FROM sessions WHERE owner=? AND finished=0 AND last_heartbeat_at >= ?",
                         (owner, time.time() - idle_s))
        return int(rows[0][0])

    def finish_session(self, session_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("UPDATE sessions SET finished=1 WHERE session_id=?", (session_id,))
            return cur.rowcount == 1

    def stale_sessions(self, idle_s: float) -> list[str]:
        """Sessions that finished or sent no heartbeat for ``idle_s`` seconds."""
        rows = self._run("SELECT session_id FROM sessions WHERE finished=1 OR last_heartbeat_at < ?",
                         (time.time() - idle_s,))
        return [r[0] for r in rows]

    # -- training runs -------------------------------------------------------------------------

    def add_model(self, model_id: str, session_id: str, base_model: str, lora_rank: int | None,
                  user_metadata: dict[str, Any] | None) -> None:
        now = time.time()
        self._run("INSERT OR REPLACE INTO models VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                  (model_id, session_id, base_model, lora_rank or 0, int(lora_rank is not None),
                   json.dumps(user_metadata or {}), now, now))

    def touch_model(self, model_id: str) -> None:
        self._run("UPDATE models SET last_request_at=? WHERE model_id=?", (time.time(), model_id))

    def model(self, model_id: str) -> dict[str, Any] | None:
        rows = self._run("SELECT * FROM models WHERE model_id=?", (model_id,))
        return self._model_row(rows[0]) if rows else None

    def models(self, owner: str, limit: int, offset: int) -> tuple[list[dict[str, Any]], int]:
        """One page of ``owner``'s training runs, newest first, and how many there are."""
        owned = "FROM models JOIN sessions USING (session_id) WHERE sessions.owner=?"
        rows = self._run(f"SELECT models.* {owned} ORDER BY models.created_at DESC LIMIT ? OFFSET ?",
                         (owner, limit, offset))
        total = self._run(f"SELECT COUNT(*) {owned}", (owner,))[0][0]
        return [self._model_row(r) for r in rows], int(total)

    def session_models(self, session_id: str) -> list[str]:
        return [r[0] for r in self._run("SELECT model_id FROM models WHERE session_id=?", (session_id,))]

    @staticmethod
    def _model_row(row: tuple[Any, ...]) -> dict[str, Any]:
        keys = ("model_id", "session_id", "base_model", "lora_rank", "is_lora", "user_metadata",
                "created_at", "last_request_at")
        out = dict(zip(keys, row))
        out["is_lora"] = bool(out["is_lora"])
        out["user_metadata"] = json.loads(out["user_metadata"] or "{}")
        return out

    # -- futures -------------------------------------------------------------------------------

    def add_future(self, dedupe_key: str | None, request_type: str, model_id: str | None,
                   owner: str = "") -> tuple[int, bool]:
        """Insert a pending future; ``(request_id, True)`` for a new one, ``(id, False)`` for a re-send."""
        with self._lock:
            if dedupe_key is not None:
                row = self._db.execute("SELECT request_id FROM futures WHERE dedupe_key=?",
                                       (dedupe_key,)).fetchone()
                if row:
                    return row[0], False
            cur = self._db.execute(
                "INSERT INTO futures (dedupe_key, request_type, model_id, status, created_at, owner) "
                "VALUES (?, ?, ?, 'pending', ?, ?)", (dedupe_key, request_type, model_id, time.time(), owner))
            return int(cur.lastrowid or 0), True

    def finish_future(self, request_id: int, status: str, result: bytes, content_type: str) -> None:
        self._run("UPDATE futures SET status=?, result=?, content_type=?, completed_at=? WHERE request_id=?",
                  (status, result, content_type, time.time(), request_id))

    def future(self, request_id: int) -> Future | None:
        rows = self._run("SELECT request_id, request_type, model_id, status, result, content_type, owner "
                         "FROM futures WHERE request_id=?", (request_id,))
        return Future(*rows[0]) if rows else None

    # -- checkpoints and samplers --------------------------------------------------------------

    def add_checkpoint(self, model_id: str, checkpoint_id: str, kind: str, path: str, tinker_path: str,
                       size_bytes: int) -> None:
        self._run("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?)",
                  (model_id, checkpoint_id, kind, path, tinker_path, size_bytes, time.time()))

    def checkpoint(self, tinker_path: str) -> dict[str, Any] | None:
        rows = self._run("SELECT * FROM checkpoints WHERE tinker_path=?", (tinker_path,))
        return self._checkpoint_row(rows[0]) if rows else None

    def checkpoint_count(self, model_id: str) -> int:
        return int(self._run("SELECT COUNT(*) FROM checkpoints WHERE model_id=?", (model_id,))[0][0])

    def checkpoints(self, model_id: str) -> list[dict[str, Any]]:
        rows = self._run("SELECT * FROM checkpoints WHERE model_id=? ORDER BY created_at", (model_id,))
        return [self._checkpoint_row(r) for r in rows]

    @staticmethod
    def _checkpoint_row(row: tuple[Any, ...]) -> dict[str, Any]:
        keys = ("model_id", "checkpoint_id", "kind", "path", "tinker_path", "size_bytes", "created_at")
        return dict(zip(keys, row))

    def add_sampler(self, sampler_id: str, session_id: str, base_model: str, model_path: str | None,
                    model_id: str | None) -> None:
        self._run("INSERT OR REPLACE INTO samplers VALUES (?, ?, ?, ?, ?, ?)",
                  (sampler_id, session_id, base_model, model_path, model_id, time.time()))

    def sampler(self, sampler_id: str) -> dict[str, Any] | None:
        rows = self._run("SELECT sampler_id, session_id, base_model, model_path, model_id FROM samplers "
                         "WHERE sampler_id=?", (sampler_id,))
        if not rows:
            return None
        return dict(zip(("sampler_id", "session_id", "base_model", "model_path", "model_id"), rows[0]))

    def close(self) -> None:
        with self._lock:
            self._db.close()
