"""A tokenizer built locally, nothing downloaded: byte-level, no merges, Qwen2.5 chat template and special tokens.

The tiny CPU policy uses it so that tests and the quick start take the same code path as a real
Qwen2.5 model: a ``transformers.PreTrainedTokenizerFast`` with ChatML turns (``<|im_start|>``,
``<|im_end|>``), the Hermes tool-call tokens (``<tool_call>``, ``</tool_call>``,
``<tool_response>``, ``</tool_response>``, added but non-special as in Qwen2.5) and the Qwen2.5
chat template. Every byte is one token, so digits, operators and unicode all round-trip.

``build_tiny_tokenizer(vision=True)`` adds the Qwen2-VL vision tokens (``<|vision_start|>``,
``<|vision_end|>``, ``<|vision_pad|>``, ``<|image_pad|>``, ``<|video_pad|>``, special as in Qwen2-VL)
and a chat template whose message contents may also be lists of parts
(``{"type": "image", "image": ...}``, ``{"type": "text", "text": ...}``): each image renders as
``<|vision_start|><|image_pad|><|vision_end|>``, the single placeholder the image processor's grid
later expands (:mod:`trainer.vision`).

>>> tok = build_tiny_tokenizer()
>>> tok.decode(tok.encode("12+3"))
'12+3'
>>> tok.convert_ids_to_tokens(tok.encode("<|im_end|>"))
['<|im_end|>']
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_PAD_TOKEN = "<|image_pad|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# The Qwen2.5 Instruct template (same rendering, including tools and tool responses inside a user turn).
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# Message contents as a string or a list of parts, the way Qwen2-VL's template renders them.
_CONTENT_MACRO = (
    "{%- macro content_text(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part.type == 'video' or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}{{- part.text -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)


def _vision_template(template: str) -> str:
    # The Qwen2.5 template (tools included) with every content rendered through the macro above.
    out = _CONTENT_MACRO + template
    for old in ("messages[0]['content']", "message.content"):
        out = out.replace("+ " + old + " +", "+ content_text(" + old + ") +")
        out = out.replace("+ " + old + " }}", "+ content_text(" + old + ") }}")
        out = out.replace("{{- " + old + " }}", "{{- content_text(" + old + ") }}")
    return out


QWEN25_VL_CHAT_TEMPLATE = _vision_template(QWEN25_CHAT_TEMPLATE)


def _bytes_to_unicode() -> dict[int, str]:
    # The GPT-2 byte-level map that the ByteLevel pre-tokenizer uses: printable bytes stay, the rest shift to 256+n.
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b], n = chr(256 + n), n + 1
    return chars


@lru_cache(maxsize=2)
def _tokenizer_json(vision: bool = False) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    if vision:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    return tok.to_str()


def build_tiny_tokenizer(vision: bool = False) -> PreTrainedTokenizerFast:
    """The shipped byte-level tokenizer as a ``PreTrainedTokenizerFast`` (vocabulary of 263 ids, 268 with vision).

    Byte ``b`` has id ``b``; then ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos)
    and the four tool-call tokens; with ``vision`` the five Qwen2-VL vision tokens follow (ids 263-267)
    and the chat template renders image parts as placeholders.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(vision)),
                                  eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, padding_side="left",
                                  model_max_length=4096)
    tok.chat_template = QWEN25_VL_CHAT_TEMPLATE if vision else QWEN25_CHAT_TEMPLATE
    return tok


__all__ = ["build_tiny_tokenizer", "QWEN25_CHAT_TEMPLATE", "QWEN25_VL_CHAT_TEMPLATE", "SPECIAL_TOKENS",
           "TOOL_TOKENS", "VISION_TOKENS", "IMAGE_PAD_TOKEN", "EOS_TOKEN", "PAD_TOKEN"]
