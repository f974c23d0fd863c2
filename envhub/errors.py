"""One exception root for envhub, and the wire error codes each exception stands for.

Every error envhub raises derives from :class:`EnvHubError`; categories also subclass the
stdlib type they stand for (``ValueError``, ``TimeoutError``, ``ConnectionError``...), so
``except TimeoutError`` keeps working. An error that crosses the wire travels as a typed
code (``{"type": "error", "data": {"code": ..., "message": ...}}``); the client raises the
exception class registered for that code with :func:`error_for_code`.
"""

from __future__ import annotations

from typing import Any


class ErrorCode:
    """Wire error codes. The first seven are OpenEnv's; the rest are envhub's own."""

    INVALID_JSON = "INVALID_JSON"
    UNKNOWN_TYPE = "UNKNOWN_TYPE"
    VALIDATION_ERROR = "VALIDATION_ERROR"
    EXECUTION_ERROR = "EXECUTION_ERROR"
    CAPACITY_REACHED = "CAPACITY_REACHED"
    FACTORY_ERROR = "FACTORY_ERROR"
    SESSION_ERROR = "SESSION_ERROR"
    # envhub extensions (sent to any client: an unknown code still reads as an error frame)
    EPISODE_NOT_STARTED = "EPISODE_NOT_STARTED"
    EPISODE_ENDED = "EPISODE_ENDED"
    STEP_TIMEOUT = "STEP_TIMEOUT"
    MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"
    UNAUTHORIZED = "UNAUTHORIZED"
    SESSION_EXPIRED = "SESSION_EXPIRED"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    CANCELLED = "CANCELLED"

    #: codes after which the server closes the socket
    FATAL = frozenset({CAPACITY_REACHED, FACTORY_ERROR, SESSION_ERROR, UNAUTHORIZED, SHUTTING_DOWN})


class EnvHubError(Exception):
    """Root of every envhub exception."""

    code: str = ErrorCode.SESSION_ERROR

    def __init__(self, message: str = "", *, code: str | None = None, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.details: dict[str, Any] = dict(details or {})

    def to_wire(self) -> dict[str, Any]:
        """The ``data`` of an error frame for this exception."""
        return {"message": self.message, "code": self.code, **self.details}


class EnvDefinitionError(EnvHubError, TypeError):
    """An env class is malformed: a reserved tool name, a tool without type hints, ..."""


class ConfigError(EnvHubError, TypeError, ValueError):
    """An unknown or invalid configuration key (a ``TypeError`` like an unexpected keyword argument)."""

    code = ErrorCode.VALIDATION_ERROR


class ProtocolError(EnvHubError, ValueError):
    """A frame that cannot be understood: not JSON, not an object, unknown type."""

    code = ErrorCode.INVALID_JSON


class ActionValidationError(EnvHubError, ValueError):
    """An action or reset argument does not match the env's schema."""

    code = ErrorCode.VALIDATION_ERROR


class EnvExecutionError(EnvHubError, RuntimeError):
    """The env raised while handling a request; the session survives."""

    code = ErrorCode.EXECUTION_ERROR


class EpisodeStateError(EnvHubError, RuntimeError):
    """A step before ``reset`` or after the episode ended."""

    code = ErrorCode.EPISODE_NOT_STARTED


class StepTimeoutError(EnvHubError, TimeoutError):
    """A request took longer than its deadline (client- or server-side)."""

    code = ErrorCode.STEP_TIMEOUT


class MessageTooLargeError(EnvHubError, ValueError):
    """A frame exceeds the configured size limit."""

    code = ErrorCode.MESSAGE_TOO_LARGE


class CapacityError(EnvHubError, ConnectionError):
    """The server is at its session cap."""

    code = ErrorCode.CAPACITY_REACHED


class AuthError(EnvHubError, PermissionError):
    """Missing or wrong bearer token."""

    code = ErrorCode.UNAUTHORIZED


class EnvConnectionError(EnvHubError, ConnectionError):
    """The server cannot be reached, or the connection dropped (infrastructure, not the policy)."""

    code = ErrorCode.SESSION_ERROR


class SessionLostError(EnvConnectionError):
    """The server-side session is gone (connection dropped and could not be resumed)."""

    code = ErrorCode.SESSION_EXPIRED


class ServerError(EnvHubError, RuntimeError):
    """An error frame whose code has no more specific class."""


_BY_CODE: dict[str, type[EnvHubError]] = {
    ErrorCode.INVALID_JSON: ProtocolError,
    ErrorCode.UNKNOWN_TYPE: ProtocolError,
    ErrorCode.VALIDATION_ERROR: ActionValidationError,
    ErrorCode.EXECUTION_ERROR: EnvExecutionError,
    ErrorCode.CAPACITY_REACHED: CapacityError,
    ErrorCode.FACTORY_ERROR: ServerError,
    ErrorCode.SESSION_ERROR: ServerError,
    ErrorCode.EPISODE_NOT_STARTED: EpisodeStateError,
    ErrorCode.EPISODE_ENDED: EpisodeStateError,
    ErrorCode.STEP_TIMEOUT: StepTimeoutError,
    ErrorCode.CANCELLED: StepTimeoutError,  # a client cancels only what it stopped waiting for
    ErrorCode.MESSAGE_TOO_LARGE: MessageTooLargeError,
    ErrorCode.UNAUTHORIZED: AuthError,
    ErrorCode.SESSION_EXPIRED: SessionLostError,
    ErrorCode.SHUTTING_DOWN: EnvConnectionError,
}


def error_for_code(data: dict[str, Any]) -> EnvHubError:
    """Build the typed exception for the ``data`` of an error frame."""
    code = str(data.get("code", ErrorCode.SESSION_ERROR))
    message = str(data.get("message", ""))
    details = {k: v for k, v in data.items() if k not in ("code", "message")}
    cls = _BY_CODE.get(code, ServerError)
    return cls(f"{code}: {message}" if message else code, code=code, details=details)
