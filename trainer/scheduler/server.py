"""The scheduler's HTTP service: a FastAPI app over one :class:`Scheduler`, and ``serve``.

Routes (JSON unless said otherwise; ``Authorization: Bearer <key>`` when auth is on)::

    GET  /health                       liveness, GPU count, whether auth is on
    GET  /gpus                         inventory and which job holds each GPU (with its node on Ray)
    GET  /nodes                        inventory per node: GPUs, free GPUs, jobs holding some
    POST /jobs                         submit (body: JobRequest) -> 201, the job
    GET  /jobs[?all=false]             your jobs (an admin sees everyone's unless all=false)
    GET  /jobs/{id}                    one job
    POST /jobs/{id}/cancel             cancel; returns when the process tree is gone
    POST /jobs/{id}/heartbeat          keep a job with heartbeat_timeout_s alive
    GET  /jobs/{id}/logs[?tail=N&follow=true&offset=B]   text/plain, streamed while following
    GET  /                             a live page of GPUs and jobs
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from trainer.scheduler._core import Scheduler
from trainer.scheduler._jobs import JobRequest
from trainer.scheduler._store import Principal
from trainer.scheduler.errors import SchedulerAuthError, SchedulerError

LOCAL_USER = Principal(user="local", admin=True)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``127.0.0.1``, ``::1``, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_auth(host: str, auth: bool | None, key_count: int) -> bool:
    """Decide whether auth is on: ``auth=None`` means on when keys exist. Raises when unsafe.

    Binding anything but loopback requires auth, and auth requires at least one key.
    """
    enabled = key_count > 0 if auth is None else auth
    if enabled and key_count == 0:
        raise SchedulerError("Expected at least one API key for --auth, found none; "
                             "create one with `envhub-sched keys create --user NAME --admin`")
    if not enabled and not is_loopback(host):
        raise SchedulerError(f"Refusing to bind {host} without auth: any host that can reach it could run "
                             "commands. Create a key (`envhub-sched keys create --user NAME`) and start with "
                             "--auth, or bind 127.0.0.1")
    return enabled


# -- routes: plain module-level functions; the scheduler and auth mode come from the app's state --
router = APIRouter()


def scheduler_of(request: Request) -> Scheduler:
    """The scheduler the app serving ``request`` was created for."""
    scheduler: Scheduler = request.app.state.scheduler
    return scheduler


async def principal(request: Request, authorization: str | None = Header(default=None)) -> Principal:
    """Who is calling: the local admin when auth is off, else the owner of the bearer key."""
    if not request.app.state.auth:
        return LOCAL_USER
    if not authorization or not authorization.startswith("Bearer "):
        raise SchedulerAuthError("Expected an 'Authorization: Bearer <key>' header; "
                                 "set ENVHUB_SCHEDULER_KEY for the CLI and client")
    who = await scheduler_of(request).authenticate(authorization[len("Bearer "):].strip())
    if who is None:
        raise SchedulerAuthError("Unknown API key; create one with `envhub-sched keys create --user NAME`")
    return who


Sched = Annotated[Scheduler, Depends(scheduler_of)]
Caller = Annotated[Principal, Depends(principal)]


def _host(scheduler: Scheduler) -> str:
    return scheduler.config.advertise_host


@router.get("/health")
async def health(request: Request, scheduler: Sched) -> dict[str, Any]:
    return {"ok": True, "gpus": scheduler.gpus_total(), "auth": request.app.state.auth}


@router.get("/gpus")
async def gpus(scheduler: Sched, who: Caller) -> list[dict[str, Any]]:
    return scheduler.gpu_view()


@router.get("/nodes")
async def nodes(scheduler: Sched, who: Caller) -> list[dict[str, Any]]:
    return scheduler.node_view()


@router.post("/jobs", status_code=201)
async def submit(body: JobRequest, scheduler: Sched, who: Caller) -> dict[str, Any]:
    return (await scheduler.submit(who, body)).public(_host(scheduler))


@router.get("/jobs")
async def list_jobs(scheduler: Sched, who: Caller, all: bool = True) -> list[dict[str, Any]]:
    return [job.public(_host(scheduler)) for job in scheduler.list(who, all_users=all)]


@router.get("/jobs/{job_id}")
async def status(job_id: str, scheduler: Sched, who: Caller) -> dict[str, Any]:
    return scheduler.get(who, job_id).public(_host(scheduler))


@router.post("/jobs/{job_id}/cancel")
async def cancel(job_id: str, scheduler: Sched, who: Caller) -> dict[str, Any]:
    return (await scheduler.cancel(who, job_id)).public(_host(scheduler))


@router.post("/jobs/{job_id}/heartbeat")
async def heartbeat(job_id: str, scheduler: Sched, who: Caller) -> dict[str, Any]:
    return (await scheduler.heartbeat(who, job_id)).public(_host(scheduler))


@router.get("/jobs/{job_id}/logs")
async def logs(job_id: str, scheduler: Sched, who: Caller, tail: int | None = Query(default=None, ge=0),
               follow: bool = False, offset: int | None = Query(default=None, ge=0)) -> StreamingResponse:
    scheduler.get(who, job_id)  # 404 / 403 before streaming anything
    return StreamingResponse(scheduler.follow_log(job_id, tail, follow, offset), media_type="text/plain")


@router.get("/", response_class=HTMLResponse)
async def page() -> str:
    return resources.files("trainer.scheduler").joinpath("_page.html").read_text()


async def _scheduler_error(request: Request, exc: SchedulerError) -> JSONResponse:
    return JSONResponse({"detail": exc.message}, status_code=getattr(exc, "status_code", 500))


def create_app(scheduler: Scheduler, *, auth: bool = False) -> FastAPI:
    """The HTTP app over ``scheduler`` (the routes above). Starts the scheduler on startup if it is not
    started, and stops it after."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = not scheduler.started
        if owned:
            for note in await scheduler.start():
                print(f"envhub-sched: {note}", flush=True)
        yield
        if owned:
            await scheduler.stop()

    app = FastAPI(title="envhub GPU scheduler", lifespan=lifespan)
    app.state.scheduler, app.state.auth = scheduler, auth
    app.add_exception_handler(SchedulerError, _scheduler_error)  # type: ignore[arg-type]
    app.include_router(router)
    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0 picks a free one; read it from ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:  # one line that says what to do, not a traceback
        sock.close()
        busy = " (another process listens there: stop it or pick another --port)" \
            if exc.errno == errno.EADDRINUSE else ""
        raise OSError(exc.errno, f"Could not listen on {host}:{port}: {exc.strerror}{busy}.") from None
    sock.listen(128)
    sock.set_inheritable(False)  # jobs must not inherit the service's socket
    return sock


def run_server(scheduler: Scheduler, sock: socket.socket, *, auth: bool) -> None:
    """Serve ``create_app(scheduler)`` on ``sock`` with uvicorn until SIGINT/SIGTERM.

    On a signal, log streams end first (``scheduler.closing``) so open connections drain, then
    the lifespan hook stops the scheduler, which ends the running jobs.
    """
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            scheduler.closing = True
            super().handle_exit(sig, frame)

    config = uvicorn.Config(create_app(scheduler, auth=auth), log_level="warning", timeout_graceful_shutdown=5)
    _Server(config).run(sockets=[sock])
