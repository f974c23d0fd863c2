"""The Tinker HTTP API (``/api/v1/...``) as SDK 0.38 speaks it, over :class:`~trainer.service._ops.Ops`.

Routes stay thin: work endpoints hand a closure to the :class:`~trainer.service._queue.WorkQueue` and
answer at once with a future (``{"request_id": "17", ...}``); ``retrieve_future`` long-polls for the
result. Lookups (``get_info``, samplers, training runs, checkpoints) answer directly. With a
``token`` every route but ``healthz`` needs ``X-API-Key: <token>`` (401 without a key, 403 with a
wrong one).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from trainer.service._ops import NotFound, Ops
from trainer.service._queue import JSON, WorkQueue
from trainer.service._settings import ServiceSettings

log = logging.getLogger("envhub.service")

_OPEN_PATHS = ("/api/v1/healthz",)


def create_app(ops: Ops) -> FastAPI:
    """The FastAPI app for one :class:`Ops`; the idle reaper runs while the app does."""
    settings: ServiceSettings = ops.settings

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        reaper = asyncio.create_task(_reap_idle(ops))
        try:
            yield
        finally:
            reaper.cancel()
            ops.queue.close()  # lets the request in progress finish and record its result
            if ops.host.vllm is not None:
                ops.host.vllm.close()  # frees the engine and its adapter files

    app = FastAPI(title="envhub training service (Tinker API)", lifespan=lifespan)
    app.state.ops = ops

    @app.exception_handler(NotFound)
    async def not_found(_: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, 404)

    @app.exception_handler(ValueError)
    async def bad_request(_: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, 400)
    _add_auth(app, settings)
    _add_session_routes(app, ops)
    _add_training_routes(app, ops)
    _add_sampling_routes(app, ops)
    _add_rest_routes(app, ops)
    _add_future_routes(app, ops.queue, settings)
    return app


def _add_auth(app: FastAPI, settings: ServiceSettings) -> None:
    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if settings.token and request.url.path not in _OPEN_PATHS:
            key = request.headers.get("x-api-key") or _bearer(request.headers.get("authorization", ""))
            if not key:
                return JSONResponse({"detail": "missing API key: pass api_key=<the server's --token>"}, 401)
            if not hmac.compare_digest(key.encode(), settings.token.encode()):
                return JSONResponse({"detail": "wrong API key for this training service"}, 403)
        if int(request.headers.get("content-length") or 0) > settings.max_request_bytes:
            return JSONResponse({"detail": f"request body over {settings.max_request_bytes} bytes "
                                           "(--max-request-mb); send smaller batches"}, 413)
        return await call_next(request)


def _bearer(header: str) -> str:
    return header[7:].strip() if header.lower().startswith("bearer ") else ""


def _future(request_id: int, model_id: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"request_id": str(request_id), "model_id": model_id, **extra}


def _add_session_routes(app: FastAPI, ops: Ops) -> None:
    @app.get("/api/v1/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config(body: dict) -> dict:
        # JSON futures everywhere but the two proto results; no JWT exchange; plain httpx transport.
        return {"pjwt_auth_enabled": False, "fwdbwd_max_chunk_len": ops.settings.max_batch_datums}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(body: dict) -> dict:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}

    @app.post("/api/v1/create_session")
    async def create_session(body: dict) -> dict:
        return {"session_id": ops.create_session(body.get("user_metadata") or {})}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(body: dict) -> dict:
        if not ops.store.heartbeat(str(body.get("session_id"))):
            raise HTTPException(404, f"unknown session {body.get('session_id')!r}")
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, body: dict | None = None) -> Response:
        if not ops.finish_session(session_id):
            raise HTTPException(404, f"unknown session {session_id!r}")
        return Response(status_code=200)

    @app.post("/api/v1/telemetry")
    async def telemetry(body: dict) -> dict:
        return {"status": "accepted"}  # dropped: events may carry request headers, API key included

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict:
        return {"supported_models": [ops.capabilities()]}


def _add_training_routes(app: FastAPI, ops: Ops) -> None:
    work = ops.queue

    @app.post("/api/v1/create_model")
    async def create_model(body: dict) -> dict:
        rid, model_id = ops.submit_create_model(body)
        return _future(rid, model_id)

    @app.post("/api/v1/get_info")
    async def get_info(body: dict) -> dict:
        return ops.get_info(str(body.get("model_id")))

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        if "protobuf" not in request.headers.get("content-type", ""):
            raise HTTPException(415, "forward_backward takes a protobuf ForwardBackwardRequest "
                                     "(tinker SDK >= 0.25)")
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise HTTPException(415, "compressed forward_backward bodies are not supported")
        rid, model_id = ops.submit_forward_backward(await request.body())
        return _future(rid, model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(body: dict) -> dict:
        return _future(ops.submit_training("optim_step", body), body.get("model_id"))

    @app.post("/api/v1/save_weights")
    async def save_weights(body: dict) -> dict:
        return _future(ops.submit_training("save_weights", body), body.get("model_id"))

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(body: dict) -> dict:
        return _future(ops.submit_training("save_weights_for_sampler", body), body.get("model_id"))

    @app.post("/api/v1/load_weights")
    async def load_weights(body: dict) -> dict:
        rid, model_id = ops.submit_load_weights(body)
        return _future(rid, model_id)

    @app.post("/api/v1/unload_model")
    async def unload_model(body: dict) -> dict:
        model_id = str(body.get("model_id"))
        return _future(work.submit("unload_model", lambda: ops.unload(model_id)), model_id)


def _add_sampling_routes(app: FastAPI, ops: Ops) -> None:
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(body: dict) -> dict:
        return {"sampling_session_id": ops.create_sampling_session(body)}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler(sampler_id: str) -> dict:
        row = ops.store.sampler(sampler_id)
        if row is None:
            raise HTTPException(404, f"unknown sampler {sampler_id!r}")
        return {"sampler_id": sampler_id, "base_model": row["base_model"], "model_path": row["model_path"]}

    @app.post("/api/v1/asample")
    async def asample(body: dict) -> dict:
        rid, sequence_ids = ops.submit_sample(body)
        return _future(rid, None, sample_sequence_ids=sequence_ids)


def _add_rest_routes(app: FastAPI, ops: Ops) -> None:
    @app.get("/api/v1/training_runs")
    async def training_runs(limit: int = 20, offset: int = 0) -> dict:
        runs, total = ops.store.models(max(1, min(limit, 1000)), max(0, offset))
        return {"training_runs": [ops.training_run(r) for r in runs],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    @app.get("/api/v1/training_runs/{run_id}")
    async def training_run(run_id: str) -> dict:
        row = ops.store.model(run_id)
        if row is None:
            raise HTTPException(404, f"unknown training run {run_id!r}")
        return ops.training_run(row)

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def checkpoints(run_id: str) -> dict:
        if ops.store.model(run_id) is None:
            raise HTTPException(404, f"unknown training run {run_id!r}")
        return {"checkpoints": [ops.checkpoint_record(c) for c in ops.store.checkpoints(run_id)]}

    @app.post("/api/v1/weights_info")
    async def weights_info(body: dict) -> dict:
        return ops.weights_info(str(body.get("tinker_path")))


def _add_future_routes(app: FastAPI, work: WorkQueue, settings: ServiceSettings) -> None:
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(body: dict) -> Response:
        try:
            request_id = int(body.get("request_id"))
        except (TypeError, ValueError):
            raise HTTPException(404, f"unknown request id {body.get('request_id')!r}") from None
        finished = await work.wait(request_id, settings.long_poll_s)
        future = work.store.future(request_id)
        if future is None:
            raise HTTPException(404, f"unknown request id {request_id}")
        if not finished or future.status == "pending":
            return JSONResponse({"type": "try_again", "request_id": str(request_id), "queue_state": "active"})
        return Response(future.result, media_type=future.content_type or JSON)


async def _reap_idle(ops: Ops) -> None:
    """Unload the models of sessions that stopped heart-beating for ``idle_timeout_s``."""
    period_s = max(1.0, min(60.0, ops.settings.idle_timeout_s / 4))
    while True:
        await asyncio.sleep(period_s)
        try:
            ops.reap_idle()
        except Exception:  # the reaper must outlive one bad pass
            log.exception("idle reaper pass failed")
