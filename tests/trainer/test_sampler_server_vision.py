"""A vision-language policy on a real HF-backend sampler server: its images travel in the request bodies, the
server's log-probs are the trainer's own (full and LoRA pushes), bad or oversized images get a 4xx before any
decoding, and a short GRPO run on diagrams samples through the server."""

from __future__ import annotations

import asyncio
import io
import json

import httpx
import pytest
import torch

from env_servers.geometry_env.env import GeometryEnv
from tests.trainer.sampler_servers import TINY, ServerProcess
from trainer.config import load_config
from trainer.core.forward import run_model, target_logprobs
from trainer.model import ModelConfig, load_policy
from trainer.recipes.rl import train
from trainer.rollout.render import ChatRenderer
from trainer.sampling import GenRequest, RemoteSampler
from trainer.sampling.image_wire import image_entry
from trainer.vision import load_vision_processor

pytestmark = pytest.mark.live
TINY_VL = ["model.name='tiny-vl'", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
           "model.num_kv_heads=1", "model.intermediate_size=64", "model.vision_depth=1", "model.vision_embed_dim=16"]
VL_SHAPE = dict(name="tiny-vl", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                vision_depth=1, vision_embed_dim=16)


def png(colour: tuple[int, int, int], size: int = 56) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    return buf.getvalue()


def image_prompt(tok: object, colour: tuple[int, int, int], size: int = 56) -> tuple[list[int], list]:
    renderer = ChatRenderer(tok, load_vision_processor(ModelConfig(**VL_SHAPE), tok))
    return renderer.prompt([{"role": "user", "content": [{"type": "image", "image": png(colour, size)},
                                                        {"type": "text", "text": "colour?"}]}])


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], images: list, ids: list[int]) -> torch.Tensor:
    tokens = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits, _ = run_model(model.eval(), tokens, torch.ones_like(tokens), images_B=[images])
    return target_logprobs(logits[:, :-1], tokens[:, 1:], 1.0)[0, len(prompt) - 1:]


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_vision_policy_samples_on_the_server_with_the_trainers_logprobs(tmp_path, lora_rank) -> None:
    server = ServerProcess(tmp_path, *TINY_VL)
    try:
        model, tok = load_policy(ModelConfig(**VL_SHAPE, lora_rank=lora_rank))
        with torch.no_grad():  # a policy unlike the server's start (for LoRA: a non-zero adapter)
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.3 * torch.randn_like(p))
        sampler = RemoteSampler([server.url], model, lora=lora_rank > 0, log=lambda m: None)
        red, blue = image_prompt(tok, (220, 0, 0)), image_prompt(tok, (0, 0, 220), 84)  # 4 and 9 image tokens

        async def run() -> list:
            return list(await asyncio.gather(*(sampler.generate(GenRequest(ids, 6, images=images))
                                               for ids, images in (red, blue, red))))
        gens = asyncio.run(run())
        for (ids, images), gen in zip((red, blue, red), gens):
            assert gen.version == 0 and gen.token_ids
            gap = (trainer_logprobs(model, ids, images, gen.token_ids) - torch.tensor(gen.logprobs)).abs().max()
            assert gap < 1e-4  # fp32 on both sides
        # the server reads the pixels: one text, two pictures, two scorings
        ids, images = red
        scored = []
        for picture in (images, image_prompt(tok, (0, 220, 0))[1]):
            body = {"prompt_ids": ids, "max_tokens": 1, "prompt_logprobs": True,
                    "images": [image_entry(f) for f in picture], **({"adapter": "policy"} if lora_rank else {})}
            scored.append(httpx.post(f"{server.url}/sample", json=body, timeout=60).json()["prompt_logprobs"][1:])
        expected = trainer_logprobs(model, ids[:1], images, ids[1:])
        assert (torch.tensor(scored[0]) - expected).abs().max() < 1e-4
        assert (torch.tensor(scored[0]) - torch.tensor(scored[1])).abs().max() > 1e-4
        sampler.close()
    finally:
        server.stop()


def test_bad_or_oversized_images_get_a_4xx_before_decoding(tmp_path) -> None:
    vision = ServerProcess(tmp_path, *TINY_VL, "--max-image-patches", "64")
    text = ServerProcess(tmp_path, *TINY)
    try:
        _, tok = load_policy(ModelConfig(**VL_SHAPE))
        ids, images = image_prompt(tok, (220, 0, 0))  # 16 patches, 4 image tokens
        good = image_entry(images[0])
        short = {**good, "pixel_values": good["pixel_values"][:-8]}
        big_ids, big = image_prompt(tok, (0, 0, 220), 168)  # 36 tokens but shrunk to 84 px: 9 tokens, 36 patches
        cases = [
            ({"prompt_ids": ids, "images": [short]}, "base64 of 16 x"),
            ({"prompt_ids": ids, "images": [{**good, "pixel_values": "!" * len(good["pixel_values"])}]}, "base64"),
            ({"prompt_ids": ids, "images": [{**good, "grid_thw": [1, 3, 4]}]}, "merge size"),
            ({"prompt_ids": ids, "images": [{"grid_thw": [1, 4, 4]}]}, "grid_thw"),
            ({"prompt_ids": ids[:-3], "images": [good, good]}, "placeholder"),
            ({"prompt_ids": big_ids + ids, "images": [image_entry(big[0]), good, good]}, "at most 64 image patches"),
            ({"prompt_ids": ids}, "placeholder"),  # placeholders without their image
        ]
        for body, reason in cases:
            resp = httpx.post(f"{vision.url}/sample", json={"max_tokens": 2, **body}, timeout=60)
            assert resp.status_code == 400 and reason in resp.json()["error"]["message"], (reason, resp.text)
        batch = httpx.post(f"{vision.url}/sample/batch", timeout=60, json={"requests": [
            {"prompt_ids": ids, "images": [short], "max_tokens": 2},
            {"prompt_ids": ids, "images": [good], "max_tokens": 2}]}).json()["results"]
        assert batch[0]["error"]["code"] == 400 and batch[1]["samples"]  # the bad one alone is refused
        resp = httpx.post(f"{text.url}/sample", json={"prompt_ids": [1, 2], "images": [good]}, timeout=60)
        assert resp.status_code == 400 and "cannot take them" in resp.json()["error"]["message"]
    finally:
        vision.stop()
        text.stop()


def test_a_vision_grpo_run_samples_through_a_server(tmp_path, serve_env) -> None:
    # the scenario's short prompt (tests/trainer/test_vision.py runs the long one in process)
    srv = serve_env(GeometryEnv, mode="single", image_size=128, instruction="", system_prompt="Look.")
    server = ServerProcess(tmp_path, *TINY_VL)
    try:
        cfg = load_config(None, [*TINY_VL, f"env.url='{srv.ws_url}'", "env.train_task={ split = 'train' }",
                                 "env.eval_task={ split = 'validation' }", "rollout.max_turns=1",
                                 "rollout.max_tokens_per_turn=4", "rollout.max_total_tokens=4", "rollout.tool_mode='text'",
                                 "algo.filter_zero_variance=false", "run.steps=2", "run.batch_size=2",
                                 "run.group_size=2", "run.eval_problems=2", "run.eval_every=0",
                                 f"run.output_dir='{tmp_path}'", "run.device='cpu'",
                                 f"sampling.servers=['{server.url}']"])
        summary = train(cfg, log=lambda m: None)
        sampled = server.metric("sequences_total")
    finally:
        server.stop()
    assert summary["steps"] == 2 and sampled >= 2 * 2 * 2  # every rollout turn was sampled on the server
    records = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert records and all(r["images"] == [[1, 6, 6]] for r in records if r.get("phase") != "eval")
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss" in m for m in metrics)
