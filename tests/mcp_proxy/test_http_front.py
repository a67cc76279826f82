"""Streamable HTTP front, real mcp SDK client, loopback tunnel to the everything_server tool."""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import CreateMessageResult, TextContent

from mcp_proxy.http_front import HttpFront, parse_bind
from mcp_proxy.jsonrpc import TOOL_DENIED
from mcp_proxy.policy import Policy
from tests.mcp_proxy.loopback import CLIENT_DID, EVERYTHING, Pair
from tests.talos.nodes import until

TOKEN = "test-token-0123456789"
TIMEOUT = 40


@pytest.fixture
async def front() -> AsyncIterator[HttpFront]:
    pair = Pair(
        Policy.build(
            allow=[CLIENT_DID], tools=["echo", "add", "slow", "sample"], command=EVERYTHING
        )
    )
    http = HttpFront(pair.client, TOKEN, "127.0.0.1:0")
    await http.start()
    try:
        yield http
    finally:
        await http.stop()
        await pair.close()


async def sampling(_ctx: Any, _params: Any) -> CreateMessageResult:
    return CreateMessageResult(
        role="assistant", content=TextContent(type="text", text="sampled over http"), model="m"
    )


@contextlib.asynccontextmanager
async def sdk_client(url: str, token: str = TOKEN, **kwargs: Any) -> AsyncIterator[Client]:
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=30) as http,
        Client(streamable_http_client(url, http_client=http), mode="legacy", **kwargs) as client,
    ):
        yield client


async def test_sdk_client_tools_progress_sampling(front: HttpFront) -> None:
    progress: list[float] = []

    async def on_progress(p: float, _total: float | None, _msg: str | None) -> None:
        progress.append(p)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        async with asyncio.timeout(TIMEOUT):
            async with sdk_client(front.url, sampling_callback=sampling) as client:
                tools = await client.list_tools()
                assert sorted(t.name for t in tools.tools) == ["add", "echo", "sample", "slow"]
                result = await client.call_tool("add", {"a": 20, "b": 22})
                assert result.content[0].text == "42"  # type: ignore[union-attr]
                slow = await client.call_tool(
                    "slow", {"steps": 3, "delay": 0.01}, progress_callback=on_progress
                )
                assert slow.content[0].text == "done 3"  # type: ignore[union-attr]
                sampled = await client.call_tool("sample", {"prompt": "hi"})
                assert sampled.content[0].text == "sampled over http"  # type: ignore[union-attr]
                resource = await client.read_resource("res://greeting")
                assert resource.contents[0].text == "hello from a resource"  # type: ignore[union-attr]
                with pytest.raises(MCPError) as denied:
                    await client.call_tool("crash", {})
                assert denied.value.code == TOOL_DENIED
    assert progress == [1.0, 2.0, 3.0]
    # DELETE on close ended the session.
    assert front.sessions == {}


async def raw(
    front: HttpFront, method: str, headers: dict[str, str], body: bytes = b""
) -> httpx2.Response:
    async with httpx2.AsyncClient(timeout=10) as http:
        return await http.request(method, front.url, headers=headers, content=body)


INIT = (
    b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18",'
    b'"capabilities":{},"clientInfo":{"name":"raw","version":"0"}}}'
)
AUTH = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/json, text/event-stream"}


async def test_security_checks(front: HttpFront) -> None:
    async with asyncio.timeout(TIMEOUT):
        no_token = await raw(front, "POST", {"Accept": AUTH["Accept"]}, INIT)
        assert no_token.status_code == 401
        wrong = await raw(front, "POST", {**AUTH, "Authorization": "Bearer nope"}, INIT)
        assert wrong.status_code == 401
        evil = await raw(front, "POST", {**AUTH, "Origin": "https://evil.example"}, INIT)
        assert evil.status_code == 403
        local = await raw(front, "POST", {**AUTH, "Origin": "http://localhost:3000"}, b"{bad")
        assert local.status_code == 400 and local.json()["error"]["code"] == -32700
        no_session = await raw(front, "POST", AUTH, b'{"jsonrpc":"2.0","id":2,"method":"ping"}')
        assert no_session.status_code == 400
        unknown = await raw(
            front,
            "POST",
            {**AUTH, "Mcp-Session-Id": "nope"},
            b'{"jsonrpc":"2.0","id":2,"method":"ping"}',
        )
        assert unknown.status_code == 404
        assert (await raw(front, "GET", {**AUTH, "Mcp-Session-Id": "nope"})).status_code == 404
        assert (await raw(front, "DELETE", {**AUTH, "Mcp-Session-Id": "nope"})).status_code == 404
    assert front.sessions == {}


def test_parse_bind() -> None:
    assert parse_bind("8080") == ("127.0.0.1", 8080)
    assert parse_bind(":0") == ("127.0.0.1", 0)
    assert parse_bind("[::1]:9") == ("::1", 9)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_bind("127.0.0.1:http")
    with pytest.raises(ValueError, match="out of range"):
        parse_bind("127.0.0.1:70000")


async def test_idle_session_is_closed_with_its_remote_tool() -> None:
    # Review #17: an HTTP session nobody uses any more must not keep a tool process alive.
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=EVERYTHING))
    front = HttpFront(pair.client, TOKEN, "127.0.0.1:0", idle_timeout=0.2)
    await front.start()
    headers = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/json, text/event-stream"}
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "idle", "version": "0"},
        },
    }
    try:
        async with (
            asyncio.timeout(TIMEOUT),
            httpx2.AsyncClient(headers=headers, timeout=TIMEOUT) as http,
        ):
            reply = await http.post(front.url, json=init)
            assert reply.status_code == 200 and "serverInfo" in reply.text
            sid = reply.headers["Mcp-Session-Id"]
            (tool_session,) = pair.server.sessions.values()
            proc = tool_session.proc
            assert proc is not None
            await until(lambda: not front.sessions, what="the idle session to be closed")
            assert await proc.wait() is not None  # the remote tool process was stopped
            await until(lambda: not pair.server.sessions, what="the remote session to end")
            ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
            gone = await http.post(front.url, json=ping, headers={"Mcp-Session-Id": sid})
            assert gone.status_code == 404
    finally:
        await front.stop()
        await pair.close()


async def test_idle_timeout_must_be_positive() -> None:
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=EVERYTHING))
    try:
        with pytest.raises(ValueError, match="idle_timeout must be positive"):
            HttpFront(pair.client, TOKEN, idle_timeout=0)
    finally:
        await pair.close()
