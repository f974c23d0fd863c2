"""Outcome metrics of episodes (win/loss/draw rates, tool calls, named reward components), from what real env
servers report over WebSocket, and the same rule applied to hand-made trajectories."""

from __future__ import annotations

import pytest
from rollout_fakes import ScriptedSampler

from env_servers.gomoku_env import GomokuEnv
from envhub.server import create_app
from envhub.server.run import ServerThread
from examples.guess_env import GuessEnv
from trainer.rollout import EnvPool, RolloutConfig, RolloutEngine, Task, Trajectory, make_tasks
from trainer.rollout.types import MAX_REWARD_COMPONENTS, MAX_STATS
from trainer.tokenizer import build_tiny_tokenizer
from trainer.update import episode_metrics


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def episode(outcome: str | None, turn_rewards: list[float], tool_calls: int = 0, **components: float) -> Trajectory:
    traj = Trajectory(task=Task({}), turn_rewards=turn_rewards, tool_calls=tool_calls)
    traj.note_step({"rewards": components, **({"outcome": outcome} if outcome else {})})
    return traj


def test_rates_components_and_tool_calls_follow_one_rule() -> None:
    episodes = [episode("win", [0.0, 10.0], tool_calls=2, solved=1.0), episode("loss", [-1.0, -10.0]),
                episode("draw", [0.0, 0.0], solved=0.5), episode("loss", [-1.0, -1.0, -20.0], tool_calls=1)]
    m = episode_metrics(episodes, "eval")
    assert (m["eval/win_rate"], m["eval/loss_rate"], m["eval/draw_rate"]) == (0.25, 0.5, 0.25)
    assert m["eval/penalised_turn_frac"] == 5 / 9
    assert (m["eval/tool_call_rate"], m["eval/tool_calls_mean"]) == (0.5, 0.75)
    assert m["eval/rewards/solved_mean"] == 1.5 / 4  # an episode that never reported it counts 0


def test_no_outcome_means_no_game_rates_and_components_sum_over_steps() -> None:
    traj = Trajectory(task=Task({}), turn_rewards=[0.5, 0.5])
    for _ in range(3):
        traj.note_step({"rewards": {"fmt": 0.5, "bad": "x", "flag": True}, "outcome": None})
    m = episode_metrics([traj], "train")
    assert m == {"train/penalised_turn_frac": 0.0, "train/tool_call_rate": 0.0, "train/tool_calls_mean": 0.0,
                 "train/rewards/fmt_mean": 1.5}
    assert episode_metrics([], "eval")["eval/penalised_turn_frac"] == 0.0


def test_sampled_nll_is_the_mean_minus_logprob_of_the_sampled_tokens_only() -> None:
    from trainer.rollout.groups import GroupedBatch
    from trainer.rollout.types import StopReason
    from trainer.update import rollout_metrics

    def sampled(logprobs: list[float], stop: StopReason | None = None) -> Trajectory:
        traj = Trajectory(task=Task({}), stop_reason=stop)
        traj.append([1, 2], policy=False)  # the prompt: no log-probs, not counted
        traj.append([3] * len(logprobs), policy=True, logprobs=logprobs)
        return traj

    trajs = [sampled([-0.5, -1.5]), sampled([-1.0]), sampled([-9.0], StopReason.ENV_ERROR)]
    assert rollout_metrics(trajs, GroupedBatch())["train/sampled_nll"] == pytest.approx(1.0)  # 3 tokens, 3.0
    assert rollout_metrics([sampled([0.0, 0.0])], GroupedBatch())["train/sampled_nll"] == 0.0  # deterministic
    assert rollout_metrics([], GroupedBatch())["train/sampled_nll"] == 0.0


def test_end_reasons_are_counted_apart_from_outcomes_and_bounded() -> None:
    from trainer.update.stats import MAX_END_REASONS

    def ended(reason: str | None, outcome: str = "loss") -> Trajectory:
        traj = Trajectory(task=Task({}), turn_rewards=[-20.0])
        traj.note_step({"outcome": outcome, **({"end_reason": reason} if reason else {})})
        return traj

    episodes = [ended("too_many_invalid"), ended("loss"), ended("too_many_invalid"), ended(None), ended("a b/c")]
    m = episode_metrics(episodes, "train")
    assert m["train/loss_rate"] == 1.0 and m["train/end/too_many_invalid_rate"] == 2 / 5
    assert (m["train/end/loss_rate"], m["train/end/a_b_c_rate"]) == (1 / 5, 1 / 5)
    many = episode_metrics([ended(f"r{i:03d}") for i in range(4 * MAX_END_REASONS)] + [ended("r999")] * 2, "eval")
    kept = [k for k in many if k.startswith("eval/end/")]
    assert len(kept) == MAX_END_REASONS and many["eval/end/r999_rate"] == 2 / (4 * MAX_END_REASONS + 2)


def test_an_env_cannot_grow_the_components_without_bound() -> None:
    traj = Trajectory(task=Task({}))
    traj.note_step({"rewards": {f"c{i}": 1.0 for i in range(10 * MAX_REWARD_COMPONENTS)}, "end_reason": "x" * 10_000})
    traj.note_step({"rewards": {"c0": 1.0, "late": 1.0}})
    assert len(traj.reward_components) == MAX_REWARD_COMPONENTS and traj.reward_components["c0"] == 2.0
    assert len(traj.info["end_reason"]) == 100


def test_env_stats_sum_over_steps_and_are_bounded() -> None:
    moves = [{"win_chances": 1, "wins_missed": 1}, {"win_chances": 1, "wins_missed": 0, "odd name": 2}]
    a, b = Trajectory(task=Task({})), Trajectory(task=Task({}))
    for stats in moves:
        a.note_step({"stats": stats})
    b.note_step({"stats": {"win_chances": "one", "wins_missed": float("inf")}})  # not finite numbers: skipped
    assert a.stats == {"win_chances": 2.0, "wins_missed": 1.0, "odd name": 2.0} and b.stats == {}
    m = episode_metrics([a, b], "eval")
    assert (m["eval/stats/win_chances_mean"], m["eval/stats/wins_missed_mean"]) == (1.0, 0.5)
    assert m["eval/stats/odd_name_mean"] == 1.0 and "eval/rewards/win_chances_mean" not in m
    flood = Trajectory(task=Task({}))
    flood.note_step({"stats": {f"s{i}": 1 for i in range(10 * MAX_STATS)}})
    assert len(flood.stats) == MAX_STATS and flood.to_record()["stats"] == flood.stats


@pytest.mark.live
async def test_gomoku_server_outcomes_reach_the_metrics(tok) -> None:
    # a policy that never writes a move loses every game once its invalid moves run out
    with ServerThread(create_app(GomokuEnv, board_size=5, opponent="random", max_invalid_moves=2)) as srv:
        engine = RolloutEngine(EnvPool(urls=[srv.ws_url]), ScriptedSampler(tok, lambda p: "pass"), tok,
                               RolloutConfig(max_turns=5, tool_mode="text"))
        trajs = await engine.run(make_tasks([{"seed": s} for s in range(4)], 1, urls=[srv.ws_url]))
    assert [t.info.get("outcome") for t in trajs] == ["loss"] * 4
    assert [t.info.get("end_reason") for t in trajs] == ["too_many_invalid"] * 4
    m = episode_metrics(trajs, "eval")
    assert (m["eval/win_rate"], m["eval/loss_rate"], m["eval/draw_rate"]) == (0.0, 1.0, 0.0)
    assert m["eval/penalised_turn_frac"] == 1.0 and m["eval/tool_call_rate"] == 0.0
    assert m["eval/stats/win_chances_mean"] == 0.0 and m["eval/stats/wins_missed_mean"] == 0.0  # no line to make


@pytest.mark.live
async def test_tool_env_components_and_tool_calls_reach_the_metrics(tok) -> None:
    call = '<tool_call>\n{"name": "guess", "arguments": {"number": 7}}\n</tool_call>'
    with ServerThread(create_app(GuessEnv)) as srv:
        engine = RolloutEngine(EnvPool(urls=[srv.ws_url]), ScriptedSampler(tok, lambda p: call), tok,
                               RolloutConfig(max_turns=1))
        trajs = await engine.run(make_tasks([{"low": 7, "high": 7}, {"low": 8, "high": 9}], 1, urls=[srv.ws_url]))
    assert [t.reward_components for t in trajs] == [{"solved": 1.0}, {"solved": 0.0}]
    m = episode_metrics(trajs, "eval")
    assert m["eval/rewards/solved_mean"] == 0.5 and m["eval/tool_call_rate"] == 1.0
    assert "eval/win_rate" not in m
