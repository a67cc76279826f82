"""The outbox rows of ``send --wait`` (docs/adr/0007-epoch-sequence-numbers.md, point 4).

When every row waiting for a commit is a waiting send whose frame left, the
commit waits (``WRITE_DELAY``) for the acks: the callers hear back at the
ack, and the one transaction writes only the messages' numbers. Anything else
(a plain send, a failed wait, the node's stop) commits what waits at once and
in order. Real nodes, real LMDB, real sockets on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from talos import node_delivery
from talos import pipeline as pl
from talos.store import Store
from talos_sdk.errors import StorageFullError, UsageError
from tests.talos.nodes import link, make_home, started, until

#: Longer than any test here: nothing is written by the timer unless a test waits for it.
LONG = 60.0


@pytest.fixture
def b_gate() -> Iterator[threading.Event]:
    """B's receive commits (hence its acks) wait on this; always released at the end."""
    event = threading.Event()
    yield event
    event.set()


def rows(store: Store, did: str) -> list[str]:
    with store.read() as txn:
        return [r.text for r in pl.iter_outbox(txn, did)]


def last_assigned(store: Store, did: str) -> int:
    with store.read() as txn:
        return pl.get_u64(txn, "meta", pl.meta_out(did))


async def test_acked_waiting_sends_share_one_commit_of_their_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_delivery, "WRITE_DELAY", LONG)
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    try:
        async with asyncio.timeout(30):
            await link(a, b)
            await a.send_message(b.did, "warm", wait=True)  # the link's first send may queue
            a.flush_outbox_now()
            await a.writer.drain()
            commits: list[int] = []
            a.writer.before("outbox", lambda kind, size: commits.append(size))
            for i in range(5):  # each caller hears back at its ack, before any commit
                await a.send_message(b.did, f"w{i}", wait=True)
            assert commits == []
            assert [e.text for e in b.inbox()] == ["warm"] + [f"w{i}" for i in range(5)]
            a.flush_outbox_now()
            await until(lambda: commits == [5], what="one commit for the five rows")
            await a.writer.drain()
            # Acked before their commit: no row, only the last number (the next prev).
            assert rows(a.store, b.did) == []
            assert last_assigned(a.store, b.did) == b.inbox()[-1].seq
    finally:
        await a.stop()
        await b.stop()


async def test_a_plain_send_commits_the_waiting_rows_before_it_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, b_gate: threading.Event
) -> None:
    monkeypatch.setattr(node_delivery, "WRITE_DELAY", LONG)
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    try:
        async with asyncio.timeout(30):
            await link(a, b)
            b.writer.before("receive", lambda kind, size: b_gate.wait(20))
            waits = [asyncio.create_task(a.send_message(b.did, f"w{i}", wait=True)) for i in (1, 2)]
            await until(lambda: a.peer_state(b.did).tx.sent > 0, what="the waiting frames sent")
            assert rows(a.store, b.did) == []  # no ack yet: the rows still wait
            await a.send_message(b.did, "plain")  # returns once its row is durable
            assert rows(a.store, b.did) == ["w1", "w2", "plain"]
            b_gate.set()
            await asyncio.gather(*waits)  # the waiting callers hear back at the acks
            await until(lambda: len(b.inbox()) == 3, what="all three delivered")
            assert [e.text for e in b.inbox()] == ["w1", "w2", "plain"]
    finally:
        await a.stop()
        await b.stop()


async def test_a_wait_that_times_out_commits_and_syncs_its_row_first(
    tmp_path: Path, b_gate: threading.Event
) -> None:
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    try:
        async with asyncio.timeout(30):
            await link(a, b)
            b.writer.before("receive", lambda kind, size: b_gate.wait(20))
            order: list[str] = []
            a.writer.before("outbox", lambda kind, size: order.append(kind))
            a.writer.before("sync", lambda kind, size: order.append(kind))
            with pytest.raises(TimeoutError):  # the frame left; B's ack never comes
                await a.send_message(b.did, "slow", wait=True, timeout=0.3)
            b_gate.set()
            # "The message stays queued" holds after a crash: committed, then synced.
            assert order == ["outbox", "sync"]
            assert rows(a.store, b.did) == ["slow"]
    finally:
        await a.stop()
        await b.stop()


async def test_the_nodes_stop_commits_the_rows_still_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, b_gate: threading.Event
) -> None:
    monkeypatch.setattr(node_delivery, "WRITE_DELAY", LONG)
    home_a, cfg_a = make_home(tmp_path, "a")
    a = await started(home_a, cfg_a)
    b = await started(*make_home(tmp_path, "b"))
    try:
        async with asyncio.timeout(30):
            await link(a, b)
            b.writer.before("receive", lambda kind, size: b_gate.wait(20))
            task = asyncio.create_task(a.send_message(b.did, "in flight", wait=True))
            await until(lambda: a.peer_state(b.did).tx.sent > 0, what="the frame sent")
            await a.stop()
            with pytest.raises(UsageError, match="stays queued"):
                await task
            with Store(home_a / "store", map_size=cfg_a.map_size) as store:
                assert rows(store, b.did) == ["in flight"]  # resent by the next run
    finally:
        b_gate.set()
        await a.stop()
        await b.stop()


async def test_a_failed_outbox_commit_leaves_no_hole_before_the_next_message(
    tmp_path: Path,
) -> None:
    """The failed row is not sent again and its successor names its prev: the peer,
    offline meanwhile, takes the later message instead of waiting for ever."""
    home_b, cfg_b = make_home(tmp_path, "b")
    a = await started(*make_home(tmp_path, "a"))
    b = await started(home_b, cfg_b)
    b2 = None
    try:
        async with asyncio.timeout(30):
            await link(a, b)
            await a.send_message(b.did, "m0", wait=True)
            await b.stop()
            await until(lambda: not a.peer_state(b.did).ready.is_set(), what="the link down")
            failures = [StorageFullError("injected: the map is full")]

            def fail_once(kind: str, size: int) -> None:
                if failures:
                    raise failures.pop()

            a.writer.before("outbox", fail_once)
            with pytest.raises(StorageFullError):
                await a.send_message(b.did, "k1")  # no id: the caller knows it failed
            await a.send_message(b.did, "k2")  # durably queued
            assert rows(a.store, b.did) == ["k2"]
            b2 = await started(home_b, cfg_b)
            await link(a, b2)
            await until(lambda: len(b2.inbox()) == 2, what="k2 delivered")
            assert [e.text for e in b2.inbox()] == ["m0", "k2"]
            await until(lambda: rows(a.store, b2.did) == [], what="k2 acked")
            assert b2.metrics.counters.get("messages_gap", 0) == 0
    finally:
        await a.stop()
        if b2 is not None:
            await b2.stop()


async def test_stop_commits_the_rows_queued_behind_an_outbox_commit_in_flight(
    tmp_path: Path, b_gate: threading.Event
) -> None:
    home_a, cfg_a = make_home(tmp_path, "a")
    a = await started(home_a, cfg_a)
    b = await started(*make_home(tmp_path, "b"))
    try:
        async with asyncio.timeout(30):
            await link(a, b)
            b.writer.before("receive", lambda kind, size: b_gate.wait(20))
            a_gate = threading.Event()
            a.writer.before("outbox", lambda kind, size: a_gate.wait(20))
            first = asyncio.create_task(a.send_message(b.did, "first"))
            await until(lambda: a._outbox_busy, what="the first commit held")
            behind = asyncio.create_task(a.send_message(b.did, "behind", wait=True))
            await until(lambda: len(a._outgoing) == 1, what="a row queued behind that commit")
            stopping = asyncio.create_task(a.stop())
            await asyncio.sleep(0.05)
            a_gate.set()
            await stopping
            await first  # its row was durable before the stop went on
            with pytest.raises(UsageError, match="stays queued"):
                await behind
            with Store(home_a / "store", map_size=cfg_a.map_size) as store:
                assert rows(store, b.did) == ["first", "behind"]
    finally:
        b_gate.set()
        await a.stop()
        await b.stop()


async def test_a_wait_without_timeout_ends_at_the_nodes_stop_with_its_row_queued(
    tmp_path: Path, b_gate: threading.Event
) -> None:
    home_a, cfg_a = make_home(tmp_path, "a")
    a = await started(home_a, cfg_a)
    b = await started(*make_home(tmp_path, "b"))
    try:
        async with asyncio.timeout(30):
            await link(a, b)
            b.writer.before("receive", lambda kind, size: b_gate.wait(20))
            task = asyncio.create_task(a.send_message(b.did, "never acked", wait=True))
            await until(lambda: bool(a.peer_state(b.did).tx.waiters), what="the caller waiting")
            await a.stop()
            with pytest.raises(UsageError, match="stays queued"):
                await task
            with Store(home_a / "store", map_size=cfg_a.map_size) as store:
                assert rows(store, b.did) == ["never acked"]
    finally:
        b_gate.set()
        await a.stop()
        await b.stop()


async def test_a_timed_out_wait_stops_waiting_for_the_ack(tmp_path: Path) -> None:
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    try:
        async with asyncio.timeout(30):
            await link(a, b)
            await b.stop()  # no ack will come
            with pytest.raises(TimeoutError):
                await a.send_message(b.did, "late", wait=True, timeout=0.2)
            assert a.peer_state(b.did).tx.waiters == {}  # nothing holds the send any more
    finally:
        await a.stop()
