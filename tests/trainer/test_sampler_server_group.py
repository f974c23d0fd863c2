"""Weight pushes through a torch.distributed group (gloo; NCCL on GPUs) to real sampler server processes: full and
LoRA pushes over real optimizer steps give the trainer's log-probs; a server that cannot join, or that lost the
group, gets the weights over its weight channel instead; NCCL asked for without CUDA is refused with the reason."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.trainer.sampler_servers import (
    SHAPE,
    TINY,
    ServerProcess,
    assert_pool_samples_at,
    push_real_steps,
    trainable_bytes,
)
from trainer.core import TrainingClient
from trainer.model import ModelConfig, load_policy
from trainer.sampler_server.app import create_app
from trainer.sampler_server.backends import HFBackend
from trainer.sampling import RemoteSampler, SamplerPool, SamplingConfig
from trainer.sampling.remote_push import payload

pytestmark = pytest.mark.live


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_pushes_through_the_group_give_the_trainers_logprobs(tmp_path, lora_rank) -> None:
    server = ServerProcess(tmp_path, *TINY)
    logs: list[str] = []
    try:
        client = TrainingClient.from_config(ModelConfig(**SHAPE, lora_rank=lora_rank))
        sampler = RemoteSampler([server.url], client.model, SamplingConfig(weight_group="gloo"),
                                lora=lora_rank > 0, log=logs.append)

        def went_through_the_group() -> None:
            slot = sampler.pool.servers[server.url]
            assert slot.group is not None and not slot.group_failed, logs

        push_real_steps(client, sampler, [11, 12, 13, 14], tolerance=1e-5, after_push=went_through_the_group)
        assert server.metric("weight_updates_total") == 3  # the starting weights, then two steps
        pushed = sampler.last_push_bytes
        sampler.close()
    finally:
        server.stop()
    assert pushed == trainable_bytes(client.model)  # LoRA: the adapter alone travels
    assert not [m for m in logs if "weight group failed" in m]


def test_a_server_that_cannot_join_or_lost_the_group_gets_the_weights_over_the_channel(tmp_path) -> None:
    refusing, joining = ServerProcess(tmp_path, *TINY, "--no-weight-group"), ServerProcess(tmp_path, *TINY)
    logs: list[str] = []
    pool = SamplerPool([refusing.url, joining.url], log=logs.append, weight_group="gloo", group_timeout_s=10.0)
    restarted = None
    try:
        model, _ = load_policy(ModelConfig(**SHAPE))
        prompt = [4, 5, 6]
        for version in (1, 2, 3):
            if version == 3:  # the server restarts on its port: its side of the group is gone
                port = joining.port
                joining.stop()
                restarted = joining = ServerProcess(tmp_path, *TINY, port=port)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05)
            pool.push(payload(model, version, lora=False, adapter_name="policy"))
            assert pool.servers[refusing.url].group_failed and pool.servers[refusing.url].group is None
            grouped = pool.servers[joining.url]
            assert (grouped.group_failed, grouped.group is None) == ((True, True) if version == 3 else (False, False))
            assert_pool_samples_at(pool, (refusing.url, joining.url), model, prompt, version=version, tolerance=1e-5)
        failures = [m for m in logs if "weight group failed" in m]
        assert len(failures) == 2 and "--no-weight-group" in failures[0] and "no weight group" in failures[1]
    finally:
        pool.close()
        for server in {refusing, joining, restarted} - {None}:
            server.stop()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
async def test_nccl_without_cuda_is_refused_with_the_reason_on_both_sides() -> None:
    for build in (lambda: SamplerPool(["http://127.0.0.1:1"], weight_group="nccl"),
                  lambda: RemoteSampler(["http://127.0.0.1:1"], None, SamplingConfig(weight_group="nccl"))):
        with pytest.raises(ValueError, match="CUDA device and NCCL for weight_group='nccl', got no CUDA device"):
            build()  # before any server is contacted
    # a CPU server offers gloo alone and refuses an NCCL join, saying why (a trainer then falls back)
    app = create_app(HFBackend(ModelConfig(**SHAPE)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sampler") as http:
        assert (await http.get("/health")).json()["weight_group"] == ["gloo"]
        resp = await http.post("/weight-group", json={"host": "127.0.0.1", "port": 1, "group": "0" * 32,
                                                      "backend": "nccl"})
    assert resp.status_code == 400 and "runs on cpu" in resp.json()["error"]["message"]


@pytest.mark.gpu
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_nccl_pushes_from_a_gpu_give_a_gpu_servers_logprobs_or_fall_back(tmp_path, lora_rank) -> None:
    """On two GPUs the tensors go GPU to GPU through NCCL; on one (trainer and server on the same GPU, which NCCL
    does not pair) the pool says so and pushes over the channel: the server's log-probs are the trainer's either way."""
    two = torch.cuda.device_count() > 1
    server = ServerProcess(tmp_path, *TINY, "model.dtype=fp32", "--device", "cuda:1" if two else "cuda:0")
    logs: list[str] = []
    try:
        client = TrainingClient.from_config(ModelConfig(**SHAPE, lora_rank=lora_rank, dtype="fp32"), device="cuda:0")
        sampler = RemoteSampler([server.url], client.model, SamplingConfig(weight_group="nccl"),
                                lora=lora_rank > 0, log=logs.append)
        slot = sampler.pool.servers[server.url]
        assert slot.group_kinds == ["gloo", "nccl"]
        if two:
            def went_through_nccl() -> None:
                assert slot.group is not None and slot.group.backend == "nccl" and not slot.group_failed, logs

            push_real_steps(client, sampler, [11, 12, 13, 14], tolerance=1e-4, after_push=went_through_nccl)
        else:
            push_real_steps(client, sampler, [11, 12, 13, 14], tolerance=1e-4)
            assert slot.group is not None or [m for m in logs if "weight group failed" in m], logs
        pushed = sampler.last_push_bytes
        sampler.close()
    finally:
        server.stop()
    assert pushed == trainable_bytes(client.model)
