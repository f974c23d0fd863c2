"""trainer.core: the training core (forward_backward, forward, optim_step, sample, save/load) of recipes and service."""

from trainer.core.client import TrainingClient
from trainer.core.host import ModelHost, TenantError
from trainer.core.losses import AGGREGATIONS, LOSSES, aggregation_units, aggregation_weights, k3_kl, token_logprobs
from trainer.core.sampling import SamplingClient
from trainer.core.state import has_checkpoint, load_checkpoint, resolve_checkpoint, save_checkpoint
from trainer.core.types import AdamParams, Datum, ForwardBackwardOutput, SampledSequence, SampleResponse, SamplingParams

__all__ = [
    "AGGREGATIONS",
    "LOSSES",
    "AdamParams",
    "Datum",
    "ForwardBackwardOutput",
    "ModelHost",
    "SampleResponse",
    "SampledSequence",
    "SamplingClient",
    "SamplingParams",
    "TenantError",
    "TrainingClient",
    "aggregation_units",
    "aggregation_weights",
    "has_checkpoint",
    "k3_kl",
    "load_checkpoint",
    "resolve_checkpoint",
    "save_checkpoint",
    "token_logprobs",
]
