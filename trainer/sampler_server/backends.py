"""The samplers a server runs, built on the in-process sampling code (this is the one module importing it).

:class:`HFBackend` decodes with :func:`trainer.sampling.decode.decode` on its own copy of the policy; weight
updates are received into fresh tensors and swapped in under ``lock``, the same lock every batched
decode holds, so no sample ever comes from half-updated weights. LoRA adapters are peft adapters on
that model, each in a slot of its own: a replacement fills a new slot while the old one keeps
serving, then the name moves to the new slot under the lock. The vLLM backend is
:mod:`trainer.sampler_server.vllm_backend`.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from dataclasses import dataclass
from typing import Any

import torch

from trainer.core.forward import BASE_ADAPTER, run_model, target_logprobs
from trainer.model import ModelConfig, load_policy
from trainer.sampler_server.protocol import BadRequestError, NotFoundError, Sample, SampleJob
from trainer.sampling.decode import decode, stop_string_check
from trainer.sampling.wire import StreamHeader, WeightFormatError

LORA_KEYS = {"r", "lora_alpha", "target_modules", "use_rslora"}
MAX_TARGET_MODULES = 4096


@dataclass
class _Slot:
    """A peft adapter slot and the version of the weights in it."""

    slot: str
    version: int


class HFBackend:
    """A Hugging Face causal LM behind the server (CPU or one GPU), with named LoRA adapters."""

    def __init__(self, model_cfg: ModelConfig, *, device: str = "cpu", served_name: str | None = None,
                 max_lora_rank: int = 256, max_adapters: int = 8):
        model, tokenizer = load_policy(dataclasses.replace(model_cfg, lora_rank=0), device)
        for p in model.parameters():
            p.requires_grad_(False)
        self.base: Any = model.eval()
        self.peft: Any = None  # the peft wrapper, once an adapter was loaded
        self.tokenizer = tokenizer
        self.model_name = served_name or model_cfg.name
        self.version = 0
        self.lock = threading.Lock()
        self.max_lora_rank, self.max_adapters = max_lora_rank, max_adapters
        self._spare: dict[str, torch.Tensor] = {}  # free tensors the next full update is received into
        self._slots: dict[str, _Slot] = {}
        self._filling: dict[str, str] = {}  # adapter name -> slot being filled by an update in progress
        self._slot_ids = itertools.count()
        self._eos = int(tokenizer.eos_token_id)
        self._pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)

    # -- generation --------------------------------------------------------------------------------
    def vocab_size(self) -> int:
        return int(self.base.get_output_embeddings().weight.shape[0])

    def max_context(self) -> int:
        return int(getattr(self.base.config, "max_position_embeddings", 1 << 30))

    def generate(self, jobs: list[SampleJob]) -> tuple[list[list[Sample]], int]:
        """One left-padded decode for ``jobs`` (equal batch keys); their samples and the version that drew them."""
        with self.lock:
            kwargs = self._adapter_kwargs(jobs[0].adapter, sum(j.n for j in jobs))
            with _seeded(jobs[0].seed):
                samples = self._decode(jobs, kwargs)
            adapter = jobs[0].adapter
            return samples, self._slots[adapter].version if adapter else self.version

    @torch.no_grad()
    def _decode(self, jobs: list[SampleJob], kwargs: dict[str, Any]) -> list[list[Sample]]:
        model = self.peft if self.peft is not None else self.base
        device = next(self.base.parameters()).device
        rows = [(job.prompt_ids, job.max_tokens) for job in jobs for _ in range(job.n)]
        width = max(len(ids) for ids, _ in rows)
        ids_BT = torch.full((len(rows), width), self._pad, dtype=torch.long)
        attn_BT = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (ids, _) in enumerate(rows):
            ids_BT[i, width - len(ids):] = torch.tensor(ids)
            attn_BT[i, width - len(ids):] = 1
        first = jobs[0]
        stops = {self._eos} if first.stop_ids is None else set(first.stop_ids)
        out = decode(model, ids_BT.to(device), attn_BT.to(device), max_new_tokens=[m for _, m in rows],
                     eos_ids=stops, temperature=1.0 if first.greedy else first.temperature, greedy=first.greedy,
                     top_k=first.top_k, top_p=first.top_p,
                     stop_check=stop_string_check(first.stop_strings, self.tokenizer), **kwargs)
        flat = [Sample(ids, lps, reason) for ids, lps, reason in zip(out.token_ids, out.logprobs, out.finish_reasons)]
        result, at = [], 0
        for job in jobs:
            samples = flat[at:at + job.n]
            if job.prompt_logprobs:
                prompt_lps = self._prompt_logprobs(model, job, kwargs)
                for sample in samples:
                    sample.prompt_logprobs = prompt_lps
            result.append(samples)
            at += job.n
        return result

    def _prompt_logprobs(self, model: Any, job: SampleJob, kwargs: dict[str, Any]) -> list[float | None]:
        """log p(prompt[i] | prompt[:i]) (None first), with the trainer's own forward pass and scoring."""
        device = next(self.base.parameters()).device
        tokens_BT = torch.tensor([job.prompt_ids], device=device)
        adapters = kwargs["adapter_names"][:1] if kwargs else None
        logits_BTV, _ = run_model(model, tokens_BT, torch.ones_like(tokens_BT), adapters=adapters)
        scored = target_logprobs(logits_BTV[:, :-1], tokens_BT[:, 1:], 1.0)[0].float().cpu().tolist()
        return [None, *scored]

    def _adapter_kwargs(self, adapter: str | None, rows: int) -> dict[str, Any]:
        if adapter is not None and adapter not in self._slots:
            raise NotFoundError(f"No adapter named {adapter!r} is loaded; loaded: {sorted(self._slots)}.")
        if self.peft is None:
            return {}
        return {"adapter_names": [self._slots[adapter].slot if adapter else BASE_ADAPTER] * rows}

    # -- full-parameter updates ------------------------------------------------------------------------
    def _base_params(self) -> dict[str, torch.nn.Parameter]:
        """The base model's parameters under their plain Hugging Face names (peft's wrappers taken out)."""
        return {name.replace(".base_layer", ""): p for name, p in self.base.named_parameters() if "lora_" not in name}

    def plan_full(self, header: StreamHeader) -> dict[str, torch.Tensor]:
        """Fresh tensors for a full update: every parameter of the model, by name, with its shape."""
        params = self._base_params()
        check_names(header, set(params), "the model's parameters (start the server with the trainer's model settings)")
        plan = {}
        for name, spec in header.specs.items():
            if spec.shape != tuple(params[name].shape) or not spec.dtype.is_floating_point:
                raise WeightFormatError(f"Expected {name} as floats of shape {tuple(params[name].shape)} (the "
                                        f"server's model), got {spec.dtype} {spec.shape}: start the server with the "
                                        "trainer's model settings.")
            spare = self._spare.get(name)
            if spare is None or tuple(spare.shape) != spec.shape or spare.dtype != spec.dtype:
                spare = torch.empty(spec.shape, dtype=spec.dtype)
            plan[name] = spare
        self._spare = {}
        return plan

    def apply_full(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Swap the new weights in, all at once, under the lock.

        What is free afterwards is kept for the next update to be received into (memory touched once, not
        every push: a 0.5B model's fresh pages cost seconds): on a CPU the weights just replaced (double
        buffering), on a GPU the host copies just uploaded."""
        params = self._base_params()
        moved = {name: t.to(params[name].device, params[name].dtype) for name, t in tensors.items()}
        with self.lock:
            old = {name: params[name].data for name in moved}
            for name, tensor in moved.items():
                params[name].data = tensor
            self.version = version
        free = {}
        for name, received in tensors.items():
            if moved[name] is not received:  # uploaded to the device: the host copy is free
                free[name] = received
            elif _owns_storage(old[name]):
                free[name] = old[name]
        self._spare = free

    # -- adapters --------------------------------------------------------------------------------------
    def plan_adapter(self, name: str, lora_config: dict[str, Any], header: StreamHeader) -> dict[str, torch.Tensor]:
        """A new slot for adapter ``name`` (shaped by ``lora_config``); the tensors to stream into it."""
        from peft import LoraConfig, get_peft_model

        config = lora_settings(lora_config, self.max_lora_rank)
        if name not in self._slots and len(self._slots) + len(self._filling) >= self.max_adapters:
            raise BadRequestError(f"Expected at most {self.max_adapters} adapters; unload one first "
                                  f"(loaded: {sorted(self._slots)}).")
        if name in self._filling:
            raise BadRequestError(f"Adapter {name!r} is being updated by another request.")
        slot = f"slot{next(self._slot_ids)}"
        try:
            with self.lock:
                cfg = LoraConfig(**config, lora_dropout=0.0, task_type="CAUSAL_LM")
                if self.peft is None:
                    self.peft = get_peft_model(self.base, cfg, adapter_name=slot).eval()
                else:
                    self.peft.add_adapter(slot, cfg)
        except ValueError as exc:  # peft: no target module matched, and the like
            raise BadRequestError(f"Could not create adapter {name!r}: {exc}") from exc
        self._filling[name] = slot
        params = self._slot_params(slot)
        try:
            check_names(header, set(params), f"the adapter's tensors for {config}")
            for key, spec in header.specs.items():
                if spec.shape != tuple(params[key].shape) or spec.dtype != params[key].dtype:
                    raise WeightFormatError(f"Expected {key} as {params[key].dtype} of shape "
                                            f"{tuple(params[key].shape)}, got {spec.dtype} {spec.shape}.")
        except WeightFormatError:
            self.discard_adapter(name)
            raise
        # streamed straight into the new slot: no request can use it before apply_adapter
        return {key: p.data for key, p in params.items()}

    def apply_adapter(self, name: str, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Make the filled slot the one ``name`` serves (the old slot goes), under the lock."""
        slot = self._filling.pop(name)
        with self.lock:
            old = self._slots.get(name)
            self._slots[name] = _Slot(slot, version)
            if old is not None:
                self._drop_slot(old.slot)

    def discard_adapter(self, name: str) -> None:
        """Drop the slot an unfinished update of ``name`` was filling."""
        slot = self._filling.pop(name, None)
        if slot is not None:
            with self.lock:
                self._drop_slot(slot)

    def unload_adapter(self, name: str) -> None:
        """Unload adapter ``name``; ``NotFoundError`` when none is loaded under that name."""
        with self.lock:
            old = self._slots.pop(name, None)
            if old is None:
                raise NotFoundError(f"No adapter named {name!r} is loaded; loaded: {sorted(self._slots)}.")
            self._drop_slot(old.slot)

    def _drop_slot(self, slot: str) -> None:
        """Delete a slot (the lock held); without any slot left, the plain model comes back (no peft layers)."""
        self.peft.delete_adapter(slot)
        if not self._slots and not self._filling:
            self.base = self.peft.unload()
            self.peft = None

    def adapters(self) -> dict[str, int]:
        """Loaded adapters and their versions."""
        return {name: s.version for name, s in self._slots.items()}

    def _slot_params(self, slot: str) -> dict[str, torch.nn.Parameter]:
        """A slot's parameters under the names peft's state dicts use (the adapter name taken out)."""
        marker = f".{slot}."
        return {name.replace(marker, "."): p for name, p in self.peft.named_parameters() if marker in name}

    def close(self) -> None:
        """Nothing to free beyond the model (garbage-collected)."""


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is a contiguous CPU tensor spanning its whole storage (safe to overwrite once unused)."""
    return t.device.type == "cpu" and t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def check_names(header: StreamHeader, expected: set[str], what: str) -> None:
    got = set(header.specs)
    missing, unknown = sorted(expected - got), sorted(got - expected)
    if missing or unknown:
        raise WeightFormatError(f"Expected exactly {what} ({len(expected)} tensors); missing {missing[:3]}"
                                f"{'...' if len(missing) > 3 else ''}, unknown {unknown[:3]}"
                                f"{'...' if len(unknown) > 3 else ''}.")


def lora_settings(raw: dict[str, Any], max_rank: int) -> dict[str, Any]:
    """The LoRA settings a push may carry, checked and bounded (rank, alpha, target modules, rsLoRA)."""
    unknown = sorted(set(raw) - LORA_KEYS)
    if unknown:
        raise BadRequestError(f"Unknown lora_config key(s) {unknown}; expected some of {sorted(LORA_KEYS)}.")
    rank, alpha, targets = raw.get("r"), raw.get("lora_alpha", 8), raw.get("target_modules", "all-linear")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise BadRequestError(f"Expected lora_config.r an int in [1, {max_rank}], got {rank!r}.")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise BadRequestError(f"Expected lora_config.lora_alpha > 0, got {alpha!r}.")
    if isinstance(targets, list):
        if not 0 < len(targets) <= MAX_TARGET_MODULES or not all(isinstance(t, str) and t for t in targets):
            raise BadRequestError(f"Expected lora_config.target_modules: 1 to {MAX_TARGET_MODULES} module names.")
    elif targets != "all-linear":
        raise BadRequestError(f"Expected lora_config.target_modules 'all-linear' or a list of names, got {targets!r}.")
    return {"r": rank, "lora_alpha": alpha, "target_modules": targets, "use_rslora": bool(raw.get("use_rslora"))}


class _seeded:
    """Fork the torch RNG and seed it, when a seed is given (a seeded job runs alone)."""

    def __init__(self, seed: int | None):
        self.seed: int | None = seed
        self.fork: Any = None

    def __enter__(self) -> None:
        if self.seed is not None:
            devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
            self.fork = torch.random.fork_rng(devices=devices)
            self.fork.__enter__()
            torch.manual_seed(self.seed)

    def __exit__(self, *exc: object) -> None:
        if self.fork is not None:
            self.fork.__exit__(None, None, None)


__all__ = ["HFBackend", "check_names", "lora_settings"]
