"""LoRA adapters only go onto the base they were trained on: a sampler server names the fingerprint of the weights
it loaded at ``/health``; a LoRA trainer leaves a server with another base out of rotation (one log line saying
why) and refuses to start when no server has its base; a full-parameter run, whose pushes replace every weight,
takes any server of the same shape."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from tests.trainer.sampler_servers import SHAPE, TINY, ServerProcess, trainer_logprobs, turns
from trainer.model import ModelConfig, base_fingerprint, load_policy
from trainer.sampling import RemoteSampler, SamplerServersDownError

pytestmark = pytest.mark.live

OTHER_BASE = (*TINY, "model.init_seed=7")


def health(server: ServerProcess) -> dict:
    with urllib.request.urlopen(f"{server.url}/health", timeout=5) as resp:
        return dict(json.loads(resp.read()))


def test_fingerprints_tell_bases_apart_whatever_the_wrapping_and_precision() -> None:
    plain, _ = load_policy(ModelConfig(**SHAPE))
    wrapped, _ = load_policy(ModelConfig(**SHAPE, lora_rank=4))
    other, _ = load_policy(ModelConfig(**SHAPE, init_seed=7))
    assert base_fingerprint(plain) == base_fingerprint(wrapped) == base_fingerprint(plain.to(torch.bfloat16))
    assert base_fingerprint(other) != base_fingerprint(plain)
    with torch.no_grad():
        next(p for n, p in wrapped.named_parameters() if "lora_B" in n).add_(1.0)  # training moves the adapter only
    assert base_fingerprint(wrapped) == base_fingerprint(plain)


def test_a_lora_run_keeps_off_a_server_with_another_base(tmp_path) -> None:
    same, other = ServerProcess(tmp_path, *TINY), ServerProcess(tmp_path, *OTHER_BASE)
    try:
        model, _ = load_policy(ModelConfig(**SHAPE, lora_rank=4))
        assert health(same)["base_fingerprint"] == base_fingerprint(model)
        assert health(other)["base_fingerprint"] not in (None, base_fingerprint(model))

        logs: list[str] = []
        sampler = RemoteSampler([same.url, other.url], model, lora=True, log=logs.append)
        assert sampler.servers[same.url].in_rotation and not sampler.servers[other.url].in_rotation
        assert [line for line in logs if other.url in line and "another base model" in line], logs
        prompt = [11, 12, 13, 14]
        for seq in turns(sampler, [prompt] * 6):  # all from the server with the trainer's base
            expected = trainer_logprobs(model, prompt, seq.token_ids)
            assert torch.tensor(seq.logprobs) == pytest.approx(expected, abs=1e-4)
        assert other.metric("requests_total") == 0
        sampler.update_weights(model, 1)  # later pushes and the prober's rejoins leave it out too, logged once
        sampler.pool.rejoin([])
        assert not sampler.servers[other.url].in_rotation
        assert len([line for line in logs if other.url in line and "another base model" in line]) == 1
        sampler.close()

        with pytest.raises(SamplerServersDownError, match="another base model"):
            RemoteSampler([other.url], model, lora=True, log=logs.append)

        full, _ = load_policy(ModelConfig(**SHAPE))  # full weights replace the server's: its base does not matter
        sampler = RemoteSampler([other.url], full)
        seq = turns(sampler, [prompt])[0]
        assert torch.tensor(seq.logprobs) == pytest.approx(trainer_logprobs(full, prompt, seq.token_ids), abs=1e-4)
        sampler.close()
    finally:
        same.stop()
        other.stop()
