"""The HTTP API in-process: bad requests, per-user visibility, hashed API keys, bind rules."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

import httpx
import pytest

from trainer.scheduler._jobs import JobRequest
from trainer.scheduler._store import Principal
from trainer.scheduler.errors import SchedulerError
from trainer.scheduler.server import create_app, resolve_auth


async def test_submit_status_logs_and_list(api, sched):
    r = await api.post("/jobs", json={"command": ["sh", "-c", "echo one; echo two; echo three"], "name": "hello"})
    assert r.status_code == 201
    job = r.json()
    assert job["state"] == "running" and job["name"] == "hello" and job["log_path"].endswith(f"{job['id']}.log")
    await sched.wait(job["id"], timeout_s=10)
    assert (await api.get(f"/jobs/{job['id']}")).json()["state"] == "succeeded"
    assert (await api.get(f"/jobs/{job['id']}/logs")).text == "one\ntwo\nthree\n"
    assert (await api.get(f"/jobs/{job['id']}/logs", params={"tail": 2})).text == "two\nthree\n"
    listed = (await api.get("/jobs")).json()
    assert [(j["id"], j["name"], j["state"], j["gpus"]) for j in listed] == [(job["id"], "hello", "succeeded", [])]


async def test_gpus_show_which_job_holds_them(api, sched):
    job = (await api.post("/jobs", json={"command": ["sleep", "60"], "gpus": 3})).json()
    holders = [g["job"] for g in (await api.get("/gpus")).json()]
    assert holders == [job["id"]] * 3 + [None]
    assert (await api.post(f"/jobs/{job['id']}/cancel")).json()["state"] == "cancelled"
    assert [g["job"] for g in (await api.get("/gpus")).json()] == [None] * 4


async def test_nodes_show_the_local_inventory_and_who_holds_it(api, sched):
    job = (await api.post("/jobs", json={"command": ["sleep", "60"], "gpus": 3})).json()
    assert (await api.get("/nodes")).json() == [
        {"node_id": "local", "node_ip": "127.0.0.1", "gpus": 4, "gpus_free": 1, "jobs": [job["id"]]}]
    await api.post(f"/jobs/{job['id']}/cancel")
    assert (await api.get("/nodes")).json()[0]["gpus_free"] == 4


@pytest.mark.parametrize("body, status, words", [
    ({"command": ["sleep", "1"], "gpus": 5}, 400, "at most 4 GPUs"),
    ({"command": ["sleep", "1"], "kind": "train"}, 422, "kind"),
    ({"gpus": 1}, 422, "command"),
    ({"command": []}, 422, "command"),
    ({"command": [""]}, 422, "program name"),
    ({"command": ["sleep", "1"], "gpus": -1}, 422, "gpus"),
    ({"command": ["sleep", "1"], "kind": "cmd", "torchrun": True}, 400, "torchrun only for kind rl or sft"),
    ({"command": ["sleep", "1"], "surprise": 1}, 422, "surprise"),
])
async def test_bad_submissions_are_refused_with_a_message(api, sched, body, status, words):
    r = await api.post("/jobs", json=body)
    assert r.status_code == status
    assert words in r.text
    assert sched.jobs == {}


@pytest.mark.parametrize("method, path", [("GET", "/jobs/nope"), ("POST", "/jobs/nope/cancel"),
                                          ("POST", "/jobs/nope/heartbeat"), ("GET", "/jobs/nope/logs")])
async def test_unknown_job_ids_are_404(api, method, path):
    r = await api.request(method, path)
    assert r.status_code == 404 and "No job 'nope'" in r.json()["detail"]


@pytest.fixture
async def keyed(sched):
    keys = {"alice": sched.store.create_key("alice"), "bob": sched.store.create_key("bob"),
            "root": sched.store.create_key("root", admin=True)}
    transport = httpx.ASGITransport(app=create_app(sched, auth=True))
    clients = {user: httpx.AsyncClient(transport=transport, base_url="http://sched",
                                       headers={"Authorization": f"Bearer {key}"}) for user, key in keys.items()}
    clients["anonymous"] = httpx.AsyncClient(transport=transport, base_url="http://sched")
    yield keys, clients
    for client in clients.values():
        await client.aclose()


async def test_requests_without_a_valid_key_are_401(keyed):
    keys, clients = keyed
    assert (await clients["anonymous"].get("/jobs")).status_code == 401
    forged = keys["alice"][:-4] + "AAAA"
    r = await clients["anonymous"].get("/jobs", headers={"Authorization": f"Bearer {forged}"})
    assert r.status_code == 401 and "Unknown API key" in r.text
    assert (await clients["anonymous"].get("/health")).json()["auth"] is True


async def test_users_see_only_their_own_jobs_and_admins_see_all(keyed):
    _, c = keyed
    a = (await c["alice"].post("/jobs", json={"command": ["sleep", "60"]})).json()
    b = (await c["bob"].post("/jobs", json={"command": ["sleep", "60"]})).json()
    assert (a["user"], b["user"]) == ("alice", "bob")
    assert [j["id"] for j in (await c["alice"].get("/jobs")).json()] == [a["id"]]
    assert (await c["bob"].get(f"/jobs/{a['id']}")).status_code == 404
    assert (await c["bob"].post(f"/jobs/{a['id']}/cancel")).status_code == 404
    assert (await c["bob"].get(f"/jobs/{a['id']}/logs")).status_code == 404
    assert [j["id"] for j in (await c["root"].get("/jobs")).json()] == [a["id"], b["id"]]
    assert (await c["root"].get("/jobs", params={"all": "false"})).json() == []
    assert (await c["root"].post(f"/jobs/{a['id']}/cancel")).json()["reason"] == "cancelled by root"
    assert (await c["bob"].post(f"/jobs/{b['id']}/cancel")).json()["state"] == "cancelled"


async def test_keys_are_stored_only_as_salted_hashes(keyed, sched):
    keys, _ = keyed
    rows = sqlite3.connect(sched.config.db_path).execute("SELECT key_id, salt, hash FROM api_keys").fetchall()
    dump = b"".join(p.read_bytes() for p in Path(sched.config.db_path).parent.glob("sched.db*") if p.is_file())
    assert len(rows) == 3 and len({salt for _, salt, _ in rows}) == 3
    for key in keys.values():
        secret = key.split(".", 1)[1]
        assert secret.encode() not in dump
        assert all(secret not in h for _, _, h in rows)


def test_binding_beyond_loopback_needs_auth():
    assert resolve_auth("127.0.0.1", None, 0) is False
    assert resolve_auth("127.0.0.1", None, 2) is True
    assert resolve_auth("0.0.0.0", None, 1) is True
    with pytest.raises(SchedulerError, match="Refusing to bind 0.0.0.0 without auth"):
        resolve_auth("0.0.0.0", None, 0)
    with pytest.raises(SchedulerError, match="Refusing to bind 10.1.2.3 without auth"):
        resolve_auth("10.1.2.3", False, 3)
    with pytest.raises(SchedulerError, match="at least one API key"):
        resolve_auth("0.0.0.0", True, 0)


async def test_job_environment_never_carries_the_scheduler_key(sched, monkeypatch, tmp_path):
    key = f"esk_{uuid.uuid4().hex}"  # a value no other variable of the host's environment holds
    monkeypatch.setenv("ENVHUB_SCHEDULER_KEY", key)
    job = await sched.submit(Principal("u"), JobRequest(command=["sh", "-c", "env"], env={"MY_FLAG": "1"}))
    await sched.wait(job.id, timeout_s=10)
    out = (tmp_path / "sched.db.logs" / f"{job.id}.log").read_text()
    assert "MY_FLAG=1" in out and "ENVHUB_JOB_ID=" in out
    assert key not in out and "ENVHUB_SCHEDULER_KEY" not in out
