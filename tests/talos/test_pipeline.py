"""Outbox/inbox rows and per-peer ordering rules (talos/pipeline.py) over a real LMDB store."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

from talos import pipeline as pl
from talos.seq_state import ReceiverState, Verdict
from talos.store import Store
from talos_sdk.errors import StorageError, UsageError

A = "did:key:z6MkA"
B = "did:key:z6MkB"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "store", map_size=1 << 22)
    yield s
    s.close()


def test_enqueue_assigns_per_peer_sequence(store: Store) -> None:
    with store.write() as txn:
        assert pl.enqueue(txn, A, b"1" * 16, 10, "one") == 1
        assert pl.enqueue(txn, A, b"2" * 16, 11, "two") == 2
        assert pl.enqueue(txn, B, b"3" * 16, 12, "für B") == 1
    with store.read() as txn:
        rows = list(pl.iter_outbox(txn, A))
        assert [(e.seq, e.msg_id, e.text) for e in rows] == [
            (1, b"1" * 16, "one"),
            (2, b"2" * 16, "two"),
        ]
        assert [e.text for e in pl.iter_outbox(txn, B)] == ["für B"]
        assert [e.seq for e in pl.iter_outbox(txn, A, after_seq=1)] == [2]
        assert rows[0].peer == A


def test_outbox_seq_with_zero_bytes(store: Store) -> None:
    with store.write() as txn:
        pl.put_u64(txn, "meta", pl.meta_out(A), 255)  # next seq is 256 = 0x...0100
        assert pl.enqueue(txn, A, b"x" * 16, 1, "t") == 256
    with store.read() as txn:
        (entry,) = pl.iter_outbox(txn, A)
    assert (entry.peer, entry.seq) == (A, 256)


def test_drop_acked(store: Store) -> None:
    with store.write() as txn:
        for i in range(5):
            pl.enqueue(txn, A, bytes([i]) * 16, i, str(i))
        pl.enqueue(txn, B, b"b" * 16, 0, "b")
        assert pl.drop_acked(txn, A, 3) == 3
    with store.read() as txn:
        assert [e.seq for e in pl.iter_outbox(txn, A)] == [4, 5]
        assert len(list(pl.iter_outbox(txn, B))) == 1


def test_inbox_row_round_trip() -> None:
    value = pl.encode_inbox(b"i" * 16, A, 7, 1234, "héllo")
    entry = pl.decode_inbox((9).to_bytes(8, "big"), value)
    assert entry == pl.InboxEntry(9, b"i" * 16, A, 7, 1234, "héllo")
    assert entry.to_json({A: "alice"}) == {
        "n": 9,
        "id": ("69" * 16),
        "from": A,
        "from_name": "alice",
        "text": "héllo",
        "ts": 1234,
    }
    assert entry.to_json()["from_name"] is None


def test_corrupt_inbox_row() -> None:
    with pytest.raises(StorageError, match="corrupt inbox row"):
        pl.decode_inbox((1).to_bytes(8, "big"), b"short")


# --- epochs and the prev link (docs/adr/0007-epoch-sequence-numbers.md) -------------------------


def test_epoch_numbers_order_lexicographically_and_never_repeat(store: Store) -> None:
    with store.write() as txn:
        assert pl.bump_epoch(txn) == 1
        first = pl.enqueue(txn, A, b"1" * 16, 1, "one", epoch=1)
        assert pl.bump_epoch(txn) == 2
        second = pl.enqueue(txn, A, b"2" * 16, 2, "two", epoch=2)
    assert (first, second) == (pl.make_seq(1, 1), pl.make_seq(2, 1))
    assert first < second and pl.epoch_of(second) == 2
    with store.read() as txn:
        rows = list(pl.iter_outbox(txn, A))
    assert [(r.seq, r.prev) for r in rows] == [(first, 0), (second, first)]
    assert pl.next_seq(second, 2) == second + 1


def test_next_seq_refuses_a_backwards_epoch_and_overflow() -> None:
    with pytest.raises(UsageError, match="went backwards"):
        pl.next_seq(pl.make_seq(3, 7), 2)
    with pytest.raises(UsageError, match="restart the node"):
        pl.next_seq(pl.make_seq(3, pl.MAX_N), 3)


def test_new_epoch_accepted_only_when_its_prev_is_delivered() -> None:
    e5 = functools.partial(pl.make_seq, 5)
    # The sender crashed after sending (5, 4) without committing it; its next run
    # starts epoch 6 with prev = (5, 3), the last number it had committed.
    rx = ReceiverState(delivered=e5(4))
    assert rx.classify(pl.make_seq(6, 1), prev=e5(3)) == Verdict.ACCEPT
    # Lost (5, 2): the receiver holds only (5, 1), so the new epoch must wait.
    rx = ReceiverState(delivered=e5(1))
    assert rx.classify(e5(3), prev=e5(2)) == Verdict.GAP
    assert rx.classify(pl.make_seq(6, 1), prev=e5(3)) == Verdict.GAP
    assert rx.classify(e5(2), prev=e5(1)) == Verdict.ACCEPT
    assert rx.classify(e5(3), prev=e5(2)) == Verdict.ACCEPT
    assert rx.classify(pl.make_seq(6, 1), prev=e5(3)) == Verdict.ACCEPT
    assert rx.classify(e5(3), prev=e5(2)) == Verdict.DUPLICATE


def test_put_row_keeps_the_highest_assigned(store: Store) -> None:
    late = pl.OutboxEntry(A, pl.make_seq(1, 2), b"2" * 16, 2, "b", pl.make_seq(1, 1))
    early = pl.OutboxEntry(A, pl.make_seq(1, 1), b"1" * 16, 1, "a", 0)
    with store.write() as txn:
        pl.put_row(txn, late)
        pl.put_row(txn, early)
        assert pl.get_u64(txn, "meta", pl.meta_out(A)) == late.seq
    with store.read() as txn:
        assert list(pl.iter_outbox(txn, A)) == [early, late]


def test_restored_store_numbers_above_the_original_after_advance_epoch(
    tmp_path: Path, store: Store
) -> None:
    with store.write() as txn:
        pl.bump_epoch(txn)
        pl.bump_epoch(txn)
        pl.enqueue(txn, A, b"1" * 16, 1, "before the backup", epoch=2)
    store.sync()
    backup = tmp_path / "backup"
    backup.mkdir()
    store.env.copy(str(backup))
    # The original home ran on to epoch 5; the peer delivered (5, 3).
    rx = ReceiverState(delivered=pl.make_seq(5, 3))
    with Store(backup, map_size=1 << 22) as restored:
        with restored.write() as txn:
            stale = pl.enqueue(txn, A, b"2" * 16, 2, "unsafe", epoch=pl.bump_epoch(txn))
        assert rx.classify(stale) == Verdict.DUPLICATE  # why a restore needs the jump
        with restored.write() as txn:
            epoch = pl.advance_epoch(txn)
            seq = pl.enqueue(txn, A, b"3" * 16, 3, "after restore", epoch=epoch)
    assert epoch == 3 + pl.RESTORE_EPOCH_STEP
    assert rx.classify(seq, prev=stale) == Verdict.ACCEPT


def test_advance_epoch_refuses_bad_steps_and_overflow(store: Store) -> None:
    with store.write() as txn:
        with pytest.raises(UsageError, match="must be positive"):
            pl.advance_epoch(txn, 0)
        assert pl.advance_epoch(txn, (1 << 32) - 1) == (1 << 32) - 1
        with pytest.raises(UsageError, match="does not fit in 32 bits"):
            pl.advance_epoch(txn, 1)


def test_a_row_naming_a_message_that_never_goes_is_stored_naming_what_it_said(
    store: Store,
) -> None:
    # Written after a drop by a writer that did not know of it (the peer's state gone
    # with `peers remove`, say): the row must not name the dropped message.
    dropped, held = pl.make_seq(1, 5), pl.make_seq(1, 2)
    with store.write() as txn:
        pl.note_assigned(txn, A, dropped)
        pl.note_skipped(txn, A, dropped, held)
        assert pl.next_prev(txn, A) == (dropped, held)
        pl.put_row(txn, pl.OutboxEntry(A, pl.make_seq(1, 6), b"6" * 16, 6, "after", dropped))
        assert pl.next_prev(txn, A) == (pl.make_seq(1, 6), pl.make_seq(1, 6))
    with store.read() as txn:
        assert [r.prev for r in pl.iter_outbox(txn, A)] == [held]


def test_the_skip_row_keeps_the_newest_number_and_for_it_the_lower_prev(store: Store) -> None:
    s = functools.partial(pl.make_seq, 1)
    with store.write() as txn:
        pl.note_assigned(txn, A, s(9))
        pl.note_skipped(txn, A, s(9), s(3))  # a drop: the peer holds (1, 3)
        pl.note_skipped(txn, A, s(9), s(8))  # a failure found later names (1, 8)
        assert pl.next_prev(txn, A) == (s(9), s(3))
        pl.note_skipped(txn, A, s(7), s(6))  # an older number changes nothing
        assert pl.next_prev(txn, A) == (s(9), s(3))
