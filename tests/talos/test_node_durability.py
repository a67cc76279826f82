"""Crash cases of the overlapped send path (docs/adr/0007-epoch-sequence-numbers.md),
sender-side log records, and signed heads between linked nodes.

A crash is reproduced in process: one node's writer thread is held at a chosen
write, the node's home is copied (what a power cut leaves on disk: the last
committed LMDB state, the ``running`` marker), and a new node runs from the copy.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from talos import node as node_mod
from talos import writer as writer_module
from talos.chain import heads as hd
from talos.chain.block import head_signing_bytes, head_statement
from talos.chain.log import block_key
from talos.chain.verify import verify_chain
from talos.config import NodeConfig
from talos.link import wire
from talos.link.refusals import DEFER_WHY
from talos.node import Node
from talos.store import Store
from talos.views import outbox_json
from talos.writer import StoreWriter
from talos_sdk.errors import StorageFullError
from talos_sdk.wallet import Wallet
from tests.talos.nodes import addr, link, make_home, started, until


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Held writes wait on this; always released so no writer thread outlives a test."""
    event = threading.Event()
    yield event
    event.set()


def held(gate: threading.Event) -> Callable[[str, int], None]:
    """A StoreWriter hook that holds every write of its kind until ``gate`` is set."""

    def hook(kind: str, size: int) -> None:
        assert gate.wait(20), f"held {kind} write never released"

    return hook


def writer(node: Node) -> StoreWriter:
    return node.writer


def crash_copy(home: Path, to: Path) -> None:
    """The home as a crash would leave it: committed LMDB pages only, no lock files."""
    shutil.copytree(
        home,
        to,
        ignore=shutil.ignore_patterns("lock.mdb", "talos.lock", "node.json", "talosd.sock"),
    )


def outbox(node: Node) -> int:
    with node.store.read() as txn:
        return txn.count("outbox")


async def test_sender_crash_after_transmit_before_outbox_commit(
    tmp_path: Path, gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    home_a, cfg_a = make_home(tmp_path, "a")
    b = await started(*make_home(tmp_path, "b"))
    a = await started(home_a, cfg_a)
    try:
        async with asyncio.timeout(30):
            await link(a, b)
            # A's writer stalls at the ack txn of m1: m1 stays in A's durable outbox.
            writer(a).before("ack", held(gate))
            # B's commit (hence its ack) waits until m1's outbox row is durable at A;
            # an earlier ack would rightly keep the row from ever being written.
            b_gate = threading.Event()
            writer(b).before("receive", held(b_gate))
            try:
                sent = asyncio.create_task(a.send_message(b.did, "m1"))
                await until(lambda: outbox(a) == 1, what="m1 in A's outbox")
            finally:
                b_gate.set()
            await sent
            await until(lambda: a.peer_state(b.did).tx.acked > 0, what="m1 acked")
            # "lost" leaves A before its outbox row commits (it queues behind the stall):
            # B commits it, the caller never hears back, A's disk never has it.
            lost = asyncio.create_task(a.send_message(b.did, "lost"))
            await until(lambda: len(b.inbox()) == 2, what="lost delivered")
            crash_copy(home_a, tmp_path / "a2")
            gate.set()
            await lost
            await a.stop()

            a2 = await started(tmp_path / "a2", cfg_a)
            try:
                assert a2.unclean_start and a2.epoch == 2
                with a2.store.read() as txn:
                    assert [r.text for r in node_mod.pl.iter_outbox(txn, b.did)] == ["m1"]
                await a2.add_peer(addr(b))
                await a2.wait_connected(b.did, 10)
                # m1 is resent as (1, 1): a duplicate for B, whose ack (1, 2) is from
                # A's old epoch and above anything A2 sent, yet accepted (ADR 0007).
                await until(lambda: outbox(a2) == 0, what="m1 acked by the old-epoch ack")
                await a2.send_message(b.did, "m3", wait=True)
                assert [e.text for e in b.inbox()] == ["m1", "lost", "m3"]
                assert b.inbox()[-1].seq == node_mod.pl.make_seq(2, 1)
                assert a2.metrics.counters.get("frames_rejected", 0) == 0
            finally:
                await a2.stop()
    finally:
        await b.stop()


async def test_receiver_crash_before_commit_gets_the_resend(
    tmp_path: Path, gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    home_b, cfg_b = make_home(tmp_path, "b")
    a = await started(*make_home(tmp_path, "a"))
    b = await started(home_b, cfg_b)
    try:
        async with asyncio.timeout(30):
            await link(a, b)
            await a.send_message(b.did, "before", wait=True)
            writer(b).before("receive", held(gate))
            # Without --wait, send returns once A's own outbox commit is durable.
            msg_id = await a.send_message(b.did, "in flight")
            with a.store.read() as txn:
                texts = [r.text for r in node_mod.pl.iter_outbox(txn, b.did)]
            assert texts[-1] == "in flight"
            rx = b.peer_state(a.did).rx
            await until(lambda: rx.accepted > rx.delivered, what="B opened it, commit held")
            crash_copy(home_b, tmp_path / "b2")
            port = b.listen_url.rsplit(":", 1)[1]  # type: ignore[union-attr]
            # B goes away before its held commit can finish and be acked.
            stopping = asyncio.create_task(b.stop())
            await until(lambda: not a.is_connected(b.did), what="link down")
            gate.set()
            await stopping

            cfg = cfg_b.model_copy(update={"listen": f"127.0.0.1:{port}"})
            b2 = await started(tmp_path / "b2", cfg)
            b2.allow(a.did)
            try:
                assert b2.unclean_start
                assert [e.text for e in b2.inbox()] == ["before"]
                await until(lambda: outbox(a) == 0, timeout=20, what="resend acked by B2")
                entries = b2.inbox()
                assert [e.text for e in entries] == ["before", "in flight"]
                assert entries[-1].msg_id.hex() == msg_id
            finally:
                await b2.stop()
    finally:
        await a.stop()


async def test_sender_logs_its_own_record_of_each_acked_message(tmp_path: Path) -> None:
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    try:
        async with asyncio.timeout(30):
            await link(a, b)
            msg_id = await a.send_message(b.did, "logged on both sides", wait=True)
            await until(lambda: a.log.pending_count >= 1, what="A's record appended")
            await until(lambda: b.log.pending_count >= 1, what="B's record appended")
            await asyncio.to_thread(a.log.seal)
            await asyncio.to_thread(b.log.seal)
            # Sealed by the call above or by the node's own sealer running meanwhile,
            # whose seal may still be finishing: waited for, not read at once (CI
            # once read it in between).
            rid = bytes.fromhex(msg_id)
            await until(
                lambda: a.log.find_record(rid) is not None and b.log.find_record(rid) is not None,
                what="both records sealed",
            )
            found_a = a.log.find_record(rid)
            found_b = b.log.find_record(rid)
            assert found_a is not None and found_b is not None
            rec_a, rec_b = found_a[2], found_b[2]
            assert (rec_a.kind, rec_a.sender, rec_a.recipient) == ("msg", a.did, b.did)
            assert rec_a.commitment == rec_b.commitment
            assert rec_a.signature == rec_b.signature
            for node in (a, b):
                report = await asyncio.to_thread(verify_chain, node.store, node.did)
                assert report.ok and report.records >= 1
    finally:
        await a.stop()
        await b.stop()


def _forged_head(wallet: Wallet, height: int, block_hash: bytes) -> bytes:
    sig = wallet.sign(head_signing_bytes(wallet.did, height, block_hash, 1))
    return hd.encode_head(head_statement(wallet.did, height, block_hash, 1, sig))


def _heads_config(root: Path, name: str) -> tuple[Path, NodeConfig]:
    return make_home(root, name, head_interval=0.05)


async def test_signed_heads_are_kept_and_a_rewritten_log_is_flagged(tmp_path: Path) -> None:
    home_a, cfg_a = _heads_config(tmp_path, "a")
    a = await started(home_a, cfg_a)
    b = await started(*_heads_config(tmp_path, "b"))
    try:
        async with asyncio.timeout(30):
            await link(a, b)
            await a.send_message(b.did, "one", wait=True)
            await until(lambda: a.log.pending_count >= 1, what="A's record")
            (block,) = await asyncio.to_thread(a.log.seal)
            await until(lambda: a.did in b.heads.peer_heads(), what="A's head kept by B")
            assert b.heads.peer_heads()[a.did]["hash"] == block.hash().hex()
            assert b.heads.equivocations() == []
            await a.stop()
            # A quietly rewrites history: drops its sealed block and seals another one
            # at the same height.
            with Store(home_a / "store") as store, store.write() as txn:
                txn.delete("blocks", block_key(0))
            a = await started(home_a, cfg_a)
            await a.wait_connected(b.did, 10)
            await a.send_message(b.did, "two", wait=True)
            await until(lambda: a.log.pending_count >= 1, what="A's new record")
            (again,) = await asyncio.to_thread(a.log.seal)
            assert again.height == block.height and again.hash() != block.hash()
            await until(lambda: len(b.heads.equivocations()) == 1, what="equivocation recorded")
            (alert,) = b.status()["equivocations"]
            assert alert["node"] == a.did
            assert alert["reason"] == "same height, different block hash"
            assert alert["presented"]["hash"] == again.hash().hex()
            assert b.heads.peer_heads()[a.did]["hash"] == block.hash().hex()  # the first one stays
            # Counted once the writer's commit is back on the loop, just after the row
            # can be read: waited for, not read at once (CI caught it in between).
            counters = b.metrics.counters
            await until(lambda: counters.get("head_equivocations") == 1, what="counted")
    finally:
        await a.stop()
        await b.stop()


async def test_forged_and_lower_heads(tmp_path: Path) -> None:
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    try:
        async with asyncio.timeout(30):
            await link(a, b)
            await a.send_app(b.did, hd.HEAD_CHANNEL, _forged_head(a.wallet, 5, b"\x05" * 32))
            await until(lambda: a.did in b.heads.peer_heads(), what="head 5 kept")
            # Signed by someone else: the frame is rejected, nothing is kept or flagged.
            other = Wallet.generate()
            await a.send_app(b.did, hd.HEAD_CHANNEL, _forged_head(other, 9, b"\x09" * 32))
            await until(
                lambda: b.metrics.counters.get("frames_rejected", 0) == 1, what="forgery refused"
            )
            assert b.heads.peer_heads()[a.did]["height"] == 5
            # A signed head below one A already signed: history was cut back.
            await a.send_app(b.did, hd.HEAD_CHANNEL, _forged_head(a.wallet, 3, b"\x03" * 32))
            await until(lambda: len(b.heads.equivocations()) == 1, what="lower head flagged")
            assert b.heads.equivocations()[0]["reason"] == "height below one already signed"
            assert b.heads.peer_heads()[a.did]["height"] == 5
    finally:
        await a.stop()
        await b.stop()


async def test_failed_receive_commit_does_not_ack_the_frames_queued_behind_it(
    tmp_path: Path, gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """M0's commit fails while m1..m4 wait; none of them may be acked."""
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    calls: list[int] = []

    def first_fails(kind: str, size: int) -> None:
        calls.append(size)
        if len(calls) == 1:
            assert gate.wait(20), "held write never released"
            raise StorageFullError("injected: map full")

    try:
        async with asyncio.timeout(30):
            await link(a, b)
            writer(b).before("receive", first_fails)
            sends = [asyncio.create_task(a.send_message(b.did, f"m{i}")) for i in range(5)]
            # m0 is alone in the held commit; m1..m4 are accepted into the next batch.
            await until(
                lambda: b.status()["queues"]["incoming_batch"] == 4,
                what="m1..m4 queued behind m0",
            )
            gate.set()
            await asyncio.gather(*sends)
            await until(lambda: b.metrics.counters.get("commit_failures") == 1, what="failure")
            await a.send_message(b.did, "end", wait=True)
            assert [e.text for e in b.inbox()] == [f"m{i}" for i in range(5)] + ["end"]
            assert calls[0] == 1
            assert b.metrics.counters["commit_failures"] == 1
            assert b.metrics.counters["messages_dropped_after_failure"] == 4
            await until(lambda: outbox(a) == 0, what="A drops the acked rows")
    finally:
        await a.stop()
        await b.stop()


async def test_heads_are_judged_off_the_read_loop(
    tmp_path: Path, gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head's store write never holds up the frames behind it."""
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    got: list[bytes] = []
    b.register_app("echo", lambda peer, payload: got.append(payload))
    try:
        async with asyncio.timeout(30):
            await link(a, b)
            writer(b).before("head", held(gate))
            await a.send_app(b.did, hd.HEAD_CHANNEL, _forged_head(a.wallet, 5, b"\x05" * 32))
            await a.send_app(b.did, "echo", b"behind the head")
            await until(lambda: got == [b"behind the head"], what="frame past a held head write")
            assert b.heads.peer_heads() == {}  # the head write is still held
            gate.set()
            await until(lambda: a.did in b.heads.peer_heads(), what="head kept")
    finally:
        await a.stop()
        await b.stop()


def test_equivocation_rows_per_peer_are_capped(tmp_path: Path) -> None:
    """A peer sending conflicting heads forever fills one count, not the disk."""
    did = Wallet.generate().did

    def head(height: int, tag: int) -> hd.PeerHead:
        statement: dict[str, Any] = {"node": did, "height": height, "hash": f"{tag:064x}"}
        return hd.PeerHead(did, height, statement["hash"], statement)

    with Store(tmp_path / "s", map_size=1 << 22) as store:
        with store.write() as txn:
            assert hd.judge_and_store(txn, did, head(5, 0)) is None
            for i in range(1, hd.MAX_EQUIVOCATIONS_KEPT + 5):
                assert hd.judge_and_store(txn, did, head(5, i)) is not None
        with store.read() as txn:
            prefix = hd.equiv_prefix(did)
            rows = [k for k, _ in txn.items("meta", prefix) if k.startswith(prefix)]
            count = txn.get("meta", hd.equiv_count_key(did))
        assert len(rows) == hd.MAX_EQUIVOCATIONS_KEPT
        assert count is not None and int.from_bytes(count, "big") == hd.MAX_EQUIVOCATIONS_KEPT + 4


async def test_a_receiver_that_cannot_store_tells_its_sender_which_says_why(
    tmp_path: Path,
) -> None:
    """B's store is full: B sends DEFER, A's outbox says why no ack comes; the resend
    after B recovers is acked, and A's outbox says nothing more."""
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    full = True

    def while_full(kind: str, size: int) -> None:
        if full:
            raise StorageFullError("injected: map full")

    try:
        async with asyncio.timeout(30):
            await link(a, b)
            writer(b).before("receive", while_full)
            await a.send_message(b.did, "kept")
            await until(lambda: a.link_state(b.did)[1] != "", what="A to hear B's DEFER")
            assert a.link_state(b.did) == ("ready", DEFER_WHY[wire.DEFER_FULL])
            (row,) = outbox_json(a)
            assert row["why"] == DEFER_WHY[wire.DEFER_FULL]
            assert a.metrics.counters["defers_received"] >= 1
            full = False  # B's operator made room: A's next resend is stored and acked
            await until(lambda: outbox(a) == 0, what="the resend to be acked")
            assert a.link_state(b.did) == ("ready", "")
            assert [e.text for e in b.inbox()] == ["kept"]
    finally:
        await a.stop()
        await b.stop()


async def test_a_lone_message_commits_on_the_loop_and_a_burst_still_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ADR 0017: one message at a time, B's receive commit and A's deferred writes run
    on their loops (no thread hand-offs); many in flight, the writer thread still
    commits them in groups."""
    # The rule under test, not the slow-disk back-off (test_writer.py has its own
    # test): a loaded machine's fsync must not switch the loop commits off.
    monkeypatch.setattr(writer_module, "HERE_SLOW", 60.0)
    a_home, a_cfg = make_home(tmp_path, "a")
    b_home, b_cfg = make_home(tmp_path, "b")
    a, b = await started(a_home, a_cfg), await started(b_home, b_cfg)
    try:
        await link(a, b)
        here0, sender0 = b.writer.here_runs, a.writer.here_runs
        for i in range(5):
            # A quiet spell before each (longer than any commit here), as between an
            # agent's messages; the writer may still be sealing or flushing at times.
            await asyncio.sleep(0.2)
            await a.send_message(b.did, f"one {i}", wait=True)
        assert b.writer.here_runs > here0
        assert b.metrics.counters.get("commits_on_loop", 0) == b.writer.here_runs - here0
        # A's deferred writes (the waiting sends' rows and their acks) went on its loop too.
        await until(lambda: a.writer.here_runs > sender0, what="A's deferred writes on its loop")
        # The last ack's write may still wait its WRITE_DELAY (ADR 0007) behind that one.
        await until(lambda: outbox(a) == 0, what="A's acked rows deleted")
        commits0, here1 = b.metrics.counters.get("commits", 0), b.writer.here_runs
        await asyncio.gather(*(a.send_message(b.did, f"many {i}", wait=True) for i in range(200)))
        commits = b.metrics.counters.get("commits", 0) - commits0
        # The burst's frames found more of their link's frames queued behind them, or
        # a commit running: the thread committed them in groups (a straggler at the
        # end may still find the node quiet).
        assert commits < 200 and b.writer.here_runs - here1 <= 2
        texts = [m.text for m in b.inbox(limit=300)]
        assert texts == [f"one {i}" for i in range(5)] + [f"many {i}" for i in range(200)]
    finally:
        await a.stop()
        await b.stop()
