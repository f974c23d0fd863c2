"""Errors of the GPU scheduler, shared by the service and its client (all are ``EnvHubError``)."""

from __future__ import annotations

from envhub.errors import EnvHubError


class SchedulerError(EnvHubError):
    """Root of the scheduler's errors."""


class JobRequestError(SchedulerError, ValueError):
    """A submission the scheduler refuses: more GPUs than it has, a bad kind, no command..."""

    status_code = 400


class JobNotFoundError(SchedulerError, KeyError):
    """No job with that id (or none the caller may see)."""

    status_code = 404

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return self.message


class SchedulerAuthError(SchedulerError, PermissionError):
    """A missing or unknown API key."""

    status_code = 401


class SchedulerUnavailableError(SchedulerError, ConnectionError):
    """The scheduler service cannot be reached."""
