"""No file of the node's home leaves by ``send_file`` (talos/transfer/outgoing.py
``_in_home``, ``_home_inodes``, ``_open_source``): by name and by inode, at the offer and
on the file as opened to send; the source is opened without blocking. Whole transfers
between two endpoints over 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from talos.transfer.manager import TransferConfig, TransferInfo
from talos.transfer.protocol import TransferState
from talos_sdk.errors import UsageError
from tests.talos.nodes import until

from .net import LIMIT, Net, is_pending, visible


async def test_a_file_swapped_for_a_link_into_the_home_after_its_offer_is_not_sent(
    net: Net,
) -> None:
    # The offer checks the name; the bytes are read when the peer accepts, from the
    # file as opened then: a symlink put in its place meanwhile must not send the key.
    key = _sender_home_with_key(net)
    report = net.tmp / "shared" / "report.txt"
    report.parent.mkdir()
    async with asyncio.timeout(LIMIT):
        out, tid = await _offered_then_replaced(net, report, lambda: report.symlink_to(key))
        inc = await net.receiver.wait(tid)
    assert out.state is TransferState.FAILED and "a file of the node's home" in out.error
    assert inc.state is not TransferState.COMPLETE
    assert visible(net.receiver.files_dir) == []


async def test_a_hard_link_to_a_file_of_the_home_is_not_sent(net: Net) -> None:
    # Another name for the key file, outside the home: refused at the offer, and at
    # the accept if the link is made after the offer.
    key = _sender_home_with_key(net)
    shared = net.tmp / "shared"
    shared.mkdir()
    os.link(key, shared / "innocent.txt")
    with pytest.raises(UsageError, match="in the node's home"):
        await net.sender.send_file(net.b.did, shared / "innocent.txt")
    report = shared / "report.txt"
    async with asyncio.timeout(LIMIT):
        out, _ = await _offered_then_replaced(net, report, lambda: os.link(key, report))
    assert out.state is TransferState.FAILED and "a file of the node's home" in out.error
    assert visible(net.receiver.files_dir) == []


async def test_a_fifo_put_in_place_of_an_offered_file_fails_it_without_blocking(
    net: Net,
) -> None:
    report = net.tmp / "report.txt"
    async with asyncio.timeout(LIMIT):
        # No writer will ever come to the FIFO: a blocking open would hang the loop.
        out, _ = await _offered_then_replaced(net, report, lambda: os.mkfifo(report))
    assert out.state is TransferState.FAILED and "changed since it was offered" in out.error


async def test_a_files_dir_that_is_the_home_exempts_none_of_its_files(net: Net) -> None:
    # Received files may be sent on; with files_dir set to the home itself that rule
    # must not cover the home's own files.
    key = _sender_home_with_key(net)
    home = key.parent
    net.sender.files_dir = home
    with pytest.raises(UsageError, match="in the node's home"):
        await net.sender.send_file(net.b.did, key)


def _sender_home_with_key(net: Net) -> Path:
    """A home for the sending manager (its private_dir) holding a key file; its path."""
    home = net.tmp / "home"
    home.mkdir()
    key = home / "identity.key"
    key.write_bytes(b"secret" * 100)
    net.sender.private_dir = home.resolve()
    return key


async def _offered_then_replaced(
    net: Net, report: Path, replace: Callable[[], object]
) -> tuple[TransferInfo, str]:
    """Offer ``report`` (600 bytes, the key file's size: a size check alone passes),
    replace it by ``replace()`` once the offer waits, accept: the sender's end, the id."""
    report.write_bytes(b"x" * 600)
    net.receiver.config = TransferConfig()  # nothing auto-accepted
    tid = await net.sender.send_file(net.b.did, report)
    await until(lambda: is_pending(net, tid), what="the offer")
    report.unlink()
    replace()
    await net.receiver.accept(tid)
    return await net.sender.wait(tid), tid
