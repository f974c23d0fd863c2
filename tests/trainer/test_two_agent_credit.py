"""Credit in two-agent training, on the gomoku-two-agent scenario's own env and algorithm: every ending turn
(an invalid move, a winning line, the move the winning line answered) sits in the datum of the agent that
played it, trained on (mask 1) with the advantage's right sign, and the metrics tell invalid moves from
lost lines."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_fakes import ScriptedSampler

from trainer.recipes.matches import MatchRollout, MatchSpec, by_agent
from trainer.recipes.players import outcome_metrics
from trainer.recipes.two_agent import build_pool
from trainer.recipes.two_agent_config import load_two_agent_config
from trainer.rollout import build_groups
from trainer.tokenizer import build_tiny_tokenizer
from trainer.update import compute_advantages, episode_metrics, pack

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "scenario_gomoku_two_agent.toml"
#: the scenario's shaping for a legal move that leaves the mover's own line open
MISSED_WIN = load_two_agent_config(CONFIG, []).env.env_kwargs["rewards"]["missed_win"]


def moves(*cells: int | str) -> list[str]:
    return [f"<move>{c}</move>" if isinstance(c, int) else c for c in cells]


#: one group of alice's (X) and bob's (O) games: name -> (alice's replies, bob's replies)
GAMES = {"x_occupied": (moves(5, 5), moves(1)), "o_occupied": (moves(5, 9), moves(1, 1)),
         "x_line": (moves(1, 2, 3), moves(4, 5)), "o_line": (moves(1, 2, 9), moves(5, 4, 6)),
         "x_garbage": (moves("hello"), moves(1)), "o_garbage": (moves(5, 9), moves("hi")),
         "x_occupied_late": (moves(1, 9, 1), moves(5, 2)), "draw": (moves(1, 3, 4, 8, 9), moves(2, 5, 6, 7))}


def scripted(replies: list[str]):
    """The replies in order, one per call (one sampler per seat and game; the scenario prompts each move
    with its board alone, so the prompt does not tell the turn)."""
    turns = iter(replies)

    def respond(prompt: str) -> str:
        return next(turns)

    return respond


@pytest.fixture(scope="module")
def played():
    """Each agent's one group of the eight games, its per-token advantages and packed batch."""
    import asyncio

    cfg = load_two_agent_config(CONFIG, [])
    tok = build_tiny_tokenizer()

    async def play() -> list:
        results = []
        for k, (alice, bob) in enumerate(GAMES.values()):
            policies = {"alice": (ScriptedSampler(tok, scripted(alice)), tok),
                        "bob": (ScriptedSampler(tok, scripted(bob)), tok)}
            results += await MatchRollout(build_pool(cfg), policies, cfg.rollout).run(
                [MatchSpec(f"credit-{k}", {"X": "alice", "O": "bob"}, {"seed": k}, group_id=0)])
        return results

    trajs = by_agent(asyncio.run(play()))
    out = {}
    for agent, own in trajs.items():
        algo = cfg.agents[agent].algo
        [group] = build_groups(own, cfg.run.group_size, filter_zero_variance=algo.filter_zero_variance).groups
        advantages = compute_advantages(algo, [group])
        out[agent] = (dict(zip(GAMES, group)), dict(zip(GAMES, advantages)), own)
    return out


def turn_advantages(traj, advantages: list[float], turn: int) -> list[float]:
    """The advantages on turn ``turn``'s trained tokens (mask 1), after packing (in the row of the sequence
    that holds the turn: the scenario's history window makes one sequence per turn)."""
    batch = pack([traj], [advantages], 0)
    end = traj.turn_ends[turn]
    row, span = next((r, tokens) for r, (tokens, _) in enumerate(traj.segments()) if tokens.start <= end < tokens.stop)
    start = max(traj.turn_ends[turn - 1] + 1 if turn else traj.prompt_len, span.start)
    ids = [j for j in range(start, end + 1) if traj.mask[j]]
    at = [j - span.start - 1 for j in ids]  # the batch's columns are shifted by one (next-token targets)
    assert ids and all(batch.mask_BS[row, k] == 1 for k in at), "the turn's sampled tokens are not trained"
    return [float(batch.advantages_BS[row, k]) for k in at]


@pytest.mark.parametrize(("game", "mover", "other", "other_last"), [
    ("x_occupied", "alice", "bob", 1.0), ("x_occupied_late", "alice", "bob", 1.0), ("x_garbage", "alice", "bob", None),
    ("o_occupied", "bob", "alice", 1.0), ("o_garbage", "bob", "alice", 1.0)])
def test_an_invalid_move_is_the_movers_last_turn_with_a_negative_advantage(played, game, mover, other,
                                                                          other_last) -> None:
    trajs, advs, _ = played[mover]
    traj = trajs[game]
    assert traj.info["agent"] == mover and traj.info["end_reason"] == "too_many_invalid"
    assert traj.turn_rewards[-1] == -20.0 and all(r == 1.0 for r in traj.turn_rewards[:-1])
    assert max(turn_advantages(traj, advs[game], len(traj.turn_ends) - 1)) < 0
    # the other seat's datum ends on its own last move (a legal one, +1; the forfeit itself is worth 0 here);
    # when X failed at once, O's episode ended at its reset: no turn, nothing trained, the win still counted
    theirs = played[other][0][game]
    assert theirs.info["end_reason"] == "opponent_forfeit" and theirs.info["outcome"] == "win"
    assert -20.0 not in theirs.turn_rewards
    if other_last is None:
        assert theirs.num_turns == 0 and theirs.turn_rewards == [] and theirs.num_policy_tokens == 0
        assert not any(played[other][1][game])
    else:
        assert theirs.turn_rewards[-1] == other_last


@pytest.mark.parametrize(("game", "winner", "loser"), [("x_line", "alice", "bob"), ("o_line", "bob", "alice")])
def test_a_winning_line_is_positive_for_the_winner_and_the_answered_move_negative_for_the_loser(
        played, game, winner, loser) -> None:
    won, lost = played[winner][0][game], played[loser][0][game]
    # in o_line alice's last move (9) left her own 1-2-3 open: the scenario's missed_win shaping lands on it too
    shaping = MISSED_WIN if game == "o_line" else 0.0
    assert won.turn_rewards[-1] == 10.0 and lost.turn_rewards[-1] == 1.0 - 10.0 + shaping
    assert min(turn_advantages(won, played[winner][1][game], len(won.turn_ends) - 1)) > 0
    assert max(turn_advantages(lost, played[loser][1][game], len(lost.turn_ends) - 1)) < 0


def test_the_metrics_tell_invalid_moves_from_lost_lines(played) -> None:
    own = played["alice"][2]
    train, outcomes = episode_metrics(own, "train"), outcome_metrics(own, "train")
    # penalised turns count every loss (the lost line's last move is rewarded below zero too) and a legal move
    # that missed a win (the draw: alice's 8 left 1-4-7 open): 5 of alice's 20 turns
    assert train["train/loss_rate"] == 4 / 8 and train["train/penalised_turn_frac"] == 5 / 20
    assert train["train/rewards/missed_win_mean"] == 2 * MISSED_WIN / 8  # o_line and the draw, on her own moves
    assert train["train/end/too_many_invalid_rate"] == outcomes["train/end/too_many_invalid_rate"] == 3 / 8
    assert train["train/end/loss_rate"] == 1 / 8 and train["train/end/opponent_forfeit_rate"] == 2 / 8
