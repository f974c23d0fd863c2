"""The chat model ``envhub eval --model`` names: an OpenAI-compatible URL, or a local model from an entry point.

``http(s)://...`` is an OpenAI-compatible base URL (usually ending in ``/v1``), spoken to with
httpx. Anything else is a local model (``tiny``, a path to a Hugging Face model directory), run
by the chat model an installed distribution registers in the ``envhub.chat_models`` entry-point
group under ``local`` (envhub's own trainer registers one: ``pip install envhub[train]``). envhub
never imports the trainer itself: the entry point is the only link.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envhub.chat import ChatCompletionsClient, ChatModel
from envhub.registry import group_entry_points

GROUP = "envhub.chat_models"
LOCAL = "local"


@dataclass
class ModelOptions:
    """Generation settings every kind of model takes."""

    max_tokens: int = 1024
    temperature: float = 1.0
    seed: int = 0
    model_name: str | None = None
    api_key: str | None = None
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= 1_000_000:
            raise ValueError(f"Expected --max-tokens in 1..1000000, got {self.max_tokens}.")
        if not 0 <= self.temperature <= 10:
            raise ValueError(f"Expected --temperature in 0..10 (0: greedy), got {self.temperature}.")


def is_url(model: str) -> bool:
    """True when ``model`` is an OpenAI-compatible base URL rather than a local model."""
    return model.startswith(("http://", "https://"))


def check_model_path(model: str) -> None:
    """A ``--model`` written as a path (``/``, ``./``, ``../``, ``~``) must be a directory: ValueError otherwise,
    rather than the Hugging Face hub's complaint about a repository id (``EvalConfig`` checks it, before any work)."""
    if model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().is_dir():
        raise ValueError(f"Expected --model to be a Hugging Face model directory, `tiny` or an http(s):// URL, got "
                         f"{model!r}, which is not a directory.")


def load_chat_model(model: str, options: ModelOptions) -> ChatModel:
    """The :class:`~envhub.chat.ChatModel` for ``--model``: an endpoint client, or the registered local model."""
    if is_url(model):
        return ChatCompletionsClient(model, model=options.model_name or "default", api_key=options.api_key,
                                     timeout_s=options.timeout_s, max_tokens=options.max_tokens,
                                     temperature=options.temperature, seed=options.seed)
    factory = _local_factory()
    chat_model: ChatModel = factory(model, max_tokens=options.max_tokens, temperature=options.temperature,
                                    seed=options.seed)
    return chat_model


def _local_factory() -> Any:
    found = [(ep, dist) for ep, dist in group_entry_points(GROUP) if ep.name == LOCAL]
    if not found:
        raise ValueError(f"Expected --model to be an http(s):// OpenAI-compatible URL, or a local model run by a chat "
                         f"model registered as {LOCAL!r} in the {GROUP!r} entry-point group; none is installed "
                         "(pip install 'envhub[train]' provides one).")
    if len(found) > 1:
        names = "; ".join(f"{dist.metadata['Name']} ({ep.value})" for ep, dist in found)
        raise ValueError(f"{len(found)} distributions register the chat model {LOCAL!r}: {names}. Uninstall one.")
    ep, dist = found[0]
    try:
        return ep.load()
    except Exception as exc:  # a third-party module failing to import is that entry's problem, said clearly
        raise ImportError(f"the chat model {LOCAL!r} = {ep.value!r} (registered by {dist.metadata['Name']}) failed to "
                          f"import: {type(exc).__name__}: {exc}") from exc


__all__ = ["GROUP", "ModelOptions", "check_model_path", "is_url", "load_chat_model"]
