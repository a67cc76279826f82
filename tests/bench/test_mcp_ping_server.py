"""bench/mcp_ping_server.py: the tool behind the tunnel bench speaks enough MCP, and only that."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from lean_jsonrpc import LeanClient, LeanError  # noqa: E402

SERVER = [sys.executable, str(BENCH / "mcp_ping_server.py")]


async def test_handshake_ping_tools_and_pipelining() -> None:
    client = await LeanClient.spawn(SERVER)
    try:
        async with asyncio.timeout(20):
            init = await client.initialize("2025-03-26")
            assert init["protocolVersion"] == "2025-03-26"
            assert init["capabilities"] == {"tools": {}}
            assert await client.request("ping") == {}
            tools = (await client.request("tools/list"))["tools"]
            assert [t["name"] for t in tools] == ["echo"]
            reply = await client.request(
                "tools/call", {"name": "echo", "arguments": {"text": "hi"}}
            )
            assert reply == {"content": [{"type": "text", "text": "hi"}], "isError": False}
            # Many requests in one read are all answered, in order of their ids.
            assert await client.pipelined("ping", [None] * 500, 64) == [{}] * 500
    finally:
        await client.close()


async def test_unknown_method_and_unknown_tool_are_method_not_found() -> None:
    client = await LeanClient.spawn(SERVER)
    try:
        async with asyncio.timeout(20):
            with pytest.raises(LeanError) as info:
                await client.request("resources/list")
            assert info.value.code == -32601
            with pytest.raises(LeanError) as info:
                await client.request("tools/call", {"name": "nope", "arguments": {}})
            assert info.value.code == -32601
    finally:
        await client.close()


async def test_garbage_line_gets_parse_error_and_server_keeps_serving() -> None:
    proc = await asyncio.create_subprocess_exec(
        *SERVER, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        async with asyncio.timeout(20):
            proc.stdin.write(b'not json\n{"jsonrpc":"2.0","method":"notifications/x"}\n')
            proc.stdin.write(b'{"jsonrpc":"2.0","id":7,"method":"ping"}\n')
            await proc.stdin.drain()
            assert b'"code":-32700' in await proc.stdout.readline()
            # The notification got no reply: the next line answers the ping.
            assert await proc.stdout.readline() == b'{"jsonrpc":"2.0","id":7,"result":{}}\n'
            proc.stdin.close()
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
