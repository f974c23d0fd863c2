"""The service's durable state and names: futures deduplicated and failed across a restart, tinker:// paths."""

from __future__ import annotations

import json

import pytest

from trainer.service import _paths
from trainer.service._store import RESTART_ERROR, Store


def test_a_resent_request_gets_the_first_ones_future(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    first, new = store.add_future("run:0/3", "optim_step", "run:0")
    again, new_again = store.add_future("run:0/3", "optim_step", "run:0")
    other, _ = store.add_future("run:0/4", "optim_step", "run:0")
    assert new and not new_again and again == first and other != first


def test_finished_results_survive_a_restart_and_pending_ones_fail(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    done, _ = store.add_future("a/1", "forward_backward", "a")
    store.finish_future(done, "completed", b"\x0a\x01x", "application/x-protobuf")
    pending, _ = store.add_future("a/2", "optim_step", "a")
    store.close()

    reopened = Store(tmp_path / "s.sqlite")
    assert reopened.interrupted == 1
    kept = reopened.future(done)
    assert (kept.status, kept.result, kept.content_type) == ("completed", b"\x0a\x01x", "application/x-protobuf")
    failed = reopened.future(pending)
    assert failed.status == "failed"
    assert json.loads(failed.result) == {"error": RESTART_ERROR, "category": "server"}
    assert reopened.add_future("a/2", "optim_step", "a") == (pending, False)  # a re-send is not run again


def test_stale_sessions_are_the_silent_and_the_finished(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    store.add_session("live", {})
    store.add_session("done", {})
    store.finish_session("done")
    assert store.stale_sessions(idle_s=60) == ["done"]
    assert set(store.stale_sessions(idle_s=-1)) == {"live", "done"}
    assert not store.heartbeat("nobody")


def test_tinker_paths_round_trip_and_bad_ones_say_what_is_expected(tmp_path):
    path = _paths.parse("tinker://sess-1:train:0/weights/step-10")
    assert (path.training_run_id, path.kind, path.name) == ("sess-1:train:0", "weights", "step-10")
    assert str(path) == "tinker://sess-1:train:0/weights/step-10"
    assert path.directory(tmp_path) == tmp_path / "checkpoints" / "sess-1_train_0" / "weights" / "step-10"
    for bad in ("s3://x/weights/a", "tinker://run/a", "tinker://run/other/a", "tinker://run/weights/../x"):
        with pytest.raises(ValueError, match="Expected"):
            _paths.parse(bad)
    with pytest.raises(ValueError, match="weights checkpoint"):
        _paths.parse("tinker://run/sampler_weights/a", "weights")
