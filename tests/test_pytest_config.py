"""The suite's own strictness (pyproject.toml): the project's warnings fail a test, third-party advice does not."""

from __future__ import annotations

import warnings

import pytest


@pytest.mark.parametrize("category", [DeprecationWarning, PendingDeprecationWarning, UserWarning, FutureWarning])
@pytest.mark.parametrize("module", ["envhub.client", "env_servers.math_env.env", "trainer.recipes.rl", "adapters.trl",
                                    "envhub"])
def test_a_warning_from_the_project_fails_the_test(category, module):
    with pytest.raises(category, match="old way"):
        warnings.warn_explicit("the old way", category, filename=f"{module.replace('.', '/')}.py", lineno=1,
                               module=module)


@pytest.mark.parametrize("category", [DeprecationWarning, UserWarning, FutureWarning])
@pytest.mark.parametrize("module", ["torch.nn.modules.module", "transformers.utils", "envhubx.client"])
def test_a_third_party_warning_is_tolerated(category, module):
    warnings.warn_explicit("the old way", category, filename="site-packages/x.py", lineno=1, module=module)


def test_other_warnings_fail_wherever_they_come_from():
    with pytest.raises(RuntimeWarning):
        warnings.warn_explicit("coroutine was never awaited", RuntimeWarning, filename="x.py", lineno=1,
                               module="torch.x")


def test_strict_settings_are_on(pytestconfig):
    assert pytestconfig.getini("xfail_strict") is True
    assert pytestconfig.option.strict_config and pytestconfig.option.strict_markers
