"""GPU inventory: declared lists work without a GPU; ``auto`` asks the driver or says why not."""

from __future__ import annotations

import shutil

import pytest

from trainer.scheduler._resources import GpuPool, PortPool, parse_gpus


def test_declared_inventory():
    gpus, note = parse_gpus("0,2,3")
    assert [g.index for g in gpus] == [0, 2, 3] and "3 declared" in note
    assert parse_gpus("")[0] == [] and "no GPUs declared" in parse_gpus("")[1]


@pytest.mark.parametrize("spec, words", [("0,0", "distinct"), ("a,b", "comma-separated"), ("-1", "non-negative")])
def test_bad_declared_inventory_is_refused(spec, words):
    with pytest.raises(ValueError, match=words):
        parse_gpus(spec)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a driver is present")
def test_auto_without_a_driver_is_zero_gpus_with_a_clear_message():
    gpus, note = parse_gpus("auto")
    assert gpus == [] and "no NVIDIA driver found" in note


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs an NVIDIA driver")
def test_auto_reads_the_driver():
    gpus, note = parse_gpus("auto")
    assert gpus and all(g.name != "declared" for g in gpus) and "GPU(s) from" in note


def test_a_gpu_is_never_held_by_two_jobs():
    pool = GpuPool(parse_gpus("0,1,2")[0])
    assert pool.take("a", 2) == [0, 1]
    assert pool.take("b", 2) is None and pool.free_count() == 1  # a refused take holds nothing
    with pytest.raises(RuntimeError, match="already held by job a"):
        pool.claim("b", [1])
    pool.release("a")
    assert pool.take("b", 3) == [0, 1, 2]


def test_ports_in_use_are_skipped():
    import socket

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        pool = PortPool(port, min(port + 20, 65535))
        taken = pool.take("a", 2)
        assert port not in taken and len(set(taken)) == 2
        assert not set(pool.take("b", 2)) & set(taken)
