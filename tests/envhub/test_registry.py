"""Envs registered by entry point: discovery, ``envhub list``, serving by name, conflicts and import failures.

The distributions here are real ones on disk (a ``.dist-info`` with ``METADATA`` and
``entry_points.txt`` beside their modules, put on ``PYTHONPATH``): importlib.metadata finds them
exactly as it finds a pip-installed package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

GOOD_ENV = textwrap.dedent('''
    from envhub import Env, Observation, tool

    class {cls}(Env):
        """{doc}

        More text that envhub list leaves out.
        """

        def reset(self, seed=None):
            return Observation(text="hello from {cls}")

        @tool
        def ping(self, text: str) -> str:
            """Echo the text."""
            self.done = True
            return text
''')


def make_dist(site: Path, name: str, version: str, envs: dict[str, str], modules: dict[str, str]) -> None:
    """An installed-looking distribution in ``site``: its modules and a dist-info registering ``envs``."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "".join(f"{env} = {target}\n" for env, target in envs.items())
    (info / "entry_points.txt").write_text(f"[envhub.envs]\n{lines}")
    for module, source in modules.items():
        (site / f"{module}.py").write_text(source)


def run_envhub(site: Path, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "envhub", *args], capture_output=True, text=True, env=env,
                          cwd=site, timeout=timeout_s)


@pytest.fixture
def site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    make_dist(site, "alpha-envs", "1.2.0", {"alpha": "alpha_mod:AlphaEnv", "shared": "alpha_mod:AlphaEnv"},
              {"alpha_mod": GOOD_ENV.format(cls="AlphaEnv", doc="Alpha says hello.")})
    make_dist(site, "beta-envs", "0.3.1", {"shared": "beta_mod:BetaEnv", "broken": "broken_mod:BrokenEnv"},
              {"beta_mod": GOOD_ENV.format(cls="BetaEnv", doc="Beta says hello."),
               "broken_mod": "import a_module_that_does_not_exist\n"})
    return site


def test_list_shows_name_class_version_tools_and_first_docstring_line(site: Path) -> None:
    out = run_envhub(site, "list", "--json")
    rows = {(r["name"], r["distribution"]): r for r in json.loads(out.stdout)}
    alpha = rows[("alpha", "alpha-envs")]
    assert alpha["class"] == "alpha_mod:AlphaEnv" and alpha["version"] == "1.2.0"
    assert alpha["tools"] == ["ping"] and alpha["description"] == "Alpha says hello."
    assert alpha["error"] is None and alpha["conflict"] is None
    assert out.returncode == 1, "a conflict or a broken entry point is a problem the exit status reports"


def test_list_reports_a_conflict_and_a_broken_entry_point(site: Path) -> None:
    out = run_envhub(site, "list")
    assert out.returncode == 1
    problems = out.stdout.split("problems:")[1]
    assert "'shared' is registered by 2 distributions (alpha-envs, beta-envs)" in problems
    assert "env 'broken' = 'broken_mod:BrokenEnv' (registered by beta-envs 0.3.1) failed to import" in problems
    assert "ModuleNotFoundError" in problems
    table = out.stdout.split("problems:")[0]
    assert table.count("\nshared ") == 2, "both claims of the name are listed, neither shadows the other"


def test_serving_a_conflicting_name_names_both_distributions(site: Path) -> None:
    out = run_envhub(site, "serve", "shared", "--port", "0")
    assert out.returncode == 2
    assert "registered by 2 distributions: alpha-envs 1.2.0 (alpha_mod:AlphaEnv); beta-envs 0.3.1 " \
           "(beta_mod:BetaEnv)" in out.stderr


def test_a_broken_entry_point_fails_clearly_when_used(site: Path) -> None:
    out = run_envhub(site, "check", "broken")
    assert out.returncode == 2
    assert "broken_mod:BrokenEnv" in out.stderr and "beta-envs" in out.stderr and "a_module_that_does_not_exist" \
        in out.stderr


def test_check_by_name_and_an_unknown_name(site: Path) -> None:
    ok = run_envhub(site, "check", "alpha")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "AlphaEnv:" in ok.stdout and "0 failed" in ok.stdout
    unknown = run_envhub(site, "check", "gamma")
    assert unknown.returncode == 2 and "no installed distribution registers it" in unknown.stderr
    assert "alpha" in unknown.stderr


def test_serve_by_name_answers_on_the_wire(site: Path, serve_process) -> None:
    import asyncio

    from envhub import EnvClient

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    server = serve_process([sys.executable, "-m", "envhub", "serve", "alpha"], cwd=site, env=env)

    async def episode() -> str:
        async with EnvClient(server.url) as client:
            return (await client.reset(seed=0)).observation.text

    assert asyncio.run(episode()) == "hello from AlphaEnv"


def test_an_installed_dist_info_wins_over_a_stale_egg_info(tmp_path: Path) -> None:
    # Run from a source tree, `NAME.egg-info` (a build leftover) comes first on sys.path; the installed
    # distribution's entry points must still be the ones read.
    site, tree = tmp_path / "site", tmp_path / "tree"
    make_dist(site, "gamma-envs", "2.0.0", {"gamma": "gamma_mod:GammaEnv"},
              {"gamma_mod": GOOD_ENV.format(cls="GammaEnv", doc="Gamma.")})
    stale = tree / "gamma_envs.egg-info"
    stale.mkdir(parents=True)
    (stale / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: gamma-envs\nVersion: 1.0.0\n")
    (stale / "entry_points.txt").write_text("[console_scripts]\ngamma = gamma_mod:main\n")
    code = "from envhub.registry import registered; print(registered()['gamma'][0].version)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(site), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tree)
    assert out.stdout.strip() == "2.0.0", out.stderr


def test_resolve_passes_module_class_through_and_refuses_garbage() -> None:
    from envhub.registry import resolve

    assert resolve("pkg.mod:Cls") == "pkg.mod:Cls"
    with pytest.raises(ValueError, match="Expected an env as 'module:Class'"):
        resolve("not a name!")


@pytest.mark.live
def test_a_fleet_service_runs_a_registered_name(site: Path, tmp_path: Path) -> None:
    from envhub.eval.serve import free_port
    from envhub.fleet import Fleet

    port = free_port()
    compose = tmp_path / "compose.yml"
    compose.write_text(textwrap.dedent(f"""
        services:
          alpha:
            command: envhub serve alpha --host 0.0.0.0 --port 8000
            ports: ["127.0.0.1:{port}:8000"]
            environment:
              PYTHONPATH: "{site}{os.pathsep}{ROOT}"
    """))
    fleet = Fleet(compose, state_dir=tmp_path / "state")
    try:
        fleet.up(wait_s=60)
        (row,) = fleet.status()
        assert row["healthy"] and row["url"] == f"ws://127.0.0.1:{port}"
    finally:
        assert fleet.down() == ["alpha"]
