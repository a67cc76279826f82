"""The manager tests' two endpoints (tests/talos/transfer/pair.py) with a transfer
manager each, and the helpers those tests share."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from talos.transfer.manager import TransferConfig, TransferManager
from talos.transfer.pipeline import Slot
from talos.transfer.protocol import Chunk, TransferState, encode_message
from talos.transfer.receiver import PARTIAL_DIR
from talos_sdk.errors import UsageError
from talos_sdk.wallet import Wallet
from tests.talos.nodes import until

from .pair import Endpoint, link

#: Seconds a manager test may take; each stops by itself well before.
LIMIT = 30.0


@dataclass
class Net:
    tmp: Path
    a: Endpoint
    b: Endpoint
    sender: TransferManager
    receiver: TransferManager
    wallet_b: Wallet

    async def restart_receiver(self, config: TransferConfig) -> None:
        link(self.a, self.b, False)
        await self.receiver.stop()
        await self.b.close()
        self.b = Endpoint(self.tmp / "b", self.wallet_b)
        self.receiver = TransferManager(self.b, self.tmp / "b" / "files", config)
        await self.receiver.start()
        link(self.a, self.b, True)


async def make_net(tmp_path: Path, receiver_config: TransferConfig) -> Net:
    wa, wb = Wallet.generate(), Wallet.generate()
    a = Endpoint(tmp_path / "a", wa)
    b = Endpoint(tmp_path / "b", wb)
    sender = TransferManager(a, tmp_path / "a" / "files")
    receiver = TransferManager(b, tmp_path / "b" / "files", receiver_config)
    await sender.start()
    await receiver.start()
    link(a, b, True)
    return Net(tmp_path, a, b, sender, receiver, wb)


def source_file(tmp: Path, size: int, name: str = "data.bin") -> tuple[Path, str]:
    path = tmp / name
    data = os.urandom(size)
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


def visible(files: Path) -> list[str]:
    return sorted(p.name for p in files.iterdir() if p.name != PARTIAL_DIR)


async def no_bulk(net: Net, **config: Any) -> None:
    """The receiver offers no bulk port: the bytes take the app channel (fallback)."""
    assert net.receiver.listener is not None
    await net.receiver.listener.close()
    net.receiver.listener = None
    net.receiver.config = TransferConfig(auto_accept=(net.a.did,), **config)


def count_app_chunks(net: Net, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the CHUNK messages the sender puts on the app channel (the fallback)."""
    send_app = net.a.send_app
    chunks = [0]
    chunk_type = encode_message(Chunk(bytes(16), 1, 0, b""))[:1]

    async def counting(did: str, name: str, payload: bytes) -> None:
        chunks[0] += payload[:1] == chunk_type
        await send_app(did, name, payload)

    monkeypatch.setattr(net.a, "send_app", counting)
    return chunks


def bulk_offsets(sender: TransferManager, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The file offset of each chunk ``sender`` puts on a bulk stream, in order."""
    count = sender._count
    offsets: list[int] = []

    def watched(tid: bytes, size: int) -> Callable[[Slot], None]:
        on_sent = count(tid, size)

        def sent(slot: Slot) -> None:
            offsets.append(slot.offset)
            on_sent(slot)

        return sent

    monkeypatch.setattr(sender, "_count", watched)
    return offsets


async def offer_pending(net: Net, size: int) -> Path:
    """Offer a file of ``size`` bytes that nobody auto-accepts; returns it once the
    receiver holds the offer pending."""
    net.receiver.config = TransferConfig()
    src, _ = source_file(net.tmp, size)
    tid = await net.sender.send_file(net.b.did, src)
    await until(lambda: is_pending(net, tid), what="the offer")
    return src


def is_pending(net: Net, tid: str) -> bool:
    try:
        return net.receiver.get(tid).state is TransferState.PENDING
    except UsageError:
        return False


async def send_whole(net: Net, size: int) -> None:
    """Send a file of ``size`` random bytes; it must arrive whole."""
    src, _ = source_file(net.tmp, size)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        inc = await net.receiver.wait(tid)
    assert inc.state is TransferState.COMPLETE, inc.error
    assert Path(inc.path).read_bytes() == src.read_bytes()
