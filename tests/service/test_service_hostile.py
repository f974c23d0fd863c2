"""Hostile and broken clients: every class of bad request gets a typed 4xx with its reason, through real HTTP and the
official SDK; nothing yields a 5xx, a hang, another client's data or a changed weight (docs/service.md, Limits)."""

from __future__ import annotations

import json
import math
import socket
import time

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from test_service_errors import PROTO, bad_request, request_body, user_error  # noqa: E402
from test_service_sdk import TEXT, forward_logprobs, sft_datum, train  # noqa: E402
from tinker import types  # noqa: E402

pytestmark = pytest.mark.live

ALICE, BOB = {"X-API-Key": "tml-alice"}, {"X-API-Key": "tml-bob"}
JSON_ROUTES = ["create_session", "session_heartbeat", "create_model", "get_info", "optim_step", "save_weights",
               "save_weights_for_sampler", "load_weights", "unload_model", "create_sampling_session", "asample",
               "retrieve_future", "weights_info"]
MALFORMED_JSON = [b"{", b"[]", b"null", b'"text"', b"{\"a\": NaN", b"\xff\xfe\x00", b"{}" * 3,
                  b"[" * 5000 + b"]" * 5000, b'{"session_id": ' + b"9" * 5000 + b"}",
                  b'{"model_id": {"nested": [[[[[[1]]]]]]}, "session_id": 7, "request_id": [], "user_metadata": 5}']


def rss_mb() -> float:
    """This process's resident memory (the in-process service's included), in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def assert_refused(response: httpx.Response, status: int | tuple[int, ...] = 400, match: str = "") -> dict:
    statuses = (status,) if isinstance(status, int) else status
    assert response.status_code in statuses, (response.status_code, response.text)
    body = response.json()
    assert body["category"] == "user" and match in body["detail"], body
    return body


@pytest.mark.parametrize("route", JSON_ROUTES)
def test_malformed_json_on_every_route_is_a_400_that_names_the_problem(serve_training, route):
    server = serve_training()
    with httpx.Client(base_url=server.url, headers=ALICE) as http:
        for body in MALFORMED_JSON:
            r = http.post(f"/api/v1/{route}", content=body, headers={"content-type": "application/json"})
            assert_refused(r, (400, 404), "")
            assert "Invalid" in r.json()["detail"] or r.status_code == 404
        wrong_types = {"session_id": 5, "model_id": ["x"], "seq_id": "1", "model_seq_id": 1.5, "num_samples": True,
                       "lora_config": {"rank": "8"}, "request_id": {"a": 1}, "path": 3, "tinker_path": None,
                       "prompt": "hello", "sampling_params": [], "adam_params": {"learning_rate": "0.1"},
                       "user_metadata": {"k": {"deep": 1}}, "tags": "x"}
        assert_refused(http.post(f"/api/v1/{route}", json=wrong_types), (400, 404))
        r = http.post(f"/api/v1/{route}", content=b"{}", headers={"content-type": "text/plain"})
        assert_refused(r, 415, "application/json")
        r = http.post(f"/api/v1/{route}", content=b"{}", headers={"content-type": "application/json",
                                                                    "content-encoding": "gzip"})
        assert_refused(r, 415, "uncompressed")


def test_bodies_over_their_limit_or_without_a_length_never_get_read(serve_training):
    server = serve_training(max_json_bytes=4096, max_request_bytes=8192)
    with httpx.Client(base_url=server.url, headers=ALICE) as http:
        assert_refused(http.post("/api/v1/create_session", content=b" " * 5000,
                                 headers={"content-type": "application/json"}), 413, "max_json_bytes")
        assert_refused(http.post("/api/v1/forward_backward", content=b"\0" * 9000, headers=PROTO),
                       413, "--max-request-mb")
        chunked = http.post("/api/v1/create_session", content=iter([b"{", b"}"]),
                            headers={"content-type": "application/json"})
        assert_refused(chunked, 411, "Content-Length")
        assert_refused(http.post("/api/v1/forward_backward", content=b"{}", headers={"content-type": "application/json"}),
                       415, "protobuf")
    # a body that promises more than it sends holds its reservation only until body_timeout_s
    slow = serve_training(body_timeout_s=0.5)
    host, port = slow.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /api/v1/create_session HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1000\r\n\r\n{")
        reply = sock.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 408") and "did not arrive" in reply
    assert httpx.get(f"{slow.url}/api/v1/healthz").status_code == 200


def test_truncated_and_lying_protobuf_is_a_400_and_allocates_nothing_it_declares(serve_training, sdk):
    server = serve_training()
    tc = sdk(server.url, "tml-alice").create_lora_training_client(base_model="tiny", rank=4).result()
    good = request_body(tc.model_id, seq_id=1)
    before = rss_mb()
    csr_bomb = _datum_with_sparse_shape(tc.model_id, rows=2**40, cols=2**40)  # a dense copy would be zettabytes
    huge_len = bytes([0x0A]) + bytes([0xFF] * 9 + [0x01])  # model_id's length: 2**64 - 1 bytes
    as_varint = bytes([0x08, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x7F])  # field 1 (a string) as a varint
    with httpx.Client(base_url=server.url, headers=ALICE) as http:
        for body, match in [(good[:len(good) // 2], "complete"), (good[:-3], ""), (b"\xff" * 64, ""),
                            (csr_bomb, "at most"), (huge_len, "past its end"), (as_varint, "wire type"),
                            (bytes([0x1A, 0x02, 0x0A, 0x00]) * 3, ""), (good + b"\x07", "wire type")]:
            r = http.post("/api/v1/forward_backward", content=body, headers=PROTO)
            assert_refused(r, (400, 404), match)
    assert rss_mb() - before < 200
    assert forward_logprobs(tc) == forward_logprobs(tc)  # the run is fine


def _datum_with_sparse_shape(model_id: str, rows: int, cols: int) -> bytes:
    """A ForwardBackwardRequest whose one loss input claims a sparse tensor of shape [rows, cols]."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)

    def field(number: int, payload: bytes) -> bytes:
        return varint(number << 3 | 2) + varint(len(payload)) + payload
    tensor = field(2, field(1, b"") + field(2, b"\0" * 8 * 3) + field(3, b"")) + varint(3 << 3) + varint(1)
    tensor += field(4, varint(rows) + varint(cols))
    datum = field(1, field(1, field(1, (5).to_bytes(4, "little")))) + field(2, field(1, b"weights") + field(2, tensor))
    return field(1, model_id.encode()) + field(3, datum) + field(4, b"cross_entropy")


def test_absurd_sizes_and_values_are_refused_at_once_and_change_no_weight(serve_training, sdk):
    server = serve_training()
    sc = sdk(server.url, "tml-alice")
    before = rss_mb()
    bad_request(sc.create_lora_training_client(base_model="tiny", rank=10**9), "--max-lora-rank")
    bad_request(sc.create_lora_training_client(base_model="tiny", rank=0), "rank")
    assert rss_mb() - before < 200  # no adapter of rank 10**9 was ever allocated
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    train(tc, 1)
    weights = forward_logprobs(tc)
    sampler = sc.create_sampling_client(base_model="tiny")
    prompt = types.ModelInput.from_ints(TEXT[:4])
    for n, params, match in [
        (0, types.SamplingParams(max_tokens=4), "num_samples"),
        (10**9, types.SamplingParams(max_tokens=4), "--max-samples"),
        (1, types.SamplingParams(max_tokens=0), "max_tokens"),
        (1, types.SamplingParams(max_tokens=10**9), "context"),
        (1, types.SamplingParams(max_tokens=2045), "context"),  # 4 + 2045 > the 2048 positions
        (1, types.SamplingParams(max_tokens=4, temperature=-1.0), "temperature"),
        (1, types.SamplingParams(max_tokens=4, top_p=0.0), "top_p"),
        (1, types.SamplingParams(max_tokens=4, seed=-1), "seed"),
        (1, types.SamplingParams(max_tokens=4, stop=[10**6]), "vocabulary"),
        (200, types.SamplingParams(max_tokens=1000), "--max-sample-tokens"),
    ]:
        bad_request(sampler.sample(prompt, n, params), match)
    bad_request(sampler.sample(types.ModelInput.from_ints([10**6]), 1, types.SamplingParams(max_tokens=4)),
                "vocabulary")
    too_long = list(range(1, 251)) * 9  # 2250 tokens, past the model's 2048 positions
    bad_request(tc.forward_backward([sft_datum(too_long)], "cross_entropy"), "context")
    nan = types.Datum(model_input=types.ModelInput.from_ints(TEXT[:-1]),
                      loss_fn_inputs={"target_tokens": TEXT[1:], "weights": [math.nan] * (len(TEXT) - 1)})
    bad_request(tc.forward_backward([nan], "cross_entropy"), "finite")
    for params in (types.AdamParams(learning_rate=-1.0), types.AdamParams(learning_rate=math.inf),
                   types.AdamParams(learning_rate=math.nan), types.AdamParams(eps=0.0),
                   types.AdamParams(beta1=1.5)):
        bad_request(tc.optim_step(params), "adam_params")
    assert forward_logprobs(tc) == weights  # nothing above reached the weights
    with httpx.Client(base_url=server.url, headers=ALICE) as http:  # what the SDK refuses to send itself
        session = http.post("/api/v1/create_session", json={}).json()["session_id"]
        sampler_id = http.post("/api/v1/create_sampling_session", json={"session_id": session, "base_model": "tiny"}
                               ).json()["sampling_session_id"]
        sample = {"sampling_session_id": sampler_id, "seq_id": 99, "num_samples": 1,
                  "prompt": {"chunks": [{"type": "encoded_text", "tokens": TEXT[:4]}]}}
        for params in ('{"max_tokens": 4, "temperature": NaN}', '{"max_tokens": 4, "temperature": Infinity}',
                       '{"max_tokens": 4, "top_k": 0}', '{"max_tokens": 4, "stop": [1, "x"]}'):
            body = json.dumps(sample)[:-1] + f', "sampling_params": {params}}}'
            assert_refused(http.post("/api/v1/asample", content=body, headers={"content-type": "application/json"}))
        image = {**sample, "sampling_params": {"max_tokens": 4},
                 "prompt": {"chunks": [{"type": "image", "data": "AAAA", "format": "png"}]}}
        assert_refused(http.post("/api/v1/asample", json=image), 400, "text-only")
    assert greedy_tokens(sampler) == greedy_tokens(sampler)  # sampling carries on


def greedy_tokens(sampler) -> list[int]:
    params = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    return sampler.sample(types.ModelInput.from_ints(TEXT[:4]), 1, params).result().sequences[0].tokens


def test_checkpoint_paths_cannot_leave_the_state_directory(serve_training, sdk, tmp_path):
    server = serve_training(state_dir=tmp_path / "state")
    sc = sdk(server.url, "tml-alice")
    tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
    for name in ("../escape", "a/b", "..", ".hidden", "/etc/passwd", "a\nb", "x" * 200, "a\\..\\b"):
        bad_request(tc.save_state(name), "checkpoint name")
    with httpx.Client(base_url=server.url, headers=ALICE) as http:
        for path in ("tinker://../../etc/weights/x", "file:///etc/passwd", "tinker://a/weights/../../x",
                     f"tinker://{tc.model_id}/weights/..", "tinker://" + "a/" * 300):
            r = http.post("/api/v1/load_weights", json={"model_id": tc.model_id, "seq_id": 50, "path": path,
                                                        "optimizer": False})
            assert_refused(r, (400, 404))
    written = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}
    assert all(str(p).startswith("state") for p in written) and not (tmp_path / "escape").exists()


def test_another_clients_runs_futures_samplers_and_checkpoints_answer_404(serve_training, sdk):
    server = serve_training()
    alice = sdk(server.url, "tml-alice")
    tc = alice.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    train(tc, 1)
    state = tc.save_state("mine").result().path
    sampler_path = tc.save_weights_for_sampler("mine").result().path
    sampling = tc.save_weights_and_get_sampling_client().result()
    weights = forward_logprobs(tc)
    with httpx.Client(base_url=server.url, headers=ALICE) as http:
        rid = http.post("/api/v1/forward_backward", content=request_body(tc.model_id, 7000),
                        headers=PROTO).json()["request_id"]
        assert http.post("/api/v1/retrieve_future", json={"request_id": rid}).status_code == 200
    bob = sdk(server.url, "tml-bob")
    bad_request(bob.create_training_client_from_state(state), "", tinker.NotFoundError)
    with pytest.raises(Exception, match="404"):
        bob.create_sampling_client(model_path=sampler_path).sample(
            types.ModelInput.from_ints(TEXT[:4]), 1, types.SamplingParams(max_tokens=2)).result()
    with httpx.Client(base_url=server.url, headers=BOB) as http:
        session = http.post("/api/v1/create_session", json={}).json()["session_id"]
        assert http.post("/api/v1/retrieve_future", json={"request_id": rid}).status_code == 404
        assert_refused(http.post("/api/v1/forward_backward", content=request_body(tc.model_id, 7001), headers=PROTO),
                       404, "Unknown training run")
        for route, body in [
            ("optim_step", {"model_id": tc.model_id, "seq_id": 7002, "adam_params": {"learning_rate": 1.0}}),
            ("save_weights", {"model_id": tc.model_id, "seq_id": 7003, "path": "stolen"}),
            ("load_weights", {"model_id": tc.model_id, "seq_id": 7004, "path": state, "optimizer": False}),
            ("load_weights", {"session_id": session, "model_seq_id": 0, "path": state, "optimizer": True}),
            ("unload_model", {"model_id": tc.model_id}), ("get_info", {"model_id": tc.model_id}),
            ("weights_info", {"tinker_path": state}),
            ("create_model", {"session_id": tc.model_id.split(":")[0], "base_model": "tiny"}),
            ("session_heartbeat", {"session_id": tc.model_id.split(":")[0]}),
            ("create_sampling_session", {"session_id": session, "model_path": sampler_path}),
            ("asample", {"sampling_session_id": sampling._sampling_session_id, "seq_id": 1, "num_samples": 1,
                         "prompt": {"chunks": [{"tokens": TEXT[:3]}]}, "sampling_params": {"max_tokens": 2}}),
        ]:
            assert_refused(http.post(f"/api/v1/{route}", json=body), 404, "Unknown")
        for path in (f"/api/v1/training_runs/{tc.model_id}", f"/api/v1/training_runs/{tc.model_id}/checkpoints",
                     f"/api/v1/samplers/{sampling._sampling_session_id}"):
            assert_refused(http.get(path), 404, "Unknown")
        assert http.get("/api/v1/training_runs").json()["training_runs"] == []
        assert_refused(http.post(f"/api/v1/sessions/{tc.model_id.split(':')[0]}/finish"), 404)
    assert forward_logprobs(tc) == weights  # alice's run is untouched and still hers
    assert [r.training_run_id for r in tinker.RestClient(base_url=server.url, api_key="tml-alice")
            .list_training_runs().result().training_runs] == [tc.model_id]


def test_pending_work_and_counts_are_bounded_per_client(serve_training, sdk):
    server = serve_training(max_pending=3, max_sessions=2, max_checkpoints_per_run=2)
    queue = server.app.state.ops.queue
    sc = sdk(server.url, "tml-alice")
    tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
    tc.save_state("one").result(), tc.save_state("two").result()
    user_error(tc.save_state("three"), "--max-checkpoints-per-run")
    assert tc.save_state("two").result().path.endswith("/two")  # saving over a name is always possible
    with httpx.Client(base_url=server.url, headers=ALICE) as http:
        assert http.post("/api/v1/create_session", json={}).status_code == 200  # the SDK's session, and this one
        assert_refused(http.post("/api/v1/create_session", json={}), 400, "--max-sessions")
        release = _block(queue)
        try:
            sent = [http.post("/api/v1/optim_step", json={"model_id": tc.model_id, "seq_id": 900 + i,
                                                          "adam_params": {"learning_rate": 0.0}}) for i in range(4)]
            assert [r.status_code for r in sent[:3]] == [200] * 3
            assert_refused(sent[3], 429, "--max-pending")
            assert sent[3].headers["retry-after"] == "1"
            other = http.post("/api/v1/create_session", json={}, headers=BOB)  # other clients are not held up
            assert other.status_code == 200
        finally:
            release()
        for r in sent[:3]:
            assert "metrics" in http.post("/api/v1/retrieve_future", json=r.json()).json()
    # through the SDK, back-pressure is waited out: sampling requests over the limit are re-sent until they fit
    sampler = tc.save_weights_and_get_sampling_client().result()
    futures = [sampler.sample(types.ModelInput.from_ints(TEXT[:4]), 1, types.SamplingParams(max_tokens=2))
               for _ in range(8)]
    assert all(len(f.result(timeout=120).sequences) == 1 for f in futures)


def _block(queue) -> callable:
    """Hold the worker (so requests stay pending) until the returned function is called."""
    import threading

    release = threading.Event()
    queue.submit("test-block", lambda: (release.wait(30), (b"{}", "application/json"))[1], bounded=False)
    time.sleep(0.05)
    return release.set
