"""talos/writer.py: the one writer thread of a node's store, on a real LMDB store."""

from __future__ import annotations

import asyncio
import functools
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from talos.store import Store, Txn
from talos.writer import StoreWriter
from talos_sdk.errors import StorageFullError, UsageError
from tests.talos.nodes import until


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[StoreWriter]:
    store = Store(tmp_path / "s", map_size=1 << 22)
    w = StoreWriter(store)
    yield w
    w.close()
    store.close()


def _rows(w: StoreWriter) -> list[bytes]:
    with w.store.read() as txn:
        return [k for k, _ in txn.items("meta")]


async def test_jobs_commit_in_submission_order_on_one_thread(writer: StoreWriter) -> None:
    threads: set[int] = set()
    order: list[int] = []

    def put(i: int) -> None:
        def job(txn: Txn) -> None:
            threads.add(threading.get_ident())
            order.append(i)
            txn.put("meta", b"k%03d" % i, b"v")

        writer.submit(job, durable=i % 2 == 0)

    for i in range(20):
        put(i)
    await writer.drain()
    assert order == list(range(20)) and len(threads) == 1
    assert threading.get_ident() not in threads
    assert _rows(writer) == [b"k%03d" % i for i in range(20)]


def _put(txn: Txn, key: bytes) -> None:
    txn.put("meta", key, b"")


async def test_jobs_submitted_together_share_one_transaction(writer: StoreWriter) -> None:
    def txnid() -> int:
        return int(writer.store.env.info()["last_txnid"])

    await writer.write(lambda txn: txn.put("meta", b"first", b""))  # the thread is up, idle
    for round_ in range(5):
        before = txnid()
        with writer.together():
            a = writer.submit(functools.partial(_put, key=b"a%d" % round_), kind="ack")
            b = writer.submit(functools.partial(_put, key=b"b%d" % round_), kind="outbox")
        await asyncio.gather(a, b)
        assert txnid() == before + 1  # one top-level commit for both jobs
    # a hooked kind still runs alone, after the jobs queued before it committed
    writer.before("outbox", lambda kind, size: None)
    before = txnid()
    with writer.together():
        a = writer.submit(lambda txn: txn.put("meta", b"c", b""), kind="ack")
        b = writer.submit(lambda txn: txn.put("meta", b"d", b""), kind="outbox")
    await asyncio.gather(a, b)
    assert txnid() == before + 2
    assert {b"a0", b"b4", b"c", b"d"} <= set(_rows(writer))


async def test_then_runs_in_the_pass_that_settles(writer: StoreWriter) -> None:
    seen: list[bool] = []
    fut = writer.submit(lambda txn: 7, then=lambda f: seen.append(f.done() and f.result() == 7))
    assert await fut == 7 and seen == [True]


async def test_a_hook_can_hold_and_fail_a_kind(writer: StoreWriter) -> None:
    gate = threading.Event()
    sizes: list[int] = []

    def hook(kind: str, size: int) -> None:
        sizes.append(size)
        assert gate.wait(20)
        raise StorageFullError("injected")

    remove = writer.before("receive", hook)
    failing = writer.submit(lambda txn: txn.put("meta", b"lost", b""), kind="receive", size=3)
    other = writer.submit(lambda txn: txn.put("meta", b"kept", b""), kind="ack")
    await asyncio.sleep(0.05)
    assert not failing.done() and not other.done()  # held, and the queue is in order
    gate.set()
    with pytest.raises(StorageFullError):
        await failing
    await other
    remove()
    await writer.write(lambda txn: txn.put("meta", b"after", b""), kind="receive")
    assert sizes == [3] and _rows(writer) == [b"after", b"kept"]


async def test_run_blocks_a_worker_and_refuses_the_loop(writer: StoreWriter) -> None:
    with pytest.raises(UsageError, match="blocks"):
        writer.run(lambda txn: None)
    value = await asyncio.to_thread(writer.run, lambda txn: txn.put("meta", b"w", b"") and 5)
    assert value == 5 and _rows(writer) == [b"w"]


async def test_a_job_calling_run_is_refused_not_deadlocked(writer: StoreWriter) -> None:
    def outer(txn: Txn) -> int:
        txn.put("meta", b"outer", b"")
        with pytest.raises(UsageError, match="inside a write job"):
            writer.run(lambda t: None)
        return 1

    assert await writer.write(outer) == 1


async def test_closed_writer_refuses_new_jobs(tmp_path: Path) -> None:
    store = Store(tmp_path / "s", map_size=1 << 22)
    w = StoreWriter(store)
    await w.sync()
    await asyncio.to_thread(w.close)
    with pytest.raises(UsageError, match="closed"):
        w.submit(lambda txn: None)
    store.close()


# --- group commit -------------------------------------------------------------------------------


def _last_txnid(w: StoreWriter) -> int:
    return int(w.store.env.info()["last_txnid"])


async def _held(writer: StoreWriter) -> tuple[asyncio.Future[None], threading.Event]:
    """A job that keeps the writer thread busy until the event is set."""
    gate = threading.Event()

    def hold(txn: Txn) -> None:
        assert gate.wait(20)
        txn.put("meta", b"held", b"")

    fut = writer.submit(hold)
    return fut, gate


async def test_jobs_queued_while_busy_share_one_transaction(writer: StoreWriter) -> None:
    first, gate = await _held(writer)
    await asyncio.sleep(0.05)  # the writer thread is inside the held job
    before = _last_txnid(writer)
    futs = [
        writer.submit(lambda txn, i=i: txn.put("meta", b"g%02d" % i, b"") and i, durable=i == 3)
        for i in range(8)
    ]
    gate.set()
    assert await asyncio.gather(*futs) == list(range(8))
    await first
    # the held job's transaction, then ONE for the eight queued behind it
    assert _last_txnid(writer) == before + 2
    assert _rows(writer) == [b"g%02d" % i for i in range(8)] + [b"held"]


async def test_a_failing_job_fails_alone_and_order_holds(writer: StoreWriter) -> None:
    first, gate = await _held(writer)
    await asyncio.sleep(0.05)
    seen: list[bytes] = []

    def put(key: bytes) -> Any:
        def job(txn: Txn) -> None:
            got = txn.get("meta", b"order")
            seen.append(got or b"")
            txn.put("meta", b"order", (got or b"") + key)
            txn.put("meta", key, b"")

        return job

    def bad(txn: Txn) -> None:
        txn.put("meta", b"bad", b"")
        raise ValueError("job fails after writing")

    futs = [writer.submit(put(b"a")), writer.submit(bad), writer.submit(put(b"b"))]
    gate.set()
    results = await asyncio.gather(*futs, return_exceptions=True)
    await first
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], ValueError)
    # the failed job's own writes are gone, its neighbours' kept, in submission order
    assert seen == [b"", b"a"]
    with writer.store.read() as txn:
        assert txn.get("meta", b"order") == b"ab" and txn.get("meta", b"bad") is None


async def test_no_job_settles_before_its_group_commits(writer: StoreWriter) -> None:
    first, gate = await _held(writer)
    await asyncio.sleep(0.05)
    ran = threading.Event()
    inner = threading.Event()

    def early(txn: Txn) -> None:
        txn.put("meta", b"early", b"")
        ran.set()

    def late(txn: Txn) -> None:
        assert inner.wait(20)
        txn.put("meta", b"late", b"")

    a = writer.submit(early)
    b = writer.submit(late)
    gate.set()
    await first
    assert await asyncio.to_thread(ran.wait, 20)
    await asyncio.sleep(0.05)
    # `early` ran but shares its transaction with `late`, still running: not acked yet
    assert not a.done() and not b.done()
    with writer.store.read() as txn:
        assert txn.get("meta", b"early") is None  # not committed either
    inner.set()
    await asyncio.gather(a, b)
    assert _rows(writer)[:2] == [b"early", b"held"]


async def test_a_job_that_fills_the_map_fails_alone(tmp_path: Path) -> None:
    store = Store(tmp_path / "s", map_size=1 << 20)
    w = StoreWriter(store)
    try:
        first, gate = await _held(w)
        await asyncio.sleep(0.05)
        small = w.submit(lambda txn: txn.put("meta", b"small", b"x"))
        # Each value alone fits; together they overflow the map: the job that
        # overflows fails with StorageFullError, the group's others commit.
        big = [
            w.submit(lambda txn, i=i: txn.put("meta", b"big%d" % i, b"x" * 300_000))
            for i in range(4)
        ]
        gate.set()
        await first
        results = await asyncio.gather(small, *big, return_exceptions=True)
        assert results[0] is True
        assert all(r is True or isinstance(r, StorageFullError) for r in results)
        assert any(isinstance(r, StorageFullError) for r in results)
        with store.read() as txn:
            for r, key in zip(results, [b"small"] + [b"big%d" % i for i in range(4)], strict=True):
                # whatever was acknowledged is there; whatever failed is not
                assert (txn.get("meta", key) is not None) == (r is True)
        await w.write(lambda txn: txn.put("meta", b"after", b""))  # the writer still works
    finally:
        await asyncio.to_thread(w.close)
        store.close()


_CRASH_CHILD = """
import asyncio, os, signal, sys, threading
from talos.store import Store
from talos.writer import StoreWriter

async def main() -> None:
    store = Store(sys.argv[1], map_size=1 << 22)
    w = StoreWriter(store)
    await w.write(lambda txn: txn.put("meta", b"before", b""))
    print("settled before", flush=True)
    gate = threading.Event()
    hold = w.submit(lambda txn: gate.wait(20) and None)
    await asyncio.sleep(0.05)

    def put(i: int):
        def job(txn):
            if i == 5:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-group: jobs 0-4 already ran
            txn.put("meta", b"g%d" % i, b"")
        return job

    for i in range(8):
        w.submit(put(i), then=lambda f, i=i: print(f"settled g{i}", flush=True))
    gate.set()
    await hold
    await asyncio.sleep(30)

asyncio.run(main())
"""


def test_sigkill_mid_group_acknowledges_nothing_of_it(tmp_path: Path) -> None:
    path = tmp_path / "s"
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH_CHILD, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.splitlines() == ["settled before"]
    with Store(path, map_size=1 << 22) as store, store.read() as txn:
        keys = [k for k, _ in txn.items("meta")]
    # what was acknowledged survived; nothing of the killed group did, not even
    # the jobs that had run before the kill
    assert keys == [b"before"]


async def test_a_failing_then_does_not_keep_its_group_unsettled(writer: StoreWriter) -> None:
    first, gate = await _held(writer)
    await asyncio.sleep(0.05)
    errors: list[BaseException] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda loop, ctx: errors.append(ctx["exception"]))

    def boom(fut: asyncio.Future[None]) -> None:
        raise RuntimeError("then failed")

    a = writer.submit(lambda txn: None, then=boom)
    b = writer.submit(lambda txn: txn.put("meta", b"b", b""))
    gate.set()
    await first
    await asyncio.wait_for(b, 20)  # settled although the callback before it raised
    assert a.done() and [str(e) for e in errors] == ["then failed"]
    loop.set_exception_handler(None)


# --- submit(here=True): a job on the caller's thread when the writer is idle (ADR 0017) ----------


def _where(txn: Txn, key: bytes) -> int:
    txn.put("meta", key, b"")
    return threading.get_ident()


async def test_here_runs_on_the_loop_thread_and_settles_before_returning(
    writer: StoreWriter,
) -> None:
    seen: list[int] = []
    fut = writer.submit(
        functools.partial(_where, key=b"here"), here=True, then=lambda f: seen.append(f.result())
    )
    assert fut.done() and fut.result() == threading.get_ident() and seen == [fut.result()]
    assert writer.here_runs == 1 and _rows(writer) == [b"here"]
    # The writer is free again: the next job goes to its thread as usual.
    assert await writer.submit(functools.partial(_where, key=b"next")) != threading.get_ident()


async def test_here_queues_behind_a_busy_writer(writer: StoreWriter) -> None:
    first, gate = await _held(writer)
    await asyncio.sleep(0.05)  # the writer thread is inside the held job
    fut = writer.submit(functools.partial(_where, key=b"queued"), here=True)
    assert not fut.done()  # not on the loop: it would have overtaken the held job
    gate.set()
    await first
    assert await fut != threading.get_ident() and writer.here_runs == 0
    assert _rows(writer) == [b"held", b"queued"]


async def test_a_job_queued_during_a_here_job_runs_after_it_on_the_thread(
    writer: StoreWriter,
) -> None:
    ran_on: list[int] = []

    def from_worker() -> None:  # a worker thread's write (as the sealer's) while the loop holds it
        ran_on.append(writer.run(functools.partial(_where, key=b"b-after")))

    worker = threading.Thread(target=from_worker)

    def here(txn: Txn) -> None:
        txn.put("meta", b"a-here", b"")
        worker.start()
        time.sleep(0.05)  # its job is queued behind this one by now (or soon after: same order)

    writer.submit(here, here=True)
    assert writer.here_runs == 1
    await asyncio.to_thread(worker.join, 20)
    assert ran_on and ran_on[0] not in (threading.get_ident(), worker.ident)
    assert _rows(writer) == [b"a-here", b"b-after"]


async def test_here_failure_settles_the_future_and_frees_the_writer(writer: StoreWriter) -> None:
    def boom(txn: Txn) -> None:
        txn.put("meta", b"never", b"")
        raise ValueError("no")

    seen: list[BaseException | None] = []
    fut = writer.submit(boom, here=True, then=lambda f: seen.append(f.exception()))
    assert isinstance(fut.exception(), ValueError) and seen == [fut.exception()]
    assert await writer.write(lambda txn: txn.put("meta", b"ok", b"") or 1) == 1
    assert _rows(writer) == [b"ok"]  # the failed job's write was rolled back


async def test_here_is_not_honoured_for_a_hooked_kind(writer: StoreWriter) -> None:
    writer.before("receive", lambda kind, size: None)
    hooked = writer.submit(functools.partial(_where, key=b"hooked"), kind="receive", here=True)
    assert await hooked != threading.get_ident() and writer.here_runs == 0  # hooks: the thread


async def test_here_is_not_honoured_on_a_slow_disk(writer: StoreWriter) -> None:
    def slow(txn: Txn) -> None:
        time.sleep(0.03)  # 8 x HERE_SLOW: even one such run lifts the average above it
        txn.put("meta", b"slow", b"")

    writer.submit(slow, here=True)
    assert writer.here_runs == 1
    later = writer.submit(functools.partial(_where, key=b"later"), here=True)
    assert await later != threading.get_ident() and writer.here_runs == 1


async def test_close_during_a_here_job_ends_the_thread(tmp_path: Path) -> None:
    """close() from a worker while the loop holds the writer: it returns once the job is done."""
    store = Store(tmp_path / "s", map_size=1 << 22)
    w = StoreWriter(store)
    try:
        await w.write(functools.partial(_where, key=b"thread"))  # the thread exists
        await until(lambda: not w.busy, what="the writer thread idle")
        closer = threading.Thread(target=w.close)

        def here(txn: Txn) -> None:
            txn.put("meta", b"here", b"")
            closer.start()
            time.sleep(0.05)  # close() is waiting for the thread by now

        w.submit(here, here=True)
        await asyncio.to_thread(closer.join, 20)
        assert not closer.is_alive() and w.here_runs == 1
        assert _rows(w) == [b"here", b"thread"]
    finally:
        store.close()


# --- together(here=True): a group on the caller's thread when the writer is idle (ADR 0017) -----


async def test_together_here_runs_the_group_on_the_loop_in_one_transaction(
    writer: StoreWriter,
) -> None:
    def boom(txn: Txn) -> None:
        txn.put("meta", b"never", b"")
        raise ValueError("no")

    before, seen = _last_txnid(writer), []
    with writer.together(here=True):
        with writer.together():  # an inner block ends: nothing runs yet
            a = writer.submit(functools.partial(_where, key=b"a"), kind="ack")
        bad = writer.submit(boom, kind="outbox", then=lambda f: seen.append(f.exception()))
        b = writer.submit(functools.partial(_where, key=b"b"), kind="outbox", durable=False)
        assert not a.done() and writer.here_runs == 0
    # Settled before the block was left, on this thread, in one transaction; the job
    # that raised dropped only its own write.
    assert a.result() == b.result() == threading.get_ident() and writer.here_runs == 1
    assert isinstance(bad.exception(), ValueError) and seen == [bad.exception()]
    assert _last_txnid(writer) == before + 1 and _rows(writer) == [b"a", b"b"]


async def test_together_here_goes_to_the_thread_when_busy_or_hooked(writer: StoreWriter) -> None:
    first, gate = await _held(writer)
    await asyncio.sleep(0.05)  # the writer thread is inside the held job
    with writer.together(here=True):
        queued = writer.submit(functools.partial(_where, key=b"queued"))
    assert not queued.done()  # behind the held job, not overtaking it on the loop
    gate.set()
    await first
    assert await queued != threading.get_ident()
    await until(lambda: not writer.busy, what="the writer thread idle")
    writer.before("outbox", lambda kind, size: None)
    with writer.together(here=True):
        ack = writer.submit(functools.partial(_where, key=b"ack"), kind="ack")
        hooked = writer.submit(functools.partial(_where, key=b"hooked"), kind="outbox")
    assert await ack != threading.get_ident() and await hooked != threading.get_ident()
    assert writer.here_runs == 0


async def test_together_here_leaves_a_worker_job_queued_meanwhile_to_the_thread(
    writer: StoreWriter,
) -> None:
    """A worker's job (a seal, with its fsync) queued during the block is not the
    block's to run on the loop: the whole group goes to the thread, in order."""
    ran_on: list[int] = []
    worker = threading.Thread(
        target=lambda: ran_on.append(writer.run(functools.partial(_where, key=b"b-worker")))
    )
    with writer.together(here=True):
        own = writer.submit(functools.partial(_where, key=b"a-own"), durable=False)
        worker.start()
        await until(lambda: len(writer._queue) == 2, what="the worker's job queued")
    await asyncio.to_thread(worker.join, 20)
    assert await own == ran_on[0] != threading.get_ident() and writer.here_runs == 0
    assert _rows(writer) == [b"a-own", b"b-worker"]
