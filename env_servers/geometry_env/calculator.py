"""The geometry tools' arithmetic: a safe calculator and exact triangle/circle/polygon formulas. Pure functions.

``calculate`` never evaluates code: the expression goes through the whitelisted, size-capped
parser of :mod:`env_servers.math_grading.expressions` (no attribute access, no names beyond math
functions and single-letter symbols, no exponent towers, at most 400 characters), and any
expression whose sympy evaluation could still be slow runs in a worker process with a
deadline (:mod:`env_servers.math_grading.bounded`), so every call finishes in bounded time. Results are
exact when they can be (``5*sqrt(2)``) with a decimal approximation. Bad input raises
:class:`CalculatorError` with a message meant for the model.
"""

from __future__ import annotations

from typing import Any

from env_servers.math_grading import bounded
from env_servers.math_grading.expressions import (
    ExpressionError,
    is_cheap,
    numeric_value,
    parse_expression,
    sympy_module,
)

MAX_RESULT_CHARS = 300
CALCULATE_TIMEOUT_S = 2.0


class CalculatorError(ValueError):
    """The input cannot be evaluated; the message says why and what is accepted."""


def format_value(value: Any) -> str:
    """``exact ≈ decimal`` (or just one of them when they coincide or the exact form is huge)."""
    sp = sympy_module()
    exact: str = sp.sstr(value)
    if value.free_symbols:
        return exact if len(exact) <= MAX_RESULT_CHARS else exact[:MAX_RESULT_CHARS] + "..."
    number = numeric_value(value, 15)
    if number is None:
        return exact if len(exact) <= MAX_RESULT_CHARS else "undefined or too large"
    approx = f"{number.real:.10g}" if abs(number.imag) < 1e-12 else f"{number.real:.10g}{number.imag:+.10g}i"
    if value.is_Integer or len(exact) > MAX_RESULT_CHARS:
        return approx if value.is_Integer else f"≈ {approx}"
    return f"{exact} ≈ {approx}"


def calculate(expression: str, *, timeout_s: float = CALCULATE_TIMEOUT_S) -> str:
    """Evaluate a math expression: ``+ - * / ^``, ``sqrt``, ``sin/cos/tan`` (radians), ``sind/cosd/tand`` (degrees),
    ``asind/acosd/atand``, ``pi``, LaTeX like ``\\frac{a}{b}``.

    Rational arithmetic and roots run in process; anything whose evaluation could be slow runs in
    a worker process that is killed after ``timeout_s``.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("Expected a non-empty expression such as 'sqrt(3**2 + 4**2)'.")
    if is_cheap(expression, calculator=True):
        return evaluate(expression)
    try:
        shown: str = bounded.call("env_servers.geometry_env.calculator:evaluate", expression, timeout_s=timeout_s)
        return shown
    except bounded.BoundedCallError as exc:
        if exc.timed_out:
            raise CalculatorError(f"{expression[:60]!r} took longer than {timeout_s:g}s to evaluate; "
                                  "simplify it or split it into steps.") from None
        raise CalculatorError(str(exc).removeprefix("CalculatorError: ")) from None


def evaluate(expression: str) -> str:
    """:func:`calculate` without the deadline (run directly only for cheap expressions)."""
    try:
        value = parse_expression(expression, calculator=True)
    except ExpressionError as exc:
        raise CalculatorError(f"cannot evaluate {expression[:60]!r}: {exc}") from None
    except Exception as exc:  # sympy internals (MemoryError, RecursionError...) on odd input
        raise CalculatorError(f"cannot evaluate {expression[:60]!r}: {type(exc).__name__}") from None
    return format_value(value)


def _exact(x: float | int, name: str, *, positive: bool = True) -> Any:
    sp = sympy_module()
    if isinstance(x, bool) or not isinstance(x, (int, float)) or x != x or x in (float("inf"), float("-inf")):
        raise CalculatorError(f"Expected {name} to be a finite number, got {x!r}.")
    if positive and x <= 0:
        raise CalculatorError(f"Expected {name} > 0, got {x!r}.")
    if abs(x) > 1e9:
        raise CalculatorError(f"Expected |{name}| <= 1e9, got {x!r}.")
    return sp.Integer(x) if isinstance(x, int) else sp.Rational(repr(float(x)))


def _angle(deg: float, name: str) -> Any:
    value = _exact(deg, name)
    if value >= 180:
        raise CalculatorError(f"Expected 0 < {name} < 180 degrees, got {deg!r}.")
    return sympy_module().pi * value / 180


def law_of_cosines(a: float, b: float, angle_deg: float) -> Any:
    """The side opposite the angle between sides ``a`` and ``b``: sqrt(a² + b² − 2ab·cos C)."""
    sp = sympy_module()
    ea, eb, c = _exact(a, "a"), _exact(b, "b"), _angle(angle_deg, "angle_deg")
    return sp.sqrt(sp.expand(ea ** 2 + eb ** 2 - 2 * ea * eb * sp.cos(c)))


def law_of_sines(side_a: float, angle_a_deg: float, angle_b_deg: float) -> Any:
    """The side opposite angle B, given side a opposite angle A: a·sin B / sin A."""
    sp = sympy_module()
    a, angle_a, angle_b = _exact(side_a, "side_a"), _angle(angle_a_deg, "angle_a_deg"), _angle(angle_b_deg, "angle_b_deg")
    if angle_a + angle_b >= sp.pi:
        raise CalculatorError(f"Expected angle_a_deg + angle_b_deg < 180, got {angle_a_deg} + {angle_b_deg}.")
    return sp.radsimp(a * sp.sin(angle_b) / sp.sin(angle_a))


def triangle_area(a: float, b: float, c: float) -> Any:
    """Heron's formula: sqrt(s(s−a)(s−b)(s−c)) with s the half perimeter."""
    sp = sympy_module()
    ea, eb, ec = _exact(a, "a"), _exact(b, "b"), _exact(c, "c")
    if not (ea + eb > ec and eb + ec > ea and ea + ec > eb):
        raise CalculatorError(f"Sides {a}, {b}, {c} violate the triangle inequality (each side < sum of the others).")
    s = (ea + eb + ec) / 2
    return sp.sqrt(s * (s - ea) * (s - eb) * (s - ec))


def polygon_interior_angle(n: int) -> Any:
    """Each interior angle of a regular n-gon, in degrees: 180(n − 2)/n."""
    if isinstance(n, bool) or not isinstance(n, int) or not 3 <= n <= 10**6:
        raise CalculatorError(f"Expected the number of sides n to be an integer >= 3, got {n!r}.")
    return sympy_module().Rational(180 * (n - 2), n)


def arc_length(radius: float, angle_deg: float) -> Any:
    """Length of an arc of a circle: 2πr · angle/360."""
    sp = sympy_module()
    r, theta = _exact(radius, "radius"), _exact(angle_deg, "angle_deg")
    if theta > 360:
        raise CalculatorError(f"Expected 0 < angle_deg <= 360, got {angle_deg!r}.")
    return sp.pi * r * theta / 180


__all__ = ["calculate", "evaluate", "format_value", "law_of_cosines", "law_of_sines", "triangle_area", "polygon_interior_angle",
           "arc_length", "CalculatorError"]
