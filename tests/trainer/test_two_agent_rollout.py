"""Two-agent match rollouts over WebSocket: each seat sampled by its own agent, rewards on the acting agent."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rollout_fakes import ScriptedSampler

from env_servers.gomoku_env import GomokuMatchEnv
from trainer.recipes.matches import MatchRollout, MatchSpec, by_agent
from trainer.recipes.setup import in_process_env
from trainer.recipes.two_agent_config import load_two_agent_config
from trainer.rollout import EnvPool, RolloutConfig, StopReason
from trainer.tokenizer import build_tiny_tokenizer

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def line_player(name: str, clumsy_as: str | None = None):
    """A scripted agent: X fills row 0, O fills row 1, left to right; as ``clumsy_as`` it first sends no move."""

    def respond(prompt: str) -> str:
        seat = re.search(r"You play ([XO])", prompt).group(1)
        turn = prompt.count("<|im_start|>assistant") - 1
        if seat == clumsy_as:
            if turn == 0:
                return f"{name} thinks."
            turn -= 1
        return f"<move>{0 if seat == 'X' else 1},{turn}</move>"

    return respond


def rollout(url, tok, alice, bob, **cfg):
    return MatchRollout(EnvPool([url], message_timeout_s=30), {"alice": (alice, tok), "bob": (bob, tok)},
                        RolloutConfig(max_turns=cfg.pop("max_turns", 12), max_tokens_per_turn=32,
                                      max_total_tokens=512, max_context_tokens=8192, tool_mode="text"))


def completions(tok, traj) -> str:
    return tok.decode([t for t, m in zip(traj.tokens, traj.mask) if m])


async def test_rewards_go_to_the_acting_agent_and_decisive_games_sum_to_zero(serve_env, tok) -> None:
    server = serve_env(GomokuMatchEnv, turn_timeout_s=10.0)
    alice = ScriptedSampler(tok, line_player("alice"))
    bob = ScriptedSampler(tok, line_player("bob", clumsy_as="X"))
    reset = {"board_size": 5, "opening": []}
    specs = [MatchSpec("attr-1", {"X": "alice", "O": "bob"}, reset, group_id=0),
             MatchSpec("attr-2", {"X": "bob", "O": "alice"}, reset, group_id=1)]
    first, second = await rollout(server.url, tok, alice, bob).run(specs)

    # Match 1, both clean: X (alice) makes five on her 5th move; bob's loss lands on his own last result.
    x, o = first.trajectories["X"], first.trajectories["O"]
    assert first.decisive and first.winner == "alice"
    assert (x.info["agent"], o.info["agent"]) == ("alice", "bob")
    assert x.turn_rewards == [0, 0, 0, 0, 10] and o.turn_rewards == [0, 0, 0, -10]
    assert x.reward + o.reward == 0
    assert x.stop_reason is StopReason.DONE and o.stop_reason is StopReason.DONE
    assert (x.info["end_reason"], o.info["end_reason"]) == ("win", "loss")
    assert (x.info["outcome"], o.info["outcome"]) == ("win", "loss")

    # Match 2: bob (X) first sends no move: the -1 is his alone; the outcome rewards still sum to zero.
    x, o = second.trajectories["X"], second.trajectories["O"]
    assert second.decisive and second.winner == "bob"
    assert x.turn_rewards == [-1, 0, 0, 0, 0, 10] and o.turn_rewards == [0, 0, 0, -10]
    assert x.turn_rewards[-1] + o.turn_rewards[-1] == 0
    assert x.reward == 9 and o.reward == -10

    # Every trajectory holds only its own agent's samples, and each sampler served only its agent's seats.
    trajs = by_agent([first, second])
    assert "bob thinks." not in "".join(completions(tok, t) for t in trajs["alice"])
    assert "bob thinks." in completions(tok, trajs["bob"][1])
    assert len(alice.requests) == sum(t.num_turns for t in trajs["alice"]) == 9
    assert len(bob.requests) == sum(t.num_turns for t in trajs["bob"]) == 10
    assert all(t.policy_version == 0 and not t.infra_failed for ts in trajs.values() for t in ts)


async def test_a_player_leaving_mid_match_is_an_infra_end_for_the_other(serve_env, tok) -> None:
    server = serve_env(GomokuMatchEnv, turn_timeout_s=10.0)
    alice, bob = ScriptedSampler(tok, line_player("alice")), ScriptedSampler(tok, line_player("bob"))
    # Three turns each are not enough to finish: X stops at its turn limit and closes its session.
    [result] = await rollout(server.url, tok, alice, bob, max_turns=3).run(
        [MatchSpec("leave-1", {"X": "alice", "O": "bob"}, {"board_size": 5, "opening": []})])
    x, o = result.trajectories["X"], result.trajectories["O"]
    assert x.stop_reason is StopReason.TURN_LIMIT and not x.infra_failed  # its own limit: trained on
    assert o.info["end_reason"] == "opponent_disconnected" and o.info["outcome"] == "disconnected"
    assert o.infra_failed and o.stop_reason is StopReason.ENV_ERROR and not result.decisive


class BrokenSampler(ScriptedSampler):
    """A policy whose generate fails (a bug, not the env): the rollout must fail loudly."""

    async def generate(self, request):
        raise RuntimeError("sampler exploded")


async def test_a_failing_policy_abandons_the_match_and_leaves_no_seat_playing(serve_env, tok) -> None:
    from rollout_fakes import wait_until

    from env_servers.gomoku_env.coordinator import REGISTRY

    server = serve_env(GomokuMatchEnv, turn_timeout_s=10.0)
    alice, bob = ScriptedSampler(tok, line_player("alice")), BrokenSampler(tok, line_player("bob"))
    with pytest.raises(RuntimeError, match="sampler exploded"):
        await rollout(server.url, tok, alice, bob).run(
            [MatchSpec("boom-1", {"X": "alice", "O": "bob"}, {"board_size": 5, "opening": []})])
    # Both sessions were closed: the server forgot the match instead of keeping alice waiting on bob.
    wait_until(lambda: REGISTRY.get("boom-1") is None, timeout_s=5)


class SecondConnectionRefused:
    """A pool whose second connection fails (the O seat's, opened after X's): an env outage before joining."""

    def __init__(self, pool: EnvPool):
        self.pool, self.opened = pool, 0

    async def open(self, url=None):
        self.opened += 1
        if self.opened == 2:
            from envhub.errors import EnvConnectionError

            raise EnvConnectionError("connection refused")
        return await self.pool.open(url)

    async def aclose(self) -> None:
        await self.pool.aclose()


async def test_a_seat_that_cannot_connect_stops_the_match_before_the_other_plays_alone(tok) -> None:
    alice, bob = ScriptedSampler(tok, line_player("alice")), ScriptedSampler(tok, line_player("bob"))
    pool = SecondConnectionRefused(EnvPool(env_cls=GomokuMatchEnv))
    rollout = MatchRollout(pool, {"alice": (alice, tok), "bob": (bob, tok)},
                           RolloutConfig(max_turns=12, max_tokens_per_turn=32, tool_mode="text"), partner_grace_s=30)
    [result] = await rollout.run([MatchSpec("refused-1", {"X": "alice", "O": "bob"}, {"board_size": 5})])
    x, o = result.trajectories["X"], result.trajectories["O"]
    assert o.stop_reason is StopReason.ENV_ERROR and "connection refused" in o.error
    assert x.stop_reason is StopReason.ENV_ERROR and "not starting the match alone" in x.error
    assert x.elapsed_s < 5 and alice.requests == []  # no grace period spent, no move made
    assert result.infra_failed and not result.decisive


async def test_the_scripted_random_player_only_makes_legal_moves_over_a_whole_game(tok) -> None:
    from trainer.recipes.opponents import RandomMoveSampler

    players = {"r1": (RandomMoveSampler(tok, seed=1), tok), "r2": (RandomMoveSampler(tok, seed=2), tok)}
    rollout = MatchRollout(EnvPool(env_cls=GomokuMatchEnv), players,
                           RolloutConfig(max_turns=13, max_tokens_per_turn=24, max_total_tokens=512,
                                         max_context_tokens=16384, tool_mode="text"))
    specs = [MatchSpec(f"rand-{i}", {"X": "r1", "O": "r2"} if i % 2 else {"X": "r2", "O": "r1"},
                       {"board_size": 5, "seed": i}) for i in range(4)]
    results = await rollout.run(specs)
    for result in results:
        reasons = set(result.end_reasons.values())
        assert reasons in ({"win", "loss"}, {"draw"}), reasons  # every game played out, nobody forfeits
        assert all(r >= 0 or r == -10 for t in result.trajectories.values() for r in t.turn_rewards)


@pytest.mark.parametrize("brief", [False, True])
async def test_the_scripted_random_player_plays_cell_numbers_legally(tok, brief) -> None:
    from trainer.recipes.opponents import RandomMoveSampler

    players = {"r1": (RandomMoveSampler(tok, seed=1), tok), "r2": (RandomMoveSampler(tok, seed=2), tok)}

    class CellMatchEnv(GomokuMatchEnv):
        def __init__(self) -> None:  # one invalid move loses: a game played out is a game of legal moves
            super().__init__(board_size=3, win_length=3, move_format="cell", brief_messages=brief,
                             max_invalid_moves=1)

    rollout = MatchRollout(EnvPool(env_cls=CellMatchEnv), players,
                           RolloutConfig(max_turns=5, max_tokens_per_turn=24, max_total_tokens=512,
                                         max_context_tokens=16384, tool_mode="text"))
    specs = [MatchSpec(f"cell-{brief}-{i}", {"X": "r1", "O": "r2"}, {"seed": i, "opening": []}) for i in range(6)]
    for result in await rollout.run(specs):
        assert set(result.end_reasons.values()) in ({"win", "loss"}, {"draw"}), result.end_reasons


def test_outcome_metrics_count_the_envs_outcome_not_its_end_reasons() -> None:
    from envhub.types import Outcome
    from trainer.recipes.players import outcome_metrics
    from trainer.rollout.types import Task, Trajectory

    def played(outcome, end_reason="an env's own words", stop=StopReason.DONE):
        return Trajectory(task=Task(reset_kwargs={}), stop_reason=stop, reward=1.0,
                          info={"outcome": outcome, "end_reason": end_reason})

    trajs = [played("win"), played(Outcome.WIN.value), played("loss", "win"), played("draw"), played(None),
             played("disconnected", stop=StopReason.ENV_ERROR)]
    m = outcome_metrics(trajs, "a")
    assert (m["a/win_rate"], m["a/loss_rate"], m["a/draw_rate"]) == (2 / 5, 1 / 5, 1 / 5)
    assert m["a/episodes"] == 5 and m["a/infra_failures"] == 1
    assert m["a/end/win_rate"] == 1 / 5 and m["a/penalised_turn_frac"] == 0.0  # episode_metrics' own rule
    empty = outcome_metrics([played(None)], "b")  # no result named: the three rates are still reported
    assert (empty["b/win_rate"], empty["b/loss_rate"], empty["b/draw_rate"]) == (0.0, 0.0, 0.0)



def cell_player(name: str, moves: dict[str, list[int]]):
    """A scripted agent for numbered-cell boards: as seat S its n-th reply is ``<move>moves[S][n]</move>``, n the
    count of S's stones on the newest board (the prompt may hold that board alone: a history window)."""

    def respond(prompt: str) -> str:
        board = prompt.rsplit("<|im_start|>user", 1)[-1]
        seat = re.findall(r"([XO]) to move\.", board)[-1]
        stones = board.split(f"{seat} to move.")[0].split().count(seat)
        return f"<move>{moves[seat][stones]}</move>"

    return respond


async def test_the_two_agent_scenarios_rewards_land_on_the_agent_whose_move_earned_them(tok) -> None:
    # The env, reward table and turn limits of examples/configs/scenario_gomoku_two_agent.toml: 3x3 board,
    # three in a row, numbered cells, +1 per legal move, one invalid move loses, a win by the other's forfeit earns 0.
    cfg = load_two_agent_config(Path(__file__).resolve().parents[2] / "examples" / "configs"
                                / "scenario_gomoku_two_agent.toml")
    # Match 1: alice (X) takes the top row, bob (O) plays 4, 5; match 2: bob (X) plays 5, then alice's cell 1.
    alice = ScriptedSampler(tok, cell_player("alice", {"X": [1, 2, 3], "O": [1]}))
    bob = ScriptedSampler(tok, cell_player("bob", {"X": [5, 1], "O": [4, 5]}))
    players = {"alice": (alice, tok), "bob": (bob, tok)}
    rollout = MatchRollout(EnvPool(env_cls=in_process_env(cfg.env)), players, cfg.rollout)
    specs = [MatchSpec("scn-1", {"X": "alice", "O": "bob"}, {"seed": 1}),
             MatchSpec("scn-2", {"X": "bob", "O": "alice"}, {"seed": 2})]
    first, second = await rollout.run(specs)

    x, o = first.trajectories["X"], first.trajectories["O"]
    assert first.winner == "alice" and (x.info["agent"], o.info["agent"]) == ("alice", "bob")
    assert x.turn_rewards == [1, 1, 10]     # each legal move +1; the winning one earns the win
    assert o.turn_rewards == [1, 1 - 10]     # bob's two legal moves; the loss lands on his last result

    x, o = second.trajectories["X"], second.trajectories["O"]
    assert second.winner == "alice" and (x.info["agent"], o.info["agent"]) == ("bob", "alice")
    assert x.turn_rewards == [1, -20]        # bob's move on alice's stone forfeits: the penalty is his alone
    assert o.turn_rewards == [1 + 0]         # alice's one legal move; bob's forfeit earns her no reward
    assert (x.info["outcome"], o.info["outcome"]) == ("loss", "win")

    # Each trajectory holds only the moves its agent's sampler made.
    trajs = by_agent([first, second])
    moves = {n: [completions(tok, t).replace(tok.eos_token, "") for t in ts] for n, ts in trajs.items()}
    assert moves == {"alice": ["<move>1</move><move>2</move><move>3</move>", "<move>1</move>"],
                     "bob": ["<move>4</move><move>5</move>", "<move>5</move><move>1</move>"]}
    assert len(alice.requests) == sum(t.num_turns for t in trajs["alice"]) == 4
    assert len(bob.requests) == sum(t.num_turns for t in trajs["bob"]) == 4
