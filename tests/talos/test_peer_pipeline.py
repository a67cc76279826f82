"""talos/peer_pipeline.py through a connected pair of pipelines, no sockets, no store
(docs/adr/0007-epoch-sequence-numbers.md; docs/PROTOCOL.md "Link protocol", Message size)."""

from __future__ import annotations

import pytest

from talos import pipeline as pl
from talos.peer_pipeline import DESYNC_LIMIT, Failed, PeerPipeline, Received, Retry
from talos_sdk.errors import ProtocolError
from tests.talos.pipeline_pair import B_DID, MAX_FRAME, PipelinePair


def test_in_order_messages_are_accepted_committed_and_acked() -> None:
    pair = PipelinePair()
    rows = [pair.send(f"m{i}") for i in range(3)]
    assert [r.seq for r in rows] == [pl.make_seq(1, n) for n in (1, 2, 3)]
    assert [pair.transmit(r) for r in rows] == [Received.ACCEPT] * 3
    ack = pair.commit()
    assert ack == rows[-1].seq and pair.delivered == ["m0", "m1", "m2"]
    acked = pair.ack(ack)
    assert acked is not None and [r.record_id for r in acked.records] == [r.msg_id for r in rows]
    assert len(acked.latencies) == 3 and pair.a.tx.acked == ack
    assert pair.ack(ack) is None  # an old ack does not move anything


def test_duplicates_are_reacked_or_left_to_their_batch() -> None:
    pair = PipelinePair()
    row = pair.send("once")
    assert pair.transmit(row) is Received.ACCEPT
    assert pair.deliver(row) is Received.IN_BATCH  # its commit will ack it
    pair.commit()
    assert pair.deliver(row) is Received.REACK
    assert pair.delivered == ["once"]


def test_a_gap_is_dropped_and_the_resend_fills_it() -> None:
    pair = PipelinePair()
    lost, second = pair.send("lost"), pair.send("second")
    pair.lose(lost)
    assert pair.transmit(second) is Received.GAP
    pair.now += 10
    assert pair.a.retry(pair.now, 5.0, ready=True, linked=True) is Retry.RESEND
    assert [r.text for r in pair.unsent()] == ["lost", "second"]
    assert [pair.transmit(r) for r in pair.unsent()] == [Received.ACCEPT, Received.ACCEPT]
    assert pair.ack(pair.commit()) is not None and pair.delivered == ["lost", "second"]


def test_a_failed_receive_commit_accepts_the_resend() -> None:
    pair = PipelinePair()
    row = pair.send("m")
    pair.transmit(row)
    pair.fail_commit()
    pair.a.link_down()  # the sender resends everything unacknowledged on the next link
    assert pair.transmit(pair.unsent()[0]) is Received.ACCEPT
    assert pair.commit() == row.seq


def test_what_the_peer_said_of_its_storage_lasts_until_an_ack_moves_or_the_link_ends() -> None:
    pair = PipelinePair()
    row = pair.send("m")
    pair.transmit(row)
    pair.fail_commit()
    pair.a.deferred = 1  # the node sets it from the peer's DEFER
    assert pair.ack(0) is None and pair.a.deferred == 1  # an ack that moves nothing
    pair.a.link_down()
    assert pair.a.deferred == 0
    pair.a.deferred = 1
    pair.transmit(pair.unsent()[0])
    assert pair.ack(pair.commit()) is not None and pair.a.deferred == 0


def test_a_row_too_large_for_the_peer_fails_and_its_successor_takes_its_prev() -> None:
    pair = PipelinePair()
    pair.a.peer_max_frame = MAX_FRAME
    first = pair.send("first")
    pair.a.peer_max_frame = pl.MSG_OVERHEAD + 10  # the peer's offer says: 10-byte texts
    big, after = pair.send("x" * 5), pair.send("y" * 5)
    big = pl.OutboxEntry(big.peer, big.seq, big.msg_id, big.ts_ms, "x" * 50, big.prev)
    assert pair.transmit(first) is Received.ACCEPT
    failed = pair.transmit(big)
    assert isinstance(failed, Failed) and failed.prev == first.seq and failed.limit == 10
    assert pair.transmit(big) is None  # failed already
    assert pair.a.for_outbox(big) is None  # only its number is noted
    assert pair.a.for_outbox(after) is not None and pair.a.for_outbox(after).prev == first.seq
    assert pair.transmit(after) is Received.ACCEPT  # prev rewritten past the failed row
    pair.commit()
    assert pair.delivered == ["first", "y" * 5]


def test_a_row_whose_outbox_commit_failed_is_skipped_and_never_logged() -> None:
    pair = PipelinePair()
    first, failed, after = pair.send("first"), pair.send("failed"), pair.send("after")
    assert pair.transmit(first) is Received.ACCEPT
    pair.lose(failed)  # sent, its frame lost with the link; then its commit fails
    pair.a.outbox_failed([failed])
    assert pair.a.for_outbox(failed) is None  # only its number is noted
    assert pair.a.for_outbox(after) is not None and pair.a.for_outbox(after).prev == first.seq
    assert pair.transmit(failed) is None  # never sent again
    assert pair.transmit(after) is Received.ACCEPT  # prev rewritten past the failed row
    acked = pair.ack(pair.commit())
    assert pair.delivered == ["first", "after"]
    assert acked is not None and [r.record_id for r in acked.records] == [
        first.msg_id,
        after.msg_id,
    ]  # no record of the failed row: its caller got no id


def test_assign_refuses_a_text_above_both_bounds() -> None:
    pair = PipelinePair()
    pair.a.peer_max_frame = pl.MSG_OVERHEAD + 4
    with pytest.raises(pl.MessageTooLargeError, match="5 bytes above the 4-byte limit"):
        pair.send("12345")
    assert pair.a.last_assigned == 0  # no number was spent


def test_acks_for_unsent_messages_are_a_protocol_error_unless_from_an_older_epoch() -> None:
    pair = PipelinePair(epoch=3)
    row = pair.send("m")
    pair.transmit(row)
    with pytest.raises(ProtocolError, match="not sent yet"):
        pair.ack(row.seq + 1)
    # A crashed earlier run may have sent epoch-2 numbers it never committed (ADR 0007),
    # but an ack counts only up to what this link carried: before anything was
    # sent it releases nothing (no outbox row is dropped unsent).
    old = PipelinePair(epoch=3)
    assert old.ack(pl.make_seq(2, 7)) is None
    old.transmit(old.send("m"))
    assert old.ack(pl.make_seq(2, 7)) is not None


def test_restore_takes_the_acked_number_from_the_oldest_outbox_row() -> None:
    row = pl.OutboxEntry(B_DID, pl.make_seq(1, 5), b"\1" * 16, 0, "t", pl.make_seq(1, 4))
    p = PeerPipeline.restore(
        B_DID, first_unacked=row, assigned=pl.make_seq(1, 9), delivered=3, own_max_frame=MAX_FRAME
    )
    assert p.tx.acked == p.tx.sent == pl.make_seq(1, 4)
    assert p.last_assigned == pl.make_seq(1, 9) and p.rx.delivered == 3


def test_retry_decisions() -> None:
    pair = PipelinePair()
    assert pair.a.retry(0, 5, ready=True, linked=True) is Retry.NONE  # idle: nothing to send
    assert pair.a.retry(0, 5, ready=False, linked=True) is Retry.NONE
    pair.send("queued")
    assert pair.a.retry(0, 5, ready=False, linked=False) is Retry.DIAL
    assert pair.a.retry(0, 5, ready=True, linked=True) is Retry.KICK  # queued, not sent
    pair.transmit(pair.unsent()[0])
    assert pair.a.retry(1, 5, ready=True, linked=True) is Retry.NONE  # in flight, recent
    assert pair.ack(pair.commit()) is not None
    assert pair.a.retry(2, 5, ready=True, linked=True) is Retry.NONE  # all acked: idle again


def test_session_resync_after_many_undecryptable_frames() -> None:
    p = PipelinePair().a
    assert not any(p.decrypt_failed() for _ in range(DESYNC_LIMIT - 1))
    p.frame_opened()
    assert not any(p.decrypt_failed() for _ in range(DESYNC_LIMIT - 1))
    assert p.decrypt_failed()


def test_unsent_reads_the_store_once_committed_rows_are_pending() -> None:
    pair = PipelinePair()
    rows = [pair.send(f"m{i}") for i in range(3)]
    pair.a.outbox_committed(rows[1].seq)  # m0, m1 are in the store now
    assert pair.a.unsent_from_memory() is None
    got, more = pair.a.unsent_after_store(rows[:2])
    assert got == rows and not more


def test_dropped_messages_are_never_sent_and_the_next_follows_the_last_acked() -> None:
    pair = PipelinePair()
    first = pair.send("first")
    pair.transmit(first)
    assert pair.ack(pair.commit()) is not None
    arrived, lost, unsent = pair.send("arrived"), pair.send("lost"), pair.send("unsent")
    assert pair.transmit(arrived) is Received.ACCEPT  # B holds it; its ack never comes
    pair.commit()
    pair.lose(lost)
    drop = pair.a.drop_unacked(*pair.a.drop_point())
    assert drop.prev == first.seq and drop.last == unsent.seq
    assert drop.fresh == [arrived.seq, lost.seq, unsent.seq]  # none committed here
    assert drop.max_sent == lost.seq  # arrived and lost had gone out
    assert pair.unsent() == []
    assert [pair.transmit(r) for r in (lost, unsent)] == [None, None]  # never sent again
    assert all(pair.a.for_outbox(r) is None for r in (arrived, lost, unsent))
    assert pair.a.retry(0, 5, ready=True, linked=True) is Retry.NONE  # nothing to kick
    assert pair.a.retry(0, 5, ready=False, linked=False) is Retry.NONE  # nor to dial for
    assert pair.ack(arrived.seq) is None  # the late ack of a dropped message moves nothing
    after = pair.send("after")
    wire = pair.a.for_outbox(after)
    assert wire is not None and wire.prev == first.seq
    assert pair.transmit(after) is Received.ACCEPT  # B holds "arrived": first <= it < after
    acked = pair.ack(pair.commit())
    assert acked is not None and [r.record_id for r in acked.records] == [after.msg_id]
    assert pair.delivered == ["first", "arrived", "after"]


def test_a_peer_that_got_none_of_the_dropped_messages_takes_the_next() -> None:
    pair = PipelinePair()
    for row in [pair.send("lost") for _ in range(3)]:
        pair.lose(row)
    assert pair.a.drop_unacked(*pair.a.drop_point()).prev == 0
    assert pair.transmit(pair.send("after")) is Received.ACCEPT
    pair.commit()
    assert pair.delivered == ["after"]


def test_restore_after_a_drop_names_what_came_before_the_dropped_messages() -> None:
    # The store after a drop ended the queue: no outbox row, ``out`` at the last
    # dropped number, ``skip`` naming the last acked one (talos/pipeline.py next_prev).
    last, held = pl.make_seq(1, 9), pl.make_seq(1, 4)
    p = PeerPipeline.restore(
        B_DID,
        first_unacked=None,
        assigned=last,
        delivered=0,
        own_max_frame=MAX_FRAME,
        next_prev=held,
    )
    row = p.assign("next", b"\2" * 16, 0, epoch=2)
    assert row.seq == pl.make_seq(2, 1) and row.prev == last
    wire = p.prepare(row)
    assert isinstance(wire, pl.OutboxEntry) and wire.prev == held
    assert p.is_next(row)
    assert p.drop_unacked(*p.drop_point()).prev == held  # a second drop still names the held one


def test_an_outbox_commit_failing_after_a_drop_keeps_what_the_drop_said() -> None:
    pair = PipelinePair()
    first = pair.send("first")
    pair.transmit(first)
    assert pair.ack(pair.commit()) is not None
    stored = pair.send("stored")
    pair.a.outbox_committed(stored.seq)  # durable, never sent (the peer is away)
    fresh = pair.send("fresh")  # its outbox commit is in the writer
    pair.a.drop_unacked(*pair.a.drop_point())
    pair.a.outbox_failed([fresh])  # then that commit fails: it must not name "stored"
    after = pair.send("after")
    wire = pair.a.for_outbox(after)
    assert wire is not None and wire.prev == first.seq
    assert pair.transmit(after) is Received.ACCEPT


def test_a_drop_covers_only_what_was_numbered_when_it_was_asked() -> None:
    # The store drops the rows first; a message numbered meanwhile is kept.
    pair = PipelinePair()
    dropped = pair.send("dropped")
    point = pair.a.drop_point()
    kept = pair.send("numbered while the store dropped")
    pair.lose(dropped)
    pair.lose(kept)  # sent naming "dropped": a gap at the peer until resent
    pair.a.drop_unacked(*point)
    assert pair.unsent() == []  # kept went out already on this link
    pair.a.link_down()  # the resend names what the drop said
    (resent,) = pair.unsent()
    assert resent.seq == kept.seq and pair.transmit(resent) is Received.ACCEPT
    assert pair.ack(pair.commit()) is not None and pair.delivered == [kept.text]
