"""The one writer of a node's LMDB store (docs/ARCHITECTURE.md "Storage and threads").

Every write transaction of a running node — message commits, acks, outbox
rows, session state, heads, pins, transfer rows, block sealing, audit records —
runs on ONE thread, in submission order. LMDB allows one writer per
environment anyway; doing it on one thread means a durable commit (fsync)
never blocks the event loop, frames keep arriving while it runs, and the
next batch forms meanwhile: group commit follows from the structure.

Three ways in:

* :meth:`StoreWriter.submit` from the event loop: returns an asyncio future,
  and ``then`` runs in the very loop pass that settles it (the ack after a
  receive commit is on every message's critical path);
* :meth:`StoreWriter.write`, the awaitable form;
* :meth:`StoreWriter.run` from any *other* thread (sealer, audit, transfer
  workers): blocks that thread until the job is done. Neither the loop (it
  would block) nor a job on the writer thread (it would wait for itself; pass
  it the ``txn`` instead) may call it.

Each job has a ``kind``; :meth:`StoreWriter.before` registers a hook that runs
on the writer thread before every job of that kind (raising fails the job).
That is the seam fault-injection tests use to hold or fail a chosen write.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar, cast

from talos.store import Store, Txn
from talos_sdk.errors import UsageError

__all__ = ["DirectWrites", "StoreWriter", "WriteHook", "Writes"]

_T = TypeVar("_T")

#: ``hook(kind, size)``: runs on the writer thread before a job of that kind.
WriteHook = Callable[[str, int], None]


class Writes(Protocol):
    """Something that runs ``fn(txn)`` in a write transaction from a worker thread."""

    def run(self, fn: Callable[[Txn], _T], *, durable: bool = True, kind: str = "write") -> _T: ...


class DirectWrites:
    """:class:`Writes` straight on the store: for offline tools, which have no loop."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def run(self, fn: Callable[[Txn], _T], *, durable: bool = True, kind: str = "write") -> _T:
        with self.store.write(durable=durable) as txn:
            return fn(txn)


class StoreWriter:
    """One thread that owns every write transaction of ``store``."""

    def __init__(self, store: Store, *, name: str = "talos-writer") -> None:
        self.store = store
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._thread_id: int | None = None
        self._hooks: dict[str, list[WriteHook]] = {}
        self._closed = False

    # --- jobs ----------------------------------------------------------------------------------

    def _job(self, fn: Callable[[Txn], _T], durable: bool, kind: str, size: int) -> _T:
        self._thread_id = threading.get_ident()
        for hook in self._hooks.get(kind, ()):
            hook(kind, size)
        with self.store.write(durable=durable) as txn:
            return fn(txn)

    def submit(
        self,
        fn: Callable[[Txn], _T],
        *,
        durable: bool = True,
        then: Callable[[asyncio.Future[_T]], None] | None = None,
        kind: str = "write",
        size: int = 1,
    ) -> asyncio.Future[_T]:
        """Queue ``fn`` now (no loop pass first); call from the event loop thread.

        ``then(future)`` runs in the loop pass that settles the future:
        ``run_in_executor`` plus ``add_done_callback`` would cost two passes.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[_T] = loop.create_future()

        def settle(result: _T | None, exc: BaseException | None) -> None:
            if not fut.done():
                if exc is None:
                    fut.set_result(cast(_T, result))
                else:
                    fut.set_exception(exc)
            if then is not None:
                then(fut)

        def job() -> None:
            try:
                result = self._job(fn, durable, kind, size)
            except BaseException as exc:
                loop.call_soon_threadsafe(settle, None, exc)
                return
            loop.call_soon_threadsafe(settle, result, None)

        self._check_open()
        self._pool.submit(job)
        return fut

    async def write(
        self, fn: Callable[[Txn], _T], *, durable: bool = True, kind: str = "write"
    ) -> _T:
        """Run ``fn(txn)`` on the writer thread and wait for its commit."""
        return await self.submit(fn, durable=durable, kind=kind)

    def run(self, fn: Callable[[Txn], _T], *, durable: bool = True, kind: str = "write") -> _T:
        """Blocking form for worker threads (see the module docstring)."""
        if threading.get_ident() == self._thread_id:
            raise UsageError("StoreWriter.run inside a write job: write with that job's txn")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise UsageError("StoreWriter.run blocks: use submit()/write() on the event loop")
        self._check_open()
        return self._pool.submit(self._job, fn, durable, kind, 1).result()

    async def drain(self) -> None:
        """Wait until every job queued before this call has finished (no transaction)."""
        self._check_open()
        await asyncio.wrap_future(self._pool.submit(_idle))

    async def sync(self) -> None:
        """Make every earlier commit durable (one fsync, queued behind them)."""
        await self.write(_nothing, durable=True, kind="sync")

    # --- hooks and lifecycle -------------------------------------------------------------------

    def before(self, kind: str, hook: WriteHook) -> Callable[[], None]:
        """Run ``hook(kind, size)`` before each job of ``kind``; returns the undo function."""
        self._hooks.setdefault(kind, []).append(hook)

        def remove() -> None:
            hooks = self._hooks.get(kind, [])
            if hook in hooks:
                hooks.remove(hook)

        return remove

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("the store writer is closed")

    def close(self) -> None:
        """Finish every queued job, then stop the thread (blocks; call from a worker)."""
        self._closed = True
        self._pool.shutdown(wait=True)


def _nothing(txn: Txn) -> None:
    return None


def _idle() -> None:
    return None
