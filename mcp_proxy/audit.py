"""Audit of every tunnelled call (DESIGN.md "MCP tunnel": every call audited; "group commit").

Each answered request becomes an :class:`AuditRecord`: caller DID, method, tool,
request id, SHA-256 of params and of result, latency and outcome. Arguments and
results are kept in plaintext only when asked (``--audit-plaintext``).

The :class:`Auditor` keeps the LMDB commit off the hot path: in ``group`` mode
a background task drains what queued within a few milliseconds into one write
transaction that is not synced, and syncs periodically (a crash loses at most
the last interval of audit, never a tool call). In ``strict`` mode the caller
awaits its record being on disk; concurrent strict callers share one fsync.

The sink is the boundary: :class:`BlockLogSink` appends ``kind="mcp"`` records
to the node's block log, so audit records are sealed into signed blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from talos_sdk.canonical import canonical_json_bytes
from talos_sdk.errors import EncodingError

if TYPE_CHECKING:
    from talos.chain.log import BlockLog

__all__ = [
    "AuditMode",
    "AuditRecord",
    "AuditSink",
    "Auditor",
    "BlockLogSink",
    "digest",
]

log = logging.getLogger(__name__)

RECORD_KIND = "mcp"
# The block format's bounds (talos/chain/block.py MAX_COMMITMENT, MAX_EXTRA).
MAX_COMMITMENT = 4096
MAX_EXTRA = 4096


class AuditMode(enum.Enum):
    """``group``: commit off the hot path; ``strict``: the reply waits for its durable record."""

    GROUP = "group"
    STRICT = "strict"


def _stable_json(value: Any) -> bytes:
    """RFC 8785 bytes (DESIGN.md "Canonical encoding") so any JCS library recomputes them.

    JSON-RPC may carry integers JCS cannot represent exactly (beyond 2**53); such a
    value falls back to sorted-key JSON rather than losing the audit record.
    """
    try:
        return canonical_json_bytes(value)
    except EncodingError:
        try:
            return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
        except TypeError:  # beyond 64 bits: only the stdlib encoder takes it
            return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def digest(value: Any) -> bytes:
    """SHA-256 of a JSON value in its canonical form, so anyone can recompute it."""
    if value is None:
        return b""
    return hashlib.sha256(_stable_json(value)).digest()


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One audited call."""

    caller: str
    server: str
    method: str
    tool: str | None
    request_id: int | str
    params_sha256: bytes
    result_sha256: bytes
    latency_us: int
    outcome: str
    timestamp_ms: int
    plaintext: bytes = b""

    def commitment(self) -> bytes:
        """The bytes stored (and Merkle-hashed) for this record; bounded by the block format."""
        body: dict[str, Any] = {
            "caller": self.caller,
            "server": self.server,
            "method": self.method,
            "tool": self.tool,
            "id": self.request_id,
            "params_sha256": self.params_sha256.hex(),
            "result_sha256": self.result_sha256.hex(),
            "latency_us": self.latency_us,
            "outcome": self.outcome,
        }
        data = _stable_json(body)
        if len(data) > MAX_COMMITMENT:
            # Only a pathological method/tool name gets here; keep the hashes, drop the names.
            body["method"] = body["method"][:256]
            body["tool"] = None if self.tool is None else self.tool[:256]
            body["id"] = str(self.request_id)[:256]
            data = _stable_json(body)
        return data


class AuditSink(Protocol):
    """Where records go: ``write`` commits without fsync, ``sync`` makes it durable."""

    def write(self, records: Sequence[AuditRecord]) -> None: ...

    def sync(self) -> None: ...


class BlockLogSink:
    """Append audit records to the node's block log (authored by the node, unsigned)."""

    def __init__(self, block_log: BlockLog, node_did: str) -> None:
        self.block_log = block_log
        self.node_did = node_did

    def write(self, records: Sequence[AuditRecord]) -> None:
        from talos.chain.block import Record

        with self.block_log.store.write(durable=False) as txn:
            for rec in records:
                self.block_log.append(
                    Record(
                        kind=RECORD_KIND,
                        record_id=os.urandom(16),
                        sender=self.node_did,
                        recipient=rec.caller,
                        commitment=rec.commitment(),
                        signature=b"",
                        timestamp_ms=rec.timestamp_ms,
                        extra=rec.plaintext[:MAX_EXTRA],
                    ),
                    txn,
                )

    def sync(self) -> None:
        self.block_log.store.sync()


class Auditor:
    """Batches records into the sink off the hot path; see the module docstring."""

    def __init__(
        self,
        sink: AuditSink,
        *,
        mode: AuditMode = AuditMode.GROUP,
        plaintext: bool = False,
        sync_interval: float = 1.0,
        commit_interval: float = 0.005,
    ) -> None:
        self.sink = sink
        self.commit_interval = commit_interval
        self._timer: asyncio.TimerHandle | None = None
        self.mode = mode
        self.plaintext = plaintext
        self.sync_interval = sync_interval
        self._queue: list[AuditRecord] = []
        self._barriers: list[asyncio.Future[None]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._dirty = False
        self._stopping = False
        self.written = 0

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="mcp-audit")

    async def stop(self) -> None:
        """Write what is queued and sync, then stop."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            # Not cancelled: a write in a worker thread must finish before the final flush.
            self._stopping = True
            self._wake.set()
            await task
        await self._flush(durable=True)

    def submit(self, rec: AuditRecord) -> None:
        """Queue ``rec`` for the next group commit (never blocks)."""
        self._queue.append(rec)
        if self._timer is None and not self._wake.is_set():
            # Linger instead of waking per record: under sequential load a thread hop per
            # call would cost more than the call; a few ms of batching costs nothing.
            self._timer = asyncio.get_running_loop().call_later(
                self.commit_interval, self._wake.set
            )

    async def record_barrier(self) -> None:
        """Return once every record submitted so far is durable (``--audit strict``)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._barriers.append(fut)
        self._wake.set()
        await fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_sync = loop.time() + self.sync_interval
        while True:
            timeout = max(0.0, next_sync - loop.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._stopping:
                return
            due = loop.time() >= next_sync
            try:
                await self._flush(durable=due)
            except Exception:
                log.exception("audit write failed; records of this batch are lost")
            if due:
                next_sync = loop.time() + self.sync_interval

    async def _flush(self, *, durable: bool) -> None:
        batch, self._queue = self._queue, []
        barriers, self._barriers = self._barriers, []
        sync = bool(durable or barriers) and (self._dirty or bool(batch))
        try:
            if batch or sync:
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
        if batch:
            self.sink.write(batch)
            self.written += len(batch)
            self._dirty = True
        if sync:
            self._dirty = False
            self.sink.sync()
