"""Python client of the GPU scheduler service.

Example::

    from trainer.scheduler import SchedulerClient

    client = SchedulerClient("http://127.0.0.1:8765")          # key from ENVHUB_SCHEDULER_KEY
    with client.job(["python", "train.py"], gpus=2, kind="sft") as job:
        for text in job.logs(follow=True):                       # heartbeats run in the background
            print(text, end="")
    print(job.status()["state"])                                 # Ctrl-C above would have cancelled it

The API key comes from the ``api_key`` argument, else ``ENVHUB_SCHEDULER_KEY``, else the file
named by ``ENVHUB_SCHEDULER_KEY_FILE``; it travels only in the ``Authorization`` header.
"""

from __future__ import annotations

import builtins
import codecs
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO, TypeVar, cast

import httpx

from trainer.scheduler.errors import (
    JobNotFoundError,
    JobRequestError,
    SchedulerAuthError,
    SchedulerError,
    SchedulerUnavailableError,
)

URL_ENV, KEY_ENV, KEY_FILE_ENV = "ENVHUB_SCHEDULER_URL", "ENVHUB_SCHEDULER_KEY", "ENVHUB_SCHEDULER_KEY_FILE"
_T = TypeVar("_T")
_ERRORS = {400: JobRequestError, 422: JobRequestError, 401: SchedulerAuthError, 403: SchedulerAuthError,
           404: JobNotFoundError}


def key_from_env() -> str | None:
    """The API key from ``ENVHUB_SCHEDULER_KEY`` or the file named by ``ENVHUB_SCHEDULER_KEY_FILE``."""
    if os.environ.get(KEY_ENV):
        return os.environ[KEY_ENV].strip()
    if os.environ.get(KEY_FILE_ENV):
        return Path(os.environ[KEY_FILE_ENV]).read_text().strip()
    return None


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        return response.text
    if isinstance(detail, list):  # request validation: one line per problem
        return "; ".join(f"{'.'.join(map(str, d.get('loc', [])[1:]))}: {d.get('msg')}" for d in detail)
    return str(detail)


class SchedulerClient:
    """Submit, inspect, follow and cancel jobs on a scheduler service (synchronous, httpx)."""

    def __init__(self, url: str | None = None, api_key: str | None = None, timeout_s: float = 60.0):
        url = url or os.environ.get(URL_ENV)
        if not url:
            raise SchedulerError(f"Expected a scheduler URL, got none; pass --url or set {URL_ENV}")
        self.url = url.rstrip("/")
        self._key = api_key if api_key is not None else key_from_env()
        self._headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        self._http = httpx.Client(base_url=self.url, headers=self._headers, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SchedulerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise SchedulerUnavailableError(f"Cannot reach the scheduler at {self.url}: {exc}") from exc
        if response.status_code >= 400:
            raise _ERRORS.get(response.status_code, SchedulerError)(_detail(response))
        return response.json()

    # -- the API ------------------------------------------------------------------------------
    def submit(self, command: list[str], *, gpus: int = 0, kind: str = "cmd", name: str | None = None,
               priority: int = 0, heartbeat_timeout_s: float | None = None, env: dict[str, str] | None = None,
               cwd: str | None = None, torchrun: bool = False, ports: int = 1, nodes: int = 1,
               replicas: int = 1) -> dict[str, Any]:
        """Queue ``command`` (an argv list, run as given); returns the new job (``id``, ``state``...)."""
        body = {"command": list(command), "gpus": gpus, "kind": kind, "name": name, "priority": priority,
                "heartbeat_timeout_s": heartbeat_timeout_s, "env": dict(env or {}), "cwd": cwd,
                "torchrun": torchrun, "ports": ports, "nodes": nodes, "replicas": replicas}
        return cast("dict[str, Any]", self._call("POST", "/jobs", json=body))

    def status(self, job_id: str) -> dict[str, Any]:
        return cast("dict[str, Any]", self._call("GET", f"/jobs/{job_id}"))

    def list(self, all_users: bool = True) -> builtins.list[dict[str, Any]]:
        """Jobs you may see, oldest first (an admin sees everyone's unless ``all_users=False``)."""
        return cast("builtins.list[dict[str, Any]]", self._call("GET", "/jobs", params={"all": str(all_users).lower()}))

    def endpoints(self, job_id: str) -> builtins.list[str]:
        """URLs of a running service's live replicas (one per replica; a replica being restarted is left out)."""
        return cast("builtins.list[str]", self.status(job_id)["endpoints"])

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel; returns the job once its whole process tree is gone."""
        return cast("dict[str, Any]", self._call("POST", f"/jobs/{job_id}/cancel"))

    def heartbeat(self, job_id: str) -> dict[str, Any]:
        return cast("dict[str, Any]", self._call("POST", f"/jobs/{job_id}/heartbeat"))

    def gpus(self) -> builtins.list[dict[str, Any]]:
        """One entry per GPU: its index (on its node), name, the job holding it; on Ray also ``node_id``, ``node_ip``."""
        return cast("builtins.list[dict[str, Any]]", self._call("GET", "/gpus"))

    def nodes(self) -> builtins.list[dict[str, Any]]:
        """One entry per node: ``node_id``, ``node_ip``, ``gpus``, ``gpus_free`` and the ``jobs`` holding some."""
        return cast("builtins.list[dict[str, Any]]", self._call("GET", "/nodes"))

    def logs(self, job_id: str, tail: int | None = None, follow: bool = False) -> Any:
        """The job's output: a ``str``, or with ``follow=True`` an iterator of text until the job ends."""
        params: dict[str, Any] = {"follow": str(follow).lower()}
        if tail is not None:
            params["tail"] = tail
        if not follow:
            try:
                response = self._http.get(f"/jobs/{job_id}/logs", params=params)
            except httpx.TransportError as exc:
                raise SchedulerUnavailableError(f"Cannot reach the scheduler at {self.url}: {exc}") from exc
            if response.status_code >= 400:
                raise _ERRORS.get(response.status_code, SchedulerError)(_detail(response))
            return response.text
        return self._follow(job_id, params)

    def _follow(self, job_id: str, params: dict[str, Any]) -> Iterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character split across chunks
        for chunk in self._stream_log(job_id, params):
            if text := decoder.decode(chunk):
                yield text
        if tail := decoder.decode(b"", final=True):
            yield tail

    def follow_bytes(self, job_id: str, offset_bytes: int = 0) -> Iterator[bytes]:
        """The job's log as raw bytes from byte ``offset_bytes`` until the job ends (a follower that
        resumes after losing the scheduler passes how many bytes it has already had)."""
        return self._stream_log(job_id, {"follow": "true", "offset": offset_bytes})

    def _stream_log(self, job_id: str, params: dict[str, Any]) -> Iterator[bytes]:
        timeout = httpx.Timeout(self._http.timeout.connect, read=None)  # a quiet job is not an error
        try:
            with self._http.stream("GET", f"/jobs/{job_id}/logs", params=params, timeout=timeout) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _ERRORS.get(response.status_code, SchedulerError)(_detail(response))
                yield from response.iter_bytes()
        except httpx.TransportError as exc:
            raise SchedulerUnavailableError(f"Lost the scheduler at {self.url} while following job {job_id}: "
                                            f"{exc}") from exc

    def wait(self, job_id: str, timeout_s: float | None = None, poll_s: float = 0.25) -> dict[str, Any]:
        """Poll until the job has ended; returns its final record."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.status(job_id)
            if job["state"] not in ("queued", "running"):
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"Job {job_id} still {job['state']} after {timeout_s} s")
            time.sleep(poll_s)

    @contextmanager
    def job(self, command: builtins.list[str], *, heartbeat_timeout_s: float = 30.0, **submit: Any) -> Iterator[JobHandle]:
        """Submit a job that lives as long as the ``with`` block.

        Heartbeats go out from a background thread every third of ``heartbeat_timeout_s``; when
        the block exits — by an error, Ctrl-C (KeyboardInterrupt) or normally — a job still queued
        or running is cancelled. If this process dies, the heartbeats stop and the scheduler ends
        the job after ``heartbeat_timeout_s``.
        """
        record = self.submit(command, heartbeat_timeout_s=heartbeat_timeout_s, **submit)
        handle = JobHandle(self, record["id"], heartbeat_timeout_s / 3)
        try:
            yield handle
        finally:
            handle._stop_heartbeats()
            try:
                if self.status(handle.id)["state"] in ("queued", "running"):
                    self.cancel(handle.id)
            except SchedulerUnavailableError:
                pass  # the scheduler is gone; its heartbeat timeout ends the job if it comes back


    @contextmanager
    def training_service(self, *, gpus: int = 1, args: builtins.list[str] | None = None, heartbeat_timeout_s: float = 60.0,
                         start_timeout_s: float = 600.0, name: str = "envhub-train-serve") -> Iterator[JobHandle]:
        """Run ``envhub-train serve`` as a ``service`` job for the ``with`` block; yields its handle once the
        service answers, with ``handle.url`` its base URL (for ``tinker.ServiceClient(base_url=...)``).

        ``args`` are extra ``envhub-train serve`` flags (``--model``, ``--token``...); the port is the one
        the scheduler reserved. The service ends with the block, or — if this process dies — when its
        heartbeats stop, like any job.
        """
        command = [sys.executable, "-m", "trainer.cli", "serve", "--host", "0.0.0.0", *(args or [])]
        with self.job(command, gpus=gpus, kind="service", name=name, ports=1, cwd=os.getcwd(),
                      heartbeat_timeout_s=heartbeat_timeout_s) as handle:
            handle.url = _wait_for_service(self, handle.id, start_timeout_s)
            yield handle


def _wait_for_service(client: SchedulerClient, job_id: str, timeout_s: float) -> str:
    """The service job's URL once ``/api/v1/healthz`` answers; an error with its log if it ends first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.status(job_id)
        if job["state"] not in ("queued", "running"):
            raise SchedulerError(f"Training service job {job_id} ended ({job['state']}: {job.get('reason', '')}) "
                                 f"before answering; its log:\n{client.logs(job_id, tail=4000)}")
        if job["state"] == "running" and job["endpoints"]:
            url: str = job["endpoints"][0]
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise TimeoutError(f"Training service job {job_id} did not answer within {timeout_s} s")


class JobHandle:
    """A job submitted by :meth:`SchedulerClient.job`, kept alive by heartbeats."""

    def __init__(self, client: SchedulerClient, job_id: str, interval_s: float):
        self.client, self.id = client, job_id
        self.url: str | None = None  # a service job's base URL, set by SchedulerClient.training_service
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(interval_s,), name=f"heartbeat-{job_id}",
                                        daemon=True)
        self._thread.start()

    def _beat(self, interval_s: float) -> None:
        with httpx.Client(base_url=self.client.url, headers=self.client._headers, timeout=interval_s * 2) as http:
            while not self._stop.wait(interval_s):
                try:
                    if http.post(f"/jobs/{self.id}/heartbeat").json().get("state") not in ("queued", "running"):
                        return
                except (httpx.HTTPError, ValueError):
                    continue  # a missed beat is survivable; the timeout allows for two

    def _stop_heartbeats(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def status(self) -> dict[str, Any]:
        return self.client.status(self.id)

    def logs(self, tail: int | None = None, follow: bool = False) -> Any:
        return self.client.logs(self.id, tail=tail, follow=follow)

    def wait(self, timeout_s: float | None = None) -> dict[str, Any]:
        return self.client.wait(self.id, timeout_s)

    def cancel(self) -> dict[str, Any]:
        return self.client.cancel(self.id)


def submit_self(url: str, argv: builtins.list[str], gpus: int, kind: str = "rl", *, name: str | None = None,
                torchrun: bool = False, heartbeat_timeout_s: float = 60.0, out: TextIO | None = None,
                nodes: int = 1, reconnect_s: float = 300.0) -> int:
    """Run ``argv`` as a scheduler job from this process: stream its log, return its exit code.

    For ``envhub-train --scheduler URL``: pass the training command without ``--scheduler``
    (e.g. ``[sys.executable, "-m", "trainer.cli", "--config", ...]``). The job runs in this
    process's working directory; Ctrl-C cancels it; 130 is returned for a cancelled job and 1 for
    a job that failed without an exit code (lost heartbeat, scheduler stopped). A scheduler that
    goes away and comes back within ``reconnect_s`` (restarted on the same store: the Ray backend
    reconnects to jobs that still run) is waited for; the log resumes where it stopped, nothing
    printed twice, and heartbeats go on.
    """
    out = out or sys.stdout
    with SchedulerClient(url) as client:
        with client.job(argv, gpus=gpus, kind=kind, name=name, torchrun=torchrun, nodes=nodes, cwd=os.getcwd(),
                        heartbeat_timeout_s=heartbeat_timeout_s) as job:
            print(f"envhub-sched: job {job.id} submitted to {client.url}", file=sys.stderr, flush=True)
            _follow_through_restarts(client, job.id, out, reconnect_s)
            final = _through_restarts(client, job.wait, reconnect_s)
    if final["state"] == "cancelled":
        return 130
    return final["exit_code"] if final["exit_code"] is not None else (0 if final["state"] == "succeeded" else 1)


_RETRY_S = 1.0  # between attempts to reach a scheduler that went away


def _follow_through_restarts(client: SchedulerClient, job_id: str, out: TextIO, reconnect_s: float) -> None:
    """Copy the job's log to ``out`` until the job ends, resuming at the byte reached after an outage."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span two chunks
    received = 0

    def copy() -> None:
        nonlocal received
        for chunk in client.follow_bytes(job_id, received):
            received += len(chunk)
            out.write(decoder.decode(chunk))
            out.flush()

    _through_restarts(client, copy, reconnect_s)
    out.write(decoder.decode(b"", final=True))


def _through_restarts(client: SchedulerClient, call: Callable[[], _T], reconnect_s: float) -> _T:
    """``call()``, again while the scheduler is unreachable, until it has been so for ``reconnect_s``."""
    lost_since: float | None = None
    while True:
        try:
            return call()
        except SchedulerUnavailableError:
            now = time.monotonic()
            if lost_since is None:
                lost_since = now
                print(f"envhub-sched: lost the scheduler at {client.url}; waiting up to {reconnect_s:g} s for it "
                      "to come back", file=sys.stderr, flush=True)
            elif now - lost_since > reconnect_s:
                raise
            time.sleep(_RETRY_S)
