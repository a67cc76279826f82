"""talos/seq_state.py: the receiver's accept / duplicate / gap decision and the sender's
acks and their waiters (docs/adr/0007-epoch-sequence-numbers.md)."""

from __future__ import annotations

import asyncio

from talos.seq_state import ReceiverState, SenderState, Verdict


def test_receiver_order_duplicates_and_gaps() -> None:
    rx = ReceiverState(delivered=2)
    assert rx.classify(2) == Verdict.DUPLICATE
    assert rx.classify(4) == Verdict.GAP
    assert rx.classify(3) == Verdict.ACCEPT
    assert rx.classify(3) == Verdict.DUPLICATE  # in the open batch: not accepted twice
    rx.rolled_back()  # the batch did not commit
    assert rx.classify(3) == Verdict.ACCEPT
    rx.committed(3)
    assert rx.delivered == 3


async def test_sender_acks_release_waiters_in_order() -> None:
    tx = SenderState(acked=0)
    w1, w3 = tx.wait_for(1), tx.wait_for(3)
    tx.sent = 3
    assert tx.on_ack(1)
    await asyncio.wait_for(w1, 1)
    assert not w3.done()
    assert not tx.on_ack(1)  # old ack: no progress
    tx.rewind()
    assert tx.sent == 1
    assert tx.on_ack(3)
    await asyncio.wait_for(w3, 1)
    assert tx.wait_for(2).done()


class _Told:
    """An AckWaiter that notes what it was told, when it was told it."""

    def __init__(self) -> None:
        self.told: list[BaseException | None] = []

    def done(self) -> bool:
        return bool(self.told)

    def set_result(self, result: None, /) -> None:
        self.told.append(result)

    def set_exception(self, exception: BaseException, /) -> None:
        self.told.append(exception)


def test_ack_waiters_are_told_in_the_call_that_acks() -> None:
    tx = SenderState(acked=2)
    early, later, refused = _Told(), _Told(), _Told()
    tx.add_waiter(2, early)  # acked already: told at once
    assert early.told == [None]
    tx.add_waiter(4, later)
    tx.add_waiter(6, refused)
    assert tx.on_ack(4) and later.told == [None] and not refused.done()
    assert not tx.on_ack(4) and later.told == [None]  # an old ack tells nobody twice
    tx.fail_waiters(lambda: TimeoutError("refused"))
    assert len(refused.told) == 1 and isinstance(refused.told[0], TimeoutError)
    assert tx.on_ack(6) and len(refused.told) == 1 and tx.waiters == {}
