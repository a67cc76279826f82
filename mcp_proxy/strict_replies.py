"""``--audit strict``: no line of a session reaches its caller before its record is durable.

:class:`StrictReplies` holds what the serve side would send the caller (replies,
the tool's own requests and notifications) until
:meth:`~mcp_proxy.audit.Auditor.record_barrier` says every record queued so far
is on disk: one fsync for all the lines waiting then, which leave in order.

If the records cannot be written, nothing leaves unrecorded (docs/security.md,
"audit"): each reply is replaced by an ``AUDIT_UNAVAILABLE`` error for its id,
the tool's own requests (sampling, elicitation, roots) are answered with that
error to the tool through ``refuse_ask``, and notifications are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable

from mcp_proxy.audit import Auditor
from mcp_proxy.jsonrpc import Kind, RequestId, audit_unavailable, sniff
from mcp_proxy.transport import FrameSender
from talos.logging import event

__all__ = ["StrictReplies"]

log = logging.getLogger(__name__)


class StrictReplies:
    """One session's lines toward its caller, each let go once its record is durable."""

    def __init__(
        self,
        auditor: Auditor,
        sender: Callable[[], FrameSender],
        sid: int,
        refuse_ask: Callable[[RequestId, bytes], None],
        log_fields: dict[str, object],
    ) -> None:
        self._auditor = auditor
        self._sender = sender  # the peer's current sender (a new link brings another)
        self._sid = sid
        self._refuse_ask = refuse_ask
        self._log_fields = log_fields
        self._out: deque[bytes] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def add(self, line: bytes) -> None:
        """Queue ``line``; one task per session keeps the order."""
        self._out.append(line)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _drain(self) -> None:
        while True:
            if not self._out:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = list(self._out)
            self._out.clear()
            try:
                await self._auditor.record_barrier()
            except Exception as exc:
                batch = self._withheld(batch, str(exc) or type(exc).__name__)
            sender = self._sender()
            for line in batch:
                sender.message(self._sid, line)
            sender.flush_now()

    def _withheld(self, batch: list[bytes], why: str) -> list[bytes]:
        """What leaves of ``batch`` when its records were not written (module docstring)."""
        out: list[bytes] = []
        for line in batch:
            msg = sniff(line)  # the serve side's own encoding: it parses
            if msg.id is None:
                continue
            if msg.kind is Kind.REQUEST:
                self._refuse_ask(msg.id, audit_unavailable(msg.id, why))
            else:
                out.append(audit_unavailable(msg.id, why))
        event(log, "audit_replies_withheld", logging.WARNING, **self._log_fields, count=len(batch))
        return out
