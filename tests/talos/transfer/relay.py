"""A real TCP relay on 127.0.0.1 for bulk-path fault injection (flip a byte, cut the stream)."""

from __future__ import annotations

import asyncio
import contextlib


class Relay:
    """Forwards connections to ``127.0.0.1:target``.

    In the client -> server direction it can XOR one byte at stream offset
    ``flip_at`` or close both sides once ``cut_after`` bytes went through; only
    the first connection is damaged, later ones pass untouched.
    """

    def __init__(self, target: int, flip_at: int | None = None, cut_after: int | None = None):
        self.target = target
        self.flip_at = flip_at
        self.cut_after = cut_after
        self.connections = 0
        self.cut = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> Relay:
        self._server = await asyncio.start_server(self._on_conn, "127.0.0.1", 0)
        return self

    async def _on_conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.connections += 1
        first = self.connections == 1
        sr, sw = await asyncio.open_connection("127.0.0.1", self.target)
        upstream = asyncio.create_task(self._pipe(cr, sw, first, (cw, sw)))
        downstream = asyncio.create_task(self._pipe(sr, cw, False, (cw, sw)))
        self._tasks |= {upstream, downstream}

    async def _pipe(
        self,
        r: asyncio.StreamReader,
        w: asyncio.StreamWriter,
        damage: bool,
        both: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        seen = 0
        try:
            while data := await r.read(1 << 16):
                if damage and self.flip_at is not None and seen <= self.flip_at < seen + len(data):
                    buf = bytearray(data)
                    buf[self.flip_at - seen] ^= 0x40
                    data = bytes(buf)
                if damage and self.cut_after is not None and seen + len(data) >= self.cut_after:
                    w.write(data[: self.cut_after - seen])
                    self.cut.set()
                    for x in both:
                        x.transport.abort()
                    return
                seen += len(data)
                w.write(data)
                await w.drain()
        except OSError:
            pass
        finally:
            w.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
