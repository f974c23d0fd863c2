"""The service's errors: each names the HTTP status a client sees and the Tinker error category.

A request refused before any work is queued (a malformed body, a size over a limit, an id of
another tenant) answers with its status at once, as ``{"detail": ..., "category": "user"}``; the
``tinker`` SDK raises it as the matching ``tinker.APIStatusError`` (``BadRequestError`` for 400,
``NotFoundError`` for 404, ...) and retries only 408, 409, 429 and 5xx. A :class:`UserError` raised
while queued work runs fails that future instead, which the SDK raises as
``tinker.RequestFailedError`` with ``category == "user"``.
"""

from __future__ import annotations

from envhub.errors import EnvHubError


class ServiceError(EnvHubError):
    """Root of the training service's errors."""

    status = 500
    category = "server"

    def body(self) -> dict[str, str]:
        """The JSON body of the HTTP answer for this error."""
        return {"detail": self.message, "category": self.category}


class UserError(ServiceError, ValueError):
    """A request the client got wrong (400); inside queued work, a future failed with ``category: "user"``."""

    status = 400
    category = "user"


class NotFound(UserError, LookupError):
    """An id this client does not own or that does not exist (404: the two are never told apart)."""

    status = 404


class PayloadTooLarge(UserError):
    """A request body over its byte limit (413)."""

    status = 413


class UnsupportedMediaType(UserError):
    """A body in a content type or encoding the route does not take (415)."""

    status = 415


class LengthRequired(UserError):
    """A request body without a ``Content-Length`` (411): its size must be known before it is read."""

    status = 411


class RequestTimeout(UserError):
    """A body that did not arrive in time (408; the SDK re-sends)."""

    status = 408


class TooManyRequests(UserError):
    """Back-pressure: too much of this client's (or everyone's) work is pending (429; the SDK backs off and
    re-sends)."""

    status = 429


class Unauthorized(UserError):
    """No API key where the service needs one (401)."""

    status = 401


class Forbidden(UserError):
    """A wrong API key (403)."""

    status = 403


__all__ = ["Forbidden", "LengthRequired", "NotFound", "PayloadTooLarge", "RequestTimeout", "ServiceError",
           "TooManyRequests", "Unauthorized", "UnsupportedMediaType", "UserError"]
