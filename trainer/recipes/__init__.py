"""trainer.recipes: the training loops (RL from env services, SFT), each readable top to bottom."""
