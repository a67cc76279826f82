"""talos/http_serve.py on 127.0.0.1: a half-sent first request is cut at its deadline,
a slow handler is not, and cleanup stops the listener."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from talos.http_serve import serve_http, trusted
from talos_sdk.errors import UsageError

TIMEOUT = 20


async def _slow(request: web.Request) -> web.Response:
    if request.headers.get("Authorization") == "Bearer t":
        trusted(request)
    await asyncio.sleep(float(request.query.get("s", "0")))
    return web.Response(text="ok")


async def test_a_half_sent_request_is_cut_and_a_slow_handler_is_not() -> None:
    app = web.Application()
    app.router.add_get("/", _slow)
    server = await serve_http(app, "127.0.0.1", 0, first_request=0.5)
    try:
        async with asyncio.timeout(TIMEOUT):
            # Headers never finished: the connection is closed, no token ever read.
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")
            await writer.drain()
            assert await reader.read() == b""
            writer.close()
            # A trusted request whose handler outlasts the deadline gets its answer.
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(
                b"GET /?s=1.5 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\n"
                b"Connection: close\r\n\r\n"
            )
            await writer.drain()
            answer = await reader.read()
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok")
            writer.close()
            # Requests the app did not trust keep no connection: cut at the deadline.
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
            assert await reader.read() == b""  # closed though kept alive by HTTP/1.1
            writer.close()
    finally:
        await server.cleanup()
    try:
        await asyncio.open_connection(server.host, server.port)
    except OSError:
        pass
    else:
        raise AssertionError("still listening after cleanup")


async def test_a_port_in_use_is_a_usage_error_naming_it() -> None:
    app = web.Application()
    server = await serve_http(app, "127.0.0.1", 0)
    try:
        with pytest.raises(UsageError, match=rf"cannot listen on 127.0.0.1:{server.port}: "):
            await serve_http(web.Application(), "127.0.0.1", server.port)
    finally:
        await server.cleanup()
