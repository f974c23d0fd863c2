"""``FunctionTool``: a plain Python function (sync or async) as an OpenAI function tool, run on the client side.

The schema follows the same rules as an env's ``@tool`` methods (type hints, ``Annotated``
descriptions, defaults, the docstring's first paragraph and ``Args:`` lines), and arguments are
validated the same way before the function runs.

>>> from typing import Annotated
>>> def add(a: Annotated[int, "first term"], b: int = 0) -> int:
...     '''Add two integers.'''
...     return a + b
>>> calc = FunctionTool(add)
>>> calc.tool_info()["function"]["parameters"]["required"], calc(a=2, b=3)
(['a'], '5')
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from typing import Any, Callable

from envhub.tools import ToolInfo, tool, validate_arguments
from envhub.types import ToolSpec


class FunctionTool:
    """A function whose calls run in this process, next to env tools in a :class:`~envhub.ToolManager`.

    Returns the function's result as text (strings as they are, anything else as JSON). A result
    that is a :class:`~envhub.types.Observation`-like object with ``text`` gives that text.
    """

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None):
        if not callable(fn):
            raise TypeError(f"Expected a function, got {type(fn).__name__}.")
        target = fn
        if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
            target = getattr(fn, "__call__")  # a callable object: its __call__ carries the signature
        info: ToolInfo | None = getattr(target, "__envhub_tool__", None)
        if info is None or name is not None or description is not None:
            info = tool(_metadata_holder(target), name=name or getattr(fn, "__name__", type(fn).__name__),
                        description=description).__envhub_tool__
        self.fn = fn
        self.info = info
        self.name = info.spec.name
        self.is_async = inspect.iscoroutinefunction(target)

    @property
    def spec(self) -> ToolSpec:
        return self.info.spec

    def tool_info(self) -> dict[str, Any]:
        """``{"type": "function", "function": {"name", "description", "parameters"}}``."""
        return self.spec.to_openai()

    def __call__(self, /, **arguments: Any) -> str:
        """Validate the arguments, run the function, return its result as text (``ValueError`` on bad arguments)."""
        if self.is_async:
            raise TypeError(f"Tool {self.name!r} is an async function; use `await tool.acall(...)`.")
        return _as_text(self.fn(**validate_arguments(self.info, arguments)))

    async def acall(self, /, **arguments: Any) -> str:
        """The async form: an async function is awaited, a sync one runs in a worker thread."""
        kwargs = validate_arguments(self.info, arguments)
        if self.is_async:
            return _as_text(await self.fn(**kwargs))
        return _as_text(await asyncio.to_thread(self.fn, **kwargs))


def _metadata_holder(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in carrying ``fn``'s signature, docstring and hints, for ``@tool`` to read without
    marking the user's own function (``functools.wraps`` keeps the path to its globals)."""

    @functools.wraps(fn)
    def holder(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return holder


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    text = getattr(value, "text", None)
    if isinstance(text, str):
        return text
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


__all__ = ["FunctionTool"]
