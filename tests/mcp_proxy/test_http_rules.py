"""Pure rules of the HTTP front: era classification, Origin/CORS, SSE exchanges."""

from __future__ import annotations

import base64

import orjson
import pytest
from multidict import CIMultiDict

from mcp_proxy.http_cors import OriginRules
from mcp_proxy.http_rules import (
    HEADER_MISMATCH,
    INVALID_PARAMS,
    SUPPORTED_VERSIONS,
    UNSUPPORTED_VERSION,
    Era,
    Rejection,
    classify,
)
from mcp_proxy.http_sse import Exchange, parse_event_id
from mcp_proxy.jsonrpc import sniff

MODERN = "2026-07-28"
META = {
    "io.modelcontextprotocol/protocolVersion": MODERN,
    "io.modelcontextprotocol/clientCapabilities": {},
}


def call(method: str = "tools/call", **params: object) -> bytes:
    body = {"jsonrpc": "2.0", "id": 7, "method": method, "params": {"_meta": META, **params}}
    return orjson.dumps(body)


def headers(**values: str) -> CIMultiDict[str]:
    return CIMultiDict({k.replace("_", "-"): v for k, v in values.items()})


def test_stateless_request_with_matching_headers() -> None:
    msg = sniff(call(name="echo"))
    h = headers(MCP_Protocol_Version=MODERN, Mcp_Method="tools/call", Mcp_Name="echo")
    assert classify(h, msg, False) is Era.STATELESS
    wrapped = "=?base64?" + base64.b64encode("échø".encode()).decode() + "?="
    h = headers(MCP_Protocol_Version=MODERN, Mcp_Method="tools/call", Mcp_Name=wrapped)
    assert classify(h, sniff(call(name="échø")), False) is Era.STATELESS


@pytest.mark.parametrize(
    ("h", "body", "code"),
    [
        ({"Mcp_Method": "tools/call", "Mcp_Name": "echo"}, call(name="echo"), HEADER_MISMATCH),
        (
            {"MCP_Protocol_Version": MODERN, "Mcp_Method": "tools/list", "Mcp_Name": "echo"},
            call(name="echo"),
            HEADER_MISMATCH,
        ),
        (
            {"MCP_Protocol_Version": MODERN, "Mcp_Method": "tools/call", "Mcp_Name": "other"},
            call(name="echo"),
            HEADER_MISMATCH,
        ),
        (
            {"MCP_Protocol_Version": MODERN, "Mcp_Method": "tools/list"},
            b'{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{}}',
            INVALID_PARAMS,
        ),
        ({"MCP_Protocol_Version": "2099-01-01"}, call(name="echo"), UNSUPPORTED_VERSION),
    ],
)
def test_bad_requests_are_refused_with_400(h: dict[str, str], body: bytes, code: int) -> None:
    verdict = classify(headers(**h), sniff(body), False)
    assert isinstance(verdict, Rejection)
    assert verdict.status == 400 and verdict.code == code
    if code == UNSUPPORTED_VERSION:
        assert verdict.data == {"supported": list(SUPPORTED_VERSIONS), "requested": "2099-01-01"}


def test_a_missing_method_header_is_named_as_missing() -> None:
    h = headers(MCP_Protocol_Version=MODERN, Mcp_Name="echo")
    verdict = classify(h, sniff(call(name="echo")), False)
    assert isinstance(verdict, Rejection) and verdict.code == HEADER_MISMATCH
    assert verdict.message == "mcp-method header is missing"


def test_legacy_requests() -> None:
    init = sniff(b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}')
    assert classify(headers(), init, False) is Era.LEGACY
    ping = sniff(b'{"jsonrpc":"2.0","id":2,"method":"ping"}')
    assert classify(headers(MCP_Protocol_Version="2025-11-25"), ping, True) is Era.LEGACY
    assert classify(headers(MCP_Protocol_Version=MODERN), None, False) is Era.STATELESS
    assert classify(headers(), None, True) is Era.LEGACY
    unsupported = classify(headers(MCP_Protocol_Version="bogus"), None, True)
    assert isinstance(unsupported, Rejection) and unsupported.code == UNSUPPORTED_VERSION


def test_origin_rules() -> None:
    default = OriginRules()
    assert default.admits(None) and default.admits("http://localhost:5173")
    assert not default.admits("https://evil.example") and not default.admits("null")
    assert default.cors("http://localhost:5173") == {}  # admitted, but no CORS without a list
    rules = OriginRules(["http://127.0.0.1:8001"])
    assert rules.admits("http://127.0.0.1:8001") and not rules.admits("http://127.0.0.1:8002")
    assert rules.cors("http://127.0.0.1:8001")["Access-Control-Allow-Origin"] == (
        "http://127.0.0.1:8001"
    )
    pre = {
        "Origin": "http://127.0.0.1:8001",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, mcp-protocol-version",
    }
    ok = rules.preflight(pre)
    assert ok is not None and "POST" in ok["Access-Control-Allow-Methods"]
    assert rules.preflight({**pre, "Origin": "http://127.0.0.1:8002"}) is None
    assert rules.preflight({**pre, "Access-Control-Request-Method": "PUT"}) is None
    assert rules.preflight({**pre, "Access-Control-Request-Headers": "x-evil"}) is None
    for bad in ("127.0.0.1:8001", "http://127.0.0.1:8001/path", "ftp://x"):
        with pytest.raises(ValueError, match="allow-origin"):
            OriginRules([bad])


async def test_exchange_replays_after_an_event_id() -> None:
    exchange = Exchange("3", keep=2)
    first = exchange.attach()
    exchange.emit(b"a")
    exchange.emit(b"b")
    exchange.emit(b"c")
    assert [first.get_nowait() for _ in range(3)] == [(1, b"a"), (2, b"b"), (3, b"c")]
    exchange.detach(first)
    assert not exchange.listening
    exchange.finish()
    again = exchange.attach(after=2)
    assert [again.get_nowait() for _ in range(2)] == [(3, b"c"), None]
    assert parse_event_id("3-2") == ("3", 2)
    for bad in ("3", "-2", "3-x", "", "1-\u00b2", "1-" + "9" * 5000, "1- 2", "1-+2"):
        assert parse_event_id(bad) is None  # not a 500: "²" and 5,000 digits broke int()


async def test_a_stream_nobody_reads_is_cut_and_the_replay_log_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mcp_proxy.http_sse as sse

    monkeypatch.setattr(sse, "STREAM_BUFFER_MAX", 100)
    monkeypatch.setattr(sse, "REPLAY_BYTES", 130)
    exchange = Exchange("7")
    queue = exchange.attach()
    exchange.emit(b"a" * 60)
    exchange.taken(queue.get_nowait())  # the response wrote the first one
    exchange.emit(b"b" * 60)
    exchange.emit(b"c" * 60)  # 120 bytes would wait unread: the response is ended
    assert not exchange.listening and exchange.queued == 0
    assert [queue.get_nowait()] == [None]
    # What the client missed stays resumable: the newest of it that one stream may hold.
    again = exchange.attach(after=1)
    assert again.get_nowait() == (3, b"c" * 60) and again.empty() and exchange.queued == 60
    exchange.emit(b"d" * 60)
    assert [seq for seq, _ in exchange.events] == [3, 4]
