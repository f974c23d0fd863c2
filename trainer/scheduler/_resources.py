"""What the scheduler hands out: GPUs (from a declared list or the driver) and TCP ports.

Both are plain allocators with one invariant each, checked on every call: a GPU or a port is held
by at most one job at a time.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    """One device the scheduler may place jobs on."""

    index: int
    name: str = "declared"
    memory_mib: int | None = None


def parse_gpus(spec: str | None) -> tuple[list[Gpu], str]:
    """Parse ``--gpus``: ``"0,1,2,3"``, ``"4"`` style lists, ``""`` (none) or ``"auto"``.

    Returns the inventory and a line that says where it came from, for the start-up log.
    """
    spec = (spec or "").strip()
    if spec == "auto":
        return detect_gpus()
    if not spec:
        return [], "no GPUs declared (pass --gpus 0,1,... or --gpus auto): only 0-GPU jobs can run"
    try:
        indices = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"Expected --gpus as comma-separated indices like 0,1,2,3 or 'auto', got {spec!r}") from None
    if len(set(indices)) != len(indices) or any(i < 0 for i in indices):
        raise ValueError(f"Expected distinct non-negative GPU indices, got {spec!r}")
    return [Gpu(i) for i in indices], f"{len(indices)} declared GPU(s): {','.join(map(str, indices))}"


def detect_gpus() -> tuple[list[Gpu], str]:
    """GPUs the driver reports, through NVML when importable, else ``nvidia-smi``; else none."""
    try:
        import pynvml  # type: ignore[import-not-found, unused-ignore]  # optional: nvidia-ml-py

        pynvml.nvmlInit()
        try:
            gpus = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(handle)
                mem = pynvml.nvmlDeviceGetMemoryInfo(handle).total // (1024 * 1024)
                gpus.append(Gpu(i, name.decode() if isinstance(name, bytes) else name, int(mem)))
            return gpus, f"{len(gpus)} GPU(s) from NVML"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no module, no driver, no device: fall through to nvidia-smi
        pass
    return _gpus_from_smi()


def _gpus_from_smi() -> tuple[list[Gpu], str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "--gpus auto: no NVIDIA driver found (no NVML, no nvidia-smi): 0 GPUs"
    try:
        out = subprocess.run([smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        return [], f"--gpus auto: nvidia-smi failed ({exc}): 0 GPUs"
    gpus = []
    for line in out.strip().splitlines():
        index, name, mem = (part.strip() for part in line.split(",", 2))
        gpus.append(Gpu(int(index), name, int(float(mem)) if mem.replace(".", "").isdigit() else None))
    return gpus, f"{len(gpus)} GPU(s) from nvidia-smi"


class GpuPool:
    """Free and held GPUs; hands out the lowest free indices first."""

    def __init__(self, gpus: list[Gpu]):
        self.gpus = list(gpus)
        self._holder: dict[int, str | None] = {g.index: None for g in gpus}

    @property
    def total(self) -> int:
        return len(self.gpus)

    def free_count(self) -> int:
        return sum(1 for h in self._holder.values() if h is None)

    def holder(self, index: int) -> str | None:
        return self._holder.get(index)

    def take(self, job_id: str, count: int) -> list[int] | None:
        """``count`` free GPUs for ``job_id``, or None when fewer are free (nothing taken then)."""
        free = [i for i in sorted(self._holder) if self._holder[i] is None]
        if len(free) < count:
            return None
        chosen = free[:count]
        for i in chosen:
            self._holder[i] = job_id
        return chosen

    def claim(self, job_id: str, indices: list[int]) -> None:
        """Mark ``indices`` as held by ``job_id`` (used when restoring state); they must be free."""
        for i in indices:
            if i in self._holder:
                if self._holder[i] not in (None, job_id):
                    raise RuntimeError(f"GPU {i} is already held by job {self._holder[i]}")
                self._holder[i] = job_id

    def release(self, job_id: str) -> None:
        for i, holder in self._holder.items():
            if holder == job_id:
                self._holder[i] = None


class PortPool:
    """TCP ports from ``[first, last]``; a port is handed out only if nobody listens on it."""

    def __init__(self, first: int = 29500, last: int = 29999, host: str = "127.0.0.1"):
        if not 0 < first <= last < 65536:
            raise ValueError(f"Expected a port range 0 < first <= last < 65536, got {first}-{last}")
        self.first, self.last, self.host = first, last, host
        self._holder: dict[int, str] = {}

    def take(self, job_id: str, count: int) -> list[int]:
        ports: list[int] = []
        for port in range(self.first, self.last + 1):
            if len(ports) == count:
                break
            if port not in self._holder and _bindable(port):
                ports.append(port)
        if len(ports) < count:
            raise RuntimeError(f"Expected {count} free ports in {self.first}-{self.last}, found {len(ports)}; "
                               "widen the range with --ports FIRST-LAST")
        for port in ports:
            self._holder[port] = job_id
        return ports

    def claim(self, job_id: str, ports: list[int]) -> None:
        for port in ports:
            self._holder[port] = job_id

    def release(self, job_id: str) -> None:
        for port in [p for p, holder in self._holder.items() if holder == job_id]:
            del self._holder[port]


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True
