"""Auth fails closed: an empty or placeholder token is refused at start-up; no token means no auth."""

from __future__ import annotations

import subprocess
import sys

import pytest
from starlette.testclient import TestClient

from envhub.server import create_app
from envhub.settings import Settings
from envhub.testing import EchoEnv


@pytest.mark.parametrize("token", ["", "  ", "none", "NULL", "off", "changeme"])
def test_empty_or_placeholder_tokens_are_refused_with_the_fix(token):
    with pytest.raises(ValueError, match="unset ENVHUB_TOKEN"):
        Settings.from_env({"ENVHUB_TOKEN": token})
    with pytest.raises(ValueError, match="unset ENVHUB_TOKEN"):
        Settings(token=token)


def test_no_token_means_no_auth_and_a_real_token_is_required():
    assert Settings.from_env({}).token is None
    app = create_app(EchoEnv, settings=Settings(log_level="warning", token="s3cret"))
    with TestClient(app) as http:
        assert http.get("/metadata", headers={"Authorization": "Bearer "}).status_code == 401
        assert http.get("/metadata", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_serve_refuses_an_empty_token_flag_with_the_fix():
    done = subprocess.run([sys.executable, "-m", "envhub", "serve", "envhub.testing:EchoEnv", "--port", "0",
                           "--token", ""], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "unset ENVHUB_TOKEN" in done.stderr, done.stderr[-2000:]
