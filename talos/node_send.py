"""One durable send in flight, driven by callbacks (docs/adr/0007-epoch-sequence-numbers.md).

:meth:`~talos.node_delivery.NodeDelivery.start_send` seals and transmits a
message from the caller's own callback and hands back a :class:`Sending`; the
outbox commit, the peer's ack, the timeout and a refusal then call into it
until it reports once through ``done(msg_id, None)`` or ``done(None, error)``.
No task per send and no future between the ack and the caller: the task and
its chain of coroutines (local call, op, send, wait), resumed after the commit,
after the ack and to return, cost loop passes and Python frames per message
(figures in the commits that added this module and the waiter).

The rules (docs/adr/0007-epoch-sequence-numbers.md, point 4):

* plain send: ``done`` after the outbox row is durable;
* ``wait``: after the peer's ack. The row's commit (no fsync of its own) waits a
  little for that ack and then writes only the message's number
  (``NodeDelivery.start_send``); an ack that comes after the commit reports
  then, as before;
* a wait that ends without the ack (timeout, refusal, caller gone) syncs the
  row before ``done`` says the message stays queued (ADR 0007, amended);
* a failed outbox commit: ``done(None, error)``, no id, nothing synced.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from talos.logging import event
from talos.node_links import refused_error
from talos_sdk.errors import UsageError

if TYPE_CHECKING:
    from talos.node_base import Peer
    from talos.node_delivery import NodeDelivery
    from talos.pipeline import OutboxEntry

__all__ = ["Done", "Sending", "until_done"]

_log = logging.getLogger("talos.node")

#: ``done(msg_id_hex, None)`` or ``done(None, error)``, called once.
Done = Callable[[str | None, BaseException | None], None]


def _ignore(msg_id: str | None, exc: BaseException | None) -> None:
    return None


_PENDING = object()  # no ack (nor a failure in its place) yet


class Sending:
    """The state of one send between ``start_send`` and its ``done`` call."""

    __slots__ = (
        "_ack",
        "_committed",
        "_done",
        "_ended",
        "_expiry",
        "_node",
        "_peer",
        "_row",
        "_since",
        "_timeout",
        "_wait",
    )

    def __init__(
        self,
        node: NodeDelivery,
        peer: Peer,
        row: OutboxEntry,
        done: Done,
        *,
        wait: bool,
        timeout: float | None,
        since: int,
    ) -> None:
        self._node = node
        self._peer = peer
        self._row = row
        self._done = done
        self._timeout = timeout
        self._since = since
        self._committed = False
        self._ended = False  # done is called, or is about to be (after a sync)
        self._expiry: asyncio.TimerHandle | None = None
        self._wait = wait
        self._ack: BaseException | object | None = _PENDING  # None once acked
        if wait:
            # This object is the waiter (talos/seq_state.py AckWaiter): the ack reaches
            # the caller in the pass that read it, not one loop pass later.
            peer.tx.add_waiter(row.seq, self)

    @property
    def msg_id(self) -> str:
        return self._row.msg_id.hex()

    def on_committed(self, exc: BaseException | None) -> None:
        """The outbox commit of this row returned (``exc`` when it failed)."""
        node = self._node
        if exc is None:
            node.metrics.inc("messages_out")
        if self._ended:
            return
        if exc is not None:
            self._finish(None, exc)
            return
        self._committed = True
        if not self._wait:
            self._finish(self.msg_id, None)
            return
        if self._ack is not _PENDING:
            self._acked_now()
            return
        peer = self._peer
        if not peer.ready.is_set():
            node.redial_now(peer.did)  # a refusal noted earlier may be stale by now
        problem = node.link_problem(peer.did)
        if problem is not None and problem.decisive and problem.at_ms >= self._since:
            self._unacked(refused_error(peer.did, problem))
            return
        # A refusal noted from now on fails this waiter itself (_problem_noted).
        if self._timeout is not None:
            loop = asyncio.get_running_loop()
            self._expiry = loop.call_later(self._timeout, self._expired)

    # --- AckWaiter (talos/seq_state.py) ----------------------------------------------------------

    def done(self) -> bool:
        return self._ack is not _PENDING or self._ended

    def set_result(self, result: None, /) -> None:
        if self._ack is _PENDING:
            self._ack = None
            self._acked_now()

    def set_exception(self, exception: BaseException, /) -> None:
        if self._ack is _PENDING:
            self._ack = exception
            self._acked_now()

    def _acked_now(self) -> None:
        if self._ended:
            return
        if not self._committed:
            if self._ack is None:
                # The peer holds the message durably: that is what the caller waits
                # for; the row's commit will write only its number.
                self._finish(self.msg_id, None)
            else:
                # "Stays queued" needs the row committed first: on_committed reports.
                self._node.flush_outbox_now()
            return
        ack = self._ack
        if ack is None:
            self._finish(self.msg_id, None)
        else:
            assert isinstance(ack, BaseException)
            self._unacked(ack)

    def _expired(self) -> None:
        if not self._ended:
            self._unacked(TimeoutError())

    def abandon(self) -> None:
        """The caller is gone: nobody hears back; a committed, unacked row is synced."""
        if self._ended:
            return
        self._done = _ignore
        if self._committed:
            self._unacked(asyncio.CancelledError())
        else:
            self._end()  # not committed yet: nothing was promised (as before)

    def _unacked(self, exc: BaseException) -> None:
        """Not acked: "the message stays queued" must hold after a crash, so the
        unsynced row is synced before the caller hears so."""
        self._end()
        try:
            synced = self._node.writer.submit_sync()
        except UsageError:  # the writer is closed: the node stopped
            self._report(None, exc)
            return
        synced.add_done_callback(lambda f: self._synced(f, exc))

    def _synced(self, fut: asyncio.Future[None], exc: BaseException) -> None:
        if not fut.cancelled():
            fut.exception()  # retrieved: a failed sync changes nothing the caller hears
        self._report(None, exc)

    def _finish(self, msg_id: str | None, exc: BaseException | None) -> None:
        self._end()
        self._report(msg_id, exc)

    def _end(self) -> None:
        """Nothing more to wait for: no timeout, no place among the ack's waiters."""
        self._ended = True
        if self._expiry is not None:
            self._expiry.cancel()
        self._peer.tx.remove_waiter(self._row.seq, self)

    def _report(self, msg_id: str | None, exc: BaseException | None) -> None:
        done, self._done = self._done, _ignore
        try:
            done(msg_id, exc)
        except Exception as error:
            # Told from inside the ack's loop over its waiters (talos/seq_state.py
            # SenderState.on_ack): one failing caller must not keep the others waiting.
            event(_log, "send_report_failed", level=logging.ERROR, error=repr(error))


#: ``done(result, None)`` or ``done(None, error)``, as :data:`Done` with any result.
_Report = Callable[[Any, BaseException | None], None]


async def until_done(start: Callable[[_Report], Sending]) -> Any:
    """Await a callback-driven send: ``start(done)`` begins it (bad input raises there),
    the result or error given to ``done`` is returned or raised; a cancelled caller
    abandons the send (a committed, unacked row is synced)."""
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def done(result: Any, exc: BaseException | None) -> None:
        if not fut.done():
            if exc is None:
                fut.set_result(result)
            else:
                fut.set_exception(exc)

    sending = start(done)
    try:
        return await fut
    except asyncio.CancelledError:
        sending.abandon()
        raise
