r"""Built-in math problems with exact answers: seedable, leveled, split into disjoint train/validation/test.

Kinds (``kind=``) and what ``difficulty`` 1, 2, 3 means for each:

========== ==================================================================================
add        addition/subtraction: 1 = single digits ("What is 3 + 5?"), 2 = two digits, 3 = three
column     addition/subtraction with no carrying or borrowing ("What is 43 + 5?"): 1 = two digits and
           one digit, 2 = two digits each, 3 = three digits each
arithmetic order of operations: 1 = one product, 2 = sum and product, 3 = five terms with division
fraction   1 = same denominator, 2 = different denominators, 3 = products and quotients
power      1 = squares and square roots, 2 = small powers and cube roots, 3 = simplest radical form
linear     solve for x: 1 = x + a = b, 2 = ax + b = c, 3 = ax + b = cx + d (fractional answers)
quadratic  roots, answer "r1, r2" in any order: 1 = x^2 = k, 2 = monic with integer roots, 3 = rational roots
word       short word problems (shopping, speed, percentages, sharing); difficulty scales the numbers
========== ==================================================================================

``add`` at difficulty 1 is meant for tiny models: the whole user prompt is under 80 characters.
A problem's split is a stable hash of its statement (:func:`split_of`), so no statement ever appears in
two splits (80% train, 10% validation, 10% test), nor does a sum's mirror (``2 + 7`` for ``7 + 2``) or a
word problem told with another name or item; :func:`task_at` gives a deterministic task per index
(for ``add`` at difficulty 1-2: the split's problems in a stable order, each once per ``n`` indices).
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from env_servers import datasets
from env_servers.datasets import SPLITS

DIFFICULTIES = (1, 2, 3)
_MAX_TRIES = 2000


@dataclass(frozen=True)
class MathTask:
    """One problem: its statement, the exact ground-truth answer (LaTeX), and where it comes from."""

    task_id: str
    problem: str
    answer: str
    kind: str
    difficulty: int | None = None
    split: str = "train"
    solution: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


def _task_id(kind: str, difficulty: int, problem: str) -> str:
    return f"{kind}-d{difficulty}-{hashlib.sha256(problem.encode()).hexdigest()[:10]}"


def _frac(q: Fraction) -> str:
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


# -- families: (rng, difficulty) -> (problem, answer) -----------------------------------------

def _add(rng: random.Random, d: int) -> tuple[str, str]:
    lo, hi = {1: (0, 9), 2: (10, 99), 3: (100, 999)}[d]
    return _render_add(rng.randint(lo, hi), rng.choice("+-"), rng.randint(lo, hi))


def _render_add(a: int, op: str, b: int) -> tuple[str, str]:
    if op == "-" and b > a:  # keep answers non-negative: easier for tiny models
        a, b = b, a
    return f"What is {a} {op} {b}?", str(a + b if op == "+" else a - b)


def _column(rng: random.Random, d: int) -> tuple[str, str]:
    # Column arithmetic with no carrying or borrowing: each answer digit depends only on the digits
    # above it, so a model can learn the rule from some problems and apply it to others.
    width_b = {1: 1, 2: 2, 3: 3}[d]
    width_a = max(2, width_b)
    a_digits = [rng.randint(1, 9)] + [rng.randint(0, 9) for _ in range(width_a - 1)]
    op = rng.choice("+-")
    b_digits = []
    for i, da in enumerate(a_digits[width_a - width_b:]):
        lo = 1 if (i == 0 and width_b > 1) else 0
        hi = 9 - da if op == "+" else da
        b_digits.append(rng.randint(min(lo, hi), hi))
    a, b = int("".join(map(str, a_digits))), int("".join(map(str, b_digits)))
    return f"What is {a} {op} {b}?", str(a + b if op == "+" else a - b)


def _arithmetic(rng: random.Random, d: int) -> tuple[str, str]:
    r = rng.randint
    if d == 1:
        a, b = r(2, 12), r(2, 12)
        return f"Compute ${a} \\times {b}$.", str(a * b)
    if d == 2:
        a, b, c = r(2, 30), r(2, 12), r(2, 12)
        if rng.random() < 0.5:
            return f"Compute ${a} + {b} \\times {c}$.", str(a + b * c)
        return f"Compute $({a} + {b}) \\times {c}$.", str((a + b) * c)
    b, q = r(2, 12), r(2, 12)
    a, c, e = b * q, r(2, 15), r(1, 50)
    dd = r(2, 9)
    return f"Compute ${a} \\div {b} + {c} \\times {dd} - {e}$.", str(q + c * dd - e)


def _fraction(rng: random.Random, d: int) -> tuple[str, str]:
    r = rng.randint
    if d == 1:
        den = r(3, 12)
        p, q = r(1, den - 1), r(1, den - 1)
        return f"Compute $\\frac{{{p}}}{{{den}}} + \\frac{{{q}}}{{{den}}}$ as a reduced fraction.", \
            _frac(Fraction(p + q, den))
    x, y = Fraction(r(1, 9), r(2, 12)), Fraction(r(1, 9), r(2, 12))
    if d == 2:
        op = rng.choice("+-")
        value = x + y if op == "+" else x - y
    else:
        op = rng.choice(["\\times", "\\div"])
        value = x * y if op == "\\times" else x / y
    return f"Compute ${_frac(x)} {op} {_frac(y)}$ as a reduced fraction.", _frac(value)


def _power(rng: random.Random, d: int) -> tuple[str, str]:
    r = rng.randint
    if d == 1:
        a = r(2, 15)
        if rng.random() < 0.5:
            return f"Compute ${a}^2$.", str(a * a)
        return f"Compute $\\sqrt{{{a * a}}}$.", str(a)
    if d == 2:
        if rng.random() < 0.5:
            a, n = r(2, 5), r(3, 6)
            return f"Compute ${a}^{{{n}}}$.", str(a ** n)
        a = r(2, 10)
        return f"Compute $\\sqrt[3]{{{a ** 3}}}$.", str(a)
    outer, inner = r(2, 9), rng.choice([2, 3, 5, 6, 7, 10, 11])
    return f"Write $\\sqrt{{{outer * outer * inner}}}$ in simplest radical form.", f"{outer}\\sqrt{{{inner}}}"


def _linear(rng: random.Random, d: int) -> tuple[str, str]:
    r = rng.randint
    x = r(-12, 12)
    if d == 1:
        a = r(1, 20)
        return f"Solve for $x$: $x + {a} = {x + a}$.", str(x)
    a, b = rng.choice([i for i in range(-9, 10) if i not in (0, 1)]), r(-20, 20)
    if d == 2:
        return f"Solve for $x$: ${_coef(a)}x{_term(b)} = {a * x + b}$.", str(x)
    c = rng.choice([i for i in range(-9, 10) if i not in (0, a)])
    dd = r(-20, 20)
    value = Fraction(dd - b, a - c)
    return f"Solve for $x$: ${_coef(a)}x{_term(b)} = {_coef(c)}x{_term(dd)}$.", _frac(value)


def _coef(n: int) -> str:
    return {1: "", -1: "-"}.get(n, str(n))


def _term(n: int, var: str = "") -> str:
    """`` + 3x``, `` - x``, or nothing for a zero coefficient."""
    if n == 0:
        return ""
    magnitude = "" if abs(n) == 1 and var else str(abs(n))
    return f" {'+' if n > 0 else '-'} {magnitude}{var}"


def _quadratic(rng: random.Random, d: int) -> tuple[str, str]:
    r = rng.randint
    suffix = " Give all solutions, separated by commas."
    if d == 1:
        k = r(1, 15)
        return f"Solve $x^2 = {k * k}$.{suffix}", f"{k}, -{k}"
    if d == 2:
        p, q = r(-9, 9), r(-9, 9)
        b, c = -(p + q), p * q
        roots = f"{p}, {q}" if p != q else str(p)
        return f"Solve $x^2{_term(b, 'x')}{_term(c)} = 0$.{suffix}", roots
    a = r(2, 5)
    root_p, root_q = Fraction(r(-6, 6), a), Fraction(r(-6, 6))
    # a(x - p)(x - q), integer coefficients since a*p is an integer
    b, c = int(-a * (root_p + root_q)), int(a * root_p * root_q)
    roots = f"{_frac(root_p)}, {_frac(root_q)}" if root_p != root_q else _frac(root_p)
    return f"Solve ${a}x^2{_term(b, 'x')}{_term(c)} = 0$.{suffix}", roots


_NAMES = ("Ada", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jia")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies")


def _word(rng: random.Random, d: int) -> tuple[str, str]:
    r, name, item = rng.randint, rng.choice(_NAMES), rng.choice(_ITEMS)
    scale = {1: 1, 2: 5, 3: 25}[d]
    template = rng.randrange(4)
    if template == 0:
        a, b, c = r(5, 20) * scale, r(1, 10) * scale, r(1, 5) * scale
        return (f"{name} has {a} {item}, buys {b} more and gives away {c}. "
                f"How many {item} does {name} have now?", str(a + b - c))
    if template == 1:
        speed, hours = r(3, 12) * 5 * scale, r(2, 6)
        return f"A train travels at {speed} km per hour for {hours} hours. How many km does it travel?", \
            str(speed * hours)
    if template == 2:
        pct, price = rng.choice([10, 20, 25, 50]), r(2, 20) * 20 * scale
        return (f"A jacket costs {price} dollars. It is on sale for {pct}% off. What is the sale price in dollars?",
                _frac(Fraction(price * (100 - pct), 100)))
    people, each = r(2, 9), r(2, 12) * scale
    return f"{name} shares {people * each} {item} equally among {people} friends. How many does each friend get?", \
        str(each)


FAMILIES: dict[str, Callable[[random.Random, int], tuple[str, str]]] = {
    "add": _add, "column": _column, "arithmetic": _arithmetic, "fraction": _fraction, "power": _power,
    "linear": _linear, "quadratic": _quadratic, "word": _word,
}
KINDS = tuple(FAMILIES)


_SUM = re.compile(r"What is (\d+) \+ (\d+)\?")
_NAME_OR_ITEM = re.compile(r"\b(?:" + "|".join(_NAMES + _ITEMS) + r")\b")


def split_of(problem: str) -> str:
    """The split of a math problem: a stable hash (:func:`env_servers.datasets.split_of`) of its text, less
    what does not change the problem. A sum and its mirror (``7 + 2``, ``2 + 7``) share a split, and so do
    word problems that differ only in the name and the item: a validation problem is never a train problem
    with its operands swapped or its apples renamed.

    >>> split_of("What is 7 + 2?") == split_of("What is 2 + 7?")
    True
    """
    m = _SUM.fullmatch(problem)
    if m:
        a, b = sorted((int(m[1]), int(m[2])))
        problem = f"What is {a} + {b}?"
    return datasets.split_of(_NAME_OR_ITEM.sub("_", problem))


def _check(kind: str | None, difficulty: int | None, split: str) -> None:
    if kind is not None and kind not in FAMILIES:
        raise ValueError(f"Expected kind to be one of {', '.join(KINDS)} (or None for a mix), got {kind!r}.")
    if difficulty is not None and difficulty not in DIFFICULTIES:
        raise ValueError(f"Expected difficulty to be 1, 2 or 3 (or None for a mix), got {difficulty!r}.")
    if split not in SPLITS:
        raise ValueError(f"Expected split to be one of {', '.join(SPLITS)}, got {split!r}.")


def generate(rng: random.Random, *, split: str = "train", kind: str | None = None,
             difficulty: int | None = None) -> MathTask:
    """A random task from ``split``; ``kind``/``difficulty`` of ``None`` pick one at random."""
    _check(kind, difficulty, split)
    k = kind or rng.choice(KINDS)
    d = difficulty or rng.choice(DIFFICULTIES)
    for _ in range(_MAX_TRIES):
        problem, answer = FAMILIES[k](rng, d)
        if split_of(problem) == split:
            return MathTask(_task_id(k, d, problem), problem, answer, k, d, split)
    raise RuntimeError(f"no {split} problem found for kind={k!r}, difficulty={d} after {_MAX_TRIES} draws")


def task_at(index: int, *, split: str = "train", kind: str | None = None, difficulty: int | None = None) -> MathTask:
    """The deterministic task number ``index`` of a split (the same on every machine and run).

    For ``add`` at difficulty 1 or 2, whose splits are small enough to list, ``index`` walks the
    split's full list (:func:`add_tasks`) and wraps around: indices ``0..n-1`` are each of its ``n``
    problems exactly once, which is what an evaluation wants. Other families draw a seeded problem
    per index (with a large space, repeats are rare).
    """
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"Expected index to be a non-negative integer, got {index!r}.")
    if kind == "add" and difficulty in (1, 2):
        pool = _add_pool(split, difficulty)
        return pool[index % len(pool)]
    return generate(random.Random(f"{split}/{kind}/{difficulty}/{index}"), split=split, kind=kind,
                    difficulty=difficulty)


def listed_size(split: str, kind: str | None, difficulty: int | None) -> int | None:
    """How many problems ``split`` holds when :func:`task_at` walks it whole (``add`` at difficulty 1-2), else None."""
    if kind == "add" and difficulty in (1, 2):
        return len(_add_pool(split, difficulty))
    return None


@functools.cache
def _add_pool(split: str, difficulty: int) -> tuple[MathTask, ...]:
    return tuple(add_tasks(split, difficulty))


def add_tasks(split: str, difficulty: int = 1) -> list[MathTask]:
    """Every ``add`` problem of a split at a difficulty (1 or 2), in a stable order: a full eval set."""
    _check("add", difficulty, split)
    if difficulty == 3:
        raise ValueError("Expected difficulty 1 or 2 for enumeration; difficulty 3 has ~1.6M problems.")
    lo, hi = {1: (0, 9), 2: (10, 99)}[difficulty]
    return [MathTask(_task_id("add", difficulty, p), p, a, "add", difficulty, split)
            for p, a in sorted(set(_all_add(lo, hi))) if split_of(p) == split]


def _all_add(lo: int, hi: int) -> Iterator[tuple[str, str]]:
    for a in range(lo, hi + 1):
        for b in range(lo, hi + 1):
            for op in "+-":
                yield _render_add(a, op, b)


__all__ = ["MathTask", "generate", "task_at", "listed_size", "add_tasks", "split_of", "FAMILIES", "KINDS", "SPLITS",
           "DIFFICULTIES"]
