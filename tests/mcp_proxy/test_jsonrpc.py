"""Tests for mcp_proxy.jsonrpc: classification and the error code of every bad input."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcp_proxy.jsonrpc import (
    INVALID_REQUEST,
    PARSE_ERROR,
    JsonRpcError,
    Kind,
    error_reply,
    sniff,
)


def test_request_fields() -> None:
    s = sniff(
        b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":'
        b'{"name":"echo","arguments":{"text":"x"},"_meta":{"progressToken":"p1"}}}'
    )
    assert (s.kind, s.id, s.method, s.tool, s.progress_token) == (
        Kind.REQUEST,
        7,
        "tools/call",
        "echo",
        "p1",
    )
    assert s.params["arguments"] == {"text": "x"}


def test_notification_response_error() -> None:
    n = sniff(b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
    assert (n.kind, n.id, n.method) == (Kind.NOTIFICATION, None, "notifications/initialized")
    r = sniff(b'{"jsonrpc":"2.0","id":"a","result":{"tools":[]}}')
    assert (r.kind, r.id, r.result) == (Kind.RESPONSE, "a", {"tools": []})
    e = sniff(b'{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"x"}}')
    assert (e.kind, e.id) == (Kind.ERROR, None)


@pytest.mark.parametrize(
    ("line", "code", "request_id"),
    [
        (b"{not json", PARSE_ERROR, None),
        (b"", PARSE_ERROR, None),
        (b"\xff\xfe", PARSE_ERROR, None),
        (b"[1,2]", INVALID_REQUEST, None),
        (b'"str"', INVALID_REQUEST, None),
        (b'{"id":1,"method":"ping"}', INVALID_REQUEST, 1),
        (b'{"jsonrpc":"1.0","id":2,"method":"ping"}', INVALID_REQUEST, 2),
        (b'{"jsonrpc":"2.0","id":3,"method":5}', INVALID_REQUEST, 3),
        (b'{"jsonrpc":"2.0","id":true,"method":"ping"}', INVALID_REQUEST, None),
        (b'{"jsonrpc":"2.0","id":1.5,"method":"ping"}', INVALID_REQUEST, None),
        (b'{"jsonrpc":"2.0","id":null,"method":"ping"}', INVALID_REQUEST, None),
        (b'{"jsonrpc":"2.0","id":4,"method":"ping","params":3}', INVALID_REQUEST, 4),
        (b'{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{}}', INVALID_REQUEST, 5),
        (b'{"jsonrpc":"2.0","id":6,"method":"tools/call"}', INVALID_REQUEST, 6),
        (b'{"jsonrpc":"2.0","result":{}}', INVALID_REQUEST, None),
        (b'{"jsonrpc":"2.0","id":8,"error":"bad"}', INVALID_REQUEST, 8),
        (b'{"jsonrpc":"2.0","id":9}', INVALID_REQUEST, 9),
    ],
)
def test_bad_input_gets_the_specific_code(line: bytes, code: int, request_id: object) -> None:
    with pytest.raises(JsonRpcError) as info:
        sniff(line)
    assert info.value.code == code
    assert info.value.request_id == request_id


def test_error_reply_shape() -> None:
    reply = orjson.loads(error_reply(3, -32001, "no", {"k": 1}))
    assert reply == {
        "jsonrpc": "2.0",
        "id": 3,
        "error": {"code": -32001, "message": "no", "data": {"k": 1}},
    }
    assert orjson.loads(error_reply(None, PARSE_ERROR, "Parse error"))["id"] is None


def _reference(line: bytes) -> tuple[object, ...]:
    """The classification rules written plainly (isinstance everywhere), to check sniff's
    exact-type fast path against: (kind, id, method, tool, token) or (code, message, id)."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return (PARSE_ERROR, "Parse error", None)

    def valid(v: object) -> bool:
        return isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool))

    bad = "Invalid Request: "
    if not isinstance(obj, dict):
        return (INVALID_REQUEST, bad + "not a JSON object", None)
    rid = obj.get("id") if valid(obj.get("id")) else None
    if obj.get("jsonrpc") != "2.0":
        return (INVALID_REQUEST, bad + 'jsonrpc must be "2.0"', rid)
    if "id" in obj and obj["id"] is not None and rid is None:
        return (INVALID_REQUEST, bad + "id must be a string or integer", None)
    method = obj.get("method")
    if method is not None:
        if not isinstance(method, str):
            return (INVALID_REQUEST, bad + "method must be a string", rid)
        params = obj.get("params")
        if params is not None and not isinstance(params, dict | list):
            return (INVALID_REQUEST, bad + "params must be an object", rid)
        tool = token = None
        if method == "tools/call":
            if not isinstance(params, dict) or not isinstance(params.get("name"), str):
                return (INVALID_REQUEST, bad + "tools/call needs params.name", rid)
            tool = params["name"]
        if isinstance(params, dict) and isinstance(params.get("_meta"), dict):
            candidate = params["_meta"].get("progressToken")
            token = candidate if valid(candidate) else None
        if "id" not in obj:
            return (Kind.NOTIFICATION, None, method, tool, token)
        if rid is None:
            return (INVALID_REQUEST, bad + "request id must not be null", None)
        return (Kind.REQUEST, rid, method, tool, token)
    if "result" in obj:
        if rid is None:
            return (INVALID_REQUEST, bad + "response without an id", None)
        return (Kind.RESPONSE, rid, None, None, None)
    if "error" in obj:
        if not isinstance(obj["error"], dict):
            return (INVALID_REQUEST, bad + "error must be an object", rid)
        return (Kind.ERROR, rid, None, None, None)
    return (INVALID_REQUEST, bad + "no method, result or error", rid)


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=False),
    st.sampled_from(["2.0", "1.0", "ping", "tools/call", "", "a"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["name", "_meta", "progressToken", "x"]), inner, max_size=3
        )
    ),
    max_leaves=6,
)
_messages = st.dictionaries(
    st.sampled_from(["jsonrpc", "id", "method", "params", "result", "error"]), _values, max_size=6
)


@given(st.one_of(_messages, _values))
@settings(max_examples=400, deadline=None)
def test_sniff_agrees_with_the_plain_rules(value: object) -> None:
    line = orjson.dumps(value)
    expected = _reference(line)
    try:
        s = sniff(line)
    except JsonRpcError as exc:
        assert (exc.code, str(exc), exc.request_id) == expected
    else:
        assert (s.kind, s.id, s.method, s.tool, s.progress_token) == expected
