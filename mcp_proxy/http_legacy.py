"""2025-11-25 Streamable HTTP sessions of the HTTP front: one tunnel session (one tool) each.

A session starts with ``initialize`` and is named by ``Mcp-Session-Id``.
Server messages are routed as the spec asks: a response to the exchange of
the POST that carries its request, a progress notification to the exchange
whose request holds its ``progressToken``, anything else (sampling,
elicitation, logging, list_changed) to the GET stream, or to the newest open
request exchange when there is none, or kept until a stream opens. Every
exchange is resumable (``http_sse``): the session keeps the last
``KEPT_EXCHANGES`` of them for a GET with ``Last-Event-ID``.

A request the client cancels (``notifications/cancelled``) ends its exchange
at once: the tool may rightly never answer it, and a session must not count
as busy because of it (MCP "Cancellation"). The session is idle when no
request exchange has a client attached; idle sessions are reaped by the front.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import OrderedDict, deque

from mcp_proxy.client import ClientSession, TunnelClient
from mcp_proxy.http_sse import STREAM_BUFFER_MAX, Exchange, Item, ReplayBudget
from mcp_proxy.jsonrpc import JsonRpcError, Kind, RequestId, Sniffed, error_reply, sniff
from talos.logging import event

__all__ = ["KEPT_EXCHANGES", "LegacySession"]

log = logging.getLogger(__name__)

KEPT_EXCHANGES = 64
GET_KEY = "0"
CANCELLED = -32800
MAX_BACKLOG = 1000
#: What waits for a GET while no stream is open: what one stream may take in one go.
BACKLOG_BYTES = STREAM_BUFFER_MAX


class LegacySession:
    """One MCP session of an HTTP client, carried by one tunnel session."""

    def __init__(self, client: TunnelClient) -> None:
        self.id = secrets.token_hex(16)
        self.tunnel: ClientSession = client.open_session(self.deliver)
        self.waiters: dict[RequestId, Exchange] = {}
        self.tokens: dict[RequestId, Exchange] = {}
        self.posts: list[Exchange] = []
        # The standalone stream lives as long as the session; each GET attaches to it.
        self.replay = ReplayBudget(reclaim=self._reclaim)
        self.get_stream = Exchange(GET_KEY, budget=self.replay)
        self.exchanges: OrderedDict[str, Exchange] = OrderedDict()
        self.backlog: deque[bytes] = deque()
        self.backlog_bytes = 0
        self._next = 0
        self.last_used = asyncio.get_running_loop().time()

    def touch(self) -> None:
        self.last_used = asyncio.get_running_loop().time()

    def idle_since(self, now: float) -> float:
        """Seconds without a request; 0 while a client still listens for a response."""
        if any(ex.listening for ex in self.posts):
            return 0.0
        return now - self.last_used

    def new_exchange(self) -> Exchange:
        self._next += 1
        exchange = Exchange(f"{self._next}", budget=self.replay)
        self.exchanges[exchange.key or ""] = exchange
        while len(self.exchanges) > KEPT_EXCHANGES:
            self.exchanges.popitem(last=False)[1].release()
        return exchange

    def _reclaim(self, emitting: Exchange) -> None:
        """The session's replay logs passed their budget: the oldest streams' logs go first
        (the standalone stream's, then the oldest requests'), the one emitting last."""
        for exchange in (self.get_stream, *self.exchanges.values()):
            if exchange is not emitting:
                exchange.drop_replay(keep_newest=False)
                if not self.replay.over:
                    return
        emitting.drop_replay(keep_newest=True)

    def open_request(self, msg: Sniffed) -> Exchange:
        """The exchange that carries the response to request ``msg``."""
        assert msg.id is not None
        exchange = self.new_exchange()
        old = self.waiters.pop(msg.id, None)
        if old is not None:
            self._end(old)  # a reused id: the older request's stream can no longer be told apart
        self.waiters[msg.id] = exchange
        if msg.progress_token is not None:
            self.tokens[msg.progress_token] = exchange
        self.posts.append(exchange)
        return exchange

    def forget(self, exchange: Exchange) -> None:
        """Drop a finished exchange from the replay store (its client read it to the end)."""
        if exchange.key is not None and self.exchanges.get(exchange.key) is exchange:
            del self.exchanges[exchange.key]
        exchange.release()

    def find(self, key: str) -> Exchange | None:
        """The exchange a ``Last-Event-ID`` names, if still kept."""
        return self.get_stream if key == GET_KEY else self.exchanges.get(key)

    def attach_get(self, after: int | None) -> tuple[asyncio.Queue[Item], int]:
        """Attach a GET to the standalone stream: replay after ``after`` (None: only new ones).

        Returns the queue and the sequence number its priming event names.
        """
        stream = self.get_stream
        start = stream.seq if after is None else after
        queue = stream.attach(start)
        while self.backlog:
            stream.emit(self.backlog.popleft())
        self.backlog_bytes = 0
        return queue, start

    def cancelled(self, request_id: RequestId) -> None:
        """The client cancelled ``request_id``: its stream ends with an error it will ignore.

        Ending it without a response would make a client resume it again and again
        (2025-11-25 "Resumability"); the tool's own late answer, if any, is dropped.
        """
        exchange = self.waiters.pop(request_id, None)
        if exchange is not None:
            exchange.emit(error_reply(request_id, CANCELLED, "request cancelled"))
            self._end(exchange)

    def _end(self, exchange: Exchange) -> None:
        exchange.finish()
        if exchange in self.posts:
            self.posts.remove(exchange)
        for token, holder in list(self.tokens.items()):
            if holder is exchange:
                del self.tokens[token]

    def deliver(self, line: bytes) -> None:
        try:
            msg = sniff(line)
        except JsonRpcError:
            event(log, "http_message_malformed_dropped", logging.WARNING, http_session=self.id[:8])
            return
        if msg.kind in (Kind.RESPONSE, Kind.ERROR) and msg.id is not None:
            exchange = self.waiters.pop(msg.id, None)
            if exchange is not None:
                exchange.emit(line)
                self._end(exchange)
            else:
                event(log, "cancelled_answer_dropped", logging.DEBUG, http_session=self.id[:8])
            return
        if msg.method == "notifications/progress" and isinstance(msg.params, dict):
            token = msg.params.get("progressToken")
            holder = self.tokens.get(token) if isinstance(token, int | str) else None
            if holder is not None:
                holder.emit(line)
                return
        if self.get_stream.listening:
            self.get_stream.emit(line)
        elif self.posts:
            listening = [ex for ex in self.posts if ex.listening]
            (listening or self.posts)[-1].emit(line)
        else:
            # Nobody listens: kept for the next GET, the newest within its bounds.
            backlog = self.backlog
            backlog.append(line)
            self.backlog_bytes += len(line)
            while len(backlog) > 1 and (
                len(backlog) > MAX_BACKLOG or self.backlog_bytes > BACKLOG_BYTES
            ):
                self.backlog_bytes -= len(backlog.popleft())

    def close(self) -> None:
        for exchange in [*self.waiters.values(), *self.posts]:
            exchange.finish()
        self.get_stream.finish()
        self.waiters.clear()
        self.posts.clear()
        self.tunnel.close()
