"""HTTP routes in process (Starlette TestClient): health, metadata, schema, MCP, stateful episodes, metrics, auth."""

from __future__ import annotations

from typing import Annotated

import pytest
from starlette.testclient import TestClient

from envhub import Env, Observation, reward, tool
from envhub.server import create_app
from envhub.settings import Settings
from envhub.testing import EchoEnv


class GuessEnv(Env):
    """Guess a secret number."""

    def reset(self, seed=None, secret: int = 7):
        self.secret, self.last = secret, None
        return Observation(text="guess")

    @tool
    def guess(self, number: Annotated[int, "your guess"]) -> str:
        """Guess the secret number."""
        self.last = number
        self.done = number == self.secret
        return "Correct!" if self.done else "Wrong."

    @reward
    def solved(self) -> float:
        return float(self.last == self.secret)


def client(env_cls=GuessEnv, **settings) -> TestClient:
    return TestClient(create_app(env_cls, settings=Settings(log_level="warning", **settings)))


def test_health_metadata_schema():
    with client() as c:
        assert c.get("/health").json() == {"status": "healthy"}
        meta = c.get("/metadata").json()
        assert meta["name"] == "GuessEnv" and meta["description"] == "Guess a secret number."
        ext = meta["envhub"]
        assert ext["protocol"] == 1 and "resume" in ext["extensions"] and ext["auth"] is False
        assert ext["max_message_bytes"] == 16 * 1024 * 1024
        assert ext["tools"][0]["function"]["name"] == "guess"
        schema = c.get("/schema").json()
        assert set(schema) == {"action", "observation", "state"}
        assert "tool_name" in schema["action"]["properties"]
        echo_schema = client(EchoEnv).get("/schema").json()
        assert echo_schema["action"]["required"] == ["message"]
        assert "echoed_message" in echo_schema["observation"]["properties"]


def test_http_episode_is_stateful_across_requests():
    with client() as c:
        first = c.post("/reset", json={"secret": 3, "seed": 1})
        assert first.status_code == 200
        sid = first.json()["session_id"]
        assert first.headers["x-envhub-session"] == sid
        wrong = c.post("/step", json={"session_id": sid, "action": {"tool_name": "guess", "arguments": {"number": 1}}})
        assert wrong.json()["observation"]["text"] == "Wrong." and wrong.json()["done"] is False
        right = c.post("/step", headers={"X-Envhub-Session": sid},
                       json={"action": {"tool_name": "guess", "arguments": {"number": 3}}})
        assert right.json()["reward"] == 1.0 and right.json()["done"] is True
        state = c.get("/state", headers={"X-Envhub-Session": sid}).json()
        assert state["step_count"] == 2 and state["done"] is True
        ended = c.post("/step", json={"session_id": sid, "action": {"text": "again"}})
        assert ended.status_code == 409 and ended.json()["code"] == "EPISODE_ENDED"


def test_http_errors_are_typed():
    with client() as c:
        assert c.post("/step", json={"action": {"text": "x"}}).json()["code"] == "VALIDATION_ERROR"
        lost = c.post("/step", json={"session_id": "nope", "action": {"text": "x"}})
        assert lost.status_code == 404 and lost.json()["code"] == "SESSION_EXPIRED"
        assert c.post("/reset", content=b"{not json").json()["code"] == "INVALID_JSON"
        sid = c.post("/reset", json={}).json()["session_id"]
        bad = c.post("/step", json={"session_id": sid, "action": {"tool": "guess"}})
        assert bad.status_code == 422 and bad.json()["errors"]
        assert c.post("/reset", json={"difficulty": 9}).status_code == 422
        assert "envhub_sessions_active 1" in c.get("/metrics").text  # the failed reset's session is gone


def test_http_sessions_count_against_the_cap():
    with client(max_sessions=1) as c:
        assert c.post("/reset", json={}).status_code == 200
        full = c.post("/reset", json={})
        assert full.status_code == 503 and full.json()["code"] == "CAPACITY_REACHED"


def test_mcp_jsonrpc():
    with client() as c:
        listed = c.post("/mcp", json={"jsonrpc": "2.0", "method": "tools/list", "id": 1}).json()
        assert listed["result"]["tools"][0]["name"] == "guess"
        assert listed["result"]["tools"][0]["inputSchema"]["required"] == ["number"]
        called = c.post("/mcp", json={"jsonrpc": "2.0", "method": "tools/call", "id": 2,
                                      "params": {"name": "guess", "arguments": {"number": 7}}}).json()
        assert called["result"]["content"][0]["text"] == "Correct!" and called["result"]["isError"] is False
        sid = c.post("/reset", json={"secret": 2}).json()["session_id"]
        in_session = c.post("/mcp", json={"jsonrpc": "2.0", "method": "tools/call", "id": 3, "params": {
            "name": "guess", "arguments": {"number": 2}, "session_id": sid}}).json()
        assert in_session["result"]["content"][0]["text"] == "Correct!"
        assert c.get("/state", params={"session_id": sid}).json()["step_count"] == 1
        assert c.post("/mcp", json={"jsonrpc": "2.0", "method": "x/y", "id": 4}).json()["error"]["code"] == -32601
        assert c.post("/mcp", json={}).json() == {"jsonrpc": "2.0", "id": None, "error": {
            "code": -32600, "message": c.post("/mcp", json={}).json()["error"]["message"]}}
        assert c.post("/mcp", content=b"{{").json()["error"]["code"] == -32700
        bad_args = c.post("/mcp", json={"jsonrpc": "2.0", "method": "tools/call", "id": 5,
                                        "params": {"name": "guess", "arguments": {"number": "x"}}}).json()
        assert bad_args["result"]["isError"] is True


def test_metrics_count_sessions_steps_and_errors():
    with client() as c:
        sid = c.post("/reset", json={}).json()["session_id"]
        for _ in range(3):
            c.post("/step", json={"session_id": sid, "action": {"tool_name": "guess", "arguments": {"number": 1}}})
        c.post("/step", json={"session_id": sid, "action": {"nope": 1}})
        text = c.get("/metrics").text
        assert "envhub_sessions_active 1" in text and "envhub_sessions_total 1" in text
        assert "envhub_steps_total 3" in text
        assert 'envhub_errors_total{code="VALIDATION_ERROR"} 1' in text
        assert 'envhub_step_latency_seconds_count 3' in text and 'le="+Inf"} 3' in text


@pytest.mark.parametrize("path", ["/metadata", "/schema", "/metrics", "/state"])
def test_auth_on_every_http_route_but_health(path):
    with client(token="tok") as c:
        assert c.get("/health").status_code == 200
        denied = c.get(path)
        assert denied.status_code == 401 and denied.json()["code"] == "UNAUTHORIZED"
        assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get(path, headers={"Authorization": "Bearer tok"}).status_code != 401
        assert c.get("/metadata", headers={"Authorization": "Bearer tok"}).json()["envhub"]["auth"] is True


def test_openapi_lists_the_stateful_routes_for_openenv_validate():
    with client() as c:
        paths = c.get("/openapi.json").json()["paths"]
        assert {"/reset", "/step", "/state", "/mcp", "/health", "/metadata", "/schema"} <= set(paths)
    with client(http_sessions=False) as c:
        assert not {"/reset", "/step", "/state"} & set(c.get("/openapi.json").json()["paths"])


def test_create_app_refuses_non_env_classes():
    with pytest.raises(TypeError, match="Expected an envhub.Env subclass"):
        create_app(dict)


def test_idle_http_sessions_are_reaped():
    import time
    with client(idle_timeout_s=0.2) as c:
        sid = c.post("/reset", json={}).json()["session_id"]
        time.sleep(0.6)
        gone = c.post("/step", json={"session_id": sid, "action": {"text": "x"}})
        assert gone.status_code == 404 and gone.json()["code"] == "SESSION_EXPIRED"
        assert "envhub_sessions_active 0" in c.get("/metrics").text


def test_connection_logs_mask_tokens_in_websocket_urls():
    import logging

    from envhub.server.transport import RedactSecrets
    record = logging.LogRecord("uvicorn.error", logging.INFO, "", 0, '%s - "WebSocket %s" [accepted]',
                               ("10.0.0.1:5", "/ws?ext=resume&resume=abc&resume_token=R3S&token=T0K"), None)
    RedactSecrets().filter(record)
    assert record.getMessage() == '10.0.0.1:5 - "WebSocket /ws?ext=resume&resume=abc&resume_token=***&token=***" ' \
                                  '[accepted]'
