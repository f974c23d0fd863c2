"""trainer: rollouts from env services -> advantages and losses -> optimizer steps, plus the GPU scheduler.

Entry points: ``envhub-train`` (:mod:`trainer.cli`), ``python -m trainer.quickstart``, and the loops in
:mod:`trainer.recipes` (``rl.train``, ``sft.train_sft``), written over the training core
:mod:`trainer.core` (the losses, forward_backward, optim_step, sample, save/load). The rollout engine is
:mod:`trainer.rollout`; pure advantages are :mod:`trainer.algos`; both core and rollout sample through
:mod:`trainer.sampling` (decode loop, HF and vLLM samplers). Submodules import torch; this package does not.
"""
