"""Diagram-only problems: questions whose answer the statement never gives (pure, seedable, no envhub).

Kinds (``kind=``), next to the text-answerable ones of :mod:`.problems`:

============ ==================================================================================
figure        which figure is drawn: ``t`` (triangle), ``q`` (quadrilateral) or ``c`` (circle); polygons
              shaded, circles outlined; a multiple-choice answer, graded on the reply's first word
              (the letter or the name)
measure       the length of a named side of a triangle whose lengths are written nowhere: the
              picture shows proportions only (the renderer scales every figure to the canvas), so
              the ``measure`` tool (a ruler on the diagram's coordinates) is the way to the answer;
              the statement asks for the reply in a ``reply`` format of :data:`MEASURE_REPLIES`
============ ==================================================================================

The statement of a kind is one sentence for every problem, so a policy blind to the picture (and,
for ``measure``, to tool results) can do no better than chance. Splits therefore hash the figure
(its coordinates) and the question, not the reply format: a triangle is in the same split whichever
format its statement asks for. :func:`problem_at` balances the answers: problem ``i`` of a
split has answer ``ANSWERS[kind][i % len(ANSWERS[kind])]``, so chance is exactly ``1/len``.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Callable
from itertools import pairwise

from env_servers.datasets import SPLITS, split_of
from env_servers.geometry_env.problems import Diagram, GeometryProblem, Point

FIGURES = {"t": "triangle", "q": "quadrilateral", "c": "circle"}
FIGURE_STATEMENT = "Figure? t=triangle q=quadrilateral c=circle"
MEASURE_LENGTHS = tuple(str(n) for n in range(2, 10))  # one digit: chance is 1/8
MEASURE_SIDES = ("AB", "BC", "CA")
#: how a ``measure`` statement asks for the reply: in ``\boxed{}``, or the number alone
MEASURE_REPLIES = {"boxed": "Reply \\boxed{length}.", "number": "Reply with the length alone."}
MEASURE_SPREAD = int(MEASURE_LENGTHS[-1]) - int(MEASURE_LENGTHS[0])
ANSWERS: dict[str, tuple[str, ...]] = {"figure": tuple(FIGURES), "measure": MEASURE_LENGTHS}
KINDS = tuple(ANSWERS)
_MAX_TRIES = 2000
_ASKED = re.compile(r"How long is ([A-Z]{2})\?")


def _polar(r: float, degrees: float) -> Point:
    return r * math.cos(math.radians(degrees)), r * math.sin(math.radians(degrees))


def _figure(rng: random.Random, answer: str) -> tuple[str, Diagram]:
    """A shaded triangle (apex up), a shaded near-upright quadrilateral, or a circle's outline, of random proportions.

    Drawn so, the three darken clearly different parts of the picture (its lower half, nearly all of
    it, a thin ring): a random vision tower tells them apart at once (with outlines alone, or one light
    shade for all three, their features hardly differ and a tiny model learns nothing in minutes).
    """
    if answer == "c":
        r = rng.uniform(2.0, 9.0)
        return FIGURE_STATEMENT, Diagram({"O": (0.0, 0.0)}, circles=[("O", r)])
    if answer == "t":
        angles = [90 + rng.uniform(-20, 20), 210 + rng.uniform(-15, 15), 330 + rng.uniform(-15, 15)]
        names = "ABC"
    else:
        angles = [45 + 90 * k + rng.uniform(-12, 12) for k in range(4)]
        names = "ABCD"
    points = {name: _polar(rng.uniform(4.0, 6.0), a) for name, a in zip(names, angles)}
    ring = [*names, names[0]]
    return FIGURE_STATEMENT, Diagram(points, segments=[(p, q, "") for p, q in pairwise(ring)],
                                     regions=[tuple(names)])


def _measure(rng: random.Random, answer: str, side: str | None = None) -> tuple[str, Diagram]:
    """Triangle ABC with the asked ``side`` (None: a random one) of length ``answer``, and the question (without
    the reply format); the other sides follow from random angles."""
    side = side or rng.choice(MEASURE_SIDES)
    length = float(answer)
    angle_at_start = rng.uniform(35, 110)  # at the side's first vertex
    other = rng.uniform(0.5, 1.6) * length
    p, q = side[0], side[1]
    r = ({"A", "B", "C"} - {p, q}).pop()
    points = {p: (0.0, 0.0), q: (length, 0.0), r: _polar(other, angle_at_start)}
    return f"How long is {side}?", Diagram(points, segments=[("A", "B", ""), ("B", "C", ""), ("C", "A", "")])


BUILDERS: dict[str, Callable[[random.Random, str], tuple[str, Diagram]]] = {"figure": _figure, "measure": _measure}


def _check_side(kind: str, side: str | None, reply: str) -> None:
    if side is not None and (kind != "measure" or side not in MEASURE_SIDES):
        raise ValueError(f"Expected side to be None or, for the measure kind, one of {MEASURE_SIDES}; got "
                         f"side={side!r} for kind={kind!r}.")
    if reply not in MEASURE_REPLIES:
        raise ValueError(f"Expected reply to be one of {tuple(MEASURE_REPLIES)}, got {reply!r}.")


def _figure_key(statement: str, diagram: Diagram) -> str:
    """What a problem's split and id hash: the question (a ``figure`` statement, a ``measure`` one without its
    reply format) and the figure's coordinates."""
    coords = ";".join(f"{n}:{x:.4f},{y:.4f}" for n, (x, y) in sorted(diagram.points.items()))
    circles = ";".join(f"{c}:{r:.4f}" for c, r in diagram.circles)
    return f"{statement}|{coords}|{circles}"


def generate(rng: random.Random, *, split: str = "train", kind: str = "figure",
             answer: str | None = None, side: str | None = None, reply: str = "boxed") -> GeometryProblem:
    """A random ``kind`` problem of ``split`` (with the given ``answer``, else a random one of the kind);
    ``side``: the side a ``measure`` problem asks for (None: a random one); ``reply``: the reply format its
    statement asks for (a key of :data:`MEASURE_REPLIES`)."""
    if split not in SPLITS:
        raise ValueError(f"Expected split to be one of {', '.join(SPLITS)}, got {split!r}.")
    if kind not in ANSWERS:
        raise ValueError(f"Expected a diagram-only kind among {', '.join(KINDS)}, got {kind!r}.")
    if answer is not None and answer not in ANSWERS[kind]:
        raise ValueError(f"Expected a {kind} answer among {ANSWERS[kind]}, got {answer!r}.")
    _check_side(kind, side, reply)
    for _ in range(_MAX_TRIES):
        truth = answer if answer is not None else rng.choice(ANSWERS[kind])
        question, diagram = _measure(rng, truth, side) if side else BUILDERS[kind](rng, truth)
        key = _figure_key(question, diagram)
        if split_of(key) == split:
            pid = f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
            choices = ANSWERS[kind] if kind == "figure" else ()
            statement = f"{question} {MEASURE_REPLIES[reply]}" if kind == "measure" else question
            return GeometryProblem(pid, statement, truth, kind, None, split, diagram, choices=choices)
    raise RuntimeError(f"no {split} problem found for kind={kind!r} after {_MAX_TRIES} draws")


def problem_at(index: int, *, split: str = "train", kind: str = "figure", side: str | None = None,
               reply: str = "boxed") -> GeometryProblem:
    """Problem number ``index`` of a split: deterministic, its answer ``ANSWERS[kind][index % len]`` (``side``,
    ``reply``: as :func:`generate`)."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"Expected index to be a non-negative integer, got {index!r}.")
    if kind not in ANSWERS:
        raise ValueError(f"Expected a diagram-only kind among {', '.join(KINDS)}, got {kind!r}.")
    answers = ANSWERS[kind]
    return generate(random.Random(f"geometry-figure/{split}/{kind}/{index}"), split=split, kind=kind,
                    answer=answers[index % len(answers)], side=side, reply=reply)


def choice_of(text: str, choices: tuple[str, ...]) -> str | None:
    """The choice a reply names with its first word: a choice letter, or the figure's name; None otherwise.

    >>> choice_of("q", ("t", "q", "c")), choice_of("Circle.", ("t", "q", "c")), choice_of("maybe t", ("t",))
    ('q', 'c', None)
    """
    words = "".join(ch if ch.isalpha() else " " for ch in text.lower()).split()
    if not words:
        return None
    first = words[0]
    if first in choices:
        return first
    named = {name: letter for letter, name in FIGURES.items() if letter in choices}
    return named.get(first)


def closeness(answer: str | None, truth: str) -> float:
    """How near a ``measure`` answer is to the true length: ``1 - |answer - truth| / MEASURE_SPREAD``, at
    least 0; 0 for an answer that is not a number. A shaping signal (an answer one off scores 6/7), never
    the accuracy.

    >>> closeness("5", "5"), closeness("4", "5"), round(closeness(" 9 ", "2"), 3), closeness("five", "5")
    (1.0, 0.8571428571428572, 0.0, 0.0)
    """
    try:
        value = float((answer or "").strip())
    except ValueError:
        return 0.0
    if not math.isfinite(value):
        return 0.0
    return max(0.0, 1.0 - abs(value - float(truth)) / MEASURE_SPREAD)


def asks_for(statement: str, segment: str) -> bool:
    """Whether ``segment`` is the side a ``measure`` statement asks for, in either direction (``CB`` is ``BC``).

    >>> asks_for("How long is BC? Reply with the length alone.", "cb"), asks_for("How long is BC?", "AB")
    (True, False)
    """
    asked = _ASKED.match(statement)
    names = segment.strip().upper().replace("-", "").replace(" ", "")
    return asked is not None and sorted(names) == sorted(asked.group(1))


def segment_length(diagram: Diagram, segment: str) -> float:
    """The length of ``segment`` (two point names, e.g. ``"AB"``) on the diagram's coordinates."""
    names = segment.strip().upper().replace("-", "").replace(" ", "")
    if len(names) != 2 or any(n not in diagram.points for n in names):
        raise ValueError(f"Expected two point names of the diagram among {''.join(sorted(diagram.points))} "
                         f"(like 'AB'), got {segment!r}.")
    (x1, y1), (x2, y2) = diagram.points[names[0]], diagram.points[names[1]]
    return math.hypot(x2 - x1, y2 - y1)


__all__ = ["ANSWERS", "FIGURES", "KINDS", "MEASURE_REPLIES", "generate", "problem_at", "choice_of", "closeness", "asks_for",
           "segment_length"]
