"""The reaper of one job share on a Ray node: ends the share's whole tree once its supervisor is gone.

``PR_SET_PDEATHSIG`` ends the share's first process when its supervisor actor dies, but not a
grandchild that left the tree (``setsid`` and a dead parent). When a node's raylet is killed its
actors exit, and nobody on that node would be left to end such a grandchild; so each share also
starts this small process, in its own session and without the job's marker, which waits for the
supervisor's pid to go away and then ends every process carrying the share's marker
(:func:`trainer.scheduler._procs.end_job_tree`). After a normal end it finds nothing and exits.
It forks once and its parent exits at once: a Ray worker that exits kills its direct children,
and the reaper must outlive the supervisor it watches.

    python -m trainer.scheduler._node_reaper SUPERVISOR_PID SUPERVISOR_START_TICKS MARKER GRACE_S
"""

from __future__ import annotations

import os
import sys
import time

from trainer.scheduler import _procs

POLL_S = 0.5


def reap_after(supervisor_pid: int, start_ticks: int, marker: str, grace_s: float) -> int:
    """Wait until the supervisor process is gone, then end the share's tree; returns how many were signalled."""
    while _procs.is_same_process(supervisor_pid, start_ticks):
        time.sleep(POLL_S)
    return len(_procs.end_job_tree(marker, None, None, grace_s))


def main(argv: list[str]) -> int:
    """Entry point: ``SUPERVISOR_PID SUPERVISOR_START_TICKS MARKER GRACE_S``."""
    if len(argv) != 4:
        print("usage: python -m trainer.scheduler._node_reaper PID START_TICKS MARKER GRACE_S", file=sys.stderr)
        return 2
    pid, ticks, marker, grace_s = int(argv[0]), int(argv[1]), argv[2], float(argv[3])
    if os.fork():
        return 0  # the starter waits for this parent only; the orphaned child reaps
    reap_after(pid, ticks, marker, grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
