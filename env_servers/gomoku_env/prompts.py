"""The words the model reads: the system prompt, the first message, and the message after each move.

Pure functions of the board and the event; the same texts serve the single-agent env (the model
is always X) and two-agent matches (the model is X or O). ``brief=True`` (``GomokuConfig.brief_messages``)
leaves out everything but the event, the board and whose turn it is: the rules stay in the system prompt.
``cells=True`` (``GomokuConfig.move_format = "cell"``) shows every empty cell as its number and asks for
``<move>n</move>``; moves in the texts are named by that number too.
"""

from __future__ import annotations

from env_servers.gomoku_env.board import Board, Move, cell_number, line_name, other

_REPLY_HINT = "Reply with your move as <move>row,col</move>."
_CELL_HINT = "Reply with your move as <move>n</move>, n the number of an empty cell."

_EVENT_ERRORS = {
    "bad_format": "Invalid move format. Expected <move>row,col</move> with two non-negative integers "
                  "(or a place_stone(row, col) call).",
    "out_of_bounds": "Position {move} is OUT OF BOUNDS: rows and columns go from 0 to {last}.",
    "occupied": "Position {move} is OCCUPIED.",
}


def system_prompt(size: int, stone: str = "X", first: bool = True, win_length: int = 5, cells: bool = False) -> str:
    """The rules and the answer format, for ``Observation.metadata["system_prompt"]``."""
    order = "You move first." if first else "Your opponent moves first."
    n = line_name(win_length)
    if cells:
        return (
            f"You are playing Gomoku ({n.capitalize()} in a Row) on a {size}x{size} board. You play {stone}; your "
            f"opponent plays {other(stone)}. {order} Players take turns placing one stone on an empty cell; "
            f"the first to get {n} or more stones in a row (horizontally, vertically or diagonally) wins. "
            f"A full board with no {n} in a row is a draw. Every empty cell is shown as its number, from 1 "
            f"(top left) to {size * size} (bottom right), row by row.\n"
            "Give exactly one move as <move>n</move>, n the number of an empty cell, for example "
            f"<move>{(size * size + 1) // 2}</move>. Only the last <move> tag counts. An invalid move (bad format, "
            "off the board, or an occupied cell) costs a penalty and you must move again; too many invalid "
            "moves in a row lose the game."
        )
    return (
        f"You are playing Gomoku ({n.capitalize()} in a Row) on a {size}x{size} board. You play {stone}; your "
        f"opponent plays {other(stone)}. {order} Players take turns placing one stone on an empty cell; "
        f"the first to get {n} or more stones in a row (horizontally, vertically or diagonally) wins. "
        f"A full board with no {n} in a row is a draw. Rows and columns are numbered from 0 (top left) to "
        f"{size - 1}. Empty cells are shown as '.'.\n"
        "First think about the position inside <thinking></thinking>, then give exactly one move as "
        "<move>row,col</move>, for example: <thinking>I take the centre.</thinking>"
        f"<move>{size // 2},{size // 2}</move>. Only the last <move> tag counts. "
        "You may instead call the place_stone(row, col) tool. An invalid move (bad format, off the "
        "board, or an occupied cell) costs a penalty and you must move again; too many invalid moves in "
        "a row lose the game."
    )


def first_message(board: Board, stone: str = "X", last_move: Move | None = None, brief: bool = False,
                  cells: bool = False) -> str:
    """The first observation: the rules in short, the board, and whose turn it is."""
    if brief:
        return _brief(board, stone, cells=cells)
    intro = (f"Game starts. You play {stone} on a {board.size}x{board.size} board; "
             f"{line_name(board.win_length)} or more in a row wins.")
    if last_move is not None:
        intro += f" Your opponent placed {other(stone)} at {_fmt(last_move, board, cells)}."
    elif board.moves:
        intro += " The game starts from this opening position."
    return f"{intro}\n\n{_text(board, cells)}\n\nYour turn ({stone}). {_hint(cells)}"


def invalid_message(event: str, board: Board, move: Move | None, stone: str, streak: int, limit: int,
                    brief: bool = False, cells: bool = False) -> str:
    """After an invalid move: what was wrong, how many invalid moves in a row so far, the board."""
    if brief:
        return _brief(board, stone, f"Invalid move ({event.replace('_', ' ')}), {streak} of {limit}.", cells=cells)
    if cells:
        error = {"bad_format": f"Invalid move format. Expected <move>n</move>, n a number from 1 to {board.size ** 2}.",
                 "out_of_bounds": f"There is no cell with that number: cells go from 1 to {board.size ** 2}.",
                 "occupied": f"Cell {_fmt(move, board, cells)} is OCCUPIED."}[event]
    else:
        error = _EVENT_ERRORS[event].format(move=_fmt(move) if move else "", last=board.size - 1)
    return (f"ERROR: {error} Invalid moves in a row: {streak} of {limit} allowed.\n\n{_text(board, cells)}\n\n"
            f"Your turn ({stone}). {_hint(cells)}")


def move_message(board: Board, stone: str, move: Move, reply: Move | None, brief: bool = False,
                 cells: bool = False) -> str:
    """After a valid move when the game goes on: both moves, the board, the next turn."""
    if brief:
        return _brief(board, stone, cells=cells)
    text = f"You placed {stone} at {_fmt(move, board, cells)}."
    if reply is not None:
        text += f" Opponent placed {other(stone)} at {_fmt(reply, board, cells)}."
    return f"{text}\n\n{_text(board, cells)}\n\nYour turn ({stone}). {_hint(cells)}"


def end_message(reason: str, board: Board, stone: str, move: Move | None = None,
                reply: Move | None = None, detail: str = "", cells: bool = False) -> str:
    """When the game ends for this player, for any reason."""
    lines = []
    if move is not None and reason not in ("too_many_invalid",):
        lines.append(f"You placed {stone} at {_fmt(move, board, cells)}.")
    if reply is not None:
        lines.append(f"Opponent placed {other(stone)} at {_fmt(reply, board, cells)}.")
    n = line_name(board.win_length)
    lines.append({
        "win": f"You made {n} in a row. You win!",
        "loss": f"Your opponent made {n} in a row. You lose.",
        "draw": f"The board is full with no {n} in a row: the game is a draw.",
        "too_many_invalid": "Too many invalid moves in a row. Game over: you lose.",
        "step_limit": "The move limit is reached. The game is stopped without a winner.",
        "opponent_forfeit": "Your opponent made too many invalid moves in a row and forfeits. You win!",
        "opponent_disconnected": "Your opponent disconnected. The match is over (no result).",
        "opponent_timeout": "Your opponent did not move in time. The match is over (no result).",
        "turn_timeout": "You did not move in time. The match is over (no result).",
    }.get(reason, f"The game is over ({reason})."))
    if detail:
        lines.append(detail)
    return " ".join(lines) + f"\n\n{_text(board, cells)}"


def _brief(board: Board, stone: str, event: str = "", cells: bool = False) -> str:
    text = f"{_text(board, cells)}\n{stone} to move."
    return f"{event}\n{text}" if event else text


def _text(board: Board, cells: bool) -> str:
    return board.render_cells() if cells else board.render()


def _hint(cells: bool) -> str:
    return _CELL_HINT if cells else _REPLY_HINT


def _fmt(move: Move | None, board: Board | None = None, cells: bool = False) -> str:
    if move is not None and cells and board is not None:
        return str(cell_number(move, board.size))
    return f"({move[0]},{move[1]})" if move else "(?)"
