"""The rollout engine: exact ids and masks, multi-turn and tool episodes, stop reasons, batching, groups."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_fakes import AddEnv, CalcEnv, CountdownEnv, CrashEnv, ScriptedSampler, SlowEnv, add_answer

from trainer.model import ModelConfig, load_policy
from trainer.rollout import EnvPool, RolloutConfig, RolloutEngine, StopReason, build_groups, make_tasks
from trainer.rollout.types import Task, Trajectory
from trainer.sampling import HFSampler, SampledSequence
from trainer.tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def engine(env_cls, sampler, tok, **cfg) -> RolloutEngine:
    return RolloutEngine(EnvPool(env_cls=env_cls), sampler, tok, RolloutConfig(**cfg))


def policy_text(tok, traj: Trajectory) -> str:
    return tok.decode([t for t, m in zip(traj.tokens, traj.mask) if m])


async def test_single_turn_keeps_sampled_ids_with_mask_one_and_prompt_with_mask_zero(tok) -> None:
    sampler = ScriptedSampler(tok, add_answer)
    [traj] = await engine(AddEnv, sampler, tok).run([Task({"a": 2, "b": 3})])
    assert traj.stop_reason is StopReason.DONE and traj.reward == 1.0
    prompt = tok.apply_chat_template([{"role": "system", "content": "Add."}, {"role": "user", "content": "2+3=?"}],
                                     tokenize=False, add_generation_prompt=True)
    assert tok.decode(traj.tokens[:traj.prompt_len]) == prompt
    assert traj.mask == [0] * traj.prompt_len + [1] * 2
    assert traj.tokens[traj.prompt_len:] == tok.encode("5", add_special_tokens=False) + [tok.eos_token_id]
    assert traj.logprobs[traj.prompt_len:] == [-0.5, -0.5] and traj.turn_ends == [len(traj.tokens) - 1]


async def test_multi_turn_appends_observations_exactly_as_the_chat_template_renders_them(tok) -> None:
    replies = iter(["3", "2", "1"])
    [traj] = await engine(CountdownEnv, ScriptedSampler(tok, lambda p: next(replies)), tok,
                          max_turns=5, system_prompt="Be brief.").run([Task({})])
    assert traj.stop_reason is StopReason.DONE and traj.num_turns == 3
    assert traj.reward == pytest.approx(1.5) and traj.turn_rewards == [0.5, 0.5, 0.5]
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count down from 3."},
                    {"role": "assistant", "content": "3"}, {"role": "user", "content": "next: 2"},
                    {"role": "assistant", "content": "2"}, {"role": "user", "content": "next: 1"},
                    {"role": "assistant", "content": "1"}]
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    # The record is the template's text minus the newline after the final <|im_end|> (never sampled).
    assert tok.decode(traj.tokens) == rendered[:-1]
    assert policy_text(tok, traj) == "3<|im_end|>2<|im_end|>1<|im_end|>"
    assert [traj.tokens[i] for i in traj.turn_ends] == [tok.eos_token_id] * 3


async def test_turn_limit_and_token_limit_are_stop_reasons(tok) -> None:
    wrong = ScriptedSampler(tok, lambda p: "9")
    [traj] = await engine(CountdownEnv, wrong, tok, max_turns=2).run([Task({})])
    assert traj.stop_reason is StopReason.TURN_LIMIT and traj.num_turns == 2
    chatty = ScriptedSampler(tok, lambda p: "x" * 50)
    [traj] = await engine(CountdownEnv, chatty, tok, max_turns=5, max_tokens_per_turn=8,
                          max_total_tokens=20).run([Task({})])
    assert traj.stop_reason is StopReason.TOKEN_LIMIT
    assert [r.max_new_tokens for r in chatty.requests] == [8, 8, 4]  # the per-turn cap goes to the sampler
    assert traj.num_policy_tokens == 20
    # A cut-off turn is closed with a mask-0 EOS before the next observation.
    second_turn_start = traj.turn_ends[0] + 1
    assert traj.tokens[second_turn_start] == tok.eos_token_id and traj.mask[second_turn_start] == 0


async def test_tool_calls_run_through_the_env_and_results_come_back_as_tool_responses(tok) -> None:
    def respond(prompt: str) -> str:
        if "<tool_response>" not in prompt:
            return '<tool_call>\n{"name": "add", "arguments": {"x": 2, "y": 5}}\n</tool_call>'
        return "The answer is 7."

    [traj] = await engine(CalcEnv, ScriptedSampler(tok, respond), tok, max_turns=3).run([Task({})])
    assert traj.stop_reason is StopReason.DONE and traj.reward == 1.0 and traj.tool_calls == 1
    text = tok.decode(traj.tokens)
    assert '"name": "add"' in text.split("<|im_start|>user")[0]  # the tool list is in the system turn
    assert "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n" \
           "<|im_start|>assistant\nThe answer is 7.<|im_end|>" in text


async def test_malformed_tool_call_is_a_parse_error_fed_back_or_stopping(tok) -> None:
    bad = ScriptedSampler(tok, lambda p: "<tool_call>\n{not json}\n</tool_call>")
    [traj] = await engine(CalcEnv, bad, tok, max_turns=2).run([Task({})])
    assert traj.parse_errors == 2 and traj.stop_reason is StopReason.TURN_LIMIT
    assert "<tool_response>\nError: invalid JSON" in tok.decode(traj.tokens)
    [traj] = await engine(CalcEnv, bad, tok, max_turns=2, stop_on_parse_error=True).run([Task({})])
    assert traj.stop_reason is StopReason.PARSE_ERROR and not traj.infra_failed


async def test_env_crash_and_timeout_are_infra_failures(tok) -> None:
    [crash] = await engine(CrashEnv, ScriptedSampler(tok, lambda p: "a"), tok).run([Task({})])
    assert crash.stop_reason is StopReason.ENV_ERROR and crash.infra_failed and "disk on fire" in crash.error
    [slow] = await engine(SlowEnv, ScriptedSampler(tok, lambda p: "a"), tok, episode_timeout_s=0.2).run([Task({})])
    assert slow.stop_reason is StopReason.TIMEOUT and slow.infra_failed


async def test_unreachable_server_is_an_env_error_not_a_crash(tok) -> None:
    pool = EnvPool(urls=["http://127.0.0.1:9"], connect_retry_s=0.3, connect_timeout_s=0.2)
    eng = RolloutEngine(pool, ScriptedSampler(tok, lambda p: "a"), tok)
    trajs = await eng.run(make_tasks([{}], 2, urls=pool.urls))
    assert [t.stop_reason for t in trajs] == [StopReason.ENV_ERROR] * 2 and "Could not connect" in trajs[0].error


async def test_episodes_run_without_a_key_each_count_as_live_and_are_forgotten(tok) -> None:
    seen: list[int] = []

    class AllAtOnce(ScriptedSampler):
        """Holds every request until all three episodes are generating; the last one notes the live count."""

        async def generate(self, request):
            self.requests.append(request)
            if len(self.requests) == 3:
                seen.append(eng.live_episodes())
            while len(self.requests) < 3:
                await asyncio.sleep(0.01)
            return SampledSequence(self.tok.encode(add_answer(self.tok.decode(request.prompt_ids)),
                                                   add_special_tokens=False) + [self.tok.eos_token_id], [-0.5] * 2, "stop")

    eng = engine(AddEnv, AllAtOnce(tok, add_answer), tok)
    trajs = await asyncio.gather(*(eng.run_bounded(Task({"a": 1, "b": i})) for i in range(3)))
    assert [t.reward for t in trajs] == [1.0] * 3
    assert seen == [3]  # the sampler's demand signal counts every episode
    assert eng.states == {} and eng.live_episodes() == 0


def test_groups_keep_only_complete_groups_and_can_drop_zero_variance() -> None:
    def traj(gid, reward, reason=StopReason.DONE):
        return Trajectory(task=Task({}, group_id=gid), reward=reward, stop_reason=reason)

    trajs = [traj(0, 1.0), traj(0, 0.0), traj(1, 1.0), traj(1, 1.0), traj(2, 1.0), traj(2, 0.0, StopReason.ENV_ERROR),
             traj(3, 0.0)]
    batch = build_groups(trajs, 2)
    assert [g[0].group_id for g in batch.groups] == [0, 1]
    assert batch.incomplete_groups == 2 and batch.infra_failures == 1
    filtered = build_groups(trajs, 2, filter_zero_variance=True)
    assert [g[0].group_id for g in filtered.groups] == [0] and filtered.zero_variance_groups == 1
    assert filtered.metrics()["stop/env_error"] == pytest.approx(1 / 7)


async def test_hf_sampler_batches_concurrent_episodes_into_few_generate_calls() -> None:
    torch.manual_seed(0)
    model, tok = load_policy(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                         intermediate_size=64))
    sampler = HFSampler(model, tok)
    trajs = await engine(AddEnv, sampler, tok, max_tokens_per_turn=6).run(make_tasks([{"seed": i} for i in range(8)], 4))
    assert len(trajs) == 32 and all(t.stop_reason is StopReason.DONE for t in trajs)
    assert sampler.calls <= 2 and sampler.sequences == 32
    for t in trajs:
        n = t.num_policy_tokens
        assert 1 <= n <= 6 and t.mask[-n:] == [1] * n and sum(t.mask[:-n]) == 0
        assert all(lp <= 0 for lp in t.logprobs[-n:])
    # The recorded log-probs are the model's own (temperature 1): recompute one trajectory.
    t = trajs[0]
    with torch.no_grad():
        logits = model(torch.tensor([t.tokens])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t.tokens[1:])[:, None])[:, 0]
    n = t.num_policy_tokens
    assert torch.allclose(lp[-n:], torch.tensor(t.logprobs[-n:]), atol=1e-4)


async def test_configured_system_prompt_can_replace_the_envs(tok) -> None:
    eng = engine(AddEnv, ScriptedSampler(tok, add_answer), tok, system_prompt="Sum.", use_env_system_prompt=False)
    [traj] = await eng.run([Task({"a": 1, "b": 2})])
    assert tok.decode(traj.tokens[:traj.prompt_len]).startswith("<|im_start|>system\nSum.<|im_end|>")
    [traj] = await engine(AddEnv, ScriptedSampler(tok, add_answer), tok, system_prompt="Sum.").run([Task({"a": 1})])
    assert tok.decode(traj.tokens[:traj.prompt_len]).startswith("<|im_start|>system\nAdd.<|im_end|>")


async def test_a_history_window_prompts_each_turn_afresh_with_the_newest_observation(tok) -> None:
    replies = iter(["3", "2", "1"])
    sampler = ScriptedSampler(tok, lambda p: next(replies))
    [traj] = await engine(CountdownEnv, sampler, tok, max_turns=5, system_prompt="Be brief.",
                          history_turns=0).run([Task({})])
    assert traj.stop_reason is StopReason.DONE and traj.turn_rewards == [0.5, 0.5, 0.5]
    windows = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
               for text in ("Count down from 3.", "next: 2", "next: 1")]
    prompts = [tok.apply_chat_template(w, tokenize=False, add_generation_prompt=True) for w in windows]
    # the sampler saw each turn's window alone, and the record holds one sequence per turn
    assert [tok.decode(r.prompt_ids) for r in sampler.requests] == prompts
    spans = [span for span, _ in traj.segments()]
    assert [tok.decode(traj.tokens[s]) for s in spans] == [p + f"{n}<|im_end|>" for p, n in zip(prompts, "321")]
    assert [s.start for s in spans[1:]] == [start for start, _ in traj.segment_starts]
    assert [traj.tokens[i] for i in traj.turn_ends] == [tok.eos_token_id] * 3
    assert policy_text(tok, traj) == "3<|im_end|>2<|im_end|>1<|im_end|>"
    assert traj.to_record()["segment_starts"] == [s.start for s in spans[1:]]


async def test_a_window_of_one_turn_keeps_the_last_reply_and_the_observation_before_it(tok) -> None:
    replies = iter(["3", "2", "1"])
    sampler = ScriptedSampler(tok, lambda p: next(replies))
    await engine(CountdownEnv, sampler, tok, max_turns=5, history_turns=1).run([Task({})])
    third = [{"role": "user", "content": "next: 2"}, {"role": "assistant", "content": "2"},
             {"role": "user", "content": "next: 1"}]
    assert tok.decode(sampler.requests[2].prompt_ids) == tok.apply_chat_template(third, tokenize=False,
                                                                                add_generation_prompt=True)


async def test_the_context_limit_counts_the_window_not_the_whole_episode(tok) -> None:
    replies = iter(["3", "2", "1"])
    whole = await engine(CountdownEnv, ScriptedSampler(tok, lambda p: next(replies)), tok, max_turns=5,
                         max_context_tokens=150).run([Task({})])
    replies = iter(["3", "2", "1"])
    windowed = await engine(CountdownEnv, ScriptedSampler(tok, lambda p: next(replies)), tok, max_turns=5,
                            max_context_tokens=150, history_turns=0).run([Task({})])
    assert whole[0].stop_reason is StopReason.TOKEN_LIMIT
    assert windowed[0].stop_reason is StopReason.DONE and windowed[0].num_turns == 3


def test_history_turns_is_unset_or_a_count() -> None:
    for bad in (-1, 1.5, True, "0"):
        with pytest.raises(ValueError, match="history_turns"):
            RolloutConfig(history_turns=bad)  # type: ignore[arg-type]
    assert RolloutConfig(history_turns=0).history_turns == 0
