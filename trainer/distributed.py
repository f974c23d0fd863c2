"""Data-parallel plumbing over torch.distributed: process group set-up, model wrapping, collectives.

Launched by ``torchrun`` or ``accelerate launch --multi_gpu`` (both set RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT) it joins the process group — gloo on CPU, NCCL on CUDA. Started as a plain
``python`` process it runs as a single rank and every collective here is a no-op, so one code path
serves both.

What accelerate carries: DDP wrapping (device ids, placement) and mixed precision (autocast around
``forward``, outputs back in fp32), through ``Accelerator.prepare_model``; ``accelerate launch
--mixed_precision bf16`` reaches the recipes as ``run.mixed_precision="auto"``. What stays here:
the process group (gloo or NCCL chosen from the run, before any accelerate state exists), FSDP2
(``fully_shard`` per decoder layer: accelerate's FSDP plugin brings its own state-dict and
optimizer conventions, while the training core's saved state (:mod:`trainer.core.state`) saves and
restores sharded models exactly with torch's distributed checkpoint API, through the helpers below),
and the optimizer and data loop, which the recipes own so that resume stays exact (accelerate's
prepared optimizers and dataloaders would add state of their own).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

T = TypeVar("T")
_joined = False  # init_distributed joined a process group in this process (exit_rank's business)
BACKENDS = ("auto", "gloo", "nccl")
#: ``run.strategy`` values: "auto" (the default) is DDP under a torchrun world of more than one rank and
#: the plain model otherwise; "none" never synchronises and is refused with more than one rank.
STRATEGIES = ("auto", "ddp", "fsdp", "none")
#: ``run.mixed_precision`` values: "auto" takes ``accelerate launch --mixed_precision`` (its
#: ACCELERATE_MIXED_PRECISION variable) and is "no" otherwise; "bf16" and "fp16" autocast ``forward``.
MIXED_PRECISIONS = ("auto", "no", "bf16", "fp16")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: its rank among ``world_size``, its device, and whether it is rank 0."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    is_main: bool = True

    @property
    def distributed(self) -> bool:
        """True when a process group with more than one rank is live."""
        return self.world_size > 1


def init_distributed(backend: str = "auto") -> DistInfo:
    """Join the torchrun process group (or return a single-process DistInfo when not under torchrun).

    ``backend="auto"`` picks NCCL when CUDA is available, gloo otherwise. Each CUDA rank is pinned to
    ``cuda:LOCAL_RANK``.
    """
    global _joined
    if backend not in BACKENDS:
        raise ValueError(f"Expected backend in {BACKENDS}, got {backend!r}.")
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("Expected a CUDA device for backend='nccl', found none; use backend='gloo' on CPU.")
    launched = "RANK" in os.environ and "MASTER_ADDR" in os.environ  # set by torchrun
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if launched else 1
    rank = int(os.environ.get("RANK", "0")) if launched else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if launched else 0
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # a torchrun world of one still gets a process group: FSDP needs one
    if launched and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", rank=rank, world_size=world_size,
                                device_id=device if use_cuda else None)
        _joined = True
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, is_main=rank == 0)


def wrap_model(model: nn.Module, strategy: str, info: DistInfo, *, mixed_precision: str = "no") -> nn.Module:
    """Wrap ``model`` for data parallelism: "auto", "ddp" (CPU or GPU), "fsdp" (CUDA only), "none".

    "auto" is "ddp" when ``info`` has more than one rank and the model unchanged otherwise. On a
    single rank, "ddp" returns the model unchanged too (there is nobody to synchronise with).
    "fsdp" shards each decoder layer (``model._no_split_modules``, e.g. Qwen2DecoderLayer) and then
    the root with ``fully_shard``. "none" returns the model unchanged and raises ValueError with more
    than one rank: every rank would train alone on its share of the data and the ranks would drift apart.
    ``mixed_precision`` "bf16"/"fp16" runs ``forward`` under autocast (parameters and optimizer
    state stay in their dtype; FSDP casts parameters per layer instead); "auto" resolves as
    :func:`resolve_mixed_precision` says.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"Expected strategy in {STRATEGIES}, got {strategy!r}.")
    mixed_precision = resolve_mixed_precision(mixed_precision)
    if strategy == "none":
        if info.distributed:
            raise ValueError(
                f"Expected run.strategy 'auto', 'ddp' or 'fsdp' with world_size={info.world_size}, got 'none': "
                "each rank would train alone on its slice of the batch and the ranks would drift apart; "
                "use run.strategy=auto (DDP), or launch one process without torchrun."
            )
        return _prepare(model, info, mixed_precision) if mixed_precision != "no" else model
    if strategy == "fsdp":
        return _fsdp(model, info, mixed_precision)
    if not info.distributed and mixed_precision == "no":
        return model
    return _prepare(model, info, mixed_precision)  # DDP ("auto" or "ddp") with more than one rank


def resolve_mixed_precision(mixed_precision: str) -> str:
    """"no", "bf16" or "fp16": "auto" is what ``accelerate launch --mixed_precision`` asked for, else "no"."""
    if mixed_precision not in MIXED_PRECISIONS:
        raise ValueError(f"Expected mixed_precision in {MIXED_PRECISIONS}, got {mixed_precision!r}.")
    if mixed_precision == "auto":
        mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        if mixed_precision not in MIXED_PRECISIONS[1:]:
            raise ValueError(f"Expected ACCELERATE_MIXED_PRECISION in {MIXED_PRECISIONS[1:]}, got {mixed_precision!r}; "
                             "launch with accelerate launch --mixed_precision no|bf16|fp16.")
    return mixed_precision


def _prepare(model: nn.Module, info: DistInfo, mixed_precision: str) -> nn.Module:
    # accelerate's state is per process: one mixed-precision setting for the whole run
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=info.device.type == "cpu", mixed_precision=mixed_precision)
    prepared: nn.Module = accelerator.prepare_model(model.to(info.device), device_placement=False)
    return prepared


def _fsdp(model: nn.Module, info: DistInfo, mixed_precision: str = "no") -> nn.Module:
    if info.device.type != "cuda":
        raise RuntimeError(
            f"Expected a CUDA device for strategy='fsdp', got {info.device}; use strategy='ddp' on CPU "
            "(FSDP over gloo is not supported here)."
        )
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    model = model.to(info.device)
    layer_names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_names:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Average ``t`` across ranks in place (and return it); unchanged on a single rank."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t.div_(dist.get_world_size())
    return t


def world_size() -> int:
    """The number of ranks of the live process group; 1 without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def rank() -> int:
    """This process's rank in the live process group; 0 without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


#: ranks' sampling seeds are this far apart (see :func:`rank_seed`)
RANK_SEED_STRIDE = 1_000_003


def rank_seed(seed: int, rank: int) -> int:
    """The sampling seed of ``rank`` in a run seeded ``seed``: ``seed`` itself on rank 0 (and in a single
    process), ``seed + RANK_SEED_STRIDE * rank`` elsewhere, so ranks never share a random stream.

    >>> rank_seed(7, 0), rank_seed(7, 1)
    (7, 1000010)
    """
    return seed + RANK_SEED_STRIDE * rank


def seed_rngs(seed: int) -> None:
    """Seed python's ``random`` and torch (CPU and every CUDA device) with ``seed``."""
    random.seed(seed)
    torch.manual_seed(seed)


def max_over_ranks(value: int, device: torch.device | str = "cpu") -> int:
    """The largest ``value`` of any rank (``value`` itself on a single rank); ``device`` must suit the backend."""
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def pad_to_ranks(rows: list[T], pad: T, device: torch.device | str = "cpu") -> list[T]:
    """``rows`` plus copies of ``pad`` up to the most rows any rank holds (``rows`` itself on one process).

    Under torchrun every rank must run the same forward/backward passes (DDP and FSDP communicate in
    them): a rank that kept fewer rows this step trains on ``pad`` rows, which carry no loss. Every rank
    must call this at the same point (it is a collective).
    """
    target = max_over_ranks(len(rows), device)
    return list(rows) + [pad] * (target - len(rows))


def barrier() -> None:
    """Wait for every rank; a no-op on a single rank."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` is sharded with FSDP2 (``fully_shard``): its state must be gathered to be saved."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


def gathered_model_state(model: nn.Module) -> dict[str, Any]:
    """An FSDP model's whole (unsharded) weights on the CPU of rank 0 (empty elsewhere). A collective: every
    rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return dict(get_model_state_dict(model, options=_full_state_options()))


def load_gathered_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Shard whole weights (what :func:`gathered_model_state` gave) back into an FSDP model; every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def gathered_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state of an FSDP model's parameters, whole, on the CPU of rank 0. A collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return dict(get_optimizer_state_dict(model, optimizer, options=_full_state_options()))


def load_gathered_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Shard whole optimizer state (from :func:`gathered_optimizer_state`) back; every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def _full_state_options() -> StateDictOptions:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # whole (unsharded) tensors on CPU, materialised on rank 0 only
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Return ``src``'s ``obj`` on every rank (any picklable object)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def shard(items: Sequence[T], info: DistInfo) -> list[T]:
    """This rank's contiguous slice of ``items`` (contiguous, so GRPO groups laid out side by side stay whole
    when the group size divides the per-rank count); ``len(items)`` must divide evenly by world_size.
    """
    if len(items) % info.world_size:
        raise ValueError(
            f"Expected a number of items divisible by world_size={info.world_size}, got {len(items)}; "
            "make the global batch a multiple of the number of ranks."
        )
    per_rank = len(items) // info.world_size
    return list(items[info.rank * per_rank: (info.rank + 1) * per_rank])


def cleanup() -> None:
    """Leave the process group (safe to call when none was joined)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def joined_process_group() -> bool:
    """True once :func:`init_distributed` has joined a process group in this process (a torchrun rank)."""
    return _joined


def exit_rank(code: int = 0) -> NoReturn:
    """End a torchrun rank with exit status ``code``: leave the process group, then do what a normal
    exit does — join non-daemon threads, run ``atexit`` handlers, flush stdout and stderr — and leave
    with ``os._exit``, skipping interpreter finalization (as multiprocessing's children do).

    Why: DDP keeps its process group, and with it gloo's worker threads, alive after
    ``destroy_process_group``. A worker still releasing a finished collective whose tensors hold Python
    objects must take the GIL to drop them; if the interpreter is finalizing by then, Python ends that
    thread with ``pthread_exit``, and unwinding it through torch's noexcept destructor aborts the
    process ("terminate called without an active exception", SIGABRT) after a run that succeeded.
    ``envhub-train`` ends every rank this way; a script of your own that calls ``train`` under torchrun
    should end with it too.
    """
    try:
        cleanup()
        shutdown = getattr(threading, "_shutdown", None)  # what normal exit runs first: joins non-daemon threads
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
