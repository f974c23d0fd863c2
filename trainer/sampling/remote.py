"""The trainer's side of sampler servers: a rollout sampler whose turns run on N servers, and the weight pushes.

:class:`RemoteSampler` has what the rollout engine asks of its in-process sampler (``version``,
``await generate(GenRequest) -> SampledSequence``, ``update_weights(model, version)``, ``close()``):

- **routing**: every turn of an episode goes to the server that sampled its first turn (its prompt
  prefix is cached there), a new episode to the server with the fewest requests in flight;
- **weights**: ``update_weights`` streams the new weights (:mod:`.wire`; a LoRA run sends only its
  adapter) to every server at once, straight from the parameters, no checkpoint on disk; each sample
  reports the version that drew it;
- **faults**: a server that fails a request (connection lost, 5xx, lost its weights) leaves the
  rotation with a log line and the turn is sampled again on another server, so the episode goes on;
  a server that cannot take an update leaves the rotation; a server that is down, late or back from
  a restart is probed at every update and joins only once it took the current weights; with no
  server left, :class:`SamplerServersDownError` stops the run, naming each server's last error.

The pool mechanics (rotation, fail-over, pushes, catching a joiner up) are :mod:`.pool`'s, shared with the
training service's sampling on the same servers.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from typing import Any

from trainer.sampling.hf import generation_model
from trainer.sampling.pool import (
    EPISODE_SERVER,
    Push,
    SamplerPool,
    SamplerRequestError,
    SamplerServersDownError,
    ServerSlot,
)
from trainer.sampling.types import GenRequest, SampledSequence, SamplingConfig


class RemoteSampler:
    """A rollout sampler backed by sampler servers at ``urls`` (see the module docstring).

    ``model`` is pushed to every server at start (version 0), so the servers sample the trainer's
    weights from the first turn; ``lora`` pushes only its adapter, as ``adapter_name``.

    >>> sampler = RemoteSampler(["http://127.0.0.1:8100"], model, SamplingConfig())   # doctest: +SKIP
    >>> engine = RolloutEngine(pool, sampler, tokenizer)                              # doctest: +SKIP
    """

    def __init__(self, urls: list[str], model: Any, config: SamplingConfig | None = None, *,
                 token: str | None = None, lora: bool = False, adapter_name: str = "policy",
                 request_timeout_s: float = 600.0, connect_timeout_s: float = 60.0,
                 log: Callable[[str], None] = print):
        self.config = config or SamplingConfig()
        self.version = 0
        self.lora, self.adapter_name, self.log = lora, adapter_name, log
        self.pool = SamplerPool(urls, token=token or os.environ.get("ENVHUB_SAMPLER_TOKEN") or None,
                                request_timeout_s=request_timeout_s, log=log)
        self.last_push_s = 0.0
        self.last_push_bytes = 0
        self._pushed_s, self._pushed_bytes = 0.0, 0  # since the last metrics()
        self.pool.wait_for_any(connect_timeout_s)
        self.update_weights(model, 0)

    @property
    def servers(self) -> dict[str, ServerSlot]:
        """The servers by URL, with their rotation state and last error."""
        return self.pool.servers

    # -- rollouts ---------------------------------------------------------------------------------
    async def generate(self, request: GenRequest) -> SampledSequence:
        """One turn, on the episode's server (or the least loaded one), re-sampled elsewhere if that one fails."""
        if request.images:
            raise ValueError("Expected text-only requests: sampler servers do not take images yet.")
        body = {"prompt_ids": request.prompt_ids, "max_tokens": request.max_new_tokens,
                "temperature": 0.0 if request.greedy else self.config.temperature, "top_p": self.config.top_p,
                **({"adapter": self.adapter_name} if self.lora else {})}
        server, data = await self.pool.request(body, prefer=EPISODE_SERVER.get())
        EPISODE_SERVER.set(server.url)
        sample = data["samples"][0]
        return SampledSequence(sample["token_ids"], sample["logprobs"], sample["finish_reason"], version=data["version"])

    def generate_batch(self, requests: list[GenRequest]) -> list[SampledSequence]:
        """Answer ``requests`` at once (a blocking call: each one is an episode of its own, routed as such)."""
        async def run() -> list[SampledSequence]:
            try:
                return list(await asyncio.gather(*(_fresh_episode(self.generate(r)) for r in requests)))
            finally:
                await self.pool.close_loop_client()
        return asyncio.run(run())

    # -- weights ----------------------------------------------------------------------------------
    def add_server(self, url: str) -> None:
        """Take ``url`` into the pool: it joins the rotation once it took the next weight update."""
        self.pool.add_server(url)

    def update_weights(self, model: Any, version: int) -> None:
        """Push ``model``'s weights (its adapter, for LoRA) to every server that answers, as ``version``.

        Servers out of rotation are probed first and join when the push succeeds; a server whose push
        fails leaves the rotation. With none left, ``SamplerServersDownError``.
        """
        start = time.monotonic()
        push = self._payload(model, version)
        self.pool.push(push)
        self.version = version
        self.last_push_s = time.monotonic() - start
        self.last_push_bytes = push.nbytes
        self._pushed_s += self.last_push_s
        self._pushed_bytes += self.last_push_bytes

    def _payload(self, model: Any, version: int) -> Push:
        peft_model = _peft_model(model)
        if self.lora:
            if peft_model is None:
                raise ValueError("Expected a peft model for a LoRA run's weight push, got a plain one.")
            from peft import get_peft_model_state_dict

            cfg = peft_model.peft_config[peft_model.active_adapter]
            lora = {"r": int(cfg.r), "lora_alpha": cfg.lora_alpha, "use_rslora": bool(cfg.use_rslora),
                    "target_modules": sorted(cfg.target_modules) if not isinstance(cfg.target_modules, str)
                    else cfg.target_modules}
            tensors = dict(get_peft_model_state_dict(peft_model))
            meta = {"version": str(version), "kind": "lora", "lora_config": json.dumps(lora)}
            return Push(f"/adapters/{self.adapter_name}", tensors, meta)
        base = generation_model(model)
        tensors = {n: p.detach() for n, p in base.named_parameters()}
        return Push("/weights", tensors, {"version": str(version), "kind": "full"})

    def metrics(self) -> dict[str, float]:
        """For a step's metrics: seconds and megabytes of weight pushes since the last call, servers in rotation."""
        out = {"time/weight_push_s": self._pushed_s, "sampler/push_mb": self._pushed_bytes / 1e6,
               "sampler/servers_in_rotation": float(sum(s.in_rotation for s in self.servers.values()))}
        self._pushed_s, self._pushed_bytes = 0.0, 0
        return out

    def close(self) -> None:
        """Close the HTTP connections."""
        self.pool.close()


async def _fresh_episode(turn: Any) -> SampledSequence:
    """``turn`` awaited as a new episode (no server chosen yet)."""
    EPISODE_SERVER.set(None)
    result: SampledSequence = await turn
    return result


def _peft_model(model: Any) -> Any:
    inner = generation_model(model)
    return inner if hasattr(inner, "peft_config") else None


__all__ = ["RemoteSampler", "SamplerServersDownError", "SamplerRequestError", "ServerSlot"]
