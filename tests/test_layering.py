"""The import rules of the repository, checked on the source: imports point only downstream.

- ``envhub`` never imports torch, trainer, adapters or env_servers;
- ``env_servers`` import envhub and their own domain deps, never trainer or adapters; an env server
  (``env_servers/<name>_env``) never imports another one: shared domain code lives in the shared
  modules beside them (``math_grading``, ``sandbox``, ``datasets``, ``serve_cli``), which import no env;
- ``trainer`` imports envhub but never env_servers, and inside it each layer of :data:`TRAINER_RANKS`
  imports only its own layer and the ones below (lazy imports inside functions count too), with no
  import cycle between its modules; ``trainer.scheduler`` imports neither torch nor the rest of trainer;
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


def test_eval_sits_on_top_of_the_sdk() -> None:
    """``envhub.eval`` (models against envs) uses the SDK; only the CLI reaches it, nothing in the SDK does.
    It finds a local model through the ``envhub.chat_models`` entry point, never by importing the trainer."""
    violations = []
    for path in _sources("envhub"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("envhub/eval/") or rel == "envhub/cli.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        violations += [f"{rel}:{lineno} imports {module}" for lineno, module in _module_names(tree)
                       if module == "envhub.eval" or module.startswith("envhub.eval.")]
    assert not violations, "the SDK must not depend on envhub.eval:\n" + "\n".join(violations)


# -- inside trainer: ranked layers, no cycles ------------------------------------------------------

#: trainer's layers, lowest first: a module imports only modules of its own rank or lower. The most
#: specific row (longest prefix) holds; every module needs one (a new package gets its row here).
TRAINER_RANKS: dict[str, int] = {
    # 0: the foundation: the policy model, its tokenizer and vision inputs, torch.distributed, metrics,
    #    export to Hugging Face format, the GPU scheduler (which imports nothing else of trainer: see below),
    #    and running a module that ends with its parent (env servers the scripts start)
    "trainer": 0, "trainer.model": 0, "trainer.vision": 0, "trainer.tokenizer": 0, "trainer.distributed": 0,
    "trainer.metrics": 0, "trainer.export": 0, "trainer.scheduler": 0, "trainer.while_parent": 0,
    "trainer.sampling": 1,                      # decode loop, HF and vLLM samplers, the one result type
    "trainer.algos": 2,                         # advantages, value head: pure tensors
    "trainer.core": 3,                          # the training core: forward_backward, optim_step, sample
    "trainer.rollout": 4,                       # episode engine, agents, env sessions
    "trainer.update": 5, "trainer.config": 5,   # the RL update; the run's config
    "trainer.recipes": 6, "trainer.quickstart": 6, "trainer.chat_model": 6,  # readable loops: RL, SFT, two-agent
    "trainer.sampler_server": 6,                # a sampler as its own HTTP server (rollouts reach it through
    #                                             trainer.sampling.remote)
    "trainer.cli": 7, "trainer.service": 7, "trainer.multiagent": 7,  # entry points (multiagent: an alias)
}


def _trainer_modules() -> dict[str, Path]:
    modules = {}
    for path in _sources("trainer"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _trainer_imports(name: str, source: str, modules: dict[str, Path]) -> dict[str, int]:
    """The trainer modules ``name`` imports (anywhere in the file), with a line of each: ``from a.b import c``
    imports ``a.b.c`` when that is a module, and every package on the way (``a``, ``a.b``) that does not
    contain ``name`` itself (importing a module runs its packages' ``__init__`` first)."""
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
    found: dict[str, int] = {}
    for lineno, module in _module_names(ast.parse(source)):
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in modules and prefix not in own:
                found.setdefault(prefix, lineno)
    return found


def _trainer_graph() -> dict[str, dict[str, int]]:
    modules = _trainer_modules()
    return {name: _trainer_imports(name, path.read_text(), modules) for name, path in modules.items()}


def _rank(module: str) -> int | None:
    rows = [prefix for prefix in TRAINER_RANKS if module == prefix or module.startswith(prefix + ".")]
    return TRAINER_RANKS[max(rows, key=len)] if rows else None


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle of ``graph`` (``[a, b, ..., a]``), or None when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_find_cycle_sees_a_cycle_through_a_lazy_import_and_none_in_a_chain() -> None:
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) is None
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 9}}) == ["a", "b", "c", "a"]
    lazy = "import os\n\ndef f():\n    from trainer.core import TrainingClient\n"
    modules = {"trainer.core": ROOT / "trainer" / "core" / "__init__.py"}
    assert _trainer_imports("trainer.sampling.x", lazy, modules) == {"trainer.core": 4}


def test_trainer_modules_import_each_other_without_cycles() -> None:
    cycle = find_cycle(_trainer_graph())
    assert cycle is None, "an import cycle among trainer modules (lazy imports count): " + " -> ".join(cycle or [])


def test_every_trainer_module_has_a_rank() -> None:
    missing = sorted(name for name in _trainer_modules() if _rank(name) is None)
    assert not missing, f"trainer modules without a row in TRAINER_RANKS (give their layer a rank): {missing}"


def test_trainer_layers_import_only_their_own_layer_and_the_ones_below() -> None:
    modules = _trainer_modules()
    violations = []
    for name, imported in _trainer_graph().items():
        for other, lineno in sorted(imported.items()):
            mine, theirs = _rank(name), _rank(other)
            if mine is not None and theirs is not None and theirs > mine:
                violations.append(f"{modules[name].relative_to(ROOT)}:{lineno} ({name}, rank {mine}) imports "
                                  f"{other} (rank {theirs})")
    assert not violations, "upward imports inside trainer:\n" + "\n".join(violations)


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


def test_trainer_packages_use_each_others_public_names_only() -> None:
    """``from trainer.core._x import y`` or ``from trainer.core.x import _y`` in another package: private to core."""
    violations = []
    for name, path in _trainer_modules().items():
        package = ".".join(name.split(".")[:2])
        for lineno, module in _module_names(ast.parse(path.read_text(), filename=str(path))):
            parts = module.split(".")
            private = any(p.startswith("_") and not p.startswith("__") for p in parts)
            if parts[0] == "trainer" and private and ".".join(parts[:2]) != package:
                violations.append(f"{path.relative_to(ROOT)}:{lineno} imports {module}")
    assert not violations, "private names used across trainer packages (export a public one):\n" + "\n".join(violations)
