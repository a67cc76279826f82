"""The durable message pipeline with one peer, as a sans-I/O object
(docs/ARCHITECTURE.md "Message path"; docs/adr/0007-epoch-sequence-numbers.md).

:class:`PeerPipeline` holds everything the ordered, acknowledged message flow
to and from one peer decides: which number a new message gets, whether an
incoming one is accepted, a duplicate to re-ack or a gap, what an ack
releases, which rows a link has still to send, when a row can never fit the
peer's frames (it is failed and its successor takes its ``prev``), and
whether a quiet link needs a resend. Events go in as method calls with
everything they need (sequence numbers, the clock reading, the epoch);
decisions come out as return values. No socket, task, timer or transaction:
the node (talos/node.py and talos/node_delivery.py) does the awaiting, the
sending and the writing. tests/talos/pipeline_pair.py drives two of these
against each other without sockets.

The row rules themselves (sequence numbers, row layouts) are in
:mod:`talos.pipeline`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final, Self

from talos import pipeline as pl
from talos.chain.block import Record
from talos.seq_state import ReceiverState, SenderState, Verdict
from talos_sdk.errors import ProtocolError

__all__ = [
    "DESYNC_LIMIT",
    "UNSENT_BATCH",
    "Acked",
    "Dropped",
    "Failed",
    "PeerPipeline",
    "Received",
    "Retry",
]

#: Consecutive undecryptable frames after which a session is re-keyed.
DESYNC_LIMIT: Final = 16
#: Committed rows read from the store per pass of a link's sender.
UNSENT_BATCH: Final = 256


class Received(enum.Enum):
    """What to do with an opened incoming message."""

    ACCEPT = "accept"  #: batch it for the next receive commit; ack after that commit
    REACK = "reack"  #: a duplicate already committed: send the ack again now
    IN_BATCH = "in-batch"  #: a duplicate of one in the open batch: its commit acks it
    GAP = "gap"  #: an earlier message is missing: drop, no ack (the sender resends)


class Retry(enum.Enum):
    """What a periodic check decides for one peer."""

    NONE = "none"
    RESEND = "resend"  #: no progress for a while: resend from the oldest unacked
    KICK = "kick"  #: nothing in flight, rows unsent: send those queued while the link came up
    DIAL = "dial"  #: rows wait and there is no link: dial the peer


@dataclass(frozen=True, slots=True)
class Acked:
    """What a forward-moving ack released."""

    seq: int
    #: Our own audit records of the acked messages, to append to the block log.
    records: list[Record]
    #: Seconds from each acked message's first transmission to this ack.
    latencies: list[float]


@dataclass(frozen=True, slots=True)
class Failed:
    """A row the peer can never accept (above its frame bound): failed for good.

    The node deletes the row and gives its durable successor ``prev``.
    """

    row: pl.OutboxEntry
    prev: int
    limit: int


@dataclass(frozen=True, slots=True)
class Dropped:
    """What :meth:`PeerPipeline.drop_unacked` dropped."""

    #: The seq the next message names as its ``prev`` (the peer holds it).
    prev: int
    #: The last assigned seq.
    last: int
    #: Seqs of the dropped rows whose outbox commit had not finished.
    fresh: list[int]
    #: The highest seq sent in this run: dropped messages up to it may have reached the peer.
    max_sent: int


@dataclass(slots=True)
class PeerPipeline:
    """Send and receive bookkeeping for one peer (see the module docstring)."""

    did: str
    tx: SenderState
    rx: ReceiverState
    own_max_frame: int
    last_assigned: int = 0
    #: The largest link frame the peer accepts (its SESSION_OFFER); 0 = not said yet.
    peer_max_frame: int = 0
    max_sent: int = 0
    #: The highest seq sent on the current link: acks count only up to it.
    link_sent: int = 0
    last_progress: float = 0.0
    decrypt_failures: int = 0
    #: The peer said it cannot store our messages (a DEFER reason), until an ack moves.
    deferred: int = 0
    #: Rows with a number whose outbox commit has not finished (sendable already).
    fresh: list[pl.OutboxEntry] = field(default_factory=list)
    #: Our own audit records of sent, unacknowledged messages, by seq.
    records: dict[int, Record] = field(default_factory=dict)
    #: First transmission time of each unacknowledged message, by seq.
    sent_at: dict[int, float] = field(default_factory=dict)
    #: Rows failed as too large for the peer: seq -> their prev, which their successor takes.
    skipped: dict[int, int] = field(default_factory=dict)

    @classmethod
    def restore(
        cls,
        did: str,
        *,
        first_unacked: pl.OutboxEntry | None,
        assigned: int,
        delivered: int,
        own_max_frame: int,
        next_prev: int | None = None,
    ) -> Self:
        """From the store: the oldest outbox row, the last assigned and delivered numbers,
        and the ``prev`` the next message names (:func:`talos.pipeline.next_prev`)."""
        acked = first_unacked.prev if first_unacked is not None else assigned
        peer = cls(
            did,
            SenderState(acked),
            ReceiverState(delivered),
            own_max_frame,
            last_assigned=assigned,
        )
        if next_prev is not None and next_prev != assigned:
            peer.skipped[assigned] = next_prev  # dropped messages end the queue
        return peer

    # --- sending -------------------------------------------------------------------------------

    def text_limit(self) -> int:
        """The largest message text (UTF-8 bytes) both nodes' frames take."""
        bound = self.own_max_frame
        if self.peer_max_frame:
            bound = min(bound, self.peer_max_frame)
        return pl.text_limit(bound)

    def assign(self, text: str, msg_id: bytes, ts_ms: int, epoch: int) -> pl.OutboxEntry:
        """Number a new message (MessageTooLargeError if it cannot fit); it is sendable now."""
        limit = self.text_limit()
        data = text.encode()  # the only encoding: the row carries these bytes from here on
        size = len(data)
        if size > limit:
            raise pl.MessageTooLargeError(
                f"message of {size} bytes above the {limit}-byte limit for {self.did}"
                " (the smaller of both nodes' max_frame, minus frame overhead);"
                " split it, or send it as a file (send-file)"
            )
        prev = self.last_assigned
        seq = pl.next_seq(prev, epoch)
        self.last_assigned = seq
        row = pl.OutboxEntry(self.did, seq, msg_id, ts_ms, text, prev, data)
        self.fresh.append(row)
        return row

    def outbox_failed(self, rows: Iterable[pl.OutboxEntry]) -> None:
        """Rows whose outbox commit failed: their callers got the error and no id, so
        they are not sent again and their successors name their prev, as for a row
        failed as too large (ADR 0007, "outbox commit fails"). Kept in ``fresh``, a
        later commit would drop them unwritten and leave a hole the peer never fills."""
        failed = set()
        for row in rows:
            if row.seq > self.tx.acked and row.seq not in self.skipped:
                # Not if dropped meanwhile: its successor names what the drop said.
                self.skipped[row.seq] = row.prev
            failed.add(row.seq)
            # A later cumulative ack must not log them as delivered.
            self.records.pop(row.seq, None)
            self.sent_at.pop(row.seq, None)
        self.fresh = [r for r in self.fresh if r.seq not in failed]

    def outbox_committed(self, seq: int) -> None:
        """The outbox row ``seq`` is durable: it is read from the store from now on."""
        if self.fresh and self.fresh[0].seq <= seq:
            self.fresh = [r for r in self.fresh if r.seq > seq]

    def prev_of(self, prev: int) -> int:
        """``prev`` past any rows failed as too large (their successor names their prev)."""
        while prev in self.skipped:
            prev = self.skipped[prev]
        return prev

    def is_next(self, row: pl.OutboxEntry) -> bool:
        """True if everything before ``row`` has been sent on this link."""
        return self.prev_of(row.prev) <= self.tx.sent

    def prepare(self, row: pl.OutboxEntry) -> pl.OutboxEntry | Failed | None:
        """The row as it goes on the wire, a :class:`Failed` if it never can, or None if it
        was failed, dropped or acked already (its row may still be in the store, or in a
        sender's hands since before the drop)."""
        if row.seq in self.skipped or row.seq <= self.tx.acked:
            return None
        if self.peer_max_frame and len(row.data) > pl.text_limit(self.peer_max_frame):
            prev = self.prev_of(row.prev)
            self.skipped[row.seq] = row.prev
            self.fresh = [r for r in self.fresh if r.seq != row.seq]
            return Failed(row, prev, pl.text_limit(self.peer_max_frame))
        prev = self.prev_of(row.prev)
        return row if prev == row.prev else dataclasses.replace(row, prev=prev)

    def drop_point(self) -> tuple[int, int]:
        """What a drop made now covers: the ``prev`` the next message will name (the last
        number the peer acknowledged, which it holds) and the last assigned number."""
        return self.prev_of(self.tx.acked), self.last_assigned

    def drop_unacked(self, prev: int, last: int) -> Dropped:
        """The user dropped every unacknowledged message up to ``last`` (``talosd outbox
        --drop``; docs/adr/0007-epoch-sequence-numbers.md, "Dropping queued messages"),
        with ``prev, last`` from :meth:`drop_point`; the store has dropped them already.

        They count as done without being logged: nothing of them is sent again,
        no ack for them is awaited (the caller fails the waiters), and the next
        message names ``prev``, so the peer takes it whether or not a dropped one
        reached it. Their numbers stay used. Messages numbered after ``last``
        (sent while the store dropped the rows) are kept.
        """
        fresh = [row.seq for row in self.fresh if row.seq <= last]
        for seq in [*fresh, last]:
            if seq > prev:
                self.skipped[seq] = prev
        self.fresh = [row for row in self.fresh if row.seq > last]
        for kept in (self.records, self.sent_at):
            for seq in [seq for seq in kept if seq <= last]:
                del kept[seq]
        self.deferred = 0
        self.tx.acked = max(self.tx.acked, last)
        self.tx.sent = max(self.tx.sent, self.tx.acked)
        return Dropped(prev, last, fresh, self.max_sent)

    def on_sent(self, row: pl.OutboxEntry, record: Record, now: float) -> None:
        """``row`` (sealed, with our audit ``record``) is about to leave on the link."""
        self.records[row.seq] = record
        if self.tx.sent == self.tx.acked:
            self.last_progress = now
        self.tx.sent = row.seq
        self.max_sent = max(self.max_sent, row.seq)
        self.link_sent = max(self.link_sent, row.seq)
        self.sent_at.setdefault(row.seq, now)

    def for_outbox(self, row: pl.OutboxEntry) -> pl.OutboxEntry | None:
        """The outbox row to write for ``row``, or None when only its number is to be
        noted (the peer acked it already, or it was failed) — read by the writer thread."""
        if row.seq <= self.tx.acked or row.seq in self.skipped:
            return None
        if row.prev in self.skipped:
            return dataclasses.replace(row, prev=self.prev_of(row.prev))
        return row

    def unsent_from_memory(self) -> list[pl.OutboxEntry] | None:
        """The rows this link has still to send when none of them needs the store, else None."""
        fresh = self.fresh
        if fresh and self.prev_of(fresh[0].prev) <= self.tx.sent:
            return [r for r in fresh if r.seq > self.tx.sent]
        return None

    def unsent_after_store(self, stored: list[pl.OutboxEntry]) -> tuple[list[pl.OutboxEntry], bool]:
        """Committed rows read after ``tx.sent`` (at most :data:`UNSENT_BATCH`), then those
        still committing; True if the store may hold more."""
        if len(stored) >= UNSENT_BATCH:
            return stored, True
        last = stored[-1].seq if stored else self.tx.sent
        return stored + [r for r in self.fresh if r.seq > last], False

    # --- acks ----------------------------------------------------------------------------------

    def on_ack(self, seq: int, epoch: int, now: float) -> Acked | None:
        """A cumulative ack from the peer; None if it does not move forward.

        An ack from an earlier epoch may cover messages a crashed run of ours sent
        without committing them (ADR 0007); in this epoch we know what we sent.
        Epoch 0 is never assigned: boots and offline sends start at 1.
        """
        if seq > self.max_sent and not 0 < pl.epoch_of(seq) < epoch:
            raise ProtocolError(f"ack {seq} for a message not sent yet")
        # Never drop an outbox row this link has not sent: a cumulative ack past
        # it (an earlier epoch's) counts only up to what this link carried.
        seq = min(seq, self.link_sent)
        if not self.tx.on_ack(seq):
            return None
        self.deferred = 0
        self.last_progress = now
        latencies = [now - self.sent_at.pop(s) for s in [s for s in self.sent_at if s <= seq]]
        self.outbox_committed(seq)
        done = sorted(s for s in self.records if s <= seq)
        return Acked(seq, [self.records.pop(s) for s in done], latencies)

    # --- receiving -----------------------------------------------------------------------------

    def receive(self, seq: int, prev: int) -> Received:
        """Classify an opened message (``prev <= delivered < seq`` is accepted)."""
        verdict = self.rx.classify(seq, prev)
        if verdict == Verdict.ACCEPT:
            return Received.ACCEPT
        if verdict == Verdict.DUPLICATE:
            return Received.REACK if seq <= self.rx.delivered else Received.IN_BATCH
        return Received.GAP

    def committed(self, seqs: Iterable[int]) -> int:
        """The receive commit holding ``seqs`` is durable; returns the cumulative ack to send."""
        for seq in seqs:
            self.rx.committed(seq)
        return self.rx.delivered

    def commit_failed(self) -> None:
        """A receive commit failed: its messages must be accepted again when resent."""
        self.rx.rolled_back()

    def decrypt_failed(self) -> bool:
        """One more undecryptable frame; True once the session must be re-keyed."""
        self.decrypt_failures += 1
        if self.decrypt_failures >= DESYNC_LIMIT:
            self.decrypt_failures = 0
            return True
        return False

    def frame_opened(self) -> None:
        self.decrypt_failures = 0

    # --- link state and retries ----------------------------------------------------------------

    def link_down(self) -> None:
        """This link's transmissions are void: resend everything unacknowledged on the next."""
        self.tx.rewind()
        self.link_sent = 0
        self.deferred = 0  # said of that link's messages; the next one tells anew

    def session_ready(self, now: float) -> None:
        self.last_progress = now

    def retry(self, now: float, interval: float, *, ready: bool, linked: bool) -> Retry:
        """The periodic check: resend, send queued rows, dial, or nothing."""
        if ready and self.tx.sent > self.tx.acked and now - self.last_progress > interval:
            self.tx.rewind()
            self.last_progress = now
            return Retry.RESEND
        if ready and self.tx.sent == self.tx.acked:
            # Only when a row waits: a kick starts a pump task that reads the outbox, and
            # an idle link was kicked every tick (a hub with 60 idle peers: 40 a second).
            return Retry.KICK if self.last_assigned > self.tx.sent else Retry.NONE
        if not linked and self.last_assigned > self.tx.acked:
            return Retry.DIAL
        return Retry.NONE
