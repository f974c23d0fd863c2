"""trainer.recipes: the training loops (RL from env services, SFT), each a readable loop over the training core."""
