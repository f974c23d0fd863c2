"""Parts of ``benchmarks/service_tenants.py``: the warmed-up base model the tenants' LoRA adapters train on, and
each tenant's validation reward with its standard error and the verdict on whether every tenant learned."""
