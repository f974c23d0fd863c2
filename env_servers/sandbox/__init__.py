"""Run untrusted Python: pluggable sandbox backends behind one async ``run`` (knows nothing about envhub).

The stable public API, also used by other envs (the math env's code-interpreter mode)::

    from env_servers.sandbox import Limits, run

    result = await run("print(6 * 7)", limits=Limits(timeout_s=2))
    result.stdout        # '42\\n'
    result.exit_code     # 0
    result.timed_out     # False

``run`` uses the process-wide backend from :func:`get_default_backend` (chosen by probing, or by
``ENVHUB_SANDBOX_BACKEND``: ``local-zygote``, ``local-bwrap``, ``local-rlimit``, ``docker``).
Build a dedicated one with :func:`make_backend`. Every backend has ``async run(...)``,
``run_sync(...)``, ``info()`` and ``close()``.
"""

from __future__ import annotations

from env_servers.sandbox.limits import ExecResult, Limits, SandboxBackend, SandboxError
from env_servers.sandbox.probe import (
    BACKENDS,
    SandboxConfig,
    available_backends,
    get_default_backend,
    make_backend,
    set_default_backend,
)


async def run(code: str, *, stdin: bytes = b"", files: dict[str, bytes] | None = None,
              limits: Limits = Limits()) -> ExecResult:
    """Run ``code`` with the shared default backend (see :func:`get_default_backend`)."""
    return await get_default_backend().run(code, stdin=stdin, files=files, limits=limits)


def run_sync(code: str, *, stdin: bytes = b"", files: dict[str, bytes] | None = None,
             limits: Limits = Limits()) -> ExecResult:
    """Blocking :func:`run`, for callers without an event loop."""
    return get_default_backend().run_sync(code, stdin=stdin, files=files, limits=limits)


__all__ = ["Limits", "ExecResult", "SandboxBackend", "SandboxError", "SandboxConfig", "BACKENDS", "run",
           "run_sync", "make_backend", "get_default_backend", "set_default_backend", "available_backends"]
