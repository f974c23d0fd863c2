"""The scenarios of ``benchmarks/scenarios.py``: each one a runner that trains from its config and reports curves."""
