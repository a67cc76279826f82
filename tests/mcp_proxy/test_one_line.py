"""Property tests of the one-line rule (mcp_proxy.jsonrpc.encode / one_line; ADR 0003).

Messages are rendered the ways JSON allows -- any whitespace between tokens
(CR and LF included), any escape in strings, duplicate keys, integers beyond
64 bits -- and the bytes the serve side would hand the tool are read the way
the real tool reads them: the MCP Python SDK's stdio server (a universal-newline
text reader, then ``jsonrpc_message_adapter.validate_json`` per line). What the
tool parses must be exactly the object the policy judged, in one message.
"""

from __future__ import annotations

import io
import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp.types import JSONRPCNotification, JSONRPCRequest, jsonrpc_message_adapter

from mcp_proxy.jsonrpc import (
    INVALID_REQUEST,
    JsonRpcError,
    Kind,
    encode,
    has_line_break,
    one_line,
    sniff,
)

WHITESPACE = st.sampled_from(["", "", " ", "\t", "\n", "\r", "\r\n", " \r ", "\n\n"])
SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "/": "\\/", "\b": "\\b", "\f": "\\f"}
SHORT_ESCAPES.update({"\n": "\\n", "\r": "\\r", "\t": "\\t"})

# Every value JSON can carry; integers reach past 64 bits (orjson judges those as floats).
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _escape_char(draw: st.DrawFn, ch: str) -> str:
    forced = ch in '"\\' or ord(ch) < 0x20
    if not forced and not draw(st.booleans()):
        return ch
    if ch in SHORT_ESCAPES and draw(st.booleans()):
        return SHORT_ESCAPES[ch]
    if ord(ch) > 0xFFFF:  # astral: a surrogate pair
        v = ord(ch) - 0x10000
        return f"\\u{0xD800 + (v >> 10):04x}\\u{0xDC00 + (v & 0x3FF):04X}"
    return f"\\u{ord(ch):04x}"


def _render_string(draw: st.DrawFn, text: str) -> str:
    return '"' + "".join(_escape_char(draw, ch) for ch in text) + '"'


def _render(draw: st.DrawFn, value: Any) -> str:
    """JSON text of ``value`` with drawn whitespace, escapes and decoy duplicate keys."""
    ws = draw(WHITESPACE)
    if isinstance(value, dict):
        items: list[str] = []
        for key, item in value.items():
            if draw(st.integers(0, 4)) == 0:
                # A decoy before the real entry: JSON parsers keep the last one.
                decoy = draw(scalars)
                items.append(
                    f"{_render_string(draw, key)}{draw(WHITESPACE)}:{_render(draw, decoy)}"
                )
            items.append(f"{_render_string(draw, key)}{draw(WHITESPACE)}:{_render(draw, item)}")
        return ws + "{" + draw(WHITESPACE) + ",".join(items) + draw(WHITESPACE) + "}" + ws
    if isinstance(value, list):
        return ws + "[" + ",".join(_render(draw, v) for v in value) + draw(WHITESPACE) + "]" + ws
    if isinstance(value, str):
        return ws + _render_string(draw, value) + ws
    if isinstance(value, float):
        return ws + repr(value) + ws  # repr of a finite float is a JSON number
    return ws + json.dumps(value) + ws


@st.composite
def messages(draw: st.DrawFn) -> tuple[bytes, dict[str, Any]]:
    """A request or notification rendered as raw bytes, and the object it was built from."""
    body: dict[str, Any] = {"jsonrpc": "2.0"}
    if draw(st.booleans()):
        body["id"] = draw(st.integers(min_value=-(2**70), max_value=2**70) | st.text(max_size=8))
    body["method"] = draw(st.sampled_from(["tools/list", "tools/call", "ping", "x/y"]))
    params = draw(st.dictionaries(st.text(max_size=6), values, max_size=4))
    if body["method"] == "tools/call":
        params["name"] = draw(st.sampled_from(["echo", "crash"]))
    body["params"] = params
    return _render(draw, body).encode("utf-8"), body


def tool_reads(wire: bytes) -> list[Any]:
    """What the MCP Python SDK's stdio server parses from ``wire`` written as one line."""
    reader = io.TextIOWrapper(io.BytesIO(wire + b"\n"), encoding="utf-8", errors="replace")
    return [jsonrpc_message_adapter.validate_json(line, by_name=False) for line in reader]


@settings(max_examples=400, deadline=None)
@given(messages())
def test_the_tool_parses_exactly_the_judged_object(case: tuple[bytes, dict[str, Any]]) -> None:
    raw, _built = case
    try:
        judged = sniff(raw)
    except JsonRpcError as exc:
        # Refused (an id beyond 64 bits is judged a float, not an id): nothing is forwarded.
        assert exc.code == INVALID_REQUEST
        return
    wire = encode(judged)
    assert not has_line_break(wire)
    assert orjson.loads(raw) == judged.obj == json.loads(wire)
    (parsed,) = tool_reads(wire)
    assert isinstance(parsed, JSONRPCRequest | JSONRPCNotification)
    assert parsed.method == judged.method
    assert (parsed.params or {}) == (judged.params or {})
    if judged.kind is Kind.REQUEST:
        assert isinstance(parsed, JSONRPCRequest) and parsed.id == judged.id
    # The tools/call the policy saw is the one the tool runs, never a hidden second one.
    if judged.method == "tools/call":
        assert parsed.params is not None and parsed.params["name"] == judged.tool


@settings(max_examples=200, deadline=None)
@given(messages())
def test_one_line_keeps_clean_bytes_and_re_encodes_the_rest(
    case: tuple[bytes, dict[str, Any]],
) -> None:
    raw, _ = case
    try:
        judged = sniff(raw)
    except JsonRpcError:
        return
    out = one_line(raw, judged)
    assert not has_line_break(out)
    if not has_line_break(raw):
        assert out is raw  # the common case costs nothing
    assert orjson.loads(out) == judged.obj


def test_the_reported_smuggle_reaches_the_tool_as_one_tools_list() -> None:
    hidden = b'{"jsonrpc":"2.0","id":777,"method":"tools/call","params":{"name":"crash"}}'
    for brk in (b"\r", b"\n", b"\r\n"):
        raw = b'{"jsonrpc":"2.0","id":776,"method":"tools/list","params":{"x":%s%s%s}}' % (
            brk,
            hidden,
            brk,
        )
        judged = sniff(raw)
        assert (judged.method, judged.tool) == ("tools/list", None)
        (parsed,) = tool_reads(encode(judged))
        assert isinstance(parsed, JSONRPCRequest) and parsed.method == "tools/list"
        # Forwarded raw, the same bytes would have made the tool read more than one line.
        reader = io.TextIOWrapper(io.BytesIO(raw + b"\n"), encoding="utf-8")
        assert len(list(reader)) > 1


@given(st.lists(messages(), min_size=1, max_size=3))
@settings(max_examples=50, deadline=None)
def test_batches_are_refused(cases: list[tuple[bytes, dict[str, Any]]]) -> None:
    batch = b"[" + b",".join(raw for raw, _ in cases) + b"]"
    with pytest.raises(JsonRpcError) as refused:
        sniff(batch)
    assert refused.value.code == INVALID_REQUEST


def test_too_deep_to_re_encode_is_refused_not_forwarded() -> None:
    deep = b"[" * 300 + b"]" * 300
    judged = sniff(b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"a":%s}}' % deep)
    with pytest.raises(JsonRpcError) as refused:
        encode(judged)
    assert (refused.value.code, refused.value.request_id) == (INVALID_REQUEST, 1)
