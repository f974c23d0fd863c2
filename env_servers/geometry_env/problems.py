"""Geometry problems with exact answers and a diagram description: pure, seedable, split by statement hash.

Kinds (``kind=``) and their level (``difficulty=`` picks among the kinds of that level):

==================== == ======================================================================
triangle_angle        1 two angles of a triangle given, find the third
polygon               1 regular polygons: interior/exterior angle, angle sum, diagonals
inscribed_angle       1 inscribed angle from the central angle (or the reverse)
right_triangle        2 Pythagoras: hypotenuse or a leg
similar_triangles     2 a side of a similar triangle from the ratio
circle_arc            2 arc length or sector area (answers in terms of pi)
chord_tangent         2 chord length from the distance to the centre; tangent length
law_of_cosines        3 third side from two sides and the included angle (60, 90 or 120 degrees)
law_of_sines          3 a side from one side and two special angles
triangle_area         3 Heron's formula for integer sides
==================== == ======================================================================

Answers are LaTeX strings built from exact sympy values (``\\sqrt{39}``, ``\\frac{10 \\pi}{3}``).
The :class:`Diagram` holds real coordinates so that :mod:`.render` draws what the text says.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from env_servers.datasets import SPLITS, split_of
from env_servers.math_grading.expressions import sympy_module

Point = tuple[float, float]


@dataclass
class Diagram:
    """What to draw: labelled points, segments (with optional length labels), circles, angle marks."""

    points: dict[str, Point] = field(default_factory=dict)
    segments: list[tuple[str, str, str]] = field(default_factory=list)  # (P, Q, label or "")
    circles: list[tuple[str, float]] = field(default_factory=list)  # (centre point, radius)
    angles: list[tuple[str, str, str, str]] = field(default_factory=list)  # (P, vertex, Q, label)
    right_angles: list[tuple[str, str, str]] = field(default_factory=list)  # (P, vertex, Q)
    # shaded interiors: a polygon's point names in order, or a 1-tuple naming a circle's centre
    regions: list[tuple[str, ...]] = field(default_factory=list)


@dataclass(frozen=True)
class GeometryProblem:
    """One problem: statement, exact answer (LaTeX), where it belongs, and its figure."""

    problem_id: str
    statement: str
    answer: str
    kind: str
    difficulty: int | None
    split: str
    diagram: Diagram | None = field(default=None, compare=False)
    image_png: bytes | None = field(default=None, compare=False, repr=False)
    choices: tuple[str, ...] = ()  # a multiple-choice problem's answers (graded on the reply's first word)


def _deg(x: float) -> float:
    return math.radians(x)


def _triangle_from_sides(a: float, b: float, c: float) -> dict[str, Point]:
    """A, B, C with BC = a, CA = b, AB = c; B at the origin, C on the x axis."""
    x = (a * a + c * c - b * b) / (2 * a)
    return {"A": (x, math.sqrt(max(c * c - x * x, 0.0))), "B": (0.0, 0.0), "C": (a, 0.0)}


def _triangle_from_angles(angle_a: float, angle_b: float) -> dict[str, Point]:
    angle_c = 180 - angle_a - angle_b
    a = 1.0
    return _triangle_from_sides(a, a * math.sin(_deg(angle_b)) / math.sin(_deg(angle_a)),
                                a * math.sin(_deg(angle_c)) / math.sin(_deg(angle_a)))


def _triangle(points: dict[str, Point], sides: tuple[str, str, str] = ("", "", "")) -> Diagram:
    """Triangle ABC with labels on BC, CA, AB."""
    return Diagram(points=points, segments=[("B", "C", sides[0]), ("C", "A", sides[1]), ("A", "B", sides[2])])


def _latex(value: Any) -> str:
    latex: str = sympy_module().latex(value)
    return latex


def _plain(value: Any) -> str:
    """A short label for the figure: ``2*sqrt(5)`` -> ``2√5``, ``15/2`` stays."""
    return str(value).replace("sqrt", "√").replace("*", "").replace("(", "").replace(")", "")


# -- families: (rng) -> (statement, answer, diagram) ------------------------------------------

def _triangle_angle(rng: random.Random) -> tuple[str, str, Diagram]:
    a = rng.randint(25, 100)
    b = rng.randint(20, 150 - a)
    d = _triangle(_triangle_from_angles(a, b))
    d.angles = [("B", "A", "C", f"{a}°"), ("A", "B", "C", f"{b}°"), ("A", "C", "B", "?")]
    return (f"In triangle ABC, angle A measures {a} degrees and angle B measures {b} degrees. "
            "Find the measure of angle C in degrees.", str(180 - a - b), d)


def _polygon(rng: random.Random) -> tuple[str, str, Diagram]:
    sp = sympy_module()
    n = rng.randint(5, 12)
    names = {5: "pentagon", 6: "hexagon", 7: "heptagon", 8: "octagon", 9: "nonagon", 10: "decagon",
             11: "hendecagon", 12: "dodecagon"}
    question, value = rng.choice([
        ("the measure of each interior angle, in degrees", sp.Rational(180 * (n - 2), n)),
        ("the measure of each exterior angle, in degrees", sp.Rational(360, n)),
        ("the sum of its interior angles, in degrees", sp.Integer(180 * (n - 2))),
        ("the number of its diagonals", sp.Integer(n * (n - 3) // 2)),
    ])
    labels = [chr(65 + i) for i in range(n)]
    points = {p: (math.cos(2 * math.pi * i / n + math.pi / 2), math.sin(2 * math.pi * i / n + math.pi / 2))
              for i, p in enumerate(labels)}
    segments = [(labels[i], labels[(i + 1) % n], "") for i in range(n)]
    return f"A regular {names[n]} has {n} sides. Find {question}.", _latex(value), Diagram(points, segments)


def _circle_points(angles_deg: dict[str, float], r: float = 1.0) -> dict[str, Point]:
    return {k: (r * math.cos(_deg(t)), r * math.sin(_deg(t))) for k, t in angles_deg.items()}


def _inscribed_angle(rng: random.Random) -> tuple[str, str, Diagram]:
    central = 2 * rng.randint(15, 85)
    points = {"O": (0.0, 0.0), **_circle_points({"A": 200 - central / 2, "B": 200 + central / 2, "C": 20})}
    d = Diagram(points, segments=[("O", "A", ""), ("O", "B", ""), ("C", "A", ""), ("C", "B", "")],
                circles=[("O", 1.0)])
    if rng.random() < 0.5:
        d.angles = [("A", "O", "B", f"{central}°"), ("A", "C", "B", "?")]
        return (f"Points A, B and C lie on a circle with centre O. The central angle AOB measures {central} "
                "degrees and C lies on the major arc. Find the inscribed angle ACB in degrees.", str(central // 2), d)
    d.angles = [("A", "O", "B", "?"), ("A", "C", "B", f"{central // 2}°")]
    return (f"Points A, B and C lie on a circle with centre O, and C lies on the major arc AB. The inscribed "
            f"angle ACB measures {central // 2} degrees. Find the central angle AOB in degrees.", str(central), d)


def _right_triangle(rng: random.Random) -> tuple[str, str, Diagram]:
    sp = sympy_module()
    a, b = rng.randint(2, 15), rng.randint(2, 15)
    c = sp.sqrt(a * a + b * b)
    points = {"A": (0.0, float(b)), "B": (0.0, 0.0), "C": (float(a), 0.0)}
    if rng.random() < 0.5:
        d = _triangle(points, (str(a), "?", str(b)))
        d.right_angles = [("A", "B", "C")]
        return (f"Triangle ABC has a right angle at B, with AB = {b} and BC = {a}. Find the length of AC.",
                _latex(c), d)
    d = _triangle(points, (str(a), _plain(c), "?"))
    d.right_angles = [("A", "B", "C")]
    return (f"Triangle ABC has a right angle at B, with hypotenuse AC = ${_latex(c)}$ and BC = {a}. "
            "Find the length of AB.", str(b), d)


def _similar_triangles(rng: random.Random) -> tuple[str, str, Diagram]:
    sp = sympy_module()
    ab, bc, ratio = rng.randint(3, 12), rng.randint(3, 12), sp.Rational(rng.randint(2, 7), rng.randint(2, 5))
    if ratio == 1:
        ratio = sp.Rational(3, 2)
    de = ab * ratio
    ca = rng.randint(max(abs(ab - bc) + 1, 2), ab + bc - 1)
    left = _triangle_from_sides(bc, ca, ab)
    scale = float(ratio)
    shift = bc * 1.3 + 1
    right = {"D": (left["A"][0] * scale + shift, left["A"][1] * scale), "E": (shift, 0.0),
             "F": (bc * scale + shift, 0.0)}
    d = Diagram({**left, **right}, segments=[("B", "C", str(bc)), ("C", "A", ""), ("A", "B", str(ab)),
                                              ("E", "F", "?"), ("F", "D", ""), ("D", "E", _plain(de))])
    return (f"Triangle ABC is similar to triangle DEF, with A corresponding to D, B to E and C to F. "
            f"AB = {ab}, BC = {bc} and DE = ${_latex(de)}$. Find EF.", _latex(bc * ratio), d)


def _circle_arc(rng: random.Random) -> tuple[str, str, Diagram]:
    sp = sympy_module()
    r, theta = rng.randint(2, 12), rng.choice([30, 40, 45, 60, 72, 90, 120, 135, 150])
    d = Diagram({"O": (0.0, 0.0), **_circle_points({"A": 0, "B": theta}, r)},
                segments=[("O", "A", str(r)), ("O", "B", "")], circles=[("O", float(r))],
                angles=[("A", "O", "B", f"{theta}°")])
    if rng.random() < 0.5:
        value = sp.Rational(theta, 180) * sp.pi * r
        return (f"A circle with centre O has radius {r}. The central angle AOB measures {theta} degrees. "
                "Find the length of arc AB (the arc inside the angle). Give an exact answer in terms of pi.",
                _latex(value), d)
    value = sp.Rational(theta, 360) * sp.pi * r * r
    return (f"A circle with centre O has radius {r}. Find the area of the sector AOB whose central angle "
            f"measures {theta} degrees. Give an exact answer in terms of pi.", _latex(value), d)


def _chord_tangent(rng: random.Random) -> tuple[str, str, Diagram]:
    sp = sympy_module()
    r = rng.randint(3, 13)
    if rng.random() < 0.5:
        dist = rng.randint(1, r - 1)
        half = math.sqrt(r * r - dist * dist)
        d = Diagram({"O": (0.0, 0.0), "M": (0.0, -float(dist)), "A": (-half, -float(dist)), "B": (half, -float(dist))},
                    segments=[("A", "B", ""), ("O", "M", str(dist)), ("O", "B", str(r))], circles=[("O", float(r))],
                    right_angles=[("O", "M", "B")])
        return (f"A circle with centre O has radius {r}. Chord AB is at distance {dist} from O (M is the foot of "
                "the perpendicular from O). Find the length of AB.", _latex(2 * sp.sqrt(r * r - dist * dist)), d)
    dist = rng.randint(r + 1, r + 12)
    angle = math.acos(r / dist)
    d = Diagram({"O": (0.0, 0.0), "P": (float(dist), 0.0), "T": (r * math.cos(angle), r * math.sin(angle))},
                segments=[("O", "P", str(dist)), ("O", "T", str(r)), ("P", "T", "?")], circles=[("O", float(r))],
                right_angles=[("O", "T", "P")])
    return (f"A circle with centre O has radius {r}. Point P is at distance {dist} from O, and PT is tangent to "
            "the circle at T. Find the length of PT.", _latex(sp.sqrt(dist * dist - r * r)), d)


def _law_of_cosines(rng: random.Random) -> tuple[str, str, Diagram]:
    sp = sympy_module()
    b, c, angle = rng.randint(2, 12), rng.randint(2, 12), rng.choice([60, 90, 120])
    cos = {60: sp.Rational(1, 2), 90: 0, 120: sp.Rational(-1, 2)}[angle]
    a = sp.sqrt(b * b + c * c - 2 * b * c * cos)
    d = _triangle(_triangle_from_sides(float(a), b, c), ("?", str(b), str(c)))
    d.angles = [("B", "A", "C", f"{angle}°")]
    return (f"In triangle ABC, AB = {c}, AC = {b} and angle A measures {angle} degrees. Find the length of BC.",
            _latex(a), d)


def _law_of_sines(rng: random.Random) -> tuple[str, str, Diagram]:
    sp = sympy_module()
    special = [30, 45, 60, 90, 120, 135]
    angle_a = rng.choice(special)
    angle_b = rng.choice([t for t in special if t + angle_a < 180 and t != angle_a])
    a = rng.randint(2, 12)
    b = sp.radsimp(a * sp.sin(sp.pi * angle_b / 180) / sp.sin(sp.pi * angle_a / 180))
    angle_c = 180 - angle_a - angle_b
    points = _triangle_from_angles(angle_a, angle_b)
    d = _triangle(points, (str(a), "?", ""))
    d.angles = [("B", "A", "C", f"{angle_a}°"), ("A", "B", "C", f"{angle_b}°")]
    return (f"In triangle ABC, angle A measures {angle_a} degrees, angle B measures {angle_b} degrees and "
            f"BC = {a}. Find the length of AC (angle C is {angle_c} degrees). Give an exact answer.", _latex(b), d)


def _triangle_area(rng: random.Random) -> tuple[str, str, Diagram]:
    sp = sympy_module()
    while True:
        a, b, c = rng.randint(3, 15), rng.randint(3, 15), rng.randint(3, 15)
        if a + b > c and b + c > a and a + c > b:
            break
    s = sp.Rational(a + b + c, 2)
    area = sp.sqrt(s * (s - a) * (s - b) * (s - c))
    return (f"Triangle ABC has sides BC = {a}, CA = {b} and AB = {c}. Find its area. Give an exact answer.",
            _latex(area), _triangle(_triangle_from_sides(a, b, c), (str(a), str(b), str(c))))


FAMILIES: dict[str, tuple[int, Callable[[random.Random], tuple[str, str, Diagram]]]] = {
    "triangle_angle": (1, _triangle_angle), "polygon": (1, _polygon), "inscribed_angle": (1, _inscribed_angle),
    "right_triangle": (2, _right_triangle), "similar_triangles": (2, _similar_triangles),
    "circle_arc": (2, _circle_arc), "chord_tangent": (2, _chord_tangent),
    "law_of_cosines": (3, _law_of_cosines), "law_of_sines": (3, _law_of_sines), "triangle_area": (3, _triangle_area),
}
KINDS = tuple(FAMILIES)
_MAX_TRIES = 2000


def _kinds_for(kind: str | None, difficulty: int | None) -> list[str]:
    if kind is not None and kind not in FAMILIES:
        raise ValueError(f"Expected kind to be one of {', '.join(KINDS)} (or None for a mix), got {kind!r}.")
    if difficulty is not None and difficulty not in (1, 2, 3):
        raise ValueError(f"Expected difficulty to be 1, 2 or 3 (or None for a mix), got {difficulty!r}.")
    kinds = [kind] if kind else [k for k, (level, _) in FAMILIES.items() if difficulty in (None, level)]
    if kind and difficulty is not None and FAMILIES[kind][0] != difficulty:
        raise ValueError(f"Kind {kind!r} has difficulty {FAMILIES[kind][0]}, got difficulty={difficulty}.")
    return kinds


def generate(rng: random.Random, *, split: str = "train", kind: str | None = None,
             difficulty: int | None = None) -> GeometryProblem:
    """A random problem from ``split`` (statements are assigned to splits by a stable hash)."""
    if split not in SPLITS:
        raise ValueError(f"Expected split to be one of {', '.join(SPLITS)}, got {split!r}.")
    kinds = _kinds_for(kind, difficulty)
    for _ in range(_MAX_TRIES):
        k = rng.choice(kinds)
        statement, answer, diagram = FAMILIES[k][1](rng)
        if any(mark in answer for mark in ("\\sqrt", "\\pi", "\\frac")) and "exact" not in statement:
            statement += " Give an exact answer (fractions, radicals and pi allowed)."
        if split_of(statement) == split:
            pid = f"{k}-{hashlib.sha256(statement.encode()).hexdigest()[:10]}"
            return GeometryProblem(pid, statement, answer, k, FAMILIES[k][0], split, diagram)
    raise RuntimeError(f"no {split} problem found for kind={kind!r} after {_MAX_TRIES} draws")


def problem_at(index: int, *, split: str = "train", kind: str | None = None,
               difficulty: int | None = None) -> GeometryProblem:
    """The deterministic problem number ``index`` of a split."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"Expected index to be a non-negative integer, got {index!r}.")
    return generate(random.Random(f"geometry/{split}/{kind}/{difficulty}/{index}"), split=split, kind=kind,
                    difficulty=difficulty)


__all__ = ["GeometryProblem", "Diagram", "generate", "problem_at", "FAMILIES", "KINDS"]
