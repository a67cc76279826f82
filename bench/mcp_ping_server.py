"""A minimal stdio MCP server for the tunnel bench (MCP spec "Transports: stdio").

Answers ``initialize`` (echoing the client's protocol version), ``ping``,
``tools/list`` and ``tools/call`` of one ``echo`` tool; notifications are
ignored, any other request gets -32601. It is deliberately a tight blocking
loop, answering every request of one ``read`` with one ``write``, so the tool
itself is never what the bench measures: raw stdio against it is the floor.
"""

from __future__ import annotations

import os
from typing import Any

import orjson

ECHO_TOOL = {
    "name": "echo",
    "description": "Return the text unchanged.",
    "inputSchema": {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
    },
}


def answer(msg: Any) -> bytes | None:
    """The reply line to one JSON-RPC message, or None for a notification / reply."""
    if not isinstance(msg, dict) or "id" not in msg or "method" not in msg:
        return None
    method = msg["method"]
    params = msg.get("params") or {}
    result: Any
    if method == "ping":
        result = {}
    elif method == "initialize":
        result = {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "bench-ping", "version": "1"},
        }
    elif method == "tools/list":
        result = {"tools": [ECHO_TOOL]}
    elif method == "tools/call" and params.get("name") == "echo":
        text = str((params.get("arguments") or {}).get("text", ""))
        result = {"content": [{"type": "text", "text": text}], "isError": False}
    else:
        err = {"code": -32601, "message": f"Method not found: {method}"}
        return orjson.dumps({"jsonrpc": "2.0", "id": msg["id"], "error": err}) + b"\n"
    return orjson.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}) + b"\n"


def main() -> None:
    """Serve stdin/stdout until stdin closes."""
    pending = b""
    while chunk := os.read(0, 1 << 16):
        *lines, pending = (pending + chunk).split(b"\n")
        out = []
        for line in lines:
            if not line.strip():
                continue
            try:
                reply = answer(orjson.loads(line))
            except orjson.JSONDecodeError:
                reply = (
                    b'{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"Parse error"}}\n'
                )
            if reply is not None:
                out.append(reply)
        data = memoryview(b"".join(out))
        while data:
            data = data[os.write(1, data) :]


if __name__ == "__main__":
    main()
