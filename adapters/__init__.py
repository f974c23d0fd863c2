"""Adapters between envhub and the ecosystem (OpenEnv, Gymnasium, OpenAI, TRL); each imports what it adapts lazily."""
