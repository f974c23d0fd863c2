"""Every ``benchmarks/*.py`` still runs: each is started with ``--smoke`` (tiny sizes, seconds) and must exit 0.

The convention (README, "Benchmarks"): a benchmark is a script in ``benchmarks/`` with a module
docstring saying what it compares and a ``--smoke`` flag; a new script is picked up here by the glob.
"""

from __future__ import annotations

import ast
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[tuple[int, str]]]]:
    # As many at once as there are cores: most of a smoke run is interpreters starting and servers
    # coming up, but more at once than that starves the servers the throughput scripts start.
    def run(path: Path) -> tuple[int, str]:
        workdir = tmp_path_factory.mktemp(path.stem)  # anything a script writes (runs/bench/...) lands here
        # its own session, so that a script past its time goes down with the servers it started
        proc = subprocess.Popen([sys.executable, str(path), "--smoke"], cwd=workdir, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            return -1, f"ran past {TIMEOUT_S} s:\n{output}"
        return proc.returncode, output

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        yield {path.name: pool.submit(run, path) for path in BENCHMARKS}


def test_there_are_benchmarks() -> None:
    assert len(BENCHMARKS) >= 5


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.name for p in BENCHMARKS])
def test_benchmark_says_what_it_compares(path: Path) -> None:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert len(doc.split()) >= 10, f"{path.name} needs a module docstring: what it measures against what, and how to run it"


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.name for p in BENCHMARKS])
def test_benchmark_smoke_run(smoke_runs: dict[str, Future[tuple[int, str]]], path: Path) -> None:
    code, output = smoke_runs[path.name].result()
    assert code == 0, f"{path.name} --smoke exited with {code}:\n{output[-3000:]}"
    assert any(ch.isdigit() for ch in output), f"{path.name} --smoke printed no figures:\n{output}"


def test_gomoku_levels_rank_the_scripted_players_by_their_tactics() -> None:
    from benchmarks.gomoku_levels import levels, takes_wins, takes_wins_and_blocks
    from env_servers.gomoku_env.board import X, board_from_moves
    from env_servers.gomoku_env.config import GomokuConfig

    board = board_from_moves(3, [(0, 0), (1, 1), (0, 1), (2, 0)], win_length=3)  # X: (0,2) wins; O threatens (0,2) too
    rng = random.Random(0)
    assert takes_wins(board, X, rng) == (0, 2) and takes_wins_and_blocks(board, X, rng) == (0, 2)
    blocked = board_from_moves(3, [(0, 0), (1, 1), (2, 2), (0, 2)], win_length=3)  # no X line; O threatens (2,0)
    assert takes_wins_and_blocks(blocked, X, rng) == (2, 0)
    rows = levels(GomokuConfig(board_size=3, win_length=3), games=400, seed=0)
    assert rows["random"]["win"] + 0.1 < rows["wins"]["win"] < rows["wins+blocks"]["win"]
    assert all(abs(r["win"] + r["loss"] + r["draw"] - 1.0) < 1e-9 for r in rows.values())
