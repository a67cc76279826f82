"""Audit of the tunnel (docs/DESIGN.md "MCP tunnel": every call audited; "group commit").

docs/PROTOCOL.md "MCP tunnel, audit record" defines the record. Every event
of a serve side becomes an :class:`AuditRecord`:

* ``call``: a caller's request and how it ended (``ok``, ``error``,
  ``tool-error``, ``denied``, ``cancelled``, ``malformed``, ``tool-exited``,
  ``link-down``, ``refused-notification``);
* ``request``: a request the tool sent to the caller (sampling, elicitation,
  roots) and the caller's answer;
* ``session``: ``open`` (or its refusal), ``close`` and the tool process's
  ``exit`` (pid, exit code, why);
* ``refusal``: a message refused before any tool saw it (not JSON-RPC, a frame
  for a session the peer does not own).

Parameters and results are committed as HMAC-SHA256 under the node's audit key
(:class:`AuditKey`, 32 random bytes kept 0600 in the home), over their RFC 8785
form: whoever holds the key can prove what was called, while a reader of the
log cannot recover small arguments by hashing guesses. Arguments and results
are kept in plaintext only when asked (``--audit-plaintext``).

The :class:`Auditor` keeps the LMDB commit off the hot path: in ``group`` mode
a background task drains what queued within a few milliseconds into one write
transaction that is not synced, and syncs periodically (a crash loses at most
the last interval of audit, never a tool call). In ``strict`` mode the caller
awaits its record being on disk; concurrent strict callers share one fsync.

The sink is the boundary: :class:`BlockLogSink` appends ``kind="mcp"`` records
to the node's block log, so audit records are sealed into signed blocks; an
attached serve's :class:`~mcp_proxy.node_audit.NodeAuditSink` (an
:class:`AsyncAuditSink`) has the running node append them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import hmac
import json
import logging
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

import orjson

from talos.logging import event
from talos_sdk.canonical import canonical_json_bytes
from talos_sdk.errors import EncodingError, UsageError

if TYPE_CHECKING:
    from talos.chain.log import BlockLog
    from talos.store import Txn
    from talos.writer import StoreWriter

__all__ = [
    "AUDIT_KEY_FILE",
    "AsyncAuditSink",
    "AuditKey",
    "AuditMode",
    "AuditRecord",
    "AuditSink",
    "Auditor",
    "BlockLogSink",
    "Event",
]

log = logging.getLogger(__name__)

RECORD_KIND: Final = "mcp"
RECORD_VERSION: Final = 2
AUDIT_KEY_FILE: Final = "proxy-audit.key"
# The block format's bounds (talos/chain/block.py MAX_COMMITMENT, MAX_EXTRA).
MAX_COMMITMENT = 4096
MAX_EXTRA = 4096
# A reason or name in a record is cut here: records must fit the block format.
MAX_TEXT = 256


class AuditMode(enum.Enum):
    """``group``: commit off the hot path; ``strict``: the reply waits for its durable record."""

    GROUP = "group"
    STRICT = "strict"


class Event(enum.StrEnum):
    """What an audit record is about (docs/PROTOCOL.md "MCP tunnel, audit record")."""

    CALL = "call"
    REQUEST = "request"
    SESSION = "session"
    REFUSAL = "refusal"


def _stable_json(value: Any) -> bytes:
    """RFC 8785 bytes (docs/DESIGN.md "Canonical encoding") so any JCS library recomputes them.

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


class AuditKey:
    """The node's audit key: params and results are committed as HMAC-SHA256 under it."""

    __slots__ = ("_mac",)

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise UsageError("an audit key is 32 bytes")
        # Keyed once; each digest copies the keyed state (no re-keying per call).
        self._mac = hmac.new(key, digestmod=hashlib.sha256)

    @classmethod
    def generate(cls) -> AuditKey:
        return cls(secrets.token_bytes(32))

    @classmethod
    def load(cls, home: Path) -> AuditKey:
        """The key in ``home`` (``proxy-audit.key``, hex), created 0600 on first use."""
        path = home / AUDIT_KEY_FILE
        try:
            text = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            key = secrets.token_bytes(32)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="ascii") as fh:
                fh.write(key.hex() + "\n")
            tmp.replace(path)
            return cls(key)
        try:
            return cls(bytes.fromhex(text))
        except ValueError:
            raise UsageError(f"{path} does not hold a 64-hex-digit audit key") from None

    def digest(self, value: Any) -> bytes:
        """HMAC-SHA256 of a JSON value's canonical form; empty for an absent value."""
        if value is None:
            return b""
        mac = self._mac.copy()
        mac.update(_stable_json(value))
        return mac.digest()


def _cut(text: str | None) -> str | None:
    return None if text is None else text[:MAX_TEXT]


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One audited event (see the module docstring for events and outcomes)."""

    caller: str
    server: str
    method: str
    tool: str | None
    request_id: int | str | None
    params_hmac: bytes
    result_hmac: bytes
    latency_us: int
    outcome: str
    timestamp_ms: int
    plaintext: bytes = b""
    event: Event = Event.CALL
    session: int = 0
    pid: int | None = None
    detail: str = ""

    def commitment(self) -> bytes:
        """The bytes stored (and Merkle-hashed) for this record; bounded by the block format."""
        body: dict[str, Any] = {
            "v": RECORD_VERSION,
            "event": str(self.event),
            "caller": self.caller,
            "server": self.server,
            "session": self.session,
            "pid": self.pid,
            "method": self.method,
            "tool": self.tool,
            "id": self.request_id,
            "params_hmac": self.params_hmac.hex(),
            "result_hmac": self.result_hmac.hex(),
            "latency_us": self.latency_us,
            "outcome": self.outcome,
            "detail": self.detail,
        }
        data = _stable_json(body)
        if len(data) > MAX_COMMITMENT:
            # Only a pathological name gets here; keep the digests, cut the names.
            body["server"] = _cut(self.server)
            body["method"] = _cut(self.method)
            body["tool"] = _cut(self.tool)
            body["id"] = _cut(None if self.request_id is None else str(self.request_id))
            body["detail"] = _cut(self.detail)
            data = _stable_json(body)
        return data


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
        from talos.chain.block import Record

        # One getrandom for the batch, not one per record (11k syscalls in 6 s at 64 in flight).
        ids = os.urandom(16 * len(records))

        def append_all(txn: Txn) -> None:
            for i, rec in enumerate(records):
                self.block_log.append(
                    Record(
                        kind=RECORD_KIND,
                        record_id=ids[16 * i : 16 * i + 16],
                        sender=self.node_did,
                        recipient=rec.caller,
                        commitment=rec.commitment(),
                        signature=b"",
                        timestamp_ms=rec.timestamp_ms,
                        extra=rec.plaintext[:MAX_EXTRA],
                    ),
                    txn,
                )

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
        commit_interval: float = 0.005,
    ) -> None:
        self.sink = sink
        self.commit_interval = commit_interval
        self._timer: asyncio.TimerHandle | None = None
        self.mode = mode
        # A key of its own when none is given (tests): digests then prove nothing later.
        self.key = key if key is not None else AuditKey.generate()
        self.plaintext = plaintext
        self.sync_interval = sync_interval
        self._queue: list[AuditRecord] = []
        self._barriers: list[asyncio.Future[None]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._dirty = False
        self._stopping = False
        self.written = 0
        # Cached: asyncio.get_running_loop() costs a getpid() per call on Python 3.11.
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
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
            loop = self._loop or asyncio.get_running_loop()
            self._timer = loop.call_later(self.commit_interval, self._wake.set)

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
            except Exception as exc:  # the writer goes on; this batch's records are lost
                event(log, "audit_write_failed", logging.ERROR, records="lost", error=repr(exc))
            if due:
                next_sync = loop.time() + self.sync_interval

    async def _flush(self, *, durable: bool) -> None:
        batch, self._queue = self._queue, []
        barriers, self._barriers = self._barriers, []
        sync = bool(durable or barriers) and (self._dirty or bool(batch))
        sink = self.sink
        try:
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
        self.written += count
        if sync:
            self._dirty = False
        elif count:
            self._dirty = True
