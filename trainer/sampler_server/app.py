"""The sampler server's HTTP face: the trainer API, versioned weight updates, health, metrics, and the OpenAI API.

==========================  ===========================================================================
route                       what it does
==========================  ===========================================================================
``POST /sample``            token ids in (and a vision-language model's image patches, :mod:`~trainer.sampling.image_wire`);
                            ``n`` samples (ids, sampled log-probs, finish reason), the prompt's log-probs when
                            asked, and the policy ``version`` that drew them out (:class:`~.protocol.SampleBody`)
``POST /sample/batch``      many ``/sample`` bodies in one request, decoded together (the HF backend: bodies of
                            different adapters and the base in one pass); one result per body: its samples
                            and version, or its own error (:class:`~.protocol.SampleBatchBody`)
``PUT /weights``            a full-parameter update: a streamed safetensors body, ``__metadata__.version``
                            (or, with ``X-Envhub-Weight-Ticket``, the same body over the weight channel)
``PUT /adapters/{name}``    load or replace LoRA adapter ``name`` (``__metadata__.lora_config``, ``version``)
``POST /weight-group``      join a trainer's 2-rank gloo or NCCL group (:mod:`.group`); a push with
                            ``X-Envhub-Weight-Group`` then brings only the header, the tensors through it
``DELETE /adapters/{name}`` unload it; ``GET /adapters`` lists the loaded ones with their versions
``GET /health``             status, model, version, adapters, queue depth, instance, weight channel port
                            (no token needed)
``GET /metrics``            Prometheus text: queue depth, requests, tokens, tokens/s, version, pushes
``/v1/...``                 ``models``, ``completions``, ``chat/completions`` (:mod:`.openai_api`)
==========================  ===========================================================================

A weight update is read completely into tensors the backend planned (every size checked against
its own model first) and only then swapped in under the backend's lock, so a request is answered
entirely by the old weights or entirely by the new ones. Updates run one at a time.
With a token, every route but ``/health`` needs ``Authorization: Bearer <token>``. Errors come back
in the OpenAI shape ``{"error": {"message", "type", "code"}}``: 400 for a bad request, 401, 404 for
an unknown model or adapter, 413 for an oversized body, 503 when the queue is full.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from trainer.sampler_server.batcher import QueueFullError, RequestBatcher
from trainer.sampler_server.channel import TICKET_HEADER, WeightChannel
from trainer.sampler_server.group import JoinBody, WeightGroups
from trainer.sampler_server.openai_api import router as openai_router
from trainer.sampler_server.protocol import (
    MAX_NAME_CHARS,
    Backend,
    BadRequestError,
    NotFoundError,
    Sample,
    SampleBatchBody,
    SampleBody,
    SampleJob,
    ServerLimits,
    check_job,
    job_of,
)
from trainer.sampler_server.state import BodyTooLargeError, ServerState, error_body, read_json
from trainer.sampling.weight_group import GROUP_HEADER
from trainer.sampling.wire import TensorStreamReader, WeightFormatError


def create_app(backend: Backend, *, limits: ServerLimits | None = None, token: str | None = None,
               backend_kind: str = "hf", tool_parser: str = "auto", channel: WeightChannel | None = None,
               weight_group: bool = True, device: str = "cpu") -> FastAPI:
    """The FastAPI app serving ``backend`` (weight bodies also through ``channel``, when given; the tensors of a
    push through a trainer's gloo group it joined, or an NCCL one when ``device`` is a CUDA device, unless
    ``weight_group`` is off)."""
    limits = limits or ServerLimits()
    batcher = RequestBatcher(backend, max_batch_rows=limits.max_batch_rows, max_queued=limits.max_queued_requests)
    state = ServerState(backend, batcher, limits, token, backend_kind, tool_parser, channel=channel,
                        groups=WeightGroups(weight_group, device))
    app = FastAPI(title="envhub sampler server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.sampler = state
    app.middleware("http")(_auth(state))
    for exc_type, status in ((BadRequestError, 400), (WeightFormatError, 400), (NotFoundError, 404),
                             (BodyTooLargeError, 413), (QueueFullError, 503)):
        app.add_exception_handler(exc_type, _error_handler(status))
    app.add_exception_handler(ValidationError, _validation_handler)
    _add_routes(app, state)
    app.include_router(openai_router)
    return app


def _error_handler(status: int) -> Any:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(str(exc), status), status_code=status)
    return handle


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ValidationError)
    return JSONResponse(error_body(_invalid(exc), 400), status_code=400)


def _invalid(exc: ValidationError) -> str:
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5])
    return f"Invalid request: {problems}"


#: the status an error of one request in a batch gets (as the routes' exception handlers map them)
_STATUS: tuple[tuple[type[Exception], int], ...] = (
    (BadRequestError, 400), (ValidationError, 400), (NotFoundError, 404), (QueueFullError, 503))


def _entry_error(exc: Exception) -> dict[str, Any]:
    status = next((code for kind, code in _STATUS if isinstance(exc, kind)), 500)
    if isinstance(exc, ValidationError):
        return error_body(_invalid(exc), status)
    return error_body(f"{type(exc).__name__}: {exc}" if status == 500 else str(exc), status)


def _answer(job: SampleJob, samples: list[Sample], version: int) -> dict[str, Any]:
    """The answer to one ``/sample`` body (an entry of ``/sample/batch``'s results, likewise)."""
    return {"samples": [{"token_ids": s.token_ids, "logprobs": s.logprobs, "finish_reason": s.finish_reason}
                        for s in samples], "version": version,
            **({"prompt_logprobs": samples[0].prompt_logprobs} if job.prompt_logprobs else {})}


def _auth(state: ServerState) -> Any:
    async def check(request: Request, call_next: Any) -> Response:
        if state.token is not None and request.url.path != "/health":
            presented = request.headers.get("authorization", "")
            scheme, _, value = presented.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), state.token.encode()):
                return JSONResponse(error_body("Missing or wrong bearer token; send 'Authorization: Bearer <token>'.",
                                               401), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        response: Response = await call_next(request)
        return response
    return check


def _add_routes(app: FastAPI, state: ServerState) -> None:
    backend, limits = state.backend, state.limits

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": backend.model_name, "backend": state.backend_kind,
                "version": backend.version, "adapters": backend.adapters(), "queue_depth": state.batcher.queue_depth,
                "instance": state.instance, "base_fingerprint": backend.base_fingerprint,
                "weight_port": state.channel.port if state.channel is not None else None,
                "weight_group": state.groups.backends()}

    @app.post("/weight-group")
    async def join_group(request: Request) -> dict[str, Any]:
        body = await read_json(request, JoinBody, 4096)
        await asyncio.to_thread(state.groups.join, body)
        return {"group": body.group, "joined": True, "instance": state.instance}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(state), media_type="text/plain; version=0.0.4")

    @app.post("/sample")
    async def sample(request: Request) -> dict[str, Any]:
        body = await read_json(request, SampleBody, limits.max_request_bytes)
        job = job_of(body, limits, backend.images, state.backend_kind)
        check_job(job, limits, backend.vocab_size(), backend.max_context())
        samples, version = await state.batcher.submit(job)
        return {**_answer(job, samples, version), "instance": state.instance}

    @app.post("/sample/batch")
    async def sample_batch(request: Request) -> Response:
        body = await read_json(request, SampleBatchBody, limits.max_batch_request_bytes)
        results: list[dict[str, Any] | None] = [None] * len(body.requests)
        jobs = []
        for i, raw in enumerate(body.requests):
            try:
                job = job_of(SampleBody.model_validate(raw), limits, backend.images, state.backend_kind)
                check_job(job, limits, backend.vocab_size(), backend.max_context())
                jobs.append((i, job))
            except (ValidationError, BadRequestError) as exc:
                results[i] = _entry_error(exc)
        outcomes = await state.batcher.submit_many([job for _, job in jobs])
        for (i, job), out in zip(jobs, outcomes):
            results[i] = _entry_error(out) if isinstance(out, Exception) else _answer(job, *out)
        # json.dumps straight away: FastAPI's encoder walks every float of a large answer one by one
        return Response(json.dumps({"results": results, "instance": state.instance}), media_type="application/json")

    @app.put("/weights")
    async def put_weights(request: Request) -> dict[str, Any]:
        async with state.update_lock:
            reader = TensorStreamReader(max_header_bytes=limits.max_header_bytes, plan=backend.plan_full)
            tensors, version, nbytes, start = await _receive(state, request, reader, "full")
            await asyncio.to_thread(backend.apply_full, tensors, version)
            _count_push(state, "full", nbytes, start)
        return {"version": version, "tensors": len(tensors), "bytes": nbytes, "instance": state.instance}

    @app.put("/adapters/{name}")
    async def put_adapter(name: str, request: Request) -> dict[str, Any]:
        _check_name(name)
        async with state.update_lock:
            def plan(header: Any) -> Any:
                raw = header.metadata.get("lora_config")
                try:
                    config = json.loads(raw) if raw is not None else None
                except json.JSONDecodeError:
                    config = None
                if not isinstance(config, dict):
                    raise BadRequestError("Expected __metadata__.lora_config: a JSON object (r, lora_alpha, "
                                          "target_modules).")
                return backend.plan_adapter(name, config, header)

            reader = TensorStreamReader(max_header_bytes=limits.max_header_bytes, plan=plan)
            try:
                tensors, version, nbytes, start = await _receive(state, request, reader, "lora")
            except BaseException:
                backend.discard_adapter(name)
                raise
            await asyncio.to_thread(backend.apply_adapter, name, tensors, version)
            _count_push(state, "lora", nbytes, start)
        return {"adapter": name, "version": version, "tensors": len(tensors), "bytes": nbytes,
                "instance": state.instance}

    @app.delete("/adapters/{name}")
    async def delete_adapter(name: str) -> dict[str, Any]:
        _check_name(name)
        async with state.update_lock:
            await asyncio.to_thread(backend.unload_adapter, name)
        return {"adapter": name, "unloaded": True}

    @app.get("/adapters")
    async def list_adapters() -> dict[str, Any]:
        return {"adapters": backend.adapters()}


def _check_name(name: str) -> None:
    if not 0 < len(name) <= MAX_NAME_CHARS or not all(c.isalnum() or c in "-_.:" for c in name):
        raise BadRequestError(f"Expected an adapter name of 1 to {MAX_NAME_CHARS} letters, digits or -_.:, "
                              f"got {name[:MAX_NAME_CHARS]!r}.")


async def _receive(state: ServerState, request: Request, reader: TensorStreamReader,
                   kind: str) -> tuple[Any, int, int, float]:
    """Stream a weight body into ``reader`` (from the request, or the weight channel when it names a ticket);
    the tensors, the push's version, its size and start time."""
    start = time.monotonic()
    nbytes = 0
    ticket, group = request.headers.get(TICKET_HEADER), request.headers.get(GROUP_HEADER)
    if ticket is not None:
        nbytes = await _receive_channel(state, ticket, reader)
    elif group is not None:  # the body is the header alone (the plan); the tensors come through the group
        async for chunk in request.stream():
            reader.feed(chunk)
        nbytes = await asyncio.to_thread(state.groups.receive, group, reader)
    else:
        try:
            async for chunk in request.stream():
                nbytes += len(chunk)
                reader.feed(chunk)
        except ClientDisconnect as exc:
            raise BadRequestError(f"The weight body was cut off after {nbytes} bytes.") from exc
    tensors = reader.finish()
    assert reader.header is not None
    meta = reader.header.metadata
    if meta.get("kind", kind) != kind:
        raise BadRequestError(f"Expected a {kind!r} weight body here, got kind {meta.get('kind')!r}.")
    raw = meta.get("version", "")
    if not raw.isdigit():
        raise BadRequestError(f"Expected __metadata__.version: a non-negative integer, got {raw!r}.")
    return tensors, int(raw), nbytes, start


async def _receive_channel(state: ServerState, ticket: str, reader: TensorStreamReader) -> int:
    """Wait for the weight channel's connection with ``ticket`` to fill ``reader``; the body's size."""
    if state.channel is None:
        raise BadRequestError(f"This server has no weight channel; send the body with the request, not "
                              f"{TICKET_HEADER}.")
    expected = state.channel.expect(ticket, reader)
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(expected.claimed)), state.channel.ticket_wait_s)
    except asyncio.TimeoutError:
        if state.channel.withdraw(ticket):
            raise BadRequestError(f"No weight stream presented the ticket within {state.channel.ticket_wait_s:.0f} s "
                                  f"(is port {state.channel.port} reachable?).") from None
    # reading runs in the channel's thread; its planner raises here if it refused the header
    return await asyncio.wrap_future(expected.done)


def _count_push(state: ServerState, kind: str, nbytes: int, start: float) -> None:
    p = state.pushes
    p.count += 1
    p.bytes += nbytes
    p.last_s = time.monotonic() - start
    p.by_kind[kind] = p.by_kind.get(kind, 0) + 1


def render_metrics(state: ServerState) -> str:
    """The Prometheus text exposition (format 0.0.4) of the server's counters."""
    s, p = state.batcher.stats, state.pushes
    rows = [
        ("queue_depth", "gauge", "Requests waiting for a batched decode.", state.batcher.queue_depth),
        ("requests_total", "counter", "Sampling requests taken.", s.requests),
        ("sequences_total", "counter", "Sequences sampled.", s.sequences),
        ("tokens_total", "counter", "Tokens sampled.", s.tokens),
        ("batches_total", "counter", "Batched decode calls.", s.batches),
        ("busy_seconds_total", "counter", "Seconds spent decoding.", round(s.busy_s, 6)),
        ("tokens_per_second", "gauge", "Tokens sampled per second of decoding.",
         round(s.tokens / s.busy_s, 3) if s.busy_s else 0.0),
        ("policy_version", "gauge", "The policy version of the base weights.", state.backend.version),
        ("adapters_loaded", "gauge", "LoRA adapters loaded.", len(state.backend.adapters())),
        ("weight_updates_total", "counter", "Weight updates applied.", p.count),
        ("weight_update_bytes_total", "counter", "Bytes of weight updates received.", p.bytes),
        ("last_weight_update_seconds", "gauge", "Seconds the last weight update took.", round(p.last_s, 6)),
    ]
    lines = []
    for name, kind, doc, value in rows:
        lines += [f"# HELP envhub_sampler_{name} {doc}", f"# TYPE envhub_sampler_{name} {kind}",
                  f"envhub_sampler_{name} {value}"]
    lines += ["# HELP envhub_sampler_errors_total Failed decode calls by exception.",
              "# TYPE envhub_sampler_errors_total counter"]
    lines += [f'envhub_sampler_errors_total{{error="{k}"}} {v}' for k, v in sorted(s.errors.items())]
    return "\n".join(lines) + "\n"


__all__ = ["create_app", "render_metrics"]
