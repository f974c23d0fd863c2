"""trainer.sampling.decode: the samplers' decode loop agrees with the model's own forward pass, for every kernel.

What matters for RL is that the log-prob reported for each sampled id is the one the trainer computes
for it afterwards (the importance ratio starts at 1), and that a left-padded row decodes as it would alone.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from trainer.sampling.decode import _sample, decode
from trainer.sampling.kernels import HFKernel, LlamaKernel

VOCAB, PAD, EOS = 50, 0, 1


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, eos_token_id=EOS)
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True)).eval()
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16)).eval()
    if kind == "qwen2-lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(_model("qwen2"), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"]))
        for name, p in model.named_parameters():  # a trained adapter, not the zero-initialised one
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.5)
        return model.eval()
    if kind == "gpt2":  # not a Llama-family model: the general kernel
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, pad_token_id=PAD,
            eos_token_id=EOS)).eval()
    raise AssertionError(kind)


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], attn[i, width - len(p):] = torch.tensor(p), 1
    return ids, attn


@torch.no_grad()
def _trainer_logprobs(model, prompt: list[int], new: list[int], temperature: float = 1.0) -> list[float]:
    """The trainer's view: one unpadded forward over prompt + completion."""
    ids = torch.tensor([prompt + new])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(new)[:, None]).squeeze(-1).tolist()


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3", "qwen2-lora", "gpt2"])
@pytest.mark.parametrize("greedy", [True, False])
def test_decode_logprobs_match_the_trainer_forward_on_padded_rows(kind: str, greedy: bool) -> None:
    model = _model(kind)
    expected_kernel = HFKernel if kind == "gpt2" else LlamaKernel
    assert isinstance(LlamaKernel.build(model, 64) or HFKernel(model), expected_kernel)
    ids, attn = _left_padded(PROMPTS)
    torch.manual_seed(1)
    out = decode(model, ids, attn, max_new_tokens=12, temperature=0.7, greedy=greedy)
    assert out.finish_reasons == ["length"] * 3 and all(len(t) == 12 for t in out.token_ids)
    for prompt, new, lps in zip(PROMPTS, out.token_ids, out.logprobs):
        want = _trainer_logprobs(model, prompt, new, 1.0 if greedy else 0.7)
        assert max(abs(a - b) for a, b in zip(lps, want)) < 1e-4
    if greedy:  # a padded row decodes as it would alone
        for i, prompt in enumerate(PROMPTS):
            alone = decode(model, torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=12, greedy=True)
            assert alone.token_ids[0] == out.token_ids[i]


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_greedy_decode_equals_hf_generate(kind: str) -> None:
    model = _model(kind)
    ids, attn = _left_padded(PROMPTS)
    out = decode(model, ids, attn, max_new_tokens=10, greedy=True)
    gen = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=10, do_sample=False, eos_token_id=None,
                         pad_token_id=PAD)
    assert out.token_ids == gen[:, ids.shape[1]:].tolist()


def test_rows_stop_at_eos_their_budget_or_the_stop_check() -> None:
    model = _model("qwen2")
    ids, attn = _left_padded(PROMPTS)
    out = decode(model, ids, attn, max_new_tokens=[8, 3, 8], greedy=True)
    first = out.token_ids[0]
    eos = first[2]  # any id the greedy row emits can serve as its stop id
    stopped = decode(model, ids, attn, max_new_tokens=[8, 3, 8], greedy=True, eos_ids={eos})
    assert stopped.token_ids[0] == first[:first.index(eos) + 1] and stopped.finish_reasons[0] == "stop"
    assert len(stopped.token_ids[1]) <= 3 and len(stopped.logprobs[1]) == len(stopped.token_ids[1])
    checked = decode(model, ids, attn, max_new_tokens=8, greedy=True, stop_check=lambda new: len(new) == 2)
    assert [len(t) for t in checked.token_ids] == [2, 2, 2] and checked.finish_reasons == ["stop"] * 3


def test_stopped_rows_do_not_change_the_running_ones() -> None:
    model = _model("qwen2")
    ids, attn = _left_padded(PROMPTS)
    full = decode(model, ids, attn, max_new_tokens=10, greedy=True)
    short = decode(model, ids, attn, max_new_tokens=[10, 2, 10], greedy=True)
    assert short.token_ids[0] == full.token_ids[0] and short.token_ids[2] == full.token_ids[2]
    assert short.token_ids[1] == full.token_ids[1][:2]
    # the same with a shared prefill (rows 0 and 2 one prompt) and grouped KV heads: each row masks its own keys
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    ids, attn = _left_padded(prompts)
    full = decode(model, ids, attn, max_new_tokens=10, greedy=True)
    short = decode(model, ids, attn, max_new_tokens=[10, 2, 3, 10], greedy=True)
    assert [short.token_ids[i] for i in (0, 3)] == [full.token_ids[i] for i in (0, 3)]
    assert short.token_ids[1] == full.token_ids[1][:2] and short.token_ids[2] == full.token_ids[2][:3]
    assert short.logprobs[0] == pytest.approx(full.logprobs[0], abs=1e-5)


@pytest.mark.parametrize(("top_k", "top_p", "allowed"), [(0, 1.0, 5), (2, 1.0, 2), (0, 0.75, 3), (0, 0.5, 2)])
def test_sampling_draws_from_the_filtered_distribution(top_k: int, top_p: float, allowed: int) -> None:
    probs = torch.tensor([0.4, 0.0, 0.3, 0.2, 0.1, 0.0])
    logp = probs.log().expand(40_000, -1).contiguous()
    torch.manual_seed(0)
    counts = torch.bincount(_sample(logp, top_k, top_p), minlength=6).float() / 40_000
    keep = probs.argsort(descending=True)[:allowed]
    want = torch.zeros(6)
    want[keep] = probs[keep] / probs[keep].sum()
    assert (counts - want).abs().max() < 0.01


def test_bad_budgets_and_temperatures_are_refused() -> None:
    model = _model("qwen2")
    ids, attn = _left_padded(PROMPTS)
    with pytest.raises(ValueError, match="budgets"):
        decode(model, ids, attn, max_new_tokens=[4, 4])
    with pytest.raises(ValueError, match="temperature"):
        decode(model, ids, attn, max_new_tokens=4, temperature=0.0)


def test_sliding_window_attention_takes_the_general_path() -> None:
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    model = transformers.MistralForCausalLM(config).eval()
    assert LlamaKernel.build(model, capacity=32) is None
    assert LlamaKernel.build(model, capacity=8) is not None
    ids, attn = _left_padded(PROMPTS)
    out = decode(model, ids, attn, max_new_tokens=12, greedy=True)
    for prompt, new, lps in zip(PROMPTS, out.token_ids, out.logprobs):
        assert max(abs(a - b) for a, b in zip(lps, _trainer_logprobs(model, prompt, new))) < 1e-4


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_repeated_prompts_share_one_prefill_and_decode_as_they_would_apart(kind: str) -> None:
    model = _model(kind)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    ids, attn = _left_padded(prompts)
    shared = decode(model, ids, attn, max_new_tokens=8, greedy=True)
    for i, prompt in enumerate(prompts):
        alone = decode(model, torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=8,
                       greedy=True)
        assert shared.token_ids[i] == alone.token_ids[0]
        assert max(abs(a - b) for a, b in zip(shared.logprobs[i], alone.logprobs[0])) < 1e-4
    torch.manual_seed(0)
    sampled = decode(model, ids, attn, max_new_tokens=8)
    assert len({tuple(t) for t in sampled.token_ids}) > 3  # copies of one prompt still sample independently
