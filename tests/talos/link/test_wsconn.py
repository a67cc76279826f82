"""The WebSocket a direct link runs on (talos/link/wsconn.py), on 127.0.0.1, with the
websockets library as the independent implementation at the other end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed, InvalidStatus

from talos.link import wsconn
from talos.link.wsconn import MAX_HEAD, WsOptions, WsServer, WsStream, ws_connect, ws_serve

OPTIONS = WsOptions(max_size=1 << 16, max_queue=4, ping_interval=0, open_timeout=5)


async def _echo(stream: WsStream) -> None:
    """Echo binary messages; a message b"close NNNN" closes with that code."""
    while True:
        message = await stream.recv()
        assert isinstance(message, bytes)
        if message.startswith(b"close "):
            await stream.close(int(message[6:]), "asked to")
            return
        await stream.send(message)


@pytest.fixture
async def echo_server() -> AsyncIterator[WsServer]:
    server = await ws_serve(_echo, "127.0.0.1", 0, OPTIONS)
    try:
        yield server
    finally:
        server.close()
        await server.wait_closed()


def _url(server: WsServer) -> str:
    return f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_a_websockets_client_talks_to_our_server(echo_server: WsServer) -> None:
    async with asyncio.timeout(10), connect(_url(echo_server), compression=None) as ws:
        for size in (0, 10, 200, 70_000 // 2):
            await ws.send(b"y" * size)
            assert await ws.recv() == b"y" * size
        await ws.send(b"close 4003")
        with pytest.raises(ConnectionClosed):
            await ws.recv()
        assert ws.close_code == 4003 and ws.close_reason == "asked to"


async def test_our_client_talks_to_our_server_and_hears_its_close_code(
    echo_server: WsServer,
) -> None:
    async with asyncio.timeout(10):
        stream = await ws_connect(_url(echo_server), OPTIONS)
        assert stream.writable and stream.can_send_now and stream.remote_host == "127.0.0.1"
        assert stream.send_nowait(b"a")
        await stream.send(b"b")
        assert [await stream.recv(), await stream.recv()] == [b"a", b"b"]
        await stream.send(b"close 4010")
        with pytest.raises(ConnectionClosed) as caught:
            await stream.recv()
        assert caught.value.rcvd is not None and caught.value.rcvd.code == 4010
        assert stream.close_code == 4010 and not stream.writable
        assert not stream.send_nowait(b"late")
        with pytest.raises(ConnectionClosed):
            await stream.send(b"late")


async def test_our_client_talks_to_a_websockets_server_that_pings_and_closes() -> None:
    async def handler(ws: ServerConnection) -> None:
        async for message in ws:
            if message == b"bye":
                await ws.close(4001, "bad proof")
                return
            await ws.send(message)

    async with (
        asyncio.timeout(10),
        serve(handler, "127.0.0.1", 0, compression=None, ping_interval=0.05) as server,
    ):
        port = next(iter(server.sockets)).getsockname()[1]
        stream = await ws_connect(f"ws://127.0.0.1:{port}", OPTIONS)
        await stream.send(b"x" * 1000)
        assert await stream.recv() == b"x" * 1000
        await asyncio.sleep(0.3)  # several pings, answered (else the server closes 1011)
        assert stream.close_code is None
        await stream.send(b"bye")
        with pytest.raises(ConnectionClosed) as caught:
            await stream.recv()
        assert caught.value.rcvd is not None and caught.value.rcvd.code == 4001
        await stream.wait_closed()
        assert stream.close_code == 4001


async def test_a_request_that_is_not_an_upgrade_gets_an_http_error(echo_server: WsServer) -> None:
    port = echo_server.sockets[0].getsockname()[1]
    async with asyncio.timeout(10):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        reply = await reader.read()  # the server answers, then closes
        writer.close()
    assert reply.startswith(b"HTTP/1.1 426") or reply.startswith(b"HTTP/1.1 400"), reply[:40]


async def test_an_upgrade_refused_by_the_server_is_an_invalid_handshake() -> None:
    async def not_websocket(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(not_websocket, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with asyncio.timeout(10):
            with pytest.raises(InvalidStatus):
                await ws_connect(f"ws://127.0.0.1:{port}", OPTIONS)
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("what", ["silent", "endless head", "long head in one write"])
async def test_a_connection_that_never_completes_its_upgrade_is_cut(what: str) -> None:
    handled: list[WsStream] = []

    async def handler(stream: WsStream) -> None:
        handled.append(stream)

    server = await ws_serve(handler, "127.0.0.1", 0, WsOptions(max_size=1024, open_timeout=0.3))
    port = server.sockets[0].getsockname()[1]
    try:
        async with asyncio.timeout(10):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if what == "endless head":
                writer.write(b"GET / HTTP/1.1\r\nX: " + b"a" * (MAX_HEAD + 10))
            elif what == "long head in one write":  # its blank line in the same read
                head = b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                head += b"X-Pad: " + b"a" * MAX_HEAD + b"\r\n\r\n"
                writer.write(head)
            assert await reader.read() == b""  # cut, nothing said
            writer.close()
    finally:
        server.close()
        await server.wait_closed()
    assert handled == []


@pytest.fixture
async def holding() -> AsyncIterator[tuple[WsServer, asyncio.Queue[WsStream]]]:
    """A server whose handler hands each open stream over and reads nothing itself."""
    ends: asyncio.Queue[WsStream] = asyncio.Queue()

    async def hold(stream: WsStream) -> None:
        await ends.put(stream)
        await stream.wait_closed()

    server = await ws_serve(hold, "127.0.0.1", 0, OPTIONS)
    try:
        yield server, ends
    finally:
        server.close()
        await server.wait_closed()


async def test_a_peer_that_stops_answering_pings_is_closed_1011(
    holding: tuple[WsServer, asyncio.Queue[WsStream]],
) -> None:
    server, ends = holding
    async with asyncio.timeout(10):
        keep = WsOptions(max_size=1024, ping_interval=0.05, ping_timeout=0.2)
        stream = await ws_connect(_url(server), keep)
        peer = await ends.get()
        await asyncio.sleep(0.2)
        assert stream.close_code is None  # answered so far
        assert peer.transport is not None
        peer.transport.pause_reading()  # a peer gone silent
        with pytest.raises(ConnectionClosed) as caught:
            await stream.recv()
        assert caught.value.sent is not None and caught.value.sent.code == 1011


@pytest.fixture
async def linked(
    holding: tuple[WsServer, asyncio.Queue[WsStream]],
) -> AsyncIterator[tuple[WsStream, WsStream]]:
    """Our client stream and the server's end of it, which nothing reads."""
    server, ends = holding
    async with asyncio.timeout(10):
        stream = await ws_connect(_url(server), OPTIONS)
        yield stream, await ends.get()


async def test_past_max_queue_unread_messages_the_socket_is_not_read(
    linked: tuple[WsStream, WsStream],
) -> None:
    stream, peer = linked
    async with asyncio.timeout(10):
        for i in range(OPTIONS.max_queue + 2):
            await stream.send(bytes([i]))
        while len(peer._queue) < OPTIONS.max_queue:
            await asyncio.sleep(0.01)
        assert not peer._reading
        got = [await peer.recv() for _ in range(OPTIONS.max_queue + 2)]
        assert got == [bytes([i]) for i in range(OPTIONS.max_queue + 2)]
        assert peer._reading
        await stream.close()


async def test_server_close_ends_open_streams_going_away(echo_server: WsServer) -> None:
    async with asyncio.timeout(10):
        stream = await ws_connect(_url(echo_server), OPTIONS)
        await stream.send(b"hello")
        assert await stream.recv() == b"hello"
        echo_server.close()
        await echo_server.wait_closed()
        with pytest.raises(ConnectionClosed) as caught:
            await stream.recv()
        assert caught.value.rcvd is not None and caught.value.rcvd.code == 1001


async def test_closing_the_server_cuts_connections_still_in_their_upgrade() -> None:
    async def handler(stream: WsStream) -> None:
        raise AssertionError("never opened")

    server = await ws_serve(handler, "127.0.0.1", 0, WsOptions(max_size=1024, open_timeout=60))
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\n")  # and no more
    await asyncio.sleep(0.1)
    async with asyncio.timeout(10):  # not the 60 s of its open_timeout
        server.close()
        await server.wait_closed()
        assert await reader.read() == b""
    writer.close()


async def test_messages_arriving_after_our_close_frame_are_dropped_unread(
    linked: tuple[WsStream, WsStream],
) -> None:
    # A peer that goes on sending without hearing our close (one refused at admission, say)
    # must not fill the queue: what comes after our close frame is dropped, the queue
    # stays empty, reading goes on, and the peer's close reply ends the close in order.
    stream, peer = linked
    async with asyncio.timeout(10):
        await stream.send(b"before")
        while peer.queued == 0:
            await asyncio.sleep(0.01)
        assert stream.transport is not None
        stream.transport.pause_reading()  # deaf to the close for now
        closing = asyncio.ensure_future(peer.close(1013, "busy"))
        for _ in range(OPTIONS.max_queue * 4):
            await stream.send(b"x" * 1000)
        stream.transport.resume_reading()  # hears it; its reply comes after all the rest
        with pytest.raises(ConnectionClosed) as caught:
            await stream.recv()
        assert caught.value.rcvd is not None and caught.value.rcvd.code == 1013
        await closing
        assert peer.close_code == 1013 and peer.queued == 1  # only the message sent before
        assert peer.dropped == OPTIONS.max_queue * 4


@pytest.mark.parametrize("cap", ["MAX_OPENING", "MAX_OPENING_PER_ADDRESS"])
async def test_connections_in_their_upgrade_are_bounded(
    monkeypatch: pytest.MonkeyPatch, cap: str
) -> None:
    # Past the cap of connections still in their HTTP upgrade (in all, or from one
    # address: these all come from 127.0.0.1), the next is cut at once; once one of them
    # ends, a new connection gets its upgrade again.
    monkeypatch.setattr(wsconn, "MAX_OPENING", 100)
    monkeypatch.setattr(wsconn, "MAX_OPENING_PER_ADDRESS", 100)
    monkeypatch.setattr(wsconn, cap, 3)
    server = await ws_serve(_echo, "127.0.0.1", 0, WsOptions(max_size=1024, open_timeout=30))
    port = server.sockets[0].getsockname()[1]
    held = []
    try:
        async with asyncio.timeout(20):  # not the 30 s of open_timeout
            for _ in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET / HTTP/1.1\r\n")  # and no more
                held.append(writer)
            while len(server._opening) < 3:
                await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert await reader.read() == b""  # cut, nothing said
            writer.close()
            held.pop().close()
            while len(server._opening) > 2:
                await asyncio.sleep(0.01)
            stream = await ws_connect(_url(server), OPTIONS)
            await stream.send(b"in")
            assert await stream.recv() == b"in"
            await stream.close()
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
