"""The Dockerfile ``envhub init`` writes: the package builds on envhub:local, serves its env by name, and
keeps the image's guarantees (no pip left, an unprivileged user, a healthcheck).

Needs a Docker engine and the envhub image (``bash scripts/fleet-images.sh`` as root); the build
fetches the package's build backend from the package index (the host's CA bundle goes along for
TLS-intercepting proxies, as ``scripts/fleet-images.sh`` does).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from compose_project import ROOT, build_images, engine_problem, free_ports, health, wait_for

from envhub.client import EnvClient

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def test_an_initialised_package_builds_and_serves_as_an_image(tmp_path: Path) -> None:
    problem = engine_problem()
    if problem:
        pytest.skip(problem)
    build_images()
    subprocess.run([sys.executable, "-m", "envhub", "init", "img_demo", "--tools"], cwd=tmp_path, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    package = tmp_path / "img_demo"
    ca = os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"
    if Path(ca).is_file():
        shutil.copy(ca, package / "build-ca.pem")
    tag = f"img-demo-test:{os.getpid()}"
    build = subprocess.run(["docker", "build", "-q", "-t", tag, "."], cwd=package, capture_output=True, text=True,
                           timeout=900, env={**os.environ, "DOCKER_BUILDKIT": "0"})
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (port,) = free_ports(1)
    name = f"img-demo-{os.getpid()}"
    try:
        subprocess.run(["docker", "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", tag], check=True,
                       capture_output=True)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: health(url), 60, "the env image to answer /health")

        async def play() -> float:
            async with EnvClient(url) as env:
                await env.reset(seed=0)
                return (await env.step({"tool_name": "submit", "arguments": {"answer": -1}})).reward

        assert asyncio.run(play()) == 0.0
        inside = subprocess.run(["docker", "exec", name, "sh", "-c", "id -u; ls /opt/envhub/bin; envhub list"],
                                capture_output=True, text=True, check=True).stdout
        assert inside.startswith("10001\n") and "\npip" not in inside
        assert "img_demo_env.env:ImgDemoEnv" in inside and "build-ca.pem" not in subprocess.run(
            ["docker", "exec", name, "find", "/opt/envhub", "-name", "build-ca.pem"], capture_output=True,
            text=True).stdout
        wait_for(lambda: subprocess.run(["docker", "inspect", "--format", "{{.State.Health.Status}}", name],
                                        capture_output=True, text=True).stdout.strip() == "healthy",
                 90, "the image's healthcheck to pass")
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)
