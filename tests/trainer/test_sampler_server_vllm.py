"""A sampler server with the vLLM backend as a real process (in .venv-vllm; skipped elsewhere): log-probs that
follow the trainer through full and LoRA pushes after real optimizer steps (over the weight channel and through
a gloo weight group), the OpenAI API, and one generate call for the rows of several adapters and the base."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import httpx
import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.live]
pytest.importorskip("vllm", reason="vLLM is not installed here; scripts/test.sh runs these tests in .venv-vllm")

from tests.trainer.sampler_servers import ServerProcess  # noqa: E402
from trainer.core import AdamParams, Datum, TrainingClient  # noqa: E402
from trainer.core.forward import run_model, target_logprobs  # noqa: E402
from trainer.model import ModelConfig  # noqa: E402
from trainer.sampling import GenRequest, RemoteSampler, SamplingConfig  # noqa: E402

SHAPE = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128)
ARGS = ["--backend", "vllm", "--device", "cpu", "model.dtype=fp32", *(f"model.{k}={v}" for k, v in SHAPE.items())]


def gap(model: torch.nn.Module, prompt: list[int], ids: list[int], logprobs: list[float]) -> float:
    tokens = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits, _ = run_model(model.eval(), tokens, torch.ones_like(tokens))
    ours = target_logprobs(logits[:, :-1], tokens[:, 1:], 1.0)[0, len(prompt) - 1:]
    return float((ours - torch.tensor(logprobs)).abs().max())


@pytest.mark.parametrize("weight_group", ["off", "gloo"])
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_vllm_server_follows_the_trainer_through_pushes(tmp_path, lora_rank, weight_group) -> None:
    server = ServerProcess(tmp_path, *ARGS, timeout_s=600)
    try:
        client = TrainingClient.from_config(ModelConfig(**SHAPE, dtype="fp32", lora_rank=lora_rank))
        sampler = RemoteSampler([server.url], client.model, SamplingConfig(weight_group=weight_group),
                                lora=lora_rank > 0)
        prompt = [11, 12, 13, 14]
        for version in (1, 2):
            client.forward_backward([Datum.from_sequence(prompt + [7, 8, 9], weights=[0] * 4 + [1, 1, 1])])
            client.optim_step(AdamParams(learning_rate=5e-2))
            client.save_weights_for_sampler(sampler, version)
            slot = sampler.pool.servers[server.url]
            assert (slot.group is not None and not slot.group_failed) == (weight_group == "gloo")
            seqs = asyncio.run(_turns(sampler, prompt, 4))
            assert all(s.version == version for s in seqs)
            # the stop token (appended with log-prob 0 when vLLM leaves it out) is not compared
            gaps = [gap(client.model, prompt, s.tokens[:len(s.logprobs)], s.logprobs) for s in seqs
                    if s.stop_reason == "length"]
            assert gaps and max(gaps) < 1e-3  # fp32 both sides; vLLM's kernels differ from torch's in rounding
            scored = _prompt_logprobs(server.url, prompt + [7, 8, 9], "policy" if lora_rank else None)
            assert scored[0] is None
            assert gap(client.model, prompt[:1], prompt[1:] + [7, 8, 9], scored[1:]) < 1e-3  # compute_logprobs
        with urllib.request.urlopen(f"{server.url}/v1/completions", data=json.dumps(
                {"model": "policy" if lora_rank else "tiny", "prompt": "1+1=", "max_tokens": 3}).encode(),
                timeout=60) as resp:
            assert json.load(resp)["choices"][0]["finish_reason"] in ("stop", "length")
        if lora_rank == 0 and weight_group == "off":  # images: a clear 400 (a vision policy needs the HF backend)
            body = {"prompt_ids": prompt, "images": [{"grid_thw": [1, 2, 2], "pixel_values": ""}]}
            request = urllib.request.Request(f"{server.url}/sample", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=60)
            assert refused.value.code == 400 and b"vLLM backend takes no images" in refused.value.read()
        sampler.close()
    finally:
        server.stop()


async def _turns(sampler: RemoteSampler, prompt: list[int], n: int) -> list:
    return list(await asyncio.gather(*(sampler.generate(GenRequest(prompt, 6)) for _ in range(n))))


def _prompt_logprobs(url: str, ids: list[int], adapter: str | None) -> list:
    body = {"prompt_ids": ids, "max_tokens": 1, "prompt_logprobs": True, **({"adapter": adapter} if adapter else {})}
    request = urllib.request.Request(f"{url}/sample", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return list(json.load(resp)["prompt_logprobs"])


def _lora_policy(seed: int) -> torch.nn.Module:
    """A LoRA policy on the server's base with a non-zero adapter of its own."""
    torch.manual_seed(seed)
    client = TrainingClient.from_config(ModelConfig(**SHAPE, dtype="fp32", lora_rank=4))
    with torch.no_grad():
        for name, p in client.model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    return client.model


def test_vllm_server_mixes_adapters_and_the_base_in_one_generate_call(tmp_path) -> None:
    from trainer.model import load_policy
    from trainer.sampling.remote_push import payload, put_as_body

    server = ServerProcess(tmp_path, *ARGS, timeout_s=600)
    try:
        policies = {"one": _lora_policy(1), "two": _lora_policy(2),
                    None: load_policy(ModelConfig(**SHAPE, dtype="fp32"))[0]}
        with httpx.Client(timeout=120) as http:
            for name in ("one", "two"):
                resp = put_as_body(http, server.url, payload(policies[name], 3, lora=True, adapter_name=name))
                assert resp.status_code == 200, resp.text
            head = TrainingClient.from_config(ModelConfig(**SHAPE, dtype="fp32", lora_rank=4,
                                                          lora_target_modules=["q_proj", "lm_head"])).model
            refused = put_as_body(http, server.url, payload(head, 1, lora=True, adapter_name="head"))
            assert refused.status_code == 400 and "vLLM loads no adapter on lm_head" in refused.text
            before = server.metric("batches_total")
            names = ["two", None, "one", "nope", "two", "one"]  # interleaved, an unknown adapter among them
            bodies = [{"prompt_ids": [11 + i, 12, 13], "n": 2, "max_tokens": 6, "stop_ids": [],
                       **({"adapter": name} if name else {})} for i, name in enumerate(names)]
            results = http.post(f"{server.url}/sample/batch", json={"requests": bodies}).json()["results"]
        assert server.metric("batches_total") - before == 1  # ONE generate call for every adapter and the base
        assert results[3]["error"]["code"] == 404 and "nope" in results[3]["error"]["message"]
        for name, body, result in zip(names, bodies, results):
            if name == "nope":
                continue
            assert result["version"] == (3 if name else 0)
            for sample in result["samples"]:
                assert gap(policies[name], body["prompt_ids"], sample["token_ids"], sample["logprobs"]) < 1e-3, name
        ids = results[0]["samples"][0]["token_ids"]  # the adapters really differ
        assert gap(policies["one"], [11, 12, 13], ids, results[0]["samples"][0]["logprobs"]) > 1e-2
    finally:
        server.stop()
