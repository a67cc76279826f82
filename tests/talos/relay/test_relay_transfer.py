"""File transfer over a relayed link (the bulk path as today, and the app-channel fallback)."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

from talos.transfer.manager import TransferConfig, TransferManager
from talos.transfer.protocol import TransferState
from tests.talos.nodes import started, until
from tests.talos.relay.conftest import RelayNet


@pytest.mark.parametrize("bulk", [False, True], ids=["no-bulk-listener", "bulk-listener"])
async def test_file_over_a_relayed_link(relay_net: RelayNet, bulk: bool) -> None:
    # A relayed link has no address to dial a bulk port at: the bytes take the app
    # channel even where the receiver listens for bulk streams (incoming.py offers no
    # port to a relayed peer, outgoing.py _send_bulk would not dial one).
    a = await started(*relay_net.home("a"))
    b = await started(*relay_net.home("b"))
    a.allow(b.did)
    b.allow(a.did)
    sender = TransferManager(a, relay_net.root / "a-files", TransferConfig())
    receiver = TransferManager(
        b, relay_net.root / "b-files", TransferConfig(auto_accept=(a.did,), bulk=bulk)
    )
    await sender.start()
    await receiver.start()
    try:
        await a.send_message(b.did, "link up", wait=True)
        assert {x["did"]: x["via"] for x in a.status()["links"]}[b.did] == "relay"
        assert a.peer_host(b.did) is None
        payload = os.urandom(3 << 20)
        source = relay_net.root / "payload.bin"
        source.write_bytes(payload)
        tid = await sender.send_file(b.did, source)
        await until(lambda: sender.get(tid).state == TransferState.COMPLETE, 60, "transfer done")
        received = relay_net.root / "b-files" / "payload.bin"
        assert hashlib.sha256(received.read_bytes()).digest() == hashlib.sha256(payload).digest()
    finally:
        await sender.stop()
        await receiver.stop()
        await a.stop()
        await b.stop()
    await asyncio.sleep(0)
