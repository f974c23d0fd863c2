"""Draw a :class:`~.problems.Diagram` as a PNG with Pillow: shaded regions, points, segments, circles, angle and
length labels.

Coordinates are scaled to fit the canvas (y up, as in the problem), so the picture has the
proportions the statement describes.
"""

from __future__ import annotations

import io
import math
import threading
from collections import OrderedDict
from functools import lru_cache

from PIL import Image, ImageDraw, ImageFont

from env_servers.geometry_env.problems import Diagram, Point

INK, ACCENT, LABEL, SHADE = (20, 20, 20), (200, 40, 40), (30, 60, 170), (50, 50, 50)


@lru_cache(maxsize=4)
def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has no sized default font
        return ImageFont.load_default()


class _Canvas:
    def __init__(self, diagram: Diagram, size: int):
        xs = [p[0] for p in diagram.points.values()] + [diagram.points[c][0] + s * r for c, r in diagram.circles
                                                       for s in (-1, 1)]
        ys = [p[1] for p in diagram.points.values()] + [diagram.points[c][1] + s * r for c, r in diagram.circles
                                                       for s in (-1, 1)]
        self.margin = size * 0.12
        span = max(max(xs) - min(xs), max(ys) - min(ys), 1e-9)
        self.scale = (size - 2 * self.margin) / span
        self.x0, self.y0, self.size = min(xs), min(ys), size
        # centre the figure on the shorter axis
        self.dx = (size - 2 * self.margin - (max(xs) - min(xs)) * self.scale) / 2
        self.dy = (size - 2 * self.margin - (max(ys) - min(ys)) * self.scale) / 2

    def xy(self, p: Point) -> tuple[float, float]:
        return (self.margin + self.dx + (p[0] - self.x0) * self.scale,
                self.size - self.margin - self.dy - (p[1] - self.y0) * self.scale)


def _centroid(points: list[tuple[float, float]]) -> tuple[float, float]:
    return sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points)


def _away(p: tuple[float, float], centre: tuple[float, float], dist: float) -> tuple[float, float]:
    vx, vy = p[0] - centre[0], p[1] - centre[1]
    norm = math.hypot(vx, vy) or 1.0
    return p[0] + vx / norm * dist, p[1] + vy / norm * dist


def _text(draw: ImageDraw.ImageDraw, at: tuple[float, float], text: str, fill: tuple[int, int, int], size: int) -> None:
    draw.text(at, text, fill=fill, font=_font(size), anchor="mm")


def render_png(diagram: Diagram, size: int = 384) -> bytes:
    """The diagram as PNG bytes (``size`` x ``size`` pixels, white background)."""
    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    canvas = _Canvas(diagram, size)
    px = {name: canvas.xy(p) for name, p in diagram.points.items()}
    centre = _centroid(list(px.values()))
    font_size = max(12, size // 24)
    shaded = {region for region in diagram.regions if len(region) == 1}
    for region in diagram.regions:
        if len(region) >= 3:
            draw.polygon([px[name] for name in region], fill=SHADE)
    for name, radius in diagram.circles:
        cx, cy = px[name]
        r = radius * canvas.scale
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), outline=INK, width=2, fill=SHADE if (name,) in shaded else None)
    for p, q, label in diagram.segments:
        draw.line((px[p], px[q]), fill=INK, width=2)
        if label:
            mid = ((px[p][0] + px[q][0]) / 2, (px[p][1] + px[q][1]) / 2)
            _text(draw, _away(mid, centre, font_size * 0.9), label, LABEL, font_size)
    for p, v, q in diagram.right_angles:
        _right_angle_mark(draw, px[p], px[v], px[q], size / 30)
    for p, v, q, label in diagram.angles:
        _angle_mark(draw, px[p], px[v], px[q], size / 14, label, font_size)
    for name, (x, y) in px.items():
        draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=INK)
        _text(draw, _away((x, y), centre, font_size), name, INK, font_size)
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def _unit(frm: tuple[float, float], to: tuple[float, float]) -> tuple[float, float]:
    vx, vy = to[0] - frm[0], to[1] - frm[1]
    norm = math.hypot(vx, vy) or 1.0
    return vx / norm, vy / norm


def _angle_mark(draw: ImageDraw.ImageDraw, p: Point, v: Point, q: Point, radius: float, label: str,
                font_size: int) -> None:
    a1 = math.degrees(math.atan2(p[1] - v[1], p[0] - v[0]))
    a2 = math.degrees(math.atan2(q[1] - v[1], q[0] - v[0]))
    start, end = sorted((a1 % 360, a2 % 360))
    if end - start > 180:  # draw the inner (smaller) angle
        start, end = end, start + 360
    draw.arc((v[0] - radius, v[1] - radius, v[0] + radius, v[1] + radius), start, end, fill=ACCENT, width=2)
    if label:
        mid = math.radians((start + end) / 2)
        at = (v[0] + math.cos(mid) * radius * 1.7, v[1] + math.sin(mid) * radius * 1.7)
        _text(draw, at, label, ACCENT, font_size)


def _right_angle_mark(draw: ImageDraw.ImageDraw, p: Point, v: Point, q: Point, side: float) -> None:
    u, w = _unit(v, p), _unit(v, q)
    a = (v[0] + u[0] * side, v[1] + u[1] * side)
    b = (a[0] + w[0] * side, a[1] + w[1] * side)
    c = (v[0] + w[0] * side, v[1] + w[1] * side)
    draw.line((a, b, c), fill=ACCENT, width=2)


_CACHE: OrderedDict[tuple[str, int], bytes] = OrderedDict()
_CACHE_LOCK = threading.Lock()
CACHE_SIZE = 2048


def render_png_cached(key: str, diagram: Diagram, size: int = 384) -> bytes:
    """:func:`render_png`, remembered by ``key`` (a problem id): GRPO groups reset the same problem many times."""
    with _CACHE_LOCK:
        png = _CACHE.get((key, size))
        if png is not None:
            _CACHE.move_to_end((key, size))
            return png
    png = render_png(diagram, size)
    with _CACHE_LOCK:
        _CACHE[(key, size)] = png
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return png


__all__ = ["render_png", "render_png_cached"]
