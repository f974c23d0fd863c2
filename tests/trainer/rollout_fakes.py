"""Fakes for rollout tests: small envs (text, multi-turn, tools, failing) and a scripted policy."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Annotated

from envhub import Env, Observation, StepResult, tool
from trainer.sampling import GenRequest, SampledSequence


class AddEnv(Env):
    """Single-turn text env: answer ``a+b``; reward 1 for the right number."""

    def reset(self, seed=None, a: int | None = None, b: int | None = None):
        self.a = self.rng.randint(0, 9) if a is None else a
        self.b = self.rng.randint(0, 9) if b is None else b
        return Observation(text=f"{self.a}+{self.b}=?", metadata={"system_prompt": "Add."})

    def on_text(self, text: str):
        right = text.strip() == str(self.a + self.b)
        return StepResult(observation=Observation(text="correct" if right else "wrong"), reward=float(right), done=True)


class CountdownEnv(Env):
    """Multi-turn text env: say the numbers 3, 2, 1 in order (0.5 per right turn); done after 1."""

    def reset(self, seed=None):
        self.next = 3
        return Observation(text="Count down from 3.")

    def on_text(self, text: str):
        right = text.strip() == str(self.next)
        self.next -= 1 if right else 0
        return StepResult(observation=Observation(text=f"next: {self.next}"), reward=0.5 * right,
                          done=self.next == 0)


class CalcEnv(Env):
    """Tool env: call ``add(x, y)`` and then answer the sum of 2 and 5 in text."""

    def reset(self, seed=None):
        return Observation(text="Use the add tool to add 2 and 5, then answer.")

    @tool
    def add(self, x: Annotated[int, "first"], y: Annotated[int, "second"]) -> str:
        """Add two integers."""
        return str(x + y)

    def on_text(self, text: str):
        return StepResult(observation=Observation(text="bye"), reward=float("7" in text), done=True)


class CrashEnv(Env):
    """Its step raises: the env side fails, not the policy."""

    def reset(self, seed=None):
        return Observation(text="hi")

    def on_text(self, text: str):
        raise RuntimeError("disk on fire")


class SlowEnv(Env):
    """Async step that takes a while (for timeouts)."""

    def reset(self, seed=None):
        return Observation(text="wait")

    async def on_text(self, text: str):
        await asyncio.sleep(5)
        return StepResult(done=True)


class ScriptedSampler:
    """A policy fake: ``respond(prompt_text) -> reply text``; the reply is encoded + EOS, log-prob -0.5 per id."""

    def __init__(self, tokenizer, respond: Callable[[str], str], *, eos: bool = True):
        self.tok, self.respond, self.eos = tokenizer, respond, eos
        self.version = 0
        self.requests: list[GenRequest] = []

    def update_weights(self, model, version: int) -> None:
        self.version = version

    async def generate(self, request: GenRequest) -> SampledSequence:
        self.requests.append(request)
        await asyncio.sleep(0)
        text = self.respond(self.tok.decode(request.prompt_ids))
        ids = self.tok.encode(text, add_special_tokens=False) + ([self.tok.eos_token_id] if self.eos else [])
        finish = "stop"
        if len(ids) > request.max_new_tokens:
            ids, finish = ids[:request.max_new_tokens], "length"
        return SampledSequence(ids, [-0.5] * len(ids), finish)


def add_answer(prompt: str) -> str:
    """The right answer to the last ``a+b=?`` in the prompt."""
    a, b = re.findall(r"(\d+)\+(\d+)=\?", prompt)[-1]
    return str(int(a) + int(b))


def wait_until(pred: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.02)
