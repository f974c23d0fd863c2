"""``python -m trainer.while_parent PID MODULE ARGS...``: run ``python -m MODULE ARGS...`` in this process,
ended by SIGTERM when process ``PID`` (the one that started it) ends, however it ends. ``MODULE`` may be
a script's path instead (ending in ``.py``): it runs as ``python SCRIPT ARGS...`` would, its folder first
on ``sys.path`` (how the benchmarks that are scripts start their servers).

A SIGKILL or a crash of a script skips the ``finally`` that stops the servers it started, and a server
must not outlive its script: :func:`argv` is the command line that starts one this way
(:func:`trainer.quickstart.env_server` starts its env servers so, the benchmarks their sampler servers).
On Linux it is ``PR_SET_PDEATHSIG``, set here, after exec (a fork hook is unsafe in a threaded parent);
elsewhere the module just runs. The signal comes when the *thread* that started it ends, so start it from
the thread that waits for it (a ``with`` block, as those helpers are, always is).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1  # prctl(2)


def argv(module: str, *args: str) -> list[str]:
    """The command line of ``python -m module args...`` (``python module args...`` for a script's path,
    ``*.py``) that ends when this process does."""
    return [sys.executable, "-m", "trainer.while_parent", str(os.getpid()), module, *args]


def main(args: list[str]) -> None:
    if len(args) < 2 or not args[0].isdigit():
        raise SystemExit("usage: python -m trainer.while_parent PID MODULE|SCRIPT.py [ARGS...]")
    parent, module = int(args[0]), args[1]
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # it ended before the signal was armed
            raise SystemExit(f"Process {parent}, which started {module}, has already ended.")
    sys.argv = [module, *args[2:]]
    if module.endswith(".py"):  # a script: as `python SCRIPT`, which puts its folder (not the cwd) first
        if not os.path.isfile(module):
            raise SystemExit(f"No script {module} to run.")
        sys.path[0] = os.path.dirname(os.path.abspath(module))
        runpy.run_path(module, run_name="__main__")
    else:
        runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
