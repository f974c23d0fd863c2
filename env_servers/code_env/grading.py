"""Grading outside the untrusted process: harness source in, serialized outputs out, comparison on the host.

The sandbox only ever sees test *inputs*. For a call-based task the harness calls the
submission's function on each input and prints one line per test, ``<nonce> <index> <typed JSON>``;
the host parses those lines and compares them with expected values it encoded itself. The
typed encoding accepts only exact built-in types (``type(x) is int``, never a subclass), so an
object whose ``__eq__`` always returns True, a patched ``unittest`` or an early ``sys.exit(0)``
earns nothing: a test counts only when its correct value was printed. For stdin/stdout tasks
the program's stdout is compared with the expected text, whitespace-normalised per line.
Pure functions: no sandbox, no envhub.
"""

from __future__ import annotations

import json
import math
import secrets
from typing import Any

# One source for the typed encoder: exec'd here for expected values, embedded in the harness.
ENCODER_SOURCE = '''
def _envhub_encode(x, _depth=0):
    if _depth > 50:
        raise TypeError("value nested too deeply")
    t = type(x)
    if x is None:
        return None
    if t is bool:
        return {"bool": x}
    if t is int:
        return {"int": str(x)}
    if t is float:
        return {"float": repr(x)}
    if t is str:
        return {"str": x}
    if t is list or t is tuple:
        return {"list": [_envhub_encode(v, _depth + 1) for v in x]}
    if t is dict:
        items = [[_envhub_encode(k, _depth + 1), _envhub_encode(v, _depth + 1)] for k, v in x.items()]
        return {"dict": sorted(items, key=lambda kv: _envhub_json(kv[0]))}
    if t is set or t is frozenset:
        return {"set": sorted((_envhub_encode(v, _depth + 1) for v in x), key=_envhub_json)}
    raise TypeError("unsupported return type " + t.__name__ + ": return built-in values (int, float, str, "
                    "bool, None, list, tuple, dict, set)")
'''

_HARNESS = '''
import functools as _envhub_ft, json as _envhub_json_mod, os as _envhub_os, sys as _envhub_sys
_envhub_json = _envhub_ft.partial(_envhub_json_mod.dumps, sort_keys=True)
_envhub_write = _envhub_os.write
{encoder}
# the submission's own prints must not crowd the reports out of the capped stdout
_envhub_sys.stdout = open(_envhub_os.devnull, "w")
_envhub_source = {source!r}
_envhub_ns = {{"__name__": "solution", "__builtins__": __builtins__}}
exec(compile(_envhub_source, "solution.py", "exec"), _envhub_ns)
_envhub_fn = _envhub_ns.get({entry_point!r})
if not callable(_envhub_fn):
    print("solution.py does not define a function named {entry_point}", file=_envhub_sys.stderr)
    raise SystemExit(1)
for _envhub_i, _envhub_args in enumerate(_envhub_json_mod.loads({inputs!r})):
    try:
        _envhub_out = "ok " + _envhub_json(_envhub_encode(_envhub_fn(*_envhub_args)))
    except BaseException as _envhub_exc:
        _envhub_out = "error " + type(_envhub_exc).__name__
    _envhub_write(1, ("\\n{nonce} %d %s\\n" % (_envhub_i, _envhub_out)).encode("utf-8", "backslashreplace"))
'''

_ns: dict[str, Any] = {"_envhub_json": lambda v: json.dumps(v, sort_keys=True)}
exec(ENCODER_SOURCE, _ns)
_encode = _ns["_envhub_encode"]


def encode_value(value: Any) -> Any:
    """The typed JSON form of a return value (raises TypeError for unsupported types)."""
    return _encode(value)


def decode_value(typed: Any) -> Any:
    """Back from the typed form to a Python value (for showing examples to the model)."""
    if typed is None:
        return None
    ((kind, raw),) = typed.items()
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    if kind == "list":
        return [decode_value(v) for v in raw]
    if kind == "dict":
        return {_hashable(decode_value(k)): decode_value(v) for k, v in raw}
    if kind == "set":
        return {_hashable(decode_value(v)) for v in raw}
    return raw


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def call_harness(source: str, entry_point: str, inputs: list[list[Any]]) -> tuple[str, str]:
    """(harness program, nonce) calling ``entry_point(*args)`` for every input list."""
    nonce = secrets.token_hex(8)
    code = _HARNESS.format(encoder=ENCODER_SOURCE, source=source, entry_point=entry_point,
                           inputs=json.dumps(inputs), nonce=nonce)
    return code, nonce


def parse_call_output(stdout: str, nonce: str, n_tests: int) -> list[Any]:
    """Per test: ``("ok", typed_value)``, ``("error", exception_name)`` or None when nothing was reported."""
    results: list[Any] = [None] * n_tests
    for line in stdout.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 3 or parts[0] != nonce or not parts[1].isdigit():
            continue
        index = int(parts[1])
        if not 0 <= index < n_tests or results[index] is not None:
            continue  # one report per test; a forged line still needs the right value to count
        if parts[2] == "ok" and len(parts) == 4:
            try:
                results[index] = ("ok", json.loads(parts[3]))
            except ValueError:
                results[index] = ("error", "unparsable output")
        elif parts[2] == "error":
            results[index] = ("error", parts[3] if len(parts) == 4 else "error")
    return results


def values_match(actual: Any, expected: Any, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """Compare two typed encodings: exact types, floats within tolerance (ints are never floats)."""
    if expected is None or actual is None:
        return actual is None and expected is None
    if not (isinstance(actual, dict) and isinstance(expected, dict)) or actual.keys() != expected.keys():
        return False
    (kind,) = expected.keys()
    a, e = actual[kind], expected[kind]
    if kind == "float":
        try:
            fa, fe = float(a), float(e)
        except (TypeError, ValueError):
            return False
        return fa == fe or math.isclose(fa, fe, rel_tol=rel_tol, abs_tol=abs_tol)
    if kind in ("list", "set"):
        return isinstance(a, list) and len(a) == len(e) and all(values_match(x, y) for x, y in zip(a, e))
    if kind == "dict":
        return (isinstance(a, list) and len(a) == len(e)
                and all(isinstance(p, list) and len(p) == 2 and values_match(p[0], q[0]) and values_match(p[1], q[1])
                        for p, q in zip(a, e)))
    return a == e and type(a) is type(e)


def normalize_stdout(text: str) -> str:
    """Trailing spaces on each line and trailing blank lines do not count."""
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def stdout_matches(actual: str, expected: str) -> bool:
    return normalize_stdout(actual) == normalize_stdout(expected)


def score(passed: int, total: int, mode: str = "fraction") -> float:
    """Reward for ``passed`` of ``total`` tests: the fraction, or 1/0 with ``all_or_nothing``."""
    if total <= 0:
        return 0.0
    if mode == "all_or_nothing":
        return float(passed == total)
    return passed / total
