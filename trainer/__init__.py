"""trainer: the RL trainer, its rollout engine and the GPU scheduler."""
