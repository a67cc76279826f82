"""talos/writer.py: the one writer thread of a node's store, on a real LMDB store."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from talos.store import Store, Txn
from talos.writer import StoreWriter
from talos_sdk.errors import StorageFullError, UsageError


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
