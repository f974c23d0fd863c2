"""Vision-language policies: image observations reach a tiny Qwen2-VL, placeholders are prompt (mask 0), the
sampler and the training forward pass see the same pixels, and the geometry env trains end to end."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rollout_fakes import ScriptedSampler

from env_servers.geometry_env.env import GeometryEnv
from envhub import Env, Observation, StepResult, tool
from trainer.config import load_config
from trainer.core import TrainingClient
from trainer.core.forward import run_model
from trainer.model import ModelConfig, load_policy
from trainer.recipes.rl import train
from trainer.recipes.sft import encode_image_demo
from trainer.rollout import EnvPool, RolloutConfig, RolloutEngine, StopReason, make_tasks
from trainer.rollout.render import ChatRenderer
from trainer.rollout.types import Task, Trajectory
from trainer.sampling import GenRequest, HFSampler
from trainer.tokenizer import VISION_TOKENS, build_tiny_tokenizer
from trainer.update import forward_values, pack
from trainer.vision import VisionProcessor, build_image_processor, load_vision_processor, suppress_tokens

TINY_VL = ["model.name='tiny-vl'", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
           "model.num_kv_heads=1", "model.intermediate_size=64", "model.vision_depth=1", "model.vision_embed_dim=16"]


def png(colour: tuple[int, int, int], size: int = 56) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vl():
    cfg = ModelConfig(name="tiny-vl", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      intermediate_size=64, vision_depth=1, vision_embed_dim=16)
    model, tok = load_policy(cfg)
    return model, tok, load_vision_processor(cfg, tok)


class PictureEnv(Env):
    """Shows a picture; its ``zoom`` tool answers with another picture; any text answer ends the episode."""

    def reset(self, seed=None):
        return Observation(text="What is it?", images=[png((200, 0, 0), 80)])

    @tool
    def zoom(self, factor: int) -> StepResult:
        """Zoom into the picture."""
        return StepResult(Observation(text=f"zoomed x{factor}", images=[png((0, 0, 200), 56)]))

    def on_text(self, text: str):
        return StepResult(Observation(text="bye"), reward=float("red" in text), done=True)


def test_vision_tokenizer_renders_image_parts_as_qwen2vl_placeholders() -> None:
    tok, text_tok = build_tiny_tokenizer(vision=True), build_tiny_tokenizer()
    assert (len(text_tok), len(tok)) == (263, 268)
    for t in VISION_TOKENS:
        assert len(tok.encode(t, add_special_tokens=False)) == 1
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "2+3?"}]
    assert tok.apply_chat_template(plain, tokenize=False) == text_tok.apply_chat_template(plain, tokenize=False)
    parts = [{"role": "user", "content": [{"type": "image", "image": b"..."}, {"type": "text", "text": "colour?"}]}]
    assert tok.apply_chat_template(parts, tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>colour?<|im_end|>\n<|im_start|>assistant\n")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    tool_msg = [*plain, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
                {"role": "tool", "content": [{"type": "image", "image": b"."}, {"type": "text", "text": "ok"}]}]
    assert tok.apply_chat_template(tool_msg, tools=tools, tokenize=False).endswith(
        "<tool_response>\n<|vision_start|><|image_pad|><|vision_end|>ok\n</tool_response><|im_end|>\n")


def test_suppressing_tokens_in_a_model_without_an_output_layer_says_so() -> None:
    from transformers import Qwen2Config, Qwen2Model

    base = Qwen2Model(Qwen2Config(vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, intermediate_size=32))
    with pytest.raises(ValueError, match="output layer"):
        suppress_tokens(base, [263])


def test_image_processor_grid_sets_the_placeholder_count_and_bad_images_say_why() -> None:
    vp = VisionProcessor(build_image_processor(56 * 56, 100 * 100), build_tiny_tokenizer(vision=True))
    big, small = vp.features([png((0, 0, 0), 300), png((0, 0, 0), 40)])
    assert (big.grid_thw, big.num_tokens, tuple(big.pixel_values.shape)) == ((1, 6, 6), 9, (36, 1176))
    assert (small.grid_thw, small.num_tokens) == ((1, 4, 4), 4)
    pad = vp.image_token_id
    assert vp.expand([1, pad, 2], [small]) == [1, pad, pad, pad, pad, 2]
    assert vp.expand([1, pad, 2], [small], [0, 0, 1]) == [0, 0, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="one <|image_pad|> placeholder per image"):
        vp.expand([1, pad, pad], [small])
    with pytest.raises(ValueError, match="Could not decode an image of 9 bytes"):
        vp.features([b"not a png"])


async def test_images_reach_the_prompt_as_mask0_placeholders_in_prompts_and_tool_responses(vl) -> None:
    _, tok, vp = vl

    def respond(prompt: str) -> str:
        return "red" if "zoomed" in prompt else '<tool_call>\n{"name": "zoom", "arguments": {"factor": 2}}\n</tool_call>'

    sampler = ScriptedSampler(tok, respond)
    engine = RolloutEngine(EnvPool(env_cls=PictureEnv), sampler, tok, RolloutConfig(max_turns=3), vision=vp)
    [traj] = await engine.run(make_tasks([{}], 1))
    assert traj.stop_reason is StopReason.DONE and traj.reward == 1.0 and traj.tool_calls == 1
    assert [f.grid_thw for f in traj.images] == [(1, 6, 6), (1, 4, 4)]
    pad = vp.image_token_id
    at_pad = [i for i, t in enumerate(traj.tokens) if t == pad]
    assert len(at_pad) == 9 + 4 and all(traj.mask[i] == 0 for i in at_pad)
    assert all(t not in vp.vision_token_ids for t, m in zip(traj.tokens, traj.mask) if m)
    # each turn's request carries the images of everything before it
    assert [len(r.images) for r in sampler.requests] == [1, 2]
    # a text-only policy gets the same episode without images or placeholders
    text_tok = build_tiny_tokenizer()
    plain = RolloutEngine(EnvPool(env_cls=PictureEnv), ScriptedSampler(text_tok, respond), text_tok,
                          RolloutConfig(max_turns=3))
    [t2] = await plain.run(make_tasks([{}], 1))
    assert t2.images == [] and "What is it?" in text_tok.decode(t2.tokens) and "vision" not in text_tok.decode(t2.tokens)


def test_sampler_log_probs_equal_the_training_forward_and_depend_on_the_image(vl) -> None:
    model, tok, vp = vl
    renderer = ChatRenderer(tok, vp)

    def prompt(colour):
        return renderer.prompt([{"role": "user", "content": [{"type": "image", "image": png(colour)},
                                                            {"type": "text", "text": "colour?"}]}])

    (red_ids, red_imgs), (blue_ids, blue_imgs) = prompt((220, 0, 0)), prompt((0, 0, 220))
    torch.manual_seed(0)
    sampler = HFSampler(model, tok)
    # two rows of different lengths: left padding in generate, right padding in training
    gens = sampler.generate_batch([GenRequest(red_ids, 6, images=red_imgs),
                                   GenRequest(red_ids[:5] + blue_ids, 6, images=blue_imgs)])
    trajs = []
    for ids, imgs, gen in zip([red_ids, red_ids[:5] + blue_ids], [red_imgs, blue_imgs], gens):
        t = Trajectory(task=Task({}))
        t.append(ids, policy=False, images=imgs)
        t.append(gen.token_ids, policy=True, logprobs=gen.logprobs)
        trajs.append(t)
    batch = pack(trajs, [[0.0] * len(t.tokens) for t in trajs], tok.pad_token_id)
    client = TrainingClient(model, tok)
    lp_BS = forward_values(client, batch, "logprobs")  # the training core's forward pass
    mask = batch.mask_BS.bool()
    assert torch.allclose(lp_BS[mask], batch.sampler_logprobs_BS[mask], atol=1e-4)
    # the same ids with the other picture's pixels score differently: the image is really read
    batch.images_B = [blue_imgs, red_imgs]
    swapped_BS = forward_values(client, batch, "logprobs")
    assert not torch.allclose(swapped_BS[mask], lp_BS[mask], atol=1e-4)
    # the policy can never write an image placeholder
    with torch.no_grad():
        logits, _ = run_model(model, batch.tokens_BT, batch.attn_BT, images_B=batch.images_B)
    assert (logits[..., vp.vision_token_ids] <= -1e4 + 1).all()


def test_sft_demonstrations_with_images_mask_their_placeholders(vl) -> None:
    _, tok, vp = vl
    demo = {"prompt": [{"role": "user", "content": [{"type": "image", "image": png((0, 200, 0))},
                                                    {"type": "text", "text": "colour?"}]}], "completion": "green"}
    ids, mask, images = encode_image_demo(tok, demo, vp)
    assert len(ids) == len(mask) and [f.num_tokens for f in images] == [4]
    assert ids.count(vp.image_token_id) == 4 and all(m == 0 for i, m in zip(ids, mask) if i == vp.image_token_id)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "green<|im_end|>"


@pytest.mark.parametrize("mode", ["single", "tools"])
def test_geometry_with_diagrams_trains_end_to_end_over_msgpack(tmp_path, serve_env, mode) -> None:
    srv = serve_env(GeometryEnv, mode=mode, image_size=128)
    cfg = load_config(None, [*TINY_VL, f"env.url='{srv.ws_url}'", "env.train_task={ split = 'train' }",
                             "env.eval_task={ split = 'validation' }", "rollout.max_turns=2",
                             "rollout.max_tokens_per_turn=6", "rollout.max_total_tokens=12",
                             # the tools' schemas (calculator and ruler) are ~4,200 byte-level tokens of prompt
                             "rollout.max_context_tokens=8192", "model.max_position_embeddings=8192",
                             "algo.filter_zero_variance=false", "run.steps=1", "run.batch_size=2", "run.group_size=2",
                             "run.eval_problems=2", f"run.output_dir='{tmp_path}'", "run.device='cpu'",
                             f"rollout.tool_mode='{'tools' if mode == 'tools' else 'text'}'"])
    summary = train(cfg, log=lambda m: None)
    assert summary["steps"] == 1
    records = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    train_recs = [r for r in records if r.get("phase") != "eval"]
    assert train_recs and all(r["images"] == [[1, 6, 6]] for r in train_recs)  # 128 px diagram, shrunk to 84 px
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss" in m for m in metrics)
    if mode == "tools":
        assert all("<tools>" in r["text"] for r in train_recs)


async def test_msgpack_carries_the_diagram_bytes_exactly(vl, serve_env) -> None:
    _, tok, vp = vl
    srv = serve_env(GeometryEnv, mode="single", image_size=128)
    pool = EnvPool(urls=[srv.ws_url])
    session = await pool.open()
    try:
        first = await session.reset(split="validation", index=0)
        assert "msgpack" in session.extensions and first.observation.images[0][:8] == b"\x89PNG\r\n\x1a\n"
        local = GeometryEnv(mode="single", image_size=128)
        assert first.observation.images == local.reset(split="validation", index=0).images
    finally:
        await session.close()
