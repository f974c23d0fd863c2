"""What each Tinker request does: check it, translate it, queue the core call, shape the answer.

``submit_*`` methods run on the HTTP side. They check everything a request can get wrong before any
work is queued (ownership, sizes and values, through :class:`~trainer.service._limits.Limits`), so a bad
request is answered at once with a 4xx; then they record a future (deduplicated by the request's sequence
number) and queue a closure. The closures run on the work queue's worker thread, where all model work
happens, and fail their future with a ``user`` error only for what depends on the state when they run
(a run unloaded meanwhile, the tenant limit, a checkpoint not yet saved). ``ModelHost`` holds the base
model and one LoRA adapter per training run (or one full-parameter run).

Every id a client names must belong to its owner (``trainer.service._guard``): another client's
sessions, runs, samplers, checkpoints and futures answer 404, exactly like ids that never existed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.core import Datum, ModelHost, TrainingClient
from trainer.model import base_fingerprint, vocab_size_of
from trainer.sampling.pool import SamplerServersDownError
from trainer.sampling.remote_push import full_push
from trainer.service import _paths, _proto, _requests, _wire
from trainer.service._errors import NotFound, UserError
from trainer.service._limits import Limits
from trainer.service._lora import checkpoint_lora, linear_parts, lora_targets
from trainer.service._queue import PROTOBUF, Batchable, BatchRunner, WorkQueue, json_body
from trainer.service._remote import RemoteSampling, adapter_name, lora_push
from trainer.service._samplers import SamplerCache
from trainer.service._sampling import Sampling
from trainer.service._settings import ServiceSettings
from trainer.service._store import Store

log = logging.getLogger("envhub.service")

Result = tuple[bytes, str]
_OWNERS_KEPT = 4096


@dataclass
class FwdBwd:
    """A checked forward_backward (or forward) request, as queued: what one pass needs."""

    model_id: str
    data: list[Datum]
    loss_fn: str
    config: dict[str, float]
    forward_only: bool


class Ops:
    """The service's operations over one :class:`ModelHost`, its :class:`Store` and its :class:`WorkQueue`."""

    def __init__(self, settings: ServiceSettings, host: ModelHost, store: Store | None = None):
        self.settings = settings
        self.host = host
        self.store = store or Store(settings.state_dir / "service.sqlite")
        self.sampling = Sampling(self)
        runners: dict[str, BatchRunner] = {"forward_backward": self.forward_backward_batch, "forward": self.forward_backward_batch,
                   "sample": self.sampling.run}
        self.queue = WorkQueue(self.store, on_start=self._set_threads, batch_runners=runners,
                               batch_window_s=settings.batch_window_s, windowed=frozenset({"sample"}),
                               max_pending=settings.max_pending, max_queued=settings.max_queued,
                               max_queued_bytes=settings.max_queued_bytes)
        self.samplers = SamplerCache(host, max_loaded=settings.sampler_slots)
        self.remote = (RemoteSampling(settings.sampler_servers, token=settings.sampler_token,
                                      max_loaded=settings.sampler_slots, weight_group=settings.sampler_weight_group,
                                      servers_file=settings.sampler_servers_file,
                                      listed=settings.listed_servers,
                                      base_fingerprint=None if settings.full_parameter else base_fingerprint(host.base))
                       if settings.sampler_servers else None)
        self.generation: dict[str, int] = {}  # bumped whenever a run's weights change
        self._owners: OrderedDict[str, str] = OrderedDict()  # session id -> owner (see _session_owner)
        vocab_size = vocab_size_of(host.base)
        self.limits = Limits.of(settings, vocab_size=vocab_size, context=self._max_context())
        self.bounds = self.limits.proto_bounds()
        self.parts = linear_parts(host.base)
        if host.vllm is not None:
            # vLLM's LoRA layers cover the transformer's linear layers, not the unembedding (tied to the embedding
            # in the tiny and Qwen models): adapters here train attention and MLP layers, whatever train_unembed says
            self.parts = {leaf: part for leaf, part in self.parts.items() if part != "unembed"}
        if self.store.interrupted:
            log.warning("%d requests were in flight when the service last stopped; they are failed",
                        self.store.interrupted)

    def _set_threads(self) -> None:
        if self.settings.threads:
            import torch

            torch.set_num_threads(self.settings.threads)

    # -- ownership (HTTP side) -----------------------------------------------------------------

    def check_session(self, owner: str, session_id: str) -> None:
        if self._session_owner(session_id) != owner:
            raise NotFound(f"Unknown session {session_id!r}; create one with tinker.ServiceClient(...).")

    def check_owned(self, owner: str, run_or_sampler_id: str, what: str = "training run") -> None:
        session = _paths.session_of(run_or_sampler_id)
        if session is None or self._session_owner(session) != owner:
            raise NotFound(f"Unknown {what} {run_or_sampler_id!r}.")

    def _session_owner(self, session_id: str) -> str | None:
        """Who owns a session (a session never changes hands: recent answers are kept, a bounded number)."""
        owner = self._owners.get(session_id)
        if owner is None:
            owner = self.store.session_owner(session_id)
            if owner is None:
                return None
            self._owners[session_id] = owner
            if len(self._owners) > _OWNERS_KEPT:
                self._owners.popitem(last=False)
        return owner

    def owned_path(self, owner: str, path: str, kind: str | None = None) -> _paths.TinkerPath:
        parsed = _paths.parse(path, kind)
        self.check_owned(owner, parsed.training_run_id, "checkpoint's training run")
        return parsed

    # -- sessions ------------------------------------------------------------------------------

    def create_session(self, owner: str, req: _requests.CreateSession) -> str:
        if self.store.live_sessions(owner, self.settings.idle_timeout_s) >= self.settings.max_sessions:
            raise UserError(f"This client has {self.settings.max_sessions} live sessions, the limit (--max-sessions); "
                            "close some (ServiceClient.close()) or let them go idle.")
        session_id = _paths.new_session_id()
        self.store.add_session(session_id, owner, dict(req.user_metadata or {}))
        return session_id

    def heartbeat(self, owner: str, session_id: str) -> None:
        self.check_session(owner, session_id)
        self.store.heartbeat(session_id)

    def finish_session(self, owner: str, session_id: str) -> None:
        self.check_session(owner, session_id)
        self.store.finish_session(session_id)
        for model_id in self.store.session_models(session_id):
            self._unload_later(model_id, owner)

    def reap_idle(self) -> None:
        for session_id in self.store.stale_sessions(self.settings.idle_timeout_s):
            for model_id in self.store.session_models(session_id):
                if model_id in self.host.clients:
                    log.info("unloading %s: its session sent no heartbeat for %.0f s", model_id,
                             self.settings.idle_timeout_s)
                    self._unload_later(model_id, "")

    def _unload_later(self, model_id: str, owner: str) -> None:
        # the service's own clean-up: never refused for back-pressure (there is at most one per training run)
        self.queue.submit("unload_model", lambda: self.unload(model_id), owner=owner, model_id=model_id, bounded=False)

    def capabilities(self) -> dict[str, Any]:
        return {"model_name": self.settings.name, "trainable": True, "sampleable": True,
                "max_context_length": self.limits.context}

    # -- training runs -------------------------------------------------------------------------

    def submit_create_model(self, owner: str, req: _requests.CreateModel) -> tuple[int, str]:
        self.check_session(owner, req.session_id)
        self.check_base_model(req.base_model)
        optimizer = (req.optimizer_config or _requests.OptimizerConfig()).type
        if optimizer != "adamw":
            raise UserError(f"Expected optimizer_config type 'adamw' (the only optimizer here), got {optimizer!r}.")
        lora = req.lora_config or _requests.LoraConfig()
        rank = self.limits.lora_rank(lora.rank)
        targets = lora_targets(self.parts, lora.model_dump())
        model_id = _paths.model_id(req.session_id, req.model_seq_id)

        def work() -> Result:
            self._add_tenant(model_id, rank, lora.seed, targets)
            self.store.add_model(model_id, req.session_id, self.settings.name, self._lora_rank(model_id),
                                 dict(req.user_metadata or {}))
            return json_body({"model_id": model_id})
        rid = self.queue.submit("create_model", work, owner=owner, dedupe_key=f"create:{model_id}", model_id=model_id)
        return rid, model_id

    def get_info(self, owner: str, model_id: str) -> dict[str, Any]:
        self.check_owned(owner, model_id)
        row = self.store.model(model_id)
        if row is None:
            raise NotFound(f"Unknown training run {model_id!r}.")
        return {"type": "get_info", "model_id": model_id, "is_lora": row["is_lora"],
                "lora_rank": row["lora_rank"] or None, "model_name": row["base_model"],
                "model_data": {"model_name": row["base_model"], "arch": type(self.host.base).__name__}}

    def submit_forward_backward(self, owner: str, body: bytes) -> tuple[int, str]:
        wire = _proto.decode_forward_backward_request(body, self.bounds)
        self.check_owned(owner, wire.model_id)
        req = FwdBwd(wire.model_id, self.limits.datums(wire), wire.loss_fn,
                     self.limits.loss_config(wire.loss_fn_config), wire.forward_only)

        def work() -> Result:
            client = self._client(req.model_id)
            run = client.forward if req.forward_only else client.forward_backward
            return _wire.forward_backward_proto(run(req.data, req.loss_fn, req.config)), PROTOBUF
        tokens = sum(len(d) for d in req.data)
        batch = None if self.settings.full_parameter else Batchable(  # LoRA tenants can share one pass
            req, req.forward_only, tokens, self.settings.max_batch_tokens, one_per_model=True)
        rid = self.queue.submit("forward" if req.forward_only else "forward_backward", work, owner=owner,
                                cost_bytes=2 * len(body), dedupe_key=_dedupe(req.model_id, wire.seq_id),
                                model_id=req.model_id, batch=batch)
        return rid, req.model_id

    def forward_backward_batch(self, reqs: list[FwdBwd]) -> list[Result | BaseException]:
        """Several training runs' forward_backward (or forward) requests in one pass through the shared base
        model (``ModelHost.forward_backward_batch``); each gets its own result or error."""
        results: list[Result | BaseException] = []
        items, slots = [], []
        for i, req in enumerate(reqs):
            try:
                items.append((self._client(req.model_id), req.data, req.loss_fn, req.config))
                slots.append(i)
                results.append(ValueError("not run"))
            except ValueError as exc:
                results.append(exc)
        outputs = self.host.forward_backward_batch(items, backward=not reqs[0].forward_only) if items else []
        for i, out in zip(slots, outputs):
            results[i] = out if isinstance(out, BaseException) else (_wire.forward_backward_proto(out), PROTOBUF)
        return results

    def submit_optim_step(self, owner: str, req: _requests.OptimStep) -> int:
        self.check_owned(owner, req.model_id)
        params = self.limits.adam(req)

        def work() -> Result:
            metrics = self._client(req.model_id).optim_step(params)
            self._bump(req.model_id)
            return json_body({"metrics": {f"{k}:mean": float(v) for k, v in metrics.items()}})
        return self.queue.submit("optim_step", work, owner=owner, dedupe_key=_dedupe(req.model_id, req.seq_id),
                                 model_id=req.model_id)

    def submit_save(self, owner: str, req: _requests.SaveWeights, kind: str) -> int:
        """``save_weights`` (``kind="weights"``) or ``save_weights_for_sampler`` (named, or ephemeral: no path)."""
        self.check_owned(owner, req.model_id)
        if req.path is None and kind == "weights":
            raise UserError("Expected a checkpoint name in save_weights' path, got none.")
        path = None if req.path is None else _paths.TinkerPath(req.model_id, kind, _paths.check_name(req.path))

        def work() -> Result:
            client = self._client(req.model_id)
            if path is None:
                return self._snapshot(req.model_id, req.sampling_session_seq_id or 0)
            existing = self.store.checkpoint(str(path)) is not None
            if not existing and self.store.checkpoint_count(req.model_id) >= self.settings.max_checkpoints_per_run:
                raise UserError(f"Training run {req.model_id!r} has {self.settings.max_checkpoints_per_run} "
                                "checkpoints, the limit (--max-checkpoints-per-run); save over an existing name.")
            directory = client.save_state(path.directory(self.settings.state_dir), optimizer=kind == "weights")
            self._record_checkpoint(path, directory)
            if kind == "sampler_weights":
                self._push_for_sampler(req.model_id, adapter_name(str(path)), client.version)
            return json_body({"path": str(path)})
        request_type = "save_weights" if kind == "weights" else "save_weights_for_sampler"
        return self.queue.submit(request_type, work, owner=owner, dedupe_key=_dedupe(req.model_id, req.seq_id),
                                 model_id=req.model_id)

    def _snapshot(self, model_id: str, sampling_session_seq_id: int) -> Result:
        """An ephemeral sampling session over a snapshot of the run's weights."""
        row = self.store.model(model_id)
        if row is None:
            raise UserError(f"Unknown training run {model_id!r}.")
        sampler_id = _paths.sampler_id(row["session_id"], sampling_session_seq_id)
        self.samplers.snapshot(sampler_id, model_id, self.generation.get(model_id, 0))
        weights = self.samplers.snapshots[sampler_id].weights
        self._push_for_sampler(model_id, adapter_name(sampler_id), self.generation.get(model_id, 0), weights)
        self.store.add_sampler(sampler_id, row["session_id"], row["base_model"], None, model_id)
        return json_body({"path": None, "sampling_session_id": sampler_id})

    def submit_load_weights(self, owner: str, req: _requests.LoadWeights) -> tuple[int, str]:
        path = self.owned_path(owner, req.path, "weights")
        if req.model_id is not None:
            self.check_owned(owner, req.model_id)
            model_id, dedupe, session_id = req.model_id, _dedupe(req.model_id, req.seq_id), None
        elif req.session_id is not None:  # create-via-load: a new run from a checkpoint
            self.check_session(owner, req.session_id)
            session_id = req.session_id
            model_id = _paths.model_id(session_id, req.model_seq_id)
            dedupe = f"create:{model_id}"
        else:
            raise UserError("Expected model_id (load into a run) or session_id (a new run) in load_weights, got neither.")

        def work() -> Result:
            source = self.store.checkpoint(str(path))
            if source is None:
                raise UserError(f"Unknown checkpoint {path}; list them with RestClient.list_checkpoints(run_id).")
            if session_id is not None:
                origin = self.store.model(source["model_id"]) or {}
                rank, targets = (0, None) if self.settings.full_parameter else checkpoint_lora(Path(source["path"]))
                self._add_tenant(model_id, rank, None, targets)
                self.store.add_model(model_id, session_id, self.settings.name, self._lora_rank(model_id),
                                     dict(req.user_metadata or {}) or origin.get("user_metadata"))
            self._client(model_id).load_state(Path(source["path"]), optimizer=req.optimizer)
            self._bump(model_id)
            return json_body({"path": str(path), "model_id": model_id})
        return self.queue.submit("load_weights", work, owner=owner, dedupe_key=dedupe, model_id=model_id), model_id

    def submit_unload(self, owner: str, model_id: str) -> int:
        self.check_owned(owner, model_id)
        return self.queue.submit("unload_model", lambda: self.unload(model_id), owner=owner, model_id=model_id)

    def unload(self, model_id: str) -> Result:
        self.samplers.drop_run(model_id)
        self.generation.pop(model_id, None)
        if model_id in self.host.clients:
            full = model_id == self.host.full
            self.host.remove(model_id)
            if self.remote is not None and full:  # the servers sample the base model again
                try:
                    self.remote.put_full(full_push(self.host.base, 0))
                except SamplerServersDownError as exc:  # kept for the servers that come back (the prober)
                    log.warning("the base weights wait for a sampler server: %s", exc)
        if self.remote is not None:
            self.remote.drop_run(model_id)
        return json_body({"model_id": model_id})

    def _push_for_sampler(self, model_id: str, name: str, version: int, weights: Any = None) -> None:
        """With sampler servers: the run's weights to every server, as adapter ``name`` (``weights``: a copy of them
        already made), or as the servers' full weights for a full-parameter run."""
        if self.remote is None:
            return
        client = self._client(model_id)
        if client.adapter is None:
            self.remote.put_full(full_push(self.host.base, version))
            return
        config = self.host.model.peft_config[client.adapter]
        push = lora_push(name, client.weights_state() if weights is None else weights, rank=int(config.r),
                         targets=config.target_modules, version=version)
        self.remote.put(name, model_id, push)

    def stats(self) -> dict[str, Any]:
        """What the scheduler and the sampler slots did: ``GET /api/v1/service_stats``."""
        q = self.queue.stats
        return {"queue": {"pending": self.queue.pending(), "jobs": q.jobs, "busy_s": round(q.busy_s, 3),
                          "busy_cpu_s": round(q.busy_cpu_s, 3),
                          "refused": q.refused, "batches": q.batches, "batched_jobs": q.batched_jobs,
                          "largest_batch": q.largest_batch,
                          "busy_by_type": {k: round(v, 3) for k, v in q.busy_by_type.items()},
                          "busy_cpu_by_type": {k: round(v, 3) for k, v in q.busy_cpu_by_type.items()}},
                "sampler_slots": {"slots": self.samplers.max_loaded, **self.samplers.stats.as_dict()},
                **({"sampler_servers": self.remote.stats()} if self.remote is not None else {})}

    # -- helpers (worker thread) ---------------------------------------------------------------

    def _client(self, model_id: str) -> TrainingClient:
        if model_id in self.host.clients:
            return self.host.client(model_id)
        if self.store.model(model_id) is not None:
            raise UserError(f"Training run {model_id!r} is not loaded (its session went idle, finished, or the "
                            "service restarted); create a training client from a saved state: "
                            "ServiceClient.create_training_client_from_state(tinker://...).")
        raise UserError(f"Unknown training run {model_id!r}; create one with create_lora_training_client.")

    def _add_tenant(self, model_id: str, rank: int, seed: int | None, targets: list[str] | None) -> None:
        if len(self.host.clients) >= self.settings.max_tenants:
            raise UserError(f"This service holds {len(self.host.clients)} training clients, its limit "
                            f"(--max-tenants {self.settings.max_tenants}); finish a session or wait for one "
                            f"to go idle ({self.settings.idle_timeout_s:.0f} s without heartbeat).")
        if self.settings.full_parameter:
            self.host.create_full_client(model_id)
        else:
            self.host.create_lora_client(model_id, rank=rank, seed=seed, target_modules=targets or "all-linear")
        self.generation[model_id] = 0

    def _lora_rank(self, model_id: str) -> int | None:
        if self.settings.full_parameter:
            return None
        return int(self.host.model.peft_config[self.host.client(model_id).adapter].r)

    def _bump(self, model_id: str) -> None:
        self.generation[model_id] = self.generation.get(model_id, 0) + 1
        self.store.touch_model(model_id)

    def _record_checkpoint(self, path: _paths.TinkerPath, directory: Path) -> None:
        size = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())
        self.store.add_checkpoint(path.training_run_id, path.name, path.kind, str(directory), str(path), size)

    def check_base_model(self, name: str | None) -> None:
        if name != self.settings.name:
            raise UserError(f"This service serves {self.settings.name!r}, not {name!r}; pass "
                            f"base_model={self.settings.name!r} (a service started with --served-name NAME answers "
                            "to NAME instead).")

    def _max_context(self) -> int:
        value = int(getattr(self.host.base.config, "max_position_embeddings", 0) or 4096)
        engine_len = getattr(self.host.vllm, "max_model_len", None)  # the vLLM engine's own cap, when one serves
        return min(value, int(engine_len)) if engine_len else value


def _dedupe(model_id: str, seq_id: int | None) -> str | None:
    """A re-sent request's key: the run and the SDK's sequence number (none without one: never deduplicated)."""
    return None if seq_id is None else f"{model_id}/{seq_id}"
