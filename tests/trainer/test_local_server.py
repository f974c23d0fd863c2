"""trainer.local_server: a child server is returned once healthy, and a failed start says why and leaves
no child behind."""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from trainer import local_server

HEALTHY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_healthy_child_is_returned_and_stopped(tmp_path: Path) -> None:
    port = local_server.free_port()
    url = f"http://127.0.0.1:{port}"
    proc = local_server.start([sys.executable, "-c", HEALTHY, str(port)], url, tmp_path / "logs" / "ok.log")
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            assert resp.status == 200
    finally:
        local_server.stop(proc)
    assert proc.returncode is not None and _gone(proc.pid)
    local_server.stop(proc)  # stopping a stopped child is a no-op
    assert "serving" in local_server.log_tail(tmp_path / "logs" / "ok.log")


def test_a_child_that_exits_while_starting_raises_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('no such model: tiny-x', flush=True); sys.exit(3)"]
    url = f"http://127.0.0.1:{local_server.free_port()}"
    with pytest.raises(RuntimeError, match=r"(?s)the env server exited with code 3 while starting.*no such model"):
        local_server.start(argv, url, tmp_path / "exit.log", what="the env server")


def test_a_child_that_never_gets_healthy_is_killed_after_the_timeout(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    argv = [sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
            "print('loading', flush=True); time.sleep(600)"]
    url = f"http://127.0.0.1:{local_server.free_port()}"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)did not become healthy within 5 s.*loading"):
        local_server.start(argv, url, tmp_path / "slow.log", timeout_s=5)
    assert time.monotonic() - start < 30
    assert _gone(int(pid_file.read_text()))
