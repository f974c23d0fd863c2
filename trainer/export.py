"""Export a policy to Hugging Face format: a plain model (LoRA merged) or the adapter alone.

Training state (weights, optimizer, RNG, the ``latest`` pointer) is the training core's:
:mod:`trainer.core.state`. This is the way out of envhub, to anything that reads ``save_pretrained``.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from torch import nn

from trainer.distributed import is_fsdp
from trainer.model import unwrap


def export_hf(model: nn.Module, tokenizer: Any, path: str | os.PathLike[str], *, merge_lora: bool = True) -> Path:
    """Write ``model`` (and ``tokenizer`` when it has ``save_pretrained``) in Hugging Face format.

    For a peft model, ``merge_lora=True`` saves a plain model with the adapter folded into the
    weights (on a copy: the training model keeps its adapter), ``merge_lora=False`` saves only the
    adapter (``adapter_config.json`` + weights), loadable with ``PeftModel.from_pretrained``.
    """
    if is_fsdp(model):
        raise TypeError("Expected an unsharded model, got an FSDP-sharded one; load the checkpoint into a plain "
                        "model in one process (TrainingClient(model, tok).load_state(trainer.core.resolve_checkpoint("
                        "run_dir), optimizer=False)) and export that.")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    inner = unwrap(model, peft=False)
    saved = _merged(inner) if merge_lora else inner
    save_pretrained = getattr(saved, "save_pretrained", None)
    if not callable(save_pretrained):
        raise TypeError(f"Expected a Hugging Face or peft model (with save_pretrained), got {type(saved).__name__}.")
    save_pretrained(out)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(out)
    return out


def _merged(model: nn.Module) -> nn.Module:
    """A copy of a peft ``model`` with its adapter folded into the weights; any other model itself."""
    try:
        from peft import PeftModel
    except ImportError:
        return model
    if not isinstance(model, PeftModel):
        return model
    copied = copy.deepcopy(model)
    _untie_lora_output_layer(copied)
    merged: nn.Module = copied.merge_and_unload()
    return merged


def _untie_lora_output_layer(model: Any) -> None:
    """Give a peft ``model``'s output layer its own copy of the weight it shares with the input embedding when
    the adapter covers it (``lm_head`` in ``lora_target_modules``): merging writes the adapter into that weight,
    and through the tie into the input embedding too, which the adapter never changed. The export is then
    saved untied (``tie_word_embeddings = False``)."""
    base = model.get_base_model()
    output, embedding = base.get_output_embeddings(), base.get_input_embeddings()
    layer = getattr(output, "base_layer", None)  # peft's LoRA layer wraps the output layer
    if layer is None or embedding is None or layer.weight is not embedding.weight:
        return
    layer.weight = nn.Parameter(layer.weight.detach().clone(), requires_grad=False)
    for config in (base.config, base.config.get_text_config()):
        config.tie_word_embeddings = False


__all__ = ["export_hf"]
