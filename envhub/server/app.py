"""``create_app``: one FastAPI app serving one env class over ``/ws`` and HTTP."""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

from fastapi import FastAPI
from starlette.routing import WebSocketRoute

from envhub import __version__
from envhub.env import Env
from envhub.server.http import BearerAuthMiddleware, build_router
from envhub.server.hub import Hub
from envhub.server.ws import WebSocketEndpoint
from envhub.settings import Settings


def create_app(env_cls: type[Env], *, settings: Settings | None = None, **env_config: Any) -> FastAPI:
    """A FastAPI app serving ``env_cls``: one ``env_cls(**env_config)`` instance per session.

    ``settings`` default to ``Settings.from_env()`` (``ENVHUB_*`` variables). Sync env methods
    run in a shared thread pool of ``settings.thread_pool_size`` threads unless the class sets
    ``run_inline = True``. The hub (sessions, metrics) is ``app.state.hub``::

        from envhub.server import create_app
        from envhub.testing import EchoEnv
        app = create_app(EchoEnv)      # uvicorn my_module:app
    """
    if not (isinstance(env_cls, type) and issubclass(env_cls, Env)):
        raise TypeError(f"Expected an envhub.Env subclass, got {env_cls!r}. Subclass envhub.Env and pass the class.")
    settings = settings if settings is not None else Settings.from_env()
    hub = Hub(env_cls, settings, dict(env_config))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await hub.drain(settings.shutdown_grace_s)

    meta = env_cls.metadata()
    app = FastAPI(title=meta["name"], description=meta["description"], version=__version__, lifespan=lifespan)
    app.state.hub = hub
    app.include_router(build_router(hub))
    app.router.routes.append(WebSocketRoute("/ws", WebSocketEndpoint(hub)))
    if settings.token is not None:
        app.add_middleware(BearerAuthMiddleware, hub=hub)
    return app
