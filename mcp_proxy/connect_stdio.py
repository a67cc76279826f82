"""``talos-proxy connect`` on stdio: the agent's lines in, the tunnel's lines out
(MCP "Transports: stdio"; the session logic is :mod:`mcp_proxy.client`).

Lines of the agent are handed to the session inside ``data_received`` while the
link is up (no task hop); reading stops while lines wait for the link, while the
link's sender is full, or while the serving side holds the session (PAUSE).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import cast

from mcp_proxy.client import ClientSession, TunnelClient
from mcp_proxy.jsonrpc import INTERNAL_ERROR, INVALID_REQUEST, error_reply
from mcp_proxy.lines import LineSplitter
from mcp_proxy.tunnel_wire import MAX_MESSAGE_BYTES

__all__ = ["EOF_DRAIN", "STDIO_LINE_LIMIT", "serve_stdio"]

STDIO_LINE_LIMIT = MAX_MESSAGE_BYTES
#: Seconds ``connect`` waits, after the end of its stdin, for responses still due.
EOF_DRAIN = 30.0


class _StdinLines(asyncio.Protocol):
    """Agent lines from stdin, handled inside ``data_received`` while the link is up."""

    def __init__(self, session: ClientSession) -> None:
        self.session = session
        self.splitter = LineSplitter(self._on_line, self._on_overflow, STDIO_LINE_LIMIT)
        self.backlog: deque[bytes] = deque()
        self.done = asyncio.Event()
        self.transport: asyncio.ReadTransport | None = None
        self._slow: asyncio.Task[None] | None = None
        self._eof = False
        # Reading stops while any holds: lines wait for the link, the link's sender is
        # full (the serving peer is not taking what the agent writes), or the serving
        # side's tool is not reading this session's input (PAUSE).
        self._held_backlog = False
        self._held_pressure = False
        self._held_remote = False
        session.client.sender.on_pressure(self._on_pressure)
        session.on_hold = self._on_hold

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's pipe transports do not subclass asyncio's ABCs.
        self.transport = cast(asyncio.ReadTransport, transport)

    def data_received(self, data: bytes) -> None:
        self.splitter.feed(data)
        if self.session.client.link_up:
            # Every line of this read leaves now, as one frame: no loop pass in between.
            self.session.client.sender.flush_now()

    def eof_received(self) -> bool:
        self.splitter.eof()
        self._finish_when_drained()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish_when_drained()

    def _on_line(self, line: bytes) -> None:
        line = line.strip()
        if not line:
            return
        if not self.backlog and self.session.try_forward(line):
            return
        # Link down: keep order behind the first waiting line, and stop reading meanwhile.
        self.backlog.append(line)
        if len(self.backlog) > 1024 and not self._held_backlog:
            self._held_backlog = True
            self._update_reading()
        if self._slow is None or self._slow.done():
            self._slow = asyncio.get_running_loop().create_task(self._drain())

    def _on_overflow(self) -> None:
        self.session.deliver(
            error_reply(None, INVALID_REQUEST, f"message above {STDIO_LINE_LIMIT} bytes")
        )

    async def _drain(self) -> None:
        while self.backlog:
            await self.session.from_agent(self.backlog.popleft())
        self._held_backlog = False
        self._update_reading()
        if self._eof:
            self.done.set()

    def _on_pressure(self, pressed: bool) -> None:
        self._held_pressure = pressed
        self._update_reading()

    def _on_hold(self, held: bool) -> None:
        self._held_remote = held
        self._update_reading()

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            if self._held_backlog or self._held_pressure or self._held_remote:
                transport.pause_reading()
            else:
                transport.resume_reading()

    def _finish_when_drained(self) -> None:
        if self.backlog:
            self._eof = True
        else:
            self.done.set()


async def serve_stdio(client: TunnelClient, *, drain: float = EOF_DRAIN) -> None:
    """Run one MCP session over this process's stdin/stdout until stdin closes.

    Either may be a pipe, a socket, a terminal, a regular file or /dev/null
    (:mod:`mcp_proxy.stdio` picks how to drive each). After the end of stdin
    the requests already sent still get their responses (``talos-proxy connect
    < requests.jsonl``), for up to ``drain`` seconds; any left then are
    answered with an error, so each request has exactly one response.
    """
    from mcp_proxy.stdio import open_stdin, open_stdout

    out = await open_stdout()
    answered = asyncio.Event()

    def deliver(line: bytes) -> None:
        out.write(line + b"\n")
        answered.set()

    def deliver_many(lines: list[bytes]) -> None:
        # One pipe write per tunnel frame, not one per line: per-line writes were 22 % of
        # connect's GIL time at 64 in flight.
        lines.append(b"")
        out.write(b"\n".join(lines))
        answered.set()

    session = client.open_session(deliver, deliver_many, out.backpressure, out.buffered)
    lines = _StdinLines(session)
    in_transport = await open_stdin(lines)
    try:
        await lines.done.wait()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(drain):
                while session.pending:
                    answered.clear()
                    await answered.wait()
        late, session.pending = session.pending, {}
        for request_id in late:
            deliver(error_reply(request_id, INTERNAL_ERROR, "connect stopped before the response"))
    finally:
        in_transport.close()
        session.close()
        await client.close()
        await out.aclose()
