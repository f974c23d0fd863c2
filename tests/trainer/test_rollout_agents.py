"""Agents, typed observations and actions, action mappers and client-side tools in the rollout engine."""

from __future__ import annotations

import asyncio
from typing import Annotated

import pytest
from pydantic import BaseModel

import agents_fakes
from envhub import Env, Observation, StepResult, tool
from rollout_fakes import AddEnv, CalcEnv, ScriptedSampler
from trainer.rollout import (Agent, AnswerAgent, EnvPool, RolloutConfig, RolloutEngine, StopReason, Task,
                             ToolCallingAgent, load_agent_class)
from trainer.rollout.actions import from_action_schema, load_action_mapper
from trainer.tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def engine(env_cls, sampler, tok, *, pool_kw=None, engine_kw=None, **cfg) -> RolloutEngine:
    return RolloutEngine(EnvPool(env_cls=env_cls, **(pool_kw or {})), sampler, tok, RolloutConfig(**cfg),
                         **(engine_kw or {}))


def prompt_of(tok, traj) -> str:
    return tok.decode(traj.tokens[:traj.prompt_len])


def policy_text(tok, traj) -> str:
    return tok.decode([t for t, m in zip(traj.tokens, traj.mask) if m])


class EchoAction(BaseModel):
    message: str


class TypedEchoEnv(Env):
    """An OpenEnv-style env: typed action ``{"message"}``, typed observation fields and no ``text``."""

    action_model = EchoAction

    def reset(self, seed=None, **task):
        return Observation(echoed_message="say hi", message_length=0)

    def step(self, action):
        return StepResult(observation=Observation(echoed_message=action.message, message_length=len(action.message)),
                          reward=float(action.message == "hi"), done=True)


class MoveAction(BaseModel):
    """Place a stone."""

    row: int
    col: int


class GridEnv(Env):
    """A typed action with two fields: the model reaches it through a tool made from the action schema."""

    action_model = MoveAction

    def reset(self, seed=None, **task):
        return Observation(text="Place a stone at row 1, column 2.")

    def step(self, action):
        return StepResult(observation=Observation(text="ok"), reward=float((action.row, action.col) == (1, 2)),
                          done=True)


# -- observations and actions of any env ------------------------------------------------------------
async def test_typed_observation_reaches_the_prompt_and_text_maps_to_the_typed_action(tok) -> None:
    [traj] = await engine(TypedEchoEnv, ScriptedSampler(tok, lambda p: "hi"), tok).run([Task({})])
    assert '"echoed_message": "say hi"' in prompt_of(tok, traj)
    assert traj.stop_reason is StopReason.DONE and traj.reward == 1.0 and traj.failure is None


async def test_without_a_mapper_the_typed_env_refuses_every_reply_and_says_why(tok) -> None:
    [traj] = await engine(TypedEchoEnv, ScriptedSampler(tok, lambda p: "hi"), tok,
                          pool_kw={"action_mapper": "identity"}).run([Task({})])
    assert traj.stop_reason is StopReason.PARSE_ERROR and traj.failed
    assert traj.failure == "validation_error" and "message" in traj.failure_message


async def test_multi_field_action_becomes_a_tool_from_its_schema(tok) -> None:
    call = '<tool_call>\n{"name": "move_action", "arguments": {"row": 1, "col": 2}}\n</tool_call>'
    [traj] = await engine(GridEnv, ScriptedSampler(tok, lambda p: call), tok).run([Task({})])
    assert '"name": "move_action"' in prompt_of(tok, traj) and "Place a stone." in prompt_of(tok, traj)
    assert traj.reward == 1.0 and traj.tool_calls == 1


async def test_mapper_from_a_module_path_and_a_mapper_that_refuses(tok) -> None:
    sampler = ScriptedSampler(tok, lambda p: "hello")
    [traj] = await engine(TypedEchoEnv, sampler, tok, pool_kw={"action_mapper": "field:message"}).run([Task({})])
    assert traj.stop_reason is StopReason.DONE and traj.reward == 0.0
    [traj] = await engine(TypedEchoEnv, sampler, tok, pool_kw={"action_mapper": "arguments"}).run([Task({})])
    assert traj.failure == "validation_error" and "tool calls only" in traj.failure_message


def test_action_mapper_specs_and_errors() -> None:
    assert load_action_mapper("message")({"text": "x"}) == {"message": "x"}
    assert load_action_mapper("call_tool")({"tool_name": "f", "arguments": {"a": 1}}) == {
        "type": "call_tool", "tool_name": "f", "arguments": {"a": 1}}
    assert load_action_mapper("agents_fakes:lookup") is agents_fakes.lookup
    assert load_action_mapper("auto") is None
    with pytest.raises(ValueError, match="'auto', one of"):
        load_action_mapper("mesage")
    mapper, tools = from_action_schema({"properties": {"text": {}, "tool_name": {}, "arguments": {}}})
    assert mapper({"text": "x"}) == {"text": "x"} and tools == []
    with pytest.raises(ValueError, match="unknown-key|Unknown key"):
        from trainer.config import load_config
        load_config(None, ["env.action_mappr=message"])


# -- agents -------------------------------------------------------------------------------------------
async def test_user_agent_from_the_config_builds_prompts_from_history_and_maps_replies(tok) -> None:
    replies = iter(["I think 5", "so 5"])
    eng = engine(AddEnv, ScriptedSampler(tok, lambda p: next(replies)), tok,
                 agent="agents_fakes:LastWordAgent", agent_kwargs={"prefix": "One number:"})
    [traj] = await eng.run([Task({"a": 2, "b": 3})])
    assert prompt_of(tok, traj).count("One number: 2+3=?") == 1 and "Add." not in prompt_of(tok, traj)
    assert traj.reward == 1.0  # the env got "5", the reply's last word
    # whatever the agent does, the record is the sampled ids (mask 1) after the rendered prompt (mask 0)
    assert traj.mask == [0] * traj.prompt_len + [1] * (len(traj.tokens) - traj.prompt_len)
    assert policy_text(tok, traj) == "I think 5<|im_end|>"


def test_agent_names_and_errors() -> None:
    assert load_agent_class("answer") is AnswerAgent and load_agent_class("tools") is ToolCallingAgent
    assert load_agent_class("auto") is Agent
    with pytest.raises(ValueError, match="answer.*'package.module:Class'"):
        load_agent_class("chatty")
    with pytest.raises(ValueError, match="subclass of trainer.rollout.agents.Agent"):
        RolloutConfig(agent="agents_fakes:lookup")
    with pytest.raises(ValueError, match="Unknown tool parser"):
        RolloutConfig(tool_parser="hermez")


async def test_answer_agent_sends_tool_markup_as_text(tok) -> None:
    call = '<tool_call>\n{"name": "add", "arguments": {"x": 2, "y": 5}}\n</tool_call>'
    [traj] = await engine(CalcEnv, ScriptedSampler(tok, lambda p: call), tok, agent="answer").run([Task({})])
    assert "<tools>" not in prompt_of(tok, traj) and traj.tool_calls == 0
    assert traj.stop_reason is StopReason.DONE and traj.reward == 0.0  # the env read the markup as its answer


def test_observation_images_become_image_parts_only_when_wanted() -> None:
    obs = Observation(text="How many circles?", images=[b"\x89PNG-1", b"\x89PNG-2"])
    assert Agent(images=False).user_message(obs) == {"role": "user", "content": "How many circles?"}
    assert Agent(images=True).user_message(obs) == {"role": "user", "content": [
        {"type": "image", "image": b"\x89PNG-1"}, {"type": "image", "image": b"\x89PNG-2"},
        {"type": "text", "text": "How many circles?"}]}
    assert Agent(images=True).user_message(Observation(text="no picture"))["content"] == "no picture"


# -- client-side tools --------------------------------------------------------------------------------
async def test_client_side_tools_run_next_to_env_tools_concurrently(tok) -> None:
    agents_fakes.BARRIER = asyncio.Barrier(2)
    calls = ('<tool_call>\n{"name": "rendezvous", "arguments": {"name": "a"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"x": 2, "y": 5}}\n</tool_call>\n'
             '<tool_call>\n{"name": "rendezvous", "arguments": {"name": "b"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "lookup", "arguments": {"key": 3}}\n</tool_call>')
    replies = iter([calls, "7"])
    eng = engine(CalcEnv, ScriptedSampler(tok, lambda p: next(replies)), tok, max_turns=2,
                 client_tools=["agents_fakes:lookup"], engine_kw={"client_tools": [agents_fakes.rendezvous]})
    [traj] = await eng.run([Task({})])
    text = tok.decode(traj.tokens)
    assert '"name": "lookup"' in prompt_of(tok, traj) and '"name": "rendezvous"' in prompt_of(tok, traj)
    responses = [part.split("</tool_response>")[0].strip() for part in text.split("<tool_response>")[1:]]
    assert responses[:3] == ["met a", "7", "met b"]  # in call order; the two rendezvous met, so they overlapped
    assert "invalid arguments for tool 'lookup'" in responses[3]
    assert traj.tool_calls == 4 and traj.reward == 1.0 and traj.stop_reason is StopReason.DONE


def test_client_tool_names_must_be_unique_and_paths_valid(tok) -> None:
    with pytest.raises(ValueError, match="Two client-side tools are named 'lookup'"):
        engine(AddEnv, None, tok, client_tools=["agents_fakes:lookup"], engine_kw={"client_tools": [agents_fakes.lookup]})
    with pytest.raises(ValueError, match="like 'my_pkg.tools:lookup'"):
        engine(AddEnv, None, tok, client_tools=["lookup"])


class ShadowEnv(CalcEnv):
    @tool
    def lookup(self, key: Annotated[str, "k"]) -> str:
        """Env lookup."""
        return key


async def test_a_client_tool_shadowing_an_env_tool_is_refused(tok) -> None:
    with pytest.raises(ValueError, match="have the names of env tools"):
        await engine(ShadowEnv, ScriptedSampler(tok, lambda p: "x"), tok,
                     client_tools=["agents_fakes:lookup"]).run([Task({})])


# -- tool-call formats through the engine ------------------------------------------------------------
async def test_mistral_calls_keep_their_special_marker_tokens_when_decoded(tok) -> None:
    mistral_tok = build_tiny_tokenizer()
    mistral_tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    reply = '[TOOL_CALLS]add[ARGS]{"x": 2, "y": 5}'
    assert mistral_tok.decode(mistral_tok.encode(reply, add_special_tokens=False), skip_special_tokens=True) \
        == 'add{"x": 2, "y": 5}'  # what a plain decode would leave the parser
    replies = iter([reply, "7"])
    eng = engine(CalcEnv, ScriptedSampler(mistral_tok, lambda p: next(replies)), mistral_tok, max_turns=2,
                 tool_parser="auto", engine_kw={"model_name": "mistralai/Ministral-8B-Instruct-2410"})
    [traj] = await eng.run([Task({})])
    assert traj.tool_calls == 1 and traj.parse_errors == 0 and traj.reward == 1.0
    assert "<tool_response>\n7\n</tool_response>" in mistral_tok.decode(traj.tokens)


async def test_qwen3_coder_calls_run_with_arguments_typed_by_the_env_schema(tok) -> None:
    call = "<tool_call>\n<function=add>\n<parameter=x>\n2\n</parameter>\n<parameter=y>\n5\n</parameter>\n</function>\n</tool_call>"
    replies = iter([call, "7"])
    [traj] = await engine(CalcEnv, ScriptedSampler(tok, lambda p: next(replies)), tok, max_turns=2,
                          tool_parser="qwen3_coder").run([Task({})])
    assert traj.tool_calls == 1 and traj.parse_errors == 0 and traj.reward == 1.0
    assert "<tool_response>\n7\n</tool_response>" in tok.decode(traj.tokens)


async def test_malformed_calls_are_parse_failures_and_an_episode_of_them_failed(tok) -> None:
    bad = "<tool_call>\n<function=add>\n<parameter=x>\n2\n</parameter>\n</tool_call>"
    [traj] = await engine(CalcEnv, ScriptedSampler(tok, lambda p: bad), tok, max_turns=2,
                          tool_parser="qwen3_coder").run([Task({})])
    assert traj.parse_errors == 2 and traj.failed_turns == 2 and traj.failed
    assert traj.failure == "parse_error" and "not closed" in traj.failure_message
    assert "Error: <function=add> is not closed" in tok.decode(traj.tokens)
