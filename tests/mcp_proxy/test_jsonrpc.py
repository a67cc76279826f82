"""Tests for mcp_proxy.jsonrpc: classification and the error code of every bad input."""

from __future__ import annotations

import orjson
import pytest

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
