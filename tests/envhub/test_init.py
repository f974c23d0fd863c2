"""``envhub init``: the scaffold of each kind works, and the whole author path runs in a fresh venv.

The fresh venv gets envhub and the new package installed editable (``--no-deps``, no index); their
dependencies come from this interpreter's site-packages through a ``.pth`` line, so nothing is
downloaded and the test stays fast.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from envhub._init import Scaffold, scaffold

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
KINDS = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize(("tools", "multi_turn"), KINDS)
def test_each_kind_scaffolds_a_package_whose_own_tests_pass(tmp_path: Path, tools: bool, multi_turn: bool) -> None:
    root = scaffold("demo", tmp_path, tools=tools, multi_turn=multi_turn)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == [".dockerignore", "Dockerfile", "README.md", "demo_env/__init__.py", "demo_env/env.py", "pyproject.toml",
                     "tests/test_env.py"]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["envhub.envs"] == {"demo": "demo_env.env:DemoEnv"}
    assert 'CMD ["envhub", "serve", "demo"' in (root / "Dockerfile").read_text()
    assert "FROM ${ENVHUB_IMAGE}" in (root / "Dockerfile").read_text()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=root,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and "3 passed" in out.stdout, out.stdout + out.stderr
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--select", "E,W,F,I,B,UP,SIM,RUF",
                           "--line-length", "120", "--target-version", "py310", "."], cwd=root, capture_output=True,
                          text=True)
    assert lint.returncode == 0, "the generated package is lint-clean:\n" + lint.stdout


def test_names_and_refusals(tmp_path: Path) -> None:
    assert Scaffold.from_name("math").package == "math_env", "never a package that shadows the standard library"
    assert (Scaffold.from_name("my-env").package, Scaffold.from_name("my-env").class_name) == ("my_env", "MyEnv")
    with pytest.raises(ValueError, match="Expected NAME to start with a letter"):
        Scaffold.from_name("9lives")
    with pytest.raises(ValueError, match="Expected NAME"):
        Scaffold.from_name("../escape")
    scaffold("taken", tmp_path)
    with pytest.raises(FileExistsError, match="already exists and is not an empty directory"):
        scaffold("taken", tmp_path)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(FileExistsError, match="already exists and is not an empty directory"):
        scaffold("a_file", tmp_path)


def test_a_dir_that_cannot_hold_the_package_is_one_line_and_status_2(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from envhub.cli import main

    (tmp_path / "a_file").write_text("")
    assert main(["init", "demo", "--dir", str(tmp_path / "a_file")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("envhub init: error: Expected --dir to be a directory NAME/ can be created in, got ")
    assert "Traceback" not in err and err.count("\n") == 1


def test_init_warns_when_the_name_is_already_registered(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from envhub.cli import main

    assert main(["init", "math", "--dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "the env name 'math' is already registered by envhub (env_servers.math_env.env:MathEnv)" in err
    assert main(["init", "fresh_name_here", "--dir", str(tmp_path)]) == 0
    assert "warning" not in capsys.readouterr().err


def fresh_venv(where: Path, *packages: Path) -> Path:
    """A venv with ``packages`` installed editable and this interpreter's site-packages as a fallback."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "_outer_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    editable = [arg for p in packages for arg in ("-e", str(p))]
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", *editable], check=True, capture_output=True)
    return python


@pytest.mark.slow
@pytest.mark.live
def test_init_install_list_serve_check_eval_in_a_fresh_venv(tmp_path: Path, serve_process) -> None:
    import httpx

    from envhub import EnvClient

    init = subprocess.run([sys.executable, "-m", "envhub", "init", "guess_demo", "--tools", "--multi-turn"],
                          cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert init.returncode == 0 and "pip install -e guess_demo" in init.stdout, init.stderr
    python = fresh_venv(tmp_path / "venv", ROOT, tmp_path / "guess_demo")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def envhub(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(python), "-m", "envhub", *args], cwd=tmp_path, capture_output=True, text=True,
                              env=env, timeout=300)

    listed = {row["name"]: row for row in json.loads(envhub("list", "--json").stdout)}
    assert listed["guess_demo"] | {"description": None} == {
        "name": "guess_demo", "class": "guess_demo_env.env:GuessDemoEnv", "distribution": "guess_demo",
        "version": "0.1.0", "tools": ["guess"], "description": None, "error": None, "conflict": None}
    assert listed["guess_demo"]["description"].startswith("Guess a secret number with the guess tool")
    assert listed["math"]["class"] == "env_servers.math_env.env:MathEnv", "the bundled envs are registered too"

    checked = envhub("check", "guess_demo")
    assert checked.returncode == 0 and "GuessDemoEnv: 7 passed, 0 failed" in checked.stdout, checked.stdout

    server = serve_process([str(python), "-m", "envhub", "serve", "guess_demo"], cwd=tmp_path, env=env)

    async def play() -> list[str]:
        async with EnvClient(server.url) as client:
            first = await client.reset(seed=0)
            step = await client.step({"tool_name": "guess", "arguments": {"number": 0}})
            return [first.observation.text, step.observation.text]

    assert asyncio.run(play()) == ["I picked a number between 1 and 50. Call guess(number) until you find it.",
                                   "Higher."]

    evaluated = envhub("eval", "--env", "guess_demo", "--model", "tiny", "--episodes", "2", "--samples", "2",
                       "--max-tokens", "8", "--max-turns", "2", "--out", "ev")
    assert evaluated.returncode == 0, evaluated.stderr
    records = [json.loads(line) for line in (tmp_path / "ev" / "results.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["failure"] is None and r["reward"] is not None for r in records)
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert summary["env"] == "guess_demo" and summary["episodes_done"] == 4 and set(summary["pass_at_k"]) == {"1", "2"}

    viewer = serve_process([str(python), "-m", "envhub", "view", "ev"], cwd=tmp_path, env=env)
    info = httpx.get(viewer.url + "/api/info", timeout=10).json()
    assert info["kind"] == "eval" and info["summary"]["episodes_done"] == 4
    page = httpx.get(viewer.url + "/api/episodes", params={"limit": 10}, timeout=10).json()
    assert page["total"] == 4 and sum("sample 1" in row["title"] for row in page["rows"]) == 2
    episode = httpx.get(viewer.url + "/api/episodes/0", timeout=10).json()
    assert episode["messages"] and episode["messages"][0]["role"] in ("system", "user")
