"""Audit of the tunnel (docs/DESIGN.md "MCP tunnel": every call audited; "group commit").

The record is defined in docs/PROTOCOL.md "MCP tunnel", Audit record. Every event
of a serve side becomes an :class:`AuditRecord`:

* ``call``: a caller's request and how it ended (``ok``, ``error``,
  ``tool-error``, ``denied``, ``cancelled``, ``malformed``, ``tool-exited``,
  ``closed`` (the session ended first, a lost link included), ``refused-notification``,
  ``too-many`` (past the session's requests in flight), ``audit-failed`` (refused
  while the last write failed: :attr:`Auditor.failing`);
* ``request``: a request the tool sent to the caller (sampling, elicitation,
  roots) and the caller's answer;
* ``session``: ``open`` (or its refusal), ``close`` and the tool process's
  ``exit`` (pid, exit code, why);
* ``refusal``: a message refused before any tool saw it (not JSON-RPC, a frame
  for a session the peer does not own).

Parameters and results are committed as HMAC-SHA256 under the node's audit key
(mcp_proxy/audit_record.py). Arguments and results are kept in plaintext only
when asked (``--audit-plaintext``).

The :class:`Auditor` keeps records off the hot path. A call's end is noted as
a plain tuple of what was seen (:meth:`Auditor.note`: the parsed params and
result, not yet digested); ``commit_interval`` (50 ms) after the first of them,
or as soon as ``batch_limit`` (128) are queued, the tuples queued meanwhile are
built into records in one pass -- digests, commitments, block-log records -- and
handed to the store writer as one write transaction: one thread hop per batch,
no task, future or loop lookup per call. In ``group`` mode that transaction is
not synced, and a sync follows within ``sync_interval`` of the first unsynced
write (a process crash loses at most the records of the last
``commit_interval``, a power loss those of the last ``sync_interval``; never a
tool call). In ``strict`` mode the caller awaits its record being on disk;
concurrent strict callers share one fsync.

The sink is the boundary: :class:`BlockLogSink` appends ``kind="mcp"`` records
to the node's block log, so audit records are sealed into signed blocks; a
batch's events share records, as many of one caller as fit each
(:func:`~mcp_proxy.audit_record.pack`, docs/adr/0014-audit-batch-records.md); an
attached serve's :class:`~mcp_proxy.node_audit.NodeAuditSink` (an
:class:`AsyncAuditSink`) has the running node append them.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, cast

from mcp_proxy.audit_record import (
    AUDIT_KEY_FILE,
    MAX_COMMITMENT,
    MAX_EXTRA,
    RECORD_KIND,
    AuditKey,
    AuditRecord,
    Event,
    Facts,
    HeavyDigestError,
    pack,
)
from talos.logging import event
from talos_sdk.errors import UsageError

if TYPE_CHECKING:
    from talos.chain.log import BlockLog
    from talos.store import Txn
    from talos.writer import StoreWriter

__all__ = [
    "AUDIT_KEY_FILE",
    "MAX_COMMITMENT",
    "MAX_EXTRA",
    "RECORD_KIND",
    "AsyncAuditSink",
    "AuditKey",
    "AuditMode",
    "AuditRecord",
    "AuditSink",
    "Auditor",
    "BlockLogSink",
    "Event",
    "Facts",
    "failing",
]

log = logging.getLogger(__name__)


class AuditMode(enum.Enum):
    """``group``: commit off the hot path; ``strict``: the reply waits for its durable record."""

    GROUP = "group"
    STRICT = "strict"


class AuditSink(Protocol):
    """Where records go: ``write`` commits without fsync, ``sync`` makes it durable."""

    def write(self, records: Sequence[AuditRecord]) -> None: ...

    def sync(self) -> None: ...


class AsyncAuditSink(Protocol):
    """A sink that commits from the event loop (``sync``: durable before it returns)."""

    @property
    def commits_from_loop(self) -> bool: ...

    async def commit(self, records: Sequence[AuditRecord], sync: bool) -> None: ...


def _commits_from_loop(sink: object) -> bool:
    return bool(getattr(sink, "commits_from_loop", False))


class BlockLogSink:
    """Append audit records to the node's block log (authored by the node, unsigned).

    With the node's ``writer`` (talos/writer.py), :meth:`commit` hands a batch to
    the writer thread straight from the event loop; without it, the blocking
    :meth:`write` / :meth:`sync` run in a worker thread that waits for the writer.
    """

    def __init__(
        self, block_log: BlockLog, node_did: str, writer: StoreWriter | None = None
    ) -> None:
        self.block_log = block_log
        self.node_did = node_did
        self.writer = writer

    @property
    def commits_from_loop(self) -> bool:
        return self.writer is not None

    def _append_all(self, records: Sequence[AuditRecord]) -> Callable[[Txn], None]:
        """The batch's block-log records, built here; the returned job only appends them.

        Built by the caller (the event loop) rather than in the job: the writer thread
        then holds the GIL only for the puts, so the loop is not kept waiting for it.
        """
        from talos.chain.block import Record

        packed = pack(records)
        # One getrandom for the batch, not one per record (11k syscalls in 6 s at 64 in flight).
        ids = os.urandom(16 * len(packed))
        node_did = self.node_did
        built = [
            Record(
                kind=RECORD_KIND,
                record_id=ids[16 * i : 16 * i + 16],
                sender=node_did,
                recipient=p.recipient,
                commitment=p.commitment,
                signature=b"",
                timestamp_ms=p.timestamp_ms,
                extra=p.extra,
            )
            for i, p in enumerate(packed)
        ]
        append = self.block_log.append

        def append_all(txn: Txn) -> None:
            for record in built:
                append(record, txn)

        return append_all

    def write(self, records: Sequence[AuditRecord]) -> None:
        # Through the node's one store writer (talos/writer.py), never a second writer.
        self.block_log.write(self._append_all(records), durable=False)

    def sync(self) -> None:
        self.block_log.sync()

    async def commit(self, records: Sequence[AuditRecord], sync: bool) -> None:
        """Write ``records`` (fsync'd with them if ``sync``) through ``writer``, from the loop.

        One thread hop per batch instead of two (a worker thread blocked on the writer
        thread): at one call in flight that was a dozen futex calls per call.
        """
        assert self.writer is not None
        if records:
            await self.writer.write(self._append_all(records), durable=sync, kind="log")
        else:
            await self.writer.sync()


class Auditor:
    """Batches records into the sink off the hot path; see the module docstring."""

    def __init__(
        self,
        sink: AuditSink | AsyncAuditSink,
        *,
        mode: AuditMode = AuditMode.GROUP,
        key: AuditKey | None = None,
        plaintext: bool = False,
        sync_interval: float = 1.0,
        commit_interval: float = 0.05,
        batch_limit: int = 128,
    ) -> None:
        self.sink = sink
        # A batch costs ~0.5 ms of CPU whatever its size (build, thread hop, commit, all
        # run cold after the linger): one per 5 ms was ~100 us of the serving process's
        # CPU per call at one call in flight (ADR 0014, amended). The size limit keeps a
        # batch built on the loop short under load.
        self.commit_interval = commit_interval
        self.batch_limit = batch_limit
        self.mode = mode
        # A key of its own when none is given (tests): digests then prove nothing later.
        self.key = key if key is not None else AuditKey.generate()
        self.plaintext = plaintext
        self.sync_interval = sync_interval
        # Noted facts and submitted records, in order, until the next commit builds them.
        self._queue: list[Facts | AuditRecord] = []
        self._barriers: list[asyncio.Future[None]] = []
        self._task: asyncio.Task[None] | None = None
        # The committer waits on this future (one per commit, not per record).
        self._waiter: asyncio.Future[None] | None = None
        self._again = False  # woken while committing: go round again before waiting
        self._timer: asyncio.TimerHandle | None = None  # the linger of the next commit
        self._sync_timer: asyncio.TimerHandle | None = None
        self._sync_due_at: float | None = None  # set while unsynced writes exist
        self._dirty = False
        self._stopping = False
        self.written = 0
        #: Why the last write failed; None once one succeeds. While set, serve refuses
        #: calls (AUDIT_UNAVAILABLE): none runs unrecorded, and each refusal's own record
        #: tries the log again.
        self.failing: str | None = None
        self.failed_batches = 0  # lost since the last write that succeeded
        # Cached: asyncio.get_running_loop() costs a getpid() per call on Python 3.11.
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name="mcp-audit")

    async def stop(self) -> None:
        """Write what is queued and sync, then stop."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            # Not cancelled: a write in a worker thread must finish before the final flush.
            self._stopping = True
            self._wake()
            await task
        for timer in (self._timer, self._sync_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._sync_timer = None
        await self._flush(durable=True)

    def note(self, facts: Facts) -> None:
        """Queue one event as seen (the hot path): digests and record are built in the batch."""
        self._queue.append(facts)
        self._queued()

    def submit(self, rec: AuditRecord) -> None:
        """Queue a built record for the next group commit (never blocks)."""
        self._queue.append(rec)
        self._queued()

    def _queued(self) -> None:
        if len(self._queue) >= self.batch_limit:
            self._wake()
        elif self._timer is None:
            self._arm()

    def _started(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            raise UsageError("Auditor.start() must run before records are noted")
        return loop

    def _arm(self) -> None:
        # Linger instead of waking per record: under sequential load a thread hop per
        # call would cost more than the call; a few ms of batching costs nothing.
        self._timer = self._started().call_later(self.commit_interval, self._wake)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        else:
            self._again = True

    async def record_barrier(self) -> None:
        """Return once every record submitted so far is durable (``--audit strict``)."""
        fut: asyncio.Future[None] = self._started().create_future()
        self._barriers.append(fut)
        self._wake()
        await fut

    async def _run(self) -> None:
        loop = self._started()
        while True:
            if not self._again:
                self._waiter = loop.create_future()
                await self._waiter
                self._waiter = None
            self._again = False
            if self._stopping:
                return
            if self._timer is not None:
                # This commit takes what the pending linger was for; the next note re-arms.
                self._timer.cancel()
                self._timer = None
            due = self._sync_due_at is not None and loop.time() >= self._sync_due_at
            try:
                await self._flush(durable=due)
            except Exception as exc:  # the writer goes on; this batch's records are lost
                self._failed(exc)
            self._schedule_sync(loop)

    def _failed(self, exc: Exception) -> None:
        """A batch could not be written: its records are lost, and calls are refused
        from now until a write succeeds (logged once per such stretch)."""
        self.failed_batches += 1
        if self.failing is None:
            event(log, "audit_write_failed", logging.ERROR, records="lost", error=repr(exc),
                  calls="refused until the audit log can be written")  # fmt: skip
        self.failing = str(exc) or type(exc).__name__

    def _schedule_sync(self, loop: asyncio.AbstractEventLoop) -> None:
        """A sync within ``sync_interval`` of the first unsynced write; none while clean."""
        if not self._dirty:
            self._sync_due_at = None
            if self._sync_timer is not None:
                self._sync_timer.cancel()
                self._sync_timer = None
        elif self._sync_due_at is None:
            self._sync_due_at = loop.time() + self.sync_interval
            self._sync_timer = loop.call_at(self._sync_due_at, self._wake)

    def _build(self, queued: list[Facts | AuditRecord], inline: bool = False) -> list[AuditRecord]:
        """The queued facts as records: the batch's digests, computed in one pass
        (``inline``: on the loop, HeavyDigestError for a value long to digest)."""
        digest = functools.partial(self.key.digest, inline=inline)
        new = tuple.__new__  # what AuditRecord._make does, without its length check per record
        out: list[AuditRecord] = []
        for item in queued:
            if type(item) is AuditRecord:
                out.append(item)
                continue
            (caller, server, method, tool, rid, params, result, latency, outcome, ms, plain,
             ev, session, pid, detail) = item  # fmt: skip
            out.append(
                new(AuditRecord, (caller, server, method, tool, rid, digest(params),
                    digest(result), latency, outcome, ms, plain, ev, session, pid, detail))
            )  # fmt: skip
        return out

    async def _flush(self, *, durable: bool) -> None:
        queued, self._queue = self._queue, []
        barriers, self._barriers = self._barriers, []
        sync = bool(durable or barriers) and (self._dirty or bool(queued))
        sink = self.sink
        try:
            try:
                batch = self._build(queued, inline=True) if queued else []
            except HeavyDigestError:
                # A large params or result of floats takes the pure-Python RFC 8785 encoder
                # (~2.5 s for 8 MB): on the loop it stalled every session of every peer, so
                # such a batch is built in a thread (it shares the GIL, the loop gets turns).
                # Not every batch: the thread hop cost 20 % of throughput at 256 in flight.
                batch = await asyncio.to_thread(self._build, queued)
            if (batch or sync) and _commits_from_loop(sink):
                await cast(AsyncAuditSink, sink).commit(batch, sync)
                self._wrote(len(batch), sync)
            elif batch or sync:
                # LMDB's writer lock may be held by the node's writer thread (and fsync is
                # slow): neither may stall the event loop that forwards tool traffic.
                await asyncio.to_thread(self._write, batch, sync)
        except BaseException as exc:
            for fut in barriers:
                if not fut.done():
                    fut.set_exception(
                        exc if isinstance(exc, Exception) else RuntimeError("stopped")
                    )
            raise
        for fut in barriers:
            if not fut.done():
                fut.set_result(None)

    def _write(self, batch: list[AuditRecord], sync: bool) -> None:
        sink = cast(AuditSink, self.sink)
        if batch:
            sink.write(batch)
        if sync:
            sink.sync()
        self._wrote(len(batch), sync)

    def _wrote(self, count: int, sync: bool) -> None:
        if self.failing is not None:
            event(log, "audit_write_recovered", logging.WARNING, batches_lost=self.failed_batches)
            self.failing = None
            self.failed_batches = 0
        self.written += count
        if sync:
            self._dirty = False
        elif count:
            self._dirty = True


def failing(auditor: Auditor | None) -> str | None:
    """Why ``auditor`` cannot write its log now; None while it can, or with no auditor."""
    return None if auditor is None else auditor.failing
