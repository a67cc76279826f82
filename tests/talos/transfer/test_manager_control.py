"""The transfer manager's control messages off the link's read loop: queued per
peer, handled in order, bounded, released at stop
(docs/adr/0015-transfer-attempts-and-cancellation.md); and a transfer cancelled by
its user, either way."""

from __future__ import annotations

import asyncio
import os

import pytest

from talos.transfer.manager import MAX_QUEUED_CONTROL
from talos.transfer.protocol import (
    APP_NAME,
    Cancel,
    Offer,
    TransferState,
    decode_message,
    encode_message,
)
from talos.transfer.receiver import PARTIAL_DIR
from talos.transfer.routes import view
from talos_sdk.errors import UsageError
from tests.talos.nodes import until

from .net import LIMIT, Net, no_bulk, offer_pending


def _chat(net: Net) -> asyncio.Event:
    """Set when a frame of another app channel reaches the receiver over the same link."""
    chat = asyncio.Event()
    net.b.register_app("chat", lambda did, payload: chat.set())
    return chat


async def _cancels_then_chat(net: Net, tid: bytes, count: int) -> None:
    """``count`` CANCELs of transfer ``tid``, then a frame on another channel, in order."""
    cancel = encode_message(Cancel(tid, "changed my mind"))
    for _ in range(count):
        await net.a.send_app(net.b.did, APP_NAME, cancel)
    await net.a.send_app(net.b.did, "chat", b"hello")


async def _link_waiting_for_room(net: Net) -> None:
    """Until the sender's link waits behind MAX_QUEUED_CONTROL messages at the receiver."""
    queues = net.receiver._control
    await until(
        lambda: net.a.did in queues and len(queues[net.a.did].waiting) >= MAX_QUEUED_CONTROL,
        what="the link waiting for room",
    )


async def test_a_transfer_waiting_for_its_turn_does_not_hold_the_link(net: Net) -> None:
    # A control message whose transfer is busy (its turn held, as by a slow accept by
    # hand) waits in the manager, not on the link: the peer's other traffic goes on.
    await offer_pending(net, 1 << 20)
    (tid_hex,) = [i.tid for i in net.receiver.list()]
    tid = bytes.fromhex(tid_hex)
    chat = _chat(net)
    async with asyncio.timeout(LIMIT):
        async with net.receiver._one_at_a_time(tid):
            await _cancels_then_chat(net, tid, 1)
            await chat.wait()
            assert net.receiver.get(tid).state is TransferState.PENDING  # the cancel waits
        await until(lambda: net.receiver.get(tid).state is TransferState.CANCELLED, what="cancel")
    assert net.receiver._control == {}  # its handler ended with the queue


async def test_a_flood_of_control_messages_is_held_on_the_link(net: Net) -> None:
    # Past MAX_QUEUED_CONTROL waiting, the link's reading waits too: a peer cannot
    # grow the queue without bound by sending faster than its transfers take turns.
    await offer_pending(net, 1 << 20)
    (tid_hex,) = [i.tid for i in net.receiver.list()]
    tid = bytes.fromhex(tid_hex)
    chat = _chat(net)
    async with asyncio.timeout(LIMIT):
        async with net.receiver._one_at_a_time(tid):
            await _cancels_then_chat(net, tid, MAX_QUEUED_CONTROL + 5)
            await _link_waiting_for_room(net)
            for _ in range(10):
                await asyncio.sleep(0)
            assert not chat.is_set()  # behind the flood, on the link
        await chat.wait()
        await until(lambda: net.receiver._control == {}, what="the flood handled")
    assert net.receiver.get(tid).state is TransferState.CANCELLED


async def test_a_message_put_as_the_queue_drains_is_handled(net: Net) -> None:
    # The link waits for room behind 64 messages that need no await; the handler
    # task empties them all in one go and ends: the waiting message must not be lost.
    await offer_pending(net, 1 << 20)
    await offer_pending(net, 1 << 20)
    first, second = [bytes.fromhex(i.tid) for i in net.receiver.list()]
    async with asyncio.timeout(LIMIT):
        async with net.receiver._one_at_a_time(first):
            await net.a.send_app(net.b.did, APP_NAME, encode_message(Cancel(first, "slow")))
            for _ in range(MAX_QUEUED_CONTROL):  # unknown transfers: handled at once
                unknown = encode_message(Cancel(os.urandom(16), "no such transfer"))
                await net.a.send_app(net.b.did, APP_NAME, unknown)
            await net.a.send_app(net.b.did, APP_NAME, encode_message(Cancel(second, "real")))
            await _link_waiting_for_room(net)
        await until(lambda: net.receiver.get(second).state is TransferState.CANCELLED, what="2nd")
    assert net.receiver.get(first).state is TransferState.CANCELLED
    await until(lambda: net.receiver._control == {}, what="the handler ended")


async def test_stop_releases_a_link_waiting_for_room(net: Net) -> None:
    await offer_pending(net, 1 << 20)
    (tid,) = [bytes.fromhex(i.tid) for i in net.receiver.list()]
    chat = _chat(net)
    async with asyncio.timeout(LIMIT):
        async with net.receiver._one_at_a_time(tid):
            await _cancels_then_chat(net, tid, MAX_QUEUED_CONTROL + 2)
            await _link_waiting_for_room(net)
            stopping = asyncio.ensure_future(net.receiver.stop())
            await chat.wait()  # stop() let the link read on, while the turn is still held
        await stopping


async def test_a_receiver_cancels_an_accepted_transfer_whose_sender_never_sends(
    net: Net,
) -> None:
    """The space of an accepted transfer is taken at ACCEPT; a sender that then sends
    nothing held it for ever. ``cancel`` ends it: the partial file goes, the row is
    cancelled, the sender hears CANCEL; a second cancel has nothing to end."""
    await no_bulk(net)  # auto-accepted, on the app channel
    tid = os.urandom(16)
    offer = Offer(tid, 64 << 20, os.urandom(32), "never.bin")  # no byte will follow
    await net.a.send_app(net.b.did, APP_NAME, encode_message(offer))
    part = net.receiver.files_dir / PARTIAL_DIR / f"{tid.hex()}.part"
    async with asyncio.timeout(LIMIT):
        await until(
            lambda: (
                tid.hex() in {i.tid for i in net.receiver.list()}
                and net.receiver.get(tid).state is TransferState.ACTIVE
                and part.exists()
            ),
            what="the transfer accepted",
        )
        heard: list[bytes] = []
        net.a.register_app(APP_NAME, lambda did, payload: heard.append(payload))
        info = await net.receiver.cancel(tid.hex())
        assert info.state is TransferState.CANCELLED and not part.exists()
        await until(lambda: bool(heard), what="the sender told")
        assert isinstance(decode_message(heard[0]), Cancel)
        with pytest.raises(UsageError, match="cancelled: nothing to cancel"):
            await net.receiver.cancel(tid.hex())


async def test_a_sender_cancels_its_offer_and_the_receiver_hears_it(net: Net) -> None:
    await offer_pending(net, 5000)
    [out] = net.sender.list()
    async with asyncio.timeout(LIMIT):
        assert (await net.sender.cancel(out.tid)).state is TransferState.CANCELLED
        await until(
            lambda: net.receiver.get(out.tid).state is TransferState.CANCELLED,
            what="the receiver told",
        )


async def test_an_attempt_whose_sender_sends_nothing_ends_and_the_attempts_run_out(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An app-channel attempt with no chunk for CHUNK_WAIT ends as broken (its
    checkpoint kept, as when a link drops); a sender that offers again and again and
    sends nothing uses up MAX_ATTEMPTS, and the transfer fails, its space freed."""
    from talos.transfer import incoming
    from talos.transfer.records import MAX_ATTEMPTS

    monkeypatch.setattr(incoming, "CHUNK_WAIT", 0.2)
    await no_bulk(net)  # auto-accepted, on the app channel
    tid = os.urandom(16)
    offer = encode_message(Offer(tid, 1 << 20, os.urandom(32), "never.bin"))
    part = net.receiver.files_dir / PARTIAL_DIR / f"{tid.hex()}.part"
    async with asyncio.timeout(LIMIT):
        for attempt in range(1, MAX_ATTEMPTS + 1):
            await net.a.send_app(net.b.did, APP_NAME, offer)
            await until(
                lambda a=attempt: (
                    tid.hex() in {i.tid for i in net.receiver.list()}
                    and net.receiver.get(tid).epoch == a
                    and tid not in net.receiver._incoming
                ),
                what=f"attempt {attempt} started and ended",
            )
            assert net.receiver.get(tid).state is TransferState.ACTIVE and part.exists()
            assert view(net.receiver, tid.hex())["moving"] is False  # `files` says it waits
        await net.a.send_app(net.b.did, APP_NAME, offer)
        await until(lambda: net.receiver.get(tid).state is TransferState.FAILED, what="failed")
    assert f"gave up after {MAX_ATTEMPTS} attempts" in (net.receiver.get(tid).error or "")
    assert not part.exists()
