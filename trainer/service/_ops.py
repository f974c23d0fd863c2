"""What each Tinker request does: look it up, translate it, queue the core call, shape the answer.

``submit_*`` methods run on the HTTP side: they record a future (deduplicated by the request's
sequence number) and queue a closure; the closures run on the work queue's worker thread, where all model work
happens. ``ModelHost`` holds the base model and one LoRA adapter per training run (or one
full-parameter run); the tenant limit, idle unloading and ``tinker://`` checkpoints live here.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainer.core import ModelHost
from trainer.service import _paths, _proto, _wire
from trainer.service._lora import checkpoint_lora, linear_parts, lora_targets
from trainer.service._queue import PROTOBUF, UserError, WorkQueue, json_body
from trainer.service._samplers import SamplerCache
from trainer.service._settings import ServiceSettings
from trainer.service._store import Store

log = logging.getLogger("envhub.service")


class NotFound(LookupError):
    """An id a synchronous route does not know (answered 404)."""


class Ops:
    def __init__(self, settings: ServiceSettings, host: ModelHost, store: Store | None = None):
        self.settings = settings
        self.host = host
        self.store = store or Store(settings.state_dir / "service.sqlite")
        self.queue = WorkQueue(self.store, on_start=self._set_threads, batch_runner=self.forward_backward_batch)
        self.samplers = SamplerCache(host)
        self.generation: dict[str, int] = {}  # bumped whenever a run's weights change
        self.vocab_size = int(host.base.get_input_embeddings().weight.shape[0])
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

    # -- sessions ------------------------------------------------------------------------------

    def create_session(self, user_metadata: dict[str, Any]) -> str:
        session_id = _paths.new_session_id()
        self.store.add_session(session_id, user_metadata)
        return session_id

    def finish_session(self, session_id: str) -> bool:
        if not self.store.finish_session(session_id):
            return False
        for model_id in self.store.session_models(session_id):
            self.queue.submit("unload_model", lambda m=model_id: self.unload(m), model_id=model_id)
        return True

    def reap_idle(self) -> None:
        for session_id in self.store.stale_sessions(self.settings.idle_timeout_s):
            for model_id in self.store.session_models(session_id):
                if model_id in self.host.clients:
                    log.info("unloading %s: its session sent no heartbeat for %.0f s", model_id,
                             self.settings.idle_timeout_s)
                    self.queue.submit("unload_model", lambda m=model_id: self.unload(m), model_id=model_id)

    def capabilities(self) -> dict[str, Any]:
        return {"model_name": self.settings.name, "trainable": True, "sampleable": True,
                "max_context_length": self._max_context()}

    # -- training runs -------------------------------------------------------------------------

    def submit_create_model(self, body: dict[str, Any]) -> tuple[int, str]:
        session_id, seq = str(body.get("session_id")), int(body.get("model_seq_id", 0))
        model_id = _paths.model_id(session_id, seq)
        lora = body.get("lora_config") or {}

        def work() -> tuple[bytes, str]:
            self._check_session(session_id)
            self._check_base_model(body.get("base_model"))
            if (body.get("optimizer_config") or {}).get("type", "adamw") != "adamw":
                raise UserError(f"Expected optimizer_config type 'adamw' (the only optimizer here), got "
                                f"{body['optimizer_config']['type']!r}.")
            self._add_tenant(model_id, int(lora.get("rank", 32)), lora.get("seed"), lora_targets(self.parts, lora))
            self.store.add_model(model_id, session_id, self.settings.name, self._lora_rank(model_id),
                                 body.get("user_metadata"))
            return json_body({"model_id": model_id})
        return self.queue.submit("create_model", work, dedupe_key=f"create:{model_id}", model_id=model_id), model_id

    def get_info(self, model_id: str) -> dict[str, Any]:
        row = self.store.model(model_id)
        if row is None:
            raise NotFound(f"unknown training run {model_id!r}")
        return {"type": "get_info", "model_id": model_id, "is_lora": row["is_lora"],
                "lora_rank": row["lora_rank"] or None, "model_name": row["base_model"],
                "model_data": {"model_name": row["base_model"], "arch": type(self.host.base).__name__}}

    def submit_forward_backward(self, body: bytes) -> tuple[int, str | None]:
        try:
            req = _proto.decode_forward_backward_request(body)
        except ValueError as exc:
            return self.queue.fail_now("forward_backward", f"Expected a ForwardBackwardRequest protobuf: {exc}"), None
        kind = "forward" if req.forward_only else "forward_backward"

        def work() -> tuple[bytes, str]:
            client, data = self._client(req.model_id), self._datums(req)
            run = client.forward if req.forward_only else client.forward_backward
            return _wire.forward_backward_proto(run(data, req.loss_fn, dict(req.loss_fn_config))), PROTOBUF
        batch = None if self.settings.full_parameter else req  # LoRA tenants can share one pass
        rid = self.queue.submit(kind, work, dedupe_key=f"{req.model_id}/{req.seq_id}", model_id=req.model_id,
                                 batch=batch)
        return rid, req.model_id

    def _datums(self, req: _proto.ForwardBackwardRequest) -> list:
        if len(req.data) > self.settings.max_batch_datums:
            raise UserError(f"Expected at most {self.settings.max_batch_datums} datums per call, got {len(req.data)}.")
        return _wire.datums(req.data, vocab_size=self.vocab_size, max_tokens=self.settings.max_batch_tokens)

    def forward_backward_batch(self, reqs: list[_proto.ForwardBackwardRequest]) -> list:
        """Several training runs' forward_backward (or forward) requests in one pass through the shared base
        model (``ModelHost.forward_backward_batch``); each gets its own result or error."""
        results: list[Any] = [None] * len(reqs)
        items, slots = [], []
        for i, req in enumerate(reqs):
            try:
                items.append((self._client(req.model_id), self._datums(req), req.loss_fn, dict(req.loss_fn_config)))
                slots.append(i)
            except ValueError as exc:
                results[i] = exc
        outputs = self.host.forward_backward_batch(items, backward=not reqs[0].forward_only) if items else []
        for i, out in zip(slots, outputs):
            results[i] = out if isinstance(out, BaseException) else (_wire.forward_backward_proto(out), PROTOBUF)
        return results

    def submit_training(self, kind: str, body: dict[str, Any]) -> int:
        model_id = str(body.get("model_id"))
        work = {"optim_step": self._optim_step, "save_weights": self._save_weights,
                "save_weights_for_sampler": self._save_for_sampler}[kind]
        return self.queue.submit(kind, lambda: work(model_id, body), dedupe_key=f"{model_id}/{body.get('seq_id')}",
                                  model_id=model_id)

    def _optim_step(self, model_id: str, body: dict[str, Any]) -> tuple[bytes, str]:
        client = self._client(model_id)
        metrics = client.optim_step(_wire.adam_params(body))
        self._bump(model_id)
        return json_body({"metrics": {f"{k}:mean": float(v) for k, v in metrics.items()}})

    def _save_weights(self, model_id: str, body: dict[str, Any]) -> tuple[bytes, str]:
        client = self._client(model_id)
        path = _paths.TinkerPath(model_id, "weights", _paths.check_name(str(body.get("path"))))
        directory = client.save_state(path.directory(self.settings.state_dir), optimizer=True)
        self._record_checkpoint(path, directory)
        return json_body({"path": str(path)})

    def _save_for_sampler(self, model_id: str, body: dict[str, Any]) -> tuple[bytes, str]:
        client = self._client(model_id)
        if body.get("path") is None:  # ephemeral: a sampling session over a snapshot of these weights
            row = self.store.model(model_id)
            sampler_id = _paths.sampler_id(row["session_id"], int(body.get("sampling_session_seq_id") or 0))
            self.samplers.snapshot(sampler_id, model_id, self.generation.get(model_id, 0))
            self.store.add_sampler(sampler_id, row["session_id"], row["base_model"], None, model_id)
            return json_body({"path": None, "sampling_session_id": sampler_id})
        path = _paths.TinkerPath(model_id, "sampler_weights", _paths.check_name(str(body["path"])))
        directory = client.save_state(path.directory(self.settings.state_dir), optimizer=False)
        self._record_checkpoint(path, directory)
        return json_body({"path": str(path)})

    def submit_load_weights(self, body: dict[str, Any]) -> tuple[int, str]:
        if body.get("model_id") is None:  # create-via-load: a new run from a checkpoint
            model_id = _paths.model_id(str(body.get("session_id")), int(body.get("model_seq_id", 0)))
            dedupe = f"create:{model_id}"
        else:
            model_id, dedupe = str(body["model_id"]), f"{body['model_id']}/{body.get('seq_id')}"

        def work() -> tuple[bytes, str]:
            path = _paths.parse(str(body.get("path")), "weights")
            source = self.store.checkpoint(str(path))
            if source is None:
                raise UserError(f"Unknown checkpoint {path}; list them with RestClient.list_checkpoints(run_id).")
            if body.get("model_id") is None:
                session_id = str(body.get("session_id"))
                self._check_session(session_id)
                origin = self.store.model(source["model_id"]) or {}
                rank, targets = (0, None) if self.settings.full_parameter else checkpoint_lora(Path(source["path"]))
                self._add_tenant(model_id, rank, None, targets)
                self.store.add_model(model_id, session_id, self.settings.name, self._lora_rank(model_id),
                                     body.get("user_metadata") or origin.get("user_metadata"))
            self._client(model_id).load_state(Path(source["path"]), optimizer=bool(body.get("optimizer")))
            self._bump(model_id)
            return json_body({"path": str(path), "model_id": model_id})
        return self.queue.submit("load_weights", work, dedupe_key=dedupe, model_id=model_id), model_id

    def unload(self, model_id: str) -> tuple[bytes, str]:
        self.samplers.drop_run(model_id)
        if model_id in self.host.clients:
            self.host.remove(model_id)
        return json_body({"model_id": model_id})

    # -- sampling ------------------------------------------------------------------------------

    def create_sampling_session(self, body: dict[str, Any]) -> str:
        session_id = str(body.get("session_id"))
        if not self.store.has_session(session_id):
            raise UserError(f"Unknown session {session_id!r}.")
        model_path, base = body.get("model_path"), body.get("base_model")
        if model_path is not None:
            path = _paths.parse(str(model_path))
            if self.store.checkpoint(str(path)) is None:
                raise UserError(f"Unknown checkpoint {path}.")
            base = self.settings.name
        else:
            self._check_base_model(base)
        sampler_id = _paths.sampler_id(session_id, int(body.get("sampling_session_seq_id", 0)))
        self.store.add_sampler(sampler_id, session_id, str(base), model_path, None)
        return sampler_id

    def submit_sample(self, body: dict[str, Any]) -> tuple[int, list[str]]:
        sampler_id = body.get("sampling_session_id")
        n = int(body.get("num_samples", 1))
        key = f"{sampler_id}/{body['seq_id']}" if sampler_id is not None and body.get("seq_id") is not None else None
        sequence_ids = [f"{key or sampler_id}:{i}" for i in range(max(n, 0))]

        def work() -> tuple[bytes, str]:
            if not 1 <= n <= self.settings.max_samples:
                raise UserError(f"Expected num_samples in [1, {self.settings.max_samples}], got {n}.")
            for unsupported in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
                if body.get(unsupported):
                    raise UserError(f"{unsupported} is not supported by this service; leave it at 0.")
            if body.get("target_prompt_logprobs") is not None or body.get("prompt_logprobs_last_n") is not None:
                raise UserError("target_prompt_logprobs and prompt_logprobs_last_n are not supported here.")
            prompt = _wire.prompt_tokens(body.get("prompt"), self.vocab_size)
            params = _wire.sampling_params(body.get("sampling_params") or {})
            sampler = self._sampler(body)
            out = sampler.sample(prompt, n, params, include_prompt_logprobs=bool(body.get("prompt_logprobs")))
            return _wire.sample_proto([out]), PROTOBUF
        return self.queue.submit("sample", work, dedupe_key=key), sequence_ids

    def _sampler(self, body: dict[str, Any]):
        sampler_id = body.get("sampling_session_id")
        row = self.store.sampler(str(sampler_id)) if sampler_id is not None else None
        if sampler_id is not None and row is None:
            raise UserError(f"Unknown sampling session {sampler_id!r}.")
        model_path = row["model_path"] if row else body.get("model_path")
        if row and row["model_id"]:
            return self.samplers.for_snapshot(str(sampler_id), self.generation.get)
        if model_path:
            checkpoint = self.store.checkpoint(str(_paths.parse(str(model_path))))
            if checkpoint is None:
                raise UserError(f"Unknown checkpoint {model_path}.")
            return self.samplers.for_checkpoint(Path(checkpoint["path"]))
        self._check_base_model(row["base_model"] if row else body.get("base_model"))
        return self.samplers.base()

    # -- REST listing --------------------------------------------------------------------------

    def training_run(self, row: dict[str, Any]) -> dict[str, Any]:
        checkpoints = self.store.checkpoints(row["model_id"])
        last = {kind: next((c for c in reversed(checkpoints) if c["kind"] == kind), None)
                for kind in _paths.CHECKPOINT_KINDS}
        return {"training_run_id": row["model_id"], "base_model": row["base_model"], "model_owner": "envhub",
                "is_lora": row["is_lora"], "lora_rank": row["lora_rank"] or None, "corrupted": False,
                "last_request_time": _iso(row["last_request_at"]),
                "last_checkpoint": last["weights"] and self.checkpoint_record(last["weights"]),
                "last_sampler_checkpoint": last["sampler_weights"] and self.checkpoint_record(last["sampler_weights"]),
                "user_metadata": {str(k): str(v) for k, v in row["user_metadata"].items()}}

    @staticmethod
    def checkpoint_record(c: dict[str, Any]) -> dict[str, Any]:
        return {"checkpoint_id": f"{c['kind']}/{c['checkpoint_id']}",
                "checkpoint_type": "training" if c["kind"] == "weights" else "sampler",
                "time": _iso(c["created_at"]), "tinker_path": c["tinker_path"], "size_bytes": c["size_bytes"],
                "public": False}

    def weights_info(self, tinker_path: str) -> dict[str, Any]:
        checkpoint = self.store.checkpoint(tinker_path)
        row = checkpoint and self.store.model(checkpoint["model_id"])
        if not row:
            raise NotFound(f"unknown checkpoint {tinker_path!r}")
        return {"base_model": row["base_model"], "is_lora": row["is_lora"], "lora_rank": row["lora_rank"] or None}

    # -- helpers (worker thread) ---------------------------------------------------------------

    def _client(self, model_id: str):
        if model_id in self.host.clients:
            self.store.touch_model(model_id)
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
            if self.host.vllm is not None and rank > self.settings.max_lora_rank:
                raise UserError(f"Expected a LoRA rank <= {self.settings.max_lora_rank} (the vLLM sampler's LoRA slots; "
                                f"start the server with a larger --max-lora-rank), got {rank}.")
            self.host.create_lora_client(model_id, rank=rank, seed=seed, target_modules=targets or "all-linear")
        self.generation[model_id] = 0

    def _lora_rank(self, model_id: str) -> int | None:
        if self.settings.full_parameter:
            return None
        return int(self.host.model.peft_config[self.host.client(model_id).adapter].r)

    def _bump(self, model_id: str) -> None:
        self.generation[model_id] = self.generation.get(model_id, 0) + 1

    def _record_checkpoint(self, path: _paths.TinkerPath, directory: Path) -> None:
        size = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())
        self.store.add_checkpoint(path.training_run_id, path.name, path.kind, str(directory), str(path), size)

    def _check_session(self, session_id: str) -> None:
        if not self.store.has_session(session_id):
            raise UserError(f"Unknown session {session_id!r}.")

    def _check_base_model(self, name: Any) -> None:
        if name != self.settings.name:
            raise UserError(f"This service serves {self.settings.name!r}, not {name!r}; pass "
                            f"base_model={self.settings.name!r} (or start it with --served-name {name}).")

    def _max_context(self) -> int | None:
        value = getattr(self.host.base.config, "max_position_embeddings", None)
        return int(value) if value else None


def _iso(ts: float | None) -> str:
    return datetime.fromtimestamp(ts or 0, tz=timezone.utc).isoformat()
