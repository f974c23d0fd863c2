"""Checkpoints that resume exactly, and export to Hugging Face format.

Layout of a run directory::

    run_dir/
      latest                 # text: name of the newest complete checkpoint
      step_00000012/
        model.pt             # full state dict, or only the LoRA adapter for a peft model
        optimizer.pt
        scheduler.pt         # when a scheduler was given
        value_head.pt ...    # one state dict per extra module given (``modules={"value_head": head}``)
        rng_rank0.pt ...     # python, numpy, torch CPU and CUDA generator states, one file per rank
        meta.json            # step, data_cursor, extra, world_size

A checkpoint is written into a hidden temporary directory and renamed into place, then ``latest`` is
replaced atomically, so a crash mid-save leaves the previous checkpoint intact and ``latest`` valid.
Under ``torchrun`` every rank calls :func:`save_checkpoint` (each saves its own RNG state); rank 0
writes the rest. DDP models are unwrapped; FSDP (``fully_shard``) models are gathered into full
weights on rank 0 (every rank must call) and re-sharded on load.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from trainer.model import unwrap

LATEST = "latest"


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    data_cursor: Any,
    extra: dict[str, Any] | None = None,
    scheduler: Any = None,
    keep_last: int | None = None,
    modules: dict[str, nn.Module] | None = None,
) -> Path:
    """Save everything needed to resume exactly into ``path/step_<step>``; returns that directory.

    ``data_cursor`` and ``extra`` must be JSON-serialisable. ``keep_last`` deletes older checkpoints.
    ``modules`` are further trained modules outside ``model`` whose parameters ``optimizer`` updates
    too (e.g. PPO's value head), saved as ``<name>.pt``; pass the same names to :func:`load_checkpoint`.
    """
    run_dir = Path(path)
    modules = _check_module_names(modules)
    rank, world_size = _rank_world()
    meta = {"step": int(step), "data_cursor": data_cursor, "extra": extra or {}, "world_size": world_size}
    meta_text = _json_or_raise(meta)
    final = run_dir / f"step_{int(step):08d}"
    tmp = run_dir / f".tmp_step_{int(step):08d}"
    # gathering an FSDP model's full state is a collective: every rank takes part, rank 0 keeps it
    model_state, optim_state = _model_state(model), _optimizer_state(model, optimizer)
    module_states = {name: _plain_state(module) for name, module in modules.items()}
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        torch.save(model_state, tmp / "model.pt")
        torch.save(optim_state, tmp / "optimizer.pt")
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        for name, state in module_states.items():
            torch.save(state, tmp / f"{name}.pt")
        (tmp / "meta.json").write_text(meta_text)
    _barrier()
    if rank == 0:
        _publish(tmp, final, run_dir)
        if keep_last:
            _prune(run_dir, keep_last)
    _barrier()
    return final


def load_checkpoint(
    path: str | os.PathLike[str], *, model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any = None,
    modules: dict[str, nn.Module] | None = None,
) -> dict[str, Any]:
    """Restore weights (or adapter), optimizer, scheduler, extra ``modules`` and this rank's RNG states
    (a rank the checkpoint holds none for, on resuming with more ranks, keeps its own).

    ``path`` is a checkpoint directory or a run directory (its ``latest`` checkpoint is used).
    ``modules`` names the extra modules given to :func:`save_checkpoint`; each must be in the checkpoint.
    Returns ``{"step", "data_cursor", "extra"}``.
    """
    ckpt = resolve_checkpoint(path)
    rank, _ = _rank_world()
    modules = _check_module_names(modules)
    missing = [name for name in modules if not (ckpt / f"{name}.pt").exists()]
    if missing:
        raise FileNotFoundError(
            f"Expected {', '.join(f'{name}.pt' for name in missing)} in {ckpt}: this checkpoint was saved without "
            f"{missing}; resume it with the same modules it was saved with (e.g. the same algo.name)."
        )
    _load_model_state(model, torch.load(ckpt / "model.pt", map_location="cpu", weights_only=True))
    if optimizer is not None:
        optim_state = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
        if _is_fsdp(model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(optim_state)
    if scheduler is not None:
        if not (ckpt / "scheduler.pt").exists():
            raise FileNotFoundError(f"Expected {ckpt / 'scheduler.pt'}: this checkpoint was saved without a scheduler.")
        scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=True))
    for name, module in modules.items():
        state = torch.load(ckpt / f"{name}.pt", map_location="cpu", weights_only=True)
        unwrap(module, peft=False).load_state_dict(state)
    rng_file = ckpt / f"rng_rank{rank}.pt"
    # Resuming on more ranks than were saved: a new rank keeps its own streams (rank 0's would make it
    # sample exactly what rank 0 samples).
    if rng_file.exists() or rank == 0:
        _set_rng_state(torch.load(rng_file, weights_only=True))
    meta = json.loads((ckpt / "meta.json").read_text())
    return {"step": meta["step"], "data_cursor": meta["data_cursor"], "extra": meta["extra"]}


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A checkpoint directory from a checkpoint or run directory; raises FileNotFoundError with the fix."""
    path = Path(path)
    if (path / "meta.json").exists():
        return path
    if (path / LATEST).exists():
        return path / (path / LATEST).read_text().strip()
    raise FileNotFoundError(
        f"Expected a checkpoint directory (with meta.json) or a run directory (with a '{LATEST}' file), "
        f"got {path}; pass the directory given to save_checkpoint."
    )


def export_hf(model: nn.Module, tokenizer: Any, path: str | os.PathLike[str], *, merge_lora: bool = True) -> Path:
    """Write ``model`` (and ``tokenizer`` when it has ``save_pretrained``) in Hugging Face format.

    For a peft model, ``merge_lora=True`` saves a plain model with the adapter folded into the
    weights (on a copy: the training model keeps its adapter), ``merge_lora=False`` saves only the
    adapter (``adapter_config.json`` + weights), loadable with ``PeftModel.from_pretrained``.
    """
    if _is_fsdp(model):
        raise TypeError(
            "Expected an unsharded model, got an FSDP-sharded one; load the checkpoint into a plain model "
            "in one process (load_checkpoint(run_dir, model=model, optimizer=None)) and export that."
        )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    pretrained: Any = unwrap(model, peft=False)  # a Hugging Face (or peft) model: save_pretrained
    if _is_peft(pretrained) and merge_lora:
        pretrained = copy.deepcopy(pretrained).merge_and_unload()
    pretrained.save_pretrained(out)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(out)
    return out


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


def _full_state_options() -> Any:  # a StateDictOptions (imported lazily: torch.distributed)
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # whole (unsharded) tensors on CPU, materialised on rank 0 only
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=_full_state_options())
    return optimizer.state_dict()


_RESERVED = {"model", "optimizer", "scheduler", "meta"}


def _check_module_names(modules: dict[str, nn.Module] | None) -> dict[str, nn.Module]:
    modules = dict(modules or {})
    for name in modules:
        if not name.isidentifier() or name in _RESERVED or name.startswith("rng_rank"):
            raise ValueError(f"Expected module names that are identifiers other than {sorted(_RESERVED)} and "
                             f"rng_rank*, got {name!r}.")
    return modules


def _plain_state(module: nn.Module) -> dict[str, Any]:
    """A small unsharded module's state dict (DDP unwrapped), on CPU."""
    return {k: v.detach().cpu().clone() for k, v in unwrap(module, peft=False).state_dict().items()}


def _model_state(model: nn.Module) -> dict[str, Any]:
    """Full weights, or the LoRA adapter alone for a peft model (FSDP models: full weights, gathered)."""
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=_full_state_options())
    model = unwrap(model, peft=False)
    if _is_peft(model):
        from peft import get_peft_model_state_dict

        return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(model).items()}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _load_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
        return
    model = unwrap(model, peft=False)
    if _is_peft(model):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, state)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise KeyError(
                f"Expected adapter weights matching the model's LoRA config, got unknown keys {unexpected[:5]}; "
                "build the model with the LoRA config used when saving."
            )
        return
    model.load_state_dict(state)


def _rng_state() -> dict[str, Any]:
    # the legacy tuple form (get_state(legacy=True), the default): name, key array, position, gauss cache
    np_name, np_key, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    assert isinstance(np_key, np.ndarray)
    state = {
        "python": random.getstate(),
        # torch.load(weights_only=True) refuses numpy arrays, so the key travels as a tensor
        "numpy": (np_name, torch.from_numpy(np_key.astype(np.int64)), np_pos, np_has_gauss, np_gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_name, np_key, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_name, np_key.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _publish(tmp: Path, final: Path, run_dir: Path) -> None:
    if final.exists():  # re-saving the same step: move the old copy aside, then drop it
        old = run_dir / f".old_{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    pointer_tmp = run_dir / f".{LATEST}.tmp"
    pointer_tmp.write_text(final.name + "\n")
    os.replace(pointer_tmp, run_dir / LATEST)


def _prune(run_dir: Path, keep_last: int) -> None:
    checkpoints = sorted(p for p in run_dir.glob("step_*") if p.is_dir())
    for old in checkpoints[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _json_or_raise(meta: dict[str, Any]) -> str:
    try:
        return json.dumps(meta, indent=2)
    except TypeError as exc:
        raise TypeError(
            f"Expected JSON-serialisable data_cursor and extra, got {exc}; store plain ints, strings, lists, dicts."
        ) from exc


def _rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
