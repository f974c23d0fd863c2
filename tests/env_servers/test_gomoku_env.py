"""GomokuEnv played through EnvRunner by scripted policies: results, rewards, every invalid path, images, seeds."""

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO

import pytest

from env_servers.gomoku_env import GomokuEnv
from env_servers.gomoku_env.board import Board, O, X
from env_servers.gomoku_env.opponents import HeuristicOpponent, RandomOpponent
from envhub import EnvRunner
from envhub.errors import ActionValidationError


def board_of(result, win_length=5) -> Board:
    rows = result.observation.metadata["board"]
    board = Board(len(rows), win_length)
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            if cell != ".":
                board.place(r, c, cell)
    return board


def strong_policy(result, rng, win_length=5):
    """The heuristic, playing X: a scripted policy that wins against random play."""
    r, c = HeuristicOpponent().choose(board_of(result, win_length), X, rng)
    return {"text": f"<thinking>threats first</thinking><move>{r},{c}</move>"}


def random_policy(result, rng):
    r, c = RandomOpponent().choose(board_of(result), X, rng)
    return {"tool_name": "place_stone", "arguments": {"row": r, "col": c}}


async def play(runner, policy, seed=0, max_steps=200, **reset):
    rng = random.Random(seed)
    result = await runner.reset(seed=seed, **reset)
    first, steps = result, []
    while not result.ended and len(steps) < max_steps:
        result = await runner.step(policy(result, rng))
        steps.append(result)
    return first, steps


async def test_first_observation_carries_rules_board_and_system_prompt():
    first = await EnvRunner(GomokuEnv()).reset(seed=5, opening=[])
    assert "Your turn (X)" in first.observation.text and "<move>row,col</move>" in first.observation.text
    assert " 0 1 2 3 4 5 6 7 8" in first.observation.text
    prompt = first.observation.metadata["system_prompt"]
    assert "9x9" in prompt and "five or more" in prompt and "place_stone" in prompt
    assert first.observation.metadata["board"] == ["." * 9] * 9


async def test_strong_policy_wins_against_random_opponent():
    runner = EnvRunner(GomokuEnv(opponent="random"))
    _, steps = await play(runner, strong_policy, seed=1)
    last = steps[-1]
    assert last.done and not last.truncated
    assert last.info["end_reason"] == "win" and last.reward == 10.0
    assert last.info["outcome"] == "win"  # envhub.types.Outcome, what trainers count
    assert last.info["episode_reward"] == 10.0  # every earlier valid move earned 0
    assert board_of(last).winner() == X
    assert "You win" in last.observation.text


async def test_random_policy_loses_against_heuristic():
    runner = EnvRunner(GomokuEnv(opponent="heuristic"))
    _, steps = await play(runner, random_policy, seed=2)
    last = steps[-1]
    assert last.done and last.info["end_reason"] == "loss" and last.reward == -10.0
    assert last.info["opponent_move"] is not None and "You lose" in last.observation.text
    assert all(s.reward == 0.0 for s in steps[:-1])


# 5x5, no five anywhere when full:      X X O O X / O O X X O / X X O O X / O O X X O / X X O O X
_DRAW_PATTERN = ["XXOOX", "OOXXO", "XXOOX", "OOXXO", "XXOOX"]


def draw_opening(leave):
    xs = [(r, c) for r in range(5) for c in range(5) if _DRAW_PATTERN[r][c] == X and (r, c) not in leave]
    os = [(r, c) for r in range(5) for c in range(5) if _DRAW_PATTERN[r][c] == O and (r, c) not in leave]
    return [list(m) for pair in zip(xs, os) for m in pair]


async def test_draw_on_a_small_board():
    runner = EnvRunner(GomokuEnv(board_size=5))
    # three empty cells: X moves, the opponent fills one of the last two, X fills the other
    first = await runner.reset(seed=0, opening=draw_opening({(0, 0), (4, 4), (3, 4)}))
    assert first.observation.text.count(".") >= 3
    step1 = await runner.step({"text": "<move>0,0</move>"})
    assert step1.info["event"] == "valid" and tuple(step1.info["opponent_move"]) in {(4, 4), (3, 4)}
    last_cell = ({(4, 4), (3, 4)} - {tuple(step1.info["opponent_move"])}).pop()
    step2 = await runner.step({"tool_name": "place_stone", "arguments": {"row": last_cell[0], "col": last_cell[1]}})
    assert step2.done and step2.info["end_reason"] == "draw" and step2.reward == 0.0
    assert "draw" in step2.observation.text


async def test_tic_tac_toe_with_brief_messages():
    runner = EnvRunner(GomokuEnv(board_size=3, win_length=3, opponent="random", opening_max_stones=0,
                                 brief_messages=True))
    first = await runner.reset(seed=3)
    assert first.observation.text == "   0 1 2\n 0 . . .\n 1 . . .\n 2 . . .\nX to move."
    assert "three or more" in first.observation.metadata["system_prompt"]
    bad = await runner.step({"text": "no move"})
    assert bad.observation.text.startswith("Invalid move (bad format), 1 of 10.\n") and bad.reward == -1.0
    wins = 0
    for seed in range(20):  # the heuristic takes its threes and blocks O's: it seldom loses to random play
        _, steps = await play(runner, lambda r, rng: strong_policy(r, rng, win_length=3), seed=seed,
                              opening=[])
        wins += steps[-1].info["outcome"] == "win"
        assert "Reply with" not in "".join(s.observation.text for s in steps)
        assert steps[-1].info["outcome"] != "win" or "three in a row" in steps[-1].observation.text
    assert wins >= 15


async def test_cell_move_format_numbers_the_board_and_takes_cell_numbers():
    runner = EnvRunner(GomokuEnv(board_size=3, win_length=3, opponent="random", opening_max_stones=0,
                                 brief_messages=True, move_format="cell"))
    first = await runner.reset(seed=3)
    assert first.observation.text == "1 2 3\n4 5 6\n7 8 9\nX to move."
    assert "<move>n</move>" in first.observation.metadata["system_prompt"]
    step = await runner.step({"text": "<move>5</move>"})
    assert step.info["event"] == "valid" and step.info["move"] == [1, 1]
    reply = step.info["opponent_move"]
    assert step.observation.text.splitlines()[1].split()[1] == "X"
    taken = f"<move>{reply[0] * 3 + reply[1] + 1}</move>"
    cases = [(taken, "occupied"), ("<move>5</move>", "occupied"), ("<move>10</move>", "out_of_bounds"),
             ("<move>1,1</move>", "bad_format")]
    for action, event in cases:
        result = await runner.step({"text": action})
        assert result.info["event"] == event and result.reward == -1.0, action
    tool = await runner.step({"tool_name": "place_stone", "arguments": {"row": 1, "col": 1}})
    assert tool.info["event"] == "occupied"  # tool calls keep coordinates


async def test_cell_move_format_full_messages_name_cells_by_number():
    runner = EnvRunner(GomokuEnv(board_size=3, win_length=3, opponent="random", opening_max_stones=0,
                                 move_format="cell"))
    await runner.reset(seed=1)
    step = await runner.step({"text": "<move>1</move>"})
    o = step.info["opponent_move"]
    cells = ["X" if i == 1 else "O" if i == o[0] * 3 + o[1] + 1 else str(i) for i in range(1, 10)]
    board = "\n".join(" ".join(cells[k:k + 3]) for k in (0, 3, 6))
    assert step.observation.text == (f"You placed X at 1. Opponent placed O at {o[0] * 3 + o[1] + 1}.\n\n{board}\n\n"
                                     "Your turn (X). Reply with your move as <move>n</move>, n the number of an "
                                     "empty cell.")
    bad = await runner.step({"text": "<move>1</move>"})
    assert "Cell 1 is OCCUPIED" in bad.observation.text


def test_move_format_is_validated():
    with pytest.raises(ValueError, match="move_format to be one of coords, cell"):
        GomokuEnv(move_format="numbers")


async def test_every_invalid_move_is_penalised_and_the_game_goes_on():
    runner = EnvRunner(GomokuEnv())
    await runner.reset(seed=0, opening=[[0, 0], [8, 8]])
    cases = [
        ({"text": "I think I'll play the centre"}, "bad_format"),
        ({"text": "<move>-1,3</move>"}, "bad_format"),
        ({"text": "<move>9,3</move>"}, "out_of_bounds"),
        ({"tool_name": "place_stone", "arguments": {"row": 3, "col": 99}}, "out_of_bounds"),
        ({"text": "<move>8,8</move>"}, "occupied"),
        ({"tool_name": "place_stone", "arguments": {"row": 0, "col": 0}}, "occupied"),
        ({"tool_name": "place_stone", "arguments": {"row": "x", "col": 0}}, "bad_format"),
        ({"tool_name": "place_stone", "arguments": {"row": 1}}, "bad_format"),
        ({"tool_name": "resign", "arguments": {}}, "bad_format"),
    ]
    for streak, (action, event) in enumerate(cases, start=1):
        result = await runner.step(action)
        assert (result.info["event"], result.reward, result.ended) == (event, -1.0, False), action
        assert result.info["invalid_streak"] == streak
        assert "ERROR" in result.observation.text and f"{streak} of 10" in result.observation.text
    assert (await runner.state())["board"][0][0] == X  # nothing changed on the board
    ok = await runner.step({"text": "<move>4,4</move>"})
    assert ok.info["event"] == "valid" and ok.info["invalid_streak"] == 0
    assert ok.info["episode_reward"] == -9.0


async def test_too_many_invalid_moves_end_the_game():
    runner = EnvRunner(GomokuEnv(max_invalid_moves=3, rewards={"too_many_invalid": -7.0}))
    await runner.reset(seed=0)
    results = [await runner.step({"text": "pass"}) for _ in range(3)]
    assert [r.reward for r in results] == [-1.0, -1.0, -7.0]
    assert results[-1].done and results[-1].info["end_reason"] == "too_many_invalid"
    with pytest.raises(Exception, match="ended"):
        await runner.step({"text": "<move>1,1</move>"})


async def test_step_limit_counts_valid_moves_only():
    runner = EnvRunner(GomokuEnv(max_moves=2, opponent="random"))
    await runner.reset(seed=0, opening=[])
    moves = [{"text": "<move>0,0</move>"}, {"text": "oops"}, {"text": "<move>0,0</move>"}]
    results = [await runner.step(m) for m in moves]
    assert not any(r.ended for r in results)  # one valid move and two invalid ones
    free = next((r, c) for r in range(9) for c in range(9) if board_of(results[-1]).is_empty(r, c))
    last = await runner.step({"text": f"<move>{free[0]},{free[1]}</move>"})
    assert last.truncated and not last.done
    assert last.info["end_reason"] == "step_limit" and last.reward == -20.0


async def test_default_limits_let_every_game_finish():
    runner = EnvRunner(GomokuEnv(board_size=5, opponent="random"))
    for seed in range(5):
        _, steps = await play(runner, random_policy, seed=seed, opening=[])
        assert steps[-1].done and steps[-1].info["end_reason"] in {"win", "loss", "draw"}


async def test_reset_options_and_validation():
    runner = EnvRunner(GomokuEnv())
    first = await runner.reset(seed=0, board_size=7, opponent="mix", opening=[])
    assert first.observation.metadata["board_size"] == 7
    for bad in ({"board_size": 30}, {"opponent": "alphazero"}, {"opening": [[0, 0]]}, {"opening": [[0, 0], [9, 9]]},
                {"opening": 5}, {"opening": [[0, 0], [1, 1, 1]]}):
        with pytest.raises(ActionValidationError, match="Expected|off the"):
            await runner.reset(seed=0, **bad)
    with pytest.raises(ValueError, match="Expected board_size"):
        GomokuEnv(board_size=2)
    with pytest.raises(ValueError, match="Expected win_length"):
        GomokuEnv(board_size=4)  # five in a row cannot fit: the fix is a shorter win_length
    with pytest.raises(ActionValidationError, match="Expected win_length"):
        await EnvRunner(GomokuEnv(board_size=5, win_length=5)).reset(seed=0, board_size=4)
    with pytest.raises(TypeError, match="board_size"):
        GomokuEnv(boardsize=9)
    for rewards in ({"win": float("nan")}, {"valid": "1"}, {"missed_win": True}):
        with pytest.raises(ValueError, match="Expected finite numeric rewards"):
            GomokuEnv(rewards=rewards)
    with pytest.raises(ValueError, match="Unknown reward name"):
        GomokuEnv(rewards={"missed_wins": -1.0})


async def test_png_render_on_request():
    from PIL import Image

    runner = EnvRunner(GomokuEnv())
    plain = await runner.reset(seed=0)
    assert plain.observation.images == []
    first = await runner.reset(seed=0, render_image=True)
    step = await runner.step({"text": "<move>4,4</move>"})
    for result in (first, step):
        (png,) = result.observation.images
        assert Image.open(BytesIO(png)).format == "PNG"
    wire = step.to_wire()["observation"]["images"][0]
    assert isinstance(wire, str)  # base64 on JSON frames
    always = EnvRunner(GomokuEnv(render_image=True))
    assert len((await always.reset(seed=0)).observation.images) == 1


async def test_a_seed_reproduces_a_game():
    async def history(seed):
        runner = EnvRunner(GomokuEnv(opponent="mix", opponent_random_prob=0.5))
        first, steps = await play(runner, random_policy, seed=seed)
        return first.observation.text, [s.observation.text for s in steps]

    assert await history(11) == await history(11)
    assert await history(11) != await history(12)
    assert await history(-11) == await history(-11) != await history(11)


async def test_a_split_draws_its_own_games_from_the_same_seeds():
    async def history(seed, split):
        runner = EnvRunner(GomokuEnv(opponent="random"))
        first, steps = await play(runner, random_policy, seed=seed, split=split)
        return first.observation.text, [s.observation.text for s in steps]

    assert await history(3, "validation") == await history(3, "validation")
    assert await history(3, "validation") != await history(3, "train") == await history(3, "train")
    with pytest.raises(ActionValidationError, match="split"):
        await EnvRunner(GomokuEnv()).reset(seed=0, split="test")


async def test_tool_schema():
    (spec,) = GomokuEnv.tools()
    assert spec.name == "place_stone" and spec.parameters["required"] == ["row", "col"]
    assert spec.parameters["properties"]["row"]["type"] == "integer"


async def test_256_concurrent_sessions_in_one_process():
    executor = ThreadPoolExecutor(8)
    # The cheap opponent and a move cap keep this about sessions, not about the heuristic's speed.
    runners = [EnvRunner(GomokuEnv(opponent="random", max_moves=8), executor=executor) for _ in range(256)]
    try:
        games = await asyncio.gather(*(play(r, random_policy, seed=i) for i, r in enumerate(runners)))
    finally:
        executor.shutdown()
    assert all(steps[-1].ended for _, steps in games)
    assert {steps[-1].info["end_reason"] for _, steps in games} <= {"win", "loss", "step_limit"}
    # sessions are independent: different seeds, different games
    assert len({tuple(steps[0].info["opponent_move"]) for _, steps in games}) > 20


async def test_each_step_reports_the_moves_tactics():
    # 3x3, three in a row: X at (0,0) and (0,1), O at (1,1) and (2,2); X to move, (0,2) completes the row
    opening = [[0, 0], [1, 1], [0, 1], [2, 2]]
    env = GomokuEnv(board_size=3, win_length=3, opponent="random", max_invalid_moves=3)
    runner = EnvRunner(env)
    await runner.reset(seed=0, opening=opening)
    missed = await runner.step({"text": "<move>2,0</move>"})  # legal, and not the win
    assert missed.info["stats"] == {"win_chances": 1, "wins_missed": 1, "block_chances": 0, "blocks_missed": 0}
    await runner.reset(seed=0, opening=opening)
    assert (await runner.step({"text": "<move>1,1</move>"})).info["stats"]["wins_missed"] == 1  # occupied: missed
    taken = await runner.step({"text": "<move>0,2</move>"})
    assert taken.info["end_reason"] == "win" and taken.info["stats"]["wins_missed"] == 0


async def test_missed_win_shaping_lands_on_the_legal_move_that_missed_and_is_named():
    opening = [[0, 0], [1, 1], [0, 1], [2, 2]]  # X to move, (0, 2) completes the top row
    env = GomokuEnv(board_size=3, win_length=3, opponent="random", max_invalid_moves=3,
                    rewards={"valid": 1.0, "missed_win": -5.0})
    runner = EnvRunner(env)
    await runner.reset(seed=0, opening=opening)
    missed = await runner.step({"text": "<move>2,0</move>"})  # legal, not the win; O cannot win in reply
    assert missed.reward == 1.0 - 5.0 and missed.info["rewards"] == {"missed_win": -5.0}
    await runner.reset(seed=0, opening=opening)
    occupied = await runner.step({"text": "<move>1,1</move>"})  # invalid: its own penalty, no shaping
    assert occupied.reward == -1.0 and "rewards" not in occupied.info
    taken = await runner.step({"text": "<move>0,2</move>"})
    assert taken.reward == 10.0 and "rewards" not in taken.info
    # off by default: the same miss earns the legal move's reward alone
    plain = EnvRunner(GomokuEnv(board_size=3, win_length=3, opponent="random", rewards={"valid": 1.0}))
    await plain.reset(seed=0, opening=opening)
    result = await plain.step({"text": "<move>2,0</move>"})
    assert result.reward == 1.0 and "rewards" not in result.info


def test_tactics_tell_a_block_from_a_miss_and_skip_boards_without_lines():
    from env_servers.gomoku_env.board import board_from_moves
    from env_servers.gomoku_env.game import tactics

    board = board_from_moves(3, [(0, 0), (1, 1), (2, 1), (0, 2)], win_length=3)  # X to move; O threatens (2,0)
    assert tactics(board, X, (2, 0)) == {"win_chances": 0, "wins_missed": 0, "block_chances": 1, "blocks_missed": 0}
    assert tactics(board, X, (1, 0))["blocks_missed"] == 1 and tactics(board, X, None)["blocks_missed"] == 1
    empty = Board(15, 5)
    assert tactics(empty, X, (7, 7)) == dict.fromkeys(("win_chances", "wins_missed", "block_chances",
                                                       "blocks_missed"), 0)
