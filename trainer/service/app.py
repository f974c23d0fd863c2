"""The Tinker HTTP API (``/api/v1/...``) as SDK 0.38 speaks it, over :class:`~trainer.service._ops.Ops`.

Routes stay thin: each parses its body with :mod:`~trainer.service._requests` (a 400 naming the field
when it is malformed) and calls :class:`Ops`, which checks the request against the service's limits and
the client's ownership before it hands a closure to the :class:`~trainer.service._queue.WorkQueue`;
work endpoints answer at once with a future (``{"request_id": "17", ...}``) and ``retrieve_future``
long-polls for the result, answering at once when it is ready. Lookups (``get_info``, samplers,
training runs, checkpoints) answer directly. :class:`~trainer.service._guard.Guard` stands in front of
every route (API key, owner, body limits). Errors are ``{"detail": ..., "category": "user"}`` with the
status of their :mod:`~trainer.service._errors` class; no client input yields a 5xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from trainer.service import _requests, _rest
from trainer.service._errors import NotFound, ServiceError, UserError
from trainer.service._guard import ANONYMOUS, Guard
from trainer.service._ops import Ops
from trainer.service._queue import JSON
from trainer.service._requests import parse

log = logging.getLogger("envhub.service")

Handler = Callable[[Request], Awaitable[Response]]


def create_app(ops: Ops) -> Starlette:
    """The ASGI app for one :class:`Ops`; the idle reaper runs while the app does.

    Plain Starlette routes (no FastAPI layer): each route parses its own body, and every request costs
    the service's one event loop as little as it can, since training steps wait on it."""

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        reaper = asyncio.create_task(_reap_idle(ops))
        try:
            yield
        finally:
            reaper.cancel()
            ops.queue.close()  # lets the request in progress finish and record its result
            if ops.host.vllm is not None:
                ops.host.vllm.close()  # frees the engine and its adapter files
            if ops.remote is not None:
                ops.remote.close()

    # routes match in order: the ones every training step calls come first
    routes = [Route(path, handler, methods=[method]) for method, path, handler in
              [*_future_routes(ops), *_training_routes(ops), *_sampling_routes(ops), *_session_routes(ops),
               *_rest_routes(ops)]]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(Guard, settings=ops.settings)],
                    exception_handlers={ServiceError: _service_error, 404: _no_route,  # type: ignore[dict-item]
                                        405: _no_route})
    app.state.ops = ops
    return app


def reply(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(obj).encode(), status, media_type=JSON)


def _owner(request: Request) -> str:
    return str(request.scope.get("envhub.owner", ANONYMOUS))


def _body(request: Request) -> bytes:
    return bytes(request.scope.get("envhub.body", b""))


def _future(request_id: int, model_id: str | None = None, **extra: Any) -> Response:
    return reply({"request_id": str(request_id), "model_id": model_id, **extra})


async def _no_route(request: Request, exc: Exception) -> Response:
    """A path or method the service does not serve: JSON like every other error, saying which."""
    status = int(getattr(exc, "status_code", 404))
    if status == 405:
        detail = f"{request.method} is not allowed on {request.url.path}."
    else:
        detail = (f"The training service has no route {request.method} {request.url.path}: it is not a Tinker API "
                  "route, or one envhub does not offer (docs/service.md lists them).")
    return Response(json.dumps({"detail": detail, "category": "user"}).encode(), status, media_type=JSON)


async def _service_error(_: Request, exc: ServiceError) -> Response:
    headers = {"retry-after": "1"} if exc.status in (408, 429) else None
    return Response(json.dumps(exc.body()).encode(), exc.status, headers=headers, media_type=JSON)


def _query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    """An integer query parameter, clamped to ``[low, high]`` (SQLite's integers are 64-bit)."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.lstrip("-").isdigit() or len(raw) > 30:
        raise UserError(f"Expected query parameter {name} to be an integer, got {raw[:40]!r}.")
    return max(low, min(int(raw), high))


def _session_routes(ops: Ops) -> list[tuple[str, str, Handler]]:
    async def healthz(request: Request) -> Response:
        return reply({"status": "ok"})

    async def client_config(request: Request) -> Response:
        # JSON futures everywhere but the two proto results; no JWT exchange; batches split to fit the limits
        return reply({"pjwt_auth_enabled": False, "fwdbwd_max_chunk_len": ops.settings.max_batch_datums,
                      "fwdbwd_max_chunk_bytes_count": min(5_000_000, ops.settings.max_request_bytes // 2)})

    async def dynamic_config(request: Request) -> Response:
        return reply({"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64})

    async def create_session(request: Request) -> Response:
        req = parse(_requests.CreateSession, _body(request))
        return reply({"session_id": ops.create_session(_owner(request), req)})

    async def heartbeat(request: Request) -> Response:
        ops.heartbeat(_owner(request), parse(_requests.SessionRef, _body(request)).session_id)
        return reply({"type": "session_heartbeat"})

    async def finish(request: Request) -> Response:
        ops.finish_session(_owner(request), str(request.path_params["session_id"]))
        return Response(status_code=200)

    async def telemetry(request: Request) -> Response:
        return reply({"status": "accepted"})  # dropped: events may carry request headers, API key included

    async def capabilities(request: Request) -> Response:
        return reply({"supported_models": [ops.capabilities()]})

    async def service_stats(request: Request) -> Response:
        return reply(ops.stats())

    return [("GET", "/api/v1/healthz", healthz), ("POST", "/api/v1/client/config", client_config),
            ("POST", "/api/v1/client/dynamic_config", dynamic_config),
            ("POST", "/api/v1/create_session", create_session), ("POST", "/api/v1/session_heartbeat", heartbeat),
            ("POST", "/api/v1/sessions/{session_id}/finish", finish), ("POST", "/api/v1/telemetry", telemetry),
            ("GET", "/api/v1/get_server_capabilities", capabilities),
            ("GET", "/api/v1/service_stats", service_stats)]


def _training_routes(ops: Ops) -> list[tuple[str, str, Handler]]:
    async def create_model(request: Request) -> Response:
        rid, model_id = ops.submit_create_model(_owner(request), parse(_requests.CreateModel, _body(request)))
        return _future(rid, model_id)

    async def get_info(request: Request) -> Response:
        return reply(ops.get_info(_owner(request), parse(_requests.ModelRef, _body(request)).model_id))

    async def forward_backward(request: Request) -> Response:
        rid, model_id = ops.submit_forward_backward(_owner(request), _body(request))
        return _future(rid, model_id)

    async def optim_step(request: Request) -> Response:
        req = parse(_requests.OptimStep, _body(request))
        return _future(ops.submit_optim_step(_owner(request), req), req.model_id)

    async def save_weights(request: Request) -> Response:
        req = parse(_requests.SaveWeights, _body(request))
        return _future(ops.submit_save(_owner(request), req, "weights"), req.model_id)

    async def save_weights_for_sampler(request: Request) -> Response:
        req = parse(_requests.SaveWeights, _body(request))
        return _future(ops.submit_save(_owner(request), req, "sampler_weights"), req.model_id)

    async def load_weights(request: Request) -> Response:
        rid, model_id = ops.submit_load_weights(_owner(request), parse(_requests.LoadWeights, _body(request)))
        return _future(rid, model_id)

    async def unload_model(request: Request) -> Response:
        model_id = parse(_requests.ModelRef, _body(request)).model_id
        return _future(ops.submit_unload(_owner(request), model_id), model_id)

    return [("POST", "/api/v1/create_model", create_model), ("POST", "/api/v1/get_info", get_info),
            ("POST", "/api/v1/forward_backward", forward_backward), ("POST", "/api/v1/optim_step", optim_step),
            ("POST", "/api/v1/save_weights", save_weights),
            ("POST", "/api/v1/save_weights_for_sampler", save_weights_for_sampler),
            ("POST", "/api/v1/load_weights", load_weights), ("POST", "/api/v1/unload_model", unload_model)]


def _sampling_routes(ops: Ops) -> list[tuple[str, str, Handler]]:
    async def create_sampling_session(request: Request) -> Response:
        req = parse(_requests.CreateSamplingSession, _body(request))
        return reply({"sampling_session_id": ops.sampling.create_session(_owner(request), req)})

    async def sampler(request: Request) -> Response:
        return reply(ops.sampling.info(_owner(request), str(request.path_params["sampler_id"])))

    async def asample(request: Request) -> Response:
        rid, sequence_ids = ops.sampling.submit(_owner(request), parse(_requests.Sample, _body(request)))
        return _future(rid, None, sample_sequence_ids=sequence_ids)

    return [("POST", "/api/v1/create_sampling_session", create_sampling_session),
            ("GET", "/api/v1/samplers/{sampler_id}", sampler), ("POST", "/api/v1/asample", asample)]


def _rest_routes(ops: Ops) -> list[tuple[str, str, Handler]]:
    async def training_runs(request: Request) -> Response:
        limit, offset = _query_int(request, "limit", 20, 1, 1000), _query_int(request, "offset", 0, 0, 2**62)
        return reply(_rest.training_runs(ops, _owner(request), limit, offset))

    async def training_run(request: Request) -> Response:
        return reply(_rest.training_run(ops, _owner(request), str(request.path_params["run_id"])))

    async def checkpoints(request: Request) -> Response:
        return reply(_rest.checkpoints(ops, _owner(request), str(request.path_params["run_id"])))

    async def weights_info(request: Request) -> Response:
        path = parse(_requests.WeightsInfo, _body(request)).tinker_path
        return reply(_rest.weights_info(ops, _owner(request), path))

    return [("GET", "/api/v1/training_runs", training_runs), ("GET", "/api/v1/training_runs/{run_id}", training_run),
            ("GET", "/api/v1/training_runs/{run_id}/checkpoints", checkpoints),
            ("POST", "/api/v1/weights_info", weights_info)]


def _future_routes(ops: Ops) -> list[tuple[str, str, Handler]]:
    async def retrieve_future(request: Request) -> Response:
        raw = parse(_requests.RetrieveFuture, _body(request)).request_id
        text = str(raw)
        if not text.isdigit() or len(text) > 18:
            raise NotFound(f"Unknown request id {text[:40]!r}.")
        future = await ops.queue.retrieve(int(text), _owner(request), ops.settings.long_poll_s)
        if future is None:
            raise NotFound(f"Unknown request id {text}.")
        if future.status == "pending":
            return reply({"type": "try_again", "request_id": text, "queue_state": "active"})
        return Response(future.result, media_type=future.content_type or JSON)

    return [("POST", "/api/v1/retrieve_future", retrieve_future)]


async def _reap_idle(ops: Ops) -> None:
    """Unload the models of sessions that stopped heart-beating for ``idle_timeout_s``."""
    period_s = max(1.0, min(60.0, ops.settings.idle_timeout_s / 4))
    while True:
        await asyncio.sleep(period_s)
        try:
            ops.reap_idle()
        except Exception:  # the reaper must outlive one bad pass
            log.exception("idle reaper pass failed")
