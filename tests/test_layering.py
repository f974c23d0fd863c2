"""The import rules of DESIGN.md, checked on the source: imports point only downstream.

- ``envhub`` never imports torch, trainer, adapters or env_servers;
- ``env_servers`` import envhub and their own domain deps, never trainer or adapters; an env server
  (``env_servers/<name>_env``) never imports another one: shared domain code lives in the shared
  modules beside them (``math_grading``, ``sandbox``, ``datasets``, ``serve_cli``), which import no env;
- ``trainer`` imports envhub but never env_servers;
- ``adapters`` import what they adapt (openenv, gymnasium, openai, trl, torch...) lazily, inside functions.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FORBIDDEN = {
    "envhub": {"torch", "trainer", "adapters", "env_servers", "transformers", "peft"},
    "env_servers": {"trainer", "adapters", "torch"},
    "trainer": {"env_servers", "adapters"},
}
# Adapters may import these only inside functions.
ADAPTER_LAZY = {"openenv", "gymnasium", "gym", "openai", "trl", "torch", "transformers", "datasets"}


def _imports(tree: ast.AST, *, top_level_only: bool = False):
    nodes = tree.body if top_level_only else ast.walk(tree)  # type: ignore[attr-defined]
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module.split(".")[0]
        elif top_level_only and isinstance(node, (ast.If, ast.Try)):
            # `if TYPE_CHECKING:` blocks and try/except ImportError at module level still count as top level
            for lineno, name in _imports(ast.Module(body=list(ast.iter_child_nodes(node)), type_ignores=[]),
                                         top_level_only=True):
                yield lineno, name


def _sources(package: str):
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_point_downstream(package: str) -> None:
    violations = []
    for path in _sources(package):
        tree = ast.parse(path.read_text(), filename=str(path))
        for lineno, name in _imports(tree):
            if name in FORBIDDEN[package]:
                violations.append(f"{path.relative_to(ROOT)}:{lineno} imports {name}")
    assert not violations, "layering violations:\n" + "\n".join(violations)


def _module_names(tree: ast.AST):
    """Every absolute module an import names, ``from env_servers import math_env`` as ``env_servers.math_env``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def _env_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "env_servers" and parts[1].endswith("_env") else None


def test_env_servers_are_independent_of_each_other() -> None:
    envs = sorted(p.name for p in (ROOT / "env_servers").iterdir() if p.is_dir() and p.name.endswith("_env"))
    assert {"math_env", "geometry_env", "code_env", "gomoku_env"} <= set(envs)
    violations = []
    for path in _sources("env_servers"):
        rel = path.relative_to(ROOT / "env_servers")
        own = rel.parts[0] if rel.parts[0].endswith("_env") else None  # None: a shared module
        tree = ast.parse(path.read_text(), filename=str(path))
        for lineno, module in _module_names(tree):
            other = _env_of(module)
            if other is not None and other != own:
                violations.append(f"env_servers/{rel}:{lineno} imports {module}")
    assert not violations, ("an env server imports another (move the shared code to a shared module):\n"
                            + "\n".join(violations))


def test_a_server_session_sees_only_its_narrow_context() -> None:
    """``Session`` works through ``SessionContext``: it never imports the hub (the session registry)."""
    tree = ast.parse((ROOT / "envhub" / "server" / "session.py").read_text())
    assert "envhub.server.hub" not in {module for _, module in _module_names(tree)}
    assert re.search(r"\bHub\b|\.hub\b", (ROOT / "envhub" / "server" / "session.py").read_text()) is None


def test_adapters_import_their_targets_lazily() -> None:
    violations = []
    for path in _sources("adapters"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for lineno, name in _imports(tree, top_level_only=True):
            if name in ADAPTER_LAZY:
                violations.append(f"{path.relative_to(ROOT)}:{lineno} imports {name} at module level")
    assert not violations, "adapters must import what they adapt inside functions:\n" + "\n".join(violations)


def test_importing_envhub_does_not_load_heavy_modules() -> None:
    import subprocess
    import sys

    code = "import sys, envhub; print(sorted(m for m in ('torch', 'transformers', 'sympy', 'trainer') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"`import envhub` pulled in heavy modules: {out}"


def test_scheduler_imports_neither_torch_nor_the_rest_of_trainer_and_ray_only_in_its_backend() -> None:
    violations = []
    for path in _sources("trainer/scheduler"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for lineno, module in _module_names(tree):
            top = module.split(".")[0]
            outside = top == "trainer" and module != "trainer.scheduler" and not module.startswith("trainer.scheduler.")
            ray_outside = top == "ray" and not path.name.startswith("_ray")  # the Ray backend's modules
            if top in ("torch", "transformers") or outside or ray_outside:
                violations.append(f"{path.relative_to(ROOT)}:{lineno} imports {module}")
    assert not violations, "the scheduler imports only itself (and ray in its Ray backend):\n" + "\n".join(violations)
