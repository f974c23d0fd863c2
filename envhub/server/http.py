"""HTTP routes: ``/health``, ``/metadata``, ``/schema``, ``/mcp``, ``/metrics`` and stateful ``/reset`` ``/step`` ``/state``.

Unlike OpenEnv's stateless HTTP routes, ``/reset`` opens a real session whose id
(``session_id`` in the body and the ``X-Envhub-Session`` header) ``/step`` and ``/state``
send back. HTTP error bodies are the wire error data: ``{"code": ..., "message": ...}``.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from envhub import __version__
from envhub._wire import ALL_EXTENSIONS, PROTOCOL_VERSION, encode
from envhub.errors import EnvHubError, ErrorCode
from envhub.protocol import Call, Reply
from envhub.server.hub import Hub
from envhub.server.mcp import PARSE_ERROR, handle_jsonrpc, rpc_error
from envhub.server.session import Session
from envhub.server.ws import bearer_token

SESSION_HEADER = "X-Envhub-Session"

_STATUS_FOR_CODE = {
    ErrorCode.INVALID_JSON: 400, ErrorCode.UNKNOWN_TYPE: 400, ErrorCode.VALIDATION_ERROR: 422,
    ErrorCode.EXECUTION_ERROR: 500, ErrorCode.FACTORY_ERROR: 500, ErrorCode.SESSION_ERROR: 500,
    ErrorCode.CAPACITY_REACHED: 503, ErrorCode.SHUTTING_DOWN: 503, ErrorCode.EPISODE_NOT_STARTED: 409,
    ErrorCode.EPISODE_ENDED: 409, ErrorCode.STEP_TIMEOUT: 504, ErrorCode.MESSAGE_TOO_LARGE: 413,
    ErrorCode.UNAUTHORIZED: 401, ErrorCode.SESSION_EXPIRED: 404,
}


class WireJSONResponse(JSONResponse):
    """JSON written by the wire codec: a lone surrogate an env returns stays a ``\\uXXXX`` escape
    instead of making the reply unencodable (a 500)."""

    def render(self, content: Any) -> bytes:
        return encode(content).encode("utf-8")  # type: ignore[union-attr]


def error_response(data: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    """An HTTP error carrying the wire error data, with the status matching its code."""
    return WireJSONResponse(data, status_code=_STATUS_FOR_CODE.get(data.get("code", ""), 500), headers=headers)


class BearerAuthMiddleware:
    """Pure ASGI middleware: every HTTP route but ``/health`` needs the bearer token (``/ws`` checks its own)."""

    def __init__(self, app: Any, hub: Hub):
        self.app = app
        self.hub = hub

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health" \
                and not self.hub.check_token(bearer_token(scope.get("headers", []))):
            response = JSONResponse({"code": ErrorCode.UNAUTHORIZED, "message": "Missing or wrong bearer token; "
                                     "send 'Authorization: Bearer <token>'."}, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


def metadata(hub: Hub) -> dict[str, Any]:
    """``GET /metadata``: OpenEnv's fields plus the ``envhub`` block clients negotiate from."""
    s = hub.settings
    return {**hub.env_cls.metadata(), "envhub": {
        "version": __version__, "protocol": PROTOCOL_VERSION, "extensions": list(ALL_EXTENSIONS),
        "max_message_bytes": s.max_message_bytes, "ping_interval_s": s.ping_interval_s,
        "ping_timeout_s": s.ping_timeout_s, "step_timeout_s": s.step_timeout_s, "idle_timeout_s": s.idle_timeout_s,
        "resume_grace_s": s.resume_grace_s, "auth": s.token is not None, "max_sessions": s.max_sessions,
        "tools": [spec.to_openai() for spec in hub.env_cls.tools()]}}


def schemas(hub: Hub) -> dict[str, Any]:
    """``GET /schema``: JSON Schemas of the action, the observation and the state."""
    state = {"type": "object", "additionalProperties": True, "properties": {
        "episode_id": {"type": ["string", "null"]}, "step_count": {"type": "integer"},
        "done": {"type": "boolean"}, "episode_reward": {"type": "number"}}}
    return {"action": hub.env_cls.action_model.model_json_schema(),
            "observation": hub.env_cls.observation_model.model_json_schema(), "state": state}


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser's stack
        raise EnvHubError(f"Invalid JSON: {exc}", code=ErrorCode.INVALID_JSON) from None
    if not isinstance(body, dict):
        raise EnvHubError(f"Expected a JSON object body, got {type(body).__name__}.", code=ErrorCode.VALIDATION_ERROR)
    return body


def _session_for(hub: Hub, request: Request, body: dict[str, Any]) -> Session:
    session_id = body.pop("session_id", None) or request.headers.get(SESSION_HEADER) \
        or request.query_params.get("session_id")
    if not session_id:
        raise EnvHubError(f"Expected a session id (body 'session_id' or the {SESSION_HEADER} header) from "
                          "POST /reset.", code=ErrorCode.VALIDATION_ERROR)
    session = hub.sessions.get(str(session_id))
    if session is None or session.kind != "http":
        raise EnvHubError(f"Unknown or expired HTTP session {session_id!r}; POST /reset to start a new one.",
                          code=ErrorCode.SESSION_EXPIRED)
    return session


async def _run(session: Session, message: dict[str, Any]) -> JSONResponse:
    assert session.lock is not None
    async with session.lock:
        effect = session.protocol.handle(message)
        assert isinstance(effect, (Reply, Call)), effect  # HTTP never sends `close`
        envelope = effect.envelope if isinstance(effect, Reply) else await session.execute(effect)
    headers = {SESSION_HEADER: session.id}
    if envelope["type"] == "error":
        return error_response(envelope["data"], headers)
    data = envelope["data"]
    if envelope["type"] == "observation":
        data = {**data, "session_id": session.id}
    return WireJSONResponse(data, headers=headers)


def build_router(hub: Hub) -> APIRouter:
    """All HTTP routes of an env server, bound to ``hub``."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "healthy"}

    @router.get("/metadata")
    async def get_metadata() -> dict[str, Any]:
        return metadata(hub)

    @router.get("/schema")
    async def get_schema() -> dict[str, Any]:
        return schemas(hub)

    @router.get("/metrics", response_class=PlainTextResponse)
    async def get_metrics() -> Response:
        return PlainTextResponse(hub.metrics.render(), media_type="text/plain; version=0.0.4")

    @router.post("/mcp")
    async def mcp(request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body() or b"null")
        except (ValueError, RecursionError) as exc:
            return WireJSONResponse(rpc_error(PARSE_ERROR, f"Parse error: {exc}"))
        params = body.get("params") if isinstance(body, dict) else None
        session_id = params.get("session_id") if isinstance(params, dict) else None
        session = hub.sessions.get(str(session_id)) if session_id else None
        if session is not None and session.kind == "http" and session.lock is not None:
            async with session.lock:
                return WireJSONResponse(await handle_jsonrpc(body, hub.env_cls, runner=session.runner))
        return WireJSONResponse(await handle_jsonrpc(body, hub.env_cls, new_runner=hub.new_runner))

    if hub.settings.http_sessions:
        _add_episode_routes(router, hub)
    return router


def _add_episode_routes(router: APIRouter, hub: Hub) -> None:
    @router.post("/reset")
    async def reset(request: Request) -> Response:
        """Start an episode. Body: reset kwargs (``seed``, ``episode_id``, task keys), optional ``session_id``."""
        try:
            body = await _json_body(request)
            fresh = not (body.get("session_id") or request.headers.get(SESSION_HEADER))
            if fresh:
                body.pop("session_id", None)
                session = await hub.open_session(frozenset(), kind="http")
            else:
                session = _session_for(hub, request, body)
        except EnvHubError as exc:
            hub.metrics.error(exc.code)
            return error_response(exc.to_wire())
        response = await _run(session, {"type": "reset", "data": body})
        if fresh and response.status_code != 200:  # nobody can use a session whose first reset failed
            await hub.close_session(session)
        return response

    @router.post("/step")
    async def step(request: Request) -> Response:
        """Apply one action. Body: ``{"action": {...}, "session_id": ..., "timeout_s"?: float}``."""
        try:
            body = await _json_body(request)
            session = _session_for(hub, request, body)
        except EnvHubError as exc:
            hub.metrics.error(exc.code)
            return error_response(exc.to_wire())
        message = {"type": "step", "data": body.get("action")}
        if body.get("timeout_s") is not None:
            message["timeout_s"] = body["timeout_s"]
        return await _run(session, message)

    @router.get("/state")
    async def state(request: Request) -> Response:
        """The episode state of the session named by ``?session_id=`` or the session header."""
        try:
            session = _session_for(hub, request, {})
        except EnvHubError as exc:
            return error_response(exc.to_wire())
        return await _run(session, {"type": "state"})
