"""Two-agent training on real sampler server processes: each agent samples its own pushed weights (on servers
of its own, or as its own adapter on servers two LoRA agents share), rewards go to the agent whose seat
earned them as in process."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from tests.trainer.sampler_servers import TINY, ServerProcess, trainer_logprobs
from tests.trainer.test_two_agent_train import tiny_config
from trainer.metrics import read_metrics
from trainer.recipes.players import Player
from trainer.recipes.two_agent import build_pool, evaluate, train_two_agents
from trainer.sampling import GenRequest, RemoteSampler

pytestmark = pytest.mark.live
MATCH_ENV = ["env.env_class='env_servers.gomoku_env:GomokuMatchEnv'", "env.env_kwargs={board_size=5, max_invalid_moves=2}",
             *(f"agents.{n}.model.max_position_embeddings=4096" for n in "ab")]
#: a server refuses prompts past its model's context (in process the tiny model reads on past it): the game's rules
#: and board take ~2,100 byte-level tokens
SERVER = [*TINY, "model.max_position_embeddings=4096"]
PROMPT = [11, 12, 13, 14]


def check_own_weights(agents: dict[str, Player]) -> None:
    """Each agent's server samples carry its version and its own model's log-probs (and not the other's)."""
    (first, a), (second, b) = agents.items()
    for agent, other in ((a, b), (b, a)):
        assert isinstance(agent.sampler, RemoteSampler)
        for gen in agent.sampler.generate_batch([GenRequest(PROMPT, 8)] * 3):
            assert gen.version == agent.version
            own = trainer_logprobs(agent.model, PROMPT, gen.token_ids)
            assert (own - torch.tensor(gen.logprobs)).abs().max() < 1e-4
            theirs = trainer_logprobs(other.model, PROMPT, gen.token_ids)
            assert (theirs - torch.tensor(gen.logprobs)).abs().max() > 1e-3  # the other agent's weights differ


def adapters(server: ServerProcess) -> dict[str, int]:
    with urllib.request.urlopen(f"{server.url}/adapters", timeout=5) as resp:
        found: dict[str, int] = json.loads(resp.read())["adapters"]
        return found


def test_each_agent_samples_its_own_weights_on_servers_of_its_own(tmp_path) -> None:
    """a trains full parameters on server A, b a LoRA adapter on server B (started with b's base: init_seed 1)."""
    server_a, server_b = ServerProcess(tmp_path, *SERVER), ServerProcess(tmp_path, *SERVER, "model.init_seed=1")
    try:
        cfg = tiny_config(tmp_path / "run", *MATCH_ENV, "run.steps=2",
                          f"agents.a.sampling.servers=['{server_a.url}']", f"agents.b.sampling.servers=['{server_b.url}']")
        in_process = tiny_config(tmp_path / "local", *MATCH_ENV)
        local = {n: Player(n, a, in_process, tmp_path / "local" / n) for n, a in in_process.agents.items()}
        expected = evaluate(in_process, local, build_pool(in_process), "t", "v")  # greedy: the same games on servers
        for agent in local.values():
            agent.close()
        checked = []

        def on_step(step: int, metrics: dict[str, dict[str, float]]) -> None:
            check_own_weights(agents)
            checked.append(step)

        agents = {n: Player(n, a, cfg, tmp_path / "run" / n) for n, a in cfg.agents.items()}
        summary = train_two_agents(cfg, agents=agents, on_step=on_step, log=lambda line: None)
        assert checked == [1, 2] and {n: s["policy_version"] for n, s in summary["agents"].items()} == {"a": 2, "b": 2}
        assert server_a.metric("policy_version") == 2 and server_a.metric("requests_total") > 0
        assert server_b.metric("policy_version") == 0 and adapters(server_b) == {"b": 2}  # b's base is untouched
        steps = {n: [r for r in read_metrics(tmp_path / "run" / n / "metrics.jsonl") if "train/reward_mean" in r]
                 for n in cfg.agents}
        for name, records in steps.items():
            before = read_metrics(tmp_path / "run" / name / "metrics.jsonl")[0]
            assert before["step"] == 0 and before["eval/reward_mean"] == expected[name]["eval/reward_mean"]
            assert before["eval/win_rate"] == expected[name]["eval/win_rate"]
            # every match gives each agent one seat: 2 openings x 2 matches, each agent's own episodes
            assert [r["train/episodes"] for r in records] == [4.0, 4.0]
            assert all(r["sampler/servers_in_rotation"] == 1 and r["sampler/push_mb"] > 0 for r in records)
        # b pushes its adapter alone, a all its weights
        assert steps["b"][0]["sampler/push_mb"] < steps["a"][0]["sampler/push_mb"] / 2
        for a_step, b_step in zip(steps["a"], steps["b"]):  # zero-sum: each match's winner and loser, one seat each
            assert a_step["train/win_rate"] == b_step["train/loss_rate"]
            assert a_step["train/loss_rate"] == b_step["train/win_rate"]
    finally:
        server_a.stop()
        server_b.stop()


def test_two_lora_agents_share_servers_each_as_its_own_adapter(tmp_path) -> None:
    server = ServerProcess(tmp_path, *SERVER, "model.init_seed=1")
    try:
        cfg = tiny_config(tmp_path, *MATCH_ENV, "run.steps=1", "agents.a.model.init_seed=1",
                          "agents.a.model.lora_rank=4", f"sampling.servers=['{server.url}']")
        checked = []

        def on_step(step: int, metrics: dict[str, dict[str, float]]) -> None:
            check_own_weights(agents)
            checked.append(step)

        agents = {n: Player(n, a, cfg, tmp_path / n) for n, a in cfg.agents.items()}
        train_two_agents(cfg, agents=agents, on_step=on_step, log=lambda line: None)
        assert checked == [1] and adapters(server) == {"a": 1, "b": 1}
    finally:
        server.stop()
