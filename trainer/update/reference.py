"""The frozen KL reference: a forward-only training client over a copy of the policy as it starts."""

from __future__ import annotations

from trainer.core import TrainingClient
from trainer.model import frozen_copy


def frozen_reference(policy: TrainingClient) -> TrainingClient:
    """A forward-only client (no optimizer) over a frozen copy of ``policy``'s model as it is now (the model
    DDP wraps: the reference is never trained, so it needs no gradient sync), same tokenizer and micro-batches."""
    return TrainingClient(frozen_copy(policy.model), policy.tokenizer, params=[],
                          micro_batch_size=policy.micro_batch_size)


__all__ = ["frozen_reference"]
