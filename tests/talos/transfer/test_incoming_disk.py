"""Incoming files and the disk (talos/transfer/incoming.py ``_open_file``): an offer must
leave DISK_RESERVE free, checked at the offer and before the first attempt preallocates,
one transfer at a time; what a cancelled accept preallocated is deleted. Whole transfers
between two endpoints over 127.0.0.1."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from talos.transfer import incoming
from talos.transfer.manager import TransferConfig
from talos.transfer.protocol import TransferState
from talos.transfer.receiver import PARTIAL_DIR
from tests.talos.nodes import until

from .net import LIMIT, Net, is_pending, offer_pending, source_file


async def test_an_offer_must_leave_disk_free(net: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    # The file is preallocated whole when accepted: an offer that would leave less than
    # DISK_RESERVE free is refused (the store and the block log share that disk).

    files = net.receiver.files_dir
    monkeypatch.setattr(incoming, "DISK_RESERVE", shutil.disk_usage(files).free - 1000)
    src, _ = source_file(net.tmp, 10_000)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        out = await net.sender.wait(tid)
    assert out.state is TransferState.REJECTED and "kept free" in out.error


async def test_an_offer_accepted_by_hand_checks_the_disk_again(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Offers wait for a hand to accept them; meanwhile others may have taken the disk.

    async with asyncio.timeout(LIMIT):
        await offer_pending(net, 10_000)
        (tid,) = [i.tid for i in net.receiver.list()]
        free = shutil.disk_usage(net.receiver.files_dir).free
        monkeypatch.setattr(incoming, "DISK_RESERVE", free)
        await net.receiver.accept(tid)
        out = await net.sender.wait(tid)
    assert net.receiver.get(tid).state is TransferState.FAILED
    assert out.state is TransferState.FAILED and "not enough disk space" in out.error


async def test_offers_accepted_together_do_not_both_take_the_disk_reserve(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Room for one of the two files above the reserve: accepted at once, the second
    # must see the space the first preallocates, not the free space both saw before.

    size = 32 << 20
    net.receiver.config = TransferConfig()  # nothing auto-accepted
    async with asyncio.timeout(LIMIT):
        tids = []
        for name in ("one.bin", "two.bin"):
            src = net.tmp / name
            with src.open("wb") as f:
                f.truncate(size)  # sparse: the sender's disk is not the point
            tid = await net.sender.send_file(net.b.did, src)
            await until(lambda t=tid: is_pending(net, t), what="the offer")
            tids.append(tid)
        free = shutil.disk_usage(net.receiver.files_dir).free
        monkeypatch.setattr(incoming, "DISK_RESERVE", free - size - size // 2)
        await asyncio.gather(*(net.receiver.accept(t) for t in tids))
        outs = [await net.sender.wait(t) for t in tids]
    states = sorted(o.state.value for o in outs)
    assert states == sorted([TransferState.COMPLETE.value, TransferState.FAILED.value])
    (failed,) = [o for o in outs if o.state is TransferState.FAILED]
    assert "not enough disk space" in failed.error


async def test_an_accept_cancelled_while_it_preallocates_leaves_no_file(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A local client gone mid-accept cancels it; the preallocation runs to its end and
    # its file, holding nothing received, is deleted (no quota counts it).
    import time as time_module

    from talos.transfer.receiver import IncomingFile

    await offer_pending(net, 1 << 20)
    (tid,) = [i.tid for i in net.receiver.list()]
    part = net.receiver.files_dir / PARTIAL_DIR / f"{tid}.part"
    allocate = IncomingFile._preallocate

    def slow(self: IncomingFile, start: int) -> None:
        time_module.sleep(0.5)
        allocate(self, start)

    monkeypatch.setattr(IncomingFile, "_preallocate", slow)
    async with asyncio.timeout(LIMIT):
        accepting = asyncio.ensure_future(net.receiver.accept(tid))
        await asyncio.sleep(0.2)
        accepting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await accepting
    assert not part.exists() and net.receiver.get(tid).state is TransferState.PENDING
