"""``envhub view``: a local web page over a training run or an eval directory (episodes, tokens, reward curve).

>>> from envhub.view import create_view_app   # doctest: +SKIP
>>> app = create_view_app("runs/quickstart")   # doctest: +SKIP

Serve ``app`` with uvicorn, or run ``envhub view runs/quickstart``.

FastAPI loads on first use of :func:`create_view_app` or :func:`serve_view`, not on import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

DEFAULT_HOST = "127.0.0.1"  # the page shows whole transcripts: loopback unless asked otherwise
DEFAULT_PORT = 8765

if TYPE_CHECKING:  # pragma: no cover
    from envhub.view.app import ViewDir, create_view_app


def serve_view(root: str | Path, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
               log_level: str = "warning") -> None:
    """Serve the viewer over ``root`` until interrupted. ValueError when ``root`` is not a run or eval directory."""
    import socket

    import uvicorn

    from envhub.view.app import create_view_app

    loopback = host in ("127.0.0.1", "localhost", "::1")
    app = create_view_app(root, allowed_hosts=["127.0.0.1", "localhost", "[::1]"] if loopback else None)
    # bind first, so the printed URL names the real port (also for port 0)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    shown = f"[{host}]" if ":" in host else host
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:  # a port in use or out of range, a host that is not this machine's
        sock.close()
        reason = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)).rstrip(".")
        raise ValueError(f"Expected an address to listen on (--host, --port; --port 0 takes any free port), got "
                         f"{shown}:{port}: {reason}.") from None
    sock.listen(128)  # connections that come before uvicorn starts wait in the backlog
    print(f"envhub view: {app.state.view.root} ({app.state.view.kind}) at http://{shown}:{sock.getsockname()[1]}/",
          flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level=log_level)).run(sockets=[sock])


def __getattr__(name: str) -> Any:
    if name in ("create_view_app", "ViewDir"):
        from envhub.view import app

        return getattr(app, name)
    raise AttributeError(f"module 'envhub.view' has no attribute {name!r}")


__all__ = ["create_view_app", "serve_view", "ViewDir", "DEFAULT_HOST", "DEFAULT_PORT"]
