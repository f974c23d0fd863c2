"""Token-exact chat rendering for rollouts: the first prompt, then observation ids appended after each turn.

The assistant's turn is never re-rendered: its sampled ids are the record. What comes between
two assistant turns (``<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``,
or tool responses inside a user turn) is cut out of the chat template's own output with a
fixed-base render: render a fixed conversation, render it again with the new messages and the
generation prompt, and keep the difference. That follows whatever the template does, without
assuming its text.
"""

from __future__ import annotations

from typing import Any

_BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]


class ChatRenderer:
    """Renders prompts and between-turn observations as token ids with one tokenizer and its chat template."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.eos_text = tokenizer.convert_ids_to_tokens(self.eos_id)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict] | None, gen_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=gen_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        """The first prompt: the rendered conversation plus the assistant generation prompt."""
        return self.encode(self._render(messages, tools, True))

    def observation_text(self, new_messages: list[dict[str, Any]], tools: list[dict] | None = None) -> str:
        """The text that follows an assistant turn's EOS up to the next generation prompt."""
        base = self._render(_BASE, tools, False)
        full = self._render(_BASE + new_messages, tools, True)
        if not full.startswith(base):
            raise ValueError("The chat template is not prefix-preserving: rendering more messages changed the "
                             "earlier text, so observations cannot be appended token-exactly. Use a template "
                             "that renders earlier turns identically.")
        end = base.rfind(self.eos_text)
        if end < 0:
            raise ValueError(f"Expected the chat template to end assistant turns with {self.eos_text!r}; "
                             "set tokenizer.eos_token to the turn terminator.")
        return base[end + len(self.eos_text):] + full[len(base):]

    def observation_ids(self, new_messages: list[dict[str, Any]], tools: list[dict] | None = None, *,
                        after_eos: bool = True) -> list[int]:
        """Ids to append after a turn; ``after_eos=False`` (turn cut off) closes the turn with EOS first."""
        ids = self.encode(self.observation_text(new_messages, tools))
        return ids if after_eos else [self.eos_id, *ids]


__all__ = ["ChatRenderer"]
