"""Bad input, limits, auth, re-sent requests and restarts: each answered clearly, nothing lost for anyone else."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from test_service_sdk import TEXT, forward_logprobs, sft_datum, train  # noqa: E402
from tinker import types  # noqa: E402
from tinker.proto import request_conv  # noqa: E402

from trainer.service._store import RESTART_ERROR  # noqa: E402

pytestmark = pytest.mark.live


#: the SDK's key in these tests: raw HTTP calls on its runs must send it (each key sees only its own)
KEY = {"X-API-Key": "tml-test"}


def user_error(future, match: str) -> None:
    with pytest.raises(tinker.RequestFailedError, match=match) as info:
        future.result()
    assert info.value.category == "user"


def bad_request(future, match: str, error: type = tinker.BadRequestError) -> None:
    """Refused when sent: a 4xx the SDK raises as ``error``, its message carrying the service's reason."""
    with pytest.raises(error, match=match) as info:
        future.result()
    assert 400 <= info.value.status_code < 500 and info.value.body["category"] == "user"


def test_bad_requests_fail_alone_with_user_errors(serve_training, sdk):
    sc = sdk(serve_training(max_batch_tokens=200).url)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    good = sft_datum()
    bad_request(tc.forward_backward([good], "no_such_loss"), "no_such_loss")
    short = types.Datum(model_input=types.ModelInput.from_ints(TEXT[:-1]),
                        loss_fn_inputs={"target_tokens": TEXT[1:], "weights": [1.0] * 5})
    bad_request(tc.forward_backward([short], "cross_entropy"), "31 entries")
    bad_request(tc.forward_backward([good] * 8, "cross_entropy"), "max-batch-tokens")
    out_of_vocab = types.Datum(model_input=types.ModelInput.from_ints([10**6]),
                               loss_fn_inputs={"target_tokens": [1], "weights": [1.0]})
    bad_request(tc.forward_backward([out_of_vocab], "cross_entropy"), r"token ids in \[0, ")
    bad_request(sc.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4), "serves 'tiny'")
    bad_request(tc.save_state("../escape"), "checkpoint name")
    bad_request(sc.create_training_client_from_state("tinker://nobody:train:0/weights/x"), "Unknown",
                tinker.NotFoundError)
    user_error(sc.create_training_client_from_state(f"tinker://{tc.model_id}/weights/never-saved"),
               "Unknown checkpoint")
    # none of that touched the run: it still trains, from where it was
    assert forward_logprobs(tc) == forward_logprobs(tc)
    losses = train(tc, 3)
    assert losses[-1] < losses[0]


def test_unknown_ids_are_user_errors_or_404(serve_training):
    server = serve_training()
    body = request_body("sess-nope:train:0", seq_id=1)
    with httpx.Client(base_url=server.url, headers=KEY) as http:
        refused = http.post("/api/v1/forward_backward", content=body, headers=PROTO)
        assert refused.status_code == 404 and "Unknown training run 'sess-nope:train:0'" in refused.json()["detail"]
        session = http.post("/api/v1/create_session", json={}).json()["session_id"]
        rid = http.post("/api/v1/forward_backward", content=request_body(f"{session}:train:5", 1),
                        headers=PROTO).json()["request_id"]  # this client's session, a run it never created
        failed = http.post("/api/v1/retrieve_future", json={"request_id": rid}).json()
        assert failed["category"] == "user" and "create one with create_lora_training_client" in failed["error"]
        assert http.post("/api/v1/get_info", json={"model_id": "sess-nope:train:0"}).status_code == 404
        assert http.get("/api/v1/samplers/nope").status_code == 404
        assert http.post("/api/v1/retrieve_future", json={"request_id": "999999"}).status_code == 404
        garbage = http.post("/api/v1/forward_backward", content=b"\xff\xff\xff", headers=PROTO)
        assert garbage.status_code == 400 and garbage.json()["category"] == "user"
        # routes the service does not offer, and wrong methods: JSON errors too, saying which
        for path in ("/api/v1/retrieve_futures", "/api/v1/cancel_future", "/no_such_route"):
            missing = http.post(path, json={})
            assert missing.status_code == 404 and missing.json()["category"] == "user"
            assert f"has no route POST {path}" in missing.json()["detail"]
        wrong = http.get("/api/v1/create_session")
        assert wrong.status_code == 405 and wrong.json() == {
            "detail": "GET is not allowed on /api/v1/create_session.", "category": "user"}
        assert http.post("/api/v1/create_session", json={}).status_code == 200  # and the service goes on


PROTO = {"content-type": "application/x-protobuf"}


def request_body(model_id: str, seq_id: int, data: list | None = None) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data or [sft_datum()], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    return request_conv.forward_backward_request_to_proto(req).SerializeToString()


def test_a_resent_request_is_applied_once(serve_training, sdk):
    server = serve_training()
    sc = sdk(server.url)
    twice = sc.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    once = sc.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    train(twice, 1), train(once, 1)  # identical runs with non-zero adapters
    with httpx.Client(base_url=server.url, headers=KEY) as http:
        body = request_body(twice.model_id, seq_id=10_000)
        ids = {http.post("/api/v1/forward_backward", content=body, headers=PROTO).json()["request_id"]
               for _ in range(3)}  # what the HTTP client's retries look like to the server
        assert len(ids) == 1
        step = {"model_id": twice.model_id, "seq_id": 10_001, "type": "optim_step",
                "adam_params": {"learning_rate": 0.01}}
        rid = http.post("/api/v1/optim_step", json=step).json()["request_id"]
        assert http.post("/api/v1/optim_step", json=step).json()["request_id"] == rid
        grad_norm_twice = http.post("/api/v1/retrieve_future", json={"request_id": rid}).json()
    once.forward_backward([sft_datum()], "cross_entropy").result()
    grad_norm_once = once.optim_step(types.AdamParams(learning_rate=0.01)).result().metrics["grad_norm:mean"]
    assert grad_norm_twice["metrics"]["grad_norm:mean"] == pytest.approx(grad_norm_once, rel=1e-5)
    assert forward_logprobs(twice) == pytest.approx(forward_logprobs(once), abs=1e-6)


def test_a_restart_keeps_finished_results_and_fails_what_was_in_flight(serve_training, sdk, tmp_path):
    state = tmp_path / "state"
    first = serve_training(state_dir=state)
    sc = sdk(first.url)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    train(tc, 2)
    saved = tc.save_state("before-restart").result().path
    expected = forward_logprobs(tc)
    release = threading.Event()
    with httpx.Client(base_url=first.url, headers=KEY) as http:
        done = http.post("/api/v1/optim_step", json={"model_id": tc.model_id, "seq_id": 500,
                                                     "adam_params": {"learning_rate": 0.0}}).json()["request_id"]
        done_body = http.post("/api/v1/retrieve_future", json={"request_id": done}).json()
        first.app.state.ops.queue.submit("test-block", lambda: (release.wait(30), (b"{}", "application/json"))[1])
        in_flight = http.post("/api/v1/optim_step", json={"model_id": tc.model_id, "seq_id": 501,
                                                          "adam_params": {"learning_rate": 0.1}}).json()["request_id"]
    try:
        second = serve_training(state_dir=state)  # what a restarted process finds in the state directory
        with httpx.Client(base_url=second.url, headers=KEY) as http:
            assert http.post("/api/v1/retrieve_future", json={"request_id": done}).json() == done_body
            failed = http.post("/api/v1/retrieve_future", json={"request_id": in_flight}).json()
            assert failed == {"error": RESTART_ERROR, "category": "server"}
        sc2 = sdk(second.url)
        resumed = sc2.create_training_client_from_state_with_optimizer(saved).result()
        assert forward_logprobs(resumed) == pytest.approx(expected, abs=1e-5)
        with httpx.Client(base_url=second.url, headers=KEY) as http:
            rid = http.post("/api/v1/forward_backward", content=request_body(tc.model_id, 900),
                            headers=PROTO).json()["request_id"]
            gone = http.post("/api/v1/retrieve_future", json={"request_id": rid}).json()
        assert gone["category"] == "user" and "create_training_client_from_state" in gone["error"]
    finally:
        release.set()


def test_tenant_limit_idle_unload_and_full_parameter(serve_training, sdk):
    limited = serve_training(max_tenants=2)
    sc = sdk(limited.url)
    a = sc.create_lora_training_client(base_model="tiny", rank=4).result()
    b = sc.create_lora_training_client(base_model="tiny", rank=4).result()
    user_error(sc.create_lora_training_client(base_model="tiny", rank=4), "--max-tenants 2")
    assert len(forward_logprobs(a)) == len(TEXT) - 1  # the others carry on
    with httpx.Client(base_url=limited.url, headers=KEY) as http:
        for run in (a, b):
            rid = http.post("/api/v1/unload_model", json={"model_id": run.model_id}).json()
            assert http.post("/api/v1/retrieve_future", json=rid).json() == {"model_id": run.model_id}
    c = sc.create_lora_training_client(base_model="tiny", rank=4).result()  # no adapter was left on the model
    # a moderate step: at 2e-2 Adam's first sign-sized step on a fresh adapter (its A drawn from the process's
    # RNG, which other threads also draw from) overshot once in a loaded run
    losses = train(c, 3, lr=5e-3)
    assert losses[-1] < losses[0], losses

    idle = serve_training(idle_timeout_s=0.5)
    ops = idle.app.state.ops
    with httpx.Client(base_url=idle.url) as http:
        session = http.post("/api/v1/create_session", json={}).json()["session_id"]
        rid = http.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                                      "lora_config": {"rank": 4}}).json()["request_id"]
        model_id = http.post("/api/v1/retrieve_future", json={"request_id": rid}).json()["model_id"]
        assert model_id in ops.host.clients
        deadline = time.monotonic() + 15
        while model_id in ops.host.clients and time.monotonic() < deadline:
            time.sleep(0.2)  # no heartbeat: the reaper unloads it
        assert model_id not in ops.host.clients
        rid = http.post("/api/v1/forward_backward", content=request_body(model_id, 1), headers=PROTO).json()
        gone = http.post("/api/v1/retrieve_future", json=rid).json()
        assert "is not loaded" in gone["error"]

    full = sdk(serve_training(full_parameter=True).url)
    tc = full.create_lora_training_client(base_model="tiny", rank=4).result()
    assert tc.get_info().is_lora is False
    losses = train(tc, 8, lr=1e-2)
    assert losses[-1] < 0.7 * losses[0], losses
    user_error(full.create_lora_training_client(base_model="tiny", rank=4), "--max-tenants 1")


def test_token_auth(serve_training, sdk):
    server = serve_training(token="tml-right")
    with pytest.raises(tinker.PermissionDeniedError, match="wrong API key"):
        sdk(server.url, api_key="tml-wrong").create_lora_training_client(base_model="tiny", rank=4).result()
    assert httpx.post(f"{server.url}/api/v1/create_session", json={}).status_code == 401
    assert httpx.get(f"{server.url}/api/v1/healthz").json() == {"status": "ok"}
    tc = sdk(server.url, api_key="tml-right").create_lora_training_client(base_model="tiny", rank=4).result()
    assert tc.get_info().model_data.model_name == "tiny"
    with pytest.raises(ValueError, match="tml-"):
        from trainer.service import ServiceSettings

        ServiceSettings(token="secret")


def test_queued_forward_backward_of_several_tenants_share_one_pass(serve_training, sdk):
    server = serve_training()
    work = server.app.state.ops.queue
    sc = sdk(server.url)
    runs = [sc.create_lora_training_client(base_model="tiny", rank=4, seed=s).result() for s in (1, 2, 1, 2)]
    for run in runs:
        train(run, 1)  # non-zero adapters; runs 0/2 and 1/3 are twins
    release = threading.Event()
    work.submit("test-block", lambda: (release.wait(30), (b"{}", "application/json"))[1])
    bodies = [request_body(runs[0].model_id, 20_000), request_body(runs[1].model_id, 20_000,
                                                                  [sft_datum(list(range(90, 110)))] * 2)]
    with httpx.Client(base_url=server.url, headers=KEY) as http:
        rids = [http.post("/api/v1/forward_backward", content=b, headers=PROTO).json()["request_id"] for b in bodies]
        release.set()
        for rid in rids:
            assert http.post("/api/v1/retrieve_future", json={"request_id": rid}).status_code == 200
    assert work.batched_jobs == 2
    runs[2].forward_backward([sft_datum()], "cross_entropy").result()  # the twins, one pass each
    runs[3].forward_backward([sft_datum(list(range(90, 110)))] * 2, "cross_entropy").result()
    norms = [r.optim_step(types.AdamParams(learning_rate=0.0)).result().metrics["grad_norm:mean"] for r in runs]
    assert norms[0] == pytest.approx(norms[2], rel=1e-4) and norms[1] == pytest.approx(norms[3], rel=1e-4)
    assert norms[0] > 0 and norms[1] > 0


def test_sampler_server_settings_read_the_servers_file_and_refuse_bad_input(tmp_path):
    from trainer.service import ServiceSettings

    listed = tmp_path / "servers.txt"
    listed.write_text("# sampler servers\nhttp://h:1/\n\nhttp://h:2  # the second\n")
    settings = ServiceSettings(state_dir=tmp_path, sampler_servers=("http://h:1",), sampler_servers_file=listed)
    assert settings.sampler_servers == ("http://h:1", "http://h:2")
    assert settings.listed_servers == ("http://h:1", "http://h:2")  # the file read once: the service starts from these
    listed.write_text("h:3\n")
    with pytest.raises(ValueError, match=r"Expected URLs like http://host:8100 in .*servers.txt, got \['h:3'\]"):
        ServiceSettings(state_dir=tmp_path, sampler_servers_file=listed)
    listed.write_text("# none yet\n")
    with pytest.raises(ValueError, match="at least one sampler server URL"):
        ServiceSettings(state_dir=tmp_path, sampler_servers_file=listed)
    with pytest.raises(ValueError, match="readable file"):
        ServiceSettings(state_dir=tmp_path, sampler_servers_file=tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="Expected --sampler-servers with --sampler-weight-group"):
        ServiceSettings(state_dir=tmp_path, sampler_weight_group="gloo")
    with pytest.raises(ValueError, match="off or gloo"):
        ServiceSettings(state_dir=tmp_path, sampler_servers=("http://h:1",), sampler_weight_group="nccl")
