"""The service's sampling requests: sampling sessions, ``asample``, and the batch runner that merges them.

:meth:`Sampling.submit` checks a request and queues it as :class:`~trainer.service._queue.Batchable` work: on
the worker, concurrent requests (one client's many prompts, several clients' samplers) with the same decode
settings run as one engine batch (:func:`~trainer.core.batch_sampling.sample_batch`: each row under its
own LoRA adapter), bounded by ``--max-sample-tokens`` tokens per batch. A seeded request runs alone, so
its samples do not depend on what else was queued. With ``--sampler vllm`` every request of a batch goes
into one ``generate`` call (:func:`~trainer.core.vllm_samplers.sample_views`: vLLM's multi-LoRA batches,
each request with its own parameters and seed).

Which weights a request samples is resolved when its batch runs (``SamplerCache``): a snapshot whose run
has not stepped since samples the live adapter; otherwise its copy is loaded into one of the
``--sampler-slots`` adapter slots, swapping out the least recently used one. Adapters a batch uses are
pinned while it runs; a batch that needs more adapters than there are slots runs in several passes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainer.core import ModelHost, SampleResponse, SamplingClient, SamplingParams
from trainer.core.batch_sampling import SampleRequest, batch_key, decode_key, sample_batch
from trainer.core.vllm_samplers import VLLMView, sample_views
from trainer.service import _paths, _requests, _wire
from trainer.service._errors import NotFound, UserError
from trainer.service._limits import Limits
from trainer.service._queue import PROTOBUF, Batchable, Deferred, WorkQueue
from trainer.service._remote import (
    RemoteRequest,
    RemoteSampling,
    adapter_name,
    checkpoint_version,
    lora_push,
    sample_body,
)
from trainer.service._samplers import SamplerCache, SlotsFull
from trainer.service._settings import ServiceSettings
from trainer.service._store import Store


class Ops(Protocol):
    """What sampling needs of the service's operations (:class:`trainer.service._ops.Ops`), named here so
    the two modules do not import each other."""

    settings: ServiceSettings
    host: ModelHost
    store: Store
    queue: WorkQueue
    samplers: SamplerCache
    remote: RemoteSampling | None
    generation: dict[str, int]
    limits: Limits

    def check_session(self, owner: str, session_id: str) -> None: ...

    def check_owned(self, owner: str, run_or_sampler_id: str, what: str = "training run") -> None: ...

    def owned_path(self, owner: str, path: str, kind: str | None = None) -> _paths.TinkerPath: ...

    def check_base_model(self, name: str | None) -> None: ...

Result = tuple[bytes, str]


@dataclass
class Pending:
    """One resolved request of a batch: ``num_samples`` completions of ``prompt`` from ``client``."""

    client: SamplingClient | VLLMView
    prompt: list[int]
    num_samples: int
    params: SamplingParams
    include_prompt_logprobs: bool


@dataclass
class QueuedSample:
    """A checked ``asample`` request, as queued."""

    req: _requests.Sample
    prompt: list[int]
    params: SamplingParams


class Sampling:
    """Sampling sessions and requests over an :class:`~trainer.service._ops.Ops`."""

    def __init__(self, ops: Ops):
        self.ops = ops

    def create_session(self, owner: str, req: _requests.CreateSamplingSession) -> str:
        ops = self.ops
        ops.check_session(owner, req.session_id)
        base: str | None = req.base_model
        if req.model_path is not None:
            path = ops.owned_path(owner, req.model_path)
            if ops.store.checkpoint(str(path)) is None:
                raise NotFound(f"Unknown checkpoint {path}.")
            base = ops.settings.name
        else:
            ops.check_base_model(base)
        sampler_id = _paths.sampler_id(req.session_id, req.sampling_session_seq_id)
        ops.store.add_sampler(sampler_id, req.session_id, str(base), req.model_path, None)
        return sampler_id

    def info(self, owner: str, sampler_id: str) -> dict[str, Any]:
        self.ops.check_owned(owner, sampler_id, "sampler")
        row = self.ops.store.sampler(sampler_id)
        if row is None:
            raise NotFound(f"Unknown sampler {sampler_id!r}.")
        return {"sampler_id": sampler_id, "base_model": row["base_model"], "model_path": row["model_path"]}

    def submit(self, owner: str, req: _requests.Sample) -> tuple[int, list[str]]:
        ops = self.ops
        prompt, params = ops.limits.sample(req)
        sampler_id = req.sampling_session_id
        if sampler_id is not None:
            ops.check_owned(owner, sampler_id, "sampling session")
        elif req.model_path is not None:
            ops.owned_path(owner, req.model_path)
        else:
            ops.check_base_model(req.base_model)
        key = f"{sampler_id}/{req.seq_id}" if sampler_id is not None and req.seq_id is not None else None
        sequence_ids = [f"{key or sampler_id}:{i}" for i in range(req.num_samples)]
        queued = QueuedSample(req, prompt, params)
        tokens = req.num_samples * (len(prompt) + params.max_tokens)
        # one vLLM generate call takes rows with any parameters, seeds included (vLLM seeds each request); so do
        # sampler servers (a batch's requests go to each server as one /sample/batch, which it splits by settings)
        settings_key = ("remote" if ops.remote is not None else "vllm" if ops.host.vllm is not None
                        else decode_key(params))
        batch = None if settings_key is None else Batchable(queued, settings_key, tokens, ops.settings.max_sample_tokens)

        def work() -> Result | Deferred:
            out = self.run([queued])[0]
            if isinstance(out, BaseException):
                raise out
            return out
        rid = ops.queue.submit("sample", work, owner=owner, cost_bytes=8 * len(prompt), dedupe_key=key, batch=batch)
        return rid, sequence_ids

    def run(self, queued: list[QueuedSample]) -> list[Result | Deferred | BaseException]:
        """Answer queued requests, merging those that can share a pass; one result or error per request (worker)."""
        if self.ops.remote is not None:
            return self._run_remote(self.ops.remote, queued)
        results: list[Result | Deferred | BaseException] = [ValueError("not run")] * len(queued)
        groups: dict[Any, list[tuple[int, Pending]]] = {}
        cache = self.ops.samplers
        try:
            for i, q in enumerate(queued):
                try:
                    client = self.sampler(q.req)
                except SlotsFull:  # this batch needs more adapters than there are slots: run what is resolved
                    self._run_groups(groups, results)
                    groups = {}
                    cache.unpin()
                    client = self.sampler(q.req)
                except ValueError as exc:
                    results[i] = exc
                    continue
                request = Pending(client, q.prompt, q.req.num_samples, q.params, bool(q.req.prompt_logprobs))
                groups.setdefault(_group(client, q.params, i), []).append((i, request))
            self._run_groups(groups, results)
        finally:
            cache.unpin()
        return results

    @staticmethod
    def _run_groups(groups: dict[Any, list[tuple[int, Pending]]],
                    results: list[Result | Deferred | BaseException]) -> None:
        for members in groups.values():
            try:
                if len(members) == 1:
                    r = members[0][1]
                    outs = [r.client.sample(r.prompt, r.num_samples, r.params,
                                            include_prompt_logprobs=r.include_prompt_logprobs)]
                else:
                    outs = _run_group([r for _, r in members])
                for (i, _), out in zip(members, outs):
                    results[i] = (_wire.sample_proto([out]), PROTOBUF)
            except ValueError as exc:  # a bad request fails alone when it can: retry the group's members one by one
                if len(members) == 1:
                    results[members[0][0]] = exc
                else:
                    for one in members:
                        Sampling._run_groups({0: [one]}, results)

    def sampler(self, req: _requests.Sample) -> SamplingClient | VLLMView:
        """The sampling client a request names, its adapter loaded and pinned (worker thread)."""
        ops = self.ops
        sampler_id = req.sampling_session_id
        row = ops.store.sampler(sampler_id) if sampler_id is not None else None
        if sampler_id is not None and row is None:
            raise UserError(f"Unknown sampling session {sampler_id!r}.")
        model_path = row["model_path"] if row else req.model_path
        if row and row["model_id"]:
            return ops.samplers.for_snapshot(str(sampler_id), ops.generation.get)
        if model_path:
            checkpoint = ops.store.checkpoint(str(_paths.parse(str(model_path))))
            if checkpoint is None:
                raise UserError(f"Unknown checkpoint {model_path}.")
            return ops.samplers.for_checkpoint(Path(checkpoint["path"]))
        return ops.samplers.base()


    # -- on sampler servers (--sampler-servers) ------------------------------------------------------
    def _run_remote(self, remote: RemoteSampling, queued: list[QueuedSample]) -> list[Result | Deferred | BaseException]:
        """Send a batch's requests to the sampler servers, in rounds of at most ``max_loaded`` adapters (the servers'
        room), each round's adapters pushed first where they are missing (worker thread); the answers come later."""
        results: list[Result | Deferred | BaseException] = [ValueError("not run")] * len(queued)
        rounds: list[list[tuple[int, RemoteRequest, str]]] = [[]]
        for i, q in enumerate(queued):
            try:
                request, run_id = self.remote_request(q)
            except ValueError as exc:
                results[i] = exc
                continue
            names = {r.adapter for _, r, _ in rounds[-1]} | {request.adapter}
            if len(names - {None}) > remote.max_loaded:
                rounds.append([])
            rounds[-1].append((i, request, run_id))
        for members in rounds:
            keep = {r.adapter for _, r, _ in members if r.adapter is not None}
            try:
                for _, r, run_id in members:
                    if r.adapter is not None and r.make_push is not None:
                        remote.ensure(r.adapter, r.make_push, run_id, keep)
            except Exception as exc:  # no server took the adapters (all down): every request of the round fails
                for i, _, _ in members:
                    results[i] = exc
                continue
            for (i, _, _), later in zip(members, remote.dispatch([r for _, r, _ in members], _proto_result)):
                results[i] = later
        return results

    def remote_request(self, q: QueuedSample) -> tuple[RemoteRequest, str]:
        """The servers' request for ``q`` (its adapter, how to push it) and the training run the adapter is of."""
        ops, req = self.ops, q.req
        sampler_id = req.sampling_session_id
        row = ops.store.sampler(sampler_id) if sampler_id is not None else None
        if sampler_id is not None and row is None:
            raise UserError(f"Unknown sampling session {sampler_id!r}.")
        model_path = row["model_path"] if row else req.model_path
        adapter: str | None = None
        make: Any = None
        run_id = ""
        if row and row["model_id"]:
            snap = ops.samplers.get(str(sampler_id))
            run_id = snap.model_id
            if snap.weights is not None:
                adapter = adapter_name(str(sampler_id))
                make = functools.partial(lora_push, adapter, snap.weights, rank=snap.rank, targets=snap.targets,
                                         version=snap.generation)
            elif snap.model_id not in ops.host.clients:  # a full-parameter run's sampler: the servers hold its weights
                raise UserError(f"Sampler {sampler_id!r} belongs to training run {snap.model_id!r}, which is unloaded.")
        elif model_path:
            path = _paths.parse(str(model_path))
            checkpoint = ops.store.checkpoint(str(path))
            if checkpoint is None:
                raise UserError(f"Unknown checkpoint {model_path}.")
            directory, run_id, adapter = Path(checkpoint["path"]), path.training_run_id, adapter_name(str(path))

            def make() -> Any:
                weights, rank, targets = ops.samplers.read_checkpoint(directory)
                return lora_push(str(adapter), weights, rank=rank, targets=targets,
                                 version=checkpoint_version(directory))
            if ops.host.full is not None:
                ops.samplers.read_checkpoint(directory)  # refused: a full-parameter service has no adapters
        elif ops.host.full is not None:
            raise UserError(f"Training run {ops.host.full!r} is training the base weights; base sampling is "
                            "unavailable.")
        body = sample_body(q.prompt, req.num_samples, q.params, bool(req.prompt_logprobs), adapter)
        return RemoteRequest(adapter, make, body), run_id


def _proto_result(response: SampleResponse) -> Result:
    return _wire.sample_proto([response]), PROTOBUF


def _run_group(group: list[Pending]) -> list[SampleResponse]:
    """Several requests that :func:`_group` put together, in one engine call: all on one vLLM engine, or all
    HF samplers with one decode setting."""
    views = [r.client for r in group if isinstance(r.client, VLLMView)]
    if len(views) == len(group):
        return sample_views([(v, r.prompt, r.num_samples, r.params, r.include_prompt_logprobs)
                             for v, r in zip(views, group)])
    rows = [SampleRequest(r.client, r.prompt, r.num_samples, r.params, r.include_prompt_logprobs)
            for r in group if isinstance(r.client, SamplingClient)]
    if len(rows) != len(group):
        raise TypeError("Expected one kind of sampler in a batch (the HF sampler or one vLLM engine), got both.")
    return sample_batch(rows)


def _group(client: SamplingClient | VLLMView, params: SamplingParams, index: int) -> Any:
    """Which requests of a batch share one engine call: equal :func:`batch_key` on the HF sampler; on one vLLM
    engine every LoRA request, and apart from them every base-model request (vLLM's CPU build applies a batch's
    adapters to its rows without one); a seeded HF request is a group of its own."""
    if not isinstance(client, SamplingClient):
        return ("vllm", id(client.engine), client.lora_request is None)
    return batch_key(client, params) or ("alone", index)
