"""The WebSocket transport: uvicorn's sans-I/O ``websockets`` protocol, minus a per-frame read pause.

uvicorn's implementation pauses socket reads after every inbound frame and resumes them when
the app receives it: two ``epoll_ctl`` system calls and a scheduling round per request. Here
reads pause only when ``ws_max_queue`` frames are waiting (real backpressure), which
measurably cuts per-step latency (benchmarks/server_profile.py). A text frame that is not
valid UTF-8 closes the connection with 1007 and logs one line for the connection, not a
traceback per frame (a client could otherwise flood the log).
"""

from __future__ import annotations

import logging
import re
from typing import Any

try:
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
except ImportError:  # uvicorn before 0.35: its default implementation is used instead
    WebSocketsSansIOProtocol = None  # type: ignore[assignment,misc]

#: what ``Settings`` hand uvicorn as ``ws=``
WS_IMPLEMENTATION = "auto" if WebSocketsSansIOProtocol is None else "envhub.server.transport:LeanWebSocketProtocol"

log = logging.getLogger("envhub.server")

if WebSocketsSansIOProtocol is not None:
    class LeanWebSocketProtocol(WebSocketsSansIOProtocol):
        """uvicorn's sans-I/O websockets protocol that pauses reading only under backpressure."""

        utf8_refused = False

        def send_receive_event_to_app(self) -> None:
            # uvicorn's own version, minus the per-frame read pause and its traceback per bad frame.
            data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
            self.frames = []
            if self.close_sent or self.utf8_refused:
                return
            message: Any
            if self.curr_msg_data_type == "text":
                try:
                    message = {"type": "websocket.receive", "text": data.decode()}
                except UnicodeDecodeError as exc:
                    return self._refuse_invalid_utf8(exc)
            else:
                message = {"type": "websocket.receive", "bytes": data}
            self.queue.put_nowait(message)
            if not self.read_paused and self.queue.qsize() >= self.config.ws_max_queue:
                self.read_paused = True
                self.transport.pause_reading()

        def _refuse_invalid_utf8(self, exc: UnicodeDecodeError) -> None:
            self.utf8_refused = True
            host, port = self.client or ("?", "?")
            log.warning("%s:%s sent a text frame that is not valid UTF-8 (%s at byte %d); closing the "
                        "connection with 1007", host, port, exc.reason, exc.start)
            self.conn.send_close(1007)
            self.handle_parser_exception()


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
