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
        # Header bytes that are not UTF-8: a wrong token, a bad version; never a 500.
        token = AUTH["Authorization"].encode()
        assert await raw_status(front, b"Authorization: Bearer \xff\xfe") == 401
        assert (
            await raw_status(front, b"Authorization: " + token + b"\r\nMCP-Protocol-Version: \xff")
            == 400
        )
    assert front.sessions == {}


async def raw_status(front: HttpFront, headers: bytes) -> int:
    """POST a ping with ``headers`` written as raw bytes; the status code."""
    url = httpx2.URL(front.url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    body = b'{"jsonrpc":"2.0","id":2,"method":"ping"}'
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" % url.path.encode()
        + b"Accept: application/json, text/event-stream\r\n"
        + headers
        + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
        + body
    )
    answer = await reader.read()
    writer.close()
    return int(answer.split(b" ", 2)[1])


def test_parse_bind() -> None:
    assert parse_bind("8080") == ("127.0.0.1", 8080)
    assert parse_bind(":0") == ("127.0.0.1", 0)
    assert parse_bind("[::1]:9") == ("::1", 9)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_bind("127.0.0.1:http")
    with pytest.raises(ValueError, match="out of range"):
        parse_bind("127.0.0.1:70000")


async def test_idle_session_is_closed_with_its_remote_tool() -> None:
    # An HTTP session nobody uses any more must not keep a tool process alive.
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=EVERYTHING))
    front = HttpFront(pair.client, TOKEN, "127.0.0.1:0", idle_timeout=1.0)
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


async def _legacy_session(http: httpx2.AsyncClient, url: str) -> str:
    reply = await http.post(url, content=INIT)
    # The client accepts JSON and the response is the only message: plain JSON, no stream.
    assert reply.status_code == 200
    assert reply.headers["Content-Type"].startswith("application/json")
    sid = reply.headers["Mcp-Session-Id"]
    done = await http.post(
        url,
        headers={"Mcp-Session-Id": sid},
        content=b'{"jsonrpc":"2.0","method":"notifications/initialized"}',
    )
    assert done.status_code == 202
    return sid


async def test_sse_event_ids_and_resumption_after_a_dropped_stream(front: HttpFront) -> None:
    call = (
        b'{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"slow",'
        b'"arguments":{"steps":3,"delay":0.3},"_meta":{"progressToken":"p"}}}'
    )
    async with asyncio.timeout(TIMEOUT), httpx2.AsyncClient(headers=AUTH, timeout=20) as http:
        sid = await _legacy_session(http, front.url)
        seen: list[str] = []
        async with http.stream(
            "POST", front.url, headers={"Mcp-Session-Id": sid}, content=call
        ) as stream:
            assert stream.headers["Content-Type"] == "text/event-stream"
            async for line in stream.aiter_lines():
                seen.append(line)
                if line.startswith("data: {"):
                    break  # the first progress event: drop the stream here
        event_ids = [line[4:] for line in seen if line.startswith("id: ")]
        assert event_ids[0].endswith("-0")  # the priming event
        assert '"progress":1' in seen[-1]
        last = event_ids[-1]
        rest: list[str] = []
        async with http.stream(
            "GET",
            front.url,
            headers={"Mcp-Session-Id": sid, "Accept": "text/event-stream", "Last-Event-ID": last},
        ) as resumed:
            assert resumed.status_code == 200
            async for line in resumed.aiter_lines():
                rest.append(line)
        data = [line for line in rest if line.startswith("data: {")]
        assert '"progress":2' in data[0] and '"progress":3' in data[1]
        assert '"id":5' in data[-1] and "done 3" in data[-1]  # nothing lost, nothing repeated
        assert len(data) == 3
        unknown = await http.get(
            front.url,
            headers={"Mcp-Session-Id": sid, "Accept": "text/event-stream", "Last-Event-ID": "x"},
        )
        assert unknown.status_code == 400


async def test_protocol_version_is_validated(front: HttpFront) -> None:
    async with asyncio.timeout(TIMEOUT), httpx2.AsyncClient(headers=AUTH, timeout=20) as http:
        sid = await _legacy_session(http, front.url)
        ping = b'{"jsonrpc":"2.0","id":2,"method":"ping"}'
        ok = await http.post(
            front.url,
            headers={"Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-06-18"},
            content=ping,
        )
        assert ok.status_code == 200 and ok.json()["result"] == {}
        for method in ("POST", "GET", "DELETE"):
            bogus = await http.request(
                method,
                front.url,
                headers={"Mcp-Session-Id": sid, "MCP-Protocol-Version": "1999-01-01"},
                content=ping if method == "POST" else b"",
            )
            assert bogus.status_code == 400
            error = bogus.json()["error"]
            assert error["code"] == -32022
            assert "2025-11-25" in error["data"]["supported"]
            assert "2026-07-28" in error["data"]["supported"]
        # The 2026-07-28 era has no session stream and nothing to delete.
        modern = {"MCP-Protocol-Version": "2026-07-28", "Accept": "text/event-stream"}
        assert (await http.get(front.url, headers=modern)).status_code == 405
        assert (await http.delete(front.url, headers=modern)).status_code == 405
        # A pretty-printed body (raw newlines) is still one message to the tool.
        pretty = b'{\n  "jsonrpc": "2.0",\n  "id": 3,\n  "method": "ping"\n}\n'
        reply = await http.post(front.url, headers={"Mcp-Session-Id": sid}, content=pretty)
        assert reply.status_code == 200 and reply.json() == {
            "jsonrpc": "2.0",
            "id": 3,
            "result": {},
        }


async def test_stateless_raw_request_and_notification(front: HttpFront) -> None:
    meta = {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {},
    }
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "add", "arguments": {"a": 1, "b": 2}, "_meta": meta},
    }
    modern = {"MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/call", "Mcp-Name": "add"}
    async with asyncio.timeout(TIMEOUT), httpx2.AsyncClient(headers=AUTH, timeout=20) as http:
        reply = await http.post(front.url, headers=modern, json=body)
        assert reply.status_code == 200 and "Mcp-Session-Id" not in reply.headers
        assert reply.json()["result"]["content"][0]["text"] == "3"
        mismatch = await http.post(front.url, headers={**modern, "Mcp-Name": "echo"}, json=body)
        assert mismatch.status_code == 400 and mismatch.json()["error"]["code"] == -32020
        note = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}}
        accepted = await http.post(front.url, headers=modern, json=note)
        assert accepted.status_code == 202


async def test_cors_preflight_needs_no_token_and_allowed_origins_get_cors_headers() -> None:
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=EVERYTHING))
    allowed = "http://127.0.0.1:9"
    http_front = HttpFront(pair.client, TOKEN, "127.0.0.1:0", allow_origins=[allowed])
    await http_front.start()
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, mcp-protocol-version",
    }
    try:
        async with asyncio.timeout(TIMEOUT), httpx2.AsyncClient(timeout=20) as http:
            ok = await http.options(http_front.url, headers={**preflight, "Origin": allowed})
            assert ok.status_code == 204
            assert ok.headers["Access-Control-Allow-Origin"] == allowed
            assert "authorization" in ok.headers["Access-Control-Allow-Headers"]
            other = await http.options(
                http_front.url, headers={**preflight, "Origin": "http://127.0.0.1:10"}
            )
            assert other.status_code == 403 and "Access-Control-Allow-Origin" not in other.headers
            # A loopback origin outside the list is refused once a list is configured.
            post = await http.post(
                http_front.url, headers={**AUTH, "Origin": "http://127.0.0.1:10"}, content=INIT
            )
            assert post.status_code == 403
            no_token = await http.post(
                http_front.url, headers={"Origin": allowed, "Accept": AUTH["Accept"]}, content=INIT
            )
            assert no_token.status_code == 401
            assert no_token.headers["Access-Control-Allow-Origin"] == allowed
            init = await http.post(
                http_front.url, headers={**AUTH, "Origin": allowed}, content=INIT
            )
            assert init.status_code == 200
            assert init.headers["Access-Control-Allow-Origin"] == allowed
            assert "Mcp-Session-Id" in init.headers["Access-Control-Expose-Headers"]
    finally:
        await http_front.stop()
        await pair.close()
