"""Deployment settings of an env server: ``ENVHUB_*`` environment variables parsed once into a frozen dataclass.

Precedence: explicit arguments (CLI flags, ``serve(..., port=...)``) over environment
variables over defaults::

    >>> Settings.from_env({"ENVHUB_PORT": "9000"}).port
    9000
    >>> Settings.from_env({"ENVHUB_PORT": "9000"}, port=9001).port
    9001
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from envhub._wire import DEFAULT_MAX_MESSAGE_BYTES
from envhub.config import check_known

ENV_PREFIX = "ENVHUB_"
_NONE_WORDS = frozenset({"", "none", "null", "off"})
# Token values that look like "no auth" or an unedited template: refused, never taken as a secret.
_PLACEHOLDER_TOKENS = _NONE_WORDS | {"nil", "false", "no", "0", "disabled", "changeme", "change-me", "change_me",
                                     "token", "secret", "password", "your-token", "<token>", "xxx", "todo"}


@dataclass(frozen=True)
class Settings:
    """How one env server runs. Every field can be set as ``ENVHUB_<FIELD>`` (upper case).

    Times are seconds; ``None`` disables a timeout. Defaults suit LLM rollouts: a 30 s ping
    with a 120 s pong allowance survives long generations on the client side, and idle
    sessions are reaped after 10 minutes.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    max_sessions: int = 256
    step_timeout_s: float | None = None
    idle_timeout_s: float | None = 600.0
    resume_grace_s: float = 30.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ping_interval_s: float | None = 30.0
    ping_timeout_s: float | None = 120.0
    token: str | None = None  # None: no auth. Empty or placeholder values are refused (fail closed).
    thread_pool_size: int = 32
    workers: int = 1
    compression: bool = False
    log_level: str = "info"
    shutdown_grace_s: float = 30.0
    http_sessions: bool = True

    def __post_init__(self) -> None:
        checks = [
            (self.max_sessions >= 1, "max_sessions", "an integer >= 1"),
            (self.max_message_bytes >= 1024, "max_message_bytes", "at least 1024"),
            (self.thread_pool_size >= 1, "thread_pool_size", "an integer >= 1"),
            (self.workers >= 1, "workers", "an integer >= 1"),
            (0 <= self.port <= 65535, "port", "a port number 0-65535"),
            (self.resume_grace_s >= 0, "resume_grace_s", "a number >= 0"),
            (self.shutdown_grace_s >= 0, "shutdown_grace_s", "a number >= 0"),
        ]
        for name in ("step_timeout_s", "idle_timeout_s", "ping_interval_s", "ping_timeout_s"):
            value = getattr(self, name)
            checks.append((value is None or value > 0, name, "a positive number of seconds or None"))
        _check_token(self.token)
        for ok, name, expected in checks:
            if not ok:
                raise ValueError(f"Expected settings.{name} to be {expected}, got {getattr(self, name)!r} "
                                 f"(set it with ENVHUB_{name.upper()} or the matching CLI flag).")

    @property
    def transport_max_bytes(self) -> int:
        """Frames above ``max_message_bytes`` get ``MESSAGE_TOO_LARGE``; above this, the transport closes 1009."""
        return 2 * self.max_message_bytes

    def replace(self, **changes: Any) -> Settings:
        """A copy with some fields changed (None values are ignored, so unset CLI flags keep their value)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read ``ENVHUB_*`` variables (``os.environ`` by default), then apply non-None ``overrides``."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _parse(f.name, str(f.type), raw)
        check_known(cls, overrides, what="setting")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _parse(name: str, type_name: str, raw: str) -> Any:
    """Parse one variable by its annotated type (annotations are strings here)."""
    text = raw.strip()
    if name == "token":
        return raw  # never read as "no token": Settings refuses empty and placeholder tokens
    optional = "None" in type_name
    if optional and text.lower() in _NONE_WORDS:
        return None
    try:
        if type_name.startswith("bool"):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if type_name.startswith("int"):
            return int(text)
        if type_name.startswith("float"):
            return float(text)
    except ValueError:
        kind = type_name.split(" ")[0]
        raise ValueError(f"Expected {ENV_PREFIX}{name.upper()} to be {kind}"
                         f"{' or none' if optional else ''}, got {raw!r}.") from None
    return text if text or not optional else None


def _check_token(token: str | None) -> None:
    """Auth fails closed: running without auth is the absence of a token, never an empty or placeholder one."""
    if token is None:
        return
    problem = None
    if token.strip().lower() in _PLACEHOLDER_TOKENS:
        problem = "empty" if not token.strip() else f"the placeholder {token!r}"
    elif token != token.strip() or any(ch.isspace() for ch in token):
        problem = "a value with whitespace, which no 'Authorization: Bearer' header can carry"
    if problem is not None:
        raise ValueError(f"The bearer token (ENVHUB_TOKEN or --token) is {problem}. To run without auth, unset "
                         "ENVHUB_TOKEN and leave out --token; to require auth, set a real secret, e.g. "
                         "ENVHUB_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))').")


__all__ = ["Settings", "ENV_PREFIX"]
