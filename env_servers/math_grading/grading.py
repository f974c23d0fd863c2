r"""Answer extraction and grading for math answers: pure functions, no envhub.

Pipeline: :func:`envhub.parsers.extract_boxed` takes the last brace-matched ``\boxed{...}`` (also ``\fbox{...}``
and the ``\boxed 5`` space form); :func:`strip_string` applies the Hendrycks MATH
normalisation (``\dfrac``->``\frac``, ``\left``/``\right``, degrees, ``\$``, units, ``\%``, short
``x=`` prefixes, ``\sqrt3``, ``\frac12``, ``0.5``, ``a/b``); :func:`is_equiv` compares two answers
first as normalised strings, then as sympy values: tuples and intervals element by element
(bracket kinds must agree), bare comma lists as multisets, percentages both as ``p`` and
``p/100``, rationals exactly and other closed forms numerically at 30 digits. There is no
substring test. sympy only ever sees small, whitelisted expressions (see :mod:`.expressions`),
and those whose evaluation could still be slow (trigonometry, logarithms, irrational exponents)
are compared in a worker process that is killed after ``GRADE_TIMEOUT_S`` (see :mod:`.bounded`),
so grading a hostile answer takes bounded time. Nothing here raises on model output.

>>> grade(r"so the answer is \boxed{\dfrac12}", "0.5").correct
True
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from env_servers.math_grading import bounded
from env_servers.math_grading.expressions import is_cheap, numeric_value, sympy_module, try_parse
from envhub.parsers import extract_boxed

_UNIT_WORDS = ("square units", "sq units", "square inches", "square feet", "square meters", "square cm",
               "units", "unit", "degrees", "degree", "cm", "mm", "km", "meters", "meter", "inches", "inch",
               "feet", "foot", "ft", "miles", "mph", "dollars", "cents", "seconds", "minutes", "hours",
               "days", "cm\\^2", "m\\^2", "cm\\^3")
_UNITS_RE = re.compile(r"(?<=[\d}\s)])\s*(?:\\(?:text|mbox|mathrm)\{\s*)?(?:" + "|".join(_UNIT_WORDS)
                       + r")\s*\}?\s*(?:\^\s*\{?\s*[23]\s*\}?)?\s*$", re.IGNORECASE)  # "5\text{cm}^2" too
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_FORMAT_RE = re.compile(r"\s*<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
_EXACT_REL_TOL = 1e-12
_MAX_STRUCTURED_CHARS = 2000
GRADE_TIMEOUT_S = 2.0
_OPEN, _CLOSE = "([{", ")]}"


# -- extraction (envhub.parsers.extract_boxed: one implementation for every env and the SDK) ------

def has_think_then_boxed(text: str) -> bool:
    r"""The ``<think>...</think>`` then ``\boxed{...}`` format some prompts ask for."""
    return isinstance(text, str) and _FORMAT_RE.fullmatch(text) is not None


# -- Hendrycks normalisation -------------------------------------------------------------------

def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
        elif part[1] != "{":
            out += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
        else:
            out += "{" + part[0] + "}" + part[1:]
    return out


def _fix_sqrt(s: str) -> str:
    parts = s.split("\\sqrt")
    out = parts[0]
    for part in parts[1:]:
        if part and part[0] not in "{[":
            out += "\\sqrt{" + part[0] + "}" + part[1:]
        else:
            out += "\\sqrt" + part
    return out


def _fix_a_slash_b(s: str) -> str:
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


# A mixed number as a whole answer (or one item of a list): "2\frac{1}{4}" or "2 1/4" is 2 + 1/4, not a
# product (2 * 1/4) and not 21/4. Only a proper fraction after a whole number: "2\frac{3}{2}" stays a product.
_MIXED_SPACED = re.compile(r"(?:^|(?<=[,(\[]))(\s*-?\s*)(\d+)\s+(\d+)\s*/\s*(\d+)(?=\s*(?:$|[,)\]]))")
_MIXED_FRAC = re.compile(r"(?:^|(?<=[,(\[]))(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}(?=$|[,)\]])")


def _improper(sign: str, whole: str, num: str, den: str, original: str) -> str:
    n, d = int(num), int(den)
    if not 0 < n < d:
        return original
    return f"{sign.strip()}\\frac{{{int(whole) * d + n}}}{{{d}}}"


def _fix_mixed_numbers(s: str) -> str:
    """``2 1/4`` (before spaces are removed) and ``2\\frac{1}{4}`` (after) as the improper ``\\frac{9}{4}``."""
    s = _MIXED_SPACED.sub(lambda m: _improper(m[1], m[2], m[3], m[4], m[0]), s)
    return _MIXED_FRAC.sub(lambda m: _improper(m[1], m[2], m[3], m[4], m[0]), s)


def _unwrap_text(s: str) -> str:
    return re.sub(r"\\(?:text|textbf|mbox|mathrm|mathbf)\{([^{}]*)\}", r"\1", s)


def strip_string(answer: str) -> str:
    r"""Hendrycks MATH normalisation (robust: never raises). ``\dfrac{1}{2}``, ``0.5`` and ``1/2`` all become ``\frac{1}{2}``."""
    # whitespace runs as one space first: spaces are dropped below anyway, and a run of thousands made the unit
    # and mixed-number patterns quadratic (a 20k-space answer took 50 s)
    s = re.sub(r"[^\S\n]+", " ", str(answer)).replace("\n", "").replace("\\!", "").replace("\\\\", "\\").replace("\u2212", "-")
    s = s.replace("±", "\\pm").replace("×", "\\times").replace("÷", "\\div").replace("π", "\\pi").replace("√", "\\sqrt")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("\\displaystyle", "").replace("\\,", " ").replace("\\;", " ").replace("\\ ", " ").replace("~", " ")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\circ", "").replace("°", "").replace("\\degree", "")
    s = s.replace("\\$", "").replace("$", "").strip().rstrip(".").strip()
    if "\\text{ " in s:  # Hendrycks: "\text{ " only ever introduces units
        s = s.split("\\text{ ")[0]
    s = _UNITS_RE.sub("", s)
    s = _unwrap_text(s).replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    halves = s.split("=")
    if len(halves) == 2 and len(halves[0].strip()) <= 2:
        s = halves[1]
    s = _fix_mixed_numbers(s.strip())
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_mixed_numbers(_fix_fracs(s))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


# -- structured comparison --------------------------------------------------------------

@dataclass(frozen=True)
class _Parsed:
    brackets: str  # "" (bare list), "()", "[)", ...
    items: tuple[Any, ...]


def _split_top_level(s: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in s:
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def _outer_brackets(s: str) -> tuple[str, str]:
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        inner = s[1:-1]
        depth = 0
        for ch in inner:  # "(1)+(2)" is not one bracketed group
            depth += (ch in _OPEN) - (ch in _CLOSE)
            if depth < 0:
                return "", s
        if depth == 0:
            return s[0] + s[-1], inner
    return "", s


def _strip_lhs(item: str) -> str:
    halves = item.split("=")
    if len(halves) == 2 and re.fullmatch(r"[A-Za-z]{1,2}(_\{?\w+\}?)?", halves[0].strip()):
        return halves[1]
    return item


def _pieces(normalised: str) -> tuple[str, list[str]]:
    """Outer bracket kind and the top-level comma-separated items (``x=`` prefixes dropped)."""
    brackets, inner = _outer_brackets(normalised)
    pieces = [_strip_lhs(p) for p in _split_top_level(inner)]
    if not brackets and len(pieces) > 1 and _THOUSANDS_RE.match(inner):
        pieces = [inner.replace(",", "")]
    if len(pieces) == 1 and brackets == "()":
        brackets, pieces = "", [inner]  # "(5)" is just 5
    if not brackets:
        pieces = [q for p in pieces for q in _expand_pm(p)]
    return brackets, pieces


def _expand_pm(piece: str) -> list[str]:
    r"""``a \pm b`` is the two solutions ``a + b`` and ``a - b``."""
    left, sep, right = piece.partition(r"\pm")
    if not sep or r"\pm" in right or not right:
        return [piece]
    return [f"{left}+{right}", f"{left}-{right}"]


def _parse_structure(normalised: str, percent: bool) -> list[_Parsed]:
    """The answer as a structure of sympy values; a percentage gives two readings (p and p/100)."""
    brackets, pieces = _pieces(normalised)
    values = [v for v in (try_parse(p) for p in pieces) if v is not None]
    if len(values) < len(pieces):
        return []
    readings = [_Parsed(brackets, tuple(values))]
    if percent and len(values) == 1:
        readings.append(_Parsed(brackets, (values[0] / 100,)))
    return readings


def values_equal(a: Any, b: Any, rel_tol: float | None = None) -> bool:
    """Equality of two sympy values: exact for rationals, numeric (30 digits) otherwise.

    With ``rel_tol`` every numeric pair is compared within that relative tolerance (for
    tasks whose answers are rounded decimals).
    """
    try:
        if a == b:
            return True
        sp = sympy_module()
        if a.has(sp.oo, -sp.oo) or b.has(sp.oo, -sp.oo):
            return False
        if rel_tol is None and a.is_Rational and b.is_Rational:
            return False
        tol = _EXACT_REL_TOL if rel_tol is None else rel_tol
        symbols = sorted(a.free_symbols | b.free_symbols, key=str)
        points = [dict(zip(symbols, vals)) for vals in _sample_points(len(symbols))] if symbols else [{}]
        for point in points:
            x, y = numeric_value(a.subs(point)), numeric_value(b.subs(point))
            if x is None or y is None or abs(x - y) > tol * max(1.0, abs(y)):
                return False
        return True
    except Exception:  # sympy corner cases on odd values: not equal, never a crash
        return False


def _sample_points(n: int) -> list[tuple[Any, ...]]:
    sp = sympy_module()
    bases = [sp.Rational(37, 100), sp.Rational(123, 100), sp.Rational(271, 100)]
    return [tuple(base + sp.Rational(k, 7) for k in range(n)) for base in bases]


def _structures_equal(a: _Parsed, b: _Parsed, rel_tol: float | None) -> bool:
    if a.brackets != b.brackets or len(a.items) != len(b.items):
        return False
    if a.brackets or len(a.items) == 1:
        return all(values_equal(x, y, rel_tol) for x, y in zip(a.items, b.items))
    remaining = list(b.items)  # a bare list "2, -3" is a set of solutions: order does not matter
    for x in a.items:
        match = next((i for i, y in enumerate(remaining) if values_equal(x, y, rel_tol)), None)
        if match is None:
            return False
        remaining.pop(match)
    return True


def is_equiv(prediction: str | None, ground_truth: str | None, *, rel_tol: float | None = None) -> bool:
    r"""Whether two answer strings mean the same value.

    >>> is_equiv(r"\dfrac12", "0.5"), is_equiv("x=3", "3"), is_equiv("50\\%", r"\frac{1}{2}")
    (True, True, True)
    >>> is_equiv("1", "10")
    False
    """
    if not isinstance(prediction, str) or not isinstance(ground_truth, str):
        return False
    p, g = strip_string(prediction), strip_string(ground_truth)
    if not p or not g:
        return False
    if p == g:
        return True
    if len(p) > _MAX_STRUCTURED_CHARS or len(g) > _MAX_STRUCTURED_CHARS:
        return False  # far longer than any answer: not worth parsing hundreds of pieces
    args = (p, g, _has_percent(prediction), _has_percent(ground_truth), rel_tol)
    if all(is_cheap(piece) for s in (p, g) for piece in _pieces(s)[1]):
        return symbolic_equiv(*args)
    try:  # transcendental or odd powers: sympy may take long, so run it in a killable worker
        return bool(bounded.call("env_servers.math_grading.grading:symbolic_equiv", *args, timeout_s=GRADE_TIMEOUT_S))
    except bounded.BoundedCallError:
        return False


def symbolic_equiv(p: str, g: str, p_percent: bool, g_percent: bool, rel_tol: float | None) -> bool:
    """Equivalence of two normalised answers as sympy structures (the slow half of :func:`is_equiv`)."""
    left, right = _parse_structure(p, p_percent), _parse_structure(g, g_percent)
    return any(_structures_equal(x, y, rel_tol) for x in left for y in right)


def _has_percent(s: str) -> bool:
    return "%" in s or "percent" in s.lower()


@dataclass(frozen=True)
class GradeResult:
    """The verdict on one response: what was parsed, and whether it matches."""

    parsed: str | None
    correct: bool

    @property
    def has_answer(self) -> bool:
        return self.parsed is not None


def grade(response: str, ground_truth: str, *, rel_tol: float | None = None) -> GradeResult:
    r"""Grade a whole model response: the last ``\boxed{}`` against the ground truth."""
    parsed = extract_boxed(response) if isinstance(response, str) else None
    return GradeResult(parsed, parsed is not None and is_equiv(parsed, ground_truth, rel_tol=rel_tol))


def grade_answer(answer: str, ground_truth: str, *, rel_tol: float | None = None) -> GradeResult:
    r"""Grade a bare answer (a ``submit_answer`` argument); a ``\boxed{}`` inside it is unwrapped."""
    if not isinstance(answer, str) or not answer.strip():
        return GradeResult(None, False)
    parsed = extract_boxed(answer) or answer.strip()
    return GradeResult(parsed, is_equiv(parsed, ground_truth, rel_tol=rel_tol))


__all__ = ["extract_boxed", "has_think_then_boxed", "strip_string",
           "is_equiv", "values_equal", "grade", "grade_answer", "GradeResult"]
