"""One peer cannot fill a node's store with messages: each sender's stored inbox rows are
bounded by ``inbox_share`` (talos/node_delivery.py ``_over_share``); past it its next
messages wait, queued at its end, while other peers' are taken; pruning frees the share
and the waiting messages then arrive, in order, once each. Real nodes on 127.0.0.1 with
real LMDB stores; the store pruning itself (talos/pipeline.py) on a real store too."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from talos import pipeline as pl
from talos.store import Store
from talos_sdk.errors import UsageError
from tests.talos.nodes import link, make_home, started, until

TEXT = "x" * 1000
SHARE = 8_000  # about seven of those messages (each row: the text, ids, the sender's DID)


async def test_a_peer_past_its_share_waits_and_others_do_not(tmp_path: Path) -> None:
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b", inbox_share=SHARE))
    c = await started(*make_home(tmp_path, "c"))
    try:
        async with asyncio.timeout(60):
            await link(a, b)
            await link(c, b)
            for i in range(20):
                await a.send_message(b.did, f"{i} {TEXT}")
            await until(lambda: b.metrics.counters.get("messages_over_share", 0) > 0, 20, "share")
            held = [e.text for e in b.inbox(limit=100)]
            assert 0 < len(held) < 20 and held == [f"{i} {TEXT}" for i in range(len(held))]
            assert b._peers[a.did].inbox_bytes <= SHARE
            # A hears why (as for a full store) and keeps the rest queued.
            await until(lambda: a._peers[b.did].deferred is not None, 20, "A told")
            # Another peer's message is taken meanwhile.
            await c.send_message(b.did, "from c", wait=True, timeout=20)
            assert b.inbox(limit=100)[-1].text == "from c"
            last = b.inbox(limit=100)[-1].n
            assert await b.prune_inbox(last) == len(held) + 1 and b.inbox(limit=100) == []
            # The share is free again: A's waiting messages arrive, in order, once each
            # (pruned as they come, to make room for the next ones).
            texts = held
            while len(texts) < 20:
                batch = b.inbox(limit=100)
                if batch:
                    texts = texts + [e.text for e in batch]
                    await b.prune_inbox(batch[-1].n)
                await asyncio.sleep(0.05)
            assert texts == [f"{i} {TEXT}" for i in range(20)]
            # Past the last message is refused (it would delete unseen arrivals), and
            # numbering goes on after an emptied inbox: n never repeats.
            with pytest.raises(UsageError, match="past the last message"):
                await b.prune_inbox(2**63)
            await a.send_message(b.did, "after", wait=True, timeout=20)
            assert b.inbox(limit=100)[0].n > last
    finally:
        for node in (a, b, c):
            await node.stop()


def test_prune_frees_each_senders_bytes_and_keeps_the_numbering(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    try:
        with store.write() as txn:
            for n, who in enumerate(["did:x", "did:y", "did:x"], start=1):
                row = pl.encode_inbox(bytes(16), who, n, 0, "hello")
                txn.put("inbox", pl.inbox_key(n), row)
                key = pl.meta_inbox_bytes(who)
                pl.put_u64(txn, "meta", key, pl.get_u64(txn, "meta", key) + len(row))
        size = len(pl.encode_inbox(bytes(16), "did:x", 1, 0, "hello"))
        with store.write() as txn:
            assert pl.prune_inbox(txn, through=2, limit=1) == (1, {"did:x": size}, 1)
        with store.write() as txn:
            assert pl.prune_inbox(txn, through=2, limit=10) == (1, {"did:y": size}, 2)
            assert pl.prune_inbox(txn, through=2, limit=10) == (0, {}, 2)
        with store.read() as txn:
            assert pl.get_u64(txn, "meta", pl.meta_inbox_bytes("did:x")) == size
            assert pl.get_u64(txn, "meta", pl.meta_inbox_bytes("did:y")) == 0
            assert pl.last_inbox_n(txn) == 3
        with store.write() as txn:
            assert pl.prune_inbox(txn, through=3, limit=10) == (1, {"did:x": size}, 3)
        with store.read() as txn:
            assert pl.last_inbox_n(txn) == 3  # empty: numbering goes on from the last pruned
    finally:
        store.close()


async def test_a_share_read_while_a_prune_commits_is_not_taken_off_twice(
    tmp_path: Path,
) -> None:
    """The peer's share is read from the store after a prune chunk committed and before
    the node heard back from that commit: the chunk's bytes are off already, and must
    not come off again (the share would then let the peer store more than it may)."""
    a = await started(*make_home(tmp_path, "a"))
    home_b, config_b = make_home(tmp_path, "b")
    b = await started(home_b, config_b)
    try:
        async with asyncio.timeout(60):
            await link(a, b)
            for i in range(3):
                await a.send_message(b.did, f"{i} {TEXT}", wait=True)
            await b.stop()  # a fresh run: a's share is read from the store when needed
            b = await started(home_b, config_b)
            first = b.inbox()[0].n
            pruning = asyncio.ensure_future(b.prune_inbox(first))
            await asyncio.sleep(0)  # the prune's write is submitted to the writer thread
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # the loop is held: its answer waits
                with b.store.read() as txn:
                    if pl.get_u64(txn, "meta", pl.META_INBOX_PRUNED) >= first:
                        break
                time.sleep(0.001)
            b.start_send(a.did, "loads a's share now", lambda msg_id, exc: None)
            assert await pruning == 1
            with b.store.read() as txn:
                stored = pl.get_u64(txn, "meta", pl.meta_inbox_bytes(a.did))
            assert stored > 0 and b.peer_state(a.did).inbox_bytes == stored
    finally:
        await a.stop()
        await b.stop()


async def test_a_store_without_counts_is_counted_at_the_first_start(tmp_path: Path) -> None:
    """Rows stored before the counts were kept (here: written with none) are counted once,
    when a node first starts on the store; later starts keep the running counts."""
    home, config = make_home(tmp_path, "a")
    with Store(home / "store") as store, store.write() as txn:
        for n, who in enumerate("xyx", start=1):
            txn.put("inbox", pl.inbox_key(n), pl.encode_inbox(bytes(16), f"did:{who}", n, 0, "hi"))
    size = len(pl.encode_inbox(bytes(16), "did:x", 1, 0, "hi"))
    for _ in range(2):  # the second start finds the marker and counts nothing again
        node = await started(home, config)
        try:
            with node.store.read() as txn:
                assert pl.get_u64(txn, "meta", pl.meta_inbox_bytes("did:x")) == 2 * size
                assert pl.get_u64(txn, "meta", pl.meta_inbox_bytes("did:y")) == size
                assert not pl.count_inbox_shares(txn)  # counted already
        finally:
            await node.stop()
