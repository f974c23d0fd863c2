"""The GPU scheduler: a service that queues jobs, places them on free GPUs and cleans them up.

It knows nothing about environments and never imports torch. Run it with ``envhub-sched serve``;
talk to it with :class:`SchedulerClient` or the ``envhub-sched`` CLI; ``submit_self`` runs a
command as a job from the current process (used by ``envhub-train --scheduler URL``).
"""

from __future__ import annotations

from trainer.scheduler.client import JobHandle, SchedulerClient, submit_self
from trainer.scheduler.errors import (
    JobNotFoundError,
    JobRequestError,
    SchedulerAuthError,
    SchedulerError,
    SchedulerUnavailableError,
)

__all__ = [
    "JobHandle",
    "JobNotFoundError",
    "JobRequestError",
    "SchedulerAuthError",
    "SchedulerClient",
    "SchedulerError",
    "SchedulerUnavailableError",
    "submit_self",
]
