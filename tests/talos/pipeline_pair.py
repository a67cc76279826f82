"""Two PeerPipelines wired to each other without sockets (in the spirit of h11's
ConnectionPair): A sends to B, B acks to A; the test decides what the "network"
and the "store" do between the steps (loss, reordering, failed commits, restarts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from talos import pipeline as pl
from talos.chain.block import Record
from talos.peer_pipeline import Acked, Failed, PeerPipeline, Received

A_DID = "did:key:z6MkA"
B_DID = "did:key:z6MkB"
MAX_FRAME = 64 * 1024


def _record(row: pl.OutboxEntry) -> Record:
    """A stand-in audit record (the pipeline only keeps and hands it back)."""
    return Record("msg", row.msg_id, A_DID, B_DID, b"c", b"\0" * 64, row.ts_ms)


@dataclass
class PipelinePair:
    """A's pipeline towards B and B's towards A, plus a clock and A's boot epoch."""

    epoch: int = 1
    now: float = 0.0
    a: PeerPipeline = field(
        default_factory=lambda: PeerPipeline.restore(
            B_DID, first_unacked=None, assigned=0, delivered=0, own_max_frame=MAX_FRAME
        )
    )
    b: PeerPipeline = field(
        default_factory=lambda: PeerPipeline.restore(
            A_DID, first_unacked=None, assigned=0, delivered=0, own_max_frame=MAX_FRAME
        )
    )
    #: B's open batch: accepted, not committed yet.
    batch: list[int] = field(default_factory=list)
    #: What B delivered (committed), in order.
    delivered: list[str] = field(default_factory=list)
    _texts: dict[int, str] = field(default_factory=dict)

    def send(self, text: str) -> pl.OutboxEntry:
        """A numbers a message (its outbox commit is a separate step)."""
        return self.a.assign(text, os.urandom(16), int(self.now * 1000), self.epoch)

    def transmit(self, row: pl.OutboxEntry) -> Received | Failed | None:
        """A puts ``row`` on the wire and B receives it."""
        wire = self.a.prepare(row)
        if wire is None or isinstance(wire, Failed):
            return wire
        self.a.on_sent(wire, _record(wire), self.now)
        return self.deliver(wire)

    def lose(self, row: pl.OutboxEntry) -> None:
        """A puts ``row`` on the wire and the network drops it."""
        wire = self.a.prepare(row)
        assert isinstance(wire, pl.OutboxEntry)
        self.a.on_sent(wire, _record(wire), self.now)

    def deliver(self, row: pl.OutboxEntry) -> Received:
        """B receives ``row`` as sent (e.g. a second time)."""
        verdict = self.b.receive(row.seq, row.prev)
        if verdict is Received.ACCEPT:
            self.batch.append(row.seq)
            self._texts[row.seq] = row.text
        return verdict

    def commit(self) -> int:
        """B's receive commit succeeds; returns the cumulative ack it sends."""
        batch, self.batch = self.batch, []
        self.delivered += [self._texts[s] for s in batch]
        return self.b.committed(batch)

    def fail_commit(self) -> None:
        """B's receive commit fails: the batch is lost, nothing acked."""
        self.batch = []
        self.b.commit_failed()

    def ack(self, seq: int) -> Acked | None:
        """The ack reaches A."""
        return self.a.on_ack(seq, self.epoch, self.now)

    def unsent(self) -> list[pl.OutboxEntry]:
        """What A's sender would transmit now (every row is still in memory here)."""
        rows = self.a.unsent_from_memory()
        if rows is None:
            rows, _ = self.a.unsent_after_store([])
        return rows
