"""Every env builds its config the same way: ``XConfig.build(kwargs)``, refusing unknown keys by name."""

from __future__ import annotations

import dataclasses

import pytest

from env_servers.code_env.env import CodeEnv, CodeEnvConfig
from env_servers.geometry_env.env import GeometryConfig, GeometryEnv
from env_servers.gomoku_env import GomokuConfig, GomokuEnv, GomokuMatchEnv
from env_servers.math_env import MathConfig, MathEnv
from envhub.errors import ConfigError

ENVS = [(MathEnv, MathConfig), (GeometryEnv, GeometryConfig), (CodeEnv, CodeEnvConfig), (GomokuEnv, GomokuConfig),
        (GomokuMatchEnv, GomokuConfig)]


@pytest.mark.parametrize("env_cls,config_cls", ENVS, ids=lambda c: c.__name__)
def test_env_configs_are_built_one_way(env_cls, config_cls):
    field = dataclasses.fields(config_cls)[0]
    assert config_cls.build({}) == config_cls()
    with pytest.raises(ConfigError, match=field.name):
        config_cls.build({"no_such_option": 1})
    with pytest.raises(ConfigError, match=field.name):
        env_cls(no_such_option=1)
