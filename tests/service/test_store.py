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
    store.add_session("live", "a", {})
    store.add_session("done", "a", {})
    store.finish_session("done")
    assert store.stale_sessions(idle_s=60) == ["done"]
    assert set(store.stale_sessions(idle_s=-1)) == {"live", "done"}
    assert not store.heartbeat("nobody")
    assert store.live_sessions("a", idle_s=60) == 1 and store.live_sessions("b", idle_s=60) == 0


def test_everything_belongs_to_the_owner_of_its_session(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    store.add_session("sa", "alice", {})
    store.add_session("sb", "bob", {})
    store.add_model("sa:train:0", "sa", "tiny", 8, {})
    store.add_model("sb:train:0", "sb", "tiny", 8, {})
    assert (store.session_owner("sa"), store.session_owner("sb"), store.session_owner("sc")) == ("alice", "bob", None)
    runs, total = store.models("alice", limit=10, offset=0)
    assert [r["model_id"] for r in runs] == ["sa:train:0"] and total == 1
    rid, _ = store.add_future("k", "optim_step", "sa:train:0", "alice")
    assert store.future(rid).owner == "alice"
    assert _paths.session_of("sa:train:0") == _paths.session_of("sa:sample:3") == "sa"
    assert _paths.session_of("sa") is None and _paths.session_of("sa:train:x") is None


def test_a_state_directory_from_before_owners_opens_and_gains_them(tmp_path):
    import sqlite3

    old = sqlite3.connect(tmp_path / "s.sqlite")
    old.executescript("CREATE TABLE sessions (session_id TEXT PRIMARY KEY, created_at REAL, last_heartbeat_at REAL, "
                      "user_metadata TEXT, finished INTEGER DEFAULT 0);"
                      "INSERT INTO sessions VALUES ('s', 0, 0, '{}', 0);")
    old.close()
    store = Store(tmp_path / "s.sqlite")
    assert store.session_owner("s") == ""  # nobody's: no client owns it, so none can use it


def test_tinker_paths_round_trip_and_bad_ones_say_what_is_expected(tmp_path):
    path = _paths.parse("tinker://sess-1:train:0/weights/step-10")
    assert (path.training_run_id, path.kind, path.name) == ("sess-1:train:0", "weights", "step-10")
    assert str(path) == "tinker://sess-1:train:0/weights/step-10"
    assert path.directory(tmp_path) == tmp_path / "checkpoints" / "sess-1_train_0" / "weights" / "step-10"
    for bad in ("s3://x/weights/a", "tinker://run/a", "tinker://run/other/a", "tinker://run/weights/../x",
                "tinker://run/weights/a/../../x", "tinker://run/weights/", "tinker://run/weights/.hidden",
                "tinker://run/weights/a\n", "tinker://run/weights/" + "a" * 200, "/etc/passwd"):
        with pytest.raises(ValueError, match="Expected"):
            _paths.parse(bad)
    with pytest.raises(ValueError, match="weights checkpoint"):
        _paths.parse("tinker://run/sampler_weights/a", "weights")
