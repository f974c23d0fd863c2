"""Every ``benchmarks/*.py`` still runs: each is started with ``--smoke`` (tiny sizes, seconds) and must exit 0.

The convention (README, "Benchmarks"): a benchmark is a script in ``benchmarks/`` with a module
docstring saying what it compares and a ``--smoke`` flag; a new script is picked up here by the glob.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))
TIMEOUT_S = 300


class SmokeRun(NamedTuple):
    proc: subprocess.Popen[bytes]
    output: Path
    log: IO[bytes]


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SmokeRun]]:
    # All start at once: most of a smoke run is interpreters starting and servers coming up, not CPU.
    runs: dict[str, SmokeRun] = {}
    for path in BENCHMARKS:
        workdir = tmp_path_factory.mktemp(path.stem)  # anything a script writes (runs/bench/...) lands here
        log = open(workdir / "output.txt", "wb")
        proc = subprocess.Popen([sys.executable, str(path), "--smoke"], cwd=workdir, stdout=log,
                                stderr=subprocess.STDOUT)
        runs[path.name] = SmokeRun(proc, workdir / "output.txt", log)
    yield runs
    for run in runs.values():
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        run.log.close()


def test_there_are_benchmarks() -> None:
    assert len(BENCHMARKS) >= 5


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.name for p in BENCHMARKS])
def test_benchmark_says_what_it_compares(path: Path) -> None:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert len(doc.split()) >= 10, f"{path.name} needs a module docstring: what it measures against what, and how to run it"


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.name for p in BENCHMARKS])
def test_benchmark_smoke_run(smoke_runs: dict[str, SmokeRun], path: Path) -> None:
    run = smoke_runs[path.name]
    try:
        code = run.proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        code = run.proc.wait()
        pytest.fail(f"{path.name} --smoke ran past {TIMEOUT_S} s:\n{run.output.read_text()[-3000:]}")
    output = run.output.read_text()
    assert code == 0, f"{path.name} --smoke exited with {code}:\n{output[-3000:]}"
    assert any(ch.isdigit() for ch in output), f"{path.name} --smoke printed no figures:\n{output}"
