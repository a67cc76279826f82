"""Stateless (2026-07-28) requests of the HTTP front, routed over a small pool of tool sessions.

A stateless request carries everything it needs (version, capabilities and
client info in ``params._meta``), so any tool process that speaks 2026-07-28
can answer it; see docs/adr/0008-http-front-eras.md. The front keeps a pool of
tunnel sessions (each one remote tool process) and routes each request to the
member with the fewest requests in flight that is not already running a
request with the same JSON-RPC id (ids from different HTTP clients collide;
responses are matched by id). A new member is opened when every member has
``SPREAD`` requests in flight, or holds the id, and the front's session limit
allows it.

Multi-round-trip results (MRTR): a result carrying ``requestState`` ties the
client's retry to the process that minted it (the SDK seals request state with
a per-process key), so the state is remembered and the retry routed back.

Cancellation is closing the response stream (2026-07-28): the front then sends
``notifications/cancelled`` to the tool and forgets the request, so the member
is idle again and can be reaped.

Notifications a tool sends on its own are routed by what they carry: progress
by its token; events of a ``subscriptions/listen`` stream by the
``io.modelcontextprotocol/subscriptionId`` in their ``_meta`` (the listen
request's id); anything else (log messages) only to the one request running
on that member besides its listens. So a request that opts into log messages
(``io.modelcontextprotocol/logLevel``) is given a member where no other request
runs, else its log lines could not be told from another client's.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable

import orjson

from mcp_proxy.client import ClientSession, TunnelClient
from mcp_proxy.http_sse import Exchange
from mcp_proxy.jsonrpc import JsonRpcError, Kind, RequestId, Sniffed, meta_of, sniff
from talos.logging import event

__all__ = ["SPREAD", "StatelessPool"]

log = logging.getLogger(__name__)

SPREAD = 8
SUBSCRIPTION_ID = "io.modelcontextprotocol/subscriptionId"
LOG_LEVEL = "io.modelcontextprotocol/logLevel"
# requestState values remembered for routing retries (the SDK's default state TTL is 10 min).
MAX_STATES = 4096


def wants_logs(msg: Sniffed) -> bool:
    """The request opted into the tool's log messages (2026-07-28 ``_meta`` logLevel)."""
    return LOG_LEVEL in meta_of(msg)


class _Member:
    """One pooled tunnel session and the stateless requests it runs."""

    def __init__(self, pool: StatelessPool, client: TunnelClient) -> None:
        self.pool = pool
        self.tunnel: ClientSession = client.open_session(self.deliver)
        self.inflight: dict[RequestId, Exchange] = {}
        self.listens: set[RequestId] = set()  # subscriptions/listen streams among inflight
        self.solo: set[RequestId] = set()  # requests that asked for log lines: none may join
        self.tokens: dict[RequestId, RequestId] = {}
        self.last_used = asyncio.get_running_loop().time()

    def start(self, msg: Sniffed) -> Exchange:
        assert msg.id is not None
        exchange = Exchange()
        self.inflight[msg.id] = exchange
        if msg.method == "subscriptions/listen":
            self.listens.add(msg.id)
        elif wants_logs(msg):
            self.solo.add(msg.id)
        if msg.progress_token is not None:
            self.tokens[msg.progress_token] = msg.id
        return exchange

    @property
    def calls(self) -> int:
        """Requests in flight other than listen streams."""
        return len(self.inflight) - len(self.listens)

    def _forget(self, request_id: RequestId) -> Exchange | None:
        exchange = self.inflight.pop(request_id, None)
        self.listens.discard(request_id)
        self.solo.discard(request_id)
        for token, rid in list(self.tokens.items()):
            if rid == request_id:
                del self.tokens[token]
        self.last_used = asyncio.get_running_loop().time()
        return exchange

    def abandon(self, request_id: RequestId) -> None:
        """The client closed the stream before the response: cancel the request at the tool."""
        exchange = self._forget(request_id)
        if exchange is None:
            return
        exchange.finish()
        note = {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": request_id, "reason": "response stream closed"},
        }
        # Only if the link is up now: a lost link already ended the request at the tool.
        # Not held back by a PAUSE: it lets the tool drop work instead of adding any.
        self.tunnel.forward_now(orjson.dumps(note))

    def deliver(self, line: bytes) -> None:
        try:
            msg = sniff(line)
        except JsonRpcError:
            event(log, "http_message_malformed_dropped", logging.WARNING, session=self.tunnel.sid)
            return
        if msg.kind in (Kind.RESPONSE, Kind.ERROR) and msg.id is not None:
            exchange = self._forget(msg.id)
            if exchange is not None:
                exchange.emit(line)
                exchange.finish()
                result = msg.result
                if msg.kind is Kind.RESPONSE and isinstance(result, dict):
                    state = result.get("requestState")
                    if isinstance(state, str):
                        self.pool.remember(state, self)
            return
        target = self._target(msg) if msg.kind is Kind.NOTIFICATION else None
        if target is not None:
            target.emit(line)
        else:
            event(
                log, "unroutable_dropped", logging.DEBUG, session=self.tunnel.sid, method=msg.method
            )

    def _target(self, msg: Sniffed) -> Exchange | None:
        """Where a notification of the tool belongs (module docstring), if it can be told."""
        if msg.method == "notifications/progress":
            params = msg.params if isinstance(msg.params, dict) else {}
            token = params.get("progressToken")
            rid = self.tokens.get(token) if isinstance(token, int | str) else None
            return self.inflight.get(rid) if rid is not None else None
        sub = meta_of(msg).get(SUBSCRIPTION_ID)
        if isinstance(sub, int | str) and sub in self.listens:
            return self.inflight[sub]
        calls = [e for rid, e in self.inflight.items() if rid not in self.listens]
        # With one request running, its other notifications (logging) can only be its own.
        return calls[0] if len(calls) == 1 else None

    def close(self) -> None:
        for exchange in self.inflight.values():
            exchange.finish()
        self.inflight.clear()
        self.tokens.clear()
        self.tunnel.close()


class StatelessPool:
    """The tool sessions one front uses for stateless requests."""

    def __init__(
        self, client: TunnelClient, may_open: Callable[[], bool], *, spread: int = SPREAD
    ) -> None:
        self.client = client
        self.may_open = may_open
        self.spread = spread
        self.members: list[_Member] = []
        self._states: OrderedDict[str, _Member] = OrderedDict()

    def __len__(self) -> int:
        return len(self.members)

    def remember(self, state: str, member: _Member) -> None:
        self._states[state] = member
        self._states.move_to_end(state)
        while len(self._states) > MAX_STATES:
            self._states.popitem(last=False)

    def pick(self, msg: Sniffed) -> _Member | None:
        """The member to run request ``msg``; None when every one is taken and none may open."""
        rid = msg.id
        params = msg.params if isinstance(msg.params, dict) else {}
        state = params.get("requestState")
        if isinstance(state, str):
            owner = self._states.get(state)
            if owner is not None and owner in self.members and rid not in owner.inflight:
                return owner
        free = [m for m in self.members if rid not in m.inflight and not m.solo]
        best = min(free, key=lambda m: m.calls) if free else None
        busy = best is None or best.calls >= (1 if wants_logs(msg) else self.spread)
        if busy and self.may_open():
            best = _Member(self, self.client)
            self.members.append(best)
        return best

    def reap(self, now: float, idle_timeout: float) -> int:
        """Close members with nothing in flight for ``idle_timeout`` seconds; how many closed."""
        idle = [m for m in self.members if not m.inflight and now - m.last_used > idle_timeout]
        for member in idle:
            self._drop(member)
        return len(idle)

    def _drop(self, member: _Member) -> None:
        self.members.remove(member)
        for state, owner in list(self._states.items()):
            if owner is member:
                del self._states[state]
        member.close()

    def close(self) -> None:
        for member in list(self.members):
            self._drop(member)
