"""``docker``: one long-lived, locked-down container per slot running the same zygote (production).

Each container: no network, read-only root, tmpfs ``/sandbox`` and ``/tmp``, user 65534, all
capabilities dropped, no-new-privileges, pids and memory (= memory+swap, sized to each run's
``mem_mb``) limits, private IPC, Docker's default seccomp profile plus the sandbox's own filter
installed by every run, and the gVisor runtime when asked for. The zygote is pid 1 of
the container, so its ``kill(-1)`` cleanup reaches every process of a run. The protocol runs
over the container's attach socket; with ``tty=False`` Docker multiplexes it in 8-byte-header
frames, demultiplexed here. The ``docker`` package is imported only when this backend is built.
"""

from __future__ import annotations

import base64
import json
import signal
import socket
import struct
import time
from typing import Any

from env_servers.sandbox import seccomp
from env_servers.sandbox.base import Slot, SlotBackend
from env_servers.sandbox.limits import ExecResult, Limits, SandboxError, decode_output
from env_servers.sandbox.zygote import DEFAULT_PRELOAD, WATCHDOG_EXTRA_S, ZYGOTE_SOURCE

DEFAULT_IMAGE = "python:3.11-slim"
ZYGOTE_OVERHEAD_MB = 256  # the warm zygote's own heap (preloaded modules) on top of a run's memory


class _Channel:
    """Length-prefixed JSON over a Docker attach socket (stdout frames demultiplexed)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()

    def send(self, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.sock.sendall(struct.pack(">I", len(data)) + data)

    def _fill(self, deadline: float) -> None:
        header = self._recv_exact(8, deadline)
        stream, size = header[0], struct.unpack(">I", header[4:8])[0]
        payload = self._recv_exact(size, deadline)
        if stream == 1:
            self.buf += payload

    def _recv_exact(self, n: int, deadline: float) -> bytes:
        out = bytearray()
        while len(out) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SandboxError("the docker sandbox worker did not answer before the watchdog deadline")
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(n - len(out))
            except TimeoutError:
                continue  # the deadline check above turns this into a SandboxError
            if not chunk:
                raise SandboxError("the docker sandbox worker closed its stream")
            out += chunk
        return bytes(out)

    def recv(self, deadline: float) -> dict[str, Any]:
        while len(self.buf) < 4:
            self._fill(deadline)
        size = struct.unpack(">I", bytes(self.buf[:4]))[0]
        while len(self.buf) < 4 + size:
            self._fill(deadline)
        msg: dict[str, Any] = json.loads(bytes(self.buf[4:4 + size]))  # the zygote sends only objects
        del self.buf[:4 + size]
        return msg


class DockerBackend(SlotBackend):
    """Zygote containers through the Docker engine; needs ``pip install docker`` and a reachable engine."""

    name = "docker"
    isolation = "container"

    def __init__(self, slots: int | None = None, *, image: str = DEFAULT_IMAGE, limits: Limits = Limits(),
                 gvisor: bool = False, preload: tuple[str, ...] = DEFAULT_PRELOAD, client: Any = None):
        super().__init__(slots, use_cgroups=False)
        if client is None:
            import docker  # imported here: only deployments that use this backend need the package

            client = docker.from_env()
        self.client = client
        self.image, self.worker_limits, self.gvisor, self.preload = image, limits, gvisor, tuple(preload)
        self._containers: dict[int, tuple[Any, _Channel]] = {}
        self._mem_mb: dict[int, int] = {}  # each slot container's current memory limit

    def info(self) -> dict[str, Any]:
        return {**super().info(), "image": self.image, "runtime": "runsc" if self.gvisor else "runc"}

    def _host_config(self, mem_mb: int) -> dict[str, Any]:
        from docker.types import Ulimit

        lim, mem = self.worker_limits, f"{mem_mb}m"
        tmpfs_opts = f"rw,size={lim.tmpfs_mb}m,mode=1777"
        config: dict[str, Any] = self.client.api.create_host_config(
            network_mode="none", read_only=True, tmpfs={"/sandbox": tmpfs_opts, "/tmp": tmpfs_opts},
            cap_drop=["ALL"], security_opt=["no-new-privileges:true"], pids_limit=lim.nproc + 16,
            mem_limit=mem, memswap_limit=mem, nano_cpus=1_000_000_000, ipc_mode="private",
            ulimits=[Ulimit(name="nofile", soft=lim.nofile, hard=lim.nofile), Ulimit(name="core", soft=0, hard=0)],
            runtime="runsc" if self.gvisor else None, auto_remove=True)
        return config

    def _start(self, slot: Slot, mem_mb: int | None = None) -> tuple[Any, _Channel]:
        mem_mb = mem_mb or self.worker_limits.mem_mb + ZYGOTE_OVERHEAD_MB
        api = self.client.api  # the low-level API: `containers.run` cannot ask for StdinOnce
        # StdinOnce + auto_remove: when this server goes away (even SIGKILLed), its attach socket
        # closes, the zygote reads EOF and exits, and the engine deletes the container.
        config = api.create_container_config(
            self.image, ["python3", "-B", "-E", "-s", "-c", ZYGOTE_SOURCE.decode(), *self.preload],
            # working_dir "/": the engine (20.10) would create a missing /sandbox root-owned 0755 over the
            # tmpfs; each run chdirs into /sandbox itself
            stdin_open=True, tty=False, user="65534:65534", working_dir="/",
            environment={"OPENBLAS_NUM_THREADS": "1", "HOME": "/sandbox", **_seccomp_environment()},
            labels={"envhub.sandbox.slot": str(slot.index)}, host_config=self._host_config(mem_mb))
        config["StdinOnce"] = True
        created = api.create_container_from_config(config)
        container = self.client.containers.get(created["Id"])
        # attached before it starts, as `docker run -i` does: nothing the zygote writes can be missed
        raw = container.attach_socket(params={"stdin": 1, "stdout": 1, "stream": 1})
        channel = _Channel(getattr(raw, "_sock", raw))
        try:
            container.start()
            hello = channel.recv(time.monotonic() + 60)
            if not hello.get("ready"):
                raise SandboxError(f"the docker sandbox worker did not start: {hello!r}")
        except BaseException:
            _remove_quietly(container)
            raise
        self._mem_mb[slot.index] = mem_mb
        return container, channel

    def _fit_memory(self, slot: Slot, limits: Limits) -> tuple[Any, _Channel]:
        """The slot's container, its memory cgroup capping one run's processes together (as the local
        slots' cgroups do): resized when the run's ``mem_mb`` differs, replaced if the engine refuses."""
        want = limits.mem_mb + ZYGOTE_OVERHEAD_MB
        if slot.index in self._containers and self._mem_mb.get(slot.index) != want:
            try:
                self._containers[slot.index][0].update(mem_limit=f"{want}m", memswap_limit=f"{want}m")
                self._mem_mb[slot.index] = want
            except Exception:  # e.g. usage above the new limit: a fresh worker starts with it
                self._close_slot(slot)
        if slot.index not in self._containers:
            self._containers[slot.index] = self._start(slot, want)
        return self._containers[slot.index]

    def _run_slot(self, slot: Slot, code: str, stdin: bytes, files: dict[str, bytes], limits: Limits) -> ExecResult:
        _, channel = self._fit_memory(slot, limits)
        start = time.monotonic()
        request = {"code": code, "stdin": base64.b64encode(stdin).decode(),
                   "files": {k: base64.b64encode(v).decode() for k, v in files.items()}, "limits": limits.to_dict()}
        try:
            channel.send(request)
            reply = channel.recv(start + limits.timeout_s + WATCHDOG_EXTRA_S)
        except (OSError, SandboxError, ValueError) as exc:
            oom = self._oom_killed(slot)
            self._close_slot(slot)
            return ExecResult(stderr=f"[sandbox] {exc}", signal=signal.SIGKILL, oom_killed=oom,
                              timed_out=not oom and time.monotonic() - start >= limits.timeout_s,
                              duration_s=time.monotonic() - start)
        if "error" in reply or not reply.get("clean", True):
            self._close_slot(slot)
        if "error" in reply:
            return ExecResult(stderr=f"[sandbox] {reply['error']}", signal=signal.SIGKILL,
                              duration_s=time.monotonic() - start)
        return ExecResult(stdout=decode_output(base64.b64decode(reply["stdout"])),
                          stderr=decode_output(base64.b64decode(reply["stderr"])),
                          exit_code=reply["exit_code"], signal=reply["signal"], timed_out=reply["timed_out"],
                          output_truncated=reply["output_truncated"], duration_s=reply["duration_s"],
                          oom_killed=bool(reply.get("oom_killed")))

    def _oom_killed(self, slot: Slot) -> bool:
        entry = self._containers.get(slot.index)
        if entry is None:  # the slot's container is already gone
            return False
        container = entry[0]
        try:
            container.reload()
            return bool(container.attrs["State"].get("OOMKilled"))
        except Exception:  # the engine could not tell; report the run as killed without a cause
            return False

    def _close_slot(self, slot: Slot) -> None:
        entry = self._containers.pop(slot.index, None)
        if entry is not None:
            _remove_quietly(entry[0])


def _remove_quietly(container: Any) -> None:
    try:
        container.remove(force=True)
    except Exception:  # already gone (auto-removed when its zygote exited); nothing else to clean
        pass


def _seccomp_environment() -> dict[str, str]:
    """The sandbox's own seccomp filter for the zygote to install in every run, on top of Docker's
    default profile (which, on older engines, still allows io_uring, for one)."""
    if not seccomp.supported():
        return {}
    return {"ENVHUB_ZYGOTE_SECCOMP": base64.b64encode(seccomp.build_filter()).decode()}


def docker_available() -> bool:
    """True when the ``docker`` package is installed and an engine answers a ping."""
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False
