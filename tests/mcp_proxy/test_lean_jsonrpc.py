"""Tests for bench/lean_jsonrpc.py (the bench client) against the real everything_server."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "lean_jsonrpc", REPO / "bench" / "lean_jsonrpc.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["lean_jsonrpc"] = module
    spec.loader.exec_module(module)
    return module


lean = _load()
EVERYTHING = [sys.executable, "-m", "tests.tools.everything_server"]


async def test_pipelined_calls_get_their_own_answers() -> None:
    async with asyncio.timeout(30):
        client = await lean.LeanClient.spawn(EVERYTHING)
        try:
            init = await client.initialize()
            assert init["serverInfo"]["name"] == "everything"
            params = [{"name": "add", "arguments": {"a": i, "b": 1}} for i in range(200)]
            results = await client.pipelined("tools/call", params, in_flight=64)
            assert [r["structuredContent"]["result"] for r in results] == [
                i + 1 for i in range(200)
            ]
            assert await client.request("ping") == {}
            with pytest.raises(lean.LeanError) as info:
                await client.request("no/such/method")
            assert info.value.code == -32601
        finally:
            await client.close()


async def test_server_exit_fails_pending_requests() -> None:
    async with asyncio.timeout(30):
        client = await lean.LeanClient.spawn(EVERYTHING)
        try:
            await client.initialize()
            with pytest.raises(lean.LeanError, match="connection closed"):
                await client.request("tools/call", {"name": "crash", "arguments": {"code": 1}})
        finally:
            await client.close()


async def test_server_requests_are_answered_by_the_handler() -> None:
    async def on_request(method: str, params: object) -> object:
        assert method == "sampling/createMessage"
        return {"role": "assistant", "model": "m", "content": {"type": "text", "text": "lean"}}

    async with asyncio.timeout(30):
        client = await lean.LeanClient.spawn(EVERYTHING, on_request=on_request)
        try:
            await client.request(
                "initialize",
                {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {"sampling": {}},
                    "clientInfo": {"name": "t", "version": "0"},
                },
            )
            await client.notify("notifications/initialized")
            result = await client.request(
                "tools/call", {"name": "sample", "arguments": {"prompt": "x"}}
            )
            assert result["structuredContent"]["result"] == "lean"
        finally:
            await client.close()


async def test_fast_server_tool() -> None:
    async with asyncio.timeout(30):
        client = await lean.LeanClient.spawn([sys.executable, "-m", "tests.tools.fast_server"])
        try:
            assert (await client.initialize())["serverInfo"]["name"] == "fast"
            assert [t["name"] for t in (await client.request("tools/list"))["tools"]] == ["echo"]
            params = [{"name": "echo", "arguments": {"text": str(i)}} for i in range(100)]
            results = await client.pipelined("tools/call", params, in_flight=16)
            assert [r["content"][0]["text"] for r in results] == [str(i) for i in range(100)]
            with pytest.raises(lean.LeanError) as info:
                await client.request("resources/list")
            assert info.value.code == -32601
        finally:
            await client.close()
