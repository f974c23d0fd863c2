"""A seeded fuzz of the live service: a few thousand malformed and abusive requests over loopback, then the checks
that matter to the other tenants: no 5xx, no hang, no server fault, memory bounded, and training still right."""

from __future__ import annotations

import copy
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from test_service_errors import PROTO, request_body  # noqa: E402
from test_service_hostile import ALICE, rss_mb  # noqa: E402
from test_service_sdk import TEXT, forward_logprobs, sft_datum, train  # noqa: E402

pytestmark = pytest.mark.live

SEED, MAX_REQUESTS, TIME_BUDGET_S = 20261125, 2000, 150
#: tight limits, so the valid requests the fuzzer stumbles on stay cheap and the queue stays short
LIMITS = {"max_batch_tokens": 1024, "max_batch_datums": 32, "max_samples": 4, "max_sample_tokens": 256,
          "max_pending": 16, "max_sessions": 8, "max_checkpoints_per_run": 4, "max_json_bytes": 64 * 1024,
          "max_request_bytes": 128 * 1024, "body_timeout_s": 5.0, "long_poll_s": 0.2}
NASTY: list[Any] = [None, True, False, -1, 0, 2**31, 2**63, 10**30, -(10**30), 1e308, -0.0, "", "x" * 3000,
                    "../../etc/passwd", "tinker://../weights/x", "\u0000", [], {}, [1] * 2000, {"a": {"b": [None]}},
                    "NaN", 3.5, [[[[[]]]]]]


class Fuzzer:
    """Turns one valid request of each route into many broken ones (``rng`` seeded: the same run every time)."""

    def __init__(self, rng: random.Random, ids: dict[str, str]):
        self.rng, self.ids = rng, ids

    def valid_json(self, route: str) -> dict[str, Any]:
        r, ids = self.rng, self.ids
        model = r.choice([ids["model"], ids["model"], ids["victim_model"], f"{ids['session']}:train:{r.randrange(9)}"])
        seq = r.randrange(10**6)
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [r.randrange(300) for _ in range(r.randrange(1, 9))]}]}
        return {
            "create_session": lambda: {"tags": [], "user_metadata": {"k": "v"}, "sdk_version": "0.38.0"},
            "session_heartbeat": lambda: {"session_id": r.choice([ids["session"], ids["victim_session"]])},
            "create_model": lambda: {"session_id": ids["session"], "model_seq_id": r.randrange(1, 6),
                                     "base_model": "tiny", "lora_config": {"rank": r.choice([1, 2, 4, 10**9])}},
            "get_info": lambda: {"model_id": model},
            "optim_step": lambda: {"model_id": model, "seq_id": seq,
                                   "adam_params": {"learning_rate": r.choice([1e-3, 0.0, -1.0, 1e30])}},
            "save_weights": lambda: {"model_id": model, "seq_id": seq, "path": r.choice(["a", "b", "c", "d", "e"])},
            "save_weights_for_sampler": lambda: {"model_id": model, "seq_id": seq,
                                                 "sampling_session_seq_id": r.randrange(50)},
            "load_weights": lambda: {"model_id": model, "seq_id": seq, "optimizer": True,
                                     "path": r.choice([ids["state"], ids["victim_state"]])},
            "unload_model": lambda: {"model_id": f"{ids['session']}:train:{r.randrange(1, 6)}"},
            "create_sampling_session": lambda: {"session_id": ids["session"], "sampling_session_seq_id": seq,
                                                "base_model": "tiny"},
            "asample": lambda: {"sampling_session_id": r.choice([ids["sampler"], ids["victim_sampler"]]),
                                "seq_id": seq, "num_samples": r.choice([1, 2, 4, 5, 10**9]), "prompt": prompt,
                                "sampling_params": {"max_tokens": r.choice([1, 8, 300, 10**9]), "temperature": 1.0}},
            "retrieve_future": lambda: {"request_id": str(r.choice([r.randrange(1, 200), 10**17, -1]))},
            "weights_info": lambda: {"tinker_path": r.choice([ids["state"], ids["victim_state"]])},
        }[route]()

    def mutate_json(self, body: Any, depth: int = 0) -> Any:
        r = self.rng
        if isinstance(body, dict) and body and depth < 4:
            key = r.choice(sorted(body))
            action = r.randrange(4)
            if action == 0:
                del body[key]
            elif action == 1:
                body[key] = self.mutate_json(body[key], depth + 1)
            else:
                body[key] = self.nasty()
            return body
        if isinstance(body, list) and body and depth < 4:
            body[r.randrange(len(body))] = self.mutate_json(body[0], depth + 1)
            return body
        return self.nasty()

    def nasty(self) -> Any:
        return copy.deepcopy(self.rng.choice(NASTY))  # a fresh copy: mutations never reach the shared list

    def json_bytes(self, route: str) -> bytes:
        r = self.rng
        body: Any = self.valid_json(route)
        for _ in range(r.randrange(4)):
            body = self.mutate_json(body)
        text = json.dumps(body).encode()
        kind = r.randrange(10)
        if kind == 0:
            return text[:r.randrange(len(text) + 1)]
        if kind == 1:
            return b"[" * r.randrange(100, 3000) + text
        if kind == 2:
            return text.replace(b"1.0", b"NaN").replace(b"0.001", b"Infinity")
        if kind == 3:
            return bytes(r.randrange(256) for _ in range(r.randrange(1, 64)))
        if kind == 4 and r.randrange(4) == 0:
            return text + b" " * (LIMITS["max_json_bytes"] + 1)  # over the limit: refused before it is read
        return text

    def proto_bytes(self) -> bytes:
        r, ids = self.rng, self.ids
        ids_ = [r.randrange(-5, 400) for _ in range(r.randrange(1, 40))]
        model = r.choice([ids["model"], ids["model"], ids["victim_model"]])
        body = request_body(model, r.randrange(10**6), [sft_datum(ids_ if len(ids_) > 1 else TEXT)] * r.randrange(1, 4))
        for _ in range(r.randrange(4)):
            at = r.randrange(len(body) + 1)
            op = r.randrange(4)
            if op == 0:
                body = body[:at]
            elif op == 1:
                body = body[:at] + bytes([r.randrange(256)]) + body[at + 1:]
            elif op == 2:
                body = body[:at] + bytes(r.randrange(256) for _ in range(r.randrange(1, 12))) + body[at:]
            else:
                body = body + body[:at]
        return body


def test_thousands_of_hostile_requests_leave_the_service_healthy_and_the_tenants_intact(serve_training, sdk):
    server = serve_training(**LIMITS)
    ops = server.app.state.ops
    victim = sdk(server.url, "tml-victim")
    tc = victim.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    train(tc, 1)
    ids = {"victim_model": tc.model_id, "victim_session": tc.model_id.split(":")[0],
           "victim_state": tc.save_state("v").result().path,
           "victim_sampler": tc.save_weights_and_get_sampling_client().result()._sampling_session_id}
    victim_weights = forward_logprobs(tc)
    with httpx.Client(base_url=server.url, headers=ALICE, timeout=30) as http:
        ids.update(_attacker(http))
        rng = random.Random(SEED)
        fuzz = Fuzzer(rng, ids)
        statuses = _fuzz(http, fuzz, rng, _rss_watch(baseline := rss_mb()))
    peak = statuses.pop("peak_rss_mb")
    assert statuses["total"] >= 300, statuses  # the time budget let a real number through
    assert not [s for s in statuses if isinstance(s, int) and s >= 500], statuses
    assert {200, 400, 404, 413, 415} <= set(statuses), statuses  # the fuzz reached every kind of answer
    assert peak - baseline < 400, (baseline, peak)  # memory stayed bounded through the abuse
    _drained(ops)
    faults = [json.loads(row[0]) for row in ops.store._run("SELECT result FROM futures WHERE status='failed'")]
    assert not [f for f in faults if f.get("category") != "user"], faults[:3]
    # the victim's run is exactly as it was, and training still works as it should
    assert forward_logprobs(tc) == pytest.approx(victim_weights, abs=0)
    losses = train(tc, 4)
    assert losses[-1] < losses[0], losses
    assert forward_logprobs(tc) != victim_weights


def _attacker(http: httpx.Client) -> dict[str, str]:
    """The fuzzing client's own session, run, checkpoint and sampler: valid ids make requests reach deeper."""
    session = http.post("/api/v1/create_session", json={}).json()["session_id"]
    rid = http.post("/api/v1/create_model", json={"session_id": session, "base_model": "tiny",
                                                  "lora_config": {"rank": 2}}).json()
    model = http.post("/api/v1/retrieve_future", json=rid).json()["model_id"]
    rid = http.post("/api/v1/save_weights", json={"model_id": model, "seq_id": 1, "path": "mine"}).json()
    state = _finished(http, rid)["path"]
    sampler = http.post("/api/v1/create_sampling_session", json={"session_id": session, "base_model": "tiny"})
    return {"session": session, "model": model, "state": state, "sampler": sampler.json()["sampling_session_id"]}


def _finished(http: httpx.Client, future: dict[str, Any]) -> dict[str, Any]:
    while True:
        out = http.post("/api/v1/retrieve_future", json=future).json()
        if out.get("type") != "try_again":
            return out


def _fuzz(http: httpx.Client, fuzz: Fuzzer, rng: random.Random, watch: Callable[[], float]) -> Counter:
    routes = sorted({"create_session", "session_heartbeat", "create_model", "get_info", "optim_step", "save_weights",
                     "save_weights_for_sampler", "load_weights", "unload_model", "create_sampling_session",
                     "asample", "retrieve_future", "weights_info"})
    statuses: Counter = Counter()
    deadline = time.monotonic() + TIME_BUDGET_S
    for _ in range(MAX_REQUESTS):
        if time.monotonic() > deadline:
            break
        kind = rng.randrange(12)
        if kind < 3:
            response = http.post("/api/v1/forward_backward", content=fuzz.proto_bytes(), headers=_headers(rng, True))
        elif kind == 3:
            path = rng.choice(["training_runs", f"training_runs/{fuzz.ids['victim_model']}", "samplers/x" * 50,
                               f"training_runs/{fuzz.ids['model']}/checkpoints", "training_runs?limit=-5&offset=1e9",
                               f"samplers/{fuzz.ids['victim_sampler']}", "training_runs?offset=" + "9" * 40])
            response = http.get(f"/api/v1/{path}")
        else:
            route = rng.choice(routes)
            response = http.post(f"/api/v1/{route}", content=fuzz.json_bytes(route), headers=_headers(rng, False))
        statuses[response.status_code] += 1
        statuses["total"] += 1
    statuses["peak_rss_mb"] = round(watch())
    return statuses


def _headers(rng: random.Random, proto: bool) -> dict[str, str]:
    kind = rng.randrange(20)
    if kind == 0:
        return {"content-type": "text/plain"}
    if kind == 1:
        return {"content-type": "application/json" if proto else "application/x-protobuf"}
    if kind == 2:
        return {"content-type": "application/json", "content-encoding": "gzip"}
    return PROTO if proto else {"content-type": "application/json"}


def _rss_watch(baseline: float) -> Callable[[], float]:
    """Sample this process's RSS every 50 ms until the returned function is called; it returns the peak."""
    peak, stop = [baseline], threading.Event()

    def watch() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], rss_mb())
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()

    def done() -> float:
        stop.set()
        thread.join()
        return max(peak[0], rss_mb())
    return done


def _drained(ops: Any, timeout_s: float = 60) -> None:
    """Everything the fuzz queued finished: no request is stuck."""
    deadline = time.monotonic() + timeout_s
    while ops.queue._pending and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ops.queue._pending, ops.queue._pending
