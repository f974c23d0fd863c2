"""``python -m trainer._while_parent PID MODULE ARGS...``: run ``python -m MODULE ARGS...`` in this process,
ended by SIGTERM when process ``PID`` (the one that started it) ends, however it ends.

:func:`trainer.quickstart.env_server` starts its env servers through it: a SIGKILL or a crash of the
script skips the ``finally`` that stops the server, and a server must not outlive its script. On Linux
it is ``PR_SET_PDEATHSIG``, set here, after exec (a fork hook is unsafe in a threaded parent); elsewhere
the module just runs.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1  # prctl(2)


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        raise SystemExit("usage: python -m trainer._while_parent PID MODULE [ARGS...]")
    parent, module = int(argv[0]), argv[1]
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # it ended before the signal was armed
            raise SystemExit(f"Process {parent}, which started {module}, has already ended.")
    sys.argv = [module, *argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
