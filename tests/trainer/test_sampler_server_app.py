"""The sampler server's routes in process (ASGI): the trainer API, weight and adapter updates, auth, bounds, metrics."""

from __future__ import annotations

import asyncio
import json
import struct

import httpx
import pytest
import torch

from trainer.core.forward import run_model, target_logprobs
from trainer.model import ModelConfig, load_policy
from trainer.sampler_server.app import create_app
from trainer.sampler_server.backends import HFBackend
from trainer.sampler_server.protocol import ServerLimits
from trainer.sampling.wire import StreamHeader, TensorSpec, encode

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    return HFBackend(TINY, max_adapters=2)


def client(backend: HFBackend, token: str | None = None, **limits: int) -> httpx.AsyncClient:
    app = create_app(backend, limits=ServerLimits(**limits), token=token)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sampler", headers=headers)


def weights_body(model: torch.nn.Module, version: int) -> bytes:
    return b"".join(bytes(c) for c in encode(dict(model.named_parameters()), {"version": str(version)}))


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], ids: list[int]) -> torch.Tensor:
    tokens = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits, _ = run_model(model.eval(), tokens, torch.ones_like(tokens))
    return target_logprobs(logits[:, :-1], tokens[:, 1:], 1.0)[0, len(prompt) - 1:]


async def test_sample_returns_n_samples_with_the_trainers_logprobs_and_the_version(backend) -> None:
    model, _ = load_policy(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    async with client(backend) as http:
        assert (await http.put("/weights", content=weights_body(model, 7))).json()["version"] == 7
        resp = await http.post("/sample", json={"prompt_ids": [5, 6, 7], "n": 3, "max_tokens": 6, "seed": 1})
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["version"] == 7 and len(data["samples"]) == 3
    for s in data["samples"]:
        assert len(s["token_ids"]) == len(s["logprobs"]) <= 6
        gap = (trainer_logprobs(model, [5, 6, 7], s["token_ids"]) - torch.tensor(s["logprobs"])).abs().max()
        assert gap < 1e-4


async def test_prompt_logprobs_are_the_trainers_and_health_names_the_instance(backend) -> None:
    model, _ = load_policy(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompt = [5, 6, 7, 8, 9]
    async with client(backend) as http:
        await http.put("/weights", content=weights_body(model, 8))
        data = (await http.post("/sample", json={"prompt_ids": prompt, "max_tokens": 1, "prompt_logprobs": True})).json()
        plain = (await http.post("/sample", json={"prompt_ids": prompt, "max_tokens": 1})).json()
        health = (await http.get("/health")).json()
    assert data["prompt_logprobs"][0] is None and "prompt_logprobs" not in plain
    expected = trainer_logprobs(model, prompt[:1], prompt[1:])
    assert (torch.tensor(data["prompt_logprobs"][1:]) - expected).abs().max() < 1e-5
    assert health["instance"] == data["instance"]  # a client tells a restarted server by it


async def test_seeds_repeat_and_stop_ids_and_strings_end_a_sample(backend) -> None:
    async with client(backend) as http:
        body = {"prompt_ids": [1, 2, 3], "n": 1, "max_tokens": 8, "seed": 3}
        a = (await http.post("/sample", json=body)).json()
        b = (await http.post("/sample", json=body)).json()
        assert a["samples"] == b["samples"]
        first = a["samples"][0]["token_ids"]
        stopped = (await http.post("/sample", json={**body, "stop_ids": [first[1]]})).json()["samples"][0]
        assert stopped["token_ids"] == first[:2] and stopped["finish_reason"] == "stop"
        text = backend.tokenizer.decode(first[2:4])
        cut = (await http.post("/sample", json={**body, "stop": [text]})).json()["samples"][0]
        assert cut["finish_reason"] == "stop" and len(cut["token_ids"]) <= 4


async def test_bad_requests_get_4xx_with_a_reason(backend) -> None:
    async with client(backend, max_new_tokens=32, max_request_bytes=4096) as http:
        cases = [({"prompt_ids": [1, 99999]}, 400, "out of range"), ({"prompt_ids": []}, 400, "prompt_ids"),
                 ({"prompt_ids": [1], "max_tokens": 33}, 400, "max_tokens <= 32"),
                 ({"prompt_ids": [1], "n": 0}, 400, "n"), ({"prompt_ids": [1], "bogus": 1}, 400, "bogus"),
                 ({"prompt_ids": [1], "adapter": "nope"}, 404, "nope"),
                 ({"prompt_ids": [1] * 5000}, 413, "at most 4096 bytes")]
        for body, status, reason in cases:
            resp = await http.post("/sample", json=body)
            assert resp.status_code == status and reason in resp.json()["error"]["message"], (body, resp.text)
        resp = await http.post("/sample", content=b"{not json")
        assert resp.status_code == 400


async def test_a_batch_request_is_decoded_together_and_each_entry_answered_or_refused_alone(backend) -> None:
    model, _ = load_policy(TINY)
    async with client(backend) as http:
        await http.put("/weights", content=weights_body(model, 4))
        before = (await http.get("/metrics")).text
        good = [{"prompt_ids": [5, 6, 7 + i], "max_tokens": 4 + i} for i in range(5)]
        bad = [{"prompt_ids": [1, 99999]}, {"prompt_ids": [1], "bogus": 1}, {"prompt_ids": [1], "adapter": "nope"}]
        resp = await http.post("/sample/batch", json={"requests": [good[0], *bad, *good[1:]]})
        after = (await http.get("/metrics")).text
        assert resp.status_code == 200, resp.text
        results = resp.json()["results"]
        assert len(results) == 8
        answered = [results[0], *results[4:]]
        for body, result in zip(good, answered):
            [sample] = result["samples"]
            assert result["version"] == 4 and len(sample["token_ids"]) == len(sample["logprobs"]) <= body["max_tokens"]
            gap = (trainer_logprobs(model, body["prompt_ids"], sample["token_ids"]) - torch.tensor(sample["logprobs"]))
            assert gap.abs().max() < 1e-4
        errors = [r["error"] for r in results[1:4]]
        assert [e["code"] for e in errors] == [400, 400, 404]
        assert "out of range" in errors[0]["message"] and "bogus" in errors[1]["message"]
        assert "nope" in errors[2]["message"]
        # the five good prompts went into ONE decode (the unknown adapter into a second one, which failed)
        assert metric(after, "batches_total") - metric(before, "batches_total") == 1
        assert metric(after, "requests_total") - metric(before, "requests_total") == 6
        assert (await http.post("/sample/batch", json={"requests": []})).status_code == 400
        # an entry that asks for its prompt scored gets it, as /sample answers it; the others do not
        scored = {"prompt_ids": [5, 6, 7], "max_tokens": 2, "prompt_logprobs": True}
        resp = await http.post("/sample/batch", json={"requests": [scored, good[0]]})
        first, second = resp.json()["results"]
        assert first["prompt_logprobs"][0] is None and "prompt_logprobs" not in second
        gap = trainer_logprobs(model, [5], [6, 7]) - torch.tensor(first["prompt_logprobs"][1:])
        assert gap.abs().max() < 1e-4


def metric(text: str, name: str) -> float:
    [line] = [ln for ln in text.splitlines() if ln.startswith(f"envhub_sampler_{name} ")]
    return float(line.split()[1])


async def test_weight_pushes_that_do_not_fit_the_model_are_refused_and_change_nothing(backend) -> None:
    model, _ = load_policy(TINY)
    other, _ = load_policy(ModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1))
    before = {n: p.detach().clone() for n, p in backend.base.named_parameters()}
    async with client(backend, max_header_bytes=1 << 16) as http:
        version = backend.version
        wrong_shape = await http.put("/weights", content=weights_body(other, 99))
        assert wrong_shape.status_code == 400 and "model settings" in wrong_shape.json()["error"]["message"]
        missing = dict(list(model.named_parameters())[:-1])
        body = b"".join(bytes(c) for c in encode(missing, {"version": "99"}))
        assert (await http.put("/weights", content=body)).status_code == 400
        huge = struct.pack("<Q", 1 << 40) + b"{}"
        resp = await http.put("/weights", content=huge)
        assert resp.status_code == 400 and "at most 65536 bytes" in resp.json()["error"]["message"]
        cut = weights_body(model, 99)[:-10]
        assert (await http.put("/weights", content=cut)).status_code == 400
        no_version = b"".join(bytes(c) for c in encode(dict(model.named_parameters()), {}))
        assert (await http.put("/weights", content=no_version)).status_code == 400
        assert backend.version == version
    assert all(torch.equal(before[n], p) for n, p in backend.base.named_parameters())


async def test_a_weight_update_never_lands_in_the_middle_of_a_decode(backend) -> None:
    model, _ = load_policy(TINY)
    async with client(backend) as http:
        await http.put("/weights", content=weights_body(model, 1))
        greedy = {"prompt_ids": [3, 4, 5], "max_tokens": 12, "temperature": 0.0}
        old = (await http.post("/sample", json=greedy)).json()["samples"][0]["token_ids"]
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1.0)
        new_body = weights_body(model, 2)
        racing = [http.post("/sample", json=greedy) for _ in range(6)]
        answers = await asyncio.gather(*racing, http.put("/weights", content=new_body))
        new = (await http.post("/sample", json=greedy)).json()["samples"][0]["token_ids"]
    assert new != old
    for resp in answers[:6]:
        data = resp.json()
        # each answer is wholly the old policy's or wholly the new one's, and says which
        assert data["samples"][0]["token_ids"] == {1: old, 2: new}[data["version"]]


async def test_lora_adapters_load_replace_and_unload_by_name(backend) -> None:
    policy, _ = load_policy(ModelConfig(**{**TINY.__dict__, "lora_rank": 4}))
    from peft import get_peft_model_state_dict

    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    lora = {"r": 4, "lora_alpha": 32, "target_modules": "all-linear"}

    def body(version: int, config: dict[str, object] = lora) -> bytes:
        meta = {"version": str(version), "kind": "lora", "lora_config": json.dumps(config)}
        return b"".join(bytes(c) for c in encode(get_peft_model_state_dict(policy), meta))

    prompt = [9, 10, 11]
    async with client(backend) as http:
        base, _ = load_policy(TINY)  # the adapter's base weights (other tests pushed others)
        assert (await http.put("/weights", content=weights_body(base, 0))).status_code == 200
        assert (await http.put("/adapters/run-a", content=body(3))).status_code == 200
        resp = (await http.post("/sample", json={"prompt_ids": prompt, "max_tokens": 5, "adapter": "run-a"})).json()
        assert resp["version"] == 3
        gap = (trainer_logprobs(policy, prompt, resp["samples"][0]["token_ids"])
               - torch.tensor(resp["samples"][0]["logprobs"])).abs().max()
        assert gap < 1e-4
        assert (await http.put("/adapters/run-a", content=body(4))).status_code == 200  # replace
        assert (await http.get("/adapters")).json() == {"adapters": {"run-a": 4}}
        models = (await http.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == ["tiny", "run-a"]
        assert (await http.put("/adapters/run-b", content=body(1, {**lora, "r": 999}))).status_code == 400
        assert (await http.put("/adapters/run-b", content=body(1, {**lora, "r": 8}))).status_code == 400  # shapes
        assert (await http.put("/adapters/bad name!", content=body(1))).status_code == 400
        assert (await http.delete("/adapters/run-a")).status_code == 200
        assert (await http.delete("/adapters/run-a")).status_code == 404
        assert (await http.get("/adapters")).json() == {"adapters": {}}


def adapter_policy(seed: int) -> tuple[torch.nn.Module, bytes]:
    """A LoRA policy on the TINY base (its adapter made non-zero) and its adapter as a push body."""
    from peft import get_peft_model_state_dict

    torch.manual_seed(seed)
    policy, _ = load_policy(ModelConfig(**{**TINY.__dict__, "lora_rank": 4}))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.5)
    meta = {"version": str(10 + seed), "kind": "lora",
            "lora_config": json.dumps({"r": 4, "lora_alpha": 32, "target_modules": "all-linear"})}
    return policy, b"".join(bytes(c) for c in encode(get_peft_model_state_dict(policy), meta))


async def test_one_batch_mixes_two_adapters_and_the_base_in_one_pass_each_row_under_its_own(backend) -> None:
    (one, body_one), (two, body_two) = adapter_policy(1), adapter_policy(2)
    base, _ = load_policy(TINY)  # the adapters' base weights (other tests pushed others)
    policies = {"one": one, "two": two, None: base}
    async with client(backend) as http:
        assert (await http.put("/weights", content=weights_body(base, 5))).status_code == 200
        assert (await http.put("/adapters/one", content=body_one)).status_code == 200
        assert (await http.put("/adapters/two", content=body_two)).status_code == 200
        before = (await http.get("/metrics")).text
        # interleaved on purpose: the server puts each adapter's rows together and answers in request order
        names = ["two", None, "one", "two", "one", None]
        bodies = [{"prompt_ids": [3 + i, 4, 5], "n": 2, "max_tokens": 6, "prompt_logprobs": i == 0,
                   **({"adapter": name} if name else {})} for i, name in enumerate(names)]
        results = (await http.post("/sample/batch", json={"requests": bodies})).json()["results"]
        after = (await http.get("/metrics")).text
        # while a pass runs with adapter layers in the model, other threads still see the plain model's sizes
        plain = set(dict(base.named_parameters()))
        with backend.table.installed({"one", "two"}):
            assert backend.vocab_size() == base.get_output_embeddings().weight.shape[0]
            assert set(backend.plan_full(StreamHeader({n: TensorSpec(p.dtype, tuple(p.shape), 0, 0) for n, p in
                                                       base.named_parameters()}, {}))) == plain
        assert (await http.delete("/adapters/one")).status_code == 200
        assert (await http.delete("/adapters/two")).status_code == 200
    assert metric(after, "batches_total") - metric(before, "batches_total") == 1  # ONE decode pass for all
    assert [r["version"] for r in results] == [12, 5, 11, 12, 11, 5]
    for name, body, result in zip(names, bodies, results):
        for sample in result["samples"]:
            expected = trainer_logprobs(policies[name], body["prompt_ids"], sample["token_ids"])
            assert (expected - torch.tensor(sample["logprobs"])).abs().max() < 1e-4, name
    scored = trainer_logprobs(two, [3], [4, 5])
    assert (torch.tensor(results[0]["prompt_logprobs"][1:]) - scored).abs().max() < 1e-4
    # the adapters really differ: the same ids score differently under each
    ids = results[0]["samples"][0]["token_ids"]
    assert (trainer_logprobs(one, [3, 4, 5], ids) - trainer_logprobs(two, [3, 4, 5], ids)).abs().max() > 1e-2


async def test_auth_health_and_metrics(backend) -> None:
    async with client(backend, token="s3cret") as http:
        await http.post("/sample", json={"prompt_ids": [1, 2], "max_tokens": 2})
        metrics = (await http.get("/metrics")).text
        assert (await http.get("/health")).json()["model"] == "tiny"
    for name in ("queue_depth", "tokens_total", "tokens_per_second", "policy_version", "weight_updates_total"):
        assert f"envhub_sampler_{name} " in metrics
    async with client(backend, token="s3cret") as http:
        http.headers["Authorization"] = "Bearer wrong"
        assert (await http.get("/health")).status_code == 200
        for method, path in (("POST", "/sample"), ("PUT", "/weights"), ("GET", "/v1/models"), ("GET", "/metrics")):
            resp = await http.request(method, path, json={"prompt_ids": [1]})
            assert resp.status_code == 401 and "bearer token" in resp.json()["error"]["message"]


def test_sampling_servers_are_configured_by_url_and_by_the_quick_starts_flag() -> None:
    from trainer.config import load_config
    from trainer.quickstart import parse_args, quickstart_config
    from trainer.sampling import SamplingConfig

    with pytest.raises(ValueError, match="sampling.servers like"):
        SamplingConfig(servers=["127.0.0.1:8100"])
    cfg = load_config(None, ["sampling.servers=['http://h1:8100', 'http://h2:8100']", "sampling.server_token='t'"])
    assert cfg.sampling.servers == ["http://h1:8100", "http://h2:8100"] and cfg.sampling.server_token == "t"
    args = parse_args(["--sampler-servers", "http://a:1,http://b:2"])
    assert quickstart_config("ws://127.0.0.1:1", args).sampling.servers == ["http://a:1", "http://b:2"]
    assert quickstart_config("ws://127.0.0.1:1", parse_args([])).sampling.servers == []


def test_a_weight_body_round_trips_through_any_chunking() -> None:
    from trainer.sampling.wire import TensorStreamReader, WeightFormatError

    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2).bfloat16()}
    body = b"".join(bytes(c) for c in encode(tensors, {"version": "4"}))
    for size in (1, 7, 64, len(body)):
        reader = TensorStreamReader(max_header_bytes=1 << 16)
        for at in range(0, len(body), size):
            reader.feed(body[at:at + size])
        out = reader.finish()
        assert reader.header is not None and reader.header.metadata == {"version": "4"}
        assert all(torch.equal(out[k], v) for k, v in tensors.items())
    cut = TensorStreamReader(max_header_bytes=1 << 16)
    cut.feed(body[:-3])
    with pytest.raises(WeightFormatError, match="cut off"):
        cut.finish()
    with pytest.raises(WeightFormatError, match="at most 16 bytes"):
        TensorStreamReader(max_header_bytes=16).feed(body)


def test_the_sampler_command_refuses_bad_model_settings_with_the_reason(capsys) -> None:
    from trainer.cli import main

    assert main(["sampler", "model.nope=1"]) == 2
    assert "Unknown key(s) ['nope'] in [model]" in capsys.readouterr().err
    assert main(["sampler", "--port", "8100", "hidden_size=64"]) == 2
    assert "Expected model.key=value overrides" in capsys.readouterr().err


async def test_openai_completions_and_a_streamed_chat_reply(backend) -> None:
    async with client(backend) as http:
        resp = await http.post("/v1/completions", json={"model": "tiny", "prompt": "1+1=", "max_tokens": 5, "n": 2,
                                                        "logprobs": 0, "seed": 3, "temperature": 0.7})
        assert resp.status_code == 200, resp.text
        data = resp.json()
        assert data["object"] == "text_completion" and len(data["choices"]) == 2
        choice = data["choices"][0]
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["logprobs"]["tokens"]) <= 5
        assert data["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in data["choices"])
        streamed = await http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
        events = [line[len("data: "):] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        bad = await http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"content": "no role"}]})
        assert bad.status_code == 400 and "role" in bad.json()["error"]["message"]
        far = await http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 10**6})
        assert far.status_code == 400 and "max_tokens" in far.json()["error"]["message"]
