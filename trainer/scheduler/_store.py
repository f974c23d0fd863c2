"""The SQLite job store and API-key table.

Synchronous on purpose: the scheduler calls it from one dedicated worker thread, so writes keep
their order and the event loop never waits on the disk. WAL mode lets readers (``envhub-sched
keys``, a second process) look while the service writes. The file is created mode 0600: it holds
key hashes and job environments.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

from trainer.scheduler._jobs import Job

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, user TEXT NOT NULL, state TEXT NOT NULL, data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_user ON jobs(user);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY, user TEXT NOT NULL, admin INTEGER NOT NULL,
    salt TEXT NOT NULL, hash TEXT NOT NULL, created_at REAL NOT NULL
);
"""

_JSON_FIELDS = {f.name for f in fields(Job)}
KEY_PREFIX = "esk_"


@dataclass(frozen=True)
class Principal:
    """Who is calling: a user name and whether they may see and cancel every job."""

    user: str
    admin: bool = False


def _hash_secret(salt: str, secret: str) -> str:
    # Keys are 256-bit random strings, not passwords: a salted SHA-256 resists offline guessing as
    # well as a slow hash would, and keeps every authenticated request cheap.
    return hashlib.sha256(f"{salt}:{secret}".encode()).hexdigest()


class JobStore:
    """Jobs and API keys in one SQLite file (``":memory:"`` works for tests)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            if not os.path.exists(self.path):
                os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
        if self.path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- jobs ---------------------------------------------------------------------------------
    def save(self, job: Job) -> None:
        """Insert or update ``job`` (one row; the record as JSON)."""
        data = json.dumps({k: v for k, v in vars(job).items() if k in _JSON_FIELDS})
        with self._lock:
            self._db.execute(
                "INSERT INTO jobs (id, seq, user, state, data) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET state = excluded.state, data = excluded.data",
                (job.id, job.seq, job.user, job.state, data))

    def load_all(self) -> list[Job]:
        with self._lock:
            rows = self._db.execute("SELECT data FROM jobs ORDER BY seq").fetchall()
        return [Job(**json.loads(data)) for (data,) in rows]

    # -- API keys -----------------------------------------------------------------------------
    def create_key(self, user: str, admin: bool = False) -> str:
        """Make a new key for ``user``; returns it. Only its salted hash is stored."""
        if not user or not user.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ValueError(f"Expected a user name of letters, digits, '-', '_' or '.', got {user!r}")
        key_id, secret, salt = secrets.token_hex(6), secrets.token_urlsafe(32), secrets.token_hex(16)
        with self._lock:
            self._db.execute("INSERT INTO api_keys VALUES (?, ?, ?, ?, ?, ?)",
                             (key_id, user, int(admin), salt, _hash_secret(salt, secret), time.time()))
        return f"{KEY_PREFIX}{key_id}.{secret}"

    def verify_key(self, key: str) -> Principal | None:
        """The principal that ``key`` belongs to, or None for an unknown or malformed key."""
        if not key.startswith(KEY_PREFIX) or "." not in key:
            return None
        key_id, secret = key[len(KEY_PREFIX):].split(".", 1)
        with self._lock:
            row = self._db.execute("SELECT user, admin, salt, hash FROM api_keys WHERE key_id = ?",
                                   (key_id,)).fetchone()
        if row is None:
            return None
        user, admin, salt, stored = row
        if not hmac.compare_digest(_hash_secret(salt, secret), stored):
            return None
        return Principal(user=user, admin=bool(admin))

    def key_count(self) -> int:
        with self._lock:
            (count,) = self._db.execute("SELECT COUNT(*) FROM api_keys").fetchone()
        return int(count)

    def list_keys(self) -> list[dict[str, object]]:
        with self._lock:
            rows = self._db.execute("SELECT key_id, user, admin, created_at FROM api_keys ORDER BY created_at")
            return [{"key_id": k, "user": u, "admin": bool(a), "created_at": c} for k, u, a, c in rows]

    def revoke_key(self, key_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM api_keys WHERE key_id = ?", (key_id,))
        return cur.rowcount > 0
