"""``serve --url``: a real Streamable HTTP MCP server (tests/tools/modern_server.py --http on
127.0.0.1) behind the tunnel, used by the real mcp SDK client in every mode."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Self

import anyio
import orjson
import pytest
from aiohttp import web

from mcp_proxy.http_front import HttpFront
from mcp_proxy.http_upstream import MAX_OPEN_REQUESTS, HttpUpstream
from mcp_proxy.policy import Policy, PolicyError
from mcp_proxy.tunnel_wire import MAX_MESSAGE_BYTES
from tests.mcp_proxy.e2e import ENV, REPO, did_of, serving
from tests.mcp_proxy.loopback import CLIENT_DID, Agent, Pair
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


class _Endpoint:
    """A bare HTTP endpoint on 127.0.0.1 answering POST /mcp with :meth:`_handle`."""

    url = ""
    _runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_post("/mcp", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/mcp"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


class HeldUpstream(_Endpoint):
    """A bare Streamable HTTP endpoint on 127.0.0.1 that answers no request until
    :attr:`release` is set; it counts what it was sent."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.open_now = self.most = 0
        self.requests: list[Any] = []  # ids, in the order their POSTs arrived
        self.notes: list[str] = []  # methods of the other messages

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "id" not in body or "method" not in body:
            self.notes.append(str(body.get("method")))
            return web.Response(status=202)
        self.requests.append(body["id"])
        self.open_now += 1
        self.most = max(self.most, self.open_now)
        try:
            await self.release.wait()
        finally:
            self.open_now -= 1
        return web.json_response({"jsonrpc": "2.0", "id": body["id"], "result": {}})

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        await super().__aexit__(*exc)


def _call(rid: int, size: int = 10) -> bytes:
    return (
        b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":'
        b'{"name":"echo","arguments":{"t":"%s"}}}' % (rid, b"x" * size)
    )


async def test_a_slow_upstream_pauses_its_caller_and_bounds_open_requests() -> None:
    # An upstream that answers nothing yet: serve POSTs at most MAX_OPEN_REQUESTS at once,
    # keeps the rest queued, and past HIGH_WATER queued pauses the caller's session (PAUSE);
    # once the upstream answers, every request gets its response and the session resumes.
    async with HeldUpstream() as upstream:
        pair = Pair(Policy.build(allow=[CLIENT_DID], url=upstream.url))
        agent = Agent(pair.client)
        replies: list[asyncio.Future[dict[str, object]]] = []

        async def ask() -> None:
            for _ in range(100):  # 10 kB each: 1 MB in all
                rid, fut = agent.start_request("tools/call")
                replies.append(fut)
                await agent.send_raw(_call(rid, 10_000))
                await asyncio.sleep(0.005)

        try:
            async with asyncio.timeout(TIMEOUT):
                asking = asyncio.ensure_future(ask())
                await until(lambda: agent.session.held, what="the caller to be paused")
                await until(lambda: upstream.open_now == MAX_OPEN_REQUESTS, what="open requests")
                assert not asking.done() and upstream.most == MAX_OPEN_REQUESTS
                upstream.release.set()
                await asking
                answers = await asyncio.gather(*replies)
                assert [a["result"] for a in answers] == [{}] * 100
                assert upstream.most == MAX_OPEN_REQUESTS and not agent.session.held
        finally:
            await pair.close()


async def test_messages_pass_requests_waiting_for_a_place() -> None:
    # With every place taken by requests the upstream holds, a notification still goes
    # out (a response the upstream waits for would too), and a request cancelled while
    # it waited for a place is never sent; the others are, in order, once places free.
    lines: list[dict[str, Any]] = []

    def on_line(line: bytes) -> None:  # as serve's session takes a reply: settled
        lines.append(orjson.loads(line))
        proc.settle(lines[-1]["id"])

    async with HeldUpstream() as upstream:
        proc = HttpUpstream(upstream.url, {}, on_line, lambda code: None)
        await proc.start()
        try:
            async with asyncio.timeout(TIMEOUT):
                count = MAX_OPEN_REQUESTS + 6
                for rid in range(1, count + 1):
                    proc.send(_call(rid), rid)
                await until(lambda: upstream.open_now == MAX_OPEN_REQUESTS, what="open requests")
                proc.send(b'{"jsonrpc":"2.0","method":"notifications/roots/list_changed"}')
                cancel = {"requestId": count, "reason": "no longer wanted"}
                proc.send(orjson.dumps(
                    {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": cancel}
                ))  # fmt: skip
                await until(lambda: upstream.notes != [], what="the notification")
                assert upstream.notes == ["notifications/roots/list_changed"]
                assert proc.backlog == 5 * len(_call(count))  # the 5 still waiting
                upstream.release.set()
                await until(lambda: len(lines) == count - 1, what="the answers")
                assert upstream.requests == list(range(1, count))
                assert sorted(line["id"] for line in lines) == list(range(1, count))
                assert proc.backlog == 0 and proc.writable
        finally:
            await proc.terminate()


class FloodingUpstream(_Endpoint):
    """A hostile Streamable HTTP endpoint on 127.0.0.1: request 1 is answered with an event
    stream of empty ``data:`` lines that never ends its event; any other request properly."""

    def __init__(self) -> None:
        self.sent = 0  # bytes of the endless event written

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if body["id"] == 1:
            chunk = b"data:\n" * 10_000
            with contextlib.suppress(ConnectionError):
                while self.sent < 2 * MAX_MESSAGE_BYTES:  # bounded: the reader stops before
                    await resp.write(chunk)
                    self.sent += len(chunk)
            return resp
        reply = orjson.dumps({"jsonrpc": "2.0", "id": body["id"], "result": {"ok": True}})
        await resp.write(b"data: " + reply + b"\n\n")
        return resp


async def test_an_endless_event_of_empty_data_lines_fails_its_request_only() -> None:
    # Empty data lines weigh their stream bytes: past MAX_MESSAGE_BYTES the request gets
    # an error reply and its stream is dropped; the next request is answered.
    lines: list[dict[str, Any]] = []

    def on_line(line: bytes) -> None:
        lines.append(orjson.loads(line))
        proc.settle(lines[-1]["id"])

    async with FloodingUpstream() as upstream:
        proc = HttpUpstream(upstream.url, {}, on_line, lambda code: None)
        await proc.start()
        try:
            async with asyncio.timeout(TIMEOUT):
                proc.send(_call(1), 1)
                await until(lambda: len(lines) == 1, what="request 1's error")
                assert lines[0]["id"] == 1 and "above" in lines[0]["error"]["message"]
                assert MAX_MESSAGE_BYTES <= upstream.sent < 2 * MAX_MESSAGE_BYTES
                proc.send(_call(2), 2)
                await until(lambda: len(lines) == 2, what="request 2's answer")
                assert lines[1] == {"jsonrpc": "2.0", "id": 2, "result": {"ok": True}}
        finally:
            await proc.terminate()
