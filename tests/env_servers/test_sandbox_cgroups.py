"""Slot cgroups on both layouts, against fake cgroup trees (the v2 path cannot run on this hybrid host)."""

from __future__ import annotations

import os
import subprocess

from env_servers.sandbox.cgroups import PARENT, SlotCgroup, layout


def test_v2_layout_writes_limits_counts_ooms_and_kills_with_cgroup_kill(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids io\n")
    cg = SlotCgroup("p1-test-0", root=tmp_path, kind="v2")
    assert cg.create(640 * 2**20, 72)
    slot = tmp_path / PARENT / "p1-test-0"
    assert (slot / "memory.max").read_text() == str(640 * 2**20)
    assert (slot / "memory.swap.max").read_text() == "0"
    assert (slot / "pids.max").read_text() == "72"
    assert "+memory +pids" in (tmp_path / PARENT / "cgroup.subtree_control").read_text()
    assert cg.procs_files() == [str(slot / "cgroup.procs")]
    (slot / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
    assert cg.oom_kills() == 2
    (slot / "cgroup.kill").write_text("")
    cg.kill()
    assert (slot / "cgroup.kill").read_text() == "1"


def test_hybrid_layout_puts_limits_in_v1_and_kills_through_unified(tmp_path):
    for ctl in ("memory", "pids", "unified"):
        (tmp_path / ctl).mkdir()
    (tmp_path / "unified" / "cgroup.procs").write_text("")
    cg = SlotCgroup("p1-test-1", root=tmp_path, kind="hybrid")
    assert cg.create(512 * 2**20, 64)
    mem = tmp_path / "memory" / PARENT / "p1-test-1"
    assert (mem / "memory.limit_in_bytes").read_text() == str(512 * 2**20)
    assert (mem / "memory.memsw.limit_in_bytes").read_text() == str(512 * 2**20)
    assert (tmp_path / "pids" / PARENT / "p1-test-1" / "pids.max").read_text() == "64"
    assert len(cg.procs_files()) == 3
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert cg.oom_kills() == 5


def test_stale_slots_of_dead_processes_are_removed(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("memory pids\n")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / PARENT / f"p{dead.pid}-local-zygote-1"
    live = tmp_path / PARENT / f"p{os.getpid()}-local-zygote-1"
    stale.mkdir(parents=True)
    live.mkdir()
    SlotCgroup("p1-new-0", root=tmp_path, kind="v2").create(2**20, 8)
    assert not stale.exists() and live.exists()


def test_no_cgroups_without_root_or_controllers(tmp_path):
    assert SlotCgroup("x", root=tmp_path, kind=None).create(2**20, 8) is False
    assert layout(tmp_path) is None  # an empty tree has neither layout (and non-root never gets one)
