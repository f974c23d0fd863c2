"""The pure session protocol: every inbound frame's effect, without sockets."""

import json

import msgpack
import pytest

from envhub.errors import EnvHubError, ErrorCode
from envhub.protocol import CLOSE_NORMAL, Call, Close, Reply, SessionProtocol, negotiate
from envhub.types import Observation, StepResult, ToolSpec


def plain() -> SessionProtocol:
    return SessionProtocol("s1", extensions=None)


def ext(*names: str, **kw) -> SessionProtocol:
    return SessionProtocol("s1", extensions=frozenset(names), resume_token="tok", **kw)


def code_of(effect) -> str:
    assert isinstance(effect, Reply), effect
    assert effect.envelope["type"] == "error"
    return effect.envelope["data"]["code"]


@pytest.mark.parametrize("frame, code", [
    ("not json", ErrorCode.INVALID_JSON),
    (b"\x00\x01binary", ErrorCode.INVALID_JSON),
    ("[1, 2]", ErrorCode.VALIDATION_ERROR),
    ('"a string"', ErrorCode.VALIDATION_ERROR),
    ("{}", ErrorCode.UNKNOWN_TYPE),
    ('{"type": 5}', ErrorCode.UNKNOWN_TYPE),
    ('{"type": "bogus"}', ErrorCode.UNKNOWN_TYPE),
    ('{"type": "tools"}', ErrorCode.UNKNOWN_TYPE),  # not negotiated: plain OpenEnv behaviour
    ('{"type": "reset", "data": [1]}', ErrorCode.VALIDATION_ERROR),
    ('{"type": "step", "data": {}, "extra": 1}', ErrorCode.VALIDATION_ERROR),
    ('{"type": "reset", "seeed": 5}', ErrorCode.VALIDATION_ERROR),  # a typo'd key beside 'type' alone
    ('{"type": "step", "dta": {"text": "x"}}', ErrorCode.VALIDATION_ERROR),
    ('{"type": "step", "data": {}, "id": [1]}', ErrorCode.VALIDATION_ERROR),
    ('{"type": "step", "data": {}, "timeout_s": -1}', ErrorCode.VALIDATION_ERROR),
    ('{"type": "step", "data": {}, "timeout_s": "soon"}', ErrorCode.VALIDATION_ERROR),
    ('{"type": "reset", "timeout_s": Infinity}', ErrorCode.VALIDATION_ERROR),  # a deadline is a finite number
])
def test_bad_frames_become_error_replies_and_never_raise(frame, code):
    p = plain()
    assert code_of(p.receive(frame)) == code
    assert isinstance(p.receive('{"type": "state"}'), Call)  # the session is still usable


def test_unknown_type_message_matches_openenv_wording():
    assert plain().receive('{"type": "bogus"}').envelope["data"]["message"] == "Unknown message type: bogus"


def test_requests_map_to_runner_calls():
    p = plain()
    reset = p.receive('{"type": "reset", "data": {"seed": 3}}')
    assert (reset.op, reset.payload, reset.timeout_s) == ("reset", {"seed": 3}, None)
    assert p.receive('{"type": "reset"}').payload == {}
    step = p.receive('{"type": "step", "data": {"text": "hi"}}')
    assert (step.op, step.payload) == ("step", {"text": "hi"})
    assert p.receive('{"type": "state"}').op == "state"
    assert p.receive('{"type": "mcp", "data": {"jsonrpc": "2.0"}}').op == "mcp"


def test_close_closes_normally_without_a_reply():
    p = plain()
    effect = p.receive('{"type": "close"}')
    assert isinstance(effect, Close) and effect.code == CLOSE_NORMAL and p.closed


def test_oversized_frame_is_refused_but_session_survives():
    p = SessionProtocol("s", extensions=None, max_message_bytes=2048)
    big = json.dumps({"type": "step", "data": {"text": "x" * 4096}})
    reply = p.receive(big)
    assert code_of(reply) == ErrorCode.MESSAGE_TOO_LARGE
    assert reply.envelope["data"]["max_message_bytes"] == 2048
    assert isinstance(p.receive('{"type": "step", "data": {"text": "x"}}'), Call)


def test_request_ids_are_echoed_on_replies_and_errors():
    p = ext("request_id")
    call = p.receive('{"type": "step", "data": {"text": "a"}, "id": "r1"}')
    assert call.request_id == "r1"
    reply = p.complete(call, StepResult(observation=Observation(text="ok"), reward=1.0))
    assert reply["id"] == "r1" and reply["type"] == "observation" and reply["data"]["reward"] == 1.0
    assert p.receive('{"type": "bogus", "id": 7}').envelope["id"] == 7
    err = p.fail(p.receive('{"type": "step", "data": {}, "id": 8}'), EnvHubError("boom", code="EXECUTION_ERROR"))
    assert err["id"] == 8 and err["data"]["code"] == "EXECUTION_ERROR"


def test_hello_only_for_opted_in_clients():
    assert plain().hello() is None
    hello = ext("msgpack", "resume").hello(resumed=True)
    assert hello["type"] == "hello"
    assert hello["data"]["extensions"] == ["msgpack", "resume"]
    assert hello["data"]["resume_token"] == "tok" and hello["data"]["resumed"] is True
    assert ext("request_id").hello()["data"]["resume_token"] is None  # no resume, no token


def test_negotiation_ignores_unknown_extensions():
    assert negotiate("request_id, msgpack,warp") == {"request_id", "msgpack"}
    assert negotiate("") == frozenset()
    assert negotiate(None) is None


def test_msgpack_sessions_decode_binary_and_encode_binary():
    p = ext("msgpack")
    call = p.receive(msgpack.packb({"type": "step", "data": {"text": "hi"}}))
    assert call.op == "step"
    out = p.encode(p.complete(call, StepResult(observation=Observation(images=[b"\x89PNG"]))))
    assert isinstance(out, bytes)
    assert msgpack.unpackb(out)["data"]["observation"]["images"] == [b"\x89PNG"]  # raw bytes, no base64
    assert code_of(p.receive(b"\xc1")) == ErrorCode.INVALID_JSON


def test_json_replies_base64_images():
    p = plain()
    call = p.receive('{"type": "step", "data": {"text": "x"}}')
    text = p.encode(p.complete(call, StepResult(observation=Observation(images=[b"\x89PNG"]))))
    assert json.loads(text)["data"]["observation"]["images"] == ["iVBORw=="]


def test_tools_extension_lists_openai_specs_locally():
    p = SessionProtocol("s", extensions=frozenset({"tools"}), tools=[ToolSpec("guess", "Guess.")])
    reply = p.receive('{"type": "tools"}')
    assert reply.envelope["data"]["tools"][0]["function"]["name"] == "guess"


def test_client_timeout_only_tightens_the_server_deadline():
    p = SessionProtocol("s", extensions=frozenset({"step_timeout"}), step_timeout_s=10.0)
    assert p.receive('{"type": "step", "data": {}, "timeout_s": 2}').timeout_s == 2.0
    assert p.receive('{"type": "step", "data": {}, "timeout_s": 60}').timeout_s == 10.0
    assert p.receive('{"type": "step", "data": {}}').timeout_s == 10.0


def test_timeout_ends_the_episode_until_a_reset_on_a_fresh_env():
    p = plain()
    call = p.receive('{"type": "step", "data": {}, "timeout_s": 0.5}')
    reply = p.timed_out(call, episode_id="ep", step_count=3)
    assert reply["data"]["code"] == ErrorCode.STEP_TIMEOUT
    assert code_of(p.receive('{"type": "step", "data": {}}')) == ErrorCode.EPISODE_ENDED
    state = p.receive('{"type": "state"}')
    assert state.envelope["data"] == {"episode_id": "ep", "step_count": 3, "done": True, "timed_out": True}
    reset = p.receive('{"type": "reset"}')
    assert reset.fresh_env
    p.env_replaced()
    assert not p.receive('{"type": "step", "data": {}}').fresh_env


def test_resume_replays_the_last_reply_without_re_executing():
    p = ext("resume", "request_id")
    call = p.receive('{"type": "step", "data": {"text": "a"}, "id": 41}')
    first = p.complete(call, StepResult(reward=2.0))
    again = p.receive('{"type": "step", "data": {"text": "a"}, "id": 41}')
    assert isinstance(again, Reply) and again.envelope == first
    assert isinstance(p.receive('{"type": "step", "data": {"text": "a"}, "id": 42}'), Call)


def test_ids_are_not_replayed_without_resume():
    p = ext("request_id")
    p.complete(p.receive('{"type": "state", "id": 1}'), {"step_count": 0})
    assert isinstance(p.receive('{"type": "state", "id": 1}'), Call)


def test_reset_keys_must_be_strings_in_msgpack():
    p = ext("msgpack")
    assert code_of(p.receive(msgpack.packb({"type": "reset", "data": {1: 2}}))) == ErrorCode.VALIDATION_ERROR
