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
