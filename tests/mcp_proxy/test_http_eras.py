"""The HTTP front in both MCP eras: the real mcp SDK client pinned to 2026-07-28, auto and legacy,
over a loopback tunnel to a real stdio MCP server (tests/tools/modern_server.py)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from mcp_proxy.http_front import HttpFront
from mcp_proxy.policy import Policy
from tests.mcp_proxy.loopback import CLIENT_DID, Pair
from tests.mcp_proxy.sdk_callbacks import (
    SDK_DEPRECATIONS_ALLOWED,
    elicitation,
    list_roots,
    sampling,
    text,
)
from tests.talos.nodes import until

TOKEN = "test-token-eras"
TIMEOUT = 60
MODERN = [sys.executable, "-m", "tests.tools.modern_server"]
MODES = ["2026-07-28", "auto", "legacy"]
BIG = 3 * 1024 * 1024  # above the SDK client's default 1 MiB SSE event limit


pytestmark = SDK_DEPRECATIONS_ALLOWED


@contextlib.asynccontextmanager
async def front_for(command: list[str], **kwargs: Any) -> AsyncIterator[tuple[HttpFront, Pair]]:
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=command))
    front = HttpFront(pair.client, TOKEN, "127.0.0.1:0", **kwargs)
    await front.start()
    try:
        yield front, pair
    finally:
        await front.stop()
        await pair.close()


@contextlib.asynccontextmanager
async def sdk(url: str, mode: str) -> AsyncIterator[Client]:
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as http,
        Client(
            streamable_http_client(url, http_client=http),
            mode=mode,
            sampling_callback=sampling,
            elicitation_callback=elicitation,
            list_roots_callback=list_roots,
        ) as client,
    ):
        yield client


async def exercise(client: Client) -> None:
    """Tools, progress, MRTR-era sampling/elicitation/roots, a 3 MiB resource, a prompt."""
    tools = await client.list_tools()
    assert {"echo", "add", "slow", "sample", "elicit", "roots"} <= {t.name for t in tools.tools}
    assert text(await client.call_tool("add", {"a": 20, "b": 22})) == "42"
    progress: list[float] = []

    async def on_progress(p: float, _total: float | None, _msg: str | None) -> None:
        progress.append(p)

    slow = await client.call_tool(
        "slow", {"steps": 3, "delay": 0.01}, progress_callback=on_progress
    )
    assert text(slow) == "done 3" and progress == [1.0, 2.0, 3.0]
    assert text(await client.call_tool("sample", {"prompt": "hi"})) == "model saw hi"
    assert text(await client.call_tool("elicit", {"question": "who?"})) == "hello ada"
    assert text(await client.call_tool("roots", {})) == "file:///work/a,file:///work/b"
    resource = await client.read_resource(f"res://big/{BIG}")
    assert len(resource.contents[0].text) == BIG  # type: ignore[union-attr]
    prompt = await client.get_prompt("review", {"code": "x = 1"})
    assert prompt.messages[0].content.text == "Please review: x = 1"  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", MODES)
async def test_sdk_client_every_mode_against_a_stdio_tool(mode: str) -> None:
    async with asyncio.timeout(TIMEOUT), front_for(MODERN) as (front, _pair):
        async with sdk(front.url, mode) as client:
            await exercise(client)
            if mode == "legacy":
                assert len(front.sessions) == 1 and len(front.pool) == 0
            else:
                assert front.sessions == {} and len(front.pool) == 1
        assert front.sessions == {}


@pytest.mark.parametrize("mode", MODES)
async def test_cancelled_request_frees_its_session(mode: str) -> None:
    async with (
        asyncio.timeout(TIMEOUT),
        front_for(MODERN, idle_timeout=2.0) as (front, pair),
        sdk(front.url, mode) as client,
    ):
        started = anyio.Event()

        async def on_progress(_p: float, _t: float | None, _m: str | None) -> None:
            started.set()

        async def long_call() -> None:
            await client.call_tool(
                "slow", {"steps": 200, "delay": 0.05}, progress_callback=on_progress
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_call)
            await started.wait()  # the call is running at the tool
            tg.cancel_scope.cancel()
        # The tool side forgets the call, and the front holds nothing for it.
        await until(
            lambda: not any(s.calls for s in pair.server.sessions.values()),
            what="the tool side to drop the cancelled call",
        )
        if mode == "legacy":
            (session,) = front.sessions.values()
            await until(lambda: not session.waiters, what="the exchange to end")
            # Nothing in flight any more: the idle reaper closes the session and its tool.
            await until(
                lambda: not front.sessions, timeout=30, what="the idle session to be reaped"
            )
        else:
            assert all(not m.inflight for m in front.pool.members)
            await until(lambda: len(front.pool) == 0, timeout=30, what="the idle pool to be reaped")
        await until(lambda: not pair.server.sessions, timeout=30, what="the remote tool to stop")


async def test_stateless_requests_spread_over_a_bounded_pool() -> None:
    async with asyncio.timeout(TIMEOUT), front_for(MODERN, max_sessions=2) as (front, _pair):
        front.pool.spread = 1
        async with sdk(front.url, "2026-07-28") as client:
            results = await asyncio.gather(
                *(client.call_tool("slow", {"steps": 1, "delay": 0.2}) for _ in range(6))
            )
            assert [text(r) for r in results] == ["done 1"] * 6
            assert len(front.pool) == 2  # opened a second member, never more than the limit
            # A legacy client cannot get a session: the limit is taken by the pool.
            async with httpx2.AsyncClient(timeout=10) as http:
                reply = await http.post(
                    front.url,
                    headers={
                        "Authorization": f"Bearer {TOKEN}",
                        "Accept": "application/json, text/event-stream",
                    },
                    json={
                        "jsonrpc": "2.0",
                        "id": 1,
                        "method": "initialize",
                        "params": {
                            "protocolVersion": "2025-11-25",
                            "capabilities": {},
                            "clientInfo": {"name": "late", "version": "0"},
                        },
                    },
                )
            assert reply.status_code == 503
            assert "too many sessions (limit 2)" in reply.json()["error"]["message"]


async def test_same_request_id_from_two_clients_runs_on_two_members() -> None:
    async with (
        asyncio.timeout(TIMEOUT),
        front_for(MODERN) as (front, _pair),
        sdk(front.url, "2026-07-28") as first,
        sdk(front.url, "2026-07-28") as second,
    ):
        # Both clients number their requests alike; each response reaches its own caller.
        one, two = await asyncio.gather(
            first.call_tool("slow", {"steps": 1, "delay": 0.3}),
            second.call_tool("echo", {"text": "second"}),
        )
        assert text(one) == "done 1" and text(two) == "second"
        assert len(front.pool) == 2  # the colliding id went to a second tool session


async def test_modern_listen_events_and_log_lines_reach_their_client() -> None:
    """A 2026-07-28 listen stream gets the events of a change made by a call that runs
    meanwhile, and a call that asked for log lines gets them with the stream open."""
    from mcp.shared.subscriptions import ResourceUpdated

    logs: list[Any] = []

    async def on_log(params: Any) -> None:
        logs.append(params)

    async with (
        asyncio.timeout(TIMEOUT),
        front_for(MODERN) as (front, _),
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as http,
        Client(
            streamable_http_client(front.url, http_client=http),
            mode="2026-07-28",
            logging_callback=on_log,
            log_level="info",
        ) as client,
        client.listen(resource_subscriptions=["res://counter"]) as events,
    ):
        assert text(await client.call_tool("bump", {})) == "counter 1"
        async for update in events:
            if isinstance(update, ResourceUpdated):
                assert update.uri == "res://counter"
                break
        assert text(await client.call_tool("logs", {})) == "logged"
        await until(lambda: len(logs) == 1, what="the log line")
        assert logs[0].level == "info" and logs[0].data == "a log line"
