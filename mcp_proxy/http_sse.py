"""One HTTP response's worth of MCP messages, as JSON or as an SSE stream (MCP "Streamable HTTP").

An :class:`Exchange` collects the messages bound for one POST (its response
and what precedes it) or one GET stream. :func:`respond` writes them out: as
``application/json`` when the client accepts it and the response is the only
message (so a result of any size avoids the client's SSE event limit), else as
``text/event-stream``. The choice is deferred until the first message arrives,
or until ``KEEPALIVE`` seconds passed without one; an open SSE stream then gets
a comment line every ``KEEPALIVE`` seconds so proxies keep it open.

Resumable exchanges (2025-11-25 sessions) number their events ``KEY-SEQ``,
start with a priming event (an id and empty data), and keep their last
``REPLAY_EVENTS`` events; a GET with ``Last-Event-ID: KEY-SEQ`` gets the
events after SEQ, then the rest of the exchange live (2025-11-25 "Resumability
and Redelivery"). Stateless exchanges (2026-07-28) carry no ids: a request's
stream is cancelled by closing it, never resumed.

Memory is bounded against a client that stops reading: an attached response
holds at most ``STREAM_BUFFER_MAX`` bytes not yet written (one message of the
largest size plus 8 MiB); beyond that its queue is dropped and the response
ends once the write it is blocked in completes (a resumable one resumes from
the replay log, and a resume replays at most ``STREAM_BUFFER_MAX`` of it, the
newest). The replay logs of one session share one :class:`ReplayBudget` of
``REPLAY_BYTES``, however many exchanges it keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import deque
from collections.abc import Callable

from aiohttp import web

from mcp_proxy.jsonrpc import JsonRpcError, Kind, sniff
from mcp_proxy.tunnel_wire import MAX_MESSAGE_BYTES
from talos.logging import event

__all__ = [
    "KEEPALIVE",
    "REPLAY_EVENTS",
    "STREAM_BUFFER_MAX",
    "Exchange",
    "Item",
    "ReplayBudget",
    "parse_event_id",
    "respond",
]

log = logging.getLogger(__name__)

KEEPALIVE = 15.0
REPLAY_EVENTS = 256
REPLAY_BYTES = 32 << 20
STREAM_BUFFER_MAX = MAX_MESSAGE_BYTES + (8 << 20)
# JSON-RPC error codes a stateless response carries with a 4xx status (2026-07-28
# "Streamable HTTP": the transport status mirrors request errors).
ERROR_STATUS = {-32700: 400, -32600: 400, -32602: 400, -32020: 400, -32021: 400, -32022: 400}
ERROR_STATUS[-32601] = 404

Item = tuple[int, bytes] | None


class ReplayBudget:
    """The bytes that the replay logs of one session keep together, at most ``limit``.

    ``reclaim(exchange)`` runs when ``exchange`` took them past it; by default that
    exchange drops its own oldest events (all but its newest, which must stay
    resumable).
    """

    def __init__(
        self, limit: int | None = None, reclaim: Callable[[Exchange], None] | None = None
    ) -> None:
        self.limit = REPLAY_BYTES if limit is None else limit
        self.kept = 0
        self.reclaim = reclaim or (lambda exchange: exchange.drop_replay(keep_newest=True))

    @property
    def over(self) -> bool:
        return self.kept > self.limit


class Exchange:
    """The messages of one response stream, numbered, with a bounded replay log if resumable."""

    def __init__(
        self, key: str | None = None, keep: int = REPLAY_EVENTS, budget: ReplayBudget | None = None
    ) -> None:
        self.key = key
        self.seq = 0
        self.done = False
        self.events: deque[tuple[int, bytes]] = deque(maxlen=keep if key is not None else 0)
        self.budget = budget if budget is not None else ReplayBudget()
        self._replaying = key is not None  # until release(): the session forgot it
        self.sink: asyncio.Queue[Item] | None = None
        self.queued = 0  # bytes in sink not yet taken by the response

    @property
    def listening(self) -> bool:
        """True while an HTTP response is attached to this exchange."""
        return self.sink is not None

    def emit(self, line: bytes) -> None:
        self.seq += 1
        if self._replaying:
            if len(self.events) == self.events.maxlen:
                self._drop_oldest()
            self.events.append((self.seq, line))
            budget = self.budget
            budget.kept += len(line)
            if budget.over:
                budget.reclaim(self)
        sink = self.sink
        if sink is not None:
            if self.queued + len(line) > STREAM_BUFFER_MAX:
                self._cut(sink)
                return
            sink.put_nowait((self.seq, line))
            self.queued += len(line)

    def _drop_oldest(self) -> None:
        self.budget.kept -= len(self.events.popleft()[1])

    def drop_replay(self, *, keep_newest: bool) -> None:
        """Drop the oldest events while the budget is over (all of them unless ``keep_newest``)."""
        events, budget = self.events, self.budget
        while budget.over and len(events) > keep_newest:
            self._drop_oldest()

    def release(self) -> None:
        """Give the replay log's bytes back to the budget and keep none from now on: the
        session forgot the exchange, though its response may still be streaming."""
        self._replaying = False
        while self.events:
            self._drop_oldest()

    def taken(self, item: Item) -> None:
        """The response took ``item`` from its queue."""
        if item is not None:
            self.queued -= len(item[1])

    def _cut(self, sink: asyncio.Queue[Item]) -> None:
        """The client is not reading: end its response, drop what it was owed."""
        event(log, "http_stream_cut", logging.WARNING, stream=self.key, queued=self.queued)
        while not sink.empty():
            sink.get_nowait()
        sink.put_nowait(None)
        self.sink = None
        self.queued = 0

    def finish(self) -> None:
        """No more messages: the attached response ends after what it holds."""
        if self.done:
            return
        self.done = True
        if self.sink is not None:
            self.sink.put_nowait(None)

    def attach(self, after: int = 0) -> asyncio.Queue[Item]:
        """A fresh queue for a (re)connected response: events after ``after``, then live ones."""
        if self.sink is not None:
            self.sink.put_nowait(None)  # one listener at a time: the older one ends
        queue: asyncio.Queue[Item] = asyncio.Queue()
        missed = [(seq, line) for seq, line in self.events if seq > after]
        self.queued = sum(len(line) for _, line in missed)
        while self.queued > STREAM_BUFFER_MAX and len(missed) > 1:
            self.queued -= len(missed.pop(0)[1])  # more than one stream may hold: the newest
        for item in missed:
            queue.put_nowait(item)
        if self.done:
            queue.put_nowait(None)
        self.sink = queue
        return queue

    def detach(self, queue: asyncio.Queue[Item]) -> None:
        if self.sink is queue:
            self.sink = None


def parse_event_id(value: str) -> tuple[str, int] | None:
    """``KEY-SEQ`` as this module numbers events; None for anything else."""
    key, sep, seq = value.rpartition("-")
    # ASCII digits, at most 19: str.isdigit() takes "²", and int() refuses 4,300 digits.
    if not sep or not key or not _SEQ.fullmatch(seq):
        return None
    return key, int(seq)


_SEQ = re.compile(r"[0-9]{1,19}")


def _status_of(line: bytes, stateless: bool) -> int:
    if not stateless:
        return 200
    try:
        msg = sniff(line)
    except JsonRpcError:
        return 200
    if msg.kind is Kind.ERROR and isinstance(msg.result, dict):
        code = msg.result.get("code")
        if isinstance(code, int):
            return ERROR_STATUS.get(code, 200)
    return 200


async def respond(
    request: web.Request,
    exchange: Exchange,
    queue: asyncio.Queue[Item],
    *,
    json_ok: bool,
    headers: dict[str, str],
    prime: int = 0,
    keepalive: float = KEEPALIVE,
) -> web.StreamResponse:
    """Write ``exchange`` as JSON (one response and nothing else) or as SSE; detaches at the end."""
    try:
        first: Item | bool
        try:
            first = False
            if json_ok:
                async with asyncio.timeout(keepalive):
                    first = await queue.get()
        except TimeoutError:
            first = False  # silent for a while: commit to SSE so keepalives can flow
        if isinstance(first, tuple) and exchange.sink is queue:
            exchange.taken(first)
        # The response came and nothing else is owed: only the end marker is left queued.
        if json_ok and isinstance(first, tuple) and exchange.done and queue.qsize() == 1:
            return web.Response(
                status=_status_of(first[1], exchange.key is None),
                body=first[1],
                content_type="application/json",
                headers=headers,
            )
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
        )
        await response.prepare(request)
        with contextlib.suppress(ConnectionResetError):
            if exchange.key is not None:
                await response.write(f"id: {exchange.key}-{prime}\ndata: \n\n".encode())
            if isinstance(first, tuple):
                await response.write(_event(exchange.key, *first))
            if first is not None:
                await _pump(response, exchange, queue, keepalive)
            await response.write_eof()
        return response
    finally:
        exchange.detach(queue)


async def _pump(
    response: web.StreamResponse, exchange: Exchange, queue: asyncio.Queue[Item], keepalive: float
) -> None:
    while True:
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel (the client
            # gone) that lands as an item arrives, and the handler went on for nobody.
            async with asyncio.timeout(keepalive):
                item = await queue.get()
        except TimeoutError:
            await response.write(b": keepalive\n\n")
            continue
        if item is None:
            return
        if exchange.sink is queue:
            exchange.taken(item)
        await response.write(_event(exchange.key, *item))


def _event(key: str | None, seq: int, line: bytes) -> bytes:
    head = f"id: {key}-{seq}\n".encode() if key is not None else b""
    return head + b"event: message\ndata: " + line + b"\n\n"
