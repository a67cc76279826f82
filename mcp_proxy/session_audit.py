"""The audit records of one tunnel session (docs/PROTOCOL.md "MCP tunnel", Audit record).

:class:`SessionAudit` turns what the serve side sees -- a call and its reply, a
request of the tool and the caller's answer, open, close, exit, a refusal --
into facts for the :class:`Auditor` (:meth:`~mcp_proxy.audit.Auditor.note`),
which builds the records in batches off the hot path. Parameters and results
enter a record only as HMACs under the node's audit key; until their batch is
built, a request in flight keeps its parsed params (a reference, not a copy).
Without an auditor every method does nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mcp_proxy.audit import Auditor, Event
from mcp_proxy.jsonrpc import RequestId, Sniffed

__all__ = ["Call", "InFlight", "SessionAudit", "refused_outside_a_session"]


@dataclass(slots=True)
class Call:
    """A request in flight (the caller's to the tool, or the tool's to the caller)."""

    method: str
    tool: str | None
    params: Any  # as parsed; digested with its record's batch
    started: float
    plaintext: bytes
    size: int = 0  # bytes of the request as forwarded: what keeping it costs


class InFlight:
    """The requests in flight one way of a session, by id, bounded in count and bytes:
    each keeps its params for its record until it is answered, and a side that never
    answers (a caller ignoring the tool's sampling requests, a tool sitting on calls it
    reads) would otherwise grow the serve side's memory without end."""

    __slots__ = ("bytes", "items", "max_bytes", "max_count", "retired")

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.items: dict[RequestId, Call] = {}
        self.bytes = 0
        self.max_count, self.max_bytes = max_count, max_bytes
        #: Ids of cancelled requests (the latest max_count): the tool may still answer one,
        #: so a new request under the same id would be paired with the old one's result.
        self.retired: dict[RequestId, None] = {}

    def taken(self, request_id: RequestId) -> bool:
        """Whether a new request may not use ``request_id``: in flight, or cancelled."""
        return request_id in self.items or request_id in self.retired

    def retire(self, request_id: RequestId) -> Call | None:
        """:meth:`pop` a cancelled request, its id kept from reuse."""
        call = self.pop(request_id)
        if call is not None:
            self.retired[request_id] = None
            if len(self.retired) > self.max_count:
                del self.retired[next(iter(self.retired))]
        return call

    def __len__(self) -> int:
        return len(self.items)

    def room(self, size: int) -> bool:
        """Whether one more request of ``size`` bytes may be kept."""
        return len(self.items) < self.max_count and self.bytes + size <= self.max_bytes

    def add(self, request_id: RequestId, call: Call) -> None:
        self.items[request_id] = call
        self.bytes += call.size

    def pop(self, request_id: RequestId | None) -> Call | None:
        call = self.items.pop(request_id, None) if request_id is not None else None
        if call is not None:
            self.bytes -= call.size
        return call

    def drain(self) -> dict[RequestId, Call]:
        """Every request still in flight, forgotten here."""
        items, self.items, self.bytes = self.items, {}, 0
        return items


def _record(
    auditor: Auditor,
    caller: str,
    server: str,
    session: int,
    pid: int | None,
    event: Event,
    method: str,
    *,
    request_id: RequestId | None = None,
    outcome: str,
    detail: str = "",
) -> None:
    """An event that is not a call (session open/close/exit, a refusal): no params, no latency."""
    auditor.note(
        (caller, server, method, None, request_id, None, None, 0, outcome,
         int(time.time() * 1000), b"", event, session, pid, detail)
    )  # fmt: skip


def refused_outside_a_session(
    auditor: Auditor | None,
    peer: str,
    sid: int,
    outcome: str,
    detail: str,
    event: Event = Event.REFUSAL,
) -> None:
    """Audit what was refused with no live session (an OPEN, a frame for no session)."""
    if auditor is not None:
        method = "open" if event is Event.SESSION else ""
        _record(auditor, peer, "", sid, None, event, method, outcome=outcome, detail=detail)


class SessionAudit:
    """Records of one session: caller ``peer``, server ``name``, tunnel id ``sid``."""

    __slots__ = ("auditor", "name", "peer", "pid", "sid")

    def __init__(
        self,
        auditor: Auditor | None,
        peer: str,
        name: str,
        sid: int,
        pid: Callable[[], int | None],
    ) -> None:
        self.auditor = auditor
        self.peer = peer
        self.name = name
        self.sid = sid
        self.pid = pid

    def new_call(self, msg: Sniffed, wire: bytes) -> Call:
        """Remember a request for its record: method, tool, params (digested in the batch)."""
        auditor = self.auditor
        plaintext = wire if auditor is not None and auditor.plaintext else b""
        return Call(
            msg.method or "", msg.tool, msg.params, time.perf_counter(), plaintext, len(wire)
        )

    def event(self, event: Event, method: str, outcome: str, detail: str = "") -> None:
        if self.auditor is not None:
            _record(
                self.auditor, self.peer, self.name, self.sid, self.pid(), event, method,
                outcome=outcome, detail=detail,
            )  # fmt: skip

    def call(
        self,
        request_id: RequestId | None,
        call: Call,
        outcome: str,
        result: Any = None,
        reply: bytes = b"",
        detail: str = "",
        event: Event = Event.CALL,
    ) -> None:
        """A request ended: ``outcome``, the reply's result (digested) and bytes (plaintext).

        The hot path of the audit: one tuple queued, no digest (built in the batch).
        """
        auditor = self.auditor
        if auditor is None:
            return
        now = time.perf_counter()
        auditor.note(
            (self.peer, self.name, call.method, call.tool, request_id, call.params, result,
             int((now - call.started) * 1e6), outcome, int(time.time() * 1000),
             (call.plaintext + b"\n" + reply) if auditor.plaintext else b"",
             event, self.sid, self.pid(), detail)
        )  # fmt: skip

    def refusal(self, request_id: RequestId | None, outcome: str, detail: str) -> None:
        if self.auditor is not None:
            _record(
                self.auditor, self.peer, self.name, self.sid, self.pid(), Event.REFUSAL, "",
                request_id=request_id, outcome=outcome, detail=detail,
            )  # fmt: skip

    def ended(
        self,
        calls: Mapping[RequestId, Call],
        asks: Mapping[RequestId, Call],
        outcome: str,
        detail: str,
    ) -> None:
        """Every request still in flight ended with the session (``outcome``, why)."""
        for request_id, call in calls.items():
            self.call(request_id, call, outcome, detail=detail)
        for request_id, ask in asks.items():
            self.call(request_id, ask, outcome, detail=detail, event=Event.REQUEST)
