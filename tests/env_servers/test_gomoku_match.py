"""Two-agent gomoku: two EnvRunner sessions share a match through the in-process coordinator."""

import asyncio
import itertools
import re
import time

import pytest

from env_servers.gomoku_env import GomokuMatchEnv
from env_servers.gomoku_env.coordinator import REGISTRY
from envhub import EnvRunner
from envhub.errors import ActionValidationError, EpisodeStateError

_ids = itertools.count()


def new_id():
    return f"test-{next(_ids)}"


def mv(r, c):
    return {"text": f"<thinking>...</thinking><move>{r},{c}</move>"}


async def play_seat(runner, match_id, seat, actions, **reset):
    """Join as ``seat`` and play scripted actions until the episode ends; returns (first, results)."""
    first = await runner.reset(seed=0, match_id=match_id, seat=seat, opening=[], **reset)
    results = []
    for action in actions:
        if results and results[-1].ended:
            break
        results.append(await runner.step(action))
    return first, results


async def test_decisive_game_is_zero_sum_and_turns_alternate():
    mid = new_id()
    x, o = EnvRunner(GomokuMatchEnv()), EnvRunner(GomokuMatchEnv())
    x_moves = [mv(0, c) for c in range(5)]
    o_moves = [mv(8, c) for c in range(5)]
    (x_first, xs), (o_first, os) = await asyncio.gather(play_seat(x, mid, "X", x_moves),
                                                         play_seat(o, mid, "O", o_moves))
    assert "Your turn (X)" in x_first.observation.text
    assert "placed X at (0,0)" in o_first.observation.text  # O's reset waited for X's first move
    assert x_first.observation.metadata["system_prompt"].count("You move first") == 1
    assert "Your opponent moves first" in o_first.observation.metadata["system_prompt"]
    # every non-final X result shows O's reply: turns alternate
    assert [tuple(r.info["opponent_move"]) for r in xs[:-1]] == [(8, c) for c in range(4)]
    assert xs[-1].done and xs[-1].info["end_reason"] == "win" and xs[-1].reward == 10.0
    assert os[-1].done and os[-1].info["end_reason"] == "loss" and os[-1].reward == -10.0
    assert len(os) == 4 and tuple(os[-1].info["opponent_move"]) == (0, 4)  # the loss shows X's winning move
    assert xs[-1].info["episode_reward"] + os[-1].info["episode_reward"] == 0.0
    assert mid not in list(REGISTRY._matches)  # finished matches are dropped
    # each seat's tactics: X took the five it could make; O, with no line of its own, left X's open
    assert tactics_of(xs) == {"win_chances": 1, "wins_missed": 0, "block_chances": 0, "blocks_missed": 0}
    assert tactics_of(os) == {"win_chances": 0, "wins_missed": 0, "block_chances": 1, "blocks_missed": 1}


def tactics_of(results) -> dict[str, int]:
    """A seat's ``info["stats"]`` summed over its steps, as a client sums them."""
    totals: dict[str, int] = {}
    for result in results:
        for name, value in result.info["stats"].items():
            totals[name] = totals.get(name, 0) + value
    return totals


async def test_shaping_goes_to_the_seat_whose_move_missed_and_keeps_the_outcome_zero_sum():
    mid = new_id()
    kwargs = {"board_size": 3, "win_length": 3, "rewards": {"missed_win": -3.0, "missed_block": -2.0}}
    x, o = EnvRunner(GomokuMatchEnv(**kwargs)), EnvRunner(GomokuMatchEnv(**kwargs))
    # X (0,0), O (1,1), X (0,1): X threatens (0,2); O (2,2) leaves it open (missed block);
    # X (2,0) misses the row (missed win); O (0,2) blocks it, but X's column (1,0) stays open; X takes it
    x_moves = [mv(0, 0), mv(0, 1), mv(2, 0), mv(1, 0)]
    o_moves = [mv(1, 1), mv(2, 2), mv(0, 2)]
    (_, xs), (_, os) = await asyncio.gather(play_seat(x, mid, "X", x_moves), play_seat(o, mid, "O", o_moves))
    assert [r.info.get("rewards") for r in xs] == [None, None, {"missed_win": -3.0}, None]
    assert [r.reward for r in xs] == [0.0, 0.0, -3.0, 10.0]
    # O's block of (0,2) left (1,0) open: every cell that stops a line counts, so it is no miss
    assert [r.info.get("rewards") for r in os] == [None, {"missed_block": -2.0}, None]
    assert [r.reward for r in os] == [0.0, -2.0, -10.0]
    assert xs[-1].info["outcome"] == "win" and os[-1].info["outcome"] == "loss"


async def test_second_player_can_win_and_the_loss_lands_on_the_first_players_result():
    mid = new_id()
    x, o = EnvRunner(GomokuMatchEnv()), EnvRunner(GomokuMatchEnv())
    x_moves = [mv(0, 0), mv(8, 8), mv(0, 8), mv(8, 0), mv(2, 7), mv(6, 1)]
    o_moves = [mv(4, c) for c in range(2, 7)]
    (_, xs), (_, os) = await asyncio.gather(play_seat(x, mid, None, x_moves), play_seat(o, mid, None, o_moves))
    assert xs[-1].info["seat"] == "X" and os[-1].info["seat"] == "O"  # seats auto-assigned in join order
    assert os[-1].done and os[-1].info["end_reason"] == "win" and os[-1].reward == 10.0
    assert xs[-1].done and xs[-1].info["end_reason"] == "loss" and xs[-1].reward == -10.0
    assert len(xs) == 5 and all(r.reward == 0.0 for r in xs[:-1])


async def test_draw_in_a_match_on_a_small_board():
    # 5x5 pattern with no five: XXOOX / OOXXO / XXOOX / OOXXO / XXOOX; the last three cells are played
    pattern = ["XXOOX", "OOXXO", "XXOOX", "OOXXO", "XXOOX"]
    leave = {(0, 0), (3, 4), (4, 4)}
    xs_ = [(r, c) for r in range(5) for c in range(5) if pattern[r][c] == "X" and (r, c) not in leave]
    os_ = [(r, c) for r in range(5) for c in range(5) if pattern[r][c] == "O" and (r, c) not in leave]
    opening = [list(m) for pair in zip(xs_, os_) for m in pair]
    mid = new_id()
    x, o = EnvRunner(GomokuMatchEnv(board_size=5)), EnvRunner(GomokuMatchEnv(board_size=5))

    async def x_side():
        await x.reset(match_id=mid, seat="X", opening=opening)
        return [await x.step(mv(0, 0)), await x.step(mv(4, 4))]

    async def o_side():
        await o.reset(match_id=mid, seat="O")
        return [await o.step(mv(3, 4))]

    xs, os = await asyncio.gather(x_side(), o_side())
    assert xs[-1].info["end_reason"] == os[-1].info["end_reason"] == "draw"
    assert xs[-1].done and os[-1].done and xs[-1].reward == os[-1].reward == 0.0


async def test_cell_move_format_in_a_match():
    mid = new_id()
    kwargs = {"board_size": 3, "win_length": 3, "brief_messages": True, "move_format": "cell"}
    x, o = EnvRunner(GomokuMatchEnv(**kwargs)), EnvRunner(GomokuMatchEnv(**kwargs))
    cell = lambda n: {"text": f"<move>{n}</move>"}  # noqa: E731
    (x_first, xs), (o_first, os) = await asyncio.gather(
        play_seat(x, mid, "X", [cell(1), cell(2), cell(3)]), play_seat(o, mid, "O", [cell(1), cell(5), cell(9)]))
    assert x_first.observation.text == "1 2 3\n4 5 6\n7 8 9\nX to move."
    assert o_first.observation.text == "X 2 3\n4 5 6\n7 8 9\nO to move."
    assert "<move>n</move>" in o_first.observation.metadata["system_prompt"]
    assert os[0].info["event"] == "occupied" and os[1].info["move"] == [1, 1]
    assert xs[-1].info["end_reason"] == "win" and os[-1].info["end_reason"] == "loss"


async def test_illegal_moves_are_charged_to_the_offender_and_the_turn_stays():
    mid = new_id()
    x, o = EnvRunner(GomokuMatchEnv()), EnvRunner(GomokuMatchEnv())
    x_actions = [{"text": "hmm"}, mv(4, 4), mv(0, 0), mv(0, 1), mv(0, 2), mv(0, 3), mv(0, 4)]
    o_actions = [mv(4, 4), mv(9, 9), mv(8, 0), mv(8, 1), mv(8, 2), mv(8, 3), mv(7, 7), mv(6, 6)]
    (_, xs), (_, os) = await asyncio.gather(play_seat(x, mid, "X", x_actions), play_seat(o, mid, "O", o_actions))
    assert (xs[0].info["event"], xs[0].reward, xs[0].info["opponent_move"]) == ("bad_format", -1.0, None)
    assert (os[0].info["event"], os[0].reward) == ("occupied", -1.0)
    assert (os[1].info["event"], os[1].reward) == ("out_of_bounds", -1.0)
    assert xs[1].info["event"] == "valid" and tuple(xs[1].info["opponent_move"]) == (8, 0)  # O moved again
    assert xs[-1].info["end_reason"] == "win" and os[-1].info["end_reason"] == "loss"
    assert xs[-1].info["episode_reward"] == 10.0 - 1.0 and os[-1].info["episode_reward"] == -10.0 - 2.0


async def test_too_many_invalid_moves_forfeit_the_match():
    mid = new_id()
    x, o = EnvRunner(GomokuMatchEnv(max_invalid_moves=2)), EnvRunner(GomokuMatchEnv(max_invalid_moves=2))
    (_, xs), (_, os) = await asyncio.gather(play_seat(x, mid, "X", [mv(4, 4), {"text": "?"}, {"text": "?"}]),
                                            play_seat(o, mid, "O", [mv(3, 3), mv(5, 5)]))
    assert xs[-1].done and xs[-1].info["end_reason"] == "too_many_invalid" and xs[-1].reward == -20.0
    assert os[-1].done and os[-1].info["end_reason"] == "opponent_forfeit" and os[-1].reward == 10.0


async def test_a_win_by_forfeit_earns_the_opponent_forfeit_reward_when_one_is_set():
    mid = new_id()
    rewards = {"opponent_forfeit": 0.5}
    x = EnvRunner(GomokuMatchEnv(max_invalid_moves=1, rewards=rewards))
    o = EnvRunner(GomokuMatchEnv(max_invalid_moves=1, rewards=rewards))
    (_, xs), (_, os) = await asyncio.gather(play_seat(x, mid, "X", [mv(4, 4), mv(4, 4)]),
                                            play_seat(o, mid, "O", [mv(3, 3)]))
    assert xs[-1].info["end_reason"] == "too_many_invalid" and xs[-1].reward == -20.0
    assert os[-1].info["end_reason"] == "opponent_forfeit" and os[-1].info["outcome"] == "win"
    assert os[-1].reward == 0.5  # the opponent's mistake, not a line of its own: the outcome is still a win


async def test_disconnect_ends_the_match_for_the_other_player_as_truncated():
    mid = new_id()
    x, o = EnvRunner(GomokuMatchEnv()), EnvRunner(GomokuMatchEnv())
    await x.reset(match_id=mid, seat="X", opening=[])
    x_step = asyncio.create_task(x.step(mv(4, 4)))
    await o.reset(match_id=mid, seat="O")
    assert not x_step.done()  # X waits for O's reply
    await o.close()  # O's session goes away (the server calls env.close() on disconnect)
    result = await asyncio.wait_for(x_step, 2)
    assert result.truncated and not result.done and result.reward == 0.0
    assert result.info["end_reason"] == "opponent_disconnected"
    assert "disconnected" in result.observation.text
    assert mid not in REGISTRY._matches


async def test_a_match_that_ends_during_reset_ends_the_episode_at_reset():
    mid = new_id()
    x, o = EnvRunner(GomokuMatchEnv()), EnvRunner(GomokuMatchEnv())
    await x.reset(match_id=mid, seat="X", opening=[])
    o_reset = asyncio.create_task(o.reset(match_id=mid, seat="O"))  # waits for X's first move
    await asyncio.sleep(0.01)
    await x.close()
    first = await o_reset
    assert first.truncated and not first.done and first.reward == 0.0
    assert first.info["end_reason"] == "opponent_disconnected" and "disconnected" in first.observation.text
    with pytest.raises(EpisodeStateError):  # nothing left to play
        await o.step(mv(4, 4))
    assert (await o.state())["done"]


async def test_a_forfeit_on_the_first_move_ends_the_other_seat_at_reset():
    mid = new_id()
    x = EnvRunner(GomokuMatchEnv(board_size=3, win_length=3, max_invalid_moves=1))
    o = EnvRunner(GomokuMatchEnv(board_size=3, win_length=3, max_invalid_moves=1))
    await x.reset(match_id=mid, seat="X", opening=[[0, 0], [1, 1]])
    o_reset = asyncio.create_task(o.reset(match_id=mid, seat="O"))
    await asyncio.sleep(0.01)
    lost = await x.step(mv(1, 1))  # occupied: X's one allowance, the match is over
    assert lost.done and lost.info["outcome"] == "loss"
    first = await o_reset
    assert first.done and first.info["outcome"] == "win" and first.info["end_reason"] == "opponent_forfeit"
    assert first.reward == 10.0 and (await o.state())["episode_reward"] == 10.0
    with pytest.raises(EpisodeStateError):
        await o.step(mv(2, 2))


async def test_a_slow_opponent_times_out():
    mid = new_id()
    x, o = EnvRunner(GomokuMatchEnv(turn_timeout_s=0.3)), EnvRunner(GomokuMatchEnv(turn_timeout_s=0.3))
    await x.reset(match_id=mid, seat="X", opening=[])
    x_step = asyncio.create_task(x.step(mv(4, 4)))
    await o.reset(match_id=mid, seat="O")
    assert (await o.state())["agents"] == {"X": "pending", "O": "running"}
    started = time.monotonic()
    result = await x_step  # O never moves
    assert 0.1 < time.monotonic() - started < 2
    assert result.truncated and result.reward == 0.0 and result.info["end_reason"] == "opponent_timeout"
    late = await o.step(mv(3, 3))
    assert late.truncated and late.reward == 0.0 and late.info["end_reason"] == "turn_timeout"
    assert not late.info["valid"] and "You placed" not in late.observation.text
    assert (await o.state())["board"][3][3] == "."  # the late move was not played


async def test_a_late_joiner_gets_the_free_seat_after_the_first_move():
    mid = new_id()
    x, o = EnvRunner(GomokuMatchEnv()), EnvRunner(GomokuMatchEnv())
    await x.reset(match_id=mid, opening=[])
    x_step = asyncio.create_task(x.step(mv(4, 4)))
    await asyncio.sleep(0.01)  # X has moved and waits; O has not joined yet
    assert (await x.state())["agents"] == {"X": "pending"}
    o_first = await o.reset(match_id=mid)
    assert o_first.observation.metadata["stone"] == "O" and "placed X at (4,4)" in o_first.observation.text
    o_step = asyncio.create_task(o.step(mv(3, 3)))  # returns once X replies
    assert tuple((await x_step).info["opponent_move"]) == (3, 3)
    await x.close()
    assert (await o_step).info["end_reason"] == "opponent_disconnected"


async def test_an_opponent_that_never_joins_times_out():
    x = EnvRunner(GomokuMatchEnv(turn_timeout_s=0.2))
    await x.reset(match_id=new_id(), seat="X", opening=[])
    result = await x.step(mv(4, 4))
    assert result.truncated and result.info["end_reason"] == "opponent_timeout"


async def test_seats_aliases_and_pairing():
    mid = new_id()
    a, b, c = (EnvRunner(GomokuMatchEnv()) for _ in range(3))
    a_reset = asyncio.create_task(a.reset(match_id=mid, player="O", opening=[]))  # waits for X's first move
    await asyncio.sleep(0.01)
    b_first = await b.reset(match_id=mid)  # takes the free seat
    assert b_first.observation.metadata["stone"] == "X" and not a_reset.done()
    with pytest.raises(ActionValidationError, match="already taken"):
        await c.reset(match_id=mid, seat="X")
    with pytest.raises(ActionValidationError, match="seat"):
        await c.reset(match_id=new_id(), seat="Z")
    with pytest.raises(ActionValidationError, match="agree"):
        await c.reset(match_id=new_id(), seat="X", player="O")
    b_step = asyncio.create_task(b.step(mv(4, 4)))
    a_first = await a_reset
    assert a_first.observation.metadata["stone"] == "O" and "placed X at (4,4)" in a_first.observation.text
    await a.close()
    assert (await b_step).info["end_reason"] == "opponent_disconnected"
    # match_id="auto" pairs sessions with each other
    p, q = EnvRunner(GomokuMatchEnv()), EnvRunner(GomokuMatchEnv())
    await p.reset(match_id="auto", opening=[])
    q_reset = asyncio.create_task(q.reset(match_id="auto"))
    p_step = asyncio.create_task(p.step(mv(4, 4)))
    q_first = await q_reset
    assert (await q.state())["match_id"] == (await p.state())["match_id"]
    assert q_first.observation.metadata["stone"] == "O"
    await q.close()
    assert (await p_step).info["end_reason"] == "opponent_disconnected"


async def test_without_match_id_each_session_opens_its_own_match():
    a, b = EnvRunner(GomokuMatchEnv()), EnvRunner(GomokuMatchEnv())
    first_a, first_b = await a.reset(seed=3), await b.reset(seed=3)
    assert first_a.observation == first_b.observation  # same seed, same opening, both X to move
    ids = [(await a.state())["match_id"], (await b.state())["match_id"]]
    assert ids[0] != ids[1]
    # private: random ids another client cannot guess (they were match-1, match-2, ...)
    assert all(re.fullmatch(r"match-[0-9a-f]{16}", i) for i in ids)
    await a.close()
    await b.close()


async def test_joiner_board_size_must_match():
    mid = new_id()
    x, o = EnvRunner(GomokuMatchEnv()), EnvRunner(GomokuMatchEnv())
    await x.reset(match_id=mid, seat="X", board_size=7, opening=[])
    with pytest.raises(ActionValidationError, match="board_size=7"):
        await o.reset(match_id=mid, board_size=9)
    await x.close()


async def test_128_matches_256_sessions_concurrently():
    async def match(i):
        mid = f"load-{i}"
        x, o = EnvRunner(GomokuMatchEnv()), EnvRunner(GomokuMatchEnv())
        return await asyncio.gather(play_seat(x, mid, "X", [mv(0, c) for c in range(5)]),
                                    play_seat(o, mid, "O", [mv(8, c) for c in range(5)]))

    games = await asyncio.gather(*(match(i) for i in range(128)))
    assert all(xs[-1].info["end_reason"] == "win" and os[-1].info["end_reason"] == "loss" for (_, xs), (_, os) in games)
    assert not [m for m in REGISTRY._matches if m.startswith("load-")]
