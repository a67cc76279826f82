"""A man-in-the-middle WebSocket relay on 127.0.0.1 for link attack tests.

Each connection accepted from the dialler is relayed to ``target``; every
message passes through ``tamper(direction, index, data)``, which returns the
messages to forward instead (none drops it, several inject). ``index`` counts
messages per direction and connection; handshake messages are 0-1 in each
direction (a2b: message 1 and 3, b2a: message 2 and ACCEPT), sealed frames
follow. Everything that crossed is kept in ``captured`` as a passive
observer would record it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from websockets.asyncio.client import connect
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

Tamper = Callable[[str, int, bytes], list[bytes]]


def honest(direction: str, index: int, data: bytes) -> list[bytes]:
    return [data]


@dataclass
class Relay:
    target: str
    tamper: Tamper = honest
    captured: list[tuple[str, bytes]] = field(default_factory=list)
    connections: int = 0
    server: Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        port = next(iter(self.server.sockets)).getsockname()[1]
        return f"ws://127.0.0.1:{port}"

    async def _handler(self, inbound: ServerConnection) -> None:
        self.connections += 1
        try:
            outbound = await connect(self.target, compression=None, max_size=None)
        except OSError:
            return
        async with outbound:
            pumps = [
                asyncio.create_task(self._pump("a2b", inbound, outbound)),
                asyncio.create_task(self._pump("b2a", outbound, inbound)),
            ]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await inbound.close()

    async def _pump(self, direction: str, src: object, dst: object) -> None:
        index = 0
        with contextlib.suppress(ConnectionClosed):
            async for data in src:  # type: ignore[attr-defined]
                assert isinstance(data, bytes)
                for out in self.tamper(direction, index, data):
                    self.captured.append((direction, out))
                    await dst.send(out)  # type: ignore[attr-defined]
                index += 1
        # Pass the close code on, the way a transparent proxy would.
        code = getattr(src, "close_code", None) or 1000
        with contextlib.suppress(ConnectionClosed):
            await dst.close(code if code != 1006 else 1000)  # type: ignore[attr-defined]


@contextlib.asynccontextmanager
async def relay_to(target: str, tamper: Tamper = honest) -> AsyncIterator[Relay]:
    relay = Relay(target, tamper)
    async with serve(relay._handler, "127.0.0.1", 0, compression=None, max_size=None) as server:
        relay.server = server
        yield relay


def client_frames(buf: bytearray) -> list[bytes]:
    """Complete WebSocket frames (client to server: masked) cut off the front of ``buf``."""
    out: list[bytes] = []
    while len(buf) >= 2:
        size, at = buf[1] & 0x7F, 2
        if size >= 126:
            width = 2 if size == 126 else 8
            if len(buf) < 2 + width:
                break
            size, at = int.from_bytes(buf[2 : 2 + width], "big"), 2 + width
        at += 4 if buf[1] & 0x80 else 0
        if len(buf) < at + size:
            break
        out.append(bytes(buf[: at + size]))
        del buf[: at + size]
    return out


@dataclass
class Delayer:
    """A TCP relay to ``port`` that, on the first connection only, holds the dialler's
    frames after the handshake (``held``) instead of passing them on; every later
    connection is relayed untouched. :meth:`cut_dialler` drops the dialler's side of
    the first connection while the listener's stays open and silent, so the listener
    closes that link without an answer: what a network path that delays, then loses,
    a connection looks like. :meth:`release` then delivers a held frame, late."""

    port: int
    held: list[bytes] = field(default_factory=list)
    _first: tuple[asyncio.StreamWriter, asyncio.StreamWriter] | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def _copy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()

    async def handle(self, ar: asyncio.StreamReader, aw: asyncio.StreamWriter) -> None:
        br, bw = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers += (aw, bw)
        if self._first is not None:
            await asyncio.gather(self._copy(ar, bw), self._copy(br, aw))
            return
        self._first = (aw, bw)
        task = asyncio.ensure_future(self._copy(br, aw))
        self._tasks.add(task)
        buf = bytearray()
        while b"\r\n\r\n" not in buf:
            data = await ar.read(1 << 16)
            if not data:
                return
            buf += data
        head, _, rest = bytes(buf).partition(b"\r\n\r\n")
        bw.write(head + b"\r\n\r\n")  # the HTTP upgrade
        buf, passed = bytearray(rest), 0
        with contextlib.suppress(OSError):
            while True:
                for frame in client_frames(buf):
                    if passed < 2:  # handshake messages 1 and 3
                        bw.write(frame)
                        passed += 1
                    else:
                        self.held.append(frame)
                data = await ar.read(1 << 16)
                if not data:
                    return
                buf += data

    def cut_dialler(self) -> None:
        assert self._first is not None
        for task in self._tasks:
            task.cancel()  # the listener's side is read no more: its close goes unanswered
        self._first[0].transport.abort()

    def release(self, index: int) -> None:
        assert self._first is not None
        self._first[1].write(self.held[index])

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for writer in self._writers:
            writer.transport.abort()
