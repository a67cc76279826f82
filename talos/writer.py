"""The one writer of a node's LMDB store (docs/ARCHITECTURE.md "Storage and threads").

Every write transaction of a running node — message commits, acks, outbox
rows, session state, heads, pins, transfer rows, block sealing, audit records —
runs on ONE thread, in submission order. LMDB allows one writer per
environment anyway; doing it on one thread means a durable commit (fsync)
does not block the event loop, frames keep arriving while it runs, and the
next batch forms meanwhile. The one exception is asked for by name:
``submit(here=True)`` on an idle writer (below).

Group commit, as databases do it: every job queued while the thread was busy
forms the next *group*, run in ONE write transaction (each job in a nested
child transaction, so a job that raises drops only its own writes) with at
most one fsync (when any job of it is durable). No caller hears back before
the group's commit and fsync returned, and then all hear back in one loop
pass: a durable job is acknowledged only once it is on disk, whatever else
shared its transaction. A commit or fsync that fails fails the whole group.
What it buys, measured on a loaded 2-core machine: an ack write and an
outbox commit queued together cost 116-125 µs of CPU per message as one
group against 200-205 µs as two transactions (two thread and loop wake-ups).

Three ways in:

* :meth:`StoreWriter.submit` from the event loop: returns an asyncio future,
  and ``then`` runs in the very loop pass that settles it (the ack after a
  receive commit is on every message's critical path). With ``here=True``
  and the writer idle (nothing queued or running, no hook on the kind, such
  runs not slower than :data:`HERE_SLOW` on average), the job runs on the
  calling thread instead, before ``submit`` returns: the loop is held for
  one commit and its fsync, and two thread wake-ups are saved
  (docs/adr/0017-lone-commit-on-the-loop.md); ``together(here=True)`` does
  the same for the group its block submits;
* :meth:`StoreWriter.write`, the awaitable form;
* :meth:`StoreWriter.run` from any *other* thread (sealer, audit, transfer
  workers): blocks that thread until the job is done. Neither the loop (it
  would block) nor a job on the writer thread (it would wait for itself; pass
  it the ``txn`` instead) may call it.

Each job has a ``kind``; :meth:`StoreWriter.before` registers a hook that runs
on the writer thread before every job of that kind (raising fails the job).
That is the seam fault-injection tests use to hold or fail a chosen write; a
job of a hooked kind runs alone, after the jobs queued before it committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from talos.store import Store, Txn
from talos_sdk.errors import UsageError

__all__ = ["DirectWrites", "StoreWriter", "WriteHook", "Writes"]

_T = TypeVar("_T")

#: ``hook(kind, size)``: runs on the writer thread before a job of that kind.
WriteHook = Callable[[str, int], None]

#: When jobs run with ``here=True`` hold the loop longer than this on average
#: (seconds; a moving average over the last ~8, so one slow fsync does not
#: count), the next ones go to the thread for HERE_BACKOFF seconds: a slow or
#: busy disk must not keep stalling the loop.
HERE_SLOW = 0.002
HERE_BACKOFF = 1.0


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


@dataclass(slots=True)
class _Job:
    fn: Callable[[Txn], Any] | None  # None: drain() (no transaction)
    durable: bool
    kind: str
    size: int
    #: ``done(result, exc)``, called on the writer thread once the job's group is settled.
    done: Callable[[Any, BaseException | None], None]
    loop: asyncio.AbstractEventLoop | None = None  # set: ``done`` runs in that loop instead


class StoreWriter:
    """One thread that owns every write transaction of ``store``, committing jobs in groups."""

    def __init__(self, store: Store, *, name: str = "talos-writer") -> None:
        self.store = store
        self._name = name
        self._thread: threading.Thread | None = None
        self._thread_id: int | None = None
        self._hooks: dict[str, list[WriteHook]] = {}
        self._closed = False
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._serving = False  # the thread was woken and has not found the queue empty yet
        # A plain lock as the thread's wake-up: held while the thread sleeps, released
        # by _enqueue. A ThreadPoolExecutor.submit per group (a Future, a work item, a
        # queue and a semaphore) was 4-5 % of a sending node's GIL time.
        self._wake = threading.Lock()
        self._wake.acquire()
        self._stop = False
        self._held = 0  # together() blocks open: wake the thread when the last one ends
        self._here_after = 0.0  # time.monotonic() before which here=True is not honoured
        self._here_avg = 0.0  # moving average of here=True run times, seconds
        #: Jobs that ran on the caller's thread (``submit(here=True)``).
        self.here_runs = 0

    # --- jobs ----------------------------------------------------------------------------------

    def _enqueue(self, job: _Job) -> None:
        with self._lock:
            # Under the lock: a job queued after close() let the thread go would never settle.
            self._check_open()
            self._queue.append(job)
            if self._serving or self._held:
                return  # the thread is busy, or together() wakes it: no wake-up now
            self._wake_thread()

    def _wake_thread(self) -> None:
        """Wake the thread for what is queued (holding ``_lock``)."""
        self._serving = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        self._wake.release()

    @contextlib.contextmanager
    def together(self, *, here: bool = False) -> Iterator[None]:
        """Jobs submitted inside form one group: the thread is woken once, on exit.

        Without it a job submitted right after another could miss the group the
        first one woke the thread for, and cost a second transaction, thread
        wake-up and loop wake-up (an ack write and the outbox commit after it).
        ``here``: if the writer is idle when the block ends, the group runs on
        this thread instead and is settled before the block is left, as
        ``submit(here=True)`` does for one job (ADR 0017). Only the block's own
        jobs: one a worker thread queued meanwhile (a seal, with its fsync) sends
        the whole group to the thread.
        """
        with self._lock:
            self._held += 1
        group: list[_Job] = []
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1
                if not self._held and not self._serving and self._queue:
                    if here and self._may_run_here(self._queue):
                        group = list(self._queue)
                        self._queue.clear()
                        self._serving = True
                    else:
                        self._wake_thread()
        if group:
            self._run_here(group)

    def _loop(self) -> None:
        """Writer thread: sleep until woken, then serve the queue until it is empty."""
        self._thread_id = threading.get_ident()
        while True:
            self._wake.acquire()
            self._serve()
            with self._lock:
                if self._stop and not self._serving:
                    return

    def _serve(self) -> None:
        """Run what is queued, a group at a time, until the queue is empty."""
        while True:
            with self._lock:
                if not self._queue:
                    self._serving = False
                    return
                jobs = list(self._queue)
                self._queue.clear()
            # A kind with hooks runs alone, outside any group: a hook that holds the
            # writer then sees every earlier job committed, as a crash there would.
            group: list[_Job] = []
            for job in jobs:
                if self._hooks.get(job.kind):
                    if group:
                        self._settle(group, self._run_group(group))
                        group = []
                    self._settle([job], self._run_group([job]))
                else:
                    group.append(job)
            if group:
                self._settle(group, self._run_group(group))

    def _run_group(self, group: list[_Job]) -> list[tuple[Any, BaseException | None]]:
        """One transaction and at most one fsync for ``group``: each job's outcome."""
        outcomes: list[tuple[Any, BaseException | None]] = [(None, None)] * len(group)
        live = [i for i, job in enumerate(group) if job.fn is not None]
        try:
            if len(live) == 1:
                job = group[live[0]]
                assert job.fn is not None
                for hook in self._hooks.get(job.kind, ()):
                    hook(job.kind, job.size)
                with self.store.write(durable=job.durable) as txn:
                    outcomes[live[0]] = (job.fn(txn), None)
            elif live:
                durable = any(group[i].durable for i in live)
                with self.store.write(durable=durable) as txn:
                    for i in live:
                        job = group[i]
                        assert job.fn is not None
                        try:
                            # A child transaction: a job that raises drops its own writes only.
                            with self.store.nested(txn) as child:
                                outcomes[i] = (job.fn(child), None)
                        except Exception as exc:
                            outcomes[i] = (None, exc)
        except BaseException as exc:
            # The commit or its fsync failed (or the lone job raised): none of the
            # group is known durable, so every job fails with it.
            outcomes = [(None, exc if e is None else e) for _, e in outcomes]
        return outcomes

    @staticmethod
    def _settle(group: list[_Job], outcomes: list[tuple[Any, BaseException | None]]) -> None:
        """Tell each job's caller; one wake-up per event loop for the whole group."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Job, Any, BaseException | None]]] = {}
        for job, (result, exc) in zip(group, outcomes, strict=True):
            if job.loop is None:
                job.done(result, exc)
            else:
                by_loop.setdefault(job.loop, []).append((job, result, exc))
        for loop, settled in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(_settle_in_loop, settled)

    def submit(
        self,
        fn: Callable[[Txn], _T],
        *,
        durable: bool = True,
        then: Callable[[asyncio.Future[_T]], None] | None = None,
        kind: str = "write",
        size: int = 1,
        here: bool = False,
    ) -> asyncio.Future[_T]:
        """Queue ``fn`` now (no loop pass first); call from the event loop thread.

        ``then(future)`` runs in the loop pass that settles the future:
        ``run_in_executor`` plus ``add_done_callback`` would cost two passes.
        ``here``: run it on this thread now if the writer is idle (module
        docstring); the future is then settled, and ``then`` called, on return.
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

        job = _Job(fn, durable, kind, size, settle, loop)
        if here and self._claim_idle(job):
            self._run_here([job])
        else:
            self._enqueue(job)
        return fut

    @property
    def busy(self) -> bool:
        """Whether a job is queued or running (on the thread, or one run ``here``)."""
        with self._lock:
            return self._serving or bool(self._queue)

    def _may_run_here(self, jobs: Iterable[_Job]) -> bool:
        """``here``'s conditions besides idleness: no back-off, and every job submitted from
        the loop (not a worker's ``run``, e.g. a seal with its fsync) with no hook on its kind."""
        if time.monotonic() < self._here_after:
            return False
        return all(job.loop is not None and not self._hooks.get(job.kind) for job in jobs)

    def _claim_idle(self, job: _Job) -> bool:
        """Take the writer for ``job`` on the caller's thread, if nothing else has it."""
        if not self._may_run_here((job,)):
            return False
        with self._lock:
            if self._serving or self._queue or self._held or self._closed:
                return False
            self._serving = True  # jobs queued meanwhile wait, as behind a running group
            return True

    def _run_here(self, group: list[_Job]) -> None:
        """Run a claimed group on this thread, give the writer back, then settle it here."""
        start = time.monotonic()
        try:
            outcomes = self._run_group(group)
        finally:
            now = time.monotonic()
            self._here_avg += (now - start - self._here_avg) / 8
            if self._here_avg > HERE_SLOW:
                self._here_after, self._here_avg = now + HERE_BACKOFF, 0.0
            self.here_runs += 1
            with self._lock:
                if (self._queue or self._stop) and not self._held:
                    # What was queued meanwhile, or a close() waiting for the thread to end.
                    self._wake_thread()
                else:
                    self._serving = False
        _settle_in_loop([(job, *outcome) for job, outcome in zip(group, outcomes, strict=True)])

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
        fut: Future[_T] = Future()

        def done(result: _T | None, exc: BaseException | None) -> None:
            if exc is None:
                fut.set_result(cast(_T, result))
            else:
                fut.set_exception(exc)

        self._enqueue(_Job(fn, durable, kind, 1, done))
        return fut.result()

    async def drain(self) -> None:
        """Wait until every job queued before this call has finished (no transaction)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def done(result: None, exc: BaseException | None) -> None:
            if not fut.done():
                fut.set_result(None)

        self._enqueue(_Job(None, False, "drain", 0, done, loop))
        await fut

    def submit_sync(self) -> asyncio.Future[None]:
        """Queue one fsync behind every earlier commit; the future settles once it returned."""
        return self.submit(_nothing, durable=True, kind="sync")

    async def sync(self) -> None:
        """Make every earlier commit durable (one fsync, queued behind them)."""
        await self.submit_sync()

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
        with self._lock:
            self._closed = True
            thread = self._thread
            if thread is None:
                return
            self._stop = True
            if not self._serving:
                self._wake_thread()
        thread.join()


def _settle_in_loop(settled: list[tuple[_Job, Any, BaseException | None]]) -> None:
    for job, result, exc in settled:
        try:
            job.done(result, exc)
        except Exception as error:  # one failing ``then`` must not keep the rest unsettled
            asyncio.get_running_loop().call_exception_handler(
                {"message": f"store writer: settling a {job.kind!r} job failed", "exception": error}
            )


def _nothing(txn: Txn) -> None:
    return None
