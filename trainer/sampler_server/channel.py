"""The weight channel: a plain TCP port that weight bodies stream into, straight into the planned tensors.

An HTTP weight push goes through the ASGI server's flow control a few hundred kilobytes at a time;
a 0.5B-shaped model is thousands of such hops. The channel takes the same safetensors body on a
socket of its own and reads it with ``recv_into`` directly into the tensors the backend planned (no
copy in between, a handful of system calls per tensor), several times faster on loopback and across
hosts alike.

Who may stream is still decided over HTTP: ``PUT /weights`` (or ``/adapters/{name}``) with the header
``X-Envhub-Weight-Ticket: <32 hex digits>`` and no body registers the ticket (the route checks the
bearer token and holds the update lock as for a body); the client then connects to the channel's port
(``/health`` names it as ``weight_port``), sends the ticket and the body, and the HTTP request answers
once the body was read and applied. A connection with a ticket nobody registered is closed.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from trainer.sampler_server.protocol import BadRequestError
from trainer.sampling.wire import TICKET_HEADER, TensorStreamReader, WeightFormatError

TICKET_CHARS = 32


@dataclass
class _Expected:
    reader: TensorStreamReader
    claimed: Future[None] = field(default_factory=Future)  # a connection presented the ticket
    done: Future[int] = field(default_factory=Future)      # the body was read whole: its size in bytes


class WeightChannel:
    """Listens on ``host:port`` (0: any free port, :attr:`port` says which) for weight streams named by tickets."""

    def __init__(self, host: str, port: int = 0, *, max_connections: int = 8, ticket_wait_s: float = 60.0,
                 read_timeout_s: float = 120.0):
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.port: int = self._listener.getsockname()[1]
        self.ticket_wait_s, self.read_timeout_s = ticket_wait_s, read_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._expected: dict[str, _Expected] = {}
        self._cond = threading.Condition()
        self._closed = False
        threading.Thread(target=self._accept, name="envhub-weight-channel", daemon=True).start()

    def expect(self, ticket: str, reader: TensorStreamReader) -> _Expected:
        """Register ``ticket``: the connection that presents it streams its body into ``reader``."""
        if len(ticket) != TICKET_CHARS or any(c not in "0123456789abcdef" for c in ticket):
            raise BadRequestError(f"Expected {TICKET_HEADER}: {TICKET_CHARS} lowercase hex digits.")
        with self._cond:
            if ticket in self._expected:
                raise BadRequestError("That weight ticket is already in use; send a fresh one.")
            expected = self._expected[ticket] = _Expected(reader)
            self._cond.notify_all()
        return expected

    def withdraw(self, ticket: str) -> bool:
        """Forget ``ticket`` if no connection claimed it yet; whether it was withdrawn."""
        with self._cond:
            expected = self._expected.get(ticket)
            if expected is None or expected.claimed.done():
                return False
            del self._expected[ticket]
            return True

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):  # too many streams at once: refuse this one
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                # a blocking socket with the kernel's own receive timeout: recv_into(MSG_WAITALL) then fills a
                # whole tensor per call (Python's settimeout would poll before every call, chunk by chunk)
                conn.settimeout(None)
                seconds = int(self.read_timeout_s)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, 0))
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
                expected = self._claim(conn)
                if expected is not None:
                    self._read(conn, expected)
        finally:
            self._slots.release()

    def _claim(self, conn: socket.socket) -> _Expected | None:
        """The registration of the ticket the connection presents (waiting a while for it), or None."""
        raw = bytearray()
        try:
            while len(raw) < TICKET_CHARS:
                chunk = conn.recv(TICKET_CHARS - len(raw))
                if not chunk:
                    return None
                raw += chunk
        except OSError:
            return None
        ticket = raw.decode("ascii", errors="replace")
        deadline = time.monotonic() + self.ticket_wait_s
        with self._cond:
            while ticket not in self._expected and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            expected = self._expected.pop(ticket, None)
            if expected is not None:
                expected.claimed.set_result(None)
        return expected

    def _read(self, conn: socket.socket, expected: _Expected) -> None:
        reader = expected.reader
        try:
            reader.fill(lambda view: conn.recv_into(view, len(view), socket.MSG_WAITALL))
            reader.finish()
        except (WeightFormatError, BadRequestError) as exc:
            expected.done.set_exception(exc)
        except OSError as exc:  # reset, timed out: the body never arrived whole
            expected.done.set_exception(BadRequestError(f"The weight stream broke off ({type(exc).__name__}: {exc})."))
        except Exception as exc:  # the backend's planner failed: the route answers with it
            expected.done.set_exception(exc)
        else:
            header = reader.header
            expected.done.set_result(header.data_bytes if header is not None else 0)


__all__ = ["WeightChannel", "TICKET_HEADER", "TICKET_CHARS"]
