"""Math answer grading shared by math_env and geometry_env: pure functions (no sockets, no env state).

``grading`` extracts, normalises and compares answers; ``expressions`` is the whitelisted
sympy parser; ``bounded`` runs the slow cases in a worker process with a deadline.
"""
