"""Real sampler server processes for the live tests (started on a free loopback port, stopped or killed by the
test), and the checks those tests share: the trainer's own log-probs, turns on a remote sampler, real optimizer
steps pushed to the servers, and what a push carried."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer import local_server, while_parent
from trainer.core import AdamParams, Datum, TrainingClient
from trainer.core.forward import run_model, target_logprobs
from trainer.local_server import free_port
from trainer.sampling import GenRequest, RemoteSampler, SampledSequence

#: the tiny shape the trainer tests use (tests/trainer/test_recipes.py), as server arguments and as ModelConfig fields
TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64"]
SHAPE = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64}


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """The trainer's log-probs of ``ids`` after ``prompt`` at temperature 1 (the model's mode is left as it was)."""
    tokens = torch.tensor([prompt + ids], device=next(model.parameters()).device)
    was_training = model.training
    with torch.no_grad():
        logits, _ = run_model(model.eval(), tokens, torch.ones_like(tokens))
    model.train(was_training)
    return target_logprobs(logits[:, :-1], tokens[:, 1:], 1.0)[0, len(prompt) - 1:].cpu()


def turns(sampler: RemoteSampler, prompts: list[list[int]], max_new_tokens: int = 8) -> list[SampledSequence]:
    """One turn per prompt, all awaited together (so they go out as one batch)."""
    async def run() -> list[SampledSequence]:
        return list(await asyncio.gather(*(sampler.generate(GenRequest(p, max_new_tokens)) for p in prompts)))
    return asyncio.run(run())


def step(client: TrainingClient, prompt: list[int]) -> None:
    """One real optimizer step (cross-entropy on a short sequence, a large learning rate)."""
    client.forward_backward([Datum.from_sequence(prompt + [7, 8, 9], weights=[0] * len(prompt) + [1, 1, 1])])
    client.optim_step(AdamParams(learning_rate=5e-2))


def push_real_steps(client: TrainingClient, sampler: RemoteSampler, prompt: list[int], *, tolerance: float,
                    after_push: Callable[[], Any] | None = None) -> None:
    """Two real steps, each pushed as the next version: every turn sampled after a push reports that version and
    the trainer's log-probs within ``tolerance``, and the steps changed what the server samples."""
    seen = []
    for version in (1, 2):
        step(client, prompt)
        client.save_weights_for_sampler(sampler, version)
        if after_push is not None:
            after_push()
        for gen in turns(sampler, [prompt] * 4):
            assert gen.version == version
            gap = (trainer_logprobs(client.model, prompt, gen.token_ids) - torch.tensor(gen.logprobs)).abs().max()
            assert gap < tolerance
            seen.append(gen.logprobs[0])
    assert len(set(seen)) > 1  # the steps changed the policy the server samples from


def assert_pool_samples_at(pool: Any, urls: Any, model: torch.nn.Module, prompt: list[int], *, version: int,
                           tolerance: float) -> None:
    """Each server in ``urls`` answers a request sent to it, from weights of ``version`` equal to ``model``'s."""
    for url in urls:
        server, data = asyncio.run(pool.request({"prompt_ids": prompt, "max_tokens": 4}, prefer=url))
        sample = data["samples"][0]
        assert server.url == url and data["version"] == version
        gap = trainer_logprobs(model, prompt, sample["token_ids"]) - torch.tensor(sample["logprobs"])
        assert gap.abs().max() < tolerance


def trainable_bytes(model: torch.nn.Module) -> int:
    """What a push of ``model`` must carry in fp32: its trainable tensors (a LoRA run's adapter alone)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad) * 4


class ServerProcess:
    """``python -m trainer.sampler_server`` on ``port`` (a free one by default), healthy once constructed."""

    def __init__(self, log_dir: Path, *args: str, port: int | None = None, timeout_s: float = 120.0):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"sampler-{self.port}-{time.monotonic_ns()}.log"
        argv = while_parent.argv("trainer.sampler_server", "--host", "127.0.0.1", "--port", str(self.port),
                                 *(args or TINY))  # ends with the test session, however it ends
        self.proc = local_server.start(argv, self.url, self.log_path, timeout_s=timeout_s, what="the sampler server")

    def metric(self, name: str, token: str | None = None) -> float:
        request = urllib.request.Request(f"{self.url}/metrics",
                                         headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(request, timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(f"envhub_sampler_{name} "):
                    return float(line.split()[1])
        raise KeyError(name)

    def kill(self) -> None:
        """SIGKILL: the server dies mid-request, as a crashed one would."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        local_server.stop(self.proc)
