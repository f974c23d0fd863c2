"""Token-exact chat rendering for rollouts: the first prompt, then observation ids appended after each turn.

The assistant's turn is never re-rendered: its sampled ids are the record. What comes between
two assistant turns (``<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``,
or tool responses inside a user turn) is cut out of the chat template's own output with a
fixed-base render: render a fixed conversation, render it again with the new messages and the
generation prompt, and keep the difference. That follows whatever the template does, without
assuming its text.

Images: message contents may be lists of parts (``{"type": "image", "image": png_bytes}``,
``{"type": "text", "text": ...}``). With a :class:`~trainer.vision.VisionProcessor` each image
becomes :class:`~trainer.vision.ImageFeatures` and its placeholder is expanded to the image's
token count (:meth:`ChatRenderer.prompt`, :meth:`ChatRenderer.observation`); without one (a
text-only policy) image parts are dropped and the text parts joined.
"""

from __future__ import annotations

from typing import Any

from trainer.vision import VisionProcessor, images_in, text_only

_BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]


class ChatRenderer:
    """Renders prompts and between-turn observations as token ids with one tokenizer and its chat template."""

    def __init__(self, tokenizer: Any, vision: VisionProcessor | None = None):
        self.tokenizer = tokenizer
        self.vision = vision
        self.eos_id = int(tokenizer.eos_token_id)
        self.eos_text = tokenizer.convert_ids_to_tokens(self.eos_id)

    @property
    def supports_images(self) -> bool:
        """True when image parts of messages reach the policy (agents then put observation images in them)."""
        return self.vision is not None

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen_prompt: bool) -> str:
        if self.vision is None:
            messages = text_only(messages)
        text: str = self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                       add_generation_prompt=gen_prompt)
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The first prompt's ids (see :meth:`prompt` for the images behind its placeholders)."""
        return self.prompt(messages, tools)[0]

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[Any]]:
        """The first prompt: the rendered conversation plus the assistant generation prompt, and its images."""
        return self._with_images(self.encode(self._render(messages, tools, True)), messages)

    def _with_images(self, ids: list[int], messages: list[dict[str, Any]]) -> tuple[list[int], list[Any]]:
        if self.vision is None:
            return ids, []
        images = self.vision.features(images_in(messages))
        return self.vision.expand(ids, images), images

    def observation_text(self, new_messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
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

    def observation_ids(self, new_messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                        after_eos: bool = True) -> list[int]:
        """Ids to append after a turn (see :meth:`observation` for the images behind their placeholders)."""
        return self.observation(new_messages, tools, after_eos=after_eos)[0]

    def observation(self, new_messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                    after_eos: bool = True) -> tuple[list[int], list[Any]]:
        """Ids to append after a turn, and their images; ``after_eos=False`` (turn cut off) closes the turn
        with EOS first."""
        ids, images = self._with_images(self.encode(self.observation_text(new_messages, tools)), new_messages)
        return (ids if after_eos else [self.eos_id, *ids]), images


__all__ = ["ChatRenderer"]
