"""Sampler servers as real processes: log-probs that match the trainer after full and LoRA pushes over real
optimizer steps, pushes over the weight channel and as HTTP bodies, a server killed mid-run, a late joiner,
every server gone, and GRPO learning through two."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from tests.trainer.sampler_servers import (
    SHAPE,
    TINY,
    ServerProcess,
    assert_pool_samples_at,
    push_real_steps,
    trainable_bytes,
    trainer_logprobs,
    turns,
)
from tests.trainer.test_recipes import config as recipe_config
from trainer.core import TrainingClient
from trainer.local_server import free_port
from trainer.model import ModelConfig, load_policy
from trainer.recipes.rl import train
from trainer.sampling import GenRequest, RemoteSampler, SamplerPool, SamplerServersDownError
from trainer.sampling.remote_push import payload

pytestmark = pytest.mark.live


# the LoRA on the output layer too: the tiny model ties it to its input embedding, and a push still
# carries the adapter alone, not that frozen base layer
@pytest.mark.parametrize("lora_rank, targets", [(0, None), (4, None), (4, ["q_proj", "v_proj", "lm_head"])],
                         ids=["full", "lora", "lora-lm_head"])
def test_pushes_after_real_steps_keep_server_logprobs_equal_to_the_trainers(tmp_path, lora_rank, targets) -> None:
    server = ServerProcess(tmp_path, *TINY)
    try:
        lora_targets = {"lora_target_modules": targets} if targets else {}
        client = TrainingClient.from_config(ModelConfig(**SHAPE, lora_rank=lora_rank, **lora_targets))
        sampler = RemoteSampler([server.url], client.model, lora=lora_rank > 0)
        prompt = [11, 12, 13, 14]
        push_real_steps(client, sampler, prompt, tolerance=1e-4)  # fp32 on both sides

        # turns asked one after another go to the server in ONE request once every live episode asked
        sampler.config.batch_wait_s = 10.0
        sampler.set_demand(lambda: 4)

        async def staggered() -> list:
            async def episode(i: int) -> object:
                await asyncio.sleep(0.05 * i)
                return await sampler.generate(GenRequest(prompt, 4))
            return list(await asyncio.gather(*(episode(i) for i in range(4))))

        before = server.metric("batches_total")
        assert len(asyncio.run(staggered())) == 4
        assert server.metric("batches_total") - before == 1
        pushed = sampler.last_push_bytes
        sampler.close()
    finally:
        server.stop()
    assert pushed == trainable_bytes(client.model)  # LoRA: the adapter alone travels


def test_the_pools_pushes_go_over_the_weight_channel_and_fall_back_to_http_bodies(tmp_path) -> None:
    """The pool the trainer and the training service share pushes over the channel /health names; a channel it
    cannot reach, or a server without one, gets the same weights as an HTTP body."""
    with_channel, without = ServerProcess(tmp_path, *TINY), ServerProcess(tmp_path, *TINY, "--weight-port", "-1")
    pool = SamplerPool([with_channel.url, without.url], log=lambda m: None)
    try:
        model, _ = load_policy(ModelConfig(**SHAPE))
        prompt = [4, 5, 6]
        for version, unreachable in ((1, False), (2, True)):
            if unreachable:  # the announced port stops answering: the push goes as an HTTP body, and stays so
                pool.servers[with_channel.url].weight_port = free_port()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05)
            pool.push(payload(model, version, lora=False, adapter_name="policy"))
            channel = pool.servers[with_channel.url].weight_port
            assert (channel is None) if unreachable else (channel is not None)  # a channel push answered
            assert pool.servers[without.url].weight_port is None
            assert_pool_samples_at(pool, (with_channel.url, without.url), model, prompt, version=version, tolerance=1e-4)
    finally:
        pool.close()
        for server in (with_channel, without):
            server.stop()


def test_a_killed_server_has_its_turns_resampled_a_late_joiner_gets_weights_first(tmp_path) -> None:
    a, b = ServerProcess(tmp_path, *TINY), ServerProcess(tmp_path, *TINY)
    late = wrong = None
    try:
        model, _ = load_policy(ModelConfig(**SHAPE))
        messages: list[str] = []
        sampler = RemoteSampler([a.url, b.url], model, log=messages.append)
        assert turns(sampler, [[1, 2, 3]] * 4)  # both servers in rotation

        async def episode() -> None:  # three turns, each on the episode's server
            for _ in range(3):
                await sampler.generate(GenRequest([1, 2, 3], 2))

        async def episodes(n: int) -> None:
            await asyncio.gather(*(episode() for _ in range(n)))

        for n, expected in ((1, [0, 3]), (2, [3, 3])):  # a second episode goes to the less loaded server
            before = [a.metric("requests_total"), b.metric("requests_total")]
            asyncio.run(episodes(n))
            assert sorted([a.metric("requests_total") - before[0], b.metric("requests_total") - before[1]]) == expected

        async def kill_mid_run() -> list:
            pending = [asyncio.ensure_future(sampler.generate(GenRequest([1, 2, 3 + i], 300))) for i in range(8)]
            start = a.metric("requests_total")
            while a.metric("requests_total") < start + 1:  # a holds turns of this batch
                await asyncio.sleep(0.01)
            a.kill()
            return list(await asyncio.gather(*pending))

        results = asyncio.run(kill_mid_run())
        assert all(r.token_ids and len(r.token_ids) == len(r.logprobs) for r in results)  # none lost, none empty
        assert not sampler.servers[a.url].in_rotation and sampler.servers[b.url].in_rotation
        assert any(a.url in m and "out of rotation" in m for m in messages)

        # a joiner (a fresh server, random weights) takes work only after it took the current weights;
        # one started with other model settings refuses them and stays out, named in the log
        late, wrong = ServerProcess(tmp_path, *TINY), ServerProcess(tmp_path, "model.hidden_size=64")
        sampler.add_server(late.url)
        sampler.add_server(wrong.url)
        assert not sampler.servers[late.url].in_rotation
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1)
        sampler.update_weights(model, 5)
        assert sampler.servers[late.url].in_rotation and sampler.servers[late.url].version == 5
        assert any(late.url in m and "joined" in m for m in messages)
        assert not sampler.servers[wrong.url].in_rotation
        assert "model settings" in sampler.servers[wrong.url].last_error
        before = late.metric("requests_total")
        prompt = [4, 5, 6]
        for gen in turns(sampler, [prompt] * 8):
            assert gen.version == 5
            assert (trainer_logprobs(model, prompt, gen.token_ids) - torch.tensor(gen.logprobs)).abs().max() < 1e-4
        assert late.metric("requests_total") > before and wrong.metric("requests_total") == 0

        for server in (b, late, wrong):
            server.kill()
        with pytest.raises(SamplerServersDownError, match="No sampler server can take work") as err:
            turns(sampler, [prompt])
        assert a.url in str(err.value) and b.url in str(err.value)
        with pytest.raises(SamplerServersDownError):
            sampler.update_weights(model, 6)
        sampler.close()
    finally:
        for server in (a, b, late, wrong):
            if server is not None:
                server.stop()


@pytest.mark.slow
def test_grpo_learns_through_two_sampler_servers_with_asynchronous_rollouts(tmp_path) -> None:
    servers = [ServerProcess(tmp_path, *TINY) for _ in range(2)]
    try:
        torch.manual_seed(0)
        urls = json.dumps([s.url for s in servers])
        # asynchronous rollouts: the next batch is sampled on the servers while a step trains
        cfg = recipe_config(tmp_path, "run.steps=16", "run.batch_size=8", "optim.lr=1e-2", f"sampling.servers={urls}",
                            "rollout.max_staleness=1")
        summary = train(cfg, log=lambda s: None)
        records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        rewards = [r["train/reward_mean"] for r in records if "train/reward_mean" in r]
        # the shaped reward rises ~0.01 a step; asynchronous sampling on two servers makes a step's mean noisier
        # (±0.03) than in process, so the test compares 4-step means 12 steps apart
        assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.06, rewards
        assert summary["val_reward_after"] >= 0.5
        steps = [r for r in records if "train/reward_mean" in r]
        assert all(r["sampler/servers_in_rotation"] == 2 for r in steps)
        assert all(r["rollout/staleness_max"] <= 1 for r in steps) and any(r["rollout/staleness_max"] == 1 for r in steps)
        assert all(s.metric("requests_total") > 50 and s.metric("policy_version") == 16 for s in servers)
    finally:
        for s in servers:
            s.stop()
