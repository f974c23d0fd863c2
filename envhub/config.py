"""Config dataclasses from keyword arguments: the one place that refuses unknown keys.

Env constructors, server settings and env CLIs all take keyword arguments into a dataclass;
an unknown key is a typo, so it is refused with the accepted names in the message.

>>> from dataclasses import dataclass
>>> @dataclass
... class BoardConfig:
...     size: int = 9
>>> from_kwargs(BoardConfig, {"size": 15})
BoardConfig(size=15)
>>> from_kwargs(BoardConfig, {"sise": 15})
Traceback (most recent call last):
...
envhub.errors.ConfigError: Unknown BoardConfig option(s) ['sise']; expected some of ['size'].
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields
from typing import Any, TypeVar

from envhub.errors import ConfigError

T = TypeVar("T")


def check_known(cls: type, keys: Iterable[str], *, what: str | None = None) -> None:
    """Raise :class:`ConfigError` naming the accepted fields when ``keys`` holds one ``cls`` lacks."""
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(keys) - set(names))
    if unknown:
        raise ConfigError(f"Unknown {what or cls.__name__} option(s) {unknown}; expected some of {sorted(names)}.")


def from_kwargs(cls: type[T], config: dict[str, Any], *, what: str | None = None) -> T:
    """``cls(**config)`` after :func:`check_known`; the dataclass validates the values themselves."""
    check_known(cls, config, what=what)
    return cls(**config)
