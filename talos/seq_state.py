"""Per-peer sequence state of the durable message pipeline: what a receiver accepted
and committed, what a sender sent and had acknowledged, and who waits for an ack
(docs/adr/0007-epoch-sequence-numbers.md; the numbers and rows are in
:mod:`talos.pipeline`).

No sockets, storage or clock; the one tie to asyncio is :meth:`SenderState.wait_for`,
the futures ``send`` callers wait on until the ack arrives, kept beside the ack
counter that resolves them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Protocol

__all__ = ["AckWaiter", "ReceiverState", "SenderState", "Verdict"]


class Verdict:
    """What to do with an incoming message sequence number."""

    ACCEPT: Final = "accept"
    DUPLICATE: Final = "duplicate"
    GAP: Final = "gap"


@dataclass(slots=True)
class ReceiverState:
    """Per-peer receive side: ``delivered`` is committed, ``accepted`` includes the open batch."""

    delivered: int
    accepted: int = -1

    def __post_init__(self) -> None:
        if self.accepted < 0:
            self.accepted = self.delivered

    def classify(self, seq: int, prev: int | None = None) -> str:
        """``prev`` defaults to ``seq - 1`` (consecutive numbers within one epoch)."""
        if seq <= self.accepted:
            return Verdict.DUPLICATE
        if (seq - 1 if prev is None else prev) <= self.accepted:
            self.accepted = seq
            return Verdict.ACCEPT
        return Verdict.GAP

    def committed(self, seq: int) -> None:
        self.delivered = max(self.delivered, seq)

    def rolled_back(self) -> None:
        """A batch failed to commit: its messages must be accepted again on resend."""
        self.accepted = self.delivered

    def not_taken(self, accepted: int) -> None:
        """The message just accepted is not taken after all (``accepted``: the mark
        before it): it is accepted again when resent, and what follows it is a gap."""
        self.accepted = accepted


class AckWaiter(Protocol):
    """Who waits for a seq's ack: an asyncio future, or a send in flight told at once
    (talos/node_send.py: no future and no loop pass between the ack and its caller)."""

    def done(self) -> bool: ...

    def set_result(self, result: None, /) -> None: ...

    def set_exception(self, exception: BaseException, /) -> None: ...


@dataclass(slots=True)
class SenderState:
    """Per-peer send side: what is acked, what this link has sent, who waits."""

    acked: int
    sent: int = -1
    waiters: dict[int, list[AckWaiter]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.sent < 0:
            self.sent = self.acked

    def rewind(self) -> None:
        """Resend everything unacknowledged (new link, or no progress for a while)."""
        self.sent = self.acked

    def on_ack(self, seq: int) -> bool:
        """Record a cumulative ack; True if it moved forward."""
        if seq <= self.acked:
            return False
        self.acked = seq
        self.sent = max(self.sent, seq)
        for s in [s for s in self.waiters if s <= seq]:
            for fut in self.waiters.pop(s, ()):
                if not fut.done():
                    fut.set_result(None)
        return True

    def fail_waiters(self, error: Callable[[], BaseException], upto: int | None = None) -> None:
        """Fail every send waiting for an ack (up to seq ``upto``) with ``error()``: the
        link was refused for good, or the user dropped the messages."""
        if upto is None:
            waiters, self.waiters = self.waiters, {}
        else:
            waiters = {s: self.waiters.pop(s) for s in [s for s in self.waiters if s <= upto]}
        for futs in waiters.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(error())

    def wait_for(self, seq: int) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.add_waiter(seq, fut)
        return fut

    def add_waiter(self, seq: int, waiter: AckWaiter) -> None:
        """``waiter`` is told when ``seq`` is acked (at once if it is already)."""
        if seq <= self.acked:
            waiter.set_result(None)
        else:
            self.waiters.setdefault(seq, []).append(waiter)

    def remove_waiter(self, seq: int, waiter: AckWaiter) -> None:
        """``waiter`` no longer waits (it timed out, or its caller left)."""
        waiting = self.waiters.get(seq)
        if waiting is not None and waiter in waiting:
            waiting.remove(waiter)
            if not waiting:
                del self.waiters[seq]
