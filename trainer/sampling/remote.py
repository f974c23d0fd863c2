"""The trainer's side of sampler servers: a rollout sampler whose turns run on N servers, and the weight pushes.

:class:`RemoteSampler` has what the rollout engine asks of its in-process sampler (``version``,
``await generate(GenRequest) -> SampledSequence``, ``update_weights(model, version)``, ``close()``):

- **routing**: every turn of an episode goes to the server that sampled its first turn (its prompt
  prefix is cached there), a new episode to the server with the fewest turns queued or in flight;
- **batching**: the turns are gathered as the in-process samplers gather theirs (until every live
  episode asked, :meth:`set_demand`) and each server gets them in ONE ``POST /sample/batch`` request,
  which it decodes as one batch; a server answering a batch gets the next one once it answered, the
  others meanwhile go on (:class:`~trainer.sampling.server_batches.ServerBatches`, which the training
  service sends its requests through too); a vision-language policy's turns carry their image patches
  (:mod:`.image_wire`, an HF-backend server);
- **weights**: ``update_weights`` streams the new weights (:mod:`.wire`; a LoRA run sends only its
  adapter) to every server at once, straight from the parameters, no checkpoint on disk, over each
  server's weight channel (:mod:`.remote_push`); each sample reports the version that drew it;
- **faults**: a server that fails a request (connection lost, 5xx, lost its weights) leaves the
  rotation with a log line and its turns are sampled again on the others, so the episodes go on
  (a turn the server refused alone fails alone: a 4xx is the caller's bug, a 503 is retried);
  a server that cannot take an update leaves the rotation; a server that is down, late or back from
  a restart is probed at every update and joins only once it took the current weights; with no
  server left, :class:`SamplerServersDownError` stops the run, naming each server's last error.

The pool mechanics (rotation, fail-over, pushes, catching a joiner up) are :mod:`.pool`'s and the batching
:mod:`.server_batches`', both shared with the training service's sampling on the same servers; this module
turns an episode's turns into requests, keeps an episode on its server, and pushes the trainer's weights.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from trainer.model import base_fingerprint
from trainer.sampling.image_wire import image_entry
from trainer.sampling.pool import (
    EPISODE_SERVER,
    SamplerPool,
    SamplerRequestError,
    SamplerServersDownError,
    ServerSlot,
)
from trainer.sampling.remote_push import payload
from trainer.sampling.server_batches import ServerBatches
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
                                request_timeout_s=request_timeout_s, log=log, weight_group=self.config.weight_group,
                                base_fingerprint=base_fingerprint(model) if lora else None)
        self.last_push_s = 0.0
        self.last_push_bytes = 0
        self._pushed_s, self._pushed_bytes = 0.0, 0  # since the last metrics()
        self.batches = ServerBatches(self.pool, self.config)
        self.pool.wait_for_any(connect_timeout_s)
        self.update_weights(model, 0)

    @property
    def servers(self) -> dict[str, ServerSlot]:
        """The servers by URL, with their rotation state and last error."""
        return self.pool.servers

    def set_demand(self, live_episodes: Callable[[], int]) -> None:
        """Tell the sampler how many episodes are live: a batch waits (up to ``batch_wait_s``) until they all ask."""
        self.batches.set_demand(live_episodes)

    # -- rollouts ---------------------------------------------------------------------------------
    async def generate(self, request: GenRequest) -> SampledSequence:
        """One turn, on the episode's server (or the least loaded one), re-sampled elsewhere if that one fails."""
        if request.max_new_tokens < 1:
            raise ValueError(f"Expected max_new_tokens >= 1, got {request.max_new_tokens}.")
        body = {"prompt_ids": request.prompt_ids, "max_tokens": request.max_new_tokens,
                "temperature": 0.0 if request.greedy else self.config.temperature, "top_p": self.config.top_p,
                **({"adapter": self.adapter_name} if self.lora else {}),
                **({"images": [image_entry(f) for f in request.images]} if request.images else {})}
        data, url = await self.batches.request(body, prefer=EPISODE_SERVER.get())
        EPISODE_SERVER.set(url)  # the episode's next turns go where this one was sampled
        s = data["samples"][0]
        return SampledSequence(s["token_ids"], s["logprobs"], s["finish_reason"], version=data["version"])

    def generate_batch(self, requests: list[GenRequest]) -> list[SampledSequence]:
        """Answer ``requests`` at once (a blocking call: each one is an episode of its own, routed as such)."""
        async def run() -> list[SampledSequence]:
            try:
                return list(await asyncio.gather(*(_fresh_episode(self.generate(r)) for r in requests)))
            finally:
                await self.batches.close_loop()
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
        push = payload(model, version, lora=self.lora, adapter_name=self.adapter_name)
        self.pool.push(push)
        self.version = version
        self.last_push_s = time.monotonic() - start
        self.last_push_bytes = push.nbytes
        self._pushed_s += self.last_push_s
        self._pushed_bytes += self.last_push_bytes

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


__all__ = ["RemoteSampler", "SamplerServersDownError", "SamplerRequestError", "ServerSlot"]
