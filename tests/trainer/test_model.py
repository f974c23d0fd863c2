"""The tiny policy and its shipped tokenizer take the same path as a real Qwen2.5 model."""

from __future__ import annotations

import pytest
import torch

from trainer.model import ModelConfig, load_policy, trainable_parameters
from trainer.tokenizer import TOOL_TOKENS, build_tiny_tokenizer


def test_tokenizer_round_trips_text_and_keeps_tool_tokens_whole() -> None:
    tok = build_tiny_tokenizer()
    text = 'héllo 12+34=46 <tool_call>\n{"name": "f"}\n</tool_call>'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    for t in TOOL_TOKENS:
        assert len(tok.encode(t, add_special_tokens=False)) == 1
    # Tool tokens are non-special (survive skip_special_tokens); <|im_end|> is the special EOS.
    assert "<tool_call>" in tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(tok.encode("a<|im_end|>", add_special_tokens=False), skip_special_tokens=True) == "a"
    assert tok.eos_token == "<|im_end|>"


def test_chat_template_renders_qwen25_turns_and_tool_responses() -> None:
    tok = build_tiny_tokenizer()
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "2+3?"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    msgs += [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
             {"role": "tool", "content": "ok"}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False)
    assert "<tools>\n" in text and "# Tools" in text
    assert text.endswith('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'
                         "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n")


def test_tiny_model_generates_and_lora_trains_only_the_adapter() -> None:
    model, tok = load_policy(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                         intermediate_size=64))
    assert type(model).__name__ == "Qwen2ForCausalLM"
    ids = torch.tensor([tok.encode("1+1=", add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 3) or tok.eos_token_id in out[0].tolist()
    lora, _ = load_policy(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                      intermediate_size=64, lora_rank=4))
    trainable = trainable_parameters(lora)
    assert trainable and all("lora_" in n for n, p in lora.named_parameters() if p.requires_grad)
    assert sum(p.numel() for p in trainable) < sum(p.numel() for p in lora.parameters()) / 2


def test_same_init_seed_builds_the_same_weights() -> None:
    a, _ = load_policy(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, init_seed=3))
    b, _ = load_policy(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, init_seed=3))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_a_lora_on_the_output_layer_is_named_and_refused_where_vllm_samples() -> None:
    from trainer.config import TrainConfig
    from trainer.model import targets_output_layer
    from trainer.sampling.types import SamplingConfig

    assert targets_output_layer(["q_proj", "lm_head"]) and targets_output_layer(".*head")
    assert not targets_output_layer("all-linear") and not targets_output_layer(["q_proj", "v_proj"])
    assert not targets_output_layer(None)
    head = ModelConfig(lora_rank=4, lora_target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="vLLM loads no adapter on lm_head"):
        TrainConfig(model=head, sampling=SamplingConfig(backend="vllm"))
    assert TrainConfig(model=head).model == head  # the hf sampler runs it
    assert not targets_output_layer("lm_head(")


@pytest.mark.parametrize("targets", ["q_proj(", [], [1], None])
def test_lora_target_modules_that_name_nothing_are_refused_early(targets) -> None:
    with pytest.raises(ValueError, match="model.lora_target_modules"):
        ModelConfig(lora_rank=4, lora_target_modules=targets)
