"""Code sandbox throughput: latency p50/p99 and executions/s per backend, next to a bare ``python3 -c`` subprocess.

    .venv/bin/python benchmarks/sandbox.py                 # every backend that works here
    .venv/bin/python benchmarks/sandbox.py --runs 500 --backends local-zygote
    .venv/bin/python benchmarks/sandbox.py --backends local-zygote,docker   # container workers (envhub:local)

Two workloads: ``print(1)`` and a numpy one (``import numpy`` + a small computation). Latency
is measured one run at a time; throughput with as many runs in flight as the backend has
slots (default: CPU cores). ``cpu ms`` is the CPU time one execution costs in all processes
(this one, its children, the slot workers): on a shared, loaded machine ``2000 / cpu ms`` is
the throughput two idle cores would give. Targets on 2 cores: warm zygote p50 <= 5 ms and >= 300 exec/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from env_servers.sandbox import Limits, SandboxConfig, available_backends, make_backend

WORKLOADS = {"print(1)": "print(1)", "numpy": "import numpy\nprint(numpy.arange(100).sum())"}
SANDBOX_PYTHON = "/usr/bin/python3"


def percentiles(samples_s: list[float]) -> tuple[float, float]:
    ordered = sorted(samples_s)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return p50 * 1000, p99 * 1000


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def worker_cpu_s(backend) -> float:
    """CPU of the long-lived slot workers (zygotes), including the runs they forked and reaped."""
    if backend.name == "docker":  # the workers are containers: ask the engine for their cgroups' CPU
        return sum(c.stats(stream=False)["cpu_stats"]["cpu_usage"]["total_usage"] / 1e9
                   for c, _ in list(backend._containers.values()))
    total = 0.0
    for slot in getattr(backend, "_slots", []):
        for pid in slot.cgroup.pids():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def bare_subprocess(code: str, runs: int, concurrency: int) -> tuple[float, float, float, float]:
    def one() -> float:
        t0 = time.perf_counter()
        subprocess.run([SANDBOX_PYTHON, "-c", code], capture_output=True, check=True)
        return time.perf_counter() - t0

    cpu0 = own_cpu_s()
    latencies = [one() for _ in range(runs)]
    cpu_ms = (own_cpu_s() - cpu0) / runs * 1000
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda _: one(), range(runs)))
    return (*percentiles(latencies), runs / (time.perf_counter() - t0), cpu_ms)


async def sandbox_backend(backend, code: str, runs: int) -> tuple[float, float, float, float]:
    limits = Limits(timeout_s=10)
    for _ in range(backend.slots * 2):  # warm every slot (zygote start, page cache)
        await backend.run(code, limits=limits)
    latencies = []
    cpu0 = own_cpu_s() + worker_cpu_s(backend)
    for _ in range(runs):
        t0 = time.perf_counter()
        result = await backend.run(code, limits=limits)
        latencies.append(time.perf_counter() - t0)
        if not result.ok:
            raise RuntimeError(f"{backend.name} failed the benchmark workload: {result.summary()} {result.stderr[-300:]}")
    cpu_ms = (own_cpu_s() + worker_cpu_s(backend) - cpu0) / runs * 1000
    t0 = time.perf_counter()
    await asyncio.gather(*(backend.run(code, limits=limits) for _ in range(runs)))
    return (*percentiles(latencies), runs / (time.perf_counter() - t0), cpu_ms)


def docker_image_present(image: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300, help="runs per measurement (default 300)")
    parser.add_argument("--slots", type=int, default=None, help="slots per backend (default: CPU cores)")
    parser.add_argument("--backends", default=None, help="comma-separated backends (default: all available)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds: checks that the script still runs (CI does this)")
    parser.add_argument("--docker-image", default=os.environ.get("ENVHUB_SANDBOX_DOCKER_IMAGE", "envhub:local"),
                        help="worker image of the docker backend (default envhub:local, built by "
                             "scripts/fleet-images.sh; ENVHUB_SANDBOX_DOCKER_IMAGE)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs = 4
    names = args.backends.split(",") if args.backends else available_backends()
    if not args.backends and "docker" in names and not docker_image_present(args.docker_image):
        print(f"note: no {args.docker_image} image (bash scripts/fleet-images.sh); skipping the docker backend")
        names.remove("docker")
    workloads = dict(WORKLOADS)
    if subprocess.run([SANDBOX_PYTHON, "-c", "import numpy"], capture_output=True).returncode:
        print(f"note: {SANDBOX_PYTHON} has no numpy (apt-get install python3-numpy); skipping the numpy workload")
        del workloads["numpy"]
    rows = []
    for label, code in workloads.items():
        slow = label == "numpy"
        runs = max(2 if args.smoke else 20, args.runs // 10) if slow else args.runs
        concurrency = args.slots or 2
        rows.append(("bare python3 -c", label, *bare_subprocess(code, runs, concurrency)))
        for name in names:
            backend = make_backend(SandboxConfig(backend=name, slots=args.slots, max_runs=1_000_000,
                                                  docker_image=args.docker_image))
            try:
                n = runs if name == "local-zygote" or not slow else max(2 if args.smoke else 20, runs // 2)
                rows.append((name, label, *asyncio.run(sandbox_backend(backend, code, n))))
            finally:
                backend.close()
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"{os.cpu_count()} cores, load average {load} at the end")
    print(f"{'backend':<18} {'workload':<10} {'p50 ms':>8} {'p99 ms':>8} {'exec/s':>8} {'cpu ms':>8}")
    for name, label, p50, p99, rate, cpu_ms in rows:
        print(f"{name:<18} {label:<10} {p50:>8.1f} {p99:>8.1f} {rate:>8.0f} {cpu_ms:>8.2f}")


if __name__ == "__main__":
    main()
