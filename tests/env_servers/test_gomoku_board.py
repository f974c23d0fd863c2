"""Gomoku domain rules: board, move parsing, openings, and the scripted opponents."""

import random

import pytest

from env_servers.gomoku_env.board import (
    Board,
    O,
    OpeningConfig,
    X,
    board_from_moves,
    cell_number,
    coerce_move,
    parse_cell,
    parse_move,
    random_opening,
)
from env_servers.gomoku_env.opponents import HeuristicOpponent, MixOpponent, RandomOpponent, make_opponent
from env_servers.gomoku_env.render import render_png


def board_with(size, xs=(), os=(), win_length=5):
    board = Board(size, win_length)
    for cell in xs:
        board.place(*cell, X)
    for cell in os:
        board.place(*cell, O)
    return board


@pytest.mark.parametrize("cells", [
    [(2, c) for c in range(5)],                     # row
    [(r, 3) for r in range(1, 6)],                  # column
    [(k, k) for k in range(5)],                     # diagonal
    [(k, 6 - k) for k in range(2, 7)],              # anti-diagonal
])
def test_five_in_any_direction_wins(cells):
    board = board_with(7, xs=cells[:4])
    assert board.winner() is None
    board.place(*cells[4], X)
    assert board.winner() == X


def test_overline_wins_and_four_does_not():
    board = board_with(9, xs=[(0, 0), (0, 1), (0, 3), (0, 4), (0, 5)])
    assert board.winner() is None  # a gap: no five yet
    board.place(0, 2, X)  # six in a row: freestyle rules count it
    assert board.winner() == X


@pytest.mark.parametrize("size", [2, 20, 9.0, True])
def test_board_size_is_validated(size):
    with pytest.raises(ValueError, match="Expected board_size"):
        Board(size)


@pytest.mark.parametrize(("size", "win_length"), [(4, 5), (9, 2), (9, 4.0)])
def test_a_line_that_cannot_fit_or_is_too_short_is_refused(size, win_length):
    with pytest.raises(ValueError, match="Expected win_length"):
        Board(size, win_length)


def test_a_shorter_winning_line_wins_on_a_small_board_and_not_before():
    board = Board(3, win_length=3)
    for cell in [(0, 2), (1, 1)]:
        board.place(*cell, O)
    assert board.winner() is None and board.winning_cells(O) == [(2, 0)]
    board.place(2, 0, O)  # the anti-diagonal
    assert board.winner() == O
    four = Board(6, win_length=4)
    for c in range(3):
        four.place(5, c, X)
    assert four.winner() is None and four.makes_line(5, 3, X)


def test_the_heuristic_takes_and_blocks_a_short_line():
    board = board_with(3, xs=[(0, 0), (0, 1)], os=[(1, 1)], win_length=3)
    assert HeuristicOpponent().choose(board, O, random.Random(0)) == (0, 2)  # blocks X's three
    board = board_with(3, xs=[(0, 0), (0, 1), (2, 1)], os=[(1, 0), (1, 1)], win_length=3)
    assert HeuristicOpponent().choose(board, O, random.Random(0)) == (1, 2)  # its own three before the block


def test_render_numbers_rows_and_columns_on_big_boards():
    board = board_with(12, xs=[(11, 10)], os=[(0, 0)])
    lines = board.render().splitlines()
    assert lines[0].split() == [str(c) for c in range(12)]
    assert lines[1].split() == ["0", "O"] + ["."] * 11
    assert lines[12].split()[0] == "11" and lines[12].split()[11] == "X"
    assert lines[0].rindex("10") + 1 == lines[12].index("X")  # column numbers sit above their cells
    small = board_with(5, xs=[(0, 4)]).render().splitlines()
    assert small[0].index("4") == small[1].index("X")


@pytest.mark.parametrize("text,expected", [
    ("<move>3,4</move>", (3, 4)),
    ("<MOVE> 3 ,  4 </MOVE>", (3, 4)),
    ("<move>(3, 4)</move>", (3, 4)),
    ("<thinking>maybe <move>0,0</move></thinking> final <move>5,6</move>", (5, 6)),  # the LAST tag counts
    ("<move>0,0</move> then <move>a,b</move>", None),  # the last tag is garbage
    ("<move>-1,2</move>", None),
    ("<move>3</move>", None),
    ("<move>3,4,5</move>", None),
    ("3,4", None),
    ("", None),
    (None, None),
])
def test_parse_move(text, expected):
    assert parse_move(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("<move>5</move>", (1, 1)),
    ("<MOVE> 9 </MOVE>", (2, 2)),
    ("1", (0, 0)),  # a reply that is only the number
    ("<move>2</move> no wait <move>7</move>", (2, 0)),  # the LAST tag counts
    ("<move>0</move>", (-1, 0)),  # numbers off the board are out of bounds, not malformed
    ("<move>10</move>", (3, 0)),
    ("<move>1,1</move>", None),
    ("<move>-3</move>", None),
    ("<move>five</move>", None),
    ("5 please", None),
    ("", None),
    (None, None),
])
def test_parse_cell(text, expected):
    assert parse_cell(text, 3) == expected


def test_render_cells_numbers_the_empty_cells_and_parse_cell_reads_them_back():
    board = board_with(3, xs=[(0, 2)], os=[(1, 1)], win_length=3)
    assert board.render_cells() == "1 2 X\n4 O 6\n7 8 9"
    big = board_with(4, xs=[(3, 3)], win_length=3)
    assert big.render_cells().splitlines() == [" 1  2  3  4", " 5  6  7  8", " 9 10 11 12", "13 14 15  X"]
    for r, c in big.empty_cells():  # every number printed on the board is that cell's move
        assert parse_cell(f"<move>{cell_number((r, c), 4)}</move>", 4) == (r, c)
        assert str(cell_number((r, c), 4)) in big.render_cells().split()


def test_coerce_move_accepts_ints_and_digit_strings_only():
    assert coerce_move(2, "3") == (2, 3)
    assert coerce_move(-1, 0) == (-1, 0)  # in-range checks happen later: out of bounds
    assert coerce_move(True, 1) is None and coerce_move(1.5, 2) is None and coerce_move("a", 1) is None


def test_random_openings_are_legal_positions():
    sizes = [5, 6, 9, 15]
    empty = 0
    for seed in range(400):
        size = sizes[seed % len(sizes)]
        moves = random_opening(random.Random(seed), size, OpeningConfig(max_stones=8, empty_prob=0.2))
        board = board_from_moves(size, moves)  # raises on illegal positions
        assert board.count(X) == board.count(O), "X must be to move: equal stone counts"
        assert board.winner() is None
        assert not board.winning_cells(X) and not board.winning_cells(O), "nobody starts one move from five"
        empty += not moves
    assert 40 <= empty <= 130  # about 20% empty boards


def test_board_from_moves_rejects_illegal_openings():
    with pytest.raises(ValueError, match="even number"):
        board_from_moves(9, [(0, 0)])
    with pytest.raises(ValueError, match="occupied"):
        board_from_moves(9, [(0, 0), (0, 0)])
    five = [m for k in range(5) for m in ((0, k), (5, k))][:9] + [(8, 8)]
    with pytest.raises(ValueError, match="five in a row"):
        board_from_moves(9, five)


# -- opponents --------------------------------------------------------------------------------
def test_heuristic_blocks_an_open_three_at_its_ends():
    board = board_with(9, xs=[(4, 3), (4, 4), (4, 5)], os=[(0, 0), (8, 8), (0, 8)])
    for seed in range(10):
        assert HeuristicOpponent().choose(board, O, random.Random(seed)) in {(4, 2), (4, 6)}


def test_heuristic_blocks_a_broken_three_in_its_gap():
    board = board_with(9, xs=[(2, 2), (3, 3), (5, 5)], os=[(0, 8), (8, 0), (8, 7)])
    assert HeuristicOpponent().choose(board, O, random.Random(0)) == (4, 4)


def test_heuristic_blocks_open_and_closed_fours():
    open_four = board_with(9, xs=[(4, 2), (4, 3), (4, 4), (4, 5)], os=[(0, 0), (8, 8), (0, 8), (8, 0)])
    assert HeuristicOpponent().choose(open_four, O, random.Random(0)) in {(4, 1), (4, 6)}
    broken_four = board_with(9, xs=[(1, 1), (2, 2), (4, 4), (5, 5)], os=[(0, 0), (8, 0), (0, 8), (7, 1)])
    assert HeuristicOpponent().choose(broken_four, O, random.Random(0)) == (3, 3)


def test_heuristic_extends_its_own_line_when_nothing_is_threatened():
    board = board_with(9, xs=[(0, 0), (8, 8)], os=[(4, 3), (4, 4)])
    assert HeuristicOpponent().choose(board, O, random.Random(0)) in {(4, 2), (4, 5)}


def test_heuristic_makes_an_open_four_over_blocking_a_three():
    # O can make an open four (a forced win); X's open three can wait.
    board = board_with(11, xs=[(8, 3), (8, 4), (8, 5), (0, 0)], os=[(3, 3), (3, 4), (3, 5), (10, 10)])
    assert HeuristicOpponent().choose(board, O, random.Random(0)) in {(3, 2), (3, 6)}


def test_heuristic_never_misses_a_win_and_always_blocks_a_five():
    rng = random.Random(123)
    checked_wins = checked_blocks = 0
    for _ in range(160):
        board = Board(9)
        for i in range(rng.randint(8, 30)):
            cell = rng.choice(board.empty_cells())
            stone = X if i % 2 == 0 else O
            if board.makes_line(*cell, stone):
                continue
            board.place(*cell, stone)
        if board.winner():
            continue
        move = HeuristicOpponent().choose(board, O, rng)
        if board.winning_cells(O):
            checked_wins += 1
            assert board.makes_line(*move, O), "the heuristic missed a win"
        elif board.winning_cells(X):
            checked_blocks += 1
            assert move in board.winning_cells(X), "the heuristic let X complete five"
    assert checked_wins >= 10 and checked_blocks >= 10


def test_heuristic_beats_random_play():
    wins = 0
    for seed in range(20):
        rng, board, stone = random.Random(seed), Board(9), X
        players = {X: RandomOpponent(), O: HeuristicOpponent()}
        while board.winner() is None and not board.is_full():
            board.place(*players[stone].choose(board, stone, rng), stone)
            stone = O if stone == X else X
        wins += board.winner() == O
    assert wins == 20


def test_mix_opponent_is_seeded_and_mixes():
    board = board_with(9, xs=[(4, 3), (4, 4), (4, 5)], os=[(0, 0), (8, 8), (0, 8)])
    picks = [MixOpponent(0.5).choose(board, O, random.Random(s)) for s in range(40)]
    assert picks == [MixOpponent(0.5).choose(board, O, random.Random(s)) for s in range(40)]
    blocks = sum(p in {(4, 2), (4, 6)} for p in picks)
    assert 10 < blocks < 40  # some heuristic blocks, some random moves
    with pytest.raises(ValueError, match="Expected opponent"):
        make_opponent("minimax")


def test_png_render_is_a_png_of_the_board_size():
    from io import BytesIO

    from PIL import Image

    png = render_png(board_with(9, xs=[(4, 4)], os=[(3, 3)]), cell_px=20)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    image = Image.open(BytesIO(png))
    assert image.size[0] == image.size[1] > 9 * 20
    # the X stone is dark, an empty cell is not
    def pixel(r, c):
        return sum(image.getpixel((28 + c * 20 + 10, 28 + r * 20 + 10)))

    assert pixel(4, 4) < 150 < pixel(0, 0) and pixel(3, 3) > 600  # X dark, O light, empty board colour


def test_a_greedy_line_builder_cannot_exploit_the_heuristic():
    # Extending the longest own line every move beats an opponent that never blocks threes and fours.
    from env_servers.gomoku_env.board import DIRECTIONS

    def longest_line_move(board, rng):
        scored = [(max(board.run_length(r, c, X, dr, dc) for dr, dc in DIRECTIONS), (r, c))
                  for r, c in board.empty_cells()]
        best = max(s for s, _ in scored)
        return rng.choice([cell for s, cell in scored if s == best])

    for seed in range(8):
        rng, board, stone = random.Random(seed), Board(9), X
        while board.winner() is None and not board.is_full():
            move = longest_line_move(board, rng) if stone == X else HeuristicOpponent().choose(board, O, rng)
            board.place(*move, stone)
            stone = O if stone == X else X
        assert board.winner() != X, f"seed {seed}: the greedy builder won"


def test_moves_with_huge_or_non_ascii_numbers_are_malformed_not_a_crash() -> None:
    from env_servers.gomoku_env.board import coerce_move, parse_cell, parse_move

    huge = "9" * 5000  # int() of it raises past Python's 4300-digit limit
    assert parse_move(f"<move>{huge},1</move>") is None and parse_cell(f"<move>{huge}</move>", 9) is None
    assert coerce_move(huge, "1") is None
    assert parse_move("<move>\u0661,\u0662</move>") is None  # Arabic-Indic digits are not a move
    assert parse_move("<move>123456789,1</move>") == (123456789, 1)  # nine digits: off the board, not malformed
