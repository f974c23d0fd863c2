"""Backend selection: probe what isolation this host offers, build the configured backend, share one per process."""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
from dataclasses import dataclass, field

from env_servers.sandbox import launcher
from env_servers.sandbox.limits import Limits, SandboxBackend, SandboxError

log = logging.getLogger(__name__)

BACKENDS = ("local-zygote", "local-bwrap", "local-rlimit", "docker")


@dataclass
class SandboxConfig:
    """Which backend to use and how big its pool is.

    ``backend``: ``auto`` (zygote when bwrap works, else docker when an engine answers, else the
    insecure rlimit fallback), or one of :data:`BACKENDS`. ``slots``: concurrent runs (default:
    CPU cores). ``preload``: modules the zygote imports once. Read from ``ENVHUB_SANDBOX_*``
    environment variables by :meth:`from_env`.
    """

    backend: str = "auto"
    slots: int | None = None
    preload: tuple[str, ...] = ("numpy",)
    max_runs: int = 500
    docker_image: str = "python:3.11-slim"
    gvisor: bool = False
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if self.backend not in ("auto", *BACKENDS):
            raise ValueError(f"Expected sandbox backend 'auto' or one of {', '.join(BACKENDS)}, got {self.backend!r}.")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> SandboxConfig:
        env = os.environ if environ is None else environ
        slots = env.get("ENVHUB_SANDBOX_SLOTS")
        preload = env.get("ENVHUB_SANDBOX_PRELOAD")
        return cls(backend=env.get("ENVHUB_SANDBOX_BACKEND", "auto"),
                   slots=int(slots) if slots else None,
                   preload=tuple(p for p in preload.split(",") if p) if preload is not None else ("numpy",),
                   docker_image=env.get("ENVHUB_SANDBOX_DOCKER_IMAGE", "python:3.11-slim"),
                   gvisor=env.get("ENVHUB_SANDBOX_GVISOR", "") in ("1", "true", "yes"))


@functools.lru_cache(maxsize=1)
def bwrap_works() -> bool:
    """A real probe run through the full bwrap chain (cached per process)."""
    if not (launcher.have_tools("bwrap", "prlimit", "setpriv") and launcher.sandbox_python_ok()):
        return False
    from env_servers.sandbox.bwrap import BwrapBackend

    try:
        with BwrapBackend(slots=1) as backend:
            result = backend.run_sync("print('sandbox-ok')", limits=Limits(timeout_s=10))
    except (OSError, SandboxError) as exc:
        log.info("bwrap probe failed: %s", exc)
        return False
    if result.stdout != "sandbox-ok\n":
        log.info("bwrap probe failed: %s %r", result.summary(), result.stderr[-500:])
        return False
    return True


def available_backends() -> list[str]:
    """Backends that can run on this host, strongest first."""
    from env_servers.sandbox.docker_backend import docker_available

    found = []
    if bwrap_works():
        found += ["local-zygote", "local-bwrap"]
    if docker_available():
        found.append("docker")
    if launcher.have_tools("prlimit") and launcher.sandbox_python_ok():
        found.append("local-rlimit")
    return found


def make_backend(config: SandboxConfig | None = None) -> SandboxBackend:
    """Build the backend ``config`` names (probing for ``auto``); the caller owns it and closes it."""
    config = config or SandboxConfig()
    name = config.backend
    if name == "auto":
        available = available_backends()
        if not available:
            raise SandboxError("No sandbox backend works on this host: install bubblewrap "
                               "(apt-get install -y bubblewrap) and /usr/bin/python3, or configure docker.")
        name = available[0]
    if name == "local-zygote":
        from env_servers.sandbox.zygote import ZygoteBackend

        return ZygoteBackend(config.slots, preload=config.preload, max_runs=config.max_runs, limits=config.limits)
    if name == "local-bwrap":
        from env_servers.sandbox.bwrap import BwrapBackend

        return BwrapBackend(config.slots)
    if name == "docker":
        from env_servers.sandbox.docker_backend import DockerBackend

        return DockerBackend(config.slots, image=config.docker_image, limits=config.limits, gvisor=config.gvisor,
                             preload=config.preload)
    from env_servers.sandbox.rlimit import RlimitBackend

    return RlimitBackend(config.slots)


_default: SandboxBackend | None = None
_default_lock = threading.Lock()


def get_default_backend() -> SandboxBackend:
    """The process-wide backend shared by every session (built on first use from ``ENVHUB_SANDBOX_*``)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = make_backend(SandboxConfig.from_env())
            atexit.register(_default.close)
            log.info("code sandbox backend: %s", _default.info())
        return _default


def set_default_backend(backend: SandboxBackend) -> None:
    """Install ``backend`` as the shared one (closing the previous one), e.g. from a server's config."""
    global _default
    with _default_lock:
        old, _default = _default, backend
    if old is not None and old is not backend:
        old.close()
