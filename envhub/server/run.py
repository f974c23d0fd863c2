"""Running an env server: ``serve`` (blocking, SIGTERM drains), ``uvicorn_config``, and ``ServerThread`` for tests."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

import uvicorn

from envhub.env import Env
from envhub.registry import import_target, lookup
from envhub.server.app import create_app
from envhub.server.transport import WS_IMPLEMENTATION, install_log_redaction
from envhub.settings import Settings


def load_target(target: str | type[Env]) -> type[Env]:
    """An env class from a class, a ``"module:Class"`` string or a name registered in the ``envhub.envs``
    entry-point group (:mod:`envhub.registry`)."""
    if isinstance(target, type):
        return target
    if ":" not in str(target):
        return lookup(str(target)).load()
    obj = import_target(str(target), expected="an env as 'module:Class' (e.g. my_env:GuessEnv)")
    if not (isinstance(obj, type) and issubclass(obj, Env)):
        raise ValueError(f"Expected {target!r} to name an envhub.Env subclass, got {obj!r}.")
    return obj


def check_env_config(env_cls: type[Env], env_config: dict[str, Any]) -> None:
    """Build ``env_cls(**env_config)`` once and close it: a config the env refuses (an unknown option, a bad
    value, a missing argument) is a ``ValueError`` naming it at start-up, not an error in every session."""
    import asyncio
    import inspect

    try:
        env = env_cls(**env_config)
    except Exception as exc:
        shown = ", ".join(f"{k}={v!r}" for k, v in env_config.items())
        raise ValueError(f"{env_cls.__name__}({shown}) failed: {type(exc).__name__}: {exc}") from exc
    try:
        closing = env.close()
        if inspect.isawaitable(closing):
            asyncio.run(closing)  # type: ignore[arg-type]
    except Exception:  # the trial env's own clean-up: the config was accepted, the sessions will tell the rest
        logging.getLogger("envhub").warning("closing the trial %s failed", env_cls.__name__, exc_info=True)


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """uvicorn keyword arguments for ``settings``: keepalive, frame limit, compression, shutdown grace."""
    return dict(
        host=settings.host, port=settings.port, ws=WS_IMPLEMENTATION, ws_max_size=settings.transport_max_bytes,
        ws_ping_interval=settings.ping_interval_s, ws_ping_timeout=settings.ping_timeout_s,
        ws_per_message_deflate=settings.compression, log_level=settings.log_level, lifespan="on",
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5, access_log=False)


def uvicorn_config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """A ``uvicorn.Config`` for ``app`` under ``settings`` (``overrides`` win)."""
    config = uvicorn.Config(app, **{**uvicorn_options(settings), **overrides})
    install_log_redaction()  # after Config, which (re)configures uvicorn's loggers
    return config


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose shutdown (SIGTERM, SIGINT) first drains envhub sessions.

    Order: stop accepting connections, let in-flight steps finish (up to ``shutdown_grace_s``),
    close every session with 1001 and close its env, then uvicorn's own shutdown.
    """

    async def shutdown(self, sockets: Any = None) -> None:
        for server in self.servers:
            server.close()
        hub = _find_hub(self.config)
        if hub is not None:
            await hub.drain(hub.settings.shutdown_grace_s)
        await super().shutdown(sockets)


def _find_hub(config: uvicorn.Config) -> Any:
    app = config.app
    state = getattr(app, "state", None)
    return getattr(state, "hub", None)


def serve(target: str | type[Env], host: str | None = None, port: int | None = None, *,
          env_config: dict[str, Any] | None = None, **settings: Any) -> None:
    """Serve an env until SIGTERM/SIGINT. ``settings`` override ``ENVHUB_*`` variables (see :class:`Settings`).

    ``env_config`` is passed to the env constructor. With ``workers > 1`` uvicorn forks worker
    processes that each build the app from the same target and settings::

        serve("my_env:GuessEnv", port=8000, max_sessions=64)
    """
    resolved = Settings.from_env(host=host, port=port, **settings)
    env_cls = load_target(target)
    check_env_config(env_cls, env_config or {})
    if resolved.workers > 1:
        return _serve_workers(target, env_cls, resolved, env_config or {})
    app = create_app(env_cls, settings=resolved, **(env_config or {}))
    config = uvicorn_config(app, resolved)
    shown = {**vars(resolved), "token": "***" if resolved.token is not None else None}
    logging.getLogger("uvicorn.error").info("envhub serving %s.%s with %s and env config %s",
                                            env_cls.__module__, env_cls.__qualname__, shown, env_config or {})
    DrainingServer(config).run()


def _serve_workers(target: str | type[Env], env_cls: type[Env], settings: Settings,
                   env_config: dict[str, Any]) -> None:
    os.environ["ENVHUB_TARGET"] = target if isinstance(target, str) else f"{env_cls.__module__}:{env_cls.__qualname__}"
    os.environ["ENVHUB_ENV_CONFIG"] = json.dumps(env_config)
    for name, value in vars(settings).items():
        if name == "token" and value is None:
            os.environ.pop("ENVHUB_TOKEN", None)  # no token is the absence of the variable, never a word
            continue
        os.environ[f"ENVHUB_{name.upper()}"] = "none" if value is None else str(value)
    # Each worker drains its sessions in the app's lifespan shutdown.
    uvicorn.run("envhub.server.run:app_from_environ", factory=True, workers=settings.workers,
                **uvicorn_options(settings))


def app_from_environ() -> Any:
    """App factory for worker processes: target from ``ENVHUB_TARGET``, env kwargs from ``ENVHUB_ENV_CONFIG``."""
    env_cls = load_target(os.environ["ENVHUB_TARGET"])
    return create_app(env_cls, settings=Settings.from_env(), **json.loads(os.environ.get("ENVHUB_ENV_CONFIG", "{}")))


class ServerThread:
    """Run an app on a loopback port in a background thread (for tests and notebooks).

    >>> from envhub.testing import EchoEnv
    >>> with ServerThread(create_app(EchoEnv)) as srv:   # doctest: +SKIP
    ...     srv.url   # 'http://127.0.0.1:54321'
    """

    def __init__(self, app: Any, *, settings: Settings | None = None, **uvicorn_overrides: Any):
        settings = (settings or (getattr(getattr(app, "state", None), "hub", None) and app.state.hub.settings)
                    or Settings())
        overrides = {"port": 0, "host": "127.0.0.1", "log_level": "warning", **uvicorn_overrides}
        self.server = DrainingServer(uvicorn_config(app, settings, **overrides))
        self._thread = threading.Thread(target=self.server.run, daemon=True, name="envhub-server")
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def start(self, timeout_s: float = 10.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("envhub test server did not start; see the log above.")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
