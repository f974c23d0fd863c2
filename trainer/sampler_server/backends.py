"""The samplers a server runs, built on the in-process sampling code (this is the one module importing it).

:class:`HFBackend` decodes with :func:`trainer.sampling.decode.decode` on its own copy of the policy (a
vision-language policy with Hugging Face ``generate``, as the in-process sampler does); weight updates
are received into fresh tensors and swapped in under ``lock``, the same lock every batched decode
holds, so no sample ever comes from half-updated weights. LoRA adapters are plain tensors per name
(:class:`~trainer.sampler_server.lora_slots.AdapterTable`, no peft layers around the model): a
replacement is received beside the adapter it replaces, which keeps serving until the name moves to it
under the lock. One ``generate`` call serves jobs of several adapters and the base in ONE decode pass,
each row under its own adapter (:class:`~trainer.sampling.row_adapters.RowAdapters`: each adapter's
rows together, one LoRA term per run, shared prefills). The vLLM backend is
:mod:`trainer.sampler_server.vllm_backend`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from trainer.core.forward import BASE_ADAPTER, run_model, target_logprobs
from trainer.model import ModelConfig, base_fingerprint, load_policy
from trainer.sampler_server.lora_slots import AdapterTable
from trainer.sampler_server.protocol import BadRequestError, ImageSpec, Outcome, Sample, SampleJob
from trainer.sampling.decode import decode, stop_string_check, supports_decode
from trainer.sampling.row_adapters import RowAdapters
from trainer.sampling.wire import StreamHeader, WeightFormatError
from trainer.vision import vision_inputs

LORA_KEYS = {"r", "lora_alpha", "target_modules", "use_rslora"}
MAX_TARGET_MODULES = 4096


class HFBackend:
    """A Hugging Face causal LM behind the server (CPU or one GPU), with named LoRA adapters."""

    def __init__(self, model_cfg: ModelConfig, *, device: str = "cpu", served_name: str | None = None,
                 max_lora_rank: int = 256, max_adapters: int = 8):
        model, tokenizer = load_policy(dataclasses.replace(model_cfg, lora_rank=0), device)
        for p in model.parameters():
            p.requires_grad_(False)
        self.base: Any = model.eval()
        self.tokenizer = tokenizer
        self.model_name = served_name or model_cfg.name
        self.base_fingerprint: str | None = base_fingerprint(self.base)  # of the weights loaded (see /health)
        self.version = 0
        self.lock = threading.Lock()
        self.max_lora_rank, self.max_adapters = max_lora_rank, max_adapters
        # read once: a pass with adapters swaps modules of the model while other threads ask (a full update's
        # plan, a request's vocabulary check); parameters stay the same objects (updates replace their data)
        base: Any = self.base
        self._params = dict(base.named_parameters())
        self._vocab = int(base.get_output_embeddings().weight.shape[0])
        self.table = AdapterTable(self.base, max_rank=max_lora_rank, max_adapters=max_adapters)
        self.images = _image_spec(self.base)
        # the decode loop's per-row adapters need [B, ...] rows in every LoRA layer; a vision tower's layers see
        # patches, so a vision-language model runs one adapter per pass (applied to all its rows)
        self.mixes_adapters = self.images is None and supports_decode(self.base)
        self._spare: dict[str, torch.Tensor] = {}  # free tensors the next full update is received into
        self._eos = int(tokenizer.eos_token_id)
        self._pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)

    # -- generation --------------------------------------------------------------------------------
    def vocab_size(self) -> int:
        return self._vocab

    def max_context(self) -> int:
        config = self.base.config
        text = getattr(config, "text_config", None) or config  # a vision-language model's language model
        return int(getattr(text, "max_position_embeddings", None) or 1 << 30)

    def generate(self, jobs: list[SampleJob]) -> list[Outcome]:
        """One batched pass for ``jobs`` (equal batch keys, adapters mixed): per job its samples and the version
        that drew them, or the error it met (an adapter not loaded)."""
        with self.lock:
            outcomes: list[Outcome | None] = [None] * len(jobs)
            ready = []
            for i, job in enumerate(jobs):
                try:
                    if job.adapter is not None:
                        self.table.check(job.adapter)
                    ready.append(i)
                except LookupError as exc:
                    outcomes[i] = exc
            # each adapter's rows together (the base's first): one run per adapter in every LoRA layer
            ready.sort(key=lambda i: (jobs[i].adapter is not None, jobs[i].adapter or ""))
            if ready:
                with _seeded(jobs[ready[0]].seed):
                    samples = self._decode([jobs[i] for i in ready])
                for i, got in zip(ready, samples):
                    adapter = jobs[i].adapter
                    outcomes[i] = (got, self.table.loaded[adapter].version if adapter else self.version)
            return [o for o in outcomes if o is not None]

    @torch.no_grad()
    def _decode(self, jobs: list[SampleJob]) -> list[list[Sample]]:
        names = {job.adapter for job in jobs if job.adapter is not None}
        if len(names) > 1 and not self.mixes_adapters:
            raise BadRequestError("Expected one adapter per pass on a vision-language model.")  # the batch key's
        active = next(iter(names)) if names and not self.mixes_adapters else None
        with self.table.installed(names, active) as keys:
            rows = [(job.prompt_ids, job.max_tokens) for job in jobs for _ in range(job.n)]
            per_row = [None if job.adapter is None else keys[job.adapter] for job in jobs for _ in range(job.n)]
            ids_BT, attn_BT = self._left_padded([ids for ids, _ in rows])
            if self.images is None and supports_decode(self.base):
                flat = self._decode_text(jobs, ids_BT, attn_BT, [m for _, m in rows],
                                         RowAdapters(self.base, per_row) if names else None)
            else:
                flat = self._generate(jobs, ids_BT, attn_BT, [m for _, m in rows])
            result, at = [], 0
            for job in jobs:
                samples = flat[at:at + job.n]
                if job.prompt_logprobs:  # per-row adapters where rows mix them; else the active one (or none)
                    row = [keys[job.adapter] if job.adapter else BASE_ADAPTER] if names and self.mixes_adapters else None
                    prompt_lps = self._prompt_logprobs(job, row)
                    for sample in samples:
                        sample.prompt_logprobs = prompt_lps
                result.append(samples)
                at += job.n
        return result

    def _left_padded(self, prompts: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(self.base.parameters()).device
        width = max(len(ids) for ids in prompts)
        ids_BT = torch.full((len(prompts), width), self._pad, dtype=torch.long)
        attn_BT = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, ids in enumerate(prompts):
            ids_BT[i, width - len(ids):] = torch.tensor(ids)
            attn_BT[i, width - len(ids):] = 1
        return ids_BT.to(device), attn_BT.to(device)

    def _decode_text(self, jobs: list[SampleJob], ids_BT: torch.Tensor, attn_BT: torch.Tensor, budgets: list[int],
                     rows: RowAdapters | None) -> list[Sample]:
        first = jobs[0]
        stops = {self._eos} if first.stop_ids is None else set(first.stop_ids)
        out = decode(self.base, ids_BT, attn_BT, max_new_tokens=budgets, eos_ids=stops,
                     temperature=1.0 if first.greedy else first.temperature, greedy=first.greedy,
                     top_k=first.top_k, top_p=first.top_p,
                     stop_check=stop_string_check(first.stop_strings, self.tokenizer), row_adapters=rows)
        return [Sample(ids, lps, reason) for ids, lps, reason in zip(out.token_ids, out.logprobs, out.finish_reasons)]

    def _generate(self, jobs: list[SampleJob], ids_BT: torch.Tensor, attn_BT: torch.Tensor,
                  budgets: list[int]) -> list[Sample]:
        """Hugging Face ``generate`` (a vision-language model, as the in-process sampler runs it): log-probs from its
        logits at the temperature, each row cut at its first stop id, stop string or budget."""
        first = jobs[0]
        stops = [self._eos] if first.stop_ids is None else list(first.stop_ids)
        temperature = 1.0 if first.greedy else first.temperature
        images = [list(job.images) for job in jobs for _ in range(job.n)]
        extra = vision_inputs(images, ids_BT, self.images.image_token_id) if self.images is not None else {}
        gen = self.base.generate(input_ids=ids_BT, attention_mask=attn_BT, max_new_tokens=max(budgets),
                                 do_sample=not first.greedy, temperature=None if first.greedy else temperature,
                                 top_p=None if first.greedy else first.top_p,
                                 top_k=None if first.greedy else first.top_k, eos_token_id=stops or None,
                                 pad_token_id=self._pad, return_dict_in_generate=True, output_logits=True, **extra)
        new_BN = gen.sequences[:, ids_BT.shape[1]:].cpu()
        logits_BNV = torch.stack(gen.logits, dim=1).float().cpu() / temperature
        logprobs_BN = torch.log_softmax(logits_BNV, dim=-1).gather(-1, new_BN.unsqueeze(-1)).squeeze(-1)
        check = stop_string_check(first.stop_strings, self.tokenizer)
        return [_cut(new_BN[i].tolist(), logprobs_BN[i].tolist(), budget, set(stops), check)
                for i, budget in enumerate(budgets)]

    def _prompt_logprobs(self, job: SampleJob, adapters: list[str] | None) -> list[float | None]:
        """log p(prompt[i] | prompt[:i]) (None first), with the trainer's own forward pass and scoring."""
        device = next(self.base.parameters()).device
        tokens_BT = torch.tensor([job.prompt_ids], device=device)
        logits_BTV, _ = run_model(self.base, tokens_BT, torch.ones_like(tokens_BT), adapters=adapters,
                                  images_B=[list(job.images)])
        scored = target_logprobs(logits_BTV[:, :-1], tokens_BT[:, 1:], 1.0)[0].float().cpu().tolist()
        return [None, *scored]

    # -- full-parameter updates ------------------------------------------------------------------------
    def _base_params(self) -> dict[str, torch.nn.Parameter]:
        """The model's parameters under their Hugging Face names (as it was built: no adapter layers)."""
        return self._params

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
        """Fresh tensors for adapter ``name`` (shaped by ``lora_config``) to stream into; the one serving goes on."""
        config = lora_settings(lora_config, self.max_lora_rank)
        with self.lock:
            return self.table.plan(name, config, header)

    def apply_adapter(self, name: str, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Make the received tensors the adapter ``name`` serves (replacing the old one), under the lock."""
        with self.lock:
            self.table.apply(name, tensors, version)

    def discard_adapter(self, name: str) -> None:
        """Forget an unfinished update of ``name``."""
        with self.lock:
            self.table.discard(name)

    def unload_adapter(self, name: str) -> None:
        """Unload adapter ``name``; ``NotFoundError`` when none is loaded under that name."""
        with self.lock:
            self.table.unload(name)

    def adapters(self) -> dict[str, int]:
        """Loaded adapters and their versions."""
        return {name: a.version for name, a in self.table.loaded.items()}

    def close(self) -> None:
        """Nothing to free beyond the model (garbage-collected)."""


def _image_spec(model: Any) -> ImageSpec | None:
    """What ``model`` takes as images (a Qwen2-VL-style vision config), or None for a text-only model."""
    config = model.config
    vision, token_id = getattr(config, "vision_config", None), getattr(config, "image_token_id", None)
    if vision is None or token_id is None:
        return None
    channels = int(getattr(vision, "in_channels", None) or getattr(vision, "in_chans", None) or 3)
    patch_dim = channels * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
    return ImageSpec(patch_dim, int(vision.spatial_merge_size), int(token_id))


def _cut(ids: list[int], logprobs: list[float], budget: int, stops: set[int], check: Any) -> Sample:
    """A row of ``generate``'s output as a sample: at most ``budget`` ids, ending at its first stop id or string."""
    for k, token in enumerate(ids[:budget]):
        if token in stops or (check is not None and check(ids[:k + 1])):
            return Sample(ids[:k + 1], logprobs[:k + 1], "stop")
    return Sample(ids[:budget], logprobs[:budget], "length")


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
