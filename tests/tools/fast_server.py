"""A minimal, fast stdio MCP server (initialize, ping, tools/list, tools/call echo).

The SDK's MCPServer costs ~1 ms per request by itself; benches of the tunnel
need a tool whose own cost is near zero so the tunnel's overhead shows.
"""

from __future__ import annotations

import sys

import orjson

TOOLS = [
    {
        "name": "echo",
        "description": "Return the text unchanged.",
        "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}},
    }
]


def answer(msg: dict[str, object]) -> dict[str, object] | None:
    method = msg.get("method")
    if "id" not in msg:
        return None
    rid = msg["id"]
    params = msg.get("params") or {}
    assert isinstance(params, dict)
    if method == "initialize":
        result: object = {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "fast", "version": "1"},
        }
    elif method == "ping":
        result = {}
    elif method == "tools/list":
        result = {"tools": TOOLS}
    elif method == "tools/call" and params.get("name") == "echo":
        text = (params.get("arguments") or {}).get("text", "")
        result = {"content": [{"type": "text", "text": text}], "isError": False}
    else:
        return {
            "jsonrpc": "2.0",
            "id": rid,
            "error": {"code": -32601, "message": "Method not found"},
        }
    return {"jsonrpc": "2.0", "id": rid, "result": result}


def main() -> None:
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        reply = answer(orjson.loads(line))
        if reply is not None:
            out.write(orjson.dumps(reply) + b"\n")
            out.flush()


if __name__ == "__main__":
    main()
