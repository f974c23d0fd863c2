"""Shared fixtures for the sandbox tests: one instance of every backend that works on this host."""

from __future__ import annotations

import os

import pytest

from env_servers.sandbox import Limits, SandboxConfig, available_backends, make_backend

_AVAILABLE = available_backends() if os.geteuid() == 0 else []
#: the image of the container backend's workers (scripts/fleet-images.sh builds it)
DOCKER_IMAGE = os.environ.get("ENVHUB_SANDBOX_DOCKER_IMAGE", "envhub:local")


def _docker_image_ready() -> bool:
    """An engine answers and the worker image is built (the docker marker's tests run then)."""
    try:
        import docker

        docker.from_env(timeout=5).images.get(DOCKER_IMAGE)
        return True
    except Exception:
        return False


# the container backend joins every list when it can run here, marked `docker`
LOCAL = [name for name in ("local-zygote", "local-bwrap", "local-rlimit") if name in _AVAILABLE] \
    + (["docker"] if _docker_image_ready() else [])
ISOLATING = [name for name in LOCAL if name != "local-rlimit"]
SKIP_REASON = "needs root and a working bubblewrap (apt-get install -y bubblewrap) for the sandbox tests"
FAST = Limits(timeout_s=1.0)


def backend_params(names: list[str]) -> list:
    if not names:
        return [pytest.param(None, marks=pytest.mark.skip(reason=SKIP_REASON))]
    return [pytest.param(name, marks=[pytest.mark.sandbox] + ([pytest.mark.docker] if name == "docker" else []),
                         id=name) for name in names]


def build(name: str, slots: int = 2):
    return make_backend(SandboxConfig(backend=name, slots=slots, preload=(), docker_image=DOCKER_IMAGE))


def assert_healthy(backend) -> None:
    """A contained attack must leave the backend serving clean, fast runs."""
    result = backend.run_sync("import os; print('ok', sorted(os.listdir('.')))", limits=Limits(timeout_s=5))
    assert result.ok, (result.summary(), result.stderr[-2000:])
    assert result.stdout.startswith("ok ")
    assert result.duration_s < 3.0


@pytest.fixture(scope="module", params=backend_params(LOCAL))
def backend(request):
    b = build(request.param)
    yield b
    b.close()


def test_limits_validate_with_the_fix_in_the_message():
    with pytest.raises(ValueError, match="timeout_s"):
        Limits(timeout_s=0)
    with pytest.raises(ValueError, match="kill_output_bytes"):
        Limits(max_output_bytes=10, kill_output_bytes=5)


def test_config_rejects_unknown_backend_names():
    with pytest.raises(ValueError, match="local-zygote"):
        SandboxConfig(backend="chroot")
    assert SandboxConfig.from_env({"ENVHUB_SANDBOX_BACKEND": "local-bwrap", "ENVHUB_SANDBOX_SLOTS": "3"}).slots == 3


def test_runs_code_with_stdin_files_and_exit_status(backend):
    result = backend.run_sync("import sys\nprint(sys.stdin.read().upper(), open('data/in.txt').read())\n"
                              "print('warn', file=sys.stderr)\nsys.exit(3)",
                              stdin=b"hello", files={"data/in.txt": b"file-content"})
    assert result.stdout == "HELLO file-content\n"
    assert result.stderr == "warn\n"
    assert (result.exit_code, result.signal, result.timed_out) == (3, None, False)
    assert result.backend == backend.name


def test_a_traceback_points_at_the_users_code(backend):
    result = backend.run_sync("x = 1\nraise ValueError('boom')")
    assert result.exit_code == 1
    assert 'File "/sandbox/main.py", line 2' in result.stderr or "main.py\", line 2" in result.stderr
    assert result.stderr.rstrip().endswith("ValueError: boom")


def test_runs_do_not_see_each_others_files(backend):
    backend.run_sync("open('left.txt', 'w').write('x'); import tempfile; open(tempfile.gettempdir() + '/t', 'w')")
    result = backend.run_sync("import os; print(os.path.exists('left.txt'))")
    assert result.stdout == "False\n"


def test_bad_file_names_are_rejected(backend):
    with pytest.raises(ValueError, match="relative file name"):
        backend.run_sync("print(1)", files={"../escape": b"x"})


async def test_async_runs_are_concurrent_up_to_the_slot_count(backend):
    import asyncio

    code = "import time\nstart = time.time()\ntime.sleep(0.3)\nprint(start, time.time())"
    results = await asyncio.gather(*(backend.run(code) for _ in range(5)))
    intervals = [tuple(map(float, r.stdout.split())) for r in results]
    # the most runs alive at one instant: exactly the slot count (2), never more, and not one at a time
    overlap = max(sum(s <= t < e for s, e in intervals) for t, _ in intervals)
    assert overlap == 2, intervals


def test_info_names_the_backend(backend):
    info = backend.info()
    assert info["backend"] == backend.name and info["slots"] == 2


@pytest.mark.docker
def test_docker_backend_runs_code_without_network():
    from env_servers.sandbox.docker_backend import DockerBackend

    if "docker" not in LOCAL:
        pytest.skip(f"needs a reachable Docker engine, `pip install docker` and the {DOCKER_IMAGE} image "
                    "(bash scripts/fleet-images.sh)")
    with DockerBackend(slots=1, image=DOCKER_IMAGE) as b:
        result = b.run_sync("import socket\nprint(1)\nsocket.create_connection(('1.1.1.1', 53), timeout=1)",
                            limits=Limits(timeout_s=5))
        assert result.stdout == "1\n" and result.exit_code == 1 and "Error" in result.stderr
        assert b.run_sync("while True: pass", limits=FAST).timed_out
        assert b.run_sync("import os; print(os.getuid())").stdout == "65534\n"


@pytest.fixture
def zygote():
    if "local-zygote" not in LOCAL:
        pytest.skip(SKIP_REASON)
    from env_servers.sandbox.zygote import ZygoteBackend

    with ZygoteBackend(slots=1, preload=(), max_runs=3) as b:
        yield b


@pytest.mark.sandbox
def test_zygote_is_recycled_after_max_runs(zygote):
    outputs = [zygote.run_sync("import os; print(os.getpid())").stdout for _ in range(7)]
    # pids count up inside one zygote's namespace (a leader, then the run, per request) and start again in a fresh one
    assert outputs == ["3\n", "5\n", "7\n", "3\n", "5\n", "7\n", "3\n"]
    assert zygote.info()["workers_spawned"] == 3


@pytest.mark.sandbox
def test_zygote_killed_mid_run_is_reported_and_respawned(zygote):
    import threading

    zygote.run_sync("print('warm')")
    slot = zygote._slots[0]
    killer = threading.Timer(0.3, slot.cgroup.kill)  # what the OOM killer does to the slot's pid 1
    killer.start()
    result = zygote.run_sync("import time; time.sleep(3)", limits=Limits(timeout_s=5))
    killer.join()
    assert not result.ok and result.signal == 9 and "[sandbox]" in result.stderr
    assert zygote.run_sync("print('back')").stdout == "back\n"


def test_syntax_errors_are_reported_like_python_does(backend):
    result = backend.run_sync("x = (1,\nprint(2)")
    assert result.exit_code == 1
    assert 'main.py", line 1' in result.stderr and result.stderr.rstrip().endswith("SyntaxError: '(' was never closed")
    assert "zygote" not in result.stderr


def test_random_streams_differ_between_runs(backend):
    code = "import random\nprint(random.random())"
    assert len({backend.run_sync(code).stdout for _ in range(3)}) == 3


def test_docker_attach_stream_is_demultiplexed():
    import json
    import socket
    import struct
    import time

    from env_servers.sandbox.docker_backend import _Channel

    ours, engine = socket.socketpair()
    message = json.dumps({"ready": True}).encode()
    framed = struct.pack(">I", len(message)) + message
    # Docker's frames: [stream, 0, 0, 0, size] + payload; stderr frames are dropped, stdout split anywhere
    for stream, payload in ((2, b"warning"), (1, framed[:3]), (1, framed[3:])):
        engine.sendall(bytes([stream, 0, 0, 0]) + struct.pack(">I", len(payload)) + payload)
    channel = _Channel(ours)
    assert channel.recv(time.monotonic() + 2) == {"ready": True}
    channel.send({"code": "print(1)"})
    size = struct.unpack(">I", engine.recv(4))[0]
    assert json.loads(engine.recv(size)) == {"code": "print(1)"}
    from env_servers.sandbox import SandboxError

    with pytest.raises(SandboxError, match="watchdog"):
        channel.recv(time.monotonic() + 0.1)
    ours.close()
    engine.close()
