"""Messages that never go: dropped by the user (``talosd outbox PEER --drop``,
Node.drop_queued, home.offline_drop) or failed as too large for the peer, and the
message after them (docs/adr/0007-epoch-sequence-numbers.md, "Dropping queued
messages"): real nodes, sockets on 127.0.0.1, LMDB and the CLI in subprocesses."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from talos import pipeline as pl
from talos.config import Home
from talos.home import offline_send
from talos.node import Node
from talos.peer_pipeline import PeerPipeline
from talos.store import Store
from talos.views import outbox_json
from talos_sdk.errors import StorageFullError
from talos_sdk.keyfile import load_wallet
from talos_sdk.wallet import Wallet
from tests.talos.daemons import talosd
from tests.talos.local.running import started as started_daemon
from tests.talos.nodes import addr, link, make_home, started, until


def _queued(store: Store, did: str) -> list[str]:
    with store.read() as txn:
        return [row.text for row in pl.iter_outbox(txn, did)]


async def test_dropped_messages_never_arrive_and_the_next_one_does_after_restarts(
    tmp_path: Path,
) -> None:
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    try:
        async with asyncio.timeout(90):
            await link(a, b)
            await a.send_message(b.did, "first", wait=True)
            await b.stop()
            await a.send_message(b.did, "dropped 1")
            await a.send_message(b.did, "dropped 2")
            waiting = asyncio.ensure_future(a.send_message(b.did, "dropped 3", wait=True))
            await until(lambda: len(_queued(a.store, b.did)) == 3, 10, "three rows queued")
            got = await a.drop_queued(b.did)
            assert got["peer"] == b.did and got["dropped"] == 3
            with pytest.raises(pl.MessageDroppedError, match="dropped from the outbox"):
                await waiting
            assert _queued(a.store, b.did) == [] and outbox_json(a) == []
            # Restarted before anything else is sent: the store alone says what the
            # next message follows.
            await a.stop()
            a = await started(a.home.path, a.config)
            b = await started(b.home.path, b.config)
            await link(a, b)  # b listens on a new port
            await a.send_message(b.did, "after", wait=True)
            assert [m.text for m in b.inbox()] == ["first", "after"]
            await a.send_message(b.did, "and on", wait=True)
            assert [m.text for m in b.inbox()][-1] == "and on"
    finally:
        await a.stop()
        await b.stop()


async def test_a_message_to_a_mistyped_did_is_dropped_and_not_dialled_for(
    tmp_path: Path,
) -> None:
    a = await started(*make_home(tmp_path, "a"))
    nobody = Wallet.generate().did
    try:
        async with asyncio.timeout(30):
            await a.send_message(nobody, "to nobody")
            assert await a.drop_queued(nobody) == {"peer": nobody, "dropped": 1, "sent": 0}
            assert _queued(a.store, nobody) == []
            assert await a.drop_queued(nobody) == {"peer": nobody, "dropped": 0, "sent": 0}
            assert not a.links.dialling(nobody)
            with pytest.raises(ValueError, match="no messages for itself"):
                await a.drop_queued(a.did)
    finally:
        await a.stop()


async def test_the_cli_drops_through_a_running_node_and_says_what_may_have_arrived(
    tmp_path: Path,
) -> None:
    a = await started_daemon(*make_home(tmp_path, "a"))
    nobody = Wallet.generate().did
    home = str(a.home.path)
    try:
        async with asyncio.timeout(60):
            sent = await asyncio.to_thread(talosd, "send", "--home", home, nobody, "typo")
            assert sent.returncode == 0, sent.stderr
            assert f"talosd outbox {nobody} --drop drops it" in sent.stderr
            res = await asyncio.to_thread(talosd, "outbox", "--home", home, nobody, "--drop")
            assert res.returncode == 0, res.stderr
            assert res.stdout == f"dropped 1 message(s) queued for {nobody}\n"
            listed = await asyncio.to_thread(talosd, "outbox", "--home", home, "--json")
            assert listed.returncode == 0 and nobody not in listed.stdout
            bare = await asyncio.to_thread(talosd, "outbox", "--home", home, "--drop")
            assert bare.returncode == 2 and "--drop needs the PEER" in bare.stderr
    finally:
        await a.stop()


async def test_messages_in_flight_when_dropped_are_counted_and_may_still_arrive(
    tmp_path: Path,
) -> None:
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    gate = threading.Event()
    try:
        async with asyncio.timeout(60):
            await link(a, b)
            await a.send_message(b.did, "first", wait=True)
            # b's receive commits, hence its acks, wait: what a sends goes out unacked.
            b.writer.before("receive", lambda kind, size: gate.wait(20))
            for text in ("one", "two"):
                await a.send_message(b.did, text)
            with a.store.read() as txn:
                top = [row.seq for row in pl.iter_outbox(txn, b.did)][-1]
            await until(lambda: _link(a, b.did)["sent"] == top, 10, "both sent")
            assert await a.drop_queued(b.did) == {"peer": b.did, "dropped": 2, "sent": 2}
            gate.set()  # b takes them after all, and acks: that ack moves nothing at a
            await until(lambda: len(b.inbox()) == 3, 10, "b committed them")
            await a.send_message(b.did, "after", wait=True)
            assert [m.text for m in b.inbox()] == ["first", "one", "two", "after"]
    finally:
        gate.set()
        await a.stop()
        await b.stop()


def _link(node: Node, did: str) -> dict[str, Any]:
    return next(row for row in node.status()["links"] if row["did"] == did)


def test_a_stopped_home_drops_its_queue_and_the_next_send_follows_the_acked(
    tmp_path: Path,
) -> None:
    home = tmp_path / "a"
    assert talosd("init", "--home", str(home), "--no-passphrase").returncode == 0
    other = talosd("init", "--home", str(tmp_path / "b"), "--no-passphrase").stdout.strip()
    added = talosd(
        "peers", "add", f"ws://127.0.0.1:9#{other}", "--name", "bob", "--home", str(home)
    )
    assert added.returncode == 0, added.stderr
    for text in ("one", "two"):
        assert talosd("send", "--home", str(home), "bob", text).returncode == 0
    res = talosd("outbox", "bob", "--drop", "--json", "--home", str(home))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"peer": other, "dropped": 2, "sent": None}
    assert talosd("send", "--home", str(home), "bob", "three").returncode == 0
    with Store(home / "store") as store, store.read() as txn:
        (row,) = pl.iter_outbox(txn, other)
        assert row.text == "three" and row.prev == 0  # what the peer holds: nothing yet
    removed = talosd("peers", "remove", "bob", "--home", str(home))
    assert f"(talosd outbox {other} --drop drops them)" in removed.stdout


async def test_after_a_last_message_failed_as_too_large_a_restart_still_delivers(
    tmp_path: Path,
) -> None:
    # The failed row has no successor when it is deleted: the store must say what the
    # next run's first message follows, or the peer waits for the failed one for ever.
    home_a, cfg_a = make_home(tmp_path, "a")
    b = await started(*make_home(tmp_path, "b", max_frame=64 * 1024))
    a_did = load_wallet(home_a / "identity.key").did
    b.allow(a_did)
    offline_send(Home(home_a), b.did, "small")
    offline_send(Home(home_a), b.did, "x" * (pl.text_limit(64 * 1024) + 1))
    a = await started(home_a, cfg_a)
    try:
        async with asyncio.timeout(60):
            await a.add_peer(addr(b))
            await until(lambda: a.status()["queues"]["outbox"] == 0, 20, "sent or failed")
            assert [m.text for m in b.inbox()] == ["small"]
            await a.stop()
            a = await started(home_a, cfg_a)
            await a.add_peer(addr(b))
            await a.send_message(b.did, "next", wait=True)
            assert [m.text for m in b.inbox()] == ["small", "next"]
    finally:
        await a.stop()
        await b.stop()


async def test_a_drop_that_fails_to_commit_drops_nothing(tmp_path: Path) -> None:
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    try:
        async with asyncio.timeout(60):
            await link(a, b)
            await a.send_message(b.did, "first", wait=True)
            await b.stop()
            for text in ("keep 1", "keep 2"):
                await a.send_message(b.did, text)

            def full(kind: str, size: int) -> None:
                raise StorageFullError("map full")

            undo = a.writer.before("drop", full)
            with pytest.raises(StorageFullError):
                await a.drop_queued(b.did)  # the user hears the drop failed ...
            undo()
            assert _queued(a.store, b.did) == ["keep 1", "keep 2"]  # ... and nothing went
            b = await started(b.home.path, b.config)
            await link(a, b)
            await a.send_message(b.did, "later", wait=True)
            assert [m.text for m in b.inbox()] == ["first", "keep 1", "keep 2", "later"]
    finally:
        await a.stop()
        await b.stop()


async def test_a_row_failed_as_too_large_just_before_a_drop_keeps_the_drops_prev(
    tmp_path: Path,
) -> None:
    # The failure's own store write lands after the drop's: it must not replace what
    # the drop said the next message follows with a dropped, undelivered message.
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b", max_frame=64 * 1024))
    b.allow(a.did)
    try:
        async with asyncio.timeout(60):
            await a.send_message(b.did, "small")  # queued: no link yet
            await a.send_message(b.did, "x" * (pl.text_limit(64 * 1024) + 1))
            with a.store.read() as txn:
                big = list(pl.iter_outbox(txn, b.did))[-1]
            peer = a.peer_state(b.did)
            peer.peer_max_frame = 64 * 1024  # as b's offer says once linked
            assert a.prepare_row(peer, big) is None  # failed: its row write is spawned
            await a.drop_queued(b.did)
            await a.stop()
            a = await started(a.home.path, a.config)
            await a.add_peer(addr(b))
            await a.send_message(b.did, "after", wait=True)
            assert [m.text for m in b.inbox()] == ["after"]
    finally:
        await a.stop()
        await b.stop()


async def test_the_drop_waits_for_its_peers_rows_still_committing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A row numbered before the drop but committed after its transaction, by a writer
    # that ran before the drop took effect in memory, came back (and, after a restart,
    # was sent). The drop now starts only once the peer has no row committing.
    a = await started(*make_home(tmp_path, "a"))
    nobody = Wallet.generate().did
    gate = threading.Event()
    seen: list[int] = []
    point = PeerPipeline.drop_point

    def noting(self: PeerPipeline) -> tuple[int, int]:
        seen.append(len(self.fresh))
        return point(self)

    monkeypatch.setattr(PeerPipeline, "drop_point", noting)
    try:
        async with asyncio.timeout(60):
            undo = a.writer.before("outbox", lambda kind, size: gate.wait(20))
            held = asyncio.ensure_future(a.send_message(nobody, "held"))
            await asyncio.sleep(0.1)  # its commit runs, held
            later = asyncio.ensure_future(a.send_message(nobody, "numbered meanwhile"))
            await asyncio.sleep(0.1)  # numbered, waiting for the next commit
            dropping = asyncio.ensure_future(a.drop_queued(nobody))
            await asyncio.sleep(0.1)
            gate.set()
            undo()
            await asyncio.gather(held, later)
            assert (await dropping)["dropped"] == 2
            assert seen == [0] and _queued(a.store, nobody) == []
    finally:
        gate.set()
        await a.stop()


async def test_a_peer_removed_with_a_row_still_committing_never_reuses_its_number(
    tmp_path: Path,
) -> None:
    # The peer's state is rebuilt from the store after `peers remove`: a number handed
    # out whose row was not written yet must not be handed out again (the peer would
    # take the second message for a duplicate of the first).
    a = await started(*make_home(tmp_path, "a"))
    nobody, other = Wallet.generate().did, Wallet.generate().did
    first_gate, second_gate = threading.Event(), threading.Event()
    commits: list[int] = []

    def hold(kind: str, size: int) -> None:
        commits.append(size)
        assert (first_gate if len(commits) == 1 else second_gate).wait(20)

    try:
        async with asyncio.timeout(60):
            undo = a.writer.before("outbox", hold)
            busy = asyncio.ensure_future(a.send_message(other, "to another peer"))
            await asyncio.sleep(0.1)  # that commit runs, held
            m1 = asyncio.ensure_future(a.send_message(nobody, "m1"))
            await asyncio.sleep(0.1)  # numbered; its commit comes after the removal's
            removing = asyncio.ensure_future(a.remove_peer(nobody))
            await asyncio.sleep(0.1)
            first_gate.set()
            await removing  # m1's row is not written yet (its commit is held)
            m2 = asyncio.ensure_future(a.send_message(nobody, "m2"))
            await asyncio.sleep(0.1)
            second_gate.set()
            undo()
            await asyncio.gather(busy, m1, m2)
            with a.store.read() as txn:
                rows = list(pl.iter_outbox(txn, nobody))
            assert [r.text for r in rows] == ["m1", "m2"]
            assert rows[0].seq < rows[1].seq
    finally:
        first_gate.set()
        second_gate.set()
        await a.stop()


async def test_a_peer_removed_after_a_failed_outbox_commit_never_reuses_that_number(
    tmp_path: Path,
) -> None:
    # The failed row's number lives only in memory (its frame may have reached the
    # peer): the state rebuilt after `peers remove` must not hand it out again.
    a = await started(*make_home(tmp_path, "a"))
    nobody = Wallet.generate().did
    try:
        async with asyncio.timeout(60):
            await a.send_message(nobody, "kept")

            def full(kind: str, size: int) -> None:
                raise StorageFullError("map full")

            undo = a.writer.before("outbox", full)
            with pytest.raises(StorageFullError):
                await a.send_message(nobody, "failed")
            undo()
            failed = a.peer_state(nobody).last_assigned
            await a.remove_peer(nobody)
            await a.send_message(nobody, "after")
            with a.store.read() as txn:
                rows = list(pl.iter_outbox(txn, nobody))
            assert [r.text for r in rows] == ["kept", "after"]
            assert rows[1].seq > failed and rows[1].prev == rows[0].seq
    finally:
        await a.stop()


async def test_a_commit_failing_while_a_peer_is_removed_leaves_no_gap(tmp_path: Path) -> None:
    # "lost"'s commit fails after the removal began: what the next message follows is
    # decided once the loop has heard of that failure, not before.
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    gate = threading.Event()
    try:
        async with asyncio.timeout(60):
            await link(a, b)
            await a.send_message(b.did, "kept", wait=True)
            await b.stop()

            def hold_then_fail(kind: str, size: int) -> None:
                gate.wait(20)
                raise StorageFullError("map full")

            undo = a.writer.before("outbox", hold_then_fail)
            lost = asyncio.ensure_future(a.send_message(b.did, "lost"))
            await asyncio.sleep(0.1)
            removing = asyncio.ensure_future(a.remove_peer(b.did))
            await asyncio.sleep(0.2)
            gate.set()
            with pytest.raises(StorageFullError):
                await lost
            undo()
            await removing
            await a.stop()
            a = await started(a.home.path, a.config)
            b = await started(b.home.path, b.config)
            await link(a, b)
            await a.send_message(b.did, "after", wait=True)
            assert [m.text for m in b.inbox()] == ["kept", "after"]
    finally:
        gate.set()
        await a.stop()
        await b.stop()
