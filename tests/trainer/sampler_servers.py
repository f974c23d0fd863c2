"""Real sampler server processes for the live tests: started on a free loopback port, stopped (or killed) by the test."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from trainer.quickstart import free_port

#: the tiny shape the trainer tests use (tests/trainer/test_recipes.py)
TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64"]


class ServerProcess:
    """``python -m trainer.sampler_server`` on ``port`` (a free one by default), healthy once constructed."""

    def __init__(self, log_dir: Path, *args: str, port: int | None = None, timeout_s: float = 120.0):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"sampler-{self.port}-{time.monotonic_ns()}.log"
        argv = [sys.executable, "-m", "trainer.sampler_server", "--host", "127.0.0.1", "--port", str(self.port),
                *(args or TINY)]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the sampler server exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1):
                    return
            except OSError as exc:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the sampler server did not come up: {self.log_path.read_text()[-2000:]}") from exc
                time.sleep(0.2)

    def metric(self, name: str, token: str | None = None) -> float:
        request = urllib.request.Request(f"{self.url}/metrics",
                                         headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(request, timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(f"envhub_sampler_{name} "):
                    return float(line.split()[1])
        raise KeyError(name)

    def kill(self) -> None:
        """SIGKILL: the server dies mid-request, as a crashed one would."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
