"""adapters.trl: environment_factory classes against live envhub servers, and a couple of GRPOTrainer steps on CPU."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from adapters.trl import EnvhubEnvironment, EnvhubTextEnvironment, environment_factory, grpo_kwargs, text_answer_reward
from env_servers.math_env import MathEnv
from envhub import Env, Observation, StepResult
from envhub.server import ServerThread, create_app
from envhub.settings import Settings

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.guess_env import GuessEnv

pytestmark = pytest.mark.live
QUIET = Settings(log_level="warning")


def _public_functions(cls: type) -> list[str]:
    # What GRPOTrainer turns into tools: public functions of the class, minus reset and get_reward.
    return sorted(n for n, _ in inspect.getmembers(cls, inspect.isfunction)
                  if not n.startswith("_") and n not in ("reset", "get_reward"))


def _bisect(env: EnvhubEnvironment) -> list[str]:
    low, high, replies = 1, 100, []
    while not replies or replies[-1] not in ("Correct!",):
        number = (low + high) // 2
        replies.append(env.guess(number=number))
        low, high = (number + 1, high) if replies[-1] == "Higher." else (low, number - 1)
    return replies


@pytest.mark.slow  # imports transformers
def test_tool_env_exposes_remote_tools_with_the_servers_schema() -> None:
    from transformers.utils import get_json_schema

    with ServerThread(create_app(GuessEnv, settings=QUIET)) as server:
        cls = environment_factory(server.url)
        assert issubclass(cls, EnvhubEnvironment) and _public_functions(cls) == ["guess"]
        assert cls.__name__ == "GuessEnv"
        env = cls()
        (spec,) = GuessEnv.tools()
        schema = get_json_schema(env.guess)["function"]
        assert schema["name"] == "guess" and schema["description"] == spec.description
        assert schema["parameters"]["required"] == ["number"]
        assert schema["parameters"]["properties"]["number"]["type"] == "integer"
        assert env.reset(seed=3, prompt=[{"role": "user", "content": ""}]).startswith("I picked a number")
        replies = _bisect(env)
        assert len(replies) <= 7 and env.get_reward() == 1.0
        assert env.guess(number=1).startswith("Error: the episode has ended")
        env.reset(seed=4)  # the same instance plays the next rollout (TRL pools instances)
        assert env.get_reward() == 0.0
        env._close()


def test_an_outage_gives_no_reward_instead_of_zero() -> None:
    server = ServerThread(create_app(GuessEnv, settings=QUIET)).start()
    env = environment_factory(server.url, message_timeout_s=5)()
    env.reset(seed=0)
    server.stop()
    reply = env.guess(number=50)
    assert reply.startswith("Error: environment failure")
    assert env.get_reward() is None


def test_text_env_submits_the_completion_and_returns_the_env_reward() -> None:
    with ServerThread(create_app(MathEnv, settings=QUIET)) as server:
        kwargs = grpo_kwargs(server.url, task={"problem": "What is 1 + 1?", "answer": "2"})
        cls = kwargs["environment_factory"]
        assert issubclass(cls, EnvhubTextEnvironment) and kwargs["reward_funcs"] == [text_answer_reward]
        assert _public_functions(cls) == []
        envs = [cls(), cls(), cls()]
        for env in envs:
            assert "1 + 1" in env.reset(prompt="ignored", seed=0)
        completions = [[{"role": "assistant", "content": "so \\boxed{2}"}], "\\boxed{3}", [{"role": "assistant"}]]
        rewards = text_answer_reward(completions, environments=envs)
        assert rewards[0] > rewards[1] and rewards[0] > 0
        assert rewards == [e._env.episode_reward for e in envs]
        with pytest.raises(ValueError, match="Expected GRPOTrainer to pass `environments`"):
            text_answer_reward(["x"])


def test_a_tool_env_can_be_forced_to_text_mode_and_bad_modes_fail() -> None:
    with ServerThread(create_app(MathEnv, settings=QUIET)) as server:
        with pytest.raises(ValueError, match="publish tools for mode='tools'"):
            environment_factory(server.url, mode="tools")
    with pytest.raises(ValueError, match="Expected mode"):
        environment_factory("ws://127.0.0.1:1", mode="both")  # type: ignore[arg-type]


class _Message(BaseModel):
    message: str


class _MessageEnv(Env):
    """Takes ``{"message": ...}``, like an OpenEnv echo env: no ``text`` field, no tools; rewards "HELLO"."""

    action_model = _Message

    def reset(self, seed: int | None = None) -> Observation:
        return Observation(text="say hello, loudly")

    def step(self, action: _Message) -> StepResult:
        return StepResult(Observation(text=action.message), reward=float(action.message == "HELLO"), done=True)


class _Move(BaseModel):
    row: str
    col: str


class _MoveEnv(_MessageEnv):
    action_model = _Move  # two string fields: which one would the completion go into?


def test_a_text_env_whose_action_has_one_string_field_gets_the_completion_there() -> None:
    with ServerThread(create_app(_MessageEnv, settings=QUIET)) as server:
        env_cls = environment_factory(server.url)
        env = env_cls()
        env.reset(seed=0)
        assert env_cls.text_field == "message" and text_answer_reward([[{"role": "assistant", "content": "HELLO"}]], [env]) == [1.0]
    with ServerThread(create_app(_MoveEnv, settings=QUIET)) as server:
        with pytest.raises(ValueError, match=r"free-text action .* the fields \['col', 'row'\]"):
            environment_factory(server.url)


def _tiny_qwen2(tok, model_cls=None):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    return (model_cls or Qwen2ForCausalLM)(config)


def _train(app, model, tok, tmp_path: Path, *, steps: int, num_generations: int, max_completion_length: int):
    """GRPO on the CPU against ``app`` served on a loopback port (rows: seeds 1, 2, ...)."""
    import trl

    from adapters.trl import seed_dataset

    with ServerThread(app) as server:
        args = trl.GRPOConfig(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4,
                              num_generations=num_generations, max_completion_length=max_completion_length,
                              learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True,
                              save_strategy="no", seed=0)
        trainer = trl.GRPOTrainer(model=model, args=args, train_dataset=seed_dataset(8, start=1),
                                  processing_class=tok, **grpo_kwargs(server.url))
        trainer.train()
    return trainer


@pytest.mark.slow
def test_grpo_trainer_trains_two_steps_against_the_math_server(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("trl")
    from trainer.tokenizer import build_tiny_tokenizer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tok = build_tiny_tokenizer()
    # A missing \boxed{} answer scores -1 here, so the logged reward can only have come from the env.
    app = create_app(MathEnv, settings=QUIET, no_answer_reward=-1.0)
    trainer = _train(app, _tiny_qwen2(tok), tok, tmp_path, steps=2, num_generations=4, max_completion_length=8)
    metrics = app.state.hub.metrics
    assert trainer.state.global_step == 2
    assert metrics.resets_total == metrics.steps_total == 8  # 2 steps x 4 rollouts, one answer each
    logged = [r for r in trainer.state.log_history if "rewards/text_answer_reward/mean" in r]
    assert len(logged) == 2 and all(r["rewards/text_answer_reward/mean"] == -1.0 for r in logged)


def _scripted_turn(text: str, rollout: int) -> str:
    """The scripted policy's next assistant turn: bisect the guessing game, or (odd rollouts) give up at once."""
    low, high = 1, 100
    turns = re.findall(r'"number": (\d+)\}\}\n</tool_call>.*?<tool_response>\n(.*?)\n</tool_response>', text, re.S)
    if not turns and rollout % 2:
        return "I give up.<|im_end|>"
    for number, reply in turns:
        if reply == "Correct!":
            return "Solved.<|im_end|>"
        low, high = (int(number) + 1, high) if reply == "Higher." else (low, int(number) - 1)
    return '<tool_call>\n{"name": "guess", "arguments": {"number": %d}}\n</tool_call><|im_end|>' % ((low + high) // 2)


@pytest.mark.slow
def test_grpo_trainer_runs_the_tool_loop_against_a_tool_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("trl")
    import torch
    from transformers import Qwen2ForCausalLM
    from trl.chat_template_utils import qwen2_5_chat_template

    from trainer.tokenizer import build_tiny_tokenizer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tok = build_tiny_tokenizer()
    tok.chat_template = qwen2_5_chat_template  # TRL parses tool calls for the templates it ships

    class ScriptedPolicy(Qwen2ForCausalLM):
        """A real Qwen2 for the loss; its ``generate`` plays :func:`_scripted_turn` (a fake policy)."""

        def generate(self, input_ids=None, attention_mask=None, **kwargs):
            rows = [tok.encode(_scripted_turn(tok.decode(ids[mask.bool()]), i))
                    for i, (ids, mask) in enumerate(zip(input_ids, attention_mask))]
            out = torch.full((len(rows), max(map(len, rows))), tok.pad_token_id, dtype=input_ids.dtype)
            for i, row in enumerate(rows):
                out[i, :len(row)] = torch.tensor(row)
            return torch.cat([input_ids, out], dim=1)

    model = _tiny_qwen2(tok, ScriptedPolicy)
    before = [p.detach().clone() for p in model.parameters()]
    app = create_app(GuessEnv, settings=QUIET)
    trainer = _train(app, model, tok, tmp_path, steps=1, num_generations=2, max_completion_length=1024)
    (log,) = [r for r in trainer.state.log_history if "rewards/GuessEnv/mean" in r]
    # Seeds 1 and 2 hide 18 and 8: bisection takes 4 and 7 guesses; each group has one solver, one quitter.
    assert app.state.hub.metrics.steps_total == 4 + 7
    assert log["rewards/GuessEnv/mean"] == 0.5 and log["tools/call_frequency"] == (4 + 7) / 4
    assert log["tools/failure_frequency"] == 0.0
    assert log["grad_norm"] > 0 and any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
