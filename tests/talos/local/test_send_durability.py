"""Sends through the local socket under group commit: what a node acknowledged survives
SIGKILL, in order (talos/writer.py, docs/adr/0007-epoch-sequence-numbers.md).

Real ``talosd run`` processes, real LMDB, real SIGKILL: both nodes are killed
the moment the last reply arrives, then their stores are read offline.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from talos import pipeline as pl
from talos.chain.block import Record
from talos.chain.pending import pending_record
from talos.local.client import LocalClient
from talos.store import Store, Txn
from tests.talos.daemons import Daemon, fast_config, talosd
from tests.talos.nodes import link, make_home, started

IN_FLIGHT = 32
COUNT = 160


def _init(tmp_path: Path, name: str) -> tuple[Path, str]:
    home = tmp_path / name
    res = talosd("init", "--home", str(home), "--no-passphrase")
    assert res.returncode == 0, res.stderr
    fast_config(home)
    return home, res.stdout.strip()


def _logged_ids(txn: Txn) -> set[bytes]:
    """Record ids in the block log: sealed into blocks, or waiting to be (``pending``)."""
    sealed = [bytes(v) for _, v in txn.items("block_records")]
    pending = [pending_record(bytes(v)) for _, v in txn.items("pending")]
    return {Record.from_bytes(v).record_id for v in sealed + pending}


async def _send_all(home: Path, did_b: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """COUNT sends, IN_FLIGHT at a time on one connection; every third without ``wait``."""
    client = await LocalClient.connect(home)
    await client.call("send", to=did_b, text="warm", wait=True)
    window = asyncio.Semaphore(IN_FLIGHT)
    acked: list[tuple[int, str]] = []
    queued: list[tuple[int, str]] = []

    async def one(i: int) -> None:
        async with window:
            wait = i % 3 != 0
            got = await client.call("send", to=did_b, text=f"m{i:04d}", wait=wait)
            assert got["acked"] is wait
            (acked if wait else queued).append((i, got["id"]))

    await asyncio.gather(*(one(i) for i in range(COUNT)))
    return acked, queued


async def test_what_was_acknowledged_survives_sigkill_in_order(tmp_path: Path) -> None:
    home_a, did_a = _init(tmp_path, "a")
    home_b, did_b = _init(tmp_path, "b")
    b = Daemon(home_b, "--listen", "127.0.0.1:0", "--allow", did_a)
    a = Daemon(home_a, "--listen", "127.0.0.1:0", "--peer", b.addr)
    try:
        acked, queued = await asyncio.wait_for(_send_all(home_a, did_b), 120)
    finally:
        # Right after the last reply: no clean stop, no final seal or sync.
        b.kill()
        a.kill()
    assert len(acked) + len(queued) == COUNT
    with Store(home_b / "store") as store, store.read() as txn:
        inbox = list(pl.iter_inbox(txn))
        logged = _logged_ids(txn)
    got = {e.msg_id.hex(): e.text for e in inbox}
    # send --wait: acked means the receiver holds it durably, in its inbox and its log
    for i, msg_id in acked:
        assert got.get(msg_id) == f"m{i:04d}"
        assert bytes.fromhex(msg_id) in logged
    # plain send: queued means durable at the sender, or delivered already
    with Store(home_a / "store") as store, store.read() as txn:
        outbox = {r.msg_id.hex() for r in pl.iter_outbox(txn, did_b)}
    for _, msg_id in queued:
        assert msg_id in got or msg_id in outbox
    # one connection's sends arrive in the order they were made
    texts = [e.text for e in inbox if e.text != "warm"]
    assert texts == sorted(texts)


async def test_a_wait_that_ends_without_the_ack_syncs_the_row_first(tmp_path: Path) -> None:
    # send --wait rows commit without their own fsync; a caller told "the message
    # stays queued" must be able to rely on it after a crash: a sync runs first.
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    try:
        await link(a, b)
        await b.stop()  # B gone: no ack will come
        order: list[str] = []
        a.writer.before("outbox", lambda kind, size: order.append(kind))
        a.writer.before("sync", lambda kind, size: order.append(kind))
        with pytest.raises(TimeoutError):
            await a.send_message(b.did, "never acked", wait=True, timeout=0.2)
        assert order == ["outbox", "sync"]
        with a.store.read() as txn:
            assert [r.text for r in pl.iter_outbox(txn, b.did)] == ["never acked"]
        # a plain send's row is synced by its own commit: no extra sync
        order.clear()
        await a.send_message(b.did, "queued")
        assert order == ["outbox"]
    finally:
        await a.stop()
