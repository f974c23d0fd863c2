"""Hostile programs against every available sandbox backend: each must be contained, and the next run clean.

Timeouts are 1 s so the whole suite stays quick on 2 cores. The rlimit fallback is not a
security boundary; the attacks it cannot stop (network, filesystem writes, disk filling)
run only against the isolating backends.
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import threading
import time
import uuid

import pytest
from test_sandbox_backends import FAST, ISOLATING, LOCAL, assert_healthy, backend_params, build

from env_servers.sandbox import Limits

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def backends():
    built = {}
    yield built
    for b in built.values():
        b.close()


@pytest.fixture(params=backend_params(LOCAL))
def backend(request, backends):
    if request.param not in backends:
        backends[request.param] = build(request.param)
    b = backends[request.param]
    yield b
    assert_healthy(b)


@pytest.fixture(params=backend_params(ISOLATING))
def isolating(request, backends):
    if request.param not in backends:
        backends[request.param] = build(request.param)
    b = backends[request.param]
    yield b
    assert_healthy(b)


def test_infinite_loop_is_killed_at_the_deadline(backend):
    result = backend.run_sync("while True:\n    pass", limits=FAST)
    assert result.timed_out and result.exit_code is None
    assert 0.9 < result.duration_s < 2.0


def test_cpu_burn_in_threads_is_killed(backend):
    code = ("import threading\ndef spin():\n    while True: pass\n"
            "ts = [threading.Thread(target=spin) for _ in range(4)]\n[t.start() for t in ts]\n[t.join() for t in ts]")
    result = backend.run_sync(code, limits=FAST)
    assert result.timed_out and result.duration_s < 2.0


def test_sleeping_program_is_killed_by_the_wall_clock(backend):
    result = backend.run_sync("import time\ntime.sleep(60)", limits=FAST)
    assert result.timed_out and result.duration_s < 2.0


def test_fork_bomb_is_contained(backend):
    code = ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    result = backend.run_sync(code, limits=FAST)
    assert not result.ok and result.duration_s < 2.5


@pytest.mark.parametrize("name", backend_params(LOCAL))
def test_the_slot_a_fork_bomb_ran_in_serves_the_next_run(name):
    """One slot: the next run there must start although the bomb's killed children still await their reaping
    (they count against the slot uid's RLIMIT_NPROC until then)."""
    with build(name, slots=1) as one_slot:
        code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
        assert not one_slot.run_sync(code, limits=FAST).ok
        after = one_slot.run_sync("print('ok')", limits=Limits(timeout_s=5, nproc=8))  # fewer than the bomb made
        assert after.ok and after.stdout == "ok\n", (after.summary(), after.stderr[-2000:])


def test_subprocess_bomb_is_contained(backend):
    code = ("import subprocess, sys\nps = []\nwhile True:\n    try:\n"
            "        ps.append(subprocess.Popen(['sleep', '30']))\n"
            "    except OSError as e:\n        print('refused', e.errno, flush=True)\n        break\n"
            "import time; time.sleep(30)")
    result = backend.run_sync(code, limits=Limits(timeout_s=2.0, nproc=32))
    assert "refused" in result.stdout and result.timed_out


def test_memory_bomb_gets_memory_error_not_host_memory(backend):
    result = backend.run_sync("x = bytearray(8 * 1024 ** 3)", limits=FAST)
    assert result.exit_code == 1 and "MemoryError" in result.stderr


def test_gradual_memory_growth_is_stopped(backend):
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 * 1024))"
    result = backend.run_sync(code, limits=Limits(timeout_s=2.0, mem_mb=256))
    assert not result.ok and ("MemoryError" in result.stderr or result.oom_killed)


def test_memory_spread_across_children_is_capped_by_the_cgroup(backend):
    # each child stays under RLIMIT_AS; together they exceed the slot's memory cgroup
    code = ("import os, time\npids = []\nfor i in range(8):\n    pid = os.fork()\n    if pid == 0:\n"
            "        b = bytearray(200 * 1024 * 1024)\n        b[::4096] = b'x' * len(b[::4096])\n"
            "        time.sleep(30)\n        os._exit(0)\n    pids.append(pid)\nfor p in pids:\n    os.waitpid(p, 0)")
    result = backend.run_sync(code, limits=Limits(timeout_s=2.0, mem_mb=256))
    assert not result.ok
    if backend.info()["cgroups"] is not None:
        assert result.oom_killed


def test_output_flood_is_capped_and_killed_quickly(backend):
    result = backend.run_sync("while True:\n    print('x' * 10000)", limits=Limits(timeout_s=5.0))
    assert result.output_truncated
    assert len(result.stdout.encode()) <= 64 * 1024
    assert result.duration_s < 2.0


def test_processes_do_not_outlive_the_run(backend):
    marker = f"envhub-daemon-{uuid.uuid4().hex}"
    code = ("import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', '{marker}'])\n"
            "    os._exit(0)\nprint('parent done')")
    result = backend.run_sync(code, limits=FAST)
    assert result.stdout == "parent done\n"
    time.sleep(0.2)
    survivors = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    survivors.append(pid)
        except OSError:
            continue
    assert survivors == []


def test_host_processes_cannot_be_killed(backend):
    victim = subprocess.Popen(["sleep", "30"])
    try:
        code = (f"import os, signal\nfor pid in ({victim.pid}, {os.getpid()}, 1):\n    try:\n"
                "        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print('denied', pid)\n"
                "try:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass")
        backend.run_sync(code, limits=FAST)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_server_environment_and_other_processes_secrets_are_unreadable(backend, monkeypatch):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("ENVHUB_TEST_SECRET", secret)
    code = ("import os, glob\nfound = [k for k, v in os.environ.items() if 'SECRET' in k]\n"
            "for path in glob.glob('/proc/*/environ'):\n    try:\n        data = open(path, 'rb').read()\n"
            "    except OSError:\n        continue\n    if b'ENVHUB_TEST_SECRET' in data:\n        found.append(path)\n"
            "print(found)")
    result = backend.run_sync(code, limits=FAST)
    assert result.stdout == "[]\n", result.stdout
    assert secret not in result.stdout


def test_root_only_files_are_unreadable(backend, tmp_path):
    secret = tmp_path / "root-only.txt"
    secret.write_text("top secret")
    secret.chmod(0o600)
    code = (f"for p in ('{secret}', '/etc/shadow', '/root/.bashrc', '/proc/1/mem'):\n    try:\n"
            "        print('READ', p, open(p, 'rb').read(20))\n    except OSError as e:\n        print('denied', p)")
    result = backend.run_sync(code, limits=FAST)
    assert "READ" not in result.stdout and "top secret" not in result.stdout


def test_files_outside_scratch_cannot_be_changed(isolating, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    victim.chmod(0o666)
    tmp_path.chmod(0o777)
    code = (f"import os\nfor p in ('/pwned', '/usr/pwned', '/etc/pwned', '{tmp_path}/new.txt'):\n    try:\n"
            "        open(p, 'w').write('x')\n        print('WROTE', p)\n    except OSError:\n        pass\n"
            f"for p in ('{victim}', '/usr/bin/python3'):\n    try:\n        os.remove(p)\n        print('REMOVED', p)\n"
            "    except OSError:\n        pass")
    result = isolating.run_sync(code, limits=FAST)
    assert "WROTE" not in result.stdout and "REMOVED" not in result.stdout
    assert victim.read_text() == "keep me" and not os.path.exists("/pwned")
    assert not (tmp_path / "new.txt").exists()


def test_loopback_services_and_unix_sockets_are_unreachable(isolating, tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.1)
    port = server.getsockname()[1]
    unix_path = tmp_path / "svc.sock"
    unix_server = socket.socket(socket.AF_UNIX)
    unix_server.bind(str(unix_path))
    unix_server.listen()
    unix_path.chmod(0o777)
    tmp_path.chmod(0o777)
    accepted, finished = [], threading.Event()

    def accept_loop():
        while not finished.is_set():
            try:
                conn, _ = server.accept()
                accepted.append(conn)
            except OSError:
                pass

    thread = threading.Thread(target=accept_loop)
    thread.start()
    code = ("import socket\nfor family, addr in ((socket.AF_INET, ('127.0.0.1', %d)), (socket.AF_INET, ('1.1.1.1', 53)),"
            " (socket.AF_INET6, ('::1', %d)), (socket.AF_UNIX, %r)):\n    try:\n        s = socket.socket(family)\n"
            "        s.settimeout(0.5)\n        s.connect(addr)\n        print('CONNECTED', addr)\n"
            "    except OSError as e:\n        print('blocked', e.errno)") % (port, port, str(unix_path))
    try:
        result = isolating.run_sync(code, limits=Limits(timeout_s=3.0))
    finally:
        finished.set()
        thread.join()
        server.close()
        unix_server.close()
    assert "CONNECTED" not in result.stdout
    assert result.stdout.count("blocked") == 4
    assert accepted == []


def test_filling_the_disk_stops_at_the_scratch_quota(isolating):
    before = __import__("shutil").disk_usage("/").free
    code = ("import os\nn = 0\ntry:\n    while True:\n        with open(f'f{n}', 'wb') as f:\n"
            "            f.write(b'0' * (4 * 1024 * 1024))\n        n += 1\nexcept OSError as e:\n    print('stopped', e.errno, n)\n"
            "try:\n    open('/tmp/big', 'wb').write(b'0' * (100 * 1024 * 1024))\nexcept OSError as e:\n    print('big', e.errno)")
    result = isolating.run_sync(code, limits=Limits(timeout_s=3.0))
    assert "stopped" in result.stdout
    assert __import__("shutil").disk_usage("/").free > before - 50 * 1024 * 1024


def test_exhausting_file_descriptors_is_contained(backend):
    code = ("fs = []\ntry:\n    while True:\n        fs.append(open('/dev/null'))\nexcept OSError as e:\n"
            "    print('limit', len(fs) < 300)")
    result = backend.run_sync(code, limits=FAST)
    assert result.stdout == "limit True\n"


def test_privilege_escalation_attempts_fail(backend):
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "caps = [l for l in open('/proc/self/status') if l.startswith(('CapEff', 'NoNewPrivs'))]\n"
            "print(''.join(caps))\nprint('setuid', libc.setuid(0), 'setgid', libc.setgid(0))\n"
            "print('unshare', libc.unshare(0x10000000))")
    result = backend.run_sync(code, limits=FAST)
    assert "CapEff:\t0000000000000000" in result.stdout
    assert "NoNewPrivs:\t1" in result.stdout
    assert "setuid -1 setgid -1" in result.stdout
    if backend.name != "local-rlimit":  # the fallback cannot stop a (harmless) private user namespace
        assert "unshare -1" in result.stdout


def test_seccomp_refuses_kernel_attack_surface(isolating):
    code = ("import ctypes, errno, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "def sys_(nr, *a):\n    r = libc.syscall(nr, *a)\n    return errno.errorcode.get(ctypes.get_errno(), r) if r < 0 else r\n"
            "print('bpf', sys_(321, 0, 0, 0), 'io_uring', sys_(425, 1, 0), 'perf', sys_(298, 0, 0, -1, -1, 0),\n"
            "      'keyctl', sys_(250, 0), 'clone3', sys_(435, 0, 0), 'mount', sys_(165, 0, 0, 0, 0, 0))\n"
            "for fam in (socket.AF_NETLINK, socket.AF_PACKET, socket.AF_INET):\n    try:\n        socket.socket(fam, socket.SOCK_RAW)\n"
            "        print('OPENED', fam)\n    except OSError as e:\n        print(errno.errorcode[e.errno])\n"
            "a, b = socket.socketpair()\na.send(b'unix ok')\nprint(b.recv(10).decode())")
    result = isolating.run_sync(code, limits=FAST)
    assert result.stdout.splitlines() == [
        "bpf EPERM io_uring EPERM perf EPERM keyctl EPERM clone3 ENOSYS mount EPERM",
        "EACCES", "EACCES", "EACCES", "unix ok"], result.stderr


def test_a_run_cannot_tamper_with_the_next_one(isolating):
    dirty = ("import ctypes, os, signal, subprocess, sys\n"
             "for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM):\n    try:\n        os.kill(1, sig)\n"
             "    except OSError:\n        pass\n"
             "os.makedirs('locked/deep'); open('locked/deep/f', 'w').write('x'); os.chmod('locked/deep', 0); os.chmod('locked', 0)\n"
             "open('/tmp/left', 'w').write('x'); open('/dev/shm/left', 'w').write('x')\n"
             "ctypes.CDLL(None).shmget(4242, 4096, 0o1000 | 0o600)\n"
             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
             "print('dirtied')")
    assert isolating.run_sync(dirty, limits=FAST).stdout == "dirtied\n"
    check = ("import os\nprint(sorted(os.listdir('.')), os.listdir('/tmp'), os.listdir('/dev/shm'))\n"
             "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) not in (os.getpid(), os.getppid())))\n"
             "print(len(open('/proc/sysvipc/shm').read().splitlines()) - 1)")
    lines = isolating.run_sync(check, limits=FAST).stdout.splitlines()
    assert lines[0] == "['main.py'] [] []"
    assert lines[1] in ("[]", "[1]")  # nothing but the zygote (pid 1; its per-run leader is our parent) or ourselves
    assert lines[2] == "0"


def test_a_run_cannot_read_an_earlier_runs_code_or_output_from_memory(isolating):
    # a forked worker must not inherit an earlier run's request or reply (in RL, another rollout's right answers)
    token = uuid.uuid4().hex
    victim = f"print('LEAK-' + {token!r})\n# CODE-{token}"
    for _ in range(isolating.slots):  # every slot has served it, so the next run follows it in its slot
        assert isolating.run_sync(victim, stdin=f"STDIN-{token}".encode(), limits=FAST).ok
    scan = ("import ctypes, re\nfound = set()\nfor line in open('/proc/self/maps'):\n    parts = line.split()\n"
            "    lo, hi = (int(x, 16) for x in parts[0].split('-'))\n"
            "    if 'r' not in parts[1] or parts[-1].startswith('[v') or hi - lo > 1 << 29:\n        continue\n"
            "    data = ctypes.string_at(lo, hi - lo)\n"
            "    for pat in (rb'(LEAK|CODE|STDIN)-[0-9a-f]{32}', rb'TEVBSy0[A-Za-z0-9+/]{40}', rb'U1RESU4t[A-Za-z0-9+/]{40}'):\n"
            "        found.update(m.group(0).decode() for m in re.finditer(pat, data))\nprint(sorted(found))")
    result = isolating.run_sync(scan, limits=Limits(timeout_s=10.0))
    assert result.ok, result.stderr[-2000:]
    leaked = base64.b64encode(f"LEAK-{token}".encode()).decode()[:40]
    assert token not in result.stdout and leaked[:20] not in result.stdout, result.stdout


def test_device_dir_and_message_queues_are_neither_writable_nor_shared_between_runs(isolating):
    dirty = ("import ctypes, os\nfor p in ('/dev/leak', '/dev/shm/big'):\n    try:\n"
             "        with open(p, 'wb') as f:\n            for _ in range(4):\n                f.write(b'x' * (30 << 20))\n"
             "        print('WROTE', p)\n    except OSError as e:\n        print('refused', p)\n"
             "libc = ctypes.CDLL(None, use_errno=True)\nfd = libc.mq_open(b'/envhub-leak', 0o100 | 2, 0o600, None)\n"
             "print('mq', 'OPENED' if fd >= 0 else 'refused')\nif fd >= 0:\n    libc.mq_send(fd, b'left', 4, 0)")
    result = isolating.run_sync(dirty, limits=FAST)
    assert "WROTE" not in result.stdout and "OPENED" not in result.stdout, result.stdout
    check = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "print(sorted(set(os.listdir('/dev')) - {'ptmx', 'pts', 'shm', 'core', 'fd', 'stderr', 'stdout', 'stdin', "
             "'tty', 'urandom', 'random', 'full', 'zero', 'null', 'mqueue'}), libc.mq_open(b'/envhub-leak', 2) >= 0)")
    assert isolating.run_sync(check, limits=FAST).stdout == "[] False\n"


def test_deeply_nested_scratch_directories_do_not_cost_the_runs_output(isolating):
    code = "import os\nfor _ in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\nprint('deep')"
    result = isolating.run_sync(code, limits=Limits(timeout_s=5.0))
    assert (result.stdout, result.exit_code) == ("deep\n", 0), result.stderr[-500:]
    assert isolating.run_sync("import os; print(os.listdir('.'))", limits=FAST).stdout == "['main.py']\n"
