"""Two-agent training: independent policies and optimizers, phase barriers, and a short run over WebSocket."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import pytest
import torch
from rollout_fakes import ScriptedSampler

from env_servers.gomoku_env import GomokuMatchEnv
from trainer.metrics import read_metrics
from trainer.recipes.matches import MatchRollout, MatchSpec, by_agent
from trainer.recipes.opponents import RandomMoveSampler, empty_cells
from trainer.recipes.phases import PhaseBarrier
from trainer.recipes.players import Player
from trainer.recipes.two_agent import build_pool, evaluate, train_two_agents
from trainer.recipes.two_agent_config import PlayerConfig, TwoAgentConfig, load_two_agent_config
from trainer.sampling import GenRequest
from trainer.tokenizer import build_tiny_tokenizer

TINY = ["name='tiny'", "hidden_size=32", "num_layers=1", "num_heads=2", "num_kv_heads=1", "intermediate_size=64"]


def tiny_config(tmp_path, *extra: str):
    """Player a: full parameters; agent b: a LoRA adapter on its own base. Both REINFORCE++ (batch baseline)."""
    overrides = ["rollout.max_turns=12", "rollout.max_tokens_per_turn=20", "rollout.max_total_tokens=200",
                 "run.batch_size=2", "run.group_size=2", "run.eval_problems=2", f"run.output_dir='{tmp_path}'"]
    for name, seed in (("a", 0), ("b", 1)):
        overrides += [f"agents.{name}.model.{kv}" for kv in TINY]
        overrides += [f"agents.{name}.model.init_seed={seed}", f"agents.{name}.algo.name='reinforce_pp'",
                      f"agents.{name}.optim.lr=1e-2", f"agents.{name}.algo.filter_zero_variance=false"]
    overrides.append("agents.b.model.lora_rank=4")
    return load_two_agent_config(None, overrides + list(extra))


def line_player(prompt: str) -> str:
    """Scripted: X fills row 0, O fills row 1, left to right (X wins on its fifth move)."""
    seat = re.search(r"You play ([XO])", prompt).group(1)
    return f"<move>{0 if seat == 'X' else 1},{prompt.count('<|im_start|>assistant') - 1}</move>"


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def changed(model, before) -> list[str]:
    return [k for k, v in model.named_parameters() if not torch.equal(v, before[k])]


@pytest.fixture
def pair(tmp_path):
    cfg = tiny_config(tmp_path, "env.env_class='env_servers.gomoku_env:GomokuMatchEnv'",
                      "env.env_kwargs={board_size=5, max_invalid_moves=2}")
    agents = {n: Player(n, a, cfg, tmp_path / n) for n, a in cfg.agents.items()}
    yield cfg, agents
    for agent in agents.values():
        agent.close()


async def test_an_update_of_one_agent_leaves_the_other_untouched_and_nothing_is_shared(pair) -> None:
    cfg, agents = pair
    a, b = agents["a"], agents["b"]
    params_a, params_b = list(a.model.parameters()), list(b.model.parameters())
    assert not {p.data_ptr() for p in params_a} & {p.data_ptr() for p in params_b}
    opt_a = {id(p) for g in a.optimizer.param_groups for p in g["params"]}
    opt_b = {id(p) for g in b.optimizer.param_groups for p in g["params"]}
    assert opt_a and opt_b and not opt_a & opt_b
    assert opt_a == {id(p) for p in params_a}  # full parameters
    assert opt_b == {id(p) for p in params_b if p.requires_grad} and len(opt_b) < len(params_b)  # LoRA only

    # Real trajectories from scripted play (in process), with a's seats X in one group and O in the other.
    tok = a.tokenizer
    scripted = {n: (ScriptedSampler(tok, line_player), tok) for n in agents}
    specs = [MatchSpec(f"ind-{g}-{k}", {"X": "a", "O": "b"} if g == 0 else {"X": "b", "O": "a"},
                       {"opening": []}, group_id=g) for g in range(2) for k in range(2)]
    trajs = by_agent(await MatchRollout(build_pool(cfg), scripted, cfg.rollout).run(specs))
    assert sorted(t.reward for t in trajs["a"]) == [-10, -10, 10, 10]

    before_a, before_b = snapshot(a.model), snapshot(b.model)
    metrics = a.update(trajs["a"], step=0)
    assert metrics["train/grad_norm"] > 0 and a.version == 1 and b.version == 0
    assert changed(a.model, before_a), "agent a's update changed nothing"
    assert changed(b.model, before_b) == [] and all(p.grad is None for p in b.model.parameters())
    with pytest.raises(ValueError, match="only agent 'b'"):
        b.update(trajs["a"], step=0)


def test_validation_against_the_other_agent_and_against_a_random_player(pair) -> None:
    cfg, agents = pair
    pool = build_pool(cfg)
    other = evaluate(cfg, agents, pool, "t", "v")
    # Greedy tiny models never make a legal move: X forfeits after two invalid moves, O wins by forfeit.
    for name in agents:
        assert other[name]["eval/episodes"] == 2 and other[name]["eval/win_rate"] == 0.5
        assert other[name]["eval/reward_mean"] == pytest.approx((10 + (-1 - 20)) / 2)
    cfg.match.eval_opponent = "random"
    vs_random = evaluate(cfg, agents, pool, "t", "r")
    assert all(m["eval/episodes"] == 2 and m["eval/infra_failures"] == 0 for m in vs_random.values())


def test_zero_steps_validate_summarise_and_return(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "env.env_class='env_servers.gomoku_env:GomokuMatchEnv'",
                      "env.env_kwargs={board_size=5, max_invalid_moves=2}", "run.steps=0")
    summary = train_two_agents(cfg, log=lambda line: None)
    assert summary["steps"] == 0 and json.loads((tmp_path / "summary.json").read_text()) == summary
    for name in ("a", "b"):
        assert summary["agents"][name]["policy_version"] == 0 and summary["agents"][name]["eval_episodes"] == 2
        assert [r["step"] for r in read_metrics(tmp_path / name / "metrics.jsonl")] == [0, 0]
        assert not (tmp_path / name / "checkpoints").exists()


def test_the_random_player_reads_the_board_and_moves_on_an_empty_cell() -> None:
    tok = build_tiny_tokenizer()
    prompt = "old board:\n   0 1\n 0 . .\n 1 . .\nnow:\n   0 1 2\n 0 X O X\n 1 O X O\n 2 X . O\nYour turn."
    assert empty_cells(prompt) == [(2, 1)]
    result = asyncio.run(RandomMoveSampler(tok).generate(GenRequest(tok.encode(prompt), 32)))
    assert tok.decode(result.token_ids) == "<move>2,1</move><|im_end|>" and result.finish_reason == "stop"


def test_phase_barrier_refuses_phases_out_of_order_and_waits_for_every_agent() -> None:
    barrier = PhaseBarrier(["a", "b"])
    with pytest.raises(RuntimeError, match="Expected phase"):
        barrier.each("update", 0, {"a": lambda: 1, "b": lambda: 2})
    assert barrier.joint("rollout", 0, lambda: "played") == "played"
    with pytest.raises(RuntimeError, match="Expected phase"):
        barrier.joint("rollout", 1, lambda: None)  # nobody updated on step 0 yet
    assert barrier.each("update", 0, {"a": lambda: time.sleep(0.2) or "a", "b": lambda: "b"}) == {"a": "a", "b": "b"}
    waits = barrier.wait_times("update", 0)
    assert waits["b"] > 0.1 and waits["a"] < 0.05  # b waited at the barrier for a
    barrier.joint("rollout", 1, lambda: None)
    updates = [r for r in barrier.records if r.phase == "update"]
    next_rollout = [r for r in barrier.records if r.phase == "rollout" and r.step == 1]
    assert max(r.released for r in updates) <= min(r.start for r in next_rollout)


def test_a_ppo_agent_checkpoint_carries_its_value_head(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "agents.a.algo.name='ppo'")
    agent = Player("a", cfg.agents["a"], cfg, tmp_path / "a")
    with torch.no_grad():
        agent.value_head.proj.weight.normal_()  # as if trained: the head starts at zero
    agent.save(1)
    fresh = Player("a", cfg.agents["a"], cfg, tmp_path / "a")
    assert fresh.load() == 1
    assert torch.equal(fresh.value_head.proj.weight, agent.value_head.proj.weight)
    for a in (agent, fresh):
        a.close()


@pytest.mark.slow
@pytest.mark.live
def test_two_tiny_agents_train_against_each_other_over_websocket(serve_env, tmp_path) -> None:
    server = serve_env(GomokuMatchEnv, board_size=5, max_invalid_moves=2, turn_timeout_s=30.0)
    cfg = tiny_config(tmp_path, f"env.url='{server.url}'", "run.steps=2", "match.eval_opponent='random'")
    agents = {n: Player(n, a, cfg, tmp_path / n) for n, a in cfg.agents.items()}
    initial = {n: snapshot(a.model) for n, a in agents.items()}
    summary = train_two_agents(cfg, agents=agents, log=lambda line: None)

    assert summary["steps"] == 2 and json.loads((tmp_path / "summary.json").read_text()) == summary
    for name, agent in agents.items():
        assert set(summary["agents"][name]) >= {"val_reward_before", "val_reward_after"}
        assert summary["agents"][name]["eval_episodes"] == 2 and agent.version == 2
        assert changed(agent.model, initial[name]), f"agent {name} did not train"
        records = read_metrics(tmp_path / name / "metrics.jsonl")
        evals = [r for r in records if "eval/reward_mean" in r]
        trains = [r for r in records if "train/reward_mean" in r]
        assert [r["step"] for r in evals] == [0, 2] and [r["step"] for r in trains] == [1, 2]
        assert evals[-1]["eval/reward_mean"] == summary["agents"][name]["val_reward_after"]
        assert all(r["match/matches"] == 4 and r["rollout/infra_failures"] == 0 for r in trains)
        assert (tmp_path / name / "checkpoints" / "latest").exists()
        assert all(json.loads(line)["task"]["match_id"] for line in open(tmp_path / name / "trajectories.jsonl"))

    # Resuming continues both agents from their own checkpoints, in step.
    resumed = train_two_agents(tiny_config(tmp_path, f"env.url='{server.url}'", "run.steps=3", "run.resume=true",
                                           "match.eval_opponent='random'"), log=lambda line: None)
    assert resumed["steps"] == 1
    for name in agents:
        assert resumed["agents"][name]["policy_version"] == 3
        assert [r["step"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if "train/loss" in r] == [1, 2, 3]


def test_the_module_entry_point_resolves_the_config_and_refuses_a_missing_env(capsys) -> None:
    from trainer.multiagent.__main__ import main

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "gomoku_two_agent.toml"
    assert main(["--config", str(config), "agents.bob.optim.lr=0.01",
                 "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["agents"]["bob"]["optim"]["lr"] == 0.01 and printed["agents"]["bob"]["model"]["lora_rank"] == 16
    assert main(["agents.carol.optim.lr=0.1"]) == 2 and "exactly two agents" in capsys.readouterr().err
    assert main([]) == 2 and "no match env" in capsys.readouterr().err


def test_a_two_agent_run_whose_matches_all_fail_stops_naming_the_reason(tmp_path) -> None:
    from trainer.rollout.failures import RolloutFailureError

    cfg = tiny_config(tmp_path, "env.env_class='test_recipes:BrokenEnv'", "run.steps=4", "run.max_failed_steps=2",
                      "match.partner_grace_s=0.1", "run.eval_problems=0",  # (a validation would stop it first)
                      "match.eval_opponent='random'")
    messages: list[str] = []
    with pytest.raises(RolloutFailureError, match=r"last 2 steps.*8/8 episodes failed \(8 with env_error\)"):
        train_two_agents(cfg, log=messages.append)
    assert sum("episodes failed" in m for m in messages) == 2
    assert [json.loads(line)["reason"] for line in open(tmp_path / "failures.jsonl")] == ["env_error"] * 2


@pytest.mark.parametrize("extra, message", [
    (["sampling.servers=['http://127.0.0.1:8100']"], "'a' trains full parameters"),
    (["agents.a.sampling.servers=['http://h:1']", "agents.b.sampling.servers=['http://h:1/']"], "'a' trains full"),
    (["agents.a.model.lora_rank=4", "sampling.servers=['http://h:1']"], r"differ in \['init_seed'\]"),
])
def test_a_server_that_would_hold_two_agents_weights_is_refused(tmp_path, extra, message) -> None:
    """One server holds one set of full weights; two LoRA agents share it only on one base (the server's)."""
    with pytest.raises(ValueError, match=message):
        tiny_config(tmp_path, *extra)


def test_each_agent_samples_on_its_own_servers_or_the_runs(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "sampling.servers=['http://h:1']", "agents.a.sampling.servers=['http://h:2']",
                      "sampling.server_token='t'")
    assert [cfg.sampling_for(n).servers for n in "ab"] == [["http://h:2"], ["http://h:1"]]
    assert cfg.sampling_for("a").server_token == "t" and cfg.sampling.servers == ["http://h:1"]


def test_reference_groups_put_each_agent_against_a_scripted_player_in_the_last_openings(tmp_path) -> None:
    from trainer.recipes.two_agent import reference_name, train_matches

    env = ["env.env_class='env_servers.gomoku_env:GomokuMatchEnv'", "env.env_kwargs={board_size=5, max_invalid_moves=2}"]
    cfg = tiny_config(tmp_path, *env, "run.batch_size=3", "match.reference_groups=1")
    specs = train_matches(cfg, ["a", "b"], 0, "r")
    assert len(specs) == (2 + 2) * cfg.run.group_size  # two head-to-head openings, one per agent and reference
    for name in ("a", "b"):
        mine = [s for s in specs if name in s.seats.values()]
        assert sorted({s.group_id for s in mine}) == [0, 1, 2]  # each agent: batch_size groups, group_size each
        assert all(len([s for s in mine if s.group_id == g]) == cfg.run.group_size for g in range(3))
        against = [s for s in mine if s.group_id == 2]
        assert all(set(s.seats.values()) == {name, reference_name(name)} for s in against)
    assert {s.seats["X"] for s in specs if s.group_id == 2} == {"a", reference_name("b")}  # seats alternate
    with pytest.raises(ValueError, match=r"reference_groups \+ match.past_groups < run.batch_size"):
        tiny_config(tmp_path, *env, "match.reference_groups=2")
    with pytest.raises(ValueError, match="reference_groups >= 0"):
        tiny_config(tmp_path, *env, "match.reference_groups=-1")

    cfg = tiny_config(tmp_path, *env, "run.batch_size=3", "match.reference_groups=1", "run.steps=1",
                      "run.log_trajectories=100")
    agents = {n: Player(n, a, cfg, tmp_path / n) for n, a in cfg.agents.items()}
    initial = {n: snapshot(a.model) for n, a in agents.items()}
    train_two_agents(cfg, agents=agents, log=lambda line: None)
    for name, agent in agents.items():
        assert changed(agent.model, initial[name])
        step = next(r for r in read_metrics(tmp_path / name / "metrics.jsonl") if "train/reward_mean" in r)
        assert step["match/matches"] == 2 * cfg.run.group_size  # the head-to-head games alone
        assert step["train_reference/episodes"] == cfg.run.group_size  # its games against the reference player
        assert step["train/episodes"] == 2 * cfg.run.group_size  # train/ outcomes: the head-to-head's
        assert {"train/win_rate", "train_reference/win_rate"} <= set(step)
        assert {"train/stats/win_chances_mean", "train_reference/stats/win_chances_mean"} <= set(step)  # tactics
        trained = [json.loads(line) for line in (tmp_path / name / "trajectories.jsonl").read_text().splitlines()]
        assert len(trained) == 3 * cfg.run.group_size  # both kinds of games are trained on
        # train/reward_mean: every game trained on, as in single-agent training (not the head-to-head's alone)
        assert step["train/reward_mean"] == pytest.approx(sum(t["reward"] for t in trained) / len(trained))


def test_a_windowed_match_prompts_each_seat_with_the_newest_board_and_ppo_is_refused_with_it(tmp_path) -> None:
    env = ["env.env_class='env_servers.gomoku_env:GomokuMatchEnv'",
           "env.env_kwargs={board_size=3, win_length=3, opening_max_stones=0, brief_messages=true, "
           "move_format='cell'}", "rollout.history_turns=0", "rollout.max_turns=5", "run.steps=1",
           "run.log_trajectories=100"]
    cfg = tiny_config(tmp_path, *env)
    agents = {n: Player(n, a, cfg, tmp_path / n) for n, a in cfg.agents.items()}
    train_two_agents(cfg, agents=agents, log=lambda line: None)
    records = [json.loads(line) for n in agents for line in (tmp_path / n / "trajectories.jsonl").read_text().splitlines()]
    turns = [r for r in records if r["num_turns"] > 1]
    assert turns and all(len(r["segment_starts"]) == r["num_turns"] - 1 for r in turns)
    assert all(r["text"].count("<|im_start|>user") == r["num_turns"] for r in turns)  # one board a prompt
    with pytest.raises(ValueError, match="agents.a.algo.name other than 'ppo'"):
        tiny_config(tmp_path, *env, "agents.a.algo.name='ppo'")


def test_past_groups_put_each_agent_against_a_frozen_snapshot_of_the_other(tmp_path) -> None:
    from trainer.recipes.past_opponents import PastOpponents, past_name
    from trainer.recipes.two_agent import reference_name, train_matches

    env = ["env.env_class='env_servers.gomoku_env:GomokuMatchEnv'", "env.env_kwargs={board_size=5, max_invalid_moves=2}"]
    cfg = tiny_config(tmp_path, *env, "run.batch_size=4", "match.past_groups=2", "match.reference_groups=1",
                      "match.past_keep=2")
    agents = {n: Player(n, a, cfg, tmp_path / n) for n, a in cfg.agents.items()}
    past = PastOpponents({n: (a.model, a.tokenizer) for n, a in agents.items()}, keep=2, seed=0)
    specs = train_matches(cfg, ["a", "b"], 0, "r", past)
    for name, other in (("a", "b"), ("b", "a")):
        mine = [s for s in specs if name in s.seats.values()]
        assert sorted({s.group_id for s in mine}) == [0, 1, 2, 3]
        snapshots = {p for s in mine if s.group_id in (1, 2) for p in s.seats.values()} - {name}
        assert snapshots and snapshots <= {past_name(other, 0), past_name(other, 1)}
        assert all(set(s.seats.values()) == {name, reference_name(name)} for s in mine if s.group_id == 3)
    with pytest.raises(ValueError, match="pool of past opponents"):
        train_matches(cfg, ["a", "b"], 0, "r")
    with pytest.raises(ValueError, match="past_every >= 1"):
        tiny_config(tmp_path, *env, "match.past_every=0")
    with pytest.raises(ValueError, match="without '@'"):
        TwoAgentConfig(agents={"a@past0": PlayerConfig(), "b": PlayerConfig()})
    # snapshots are copies: an update moves the agent, not its snapshots, until the next one is taken
    model = agents["a"].model
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    slots = past.samplers["a"]
    assert not torch.equal(next(slots[0].model.parameters()), next(model.parameters()))
    past.take({n: a.model for n, a in agents.items()}, version=5)
    assert past.versions["a"] == [0, 5]  # the oldest slot after the policy before training
    assert torch.equal(next(slots[1].model.parameters()), next(model.parameters()))
    assert not torch.equal(next(slots[0].model.parameters()), next(model.parameters()))
    past.close()

    cfg = tiny_config(tmp_path, *env, "run.batch_size=3", "match.past_groups=1", "run.steps=2", "match.past_every=1")
    agents = {n: Player(n, a, cfg, tmp_path / n) for n, a in cfg.agents.items()}
    train_two_agents(cfg, agents=agents, log=lambda line: None)
    for name in agents:
        step = next(r for r in read_metrics(tmp_path / name / "metrics.jsonl") if "train/reward_mean" in r)
        assert step["train_past/episodes"] == cfg.run.group_size  # its games against the other's snapshot
        assert step["train/episodes"] == 2 * cfg.run.group_size and step["match/matches"] == 2 * cfg.run.group_size
