"""One ``check_env`` run per env class the project ships (env servers, their variants, the examples).

A new ``Env`` subclass under ``env_servers/`` or in ``examples/`` fails
``test_every_env_class_is_checked`` until it gets a case here.
"""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import env_servers
from envhub import Env
from envhub.testing import check_env

ROOT = Path(__file__).resolve().parents[1]


def _sandbox_ready() -> bool:
    from env_servers.sandbox import available_backends

    return os.geteuid() == 0 and "local-zygote" in available_backends()


needs_sandbox = pytest.mark.skipif(not _sandbox_ready(),
                                   reason="needs root and a working bubblewrap (apt-get install -y bubblewrap)")


@dataclass
class Case:
    """``check_env(cls, sample_action=action, **config)`` for the env class at ``target``."""

    target: str
    action: Any = None
    config: dict[str, Any] = field(default_factory=dict)
    marks: tuple[pytest.MarkDecorator, ...] = ()

    def param(self, label: str = "") -> Any:
        return pytest.param(self, id=self.target.rsplit(":", 1)[1] + (f"-{label}" if label else ""), marks=self.marks)


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"tool_name": name, "arguments": arguments}


CASES = [
    Case("envhub.testing:EchoEnv", {"message": "hi"}).param(),
    Case("examples.guess_env:GuessEnv", call("guess", number=50)).param(),
    Case("examples.shapes_env:ShapesEnv", {"text": "red"}).param(),
    Case("env_servers.math_env.env:MathEnv", {"text": r"\boxed{1}"}).param(),
    # model code runs through the plain local runner here: the check is the env contract, not isolation
    Case("env_servers.math_env.tool_env:MathToolEnv", call("submit_answer", answer="1"),
         {"python_runner": "local-subprocess"}).param(),
    Case("env_servers.geometry_env.env:GeometryEnv", call("calculate", expression="1+1")).param("tools"),
    Case("env_servers.geometry_env.env:GeometryEnv", {"text": r"<think>x</think>\boxed{1}"},
         {"mode": "single"}).param("single"),
    Case("env_servers.gomoku_env.env:GomokuEnv").param(),
    Case("env_servers.gomoku_env.env:GomokuEnv", {"text": "<move>4,4</move>"},
         {"board_size": 7, "opponent": "mix"}).param("text-7x7"),
    Case("env_servers.gomoku_env.match_env:GomokuMatchEnv", config={"turn_timeout_s": 0.5}).param(),
    Case("env_servers.code_env.env:CodeEnv", call("run_python", code="print('hi')"), marks=(needs_sandbox,)).param(),
]


def load(target: str) -> type[Env]:
    module, name = target.split(":")
    cls = getattr(importlib.import_module(module), name)
    assert isinstance(cls, type) and issubclass(cls, Env), target
    return cls


@pytest.mark.parametrize("case", CASES)
def test_check_env(case: Case) -> None:
    results = check_env(load(case.target), sample_action=case.action, **case.config)
    assert all(r.passed for r in results)


def _env_classes_in_env_servers() -> set[str]:
    for info in pkgutil.walk_packages(env_servers.__path__, "env_servers."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    found: set[str] = set()
    todo = list(Env.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("env_servers."):
            found.add(f"{cls.__module__}:{cls.__qualname__}")
    return found


def _env_classes_in_examples() -> set[str]:
    # read, not imported: the examples are scripts and some pull in heavy optional packages
    found = set()
    for path in sorted((ROOT / "examples").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            bases = {getattr(b, "id", getattr(b, "attr", "")) for b in getattr(node, "bases", [])}
            if isinstance(node, ast.ClassDef) and bases & {"Env", "MathEnv", "GomokuEnv"}:
                found.add(f"examples.{path.stem}:{node.name}")
    return found


def test_every_env_class_is_checked() -> None:
    checked = {p.values[0].target for p in CASES}
    shipped = _env_classes_in_env_servers() | _env_classes_in_examples()
    assert shipped, "found no env classes at all"
    assert shipped <= checked, f"env classes without a check_env case: {sorted(shipped - checked)}"


def test_every_env_server_class_is_registered_by_name() -> None:
    """envhub's pyproject.toml registers each env class of env_servers (``envhub serve math``...)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    registered = project["entry-points"]["envhub.envs"]
    assert set(registered.values()) == _env_classes_in_env_servers(), "register each env_servers class once"
    assert {"math", "gomoku", "gomoku_match", "geometry", "code"} <= set(registered)
