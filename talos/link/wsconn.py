"""The WebSocket a direct link runs on: the asyncio side of :mod:`talos.link.wsframe`.

:class:`WsStream` is a :class:`~talos.link.peer.FrameStream` (one link frame
per binary message) over one TCP connection, as the relay's stream is over
NATS. It only moves bytes, waits and times out: the framing and the closing
rules are :class:`~talos.link.wsframe.WsFrames`', the opening handshake (the
HTTP upgrade, RFC 6455 section 4) is websockets' sans-I/O ``ClientProtocol``
/ ``ServerProtocol``, fed exactly the bytes of the HTTP head so that what
follows it is ours to parse (docs/adr/0016-own-websocket-data-phase.md).

Received messages are queued as they are parsed, inside ``data_received``;
:meth:`WsStream.recv` returns the next one without a suspension when one is
there. Past ``max_queue`` unread messages the socket is not read (the peer's
sends then wait on TCP). Once our close frame is sent, messages still arriving
are dropped unread: nobody reads a stream its owner is closing, and a peer
refused at admission could otherwise make it hold ``max_queue`` messages of
``max_size`` each for as long as the close waits for its reply.

Writes are never awaited before they are made: :meth:`WsStream.send` writes,
then waits while the transport is above its high-water mark, so order on the
wire is the order of calls, ``send_nowait`` included. Keepalive: a ping every
``ping_interval``; a pong not back within ``ping_timeout`` fails the
connection (1011), as websockets does. A closed stream raises websockets'
``ConnectionClosed`` with both close frames, which the link layer reads the
peer's refusal code from.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

from websockets.client import ClientProtocol
from websockets.exceptions import (
    ConnectionClosed,
    ConnectionClosedError,
    ConnectionClosedOK,
    InvalidHandshake,
)
from websockets.frames import Close as WsClose
from websockets.http11 import Request
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.uri import parse_uri

from talos.link.wsframe import Closed, Pong, WebSocketError, WsFrames

__all__ = ["WsOptions", "WsServer", "WsStream", "ws_connect", "ws_serve"]

log = logging.getLogger(__name__)

#: The HTTP head of an upgrade (request or response) is refused past this many bytes.
MAX_HEAD = 16 * 1024
#: Connections a server keeps in their HTTP upgrade at once, in all and from one address;
#: one more is cut at once. Each may hold MAX_HEAD for open_timeout before it proves
#: anything (4 MiB in all), and one host cannot take every place.
MAX_OPENING = 256
MAX_OPENING_PER_ADDRESS = 16
_HEAD_END = b"\r\n\r\n"
#: Close code when a keepalive pong is late (RFC 6455 section 7.4.1: internal error).
CLOSE_PING_TIMEOUT = 1011
CLOSE_GOING_AWAY = 1001
_OK_CODES = (1000, 1001, 1005)  # 1005: a close frame without a code
#: The transport's high-water mark: above it, sends wait (websockets' default limit).
WRITE_LIMIT = 32 * 1024
#: ``can_send_now`` while the transport holds less than this (half the high-water mark):
#: what is sent now leaves without queueing behind much.
_SEND_NOW_LIMIT = 16 * 1024


@dataclass(frozen=True, slots=True)
class WsOptions:
    """Bounds and timers of one WebSocket (both ends of a link use the same)."""

    max_size: int
    max_queue: int = 16
    ping_interval: float = 20.0
    ping_timeout: float = 20.0
    open_timeout: float = 10.0
    close_timeout: float = 2.0


class WsStream(asyncio.Protocol):
    """One WebSocket, shaped like the stream a link runs on (see the module docstring)."""

    via = "direct"

    def __init__(self, options: WsOptions, *, client: bool) -> None:
        self.options = options
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.frames: WsFrames | None = None  # set once the opening handshake is done
        self._head = bytearray()  # bytes read while the HTTP head is not done
        self._head_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue: deque[bytes | str] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._drain: asyncio.Future[None] | None = None
        self._reading = True
        self._dropping = False  # our close frame is sent: arriving messages are dropped
        self.dropped = 0
        self._pings: dict[bytes, asyncio.Future[None]] = {}
        self._keeper: asyncio.Task[None] | None = None
        self.write_paused = False
        #: websockets' meaning: None while the TCP connection is up; then the peer's
        #: close code, or 1006 when no close frame came.
        self.close_code: int | None = None
        self.close_reason = ""
        self.remote_address: tuple[str, int] | None = None
        self.local_address: tuple[str, int] | None = None

    # --- the FrameStream interface -------------------------------------------------------------

    @property
    def source(self) -> str:
        """The peer's IP address, what handshake admission counts by."""
        return self.remote_host or ""

    @property
    def remote_host(self) -> str | None:
        return self.remote_address[0] if self.remote_address else None

    @property
    def open(self) -> bool:
        return self.close_code is None

    async def send(self, data: bytes) -> None:
        """Write one binary message, then wait while the transport is above its high mark."""
        self._write_message(data)
        if self.write_paused:
            if self._drain is None or self._drain.done():
                self._drain = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._drain)
            if self._lost.done():
                raise self._closed_error()

    def send_nowait(self, data: bytes) -> bool:
        """Write one binary message now if that needs no waiting; False (nothing sent) if not."""
        if not self.writable:
            return False
        self._write_message(data)
        return True

    def _write_message(self, data: bytes) -> None:
        frames, transport = self.frames, self.transport
        if frames is None or transport is None or not frames.open or transport.is_closing():
            raise self._closed_error()
        transport.write(frames.send_binary(data))

    @property
    def writable(self) -> bool:
        """True when :meth:`send_nowait` would write."""
        frames, transport = self.frames, self.transport
        return (
            not self.write_paused
            and frames is not None
            and frames.open
            and transport is not None
            and not transport.is_closing()
        )

    @property
    def can_send_now(self) -> bool:
        """True when :meth:`send` would not wait for flow control."""
        transport = self.transport
        return (
            self.writable
            and transport is not None
            and transport.get_write_buffer_size() < _SEND_NOW_LIMIT
        )

    @property
    def queued(self) -> int:
        """Messages received and not yet taken by :meth:`recv`."""
        return len(self._queue)

    async def recv(self) -> bytes | str:
        """The next message; raises ``ConnectionClosed`` once closed and drained.

        One reader at a time (a link's read loop).
        """
        queue = self._queue
        while not queue:
            if self._lost.done() or (self.frames is not None and self.frames.closed):
                # No message can come any more (until then, the peer's may, even after ours).
                await self._closing_done()
                raise self._closed_error()
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        message = queue.popleft()
        if not self._reading and len(queue) <= self.options.max_queue // 4:
            self._set_reading(True)
        return message

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Send our close frame, wait (``close_timeout``) for the peer's and the TCP end."""
        transport, frames = self.transport, self.frames
        if transport is None or self._lost.done():
            return
        if frames is None:  # still opening: nothing to close politely
            transport.abort()
        else:
            data = frames.send_close(code, reason)
            if data and not transport.is_closing():
                transport.write(data)
            self._dropping = True
            if not self._reading:  # a full queue must not keep the peer's reply unread
                self._set_reading(True)
            if frames.closed and not self.client:
                transport.close()  # the server closes TCP first (RFC 6455 section 7.1.1)
        await self._closing_done()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._lost)

    # --- asyncio callbacks ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A TCP transport (uvloop's too, which does not subclass asyncio.Transport).
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=WRITE_LIMIT)
        self.remote_address = _address(transport.get_extra_info("peername"))
        self.local_address = _address(transport.get_extra_info("sockname"))

    def data_received(self, data: bytes) -> None:
        frames = self.frames
        if frames is None:
            self._opening_data(data)
            return
        try:
            events = frames.receive_data(data)
        except WebSocketError:
            self._fail(frames)
            return
        # While the peer does not take what we write, a pong waits (the framer keeps the
        # latest only); a close frame leaves at once.
        if not self.write_paused or not frames.open:
            out = frames.data_to_send()
            if out:
                self._write(out)
        if not events:
            return
        queue = self._queue
        for ev in events:
            kind = type(ev)
            if kind is bytes or kind is str:
                if self._dropping:
                    self.dropped += 1
                else:
                    queue.append(cast(bytes | str, ev))
            elif kind is Pong:
                pong = self._pings.pop(cast(Pong, ev).data, None)
                if pong is not None and not pong.done():
                    pong.set_result(None)
            elif kind is Closed:
                self._on_close_frame(frames)
        if self._reading and len(queue) >= self.options.max_queue and not self._dropping:
            self._set_reading(False)
        self._wake()

    def eof_received(self) -> bool:
        return False  # the transport closes itself; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        frames = self.frames
        rcvd = frames.close_rcvd if frames is not None else None
        self.close_code = rcvd.code if rcvd is not None else 1006
        self.close_reason = rcvd.reason if rcvd is not None else ""
        if not self._lost.done():
            self._lost.set_result(None)
        if not self._head_done.done():
            self._head_done.set_exception(ConnectionError("closed during the opening handshake"))
            self._head_done.exception()  # retrieved: an opener that timed out never will
        if self._keeper is not None:
            self._keeper.cancel()
        for fut in (self._drain, *self._pings.values()):
            if fut is not None and not fut.done():
                fut.set_result(None)
        self._pings.clear()
        self._wake()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.frames is not None:
            out = self.frames.data_to_send()
            if out:
                self._write(out)
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # --- opening -------------------------------------------------------------------------------

    def _opening_data(self, data: bytes) -> None:
        self._head += data
        if self._head_done.done():
            return  # complete: what follows is the data phase's (start() takes it)
        end = self._head.find(_HEAD_END)
        if end < 0 and len(self._head) <= MAX_HEAD:
            return
        if 0 <= end <= MAX_HEAD - len(_HEAD_END):
            self._head_done.set_result(None)
            return
        # A head over MAX_HEAD, whether or not its blank line came in the same read.
        self._head_done.set_exception(ConnectionError("HTTP head too long"))
        self._head_done.exception()
        assert self.transport is not None
        self.transport.abort()

    async def read_head(self) -> bytes:
        """The HTTP head of the opening handshake, through its blank line."""
        await self._head_done
        end = self._head.index(_HEAD_END) + len(_HEAD_END)
        return bytes(self._head[:end])

    def start(self, head_length: int) -> None:
        """Enter the data phase; what came after the HTTP head is its first bytes."""
        rest = bytes(self._head[head_length:])
        self._head = bytearray()
        self.frames = WsFrames(client=self.client, max_size=self.options.max_size)
        if self.options.ping_interval:
            self._keeper = asyncio.get_running_loop().create_task(self._keepalive())
        if rest:
            self.data_received(rest)

    # --- internals -----------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _set_reading(self, on: bool) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            self._reading = on
            transport.resume_reading() if on else transport.pause_reading()

    def _on_close_frame(self, frames: WsFrames) -> None:
        assert self.transport is not None
        if not self.client:
            self.transport.close()  # the reply (if any) was written first
        else:
            # The server closes TCP; a server that does not is cut after close_timeout.
            asyncio.get_running_loop().call_later(self.options.close_timeout, self._abort)

    def _fail(self, frames: WsFrames) -> None:
        """A forbidden frame: our close frame (queued by the framer) goes, then TCP ends."""
        self._write(frames.data_to_send())
        assert self.transport is not None
        self.transport.close()
        self._wake()

    def _abort(self) -> None:
        if self.transport is not None and not self._lost.done():
            self.transport.abort()

    async def _closing_done(self) -> None:
        """Wait up to ``close_timeout`` for the TCP connection to end, then cut it."""
        if self._lost.done():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.options.close_timeout):
                await asyncio.shield(self._lost)
                return
        self._abort()
        await asyncio.shield(self._lost)

    async def _keepalive(self) -> None:
        options = self.options
        while True:
            await asyncio.sleep(options.ping_interval)
            frames = self.frames
            if frames is None or not frames.open or self.transport is None:
                return
            payload = os.urandom(4)
            pong = self._pings[payload] = asyncio.get_running_loop().create_future()
            self._write(frames.send_ping(payload))
            try:
                async with asyncio.timeout(options.ping_timeout):
                    await pong
            except TimeoutError:
                self._write(frames.send_close(CLOSE_PING_TIMEOUT, "keepalive ping timeout"))
                self._abort()
                return

    def _closed_error(self) -> ConnectionClosed:
        frames = self.frames
        rcvd = sent = None
        if frames is not None:
            if frames.close_rcvd is not None:
                rcvd = WsClose(frames.close_rcvd.code, frames.close_rcvd.reason)
            if frames.close_sent is not None:
                sent = WsClose(frames.close_sent.code, frames.close_sent.reason)
        order = frames.rcvd_then_sent if frames is not None and rcvd and sent else None
        ok = (rcvd is None or rcvd.code in _OK_CODES) and (sent is None or sent.code in _OK_CODES)
        if ok and (rcvd is not None or sent is not None):
            return ConnectionClosedOK(rcvd, sent, order)
        return ConnectionClosedError(rcvd, sent, order)


def _address(name: object) -> tuple[str, int] | None:
    """(host, port) of a socket name; None for what is not an IP socket's."""
    if isinstance(name, tuple) and len(name) >= 2:
        return (str(name[0]), int(name[1]))
    return None


async def ws_connect(url: str, options: WsOptions) -> WsStream:
    """Open ``url`` (``ws://`` or ``wss://``) and run the client's opening handshake.

    Raises ``InvalidURI``, ``InvalidHandshake`` (a refusal or a bad response),
    ``OSError`` or ``TimeoutError`` (``open_timeout``).
    """
    uri = parse_uri(url)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(options.open_timeout):
        transport, stream = await loop.create_connection(
            lambda: WsStream(options, client=True),
            uri.host,
            uri.port,
            ssl=ssl.create_default_context() if uri.secure else None,
            server_hostname=uri.host if uri.secure else None,
        )
        try:
            opening = ClientProtocol(uri, max_size=options.max_size)
            opening.send_request(opening.connect())
            transport.write(b"".join(opening.data_to_send()))
            try:
                head = await stream.read_head()
            except ConnectionError as exc:
                raise InvalidHandshake(str(exc)) from None
            opening.receive_data(head)
            opening.events_received()
            if opening.state is not State.OPEN:
                raise opening.handshake_exc or InvalidHandshake("the upgrade was not accepted")
        except BaseException:
            transport.abort()
            raise
    stream.start(len(head))
    return stream


Handler = Callable[[WsStream], Awaitable[None]]


class WsServer:
    """Accepts WebSockets on a socket; ``handler(stream)`` runs once each is open."""

    def __init__(self, handler: Handler, options: WsOptions) -> None:
        self.handler = handler
        self.options = options
        self.server: asyncio.Server | None = None
        self._streams: set[WsStream] = set()  # open: their handler runs
        self._opening: set[WsStream] = set()  # still in the HTTP upgrade
        self._hosts: Counter[str] = Counter()  # of them, from each address
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self.server.sockets) if self.server is not None else ()

    def _made(self) -> WsStream:
        stream = WsStream(self.options, client=False)
        task = asyncio.get_running_loop().create_task(self._serve(stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return stream

    async def _serve(self, stream: WsStream) -> None:
        await asyncio.sleep(0)  # connection_made first: the peer's address is known
        host = stream.remote_host or ""
        if len(self._opening) >= MAX_OPENING or self._hosts[host] >= MAX_OPENING_PER_ADDRESS:
            stream._abort()
            return
        self._opening.add(stream)
        self._hosts[host] += 1
        try:
            opened = await self._accept(stream)
        finally:
            self._opening.discard(stream)
            self._hosts[host] -= 1
            if not self._hosts[host]:
                del self._hosts[host]
        if not opened:
            return
        self._streams.add(stream)
        try:
            await self.handler(stream)
        except Exception:  # the handler's own fault: the stream closes, the server goes on
            log.exception("WebSocket connection handler failed")
        finally:
            self._streams.discard(stream)
            await stream.close()

    async def _accept(self, stream: WsStream) -> bool:
        """The server's opening handshake; False (the connection cut) if it failed."""
        opening = ServerProtocol(max_size=self.options.max_size)
        try:
            async with asyncio.timeout(self.options.open_timeout):
                head = await stream.read_head()
        except (ConnectionError, TimeoutError):
            stream._abort()
            return False
        opening.receive_data(head)
        events = opening.events_received()
        if events and isinstance(events[0], Request):
            opening.send_response(opening.accept(events[0]))
        transport = stream.transport
        assert transport is not None
        for chunk in opening.data_to_send():
            if chunk:
                transport.write(chunk)
        if opening.state is not State.OPEN:
            transport.close()  # a refusal (400, 426, ...) was written first
            return False
        stream.start(len(head))
        return True

    def close(self, close_connections: bool = True) -> None:
        """Stop accepting (connections still in their upgrade are cut); with
        ``close_connections``, close each open stream (1001)."""
        if self.server is not None:
            self.server.close()
        for stream in list(self._opening):
            stream._abort()
        if close_connections:
            for stream in list(self._streams):
                task = asyncio.get_running_loop().create_task(
                    stream.close(CLOSE_GOING_AWAY, "server shutting down")
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def wait_closed(self) -> None:
        """Once closed: wait for the listener and every handler to end."""
        if self.server is not None:
            await self.server.wait_closed()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


async def ws_serve(handler: Handler, host: str, port: int, options: WsOptions) -> WsServer:
    """Listen on ``host:port``; each connection that completes the upgrade runs ``handler``."""
    server = WsServer(handler, options)
    server.server = await asyncio.get_running_loop().create_server(server._made, host, port)
    return server
