"""Safe, bounded parsing of math expressions (LaTeX or calculator syntax) into sympy values.

Nothing here calls ``eval`` or sympy's string parser: text is tokenised, rewritten to a small
Python-expression subset, parsed with :mod:`ast`, and every node is checked against a
whitelist before the matching sympy object is built. Sizes are capped (input length, node
count, integer digits, exponent magnitude), so a model's ``9^9^9^9`` or ``10^{10^{100}}``
is rejected in microseconds instead of hanging a server thread. Garbage is data: the public
functions return ``None`` instead of raising.
"""

from __future__ import annotations

import ast
import math
import re
from functools import lru_cache
from typing import Any

MAX_EXPR_CHARS = 400
MAX_NODES = 200
MAX_INT_DIGITS = 60
MAX_RESULT_BITS = 4096  # an exact power may have at most this many bits
MAX_SYMBOLIC_EXPONENT = 64
MAX_ROOT_DEGREE = 16

_FUNCTIONS_1 = ("sqrt", "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan",
                "sinh", "cosh", "tanh", "exp", "log", "ln", "abs", "floor", "ceil")
#: calculator-only helpers: trigonometry in degrees
_DEGREE_FUNCTIONS = ("sind", "cosd", "tand", "asind", "acosd", "atand", "deg", "rad")
_CONSTANTS = ("pi", "oo", "E", "I")

_LATEX_WORDS = {
    r"\cdot": "*", r"\times": "*", r"\div": "/", r"\pi": " pi ", r"\infty": " oo ", r"\infinity": " oo ",
    r"\ln": " ln ", r"\log": " log ", r"\exp": " exp ", r"\sin": " sin ", r"\cos": " cos ",
    r"\tan": " tan ", r"\cot": " cot ", r"\sec": " sec ", r"\csc": " csc ", r"\arcsin": " asin ",
    r"\arccos": " acos ", r"\arctan": " atan ", r"\theta": " theta ", r"\alpha": " alpha ",
    r"\beta": " beta ", r"\le": "<=", r"\ge": ">=",
}
_GREEK = ("theta", "alpha", "beta")
#: numbers (with an optional exponent: ``1e3``, ``2.5E-3``; ``2e`` stays 2 times e), words, operators
_TOKEN = re.compile(r"\s*(?:((?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)|([A-Za-z]+)|(\*\*|[-+*/(),^]))")


class ExpressionError(ValueError):
    """An expression outside the safe subset (the message says which rule it broke)."""


def sympy_module() -> Any:
    """Import sympy on first use, so that importing an env module stays cheap."""
    import sympy

    return sympy


# -- LaTeX -> calculator syntax ------------------------------------------------------------

def _brace_group(s: str, start: int) -> tuple[str, int] | None:
    """The content of the ``{...}`` group opening at ``s[start]`` and the index after it."""
    if start >= len(s) or s[start] != "{":
        return None
    depth = 0
    for i in range(start, len(s)):
        if s[i] == "{":
            depth += 1
        elif s[i] == "}":
            depth -= 1
            if depth == 0:
                return s[start + 1:i], i + 1
    return None


def _rewrite_command(s: str, name: str, arity: int, template: str) -> str:
    """Replace ``\\name{a}{b}`` by ``template.format(a, b)``, innermost groups handled recursively."""
    out: list[str] = []
    i = 0
    while True:
        j = s.find(name, i)
        if j < 0:
            return "".join(out) + s[i:]
        out.append(s[i:j])
        k = j + len(name)
        args: list[str] = []
        if name == r"\sqrt" and k < len(s) and s[k] == "[":
            close = s.find("]", k)
            if close < 0:
                raise ExpressionError("unclosed \\sqrt[")
            args.append(s[k + 1:close])
            k = close + 1
        for _ in range(arity):
            group = _brace_group(s, k)
            if group is None:  # \frac12, \sqrt3: single-character arguments
                if k >= len(s) or not s[k].isalnum():
                    raise ExpressionError(f"{name} needs braced arguments")
                group = (s[k], k + 1)
            args.append(_latex_to_calc(group[0]))
            k = group[1]
        if len(args) == arity + 1:  # \sqrt[n]{x}
            out.append(f"(({args[1]})**(1/({_latex_to_calc(args[0])})))")
        else:
            out.append(template.format(*args))
        i = k


def _latex_to_calc(s: str) -> str:
    for cmd in (r"\dfrac", r"\tfrac"):
        s = s.replace(cmd, r"\frac")
    s = _rewrite_command(s, r"\frac", 2, "(({0})/({1}))")
    s = _rewrite_command(s, r"\sqrt", 1, "sqrt({0})")
    for word in sorted(_LATEX_WORDS, key=len, reverse=True):  # replacements hold no backslash: literal
        s = re.sub(re.escape(word) + r"(?![A-Za-z])", _LATEX_WORDS[word], s)
    s = s.replace(r"\left", "").replace(r"\right", "").replace(r"\,", "").replace(r"\!", "")
    if "\\" in s:
        raise ExpressionError(f"unsupported LaTeX command in {s[:40]!r}")
    return s.replace("{", "(").replace("}", ")").replace("[", "(").replace("]", ")")


# -- tokenising with implicit multiplication ---------------------------------------------

def _tokens(s: str, functions: frozenset[str], strict: bool = False) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos, s = 0, s.rstrip()
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if m is None:
            raise ExpressionError(f"unexpected character {s[pos:pos + 1]!r}")
        pos = m.end()
        number, word, op = m.groups()
        if number is not None:
            out.append(("num", number))
        elif op is not None:
            out.append(("op", "**" if op == "^" else op))
        else:
            out.extend(_split_word(word, functions, strict))
    return out


def _split_word(word: str, functions: frozenset[str], strict: bool = False) -> list[tuple[str, str]]:
    """``sqrt`` stays a function; ``xy`` is ``x*y``; ``pi``/``theta`` stay whole. ``strict`` (the calculator)
    refuses a word of several letters that is none of these (``factorial``, ``mod``: not ``f*a*c*...``)."""
    if word in functions:
        return [("fn", word)]
    if word in ("pi", "oo") or word in _GREEK:
        return [("name", word)]
    if word.lower() in ("inf", "infty", "infinity"):
        return [("name", "oo")]
    if strict and len(word) > 1:
        raise ExpressionError(f"unknown function or name {word[:40]!r}; the functions are {', '.join(sorted(functions))}"
                              ", the constants pi and e, and single-letter symbols")
    return [("name", ch) for ch in word]


def _with_implicit_products(tokens: list[tuple[str, str]]) -> str:
    parts: list[str] = []
    prev: tuple[str, str] | None = None
    for tok in tokens:
        if prev is not None:
            left = prev[0] in ("num", "name") or prev == ("op", ")")
            right = tok[0] in ("num", "name", "fn") or tok == ("op", "(")
            if left and right:
                parts.append("*")
        parts.append(_num_literal(tok[1]) if tok[0] == "num" else tok[1])
        prev = tok
    return "".join(parts)


def _num_literal(text: str) -> str:
    """Decimals and scientific notation become exact ratios so that ``0.1`` is 1/10, not the nearest float, and
    ``2.5e-3`` is 1/400. An exponent past ``MAX_INT_DIGITS`` is refused (``1e999`` is no number to build)."""
    mantissa, _, exp_text = text.lower().partition("e")
    exponent = int(exp_text) if exp_text else 0
    whole, _, frac = mantissa.partition(".")
    frac = frac.rstrip("0")
    digits, exponent = (whole or "0") + frac, exponent - len(frac)
    if abs(exponent) > MAX_INT_DIGITS:
        raise ExpressionError(f"number {text[:40]!r} is out of range (exponent beyond {MAX_INT_DIGITS} digits)")
    if exponent >= 0:
        return str(int(digits)) + "0" * exponent if int(digits) else "0"
    return f"({int(digits)}/1{'0' * -exponent})"


def to_python_syntax(text: str, *, latex: bool = True, functions: frozenset[str] | None = None,
                     strict: bool = False) -> str:
    """Rewrite ``text`` into the Python-expression subset :func:`parse_expression` accepts (``strict``: no
    word of several letters but the functions and constants)."""
    if len(text) > MAX_EXPR_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPR_CHARS} characters")
    funcs = functions if functions is not None else frozenset(_FUNCTIONS_1)
    s = _latex_to_calc(text) if latex else text
    return _with_implicit_products(_tokens(s, funcs, strict))


# -- AST -> sympy, node by node ---------------------------------------------------------

class _Builder:
    def __init__(self, functions: frozenset[str]):
        self.sp = sympy_module()
        self.functions = functions
        self.nodes = 0

    def build(self, node: ast.AST) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise ExpressionError(f"expression has more than {MAX_NODES} parts")
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            raise ExpressionError(f"{type(node).__name__} is not allowed")
        return method(node)

    def _Constant(self, node: ast.Constant) -> Any:
        if isinstance(node.value, bool) or not isinstance(node.value, int):
            raise ExpressionError(f"literal {node.value!r} is not a number")
        if len(str(node.value)) > MAX_INT_DIGITS:
            raise ExpressionError(f"integer with more than {MAX_INT_DIGITS} digits")
        return self.sp.Integer(node.value)

    def _Name(self, node: ast.Name) -> Any:
        sp = self.sp
        named = {"pi": sp.pi, "oo": sp.oo, "E": sp.E, "e": sp.E, "I": sp.I, "i": sp.I}
        if node.id in named:
            return named[node.id]
        if len(node.id) == 1 or node.id in _GREEK:
            return sp.Symbol(node.id)
        raise ExpressionError(f"unknown name {node.id!r}")

    def _UnaryOp(self, node: ast.UnaryOp) -> Any:
        value = self.build(node.operand)
        if isinstance(node.op, ast.USub):
            return -value
        if isinstance(node.op, ast.UAdd):
            return value
        raise ExpressionError("only unary + and - are allowed")

    def _BinOp(self, node: ast.BinOp) -> Any:
        left, right = self.build(node.left), self.build(node.right)
        op = type(node.op)
        if op is ast.Add:
            return left + right
        if op is ast.Sub:
            return left - right
        if op is ast.Mult:
            return left * right
        if op is ast.Div:
            return left / right
        if op is ast.Pow:
            _check_power(self.sp, left, right)
            return left ** right
        raise ExpressionError(f"operator {op.__name__} is not allowed")

    def _Call(self, node: ast.Call) -> Any:
        if not isinstance(node.func, ast.Name) or node.func.id not in self.functions or node.keywords:
            raise ExpressionError("only calls of whitelisted functions are allowed")
        if len(node.args) != 1:
            raise ExpressionError(f"{node.func.id}() takes one argument")
        return _apply(self.sp, node.func.id, self.build(node.args[0]))


def _check_power(sp: Any, base: Any, exp: Any) -> None:
    """Refuse powers whose exact value would be huge: the guard against exponent towers."""
    if exp.free_symbols or base.free_symbols:
        if exp.is_number and abs(exp) > MAX_SYMBOLIC_EXPONENT:
            raise ExpressionError(f"symbolic power with exponent above {MAX_SYMBOLIC_EXPONENT}")
        if exp.free_symbols and base.free_symbols:
            raise ExpressionError("a symbol raised to a symbolic power is not supported")
        return
    if not exp.is_Rational:
        if exp.is_number and abs(sp.N(exp, 15)) > MAX_SYMBOLIC_EXPONENT:
            raise ExpressionError("irrational exponent too large")
        return
    if exp.q > MAX_ROOT_DEGREE:
        raise ExpressionError(f"root of degree above {MAX_ROOT_DEGREE}")
    if base.is_Rational:
        bits = max(abs(base.p).bit_length(), base.q.bit_length(), 1)
        if bits * abs(exp.p) > MAX_RESULT_BITS:
            raise ExpressionError(f"power with more than {MAX_RESULT_BITS} bits")
    elif abs(exp.p) > MAX_SYMBOLIC_EXPONENT:
        raise ExpressionError(f"power of an irrational number with exponent above {MAX_SYMBOLIC_EXPONENT}")


def _apply(sp: Any, name: str, arg: Any) -> Any:
    deg = sp.pi / 180
    table = {
        "sqrt": sp.sqrt, "sin": sp.sin, "cos": sp.cos, "tan": sp.tan, "cot": sp.cot, "sec": sp.sec,
        "csc": sp.csc, "asin": sp.asin, "acos": sp.acos, "atan": sp.atan, "sinh": sp.sinh,
        "cosh": sp.cosh, "tanh": sp.tanh, "exp": sp.exp, "log": sp.log, "ln": sp.log, "abs": sp.Abs,
        "floor": sp.floor, "ceil": sp.ceiling,
        "sind": lambda x: sp.sin(x * deg), "cosd": lambda x: sp.cos(x * deg), "tand": lambda x: sp.tan(x * deg),
        "asind": lambda x: sp.asin(x) / deg, "acosd": lambda x: sp.acos(x) / deg,
        "atand": lambda x: sp.atan(x) / deg, "deg": lambda x: x / deg, "rad": lambda x: x * deg,
    }
    if name in ("exp", "sinh", "cosh", "tanh") and arg.is_number and abs(sp.N(arg, 15)) > 10_000:
        raise ExpressionError(f"{name}() argument too large")
    return table[name](arg)


def parse_expression(text: str, *, latex: bool = True, calculator: bool = False) -> Any:
    """Parse one expression into a sympy value; raise :class:`ExpressionError` when outside the safe subset.

    ``latex`` accepts ``\\frac``, ``\\sqrt``, ``\\pi``, ``^``...; ``calculator`` adds degree-based
    trigonometry (``sind(30)``) for the geometry calculator tool.

    >>> parse_expression(r"\\frac{\\sqrt{8}}{2}")
    sqrt(2)
    """
    functions = frozenset(_FUNCTIONS_1 + (_DEGREE_FUNCTIONS if calculator else ()))
    return _parse_cached(text.strip(), latex, functions, calculator)


@lru_cache(maxsize=4096)
def _parse_cached(text: str, latex: bool, functions: frozenset[str], strict: bool = False) -> Any:
    if not text:
        raise ExpressionError("empty expression")
    source = to_python_syntax(text, latex=latex, functions=functions, strict=strict)
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ExpressionError(f"not an expression: {exc}") from None
    try:
        value = _Builder(functions).build(tree.body)
    except ExpressionError:
        raise
    except Exception as exc:  # sympy internals on odd input (MemoryError, RecursionError, ...): data, not a crash
        raise ExpressionError(f"cannot evaluate: {type(exc).__name__}: {exc}") from None
    sp = sympy_module()
    if value.has(sp.zoo, sp.nan):
        raise ExpressionError("undefined value (division by zero?)")
    return value


def is_cheap(text: str, *, latex: bool = True, calculator: bool = False) -> bool:
    """True when building ``text`` is cheap for sure: rational arithmetic, symbols, pi, ``sqrt``, rational powers.

    Anything else (trigonometry, logarithms, irrational or symbolic exponents) may make sympy's
    automatic evaluation slow, so callers run it through :mod:`.bounded` under a deadline.
    Unparsable text counts as cheap: :func:`parse_expression` rejects it at once.
    """
    functions = frozenset(_FUNCTIONS_1 + (_DEGREE_FUNCTIONS if calculator else ()))
    try:
        tree = ast.parse(to_python_syntax(text.strip(), latex=latex, functions=functions, strict=calculator), mode="eval")
    except Exception:
        return True
    return _cheap(tree.body, in_exponent=False)


def _cheap(node: ast.AST, in_exponent: bool) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Name):
        return not in_exponent
    if isinstance(node, ast.UnaryOp):
        return _cheap(node.operand, in_exponent)
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Pow):
            return not in_exponent and _cheap(node.left, False) and _cheap(node.right, True)
        return isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)) and \
            _cheap(node.left, in_exponent) and _cheap(node.right, in_exponent)
    if isinstance(node, ast.Call):
        return (not in_exponent and isinstance(node.func, ast.Name) and node.func.id == "sqrt"
                and len(node.args) == 1 and _cheap(node.args[0], False))
    return False


def try_parse(text: str, **kwargs: Any) -> Any | None:
    """:func:`parse_expression`, or ``None`` for anything outside the safe subset."""
    try:
        return parse_expression(text, **kwargs)
    except ExpressionError:
        return None
    except Exception:  # sympy internals on odd input: garbage in, None out
        return None


def numeric_value(value: Any, digits: int = 30) -> complex | None:
    """A finite complex number for a closed-form sympy value, or ``None``."""
    try:
        number = complex(sympy_module().N(value, digits))
    except (TypeError, ValueError, OverflowError):
        return None
    if not (math.isfinite(number.real) and math.isfinite(number.imag)):
        return None
    return number


__all__ = ["ExpressionError", "parse_expression", "try_parse", "is_cheap", "to_python_syntax", "numeric_value",
           "sympy_module", "MAX_EXPR_CHARS"]
