"""``serve --url``: a real Streamable HTTP MCP server (tests/tools/modern_server.py --http on
127.0.0.1) behind the tunnel, used by the real mcp SDK client in every mode."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from mcp_proxy.http_front import HttpFront
from mcp_proxy.policy import Policy, PolicyError
from tests.mcp_proxy.e2e import ENV, REPO, did_of, serving
from tests.mcp_proxy.loopback import CLIENT_DID, Pair
from tests.mcp_proxy.sdk_callbacks import SDK_DEPRECATIONS_ALLOWED, text
from tests.mcp_proxy.test_http_eras import MODES, TOKEN, exercise, sdk
from tests.talos.nodes import until

TIMEOUT = 90


pytestmark = SDK_DEPRECATIONS_ALLOWED


@contextlib.asynccontextmanager
async def upstream_server() -> AsyncIterator[str]:
    """The modern_server over Streamable HTTP on 127.0.0.1; yields its URL."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.tools.modern_server",
        "--http",
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
        env=ENV,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert line.startswith("listening on "), line
        yield line.split()[-1]
    finally:
        proc.terminate()
        await proc.wait()


@contextlib.asynccontextmanager
async def bridged(url: str, **kwargs: object) -> AsyncIterator[tuple[HttpFront, Pair]]:
    pair = Pair(Policy.build(allow=[CLIENT_DID], url=url, headers={"X-Test": "bridged"}))
    front = HttpFront(pair.client, TOKEN, "127.0.0.1:0", **kwargs)  # type: ignore[arg-type]
    await front.start()
    try:
        yield front, pair
    finally:
        await front.stop()
        await pair.close()


@pytest.mark.parametrize("mode", MODES)
async def test_sdk_client_every_mode_through_an_http_upstream(mode: str) -> None:
    async with (
        asyncio.timeout(TIMEOUT),
        upstream_server() as url,
        bridged(url) as (front, pair),
        sdk(front.url, mode) as client,
    ):
        await exercise(client)
        started = anyio.Event()

        async def on_progress(_p: float, _t: float | None, _m: str | None) -> None:
            started.set()

        async def long_call() -> None:
            await client.call_tool(
                "slow", {"steps": 200, "delay": 0.05}, progress_callback=on_progress
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_call)
            await started.wait()
            tg.cancel_scope.cancel()
        await until(
            lambda: not any(s.calls for s in pair.server.sessions.values()),
            timeout=30,
            what="the serve side to drop the cancelled call",
        )
        # The session still works after a cancellation.
        assert text(await client.call_tool("echo", {"text": "after"})) == "after"


def test_url_and_command_are_exclusive() -> None:
    with pytest.raises(PolicyError, match="not both"):
        Policy.build(allow=[CLIENT_DID], command=["x"], url="http://127.0.0.1:1/mcp")
    with pytest.raises(PolicyError, match="http"):
        Policy.build(allow=[CLIENT_DID], url="ftp://127.0.0.1/mcp")


async def test_talos_proxy_serve_url_end_to_end(tmp_path: Path) -> None:
    """The real CLI: ``serve --url`` with a header; ``connect`` as an SDK client's stdio server."""
    from tests.mcp_proxy.e2e import connect_params

    client_home, server_home = tmp_path / "client", tmp_path / "server"
    client_did = did_of(client_home)
    async with (
        asyncio.timeout(TIMEOUT),
        upstream_server() as url,
        serving(
            server_home, ["--allow", client_did, "--url", url, "--header", "X-Test=cli"], []
        ) as serve,
    ):
        from mcp import Client

        address = await serve.ready()
        async with Client(connect_params(client_home, address), mode="auto") as client:
            assert text(await client.call_tool("add", {"a": 2, "b": 3})) == "5"
    bad = subprocess.run(
        [
            *(sys.executable, "-m", "mcp_proxy.cli", "serve", "--home", str(server_home)),
            *("--listen", "127.0.0.1:0", "--allow", client_did, "--url", url, "--header", "nope"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=ENV,
    )
    assert bad.returncode == 2 and "--header needs K=V" in bad.stderr


async def test_a_slow_upstream_pauses_its_caller_and_bounds_open_requests() -> None:
    # An upstream that answers nothing yet: serve POSTs at most MAX_OPEN_REQUESTS at once,
    # keeps the rest queued, and past HIGH_WATER queued pauses the caller's session (PAUSE);
    # once the upstream answers, every request gets its response and the session resumes.
    from aiohttp import web

    from mcp_proxy.http_upstream import MAX_OPEN_REQUESTS
    from tests.mcp_proxy.loopback import Agent

    release = asyncio.Event()
    open_now = most = 0

    async def handle(request: web.Request) -> web.Response:
        nonlocal open_now, most
        body = await request.json()
        if "id" not in body:
            return web.Response(status=202)
        open_now += 1
        most = max(most, open_now)
        await release.wait()
        open_now -= 1
        return web.json_response({"jsonrpc": "2.0", "id": body["id"], "result": {}})

    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/mcp", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    pair = Pair(Policy.build(allow=[CLIENT_DID], url=f"http://127.0.0.1:{port}/mcp"))
    agent = Agent(pair.client)
    replies: list[asyncio.Future[dict[str, object]]] = []

    async def ask() -> None:
        for _ in range(100):  # 10 kB each: 1 MB in all
            rid, fut = agent.start_request("tools/call")
            replies.append(fut)
            await agent.send_raw(
                b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":'
                b'{"name":"echo","arguments":{"t":"%s"}}}' % (rid, b"x" * 10_000)
            )
            await asyncio.sleep(0.005)

    try:
        async with asyncio.timeout(TIMEOUT):
            asking = asyncio.ensure_future(ask())
            await until(lambda: agent.session.held, what="the caller to be paused")
            await until(lambda: open_now == MAX_OPEN_REQUESTS, what="the open requests")
            assert not asking.done() and most == MAX_OPEN_REQUESTS
            release.set()
            await asking
            answers = await asyncio.gather(*replies)
            assert [a["result"] for a in answers] == [{}] * 100
            assert len(replies) == 100 and most == MAX_OPEN_REQUESTS and not agent.session.held
    finally:
        release.set()
        await pair.close()
        await runner.cleanup()
