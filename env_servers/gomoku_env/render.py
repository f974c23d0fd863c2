"""Gomoku board as a PNG image (Pillow): a grid with row/column numbers, X black, O white, last move ringed.

Pure domain code, no envhub imports. The text rendering lives on ``Board.render``.
"""

from __future__ import annotations

import io

from env_servers.gomoku_env.board import EMPTY, Board, X

CELL_PX = 32
MARGIN_PX = 28
_BACKGROUND = (222, 184, 135)
_GRID = (60, 40, 20)
_LAST = (220, 30, 30)


def render_png(board: Board, cell_px: int = CELL_PX) -> bytes:
    """The board as PNG bytes; each cell is a square with its stone centred in it."""
    from PIL import Image, ImageDraw, ImageFont  # Pillow is an env dependency, loaded only when images are asked for

    side = 2 * MARGIN_PX + board.size * cell_px
    image = Image.new("RGB", (side, side), _BACKGROUND)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    for k in range(board.size + 1):
        pos = MARGIN_PX + k * cell_px
        draw.line([(MARGIN_PX, pos), (side - MARGIN_PX, pos)], fill=_GRID, width=1)
        draw.line([(pos, MARGIN_PX), (pos, side - MARGIN_PX)], fill=_GRID, width=1)
    for k in range(board.size):
        centre = MARGIN_PX + k * cell_px + cell_px // 2
        draw.text((centre, MARGIN_PX // 2), str(k), fill=_GRID, font=font, anchor="mm")
        draw.text((MARGIN_PX // 2, centre), str(k), fill=_GRID, font=font, anchor="mm")
    last = board.moves[-1][:2] if board.moves else None
    pad = max(2, cell_px // 8)
    for r in range(board.size):
        for c in range(board.size):
            stone = board.cells[r][c]
            if stone == EMPTY:
                continue
            x0, y0 = MARGIN_PX + c * cell_px + pad, MARGIN_PX + r * cell_px + pad
            box = [x0, y0, x0 + cell_px - 2 * pad, y0 + cell_px - 2 * pad]
            fill, outline = ((20, 20, 20), (0, 0, 0)) if stone == X else ((245, 245, 245), (0, 0, 0))
            draw.ellipse(box, fill=fill, outline=_LAST if (r, c) == last else outline,
                         width=3 if (r, c) == last else 1)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
