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
    merged: nn.Module = copy.deepcopy(model).merge_and_unload()
    return merged


__all__ = ["export_hf"]
