"""trainer.sampling: token-id prompts -> sampled sequences with log-probs; the layer under core and rollout.

The training core (``trainer.core.SamplingClient``) and the rollout engine both sample through this
package and nothing else; it imports neither of them. Its parts:

- :mod:`~trainer.sampling.types`: :class:`GenRequest`, the ONE result type :class:`SampledSequence`
  (token ids, log-probs, stop reason, the policy version that sampled it), the core's
  :class:`SamplingParams` / :class:`SampleResponse`, and the batch samplers' :class:`SamplingConfig`;
- :mod:`~trainer.sampling.decode`: the batched decode loop, on the model arithmetic of
  :mod:`~trainer.sampling.kernels` (a lean Llama-family kernel, or any Hugging Face model's own forward);
- :mod:`~trainer.sampling.batching`: :class:`BatchingSampler`, the queue that answers many awaiting
  callers with one batched call, under a weights lock;
- :mod:`~trainer.sampling.hf`: :class:`HFSampler`, the policy model itself through the decode loop;
- :mod:`~trainer.sampling.remote`: :class:`RemoteSampler`, the trainer's side of ``envhub-train sampler``
  servers (episode-sticky routing, one batched request per server, faults), on
  :mod:`~trainer.sampling.pool`'s :class:`SamplerPool` (rotation, fail-over, pushes, catching joiners up),
  which the training service's sampling on the same servers uses too; :mod:`~trainer.sampling.remote_push`
  is what a push carries and how it travels (a server's weight channel, else an HTTP body), in the
  :mod:`~trainer.sampling.wire` format;
- :mod:`~trainer.sampling.vllm_engine`: :class:`VLLMSampler`, a vLLM engine (its GPU or CPU build) on one
  dedicated thread, with in-memory weight sync, ``generate_batch`` and Tinker-style ``sample``.

The interface, :class:`Sampler` (:mod:`~trainer.sampling.protocol`)::

    version: int                                               # policy version of the loaded weights
    async generate(GenRequest) -> SampledSequence              # batched with other waiting callers
    generate_batch(list[GenRequest]) -> list[SampledSequence]  # one blocking call, one greedy flag
    update_weights(model, version) -> None                     # sample model's current weights from now on
    close() -> None                                            # free the engine / files; idempotent

A sampler behind an HTTP server fits the same interface: :class:`RemoteSampler` gathers the turns as
:class:`BatchingSampler` does (the shared :class:`~trainer.sampling.batching.TurnQueue`, through
:class:`~trainer.sampling.server_batches.ServerBatches`), sends each ``envhub-train sampler`` server its
turns in one request, and pushes weights (with their version) in
``update_weights``.
Results carry the version that produced them, so a trainer can bound how stale its rollouts are.

>>> sampler = make_sampler(model, tokenizer, SamplingConfig(temperature=0.8))            # doctest: +SKIP
>>> [seq] = sampler.generate_batch([GenRequest(prompt_ids, max_new_tokens=16)])          # doctest: +SKIP
>>> seq.tokens, seq.logprobs, seq.stop_reason, seq.version                               # doctest: +SKIP
"""

from trainer.sampling.batching import BatchingSampler
from trainer.sampling.decode import Decoded, decode, stop_string_check, supports_decode
from trainer.sampling.factory import make_sampler
from trainer.sampling.hf import HFSampler, generation_model
from trainer.sampling.pool import Push, SamplerPool
from trainer.sampling.protocol import Sampler
from trainer.sampling.remote import RemoteSampler, SamplerServersDownError
from trainer.sampling.types import GenRequest, SampledSequence, SampleResponse, SamplingConfig, SamplingParams

__all__ = [
    "BatchingSampler",
    "Decoded",
    "GenRequest",
    "HFSampler",
    "Push",
    "RemoteSampler",
    "SampleResponse",
    "SampledSequence",
    "Sampler",
    "SamplerPool",
    "SamplerServersDownError",
    "SamplingConfig",
    "SamplingParams",
    "decode",
    "generation_model",
    "make_sampler",
    "stop_string_check",
    "supports_decode",
]
