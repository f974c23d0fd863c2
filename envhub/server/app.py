"""``create_app``: one FastAPI app serving one env class over ``/ws`` and HTTP."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

from fastapi import FastAPI
from starlette.routing import WebSocketRoute

from envhub import __version__
from envhub.env import Env
from envhub.server.http import BearerAuthMiddleware, build_router
from envhub.server.hub import Hub
from envhub.server.ws import WebSocketEndpoint
from envhub.settings import Settings


class EnvApp(FastAPI):
    """FastAPI for HTTP; ``/ws`` frames go straight to the session endpoint.

    Starlette and FastAPI middleware wrap ``send`` and ``receive`` of every connection, which
    costs a few calls per frame for nothing a WebSocket session uses; the endpoint does its own
    auth and error handling, so ``/ws`` skips that stack.
    """

    ws_endpoint: WebSocketEndpoint

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket" and scope["path"] in ("/ws", scope.get("root_path", "") + "/ws"):
            return await self.ws_endpoint(scope, receive, send)
        await super().__call__(scope, receive, send)


def create_app(env_cls: type[Env], *, settings: Settings | None = None, **env_config: Any) -> FastAPI:
    """A FastAPI app serving ``env_cls``: one ``env_cls(**env_config)`` instance per session.

    ``settings`` default to ``Settings.from_env()`` (``ENVHUB_*`` variables). Sync env methods
    run in a shared thread pool of ``settings.thread_pool_size`` threads unless the class sets
    ``run_inline = True``. The hub (sessions, metrics) is ``app.state.hub``.

    >>> import json, urllib.request
    >>> from envhub.server import ServerThread, create_app
    >>> from envhub.testing import EchoEnv
    >>> app = create_app(EchoEnv)      # or serve it with: uvicorn my_module:app
    >>> with ServerThread(app) as server:
    ...     json.load(urllib.request.urlopen(server.url + "/health"))
    {'status': 'healthy'}
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
    app = EnvApp(title=meta["name"], description=meta["description"], version=__version__, lifespan=lifespan)
    app.state.hub = hub
    app.include_router(build_router(hub))
    app.ws_endpoint = WebSocketEndpoint(hub)
    app.router.routes.append(WebSocketRoute("/ws", app.ws_endpoint))  # for apps mounted under another router
    if settings.token is not None:
        app.add_middleware(BearerAuthMiddleware, hub=hub)
    return app
