"""Parts of ``benchmarks/service_tenants.py``: the warmed-up base model the tenants' LoRA adapters train on."""
