"""Envs registered by installed distributions: the ``envhub.envs`` entry-point group.

A distribution registers each env class under a short name in its ``pyproject.toml``::

    [project.entry-points."envhub.envs"]
    guess = "guess_env.env:GuessEnv"

After ``pip install``, ``envhub serve guess``, ``envhub check guess``, ``envhub eval --env guess``
and compose ``command: envhub serve guess`` find it, and ``envhub list`` shows it. Discovery
reads ``importlib.metadata`` only: listing names imports nothing. A name that two distributions
register is a conflict, never silently shadowed: :func:`resolve` refuses it naming both
distributions, and ``envhub list`` shows it as a problem.

>>> resolve("my_env:GuessEnv")    # a "module:Class" target passes through unchanged
'my_env:GuessEnv'
"""

from __future__ import annotations

import importlib.metadata
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from envhub.errors import EnvHubError

GROUP = "envhub.envs"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def import_target(target: str, *, expected: str) -> Any:
    """The object a ``"package.module:attr"`` string names (``attr`` may be dotted: ``Outer.Inner``).

    ``expected`` says what the caller wants, for the error (``"an env like 'my_env:GuessEnv'"``): a string
    of any other shape, or an attribute the module lacks, raises ValueError naming it; the module's own
    import errors propagate unchanged.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"Expected {expected}, got {target!r}.")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"Module {module_name!r} has no attribute {attr!r}; expected {expected}.") from None
    return obj


class EnvNameConflictError(EnvHubError, ValueError):
    """Two installed distributions register the same env name."""


class EnvEntryImportError(EnvHubError, ImportError):
    """A registered entry point does not import, or does not name an ``envhub.Env`` subclass."""


@dataclass(frozen=True)
class EnvEntry:
    """One registered env: its name, its ``module:Class`` target and the distribution that registers it."""

    name: str
    target: str
    distribution: str
    version: str

    def load(self) -> type[Any]:
        """The env class; a failure raises :class:`EnvEntryImportError` naming the distribution."""
        from envhub.env import Env

        try:
            obj = import_target(self.target, expected="an entry point like 'my_env:GuessEnv'")
        except Exception as exc:  # any error while importing a third-party module is that entry's failure
            raise EnvEntryImportError(
                f"env {self.name!r} = {self.target!r} (registered by {self.distribution} {self.version}) failed to "
                f"import: {type(exc).__name__}: {exc}") from exc
        if not (isinstance(obj, type) and issubclass(obj, Env)):
            raise EnvEntryImportError(f"env {self.name!r} = {self.target!r} (registered by {self.distribution}) is "
                                      f"{obj!r}, expected an envhub.Env subclass.")
        return obj


@dataclass
class EnvDescription:
    """What ``envhub list`` shows for one registered env (``error`` set when it did not load)."""

    entry: EnvEntry
    tools: list[str] = field(default_factory=list)
    summary: str = ""
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.entry.name, "class": self.entry.target, "distribution": self.entry.distribution,
                "version": self.entry.version, "tools": self.tools, "description": self.summary,
                "error": self.error}


def installed_distributions() -> list[importlib.metadata.Distribution]:
    """One distribution per name: an installed one (``.dist-info``) over a build leftover (``.egg-info``).

    ``importlib.metadata`` keeps the first copy of a name on ``sys.path``; run from a source tree,
    that is the tree's stale ``NAME.egg-info`` (``python -m`` puts the working directory first), whose
    entry points may predate the installed ones.
    """
    chosen: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions():
        name = re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "")).lower()
        if name and (name not in chosen or (_is_egg_info(chosen[name]) and not _is_egg_info(dist))):
            chosen[name] = dist
    return list(chosen.values())


def _is_egg_info(dist: importlib.metadata.Distribution) -> bool:
    return str(getattr(dist, "_path", "")).endswith(".egg-info")


def group_entry_points(group: str) -> list[tuple[importlib.metadata.EntryPoint, importlib.metadata.Distribution]]:
    """Every entry point of ``group`` with the distribution that declares it (see :func:`installed_distributions`)."""
    return [(ep, dist) for dist in installed_distributions() for ep in dist.entry_points if ep.group == group]


def registered() -> dict[str, list[EnvEntry]]:
    """Every registered name with the entries that claim it (more than one: a conflict), sorted by name."""
    by_name: dict[str, list[EnvEntry]] = defaultdict(list)
    for ep, dist in group_entry_points(GROUP):
        entry = EnvEntry(ep.name, ep.value, dist.metadata["Name"] or "unknown distribution", dist.version or "?")
        if entry not in by_name[ep.name]:
            by_name[ep.name].append(entry)
    return dict(sorted(by_name.items()))


def lookup(name: str) -> EnvEntry:
    """The one entry registered as ``name``; an unknown name or a conflict raises with the fix."""
    entries = registered()
    found = entries.get(name)
    if not found:
        known = ", ".join(entries) or "none"
        raise ValueError(f"Expected an env as 'module:Class' or a registered name, got {name!r}: no installed "
                         f"distribution registers it in the {GROUP!r} entry-point group (registered: {known}). "
                         "Install the env's package (pip install -e ./my_env) or pass module:Class.")
    if len(found) > 1:
        raise EnvNameConflictError(
            f"env name {name!r} is registered by {len(found)} distributions: "
            + "; ".join(f"{e.distribution} {e.version} ({e.target})" for e in found)
            + ". Uninstall one of them, or pass the class you mean as module:Class.")
    return found[0]


def resolve(target: str) -> str:
    """A ``module:Class`` target for ``target``: itself when it has a colon, else the registered name's."""
    if ":" in target:
        return target
    if not _NAME.fullmatch(target):
        raise ValueError(f"Expected an env as 'module:Class' (e.g. my_env:GuessEnv) or a registered name, "
                         f"got {target!r}.")
    return lookup(target).target


def describe(entry: EnvEntry) -> EnvDescription:
    """Load ``entry`` and read its tools and the first line of its docstring (a failure is kept, not raised)."""
    try:
        cls = entry.load()
    except EnvEntryImportError as exc:
        return EnvDescription(entry, error=str(exc))
    try:
        tools = [spec.name for spec in cls.tools()]
    except Exception as exc:  # a malformed env class is that entry's problem, not the listing's
        return EnvDescription(entry, error=f"env {entry.name!r}: tools() raised {type(exc).__name__}: {exc}")
    doc = (cls.__doc__ or "").strip().splitlines()
    return EnvDescription(entry, tools=tools, summary=doc[0].strip() if doc else "")


__all__ = ["GROUP", "import_target", "installed_distributions", "group_entry_points", "EnvEntry", "EnvDescription",
           "EnvNameConflictError", "EnvEntryImportError", "registered", "lookup", "resolve", "describe"]
