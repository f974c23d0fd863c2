"""Environment servers: math, gomoku, geometry and a code sandbox, each a package of pure domain modules plus an envhub adapter.

The ``<name>_env`` packages never import one another (tests/test_layering.py checks it). Domain code
more than one of them needs lives beside them: ``math_grading`` (answer grading, shared by math and
geometry), ``sandbox`` (untrusted code execution, shared by code and math's interpreter tool),
``datasets`` (local dataset files, stable splits) and ``serve_cli`` (an env server's command line).
"""
