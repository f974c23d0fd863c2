"""``benchmarks/_tenants/learning.py``: the validation estimate's standard error and the per-phase verdict."""

from __future__ import annotations

import math

import pytest

from benchmarks._tenants.learning import Validation, clear_rise, estimate, verdict


def test_estimate_is_the_mean_over_problems_with_the_within_problem_standard_error() -> None:
    v = estimate([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert v.mean == pytest.approx(0.25)
    # the first problem's sample variance 1/3 over its 4 samples; the second has none; over 2 problems
    assert v.se == pytest.approx(math.sqrt(1 / 12) / 2)


def test_estimate_refuses_fewer_than_two_samples() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        estimate([[1.0], [0.0, 1.0]])


def test_a_clear_rise_exceeds_twice_the_standard_error_of_the_difference() -> None:
    before = Validation(0.15, 0.015)
    assert clear_rise(before, Validation(0.25, 0.015))
    assert not clear_rise(before, Validation(0.19, 0.015))  # 0.04 < 2 * 0.0212
    assert not clear_rise(before, Validation(0.10, 0.015))


def test_verdict_says_yes_only_when_every_tenant_rose_clearly() -> None:
    before = Validation(0.15, 0.015)
    assert verdict([(before, Validation(0.25, 0.015))] * 2).startswith(
        "every tenant's validation rose clearly (by > 2 standard errors): yes (2 of 2")
    line = verdict([(before, Validation(0.25, 0.015)), (before, Validation(0.16, 0.015))])
    assert ": no (1 of 2; 2 of 2 rose at all)" in line
