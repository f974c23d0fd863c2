"""The WebSocket transport: uvicorn's sans-I/O ``websockets`` protocol, minus a per-frame read pause.

uvicorn's implementation pauses socket reads after every inbound frame and resumes them when
the app receives it: two ``epoll_ctl`` system calls and a scheduling round per request. Here
reads pause only when ``ws_max_queue`` frames are waiting (real backpressure), which
measurably cuts per-step latency (benchmarks/server_profile.py).
"""

from __future__ import annotations

import logging
import re

try:
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
except ImportError:  # uvicorn before 0.35: its default implementation is used instead
    WebSocketsSansIOProtocol = None  # type: ignore[assignment,misc]

#: what ``Settings`` hand uvicorn as ``ws=``
WS_IMPLEMENTATION = "auto" if WebSocketsSansIOProtocol is None else "envhub.server.transport:LeanWebSocketProtocol"

if WebSocketsSansIOProtocol is not None:
    class LeanWebSocketProtocol(WebSocketsSansIOProtocol):
        """uvicorn's sans-I/O websockets protocol that pauses reading only under backpressure."""

        def send_receive_event_to_app(self) -> None:
            paused = self.read_paused
            self.read_paused = True  # makes the parent skip its unconditional pause_reading()
            try:
                super().send_receive_event_to_app()
            finally:
                self.read_paused = paused
            if not paused and self.queue.qsize() >= self.config.ws_max_queue:
                self.read_paused = True
                self.transport.pause_reading()


_SECRET_QUERY = re.compile(r"((?:^|[?&])(?:token|resume_token)=)[^&\s\"']*")


class RedactSecrets(logging.Filter):
    """Masks ``token=`` and ``resume_token=`` query values in uvicorn's connection log lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_SECRET_QUERY.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args)
        return True


def install_log_redaction() -> None:
    """Attach :class:`RedactSecrets` to uvicorn's logger once (WebSocket URLs may carry secrets)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, RedactSecrets) for f in logger.filters):
        logger.addFilter(RedactSecrets())
