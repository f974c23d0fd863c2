"""JSON-RPC 2.0 for ``POST /mcp`` and the WebSocket ``mcp`` message: ``initialize``, ``tools/list``, ``tools/call``.

A ``tools/call`` runs the env's ``@tool`` through the session's runner (so rewards and
episode bookkeeping apply); over HTTP without a session it runs in a throwaway env.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from envhub.env import Env, EnvRunner
from envhub.errors import EnvHubError
from envhub.protocol import SERVER_NAME

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
SERVER_ERROR = -32000
MCP_PROTOCOL_VERSION = "2025-03-26"


def rpc_error(code: int, message: str, rpc_id: Any = None) -> dict[str, Any]:
    """A JSON-RPC error response."""
    return {"jsonrpc": "2.0", "id": rpc_id, "error": {"code": code, "message": message}}


def _result(rpc_id: Any, result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "result": result}


RunnerFactory = Callable[[], Awaitable[EnvRunner]]


async def handle_jsonrpc(request: Any, env_cls: type[Env], *, runner: EnvRunner | None = None,
                         new_runner: RunnerFactory | None = None) -> dict[str, Any]:
    """Answer one JSON-RPC request.

    ``tools/call`` runs on ``runner`` (a session's) or, when None, on a throwaway runner made by
    ``new_runner`` that is reset before and closed after the call.
    """
    if not isinstance(request, dict) or request.get("jsonrpc") != "2.0" or not isinstance(request.get("method"), str):
        rpc_id = request.get("id") if isinstance(request, dict) else None
        return rpc_error(INVALID_REQUEST, "Invalid Request: expected {\"jsonrpc\": \"2.0\", \"method\": str, "
                                          "\"params\": {...}, \"id\": ...}.", rpc_id)
    rpc_id, method = request.get("id"), request["method"]
    params = request.get("params") or {}
    if not isinstance(params, dict):
        return rpc_error(INVALID_PARAMS, f"Expected params to be an object, got {type(params).__name__}.", rpc_id)
    if method == "initialize":
        return _result(rpc_id, {"protocolVersion": MCP_PROTOCOL_VERSION, "capabilities": {"tools": {}},
                                "serverInfo": {"name": env_cls.metadata()["name"], "version": SERVER_NAME}})
    if method == "tools/list":
        return _result(rpc_id, {"tools": [spec.to_mcp() for spec in env_cls.tools()]})
    if method == "tools/call":
        return await _call_tool(rpc_id, params, env_cls, runner, new_runner)
    return rpc_error(METHOD_NOT_FOUND, f"Method not found: {method!r}; supported: initialize, tools/list, "
                                       "tools/call.", rpc_id)


async def _call_tool(rpc_id: Any, params: dict[str, Any], env_cls: type[Env],
                     runner: EnvRunner | None, new_runner: RunnerFactory | None) -> dict[str, Any]:
    name, arguments = params.get("name"), params.get("arguments") or {}
    names = [spec.name for spec in env_cls.tools()]
    if name not in names:
        return rpc_error(INVALID_PARAMS, f"Unknown tool {name!r}; available: {names}.", rpc_id)
    if not isinstance(arguments, dict):
        return rpc_error(INVALID_PARAMS, f"Expected arguments to be an object, got {type(arguments).__name__}.",
                         rpc_id)
    throwaway = runner is None
    try:
        if runner is None:
            runner = await new_runner() if new_runner is not None else EnvRunner(env_cls())
            await runner.reset()
        result = await runner.step({"tool_name": name, "arguments": arguments})
    except EnvHubError as exc:
        return rpc_error(SERVER_ERROR, f"{exc.code}: {exc.message}", rpc_id)
    finally:
        if throwaway and runner is not None:
            await runner.close()
    obs = result.observation
    return _result(rpc_id, {"content": [{"type": "text", "text": obs.text}],
                            "structuredContent": result.to_wire(), "isError": "tool_error" in result.info})
