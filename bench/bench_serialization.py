"""Encodings beside json / orjson / struct baselines (docs/DESIGN.md "Performance targets").

Rows: ``canonical_json_bytes`` (RFC 8785) on the small commitment-sized object
the node signs, beside the orjson call its fast path wraps and stdlib ``json``;
the float path beside ``json``; link frames (``talos.link.wire``) and tunnel
frames (``mcp_proxy.tunnel_wire``) beside a bare ``struct`` pack/unpack of the
same layout; and the boundaries: JSON-RPC sniffing (``mcp_proxy.jsonrpc``) and
the pydantic ``NodeConfig`` beside a plain ``orjson.loads``.
"""

from __future__ import annotations

import json
import struct
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import orjson
from _common import Suite

from mcp_proxy import jsonrpc, tunnel_wire
from talos.config import NodeConfig
from talos.link import wire
from talos_sdk.canonical import canonical_json_bytes

DID_A = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
DID_B = "did:key:z6MkpTHR8VNsBxYAAWHut2Geadd9jSwuBV8xRoAnwWsdvktH"
# What a sender signs for each message (docs/DESIGN.md "Signing"): small, all strings and ints.
SMALL: dict[str, Any] = {
    "type": "talos.msg/1",
    "sender": DID_A,
    "recipient": DID_B,
    "seq": 4711,
    "ts": 1_732_000_000_123,
    "sha256": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
}
WITH_FLOATS: dict[str, Any] = {
    **SMALL,
    "latency": 0.000123,
    "ratio": 1.5,
    "scores": [0.1, 2e-7, 1e21],
}
TOOL_CALL = (
    b'{"jsonrpc":"2.0","id":17,"method":"tools/call","params":{"name":"get_current_time",'
    b'"arguments":{"timezone":"Europe/Paris"},"_meta":{"progressToken":17}}}'
)
CONFIG = orjson.dumps(
    {
        "listen": "127.0.0.1:7400",
        "peers": [f"ws://127.0.0.1:7401#{DID_B}"],
        "allow": [DID_B],
        "api_port": 7480,
        "seal_count": 128,
        "pq": True,
    }
)
BODY = bytes(100)  # a sealed 35-byte message with its ratchet header and tag
_MSG_HEAD = struct.Struct(">BQ")
_TUNNEL_HEAD = struct.Struct(">BBIII")  # version, kind, session, count, first length


def _json_canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _raw_msg_encode(seq: int, body: bytes) -> bytes:
    return _MSG_HEAD.pack(0x20, seq) + body


def _raw_msg_decode(data: bytes) -> tuple[int, bytes]:
    return _MSG_HEAD.unpack_from(data)[1], data[_MSG_HEAD.size :]


def _raw_tunnel_encode(session: int, message: bytes) -> bytes:
    return _TUNNEL_HEAD.pack(1, 2, session, 1, len(message)) + message


def _raw_tunnel_decode(data: bytes) -> tuple[int, bytes]:
    return _TUNNEL_HEAD.unpack_from(data)[2], data[_TUNNEL_HEAD.size :]


def bench_canonical(suite: Suite) -> None:
    """RFC 8785 bytes: the fast path (ints and strings) and the exact path (floats)."""
    assert canonical_json_bytes(SMALL) == _json_canonical(SMALL)
    suite.pair(
        "canonical.small",
        "canonical_json_bytes, small object",
        partial(orjson.dumps, SMALL, option=orjson.OPT_SORT_KEYS),
        partial(canonical_json_bytes, SMALL),
        raw_label="orjson.dumps(OPT_SORT_KEYS), small object",
    )
    suite.floor(
        "json.small", "json.dumps(sort_keys) compact, small object", partial(_json_canonical, SMALL)
    )
    suite.pair(
        "canonical.floats",
        "canonical_json_bytes, object with floats",
        partial(_json_canonical, WITH_FLOATS),
        partial(canonical_json_bytes, WITH_FLOATS),
        raw_label="json.dumps(sort_keys) compact, object with floats",
    )


def bench_frames(suite: Suite) -> None:
    """Binary frames: our encoders/decoders with their checks vs a bare struct pack."""
    msg = wire.Msg(4711, BODY)
    msg_bytes = wire.encode(msg)
    assert _raw_msg_encode(4711, BODY) == msg_bytes
    suite.pair(
        "wire.msg.encode",
        "talos.link.wire.encode(Msg), 100 B body",
        partial(_raw_msg_encode, 4711, BODY),
        partial(wire.encode, msg),
        raw_label="struct pack + concat, Msg layout",
    )
    suite.pair(
        "wire.msg.decode",
        "talos.link.wire.decode(Msg), 100 B body",
        partial(_raw_msg_decode, msg_bytes),
        partial(wire.decode, msg_bytes),
        raw_label="struct unpack + slice, Msg layout",
    )
    kind = tunnel_wire.FrameKind.MESSAGES
    frame = tunnel_wire.encode_frame(kind, 7, [TOOL_CALL])
    assert _raw_tunnel_encode(7, TOOL_CALL) == frame
    suite.pair(
        "tunnel_wire.encode",
        "mcp_proxy.tunnel_wire.encode_frame, 1 tools/call",
        partial(_raw_tunnel_encode, 7, TOOL_CALL),
        partial(tunnel_wire.encode_frame, kind, 7, [TOOL_CALL]),
        raw_label="struct pack + concat, tunnel frame layout",
    )
    suite.pair(
        "tunnel_wire.decode",
        "mcp_proxy.tunnel_wire.decode_frame, 1 tools/call",
        partial(_raw_tunnel_decode, frame),
        partial(tunnel_wire.decode_frame, frame),
        raw_label="struct unpack + slice, tunnel frame layout",
    )


def bench_boundaries(suite: Suite) -> None:
    """Parsing at the boundaries: JSON-RPC sniffing and the pydantic config model."""
    suite.pair(
        "jsonrpc.sniff",
        "mcp_proxy.jsonrpc.sniff, tools/call",
        partial(orjson.loads, TOOL_CALL),
        partial(jsonrpc.sniff, TOOL_CALL),
        raw_label="orjson.loads, tools/call",
    )
    suite.floor("json.loads.toolcall", "json.loads, tools/call", partial(json.loads, TOOL_CALL))
    suite.pair(
        "pydantic.nodeconfig",
        "NodeConfig.model_validate_json (pydantic)",
        partial(orjson.loads, CONFIG),
        partial(NodeConfig.model_validate_json, CONFIG),
        raw_label="orjson.loads, same config",
    )


def main() -> None:
    """Register every row, run them, print the table, write the results JSON."""
    suite = Suite.create(__file__)
    bench_canonical(suite)
    bench_frames(suite)
    bench_boundaries(suite)
    suite.finish()


if __name__ == "__main__":
    main()
