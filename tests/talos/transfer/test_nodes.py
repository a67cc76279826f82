"""File transfer between real in-process nodes (talos.node.Node) on 127.0.0.1.

Links are real websockets with ratchet sessions; file data goes over the real
bulk TCP path. Faults are real too: a node stopped and started again on its
home, a link closed, a relay that cuts or flips bytes of the bulk stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from talos.config import NodeConfig
from talos.node import Node
from talos.transfer import bulk
from talos.transfer.manager import TransferConfig, TransferManager
from talos.transfer.protocol import BULK_CHUNK, Accept, TransferState
from talos.transfer.receiver import PARTIAL_DIR, IncomingAttempt

from ..nodes import link, make_home, started, until
from .net import bulk_offsets
from .relay import Relay

LIMIT = 60.0
MIB = 1 << 20


@dataclass
class Side:
    home: Path
    config: NodeConfig
    tconfig: TransferConfig
    node: Node
    manager: TransferManager

    @property
    def files(self) -> Path:
        return self.home / "files"

    async def stop(self) -> None:
        await self.manager.stop()
        await self.node.stop()


async def _side(home: Path, config: NodeConfig, tconfig: TransferConfig) -> Side:
    node = await started(home, config)
    manager = TransferManager(node, home / "files", tconfig)
    await manager.start()
    return Side(home, config, tconfig, node, manager)


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[Side, Side]]:
    """A (sender, listening) and B (receiver, dials A, auto-accepts A)."""
    a_home, a_config = make_home(tmp_path, "a")
    b_home, b_config = make_home(tmp_path, "b")
    a = await _side(a_home, a_config, TransferConfig())
    b_cfg = TransferConfig(auto_accept=(a.node.did,), checkpoint_bytes=MIB, window=2)
    b = await _side(b_home, b_config, b_cfg)
    await link(b.node, a.node)
    sides = [a, b]
    yield a, b
    for side in sides:
        await side.stop()


def _file(tmp: Path, size: int) -> Path:
    path = tmp / "payload.bin"
    path.write_bytes(os.urandom(size))
    return path


def _visible(files: Path) -> list[str]:
    return sorted(p.name for p in files.iterdir() if p.name != PARTIAL_DIR)


class _ChunkGate:
    """Holds the receiver's ``at``-th chunk (counted over all attempts) until opened.

    Keeps a fault mid-transfer by synchronisation, not by slowing every chunk:
    the stream cannot get past the gate, so ``committed < size`` holds whatever
    the machine's speed. With ``interrupt`` the held chunk is never written: it
    fails as if its connection was cut (what a node stopping mid-chunk looks like).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int, *, interrupt: bool) -> None:
        self.reached = asyncio.Event()
        self.opened = threading.Event()
        loop = asyncio.get_running_loop()
        original = IncomingAttempt.open
        count = 0

        def gated(attempt: IncomingAttempt, slot: Any) -> None:
            nonlocal count
            count += 1  # only the opening thread of the one live attempt calls this
            if count == at:
                loop.call_soon_threadsafe(self.reached.set)
                if not self.opened.wait(LIMIT):
                    raise TimeoutError("the test never opened the chunk gate")
                if interrupt:
                    raise ConnectionAbortedError("interrupted at the test's chunk gate")
            original(attempt, slot)

        monkeypatch.setattr(IncomingAttempt, "open", gated)


def _accepted_offsets(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the offset of every ACCEPT the sender acts on (observation only)."""
    seen: list[int] = []
    original = TransferManager._on_accept

    async def spy(self: TransferManager, msg: Accept) -> None:
        if self.get(msg.tid).direction == "out":
            seen.append(msg.offset)
        await original(self, msg)

    monkeypatch.setattr(TransferManager, "_on_accept", spy)
    return seen


def _via_relay(monkeypatch: pytest.MonkeyPatch, relay: Relay) -> None:
    """Route the sender's bulk connections through ``relay`` (first one is damaged)."""
    original = bulk.connect_bulk

    async def connect(host: str, port: int, tid: bytes, token: bytes) -> bulk.BulkStream:
        relay.target = port
        return await original("127.0.0.1", relay.port, tid, token)

    monkeypatch.setattr(bulk, "connect_bulk", connect)


async def test_file_between_real_nodes_logged_on_both(
    tmp_path: Path, pair: tuple[Side, Side]
) -> None:
    a, b = pair
    src = _file(tmp_path, 2 * BULK_CHUNK + 5)
    async with asyncio.timeout(LIMIT):
        tid = await a.manager.send_file(b.node.did, src)
        inc = await b.manager.wait(tid)
        out = await a.manager.wait(tid)
    assert a.node.peer_host(b.node.did) == "127.0.0.1"  # where the bulk port was dialled
    assert inc.state is out.state is TransferState.COMPLETE
    assert Path(inc.path).read_bytes() == src.read_bytes()
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    assert inc.sha256 == out.sha256 == digest
    assert inc.signature == out.signature != ""
    for side in (a, b):
        await asyncio.to_thread(side.node.log.seal)
        log = side.node.log
        records = [r for blk in log.iter_blocks() for r in log.block_records(blk.height)]
        files = [r for r in records if r.kind == "file"]
        assert [r.record_id.hex() for r in files] == [tid]
        assert bytes.fromhex(digest) in files[0].commitment


async def test_receiving_node_restart_resumes(
    tmp_path: Path, pair: tuple[Side, Side], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    # The first checkpoint starts after the first chunk and needs no later one to finish,
    # so holding chunk 5 still lets a checkpoint (>= 1 MiB) be recorded.
    gate = _ChunkGate(monkeypatch, 5, interrupt=True)
    size = 24 * MIB
    src = _file(tmp_path, size)
    checkpointed = asyncio.Event()
    offsets = bulk_offsets(a.manager, monkeypatch)
    b.manager.on_progress = lambda tid, offset: checkpointed.set() if offset > 0 else None
    async with asyncio.timeout(LIMIT):
        tid = await a.manager.send_file(b.node.did, src)
        await gate.reached.wait()
        await checkpointed.wait()
        stopping = asyncio.ensure_future(b.stop())  # the whole node, not only its manager
        await asyncio.sleep(0)  # let the stop begin; either order leaves chunk 5 unwritten
        gate.opened.set()
        await stopping
        before = len(offsets)
        b2 = await _side(b.home, b.config, b.tconfig)  # redials A from its peers table
        b2.node.allow(a.node.did)
        committed = b2.manager.get(tid).offset
        assert MIB <= committed <= 4 * MIB < size
        b.node, b.manager = b2.node, b2.manager  # the fixture stops the new one
        inc = await b2.manager.wait(tid)
        out = await a.manager.wait(tid)
    assert inc.state is out.state is TransferState.COMPLETE
    assert inc.epoch >= 2
    assert Path(inc.path).read_bytes() == src.read_bytes()
    resumed = offsets[before:]
    assert resumed and min(resumed) >= committed  # resumed, not restarted


async def test_link_drop_resumes_from_committed_offset(
    tmp_path: Path, pair: tuple[Side, Side], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    # Chunk 5 waits for a recorded checkpoint, so the cut (at 12 MiB) comes after one.
    gate = _ChunkGate(monkeypatch, 5, interrupt=False)
    b.manager.on_progress = lambda tid, offset: gate.opened.set() if offset > 0 else None
    offsets = _accepted_offsets(monkeypatch)
    relay = await Relay(0, cut_after=12 * MIB).start()
    _via_relay(monkeypatch, relay)
    size = 20 * MIB
    src = _file(tmp_path, size)
    try:
        async with asyncio.timeout(LIMIT):
            tid = await a.manager.send_file(b.node.did, src)
            await relay.cut.wait()
            # the bulk connection died: take the peer link down with it
            ws_link = a.node.peer_state(b.node.did).link
            assert ws_link is not None
            await ws_link.close()
            inc = await b.manager.wait(tid)
            out = await a.manager.wait(tid)
    finally:
        await relay.close()
    assert inc.state is out.state is TransferState.COMPLETE
    assert Path(inc.path).read_bytes() == src.read_bytes()
    assert relay.connections >= 2
    assert offsets[0] == 0
    assert offsets[-1] > 0  # the second attempt started at the receiver's checkpoint


async def test_tampered_bulk_chunk_is_rejected_and_retried(
    tmp_path: Path,
    pair: tuple[Side, Side],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = pair
    offsets = _accepted_offsets(monkeypatch)
    # sender -> receiver: 53-byte hello, 32-byte proof, then (u32 | 25 + 1 MiB sealed) frames;
    # flip a ciphertext byte inside the third chunk
    third = 53 + 32 + 2 * (4 + 25 + BULK_CHUNK)
    relay = await Relay(0, flip_at=third + 4 + 9 + 777).start()
    _via_relay(monkeypatch, relay)
    size = 6 * BULK_CHUNK
    src = _file(tmp_path, size)
    seen_partial: list[list[str]] = []
    try:
        with caplog.at_level(logging.WARNING, logger="talos.transfer"):
            async with asyncio.timeout(LIMIT):
                tid = await a.manager.send_file(b.node.did, src)
                await until(lambda: relay.connections >= 2, LIMIT, "a second attempt")
                seen_partial.append(_visible(b.files))
                inc = await b.manager.wait(tid)
                await a.manager.wait(tid)
    finally:
        await relay.close()
    assert seen_partial == [[]]  # nothing visible while the damaged attempt was retried
    assert "DecryptionError" in caplog.text
    assert inc.state is TransferState.COMPLETE
    assert inc.epoch >= 2
    assert len(offsets) >= 2
    assert Path(inc.path).read_bytes() == src.read_bytes()
