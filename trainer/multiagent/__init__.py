"""``python -m trainer.multiagent``: an alias of ``envhub-train two-agent``.

Two-agent training is a recipe beside RL and SFT: :mod:`trainer.recipes.two_agent`.
"""
