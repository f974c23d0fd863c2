"""The service's sampling on ``envhub-train sampler`` servers (``--sampler-servers``): training stays here.

The servers are one :class:`~trainer.sampling.pool.SamplerPool`, the trainer's own client of them: a request
goes to the least loaded server, one that fails it is taken out of rotation and the request re-sent to
another, and with none left the request fails with a message naming each server and its last error.

- **pushes**: ``save_weights_for_sampler`` pushes the run's LoRA adapter to every server under a name of its
  own (:func:`adapter_name`: the sampler id of an ephemeral sampler, the ``tinker://`` path of a named one),
  tagged with a version (an ephemeral sampler's: the run's weight generation, bumped by every optimizer step
  and load; a named one's: the optimizer steps its checkpoint records); a full-parameter run pushes its full weights
  (the servers then sample those for its samplers, as the in-process sampler samples its live weights).
- **requests** name their sampler's adapter; one that is not on the servers (unloaded for room, or a
  ``save_weights`` checkpoint never pushed) is pushed first from its CPU copy or its checkpoint.
- **room**: the servers hold at most ``max_loaded`` adapters (``--sampler-slots``); past them the least
  recently used one that no request in flight uses is unloaded from every server.
- **batching**: the requests the work queue merged into one batch go to each server as ONE
  ``POST /sample/batch`` (:class:`~trainer.sampling.server_batches.ServerBatches`, as the trainer's rollouts
  do); requests naming different adapters share it (the server decodes each adapter's rows together). A
  later batch goes at once, even to a server still decoding (``overlap``): the server's queue merges it
  into its next decode. Every adapter a request
  names is on every server in rotation before the request is sent, so a request moved to another server
  (its server died mid-batch, failed it, restarted) finds its adapter there too.
- **concurrency**: requests run on a thread of their own (an asyncio loop), so the work queue's worker goes
  on training while the servers sample; the pushes stay on the worker, in order with the training steps.
- **weight group**: with ``weight_group="gloo"`` (``--sampler-weight-group gloo``) pushes (LoRA and full)
  go through a torch.distributed group with each server (:mod:`trainer.sampling.weight_group`); a server that
  cannot join, or loses it, takes them over its weight channel or as HTTP bodies, with one log line.
- **joiners**: every ``probe_s`` a background thread sends everything the servers hold (full weights,
  every adapter) to each server out of rotation that answers (one started late, or restarted); it takes
  work only once it holds all of it. The same thread re-reads ``servers_file`` (``--sampler-servers-file``)
  and takes in the servers added to it, which join the same way; a server that leaves the file leaves the pool
  (requests in flight there are answered; not the last server, nor one named on the command line).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from trainer.core import SampledSequence, SampleResponse, SamplingParams
from trainer.sampling import remote_push
from trainer.sampling.pool import Push, SamplerPool
from trainer.sampling.server_batches import ServerBatches
from trainer.service._settings import read_server_list

log = logging.getLogger("envhub.service")
T = TypeVar("T")

#: the LoRA alpha of every adapter the service makes (ModelHost's default: create_lora_client, load_sampler)
LORA_ALPHA = 32
MAX_ADAPTER_NAME = 128  # the sampler servers' limit


@dataclass(frozen=True)
class RemoteRequest:
    """One ``asample`` as the servers take it: the ``/sample`` body and the adapter it needs on them."""

    adapter: str | None  # None: the base model (or a full-parameter run's pushed weights)
    make_push: Callable[[], Push] | None  # the adapter's weights, if they must be pushed first
    body: dict[str, Any]


def adapter_name(key: str) -> str:
    """The servers' adapter name for a sampler id or ``tinker://`` path: itself where the servers' name rules
    allow it, else a digest of it."""
    name = key.removeprefix("tinker://").replace("/", ".")
    if len(name) <= MAX_ADAPTER_NAME and all(c.isalnum() or c in "-_.:" for c in name):
        return name
    return "sampler-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def lora_push(name: str, weights: Mapping[str, torch.Tensor], *, rank: int, targets: Any, version: int) -> Push:
    """Adapter ``name``'s push: its LoRA tensors (peft state-dict names) and its LoRA settings."""
    # the LoRA tensors alone: a state saved before TrainingClient.weights_state left it out may still carry a
    # targeted unembedding's (frozen, tied) base weight, which peft's state dict used to add
    return remote_push.lora_push(name, {k: v for k, v in weights.items() if ".lora_" in k}, version=version,
                                 rank=rank, alpha=LORA_ALPHA, targets=targets)


def checkpoint_version(directory: Path) -> int:
    """The version a saved state records (its optimizer steps), 0 where it records none."""
    try:
        return int(json.loads((directory / "meta.json").read_text()).get("version", 0))
    except (OSError, ValueError, TypeError):
        return 0


def sample_body(prompt: list[int], num_samples: int, params: SamplingParams, prompt_logprobs: bool,
                adapter: str | None) -> dict[str, Any]:
    """The servers' ``/sample`` body for a request with the core's sampling parameters (same stop rules:
    no ``stop`` stops at EOS, ids or strings replace it)."""
    return {"prompt_ids": prompt, "n": num_samples, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "top_k": max(params.top_k, 0),
            "stop_ids": None if params.stop is None else params.stop_token_ids, "stop": params.stop_strings,
            "seed": params.seed, "prompt_logprobs": prompt_logprobs, **({"adapter": adapter} if adapter else {})}


def response_of(data: dict[str, Any]) -> SampleResponse:
    """A server's ``/sample`` answer as the core's :class:`SampleResponse`."""
    sequences = [SampledSequence(s["token_ids"], s["logprobs"], s["finish_reason"], version=int(data["version"]))
                 for s in data["samples"]]
    return SampleResponse(sequences, data.get("prompt_logprobs"))


class RemoteSampling:
    """The sampler servers at ``urls`` and the adapters the service keeps on them (see the module docstring)."""

    def __init__(self, urls: Sequence[str], *, token: str | None = None, max_loaded: int = 4,
                 probe_s: float = 2.0, request_timeout_s: float = 600.0, weight_group: str = "off",
                 servers_file: Path | None = None, listed: Collection[str] = (), base_fingerprint: str | None = None):
        self.servers_file = servers_file
        self._problems: set[str] = set()  # of servers_file (bad lines, unreadable), each logged once
        # the servers the file lists (as last read; at the start ``listed``, what the settings read): those that
        # leave it are removed, those named on the command line (``urls`` and not in the file at the start) never are
        self._listed = {u.rstrip("/") for u in listed}
        self._pinned = {u.rstrip("/") for u in urls} - self._listed
        self.pool = SamplerPool(urls, token=token, request_timeout_s=request_timeout_s, log=log.warning,
                                weight_group=weight_group, base_fingerprint=base_fingerprint)
        # the work queue gathered the requests already: a batch waits for nothing more (the default demand), and
        # those that arrive while a server decodes go to it at once, to join its next decode
        self.batches = ServerBatches(self.pool, overlap=True)
        self.max_loaded = max_loaded
        self._adapters: OrderedDict[str, tuple[str, Push]] = OrderedDict()  # name -> (run id, push), LRU first
        self._full: Push | None = None
        self._lock = threading.RLock()  # pushes, unloads and catch-ups one at a time
        self._busy: dict[str, int] = {}  # adapter -> requests on the servers now (never unloaded meanwhile)
        self._busy_lock = threading.Lock()
        self._stop = threading.Event()
        # requests run on this loop's thread, so the work queue's worker goes on training meanwhile
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="sampler-requests")
        self._loop_thread.start()
        self.pool.rejoin([])  # the servers up now take work at once; the others join when they answer
        if not any(s.in_rotation for s in self.pool.servers.values()):
            log.warning("no sampler server answers yet:\n%s", self.pool.down_message())
        self._prober = threading.Thread(target=self._probe, args=(probe_s,), daemon=True, name="sampler-probe")
        self._prober.start()

    # -- weights (the work queue's worker) -----------------------------------------------------------
    def put(self, name: str, run_id: str, push: Push) -> None:
        """Load or replace adapter ``name`` (of training run ``run_id``) on every server."""
        with self._lock:
            self._adapters[name] = (run_id, push)
            self._adapters.move_to_end(name)
            self._make_room(keep={name})
            self.pool.push(push, self._everything())

    def put_full(self, push: Push) -> None:
        """Replace the servers' full weights (a full-parameter run's, or the base model's again)."""
        with self._lock:
            self._full = push
            self.pool.push(push, self._everything())

    def ensure(self, name: str, make_push: Callable[[], Push], run_id: str, keep: set[str]) -> None:
        """Adapter ``name`` on the servers (pushed from ``make_push()`` unless it is there), ``keep`` not unloaded."""
        with self._lock:
            if name in self._adapters:
                self._adapters.move_to_end(name)
                return
            push = make_push()
            self._adapters[name] = (run_id, push)
            self._make_room(keep=keep | {name})
            self.pool.push(push, self._everything())

    def drop_run(self, run_id: str) -> None:
        """Unload training run ``run_id``'s adapters from the servers (those requests in flight use stay until they
        are the least recently used)."""
        with self._lock:
            with self._busy_lock:
                idle = [n for n, (run, _) in self._adapters.items() if run == run_id and not self._busy.get(n)]
            for name in idle:
                self._unload(name)

    def _make_room(self, keep: set[str]) -> None:
        while len(self._adapters) > self.max_loaded:
            with self._busy_lock:
                victim = next((n for n in self._adapters if n not in keep and not self._busy.get(n)), None)
            if victim is None:
                return  # requests in flight use them all: the servers hold more until they are answered
            self._unload(victim)

    def _unload(self, name: str) -> None:
        self._adapters.pop(name)
        self.pool.delete(f"/adapters/{name}")

    def _everything(self) -> list[Push]:
        return ([self._full] if self._full is not None else []) + [push for _, push in self._adapters.values()]

    def _probe(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            self._read_servers_file()
            if all(s.in_rotation for s in self.pool.servers.values()):
                continue
            try:
                with self._lock:
                    self.pool.rejoin(self._everything())
            except Exception:  # the prober must outlive one bad pass
                log.exception("catching sampler servers up failed")

    def _read_servers_file(self) -> None:
        """Take in the servers ``servers_file`` lists now that the pool lacks (they join once caught up), and take out
        those it no longer lists (not the last one, nor one of ``--sampler-servers``)."""
        if self.servers_file is None:
            return
        try:
            urls, bad = read_server_list(self.servers_file)
            problems = {f"{line!r} is no URL like http://host:8100; skipped" for line in bad}
        except OSError as exc:  # being rewritten, or removed: the servers taken in stay
            urls, problems = [], {f"unreadable ({exc}); the servers taken in stay"}
        else:
            problems |= self._remove_unlisted(set(urls))
        for problem in problems - self._problems:
            log.warning("sampler servers file %s: %s", self.servers_file, problem)
        self._problems = problems
        for url in urls:
            if url not in self.pool.servers:
                log.warning("sampler server %s added (from %s); it takes work once it took the weights", url,
                            self.servers_file)
                self.pool.add_server(url)

    def _remove_unlisted(self, listed: set[str]) -> set[str]:
        """Remove the servers that left the file since it was last read; the problems to log (once)."""
        problems = set()
        gone = sorted(self._listed - listed - self._pinned)
        if gone:  # the lock only then: a push holds it for as long as it travels
            with self._lock:  # not while a push is on its way to the server
                for url in gone:
                    if url in self.pool.servers and len(self.pool.servers) == 1:
                        problems.add(f"{url} is no longer listed but is the last sampler server; kept until another "
                                     "is listed")
                        listed.add(url)  # removed once another server is listed
                    elif self.pool.remove_server(url):
                        log.warning("sampler server %s removed (no longer in %s): requests in flight there are "
                                    "answered, no new ones go to it", url, self.servers_file)
        self._listed = listed
        return problems

    # -- requests ------------------------------------------------------------------------------------
    def dispatch(self, requests: list[RemoteRequest],
                 convert: Callable[[SampleResponse], T]) -> list[concurrent.futures.Future[T]]:
        """Send ``requests`` to the servers (their adapters already there) without waiting: one future each, of
        ``convert(answer)``; their adapters stay on the servers until they are answered."""
        with self._busy_lock:
            for r in requests:
                if r.adapter is not None:
                    self._busy[r.adapter] = self._busy.get(r.adapter, 0) + 1
        futures: list[concurrent.futures.Future[T]] = [concurrent.futures.Future() for _ in requests]
        for r, future in zip(requests, futures):
            future.add_done_callback(functools.partial(self._done, r.adapter))
        # queued in one callback on the loop, so all of them wait for their servers together
        self._loop.call_soon_threadsafe(self._start, requests, convert, futures)
        return futures

    def _start(self, requests: list[RemoteRequest], convert: Callable[[SampleResponse], T],
               futures: list[concurrent.futures.Future[T]]) -> None:
        for r, future in zip(requests, futures):
            task = self._loop.create_task(self._request(r, convert))
            task.add_done_callback(functools.partial(_copy_outcome, future))

    async def _request(self, request: RemoteRequest, convert: Callable[[SampleResponse], T]) -> T:
        data, _ = await self.batches.request(request.body)
        return convert(response_of(data))

    def _done(self, adapter: str | None, _: object) -> None:
        if adapter is not None:
            with self._busy_lock:
                left = self._busy.pop(adapter) - 1
                if left:
                    self._busy[adapter] = left

    def stats(self) -> dict[str, Any]:
        """For ``service_stats``: each server's state, the adapters held, the ``/sample/batch`` requests sent and
        the requests they carried, how pushes travel."""
        return {"servers": {s.url: {"in_rotation": s.in_rotation, "in_flight": s.in_flight,
                                    "weight_group": s.group is not None,
                                    **({} if s.in_rotation else {"last_error": s.last_error})}
                            for s in self.pool.servers.values()},
                "adapters": {name: push.version for name, (_, push) in list(self._adapters.items())},
                "batches_sent": self.batches.posts, "requests_sent": self.batches.bodies}

    def close(self) -> None:
        """Stop the prober and the requests' loop (requests still on the servers are not answered), close the
        connections."""
        self._stop.set()
        self._prober.join(timeout=10)
        # the loop's connections close on the loop itself (close() may run inside another loop: the app's shutdown)
        closing = asyncio.run_coroutine_threadsafe(self.batches.close_loop(), self._loop)
        try:
            closing.result(timeout=10)
        except Exception:  # shutting down: the connections go with the process
            log.debug("closing the sampler servers' connections failed", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=10)
        self.pool.close()
        self._loop.close()


def _copy_outcome(future: concurrent.futures.Future[T], task: asyncio.Task[T]) -> None:
    """``task``'s result, error or cancellation onto the caller's ``future``."""
    if task.cancelled():
        future.cancel()
    elif (exc := task.exception()) is not None:
        future.set_exception(exc)
    else:
        future.set_result(task.result())
