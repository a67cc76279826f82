"""The outbox rows of ``send --wait`` (docs/adr/0007-epoch-sequence-numbers.md, point 4).

When every row waiting for a commit is a waiting send whose frame left, the
commit waits (``WRITE_DELAY``) for the acks: the callers hear back at the
ack, and the one transaction writes only the messages' numbers. Anything else
(a plain send, a failed wait, the node's stop) commits what waits at once and
in order. Real nodes, real LMDB, real sockets on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from talos import node_delivery
from talos import pipeline as pl
from talos.config import NodeConfig
from talos.node import Node
from talos.store import Store
from talos_sdk.errors import StorageFullError, UsageError
from tests.talos.nodes import link, make_home, started, until

#: Longer than any test here: nothing is written by the timer unless a test waits for it.
LONG = 60.0


@dataclass
class Pair:
    a: Node
    b: Node
    home_a: Path
    cfg_a: NodeConfig
    b_gate: threading.Event  # set: B commits what it receives (hence acks)

    def hold_b(self) -> None:
        """From now on B's receive commits, hence its acks, wait for ``b_gate``."""
        self.b_gate.clear()
        self.b.writer.before("receive", lambda kind, size: self.b_gate.wait(20))

    def rows(self, store: Store | None = None) -> list[str]:
        """A's outbox rows for B (``store``: A's store reopened after its stop)."""
        with (store or self.a.store).read() as txn:
            return [r.text for r in pl.iter_outbox(txn, self.b.did)]

    def stored_rows(self) -> list[str]:
        with Store(self.home_a / "store", map_size=self.cfg_a.map_size) as store:
            return self.rows(store)


@contextlib.asynccontextmanager
async def linked(tmp_path: Path) -> AsyncIterator[Pair]:
    """A linked to B, both stopped at the end (B's held commits released first)."""
    home_a, cfg_a = make_home(tmp_path, "a")
    a = await started(home_a, cfg_a)
    b = await started(*make_home(tmp_path, "b"))
    pair = Pair(a, b, home_a, cfg_a, threading.Event())
    pair.b_gate.set()
    try:
        async with asyncio.timeout(30):
            await link(a, b)
            yield pair
    finally:
        pair.b_gate.set()
        await a.stop()
        await b.stop()


async def test_acked_waiting_sends_share_one_commit_of_their_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_delivery, "WRITE_DELAY", LONG)
    async with linked(tmp_path) as p:
        a, b = p.a, p.b
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
        assert p.rows() == []
        with a.store.read() as txn:
            assert pl.get_u64(txn, "meta", pl.meta_out(b.did)) == b.inbox()[-1].seq


async def test_a_plain_send_commits_the_waiting_rows_before_it_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_delivery, "WRITE_DELAY", LONG)
    async with linked(tmp_path) as p:
        a, b = p.a, p.b
        p.hold_b()
        waits = [asyncio.create_task(a.send_message(b.did, f"w{i}", wait=True)) for i in (1, 2)]
        await until(lambda: a.peer_state(b.did).tx.sent > 0, what="the waiting frames sent")
        assert p.rows() == []  # no ack yet: the rows still wait
        await a.send_message(b.did, "plain")  # returns once its row is durable
        assert p.rows() == ["w1", "w2", "plain"]
        p.b_gate.set()
        await asyncio.gather(*waits)  # the waiting callers hear back at the acks
        await until(lambda: len(b.inbox()) == 3, what="all three delivered")
        assert [e.text for e in b.inbox()] == ["w1", "w2", "plain"]


async def test_a_wait_that_times_out_commits_and_syncs_its_row_first(tmp_path: Path) -> None:
    async with linked(tmp_path) as p:
        p.hold_b()
        order: list[str] = []
        p.a.writer.before("outbox", lambda kind, size: order.append(kind))
        p.a.writer.before("sync", lambda kind, size: order.append(kind))
        with pytest.raises(TimeoutError):  # the frame left; B's ack never comes
            await p.a.send_message(p.b.did, "slow", wait=True, timeout=0.3)
        # "The message stays queued" holds after a crash: committed, then synced.
        assert order == ["outbox", "sync"]
        assert p.rows() == ["slow"]
        assert p.a.peer_state(p.b.did).tx.waiters == {}  # nothing holds the send any more


async def test_the_nodes_stop_commits_the_waiting_rows_and_ends_their_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_delivery, "WRITE_DELAY", LONG)
    async with linked(tmp_path) as p:
        p.hold_b()
        task = asyncio.create_task(p.a.send_message(p.b.did, "in flight", wait=True))
        await until(lambda: bool(p.a.peer_state(p.b.did).tx.waiters), what="the caller waiting")
        await p.a.stop()
        with pytest.raises(UsageError, match="stays queued"):  # no timeout, yet it ends
            await task
        assert p.stored_rows() == ["in flight"]  # resent by the next run


async def test_stop_commits_the_rows_queued_behind_an_outbox_commit_in_flight(
    tmp_path: Path,
) -> None:
    async with linked(tmp_path) as p:
        a = p.a
        p.hold_b()
        a_gate = threading.Event()
        a.writer.before("outbox", lambda kind, size: a_gate.wait(20))
        first = asyncio.create_task(a.send_message(p.b.did, "first"))
        await until(lambda: a._outbox_busy, what="the first commit held")
        behind = asyncio.create_task(a.send_message(p.b.did, "behind", wait=True))
        await until(lambda: len(a._outgoing) == 1, what="a row queued behind that commit")
        stopping = asyncio.create_task(a.stop())
        await asyncio.sleep(0.05)
        a_gate.set()
        await stopping
        await first  # its row was durable before the stop went on
        with pytest.raises(UsageError, match="stays queued"):
            await behind
        assert p.stored_rows() == ["first", "behind"]


async def test_a_failed_outbox_commit_leaves_no_hole_before_the_next_message(
    tmp_path: Path,
) -> None:
    """The failed row is not sent again and its successor names its prev: the peer,
    offline meanwhile, takes the later message instead of waiting for ever."""
    async with linked(tmp_path) as p:
        a, b = p.a, p.b
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
        assert p.rows() == ["k2"]
        b2 = await started(b.home.path, b.config)
        try:
            await link(a, b2)
            await until(lambda: len(b2.inbox()) == 2, what="k2 delivered")
            assert [e.text for e in b2.inbox()] == ["m0", "k2"]
            await until(lambda: p.rows() == [], what="k2 acked")
            assert b2.metrics.counters.get("messages_gap", 0) == 0
        finally:
            await b2.stop()
