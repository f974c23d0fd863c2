"""envhub's public surface: the deliberate top-level API, its docstrings, and the runnable examples in them."""

from __future__ import annotations

import doctest
import importlib
import importlib.metadata
import inspect
import io
import pkgutil
import subprocess
import sys

import pytest

import envhub

#: the whole top level, on purpose (STYLE.md: about 20 names); a new name is a decision, made here too
PUBLIC_API = {
    "Env", "EnvRunner", "Observation", "Action", "StepResult", "ToolSpec", "ToolCall", "tool", "reward",
    "EnvHubError", "EnvClient", "SyncEnvClient", "OpenEnv", "EnvTool", "ToolManager", "create_app", "serve",
    "check_env", "FunctionTool", "LocalEnv", "__version__",
}
#: what a user starts from: each docstring carries an example that runs (``serve`` blocks until a
#: signal, so its example is ``envhub serve`` in the README, which tests/test_readme.py checks)
ENTRY_POINTS = ["Env", "EnvRunner", "tool", "reward", "EnvClient", "SyncEnvClient", "OpenEnv", "EnvTool",
                "ToolManager", "create_app", "check_env", "FunctionTool", "LocalEnv"]
MODULES = sorted(info.name for info in pkgutil.walk_packages(envhub.__path__, "envhub.")
                 if not info.name.endswith("__main__"))


def test_all_is_the_deliberate_api():
    assert len(envhub.__all__) == len(set(envhub.__all__)), "duplicate names in envhub.__all__"
    assert set(envhub.__all__) == PUBLIC_API


@pytest.mark.parametrize("name", sorted(PUBLIC_API - {"__version__"}))
def test_every_public_name_imports_from_envhub_and_is_documented(name):
    obj = getattr(envhub, name)
    assert obj.__module__.startswith("envhub."), f"{name} comes from {obj.__module__}"
    doc = inspect.getdoc(obj) or ""
    assert len(doc.split()) >= 5, f"envhub.{name} needs a docstring saying what it is"


def test_star_import_gives_exactly_the_public_api():
    namespace: dict[str, object] = {}
    exec("from envhub import *", namespace)
    assert namespace.keys() >= PUBLIC_API
    assert envhub.__version__ == importlib.metadata.version("envhub")


def test_import_envhub_stays_light():
    # env authors import envhub for Env/@tool: the server and client stacks load on first use only
    code = "import sys, envhub; print(sorted(m for m in ('fastapi', 'uvicorn', 'websockets') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_points_have_a_runnable_example(name):
    examples = [ex for test in doctest.DocTestFinder(recurse=False).find(getattr(envhub, name))
                for ex in test.examples if not ex.options.get(doctest.SKIP)]
    assert examples, f"envhub.{name}'s docstring needs a >>> example that runs (not +SKIP)"


@pytest.mark.parametrize("module_name", MODULES)
def test_doctests(module_name):
    module = importlib.import_module(module_name)
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder().find(module, module_name):
        runner.run(test, out=out.write)
    assert runner.failures == 0, out.getvalue()


def test_the_doctests_run_at_all():
    finder = doctest.DocTestFinder()
    counted = sum(len(t.examples) for name in MODULES for t in finder.find(importlib.import_module(name), name))
    assert counted >= 60
