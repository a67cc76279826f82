"""File transfer glue to the node (docs/PROTOCOL.md "File transfer"; ADR 0004).

:class:`TransferManager` speaks the control messages of
:mod:`talos.transfer.protocol` on the node's ratchet-sealed app channel
``"file"``, keeps every transfer in the store's ``transfers`` database (so a
restart of either node resumes from the last committed offset), moves the
bytes over the bulk TCP path (:mod:`talos.transfer.bulk`) or, if that cannot
connect, over the app channel itself, and appends one ``"file"`` record to the
block log when a transfer completes.

Failure policy: a broken connection or a chunk that fails authentication ends
the *attempt* (the sender re-offers and resumes from the receiver's last
committed offset; at most :data:`MAX_ATTEMPTS`). A size lie, a SHA-256
mismatch, a full disk or the quota end the *transfer*: the partial file is
deleted and the sender is told why.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Final, Protocol

import orjson
from pydantic import BaseModel, ConfigDict, Field

from talos.store import Store, Txn
from talos.transfer import bulk
from talos.transfer.protocol import (
    APP_NAME,
    BULK_CHUNK,
    FALLBACK_CHUNK,
    TID_LEN,
    Accept,
    Cancel,
    Chunk,
    Credit,
    Done,
    Event,
    Failed,
    Offer,
    Pending,
    Reject,
    TransferMessage,
    TransferProtocolError,
    TransferState,
    decode_message,
    encode_message,
    file_commitment,
    is_final,
    next_state,
    safe_name,
)
from talos.transfer.receiver import IncomingAttempt, IncomingFile
from talos.transfer.sender import OutgoingAttempt, Signer, file_size
from talos.writer import StoreWriter
from talos_sdk.errors import (
    DecryptionError,
    HandshakeError,
    ProtocolError,
    StorageError,
    TalosError,
    UsageError,
)
from talos_sdk.wallet import verify as verify_signature

__all__ = [
    "MAX_ATTEMPTS",
    "MAX_OPEN_OFFERS",
    "CreditExceededError",
    "TransferConfig",
    "TransferInfo",
    "TransferManager",
]

log = logging.getLogger("talos.transfer")

MAX_ATTEMPTS: Final = 5
#: Open incoming offers (offered, pending, active) one peer may hold; more are refused.
MAX_OPEN_OFFERS: Final = 64
_DB: Final = "transfers"
_OPEN_IN: Final = (TransferState.OFFERED, TransferState.PENDING, TransferState.ACTIVE)


class CreditExceededError(TransferProtocolError):
    """The sender sent a fallback chunk beyond the credit the receiver granted."""


class TransferConfig(BaseModel):
    """File-transfer settings of a node (pydantic: read from CLI flags / JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    files_dir: Path | None = Field(default=None, description="where received files land")
    auto_accept: tuple[str, ...] = Field(default=(), description="DIDs whose offers need no accept")
    quota_bytes: int = Field(default=64 << 30, ge=0, description="bytes of incoming files held")
    min_file_bytes: int = Field(
        default=64 << 10,
        ge=1,
        description="what each incoming file counts against the quota at least (its row, inode)",
    )
    max_rows_per_peer: int = Field(
        default=10_000,
        ge=1,
        description="incoming transfer rows kept per peer; the oldest ended ones are dropped",
    )
    bulk: bool = True
    bulk_host: str = "127.0.0.1"
    bulk_port: int = Field(default=0, ge=0, le=65535)
    window: int = Field(default=8, ge=1, le=1024, description="chunks in flight")
    checkpoint_bytes: int = Field(default=32 << 20, ge=1 << 16)
    retry_delay: float = Field(default=0.2, gt=0)


class AppNode(Protocol):
    """What the manager needs from :class:`talos.node.Node` (docs/ARCHITECTURE.md)."""

    @property
    def did(self) -> str: ...

    @property
    def store(self) -> Store: ...

    @property
    def writer(self) -> StoreWriter: ...

    @property
    def wallet(self) -> Any: ...

    def register_app(
        self, name: str, handler: Callable[[str, bytes], Awaitable[None] | None]
    ) -> None: ...

    async def send_app(self, did: str, name: str, payload: bytes) -> None: ...

    def on_link_change(self, callback: Callable[[str, bool], None]) -> None: ...

    def is_connected(self, did: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class TransferInfo:
    """One transfer as persisted in the ``transfers`` database."""

    tid: str
    direction: str  # "in" | "out"
    peer: str
    name: str
    size: int
    sha256: str
    key: str = ""  # hex; never leaves the node (not in to_public)
    signature: str = ""  # hex; the sender's signature over file_commitment
    state: TransferState = TransferState.OFFERED
    offset: int = 0  # in: bytes committed (fsync'd + recorded); out: bytes acknowledged
    epoch: int = 0
    attempts: int = 0
    path: str = ""
    error: str = ""
    created_ms: int = 0
    updated_ms: int = 0

    def to_public(self) -> dict[str, Any]:
        """JSON view for the CLI / control API (no key)."""
        data = asdict(self)
        del data["key"], data["signature"]
        data["state"] = self.state.value
        data["status"] = self.state.value
        data["from"] = self.peer if self.direction == "in" else ""
        data["to"] = self.peer if self.direction == "out" else ""
        return data

    def encode(self) -> bytes:
        data = asdict(self)
        data["state"] = self.state.value
        return orjson.dumps(data)

    @classmethod
    def decode(cls, raw: bytes) -> TransferInfo:
        data = orjson.loads(raw)
        data["state"] = TransferState(data["state"])
        return cls(**data)


@dataclass(slots=True)
class _Incoming:
    """Live receiving state of one attempt."""

    file: IncomingFile
    attempt: IncomingAttempt
    #: fallback chunks waiting for the worker thread; at most ``granted - received``
    queue: asyncio.Queue[bytes | Exception | None]
    #: fallback chunks the sender may have sent so far (the credit granted)
    granted: int
    #: fallback chunks taken in by :meth:`TransferManager._on_chunk`
    received: int = 0
    task: asyncio.Task[None] | None = None
    #: set by the receiving thread when it asks for a checkpoint, cleared when it is done
    syncing: bool = False
    sync_task: asyncio.Task[None] | None = None


class TransferManager:
    """Sends and receives files for one node."""

    def __init__(
        self, node: AppNode, files_dir: Path, config: TransferConfig | None = None
    ) -> None:
        self.node = node
        self.config = config or TransferConfig()
        self.files_dir = Path(files_dir)
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.listener: bulk.BulkListener | None = None
        self.block_log: Any = getattr(node, "log", None)
        self._incoming: dict[bytes, _Incoming] = {}
        self._sending: dict[bytes, asyncio.Task[None]] = {}
        self._credit: dict[bytes, tuple[int, asyncio.Event]] = {}
        self._waiters: dict[bytes, list[asyncio.Future[TransferInfo]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.progress: dict[bytes, int] = {}
        #: called as ``on_progress(tid, committed_offset)`` after each receiver checkpoint
        self.on_progress: Callable[[bytes, int], None] | None = None
        self.bytes_sent: dict[bytes, int] = {}
        self._stopped = False
        # Rows go to the store through the node's one writer, in order, so an fsync never
        # blocks the loop; rows queued but not yet committed are served from _unwritten.
        self._unwritten: dict[bytes, TransferInfo] = {}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Register the app channel, start the bulk listener, resume unfinished sends."""
        if self.config.bulk:
            self.listener = bulk.BulkListener(self.config.bulk_host, self.config.bulk_port)
            await self.listener.start()
        self.node.register_app(APP_NAME, self._on_app)
        self.node.on_link_change(self._on_link)
        for info in self.list():
            if (
                info.direction == "out"
                and not is_final(info.state)
                and self.node.is_connected(info.peer)
            ):
                self._spawn(self._offer(bytes.fromhex(info.tid)))

    async def stop(self) -> None:
        """Stop every transfer task; progress already committed survives."""
        self._stopped = True
        if self.listener is not None:
            await self.listener.close()
        tasks = [*self._tasks, *self._sending.values()]
        tasks += [i.task for i in self._incoming.values() if i.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for inc in self._incoming.values():
            await self._settle_checkpoint(inc)
            inc.file.close()
        self._incoming.clear()
        await self.node.writer.drain()  # every queued row is committed

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_link(self, did: str, up: bool) -> None:
        if not up or self._stopped:
            return
        for info in self.list():
            tid = bytes.fromhex(info.tid)
            if (
                info.direction == "out"
                and info.peer == did
                and not is_final(info.state)
                and tid not in self._sending
            ):
                self._spawn(self._offer(tid))

    # ------------------------------------------------------------------ store

    def get(self, tid: str | bytes) -> TransferInfo:
        """The transfer with id ``tid`` (hex or bytes); :class:`UsageError` if unknown."""
        key = bytes.fromhex(tid) if isinstance(tid, str) else tid
        queued = self._unwritten.get(key)
        if queued is not None:
            return queued
        with self.node.store.read() as txn:
            raw = txn.get(_DB, key)
        if raw is None:
            raise UsageError(f"no transfer with id {key.hex()}")
        return TransferInfo.decode(raw)

    def list(self) -> list[TransferInfo]:
        """Every transfer, oldest first."""
        with self.node.store.read() as txn:
            rows = {k: TransferInfo.decode(v) for k, v in txn.items(_DB)}
        rows.update(self._unwritten)
        return sorted(rows.values(), key=lambda i: (i.created_ms, i.tid))

    async def _save(
        self, info: TransferInfo, durable: bool = True, *, notify: bool = True
    ) -> TransferInfo:
        """Persist ``info``; returns once committed (and fsync'd if ``durable``).

        The row is visible to :meth:`get` at once, so read-modify-write steps on
        the loop stay ordered; the LMDB write lock and the fsync are taken on
        the manager's writer thread, never on the loop.
        """
        info = replace(info, updated_ms=int(time.time() * 1000))
        key = bytes.fromhex(info.tid)
        self._unwritten[key] = info

        row = info.encode()

        def written(_: object) -> None:
            if self._unwritten.get(key) is info:
                del self._unwritten[key]

        await self.node.writer.submit(
            lambda txn: txn.put(_DB, key, row), durable=durable, then=written, kind="transfer"
        )
        if notify:
            self._notify(info)
        return info

    def _notify(self, info: TransferInfo) -> None:
        """Wake :meth:`wait` callers once ``info`` is final."""
        if is_final(info.state):
            for waiter in self._waiters.pop(bytes.fromhex(info.tid), []):
                if not waiter.done():
                    waiter.set_result(info)

    async def _move(
        self, info: TransferInfo, event: Event, *, notify: bool = True, **changes: Any
    ) -> TransferInfo:
        info = replace(info, state=next_state(info.state, event), **changes)
        return await self._save(info, notify=notify)

    async def wait(self, tid: str | bytes, timeout: float | None = None) -> TransferInfo:
        """Until the transfer reaches a final state (even one not offered yet); returns it."""
        key = bytes.fromhex(tid) if isinstance(tid, str) else tid
        with contextlib.suppress(UsageError):  # not offered yet: wait for it to appear
            info = self.get(key)
            if is_final(info.state):
                return info
        fut: asyncio.Future[TransferInfo] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(fut)
        async with asyncio.timeout(timeout):
            return await fut

    async def _send(self, did: str, msg: TransferMessage) -> None:
        try:
            await self.node.send_app(did, APP_NAME, encode_message(msg))
        except (TalosError, OSError, ConnectionError) as exc:
            log.info("transfer message to %s not sent: %s", did, exc)

    # ------------------------------------------------------------------ sending

    async def send_file(self, did: str, path: Path | str, name: str | None = None) -> str:
        """Offer ``path`` to ``did`` (as ``name``, default its base name); returns the id (hex).

        The transfer resumes by itself after a link drop or a restart of either node.
        """
        path = Path(path).resolve()
        try:
            # No hashing pass here: the digest is computed while the bytes stream.
            size = await asyncio.to_thread(file_size, path)
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror}") from None
        now = int(time.time() * 1000)
        tid = os.urandom(TID_LEN)
        info = TransferInfo(
            tid=tid.hex(),
            direction="out",
            peer=did,
            name=path.name if name is None else name,
            size=size,
            sha256="",  # known once the stream's commit chunk is sealed
            key=os.urandom(32).hex(),
            path=str(path),
            created_ms=now,
        )
        await self._save(info)
        if self.node.is_connected(did):
            await self._offer(bytes.fromhex(info.tid))
        return info.tid

    async def _offer(self, tid: bytes) -> None:
        info = self.get(tid)
        if is_final(info.state):
            return
        await self._send(info.peer, Offer(tid, info.size, bytes.fromhex(info.key), info.name))

    async def _on_accept(self, peer: str, msg: Accept, info: TransferInfo) -> None:
        if info.direction != "out" or is_final(info.state):
            return
        if not 0 <= msg.offset <= info.size:
            await self._fail_out(info, f"receiver asked to resume at {msg.offset}")
            return
        info = await self._move(info, Event.ACCEPT, epoch=msg.epoch, offset=msg.offset)
        old = self._sending.pop(msg.tid, None)
        if old is not None:
            old.cancel()
        task = asyncio.ensure_future(self._run_send(info, msg))
        self._sending[msg.tid] = task
        task.add_done_callback(functools.partial(self._sent_done, msg.tid))

    def _sent_done(self, tid: bytes, task: asyncio.Task[None]) -> None:
        if self._sending.get(tid) is task:
            del self._sending[tid]

    async def _run_send(self, info: TransferInfo, msg: Accept) -> None:
        tid = msg.tid
        try:
            if msg.bulk_port and await self._send_bulk(info, msg):
                return
            await self._send_fallback(info, msg)
        except asyncio.CancelledError:
            raise
        except TalosError as exc:  # source changed, etc.: the transfer cannot go on
            await self._fail_out(self.get(tid), str(exc))
            await self._send(info.peer, Cancel(tid, str(exc)))
        except (OSError, ConnectionError, asyncio.IncompleteReadError) as exc:
            log.info("transfer %s attempt %d broke: %s", tid.hex(), msg.epoch, exc)
            await self._retry_later(tid)
        finally:
            # Deregister now, not in a done callback: a link-up handled in between
            # would see a send still "running" and not re-offer.
            if self._sending.get(tid) is asyncio.current_task():
                del self._sending[tid]

    async def _retry_later(self, tid: bytes) -> None:
        await asyncio.sleep(self.config.retry_delay)
        info = self.get(tid)
        if not is_final(info.state) and self.node.is_connected(info.peer):
            await self._offer(tid)

    def _count(self, tid: bytes) -> Callable[[int], None]:
        def on_sent(n: int) -> None:
            self.bytes_sent[tid] = self.bytes_sent.get(tid, 0) + n

        return on_sent

    def _signer(self, info: TransferInfo) -> Signer:
        """Sign the file commitment for the commit chunk, persisting it before it is sent.

        Called from the sending thread; the digest and signature are saved on
        the loop (the store's writer) and the thread waits for that, so a DONE
        that arrives later, even after a restart, finds them recorded.
        """
        loop = asyncio.get_running_loop()
        tid = bytes.fromhex(info.tid)

        async def save(digest: bytes, signature: bytes) -> None:
            current = self.get(tid)
            await self._save(replace(current, sha256=digest.hex(), signature=signature.hex()))

        def sign(digest: bytes) -> bytes:
            commitment = file_commitment(tid, digest, info.size, self.node.did, info.peer)
            signature: bytes = self.node.wallet.sign(commitment)
            asyncio.run_coroutine_threadsafe(save(digest, signature), loop).result()
            return signature

        return sign

    async def _send_bulk(self, info: TransferInfo, msg: Accept) -> bool:
        """True if the bulk path carried the attempt to a verdict; False to fall back."""
        out = OutgoingAttempt(
            Path(info.path), info.size, bytes.fromhex(info.key), msg.tid, msg.epoch, msg.offset,
            BULK_CHUNK, self._signer(info),
        )  # fmt: skip
        try:
            try:
                stream = await bulk.connect_bulk(msg.bulk_host, msg.bulk_port, msg.tid, msg.token)
            except (OSError, TimeoutError, HandshakeError) as exc:
                log.info("bulk path to %s unavailable (%s); using the app channel", info.peer, exc)
                return False
            try:
                verified = await bulk.send_chunks(
                    stream, out.seal_next_into, out.sealed_max, msg.window, self._count(msg.tid)
                )
            finally:
                await stream.close()
        finally:
            out.close()
        if not verified:
            await self._retry_later(msg.tid)
        return True

    async def _send_fallback(self, info: TransferInfo, msg: Accept) -> None:
        tid = msg.tid
        event = asyncio.Event()
        self._credit[tid] = (msg.window, event)
        out = OutgoingAttempt(
            Path(info.path), info.size, bytes.fromhex(info.key), tid, msg.epoch, msg.offset,
            FALLBACK_CHUNK, self._signer(info),
        )  # fmt: skip
        count = self._count(tid)
        try:
            while not out.finished:
                index = out.index
                while index >= self._credit[tid][0]:
                    event.clear()
                    await event.wait()
                sealed = await asyncio.to_thread(out.next_sealed)
                await self.node.send_app(
                    info.peer, APP_NAME, encode_message(Chunk(tid, msg.epoch, index, sealed))
                )
                count(len(sealed))
        finally:
            out.close()
            self._credit.pop(tid, None)

    def _on_credit(self, msg: Credit) -> None:
        entry = self._credit.get(msg.tid)
        if entry is not None and msg.upto > entry[0]:
            self._credit[msg.tid] = (msg.upto, entry[1])
            entry[1].set()

    async def _fail_out(self, info: TransferInfo, reason: str) -> None:
        if not is_final(info.state):
            await self._save(replace(info, state=TransferState.FAILED, error=reason))

    # ------------------------------------------------------------------ receiving

    def _charge(self, size: int) -> int:
        """What a file of ``size`` bytes costs against the quota: tiny and empty files
        still cost a row and an inode, so each counts at least ``min_file_bytes``."""
        return max(size, self.config.min_file_bytes)

    def _quota_used(self, rows: Iterable[TransferInfo]) -> int:
        held = (TransferState.PENDING, TransferState.ACTIVE, TransferState.COMPLETE)
        return sum(self._charge(i.size) for i in rows if i.direction == "in" and i.state in held)

    async def _make_room(self, peer: str, rows: Iterable[TransferInfo]) -> bool:
        """Keep ``peer``'s incoming rows under ``max_rows_per_peer`` by forgetting its
        oldest ended transfers that hold no file; False if no room can be made."""
        mine = [i for i in rows if i.peer == peer and i.direction == "in"]
        excess = len(mine) - self.config.max_rows_per_peer + 1
        if excess <= 0:
            return True
        ended = (TransferState.FAILED, TransferState.REJECTED, TransferState.CANCELLED)
        drop = [bytes.fromhex(i.tid) for i in mine if i.state in ended][:excess]
        if len(drop) < excess:
            return False

        def forget(txn: Txn) -> None:
            for key in drop:
                txn.delete(_DB, key)

        await self.node.writer.write(forget, kind="transfer")
        return True

    async def _on_offer(self, peer: str, msg: Offer) -> None:
        try:
            info: TransferInfo | None = self.get(msg.tid)
        except UsageError:
            info = None
        if info is not None:
            if info.peer != peer or info.direction != "in":
                return  # a tid collision or another peer replaying it: ignore
            await self._answer_known(info)
            return
        name = safe_name(msg.name)
        now = int(time.time() * 1000)
        info = TransferInfo(
            tid=msg.tid.hex(),
            direction="in",
            peer=peer,
            name=name,
            size=msg.size,
            sha256="",  # from the sender's commit chunk, once verified
            key=msg.key.hex(),
            created_ms=now,
        )
        reason = ""
        rows = self.list()
        if sum(i.peer == peer and i.direction == "in" and i.state in _OPEN_IN for i in rows) >= (
            MAX_OPEN_OFFERS
        ):
            reason = f"too many open offers from this peer (limit {MAX_OPEN_OFFERS})"
        elif self._quota_used(rows) + self._charge(msg.size) > self.config.quota_bytes:
            reason = (
                f"quota exceeded: {msg.size} bytes offered (counts as "
                f"{self._charge(msg.size)}), quota {self.config.quota_bytes}"
            )
        elif not await self._make_room(peer, rows):
            reason = (
                f"too many transfers kept from this peer "
                f"(limit {self.config.max_rows_per_peer}, none ended without a file)"
            )
        elif shutil.disk_usage(self.files_dir).free < msg.size:
            reason = f"not enough disk space for {msg.size} bytes"
        if reason:
            # No row for a refusal: a peer's offers cannot grow the store without bound.
            log.info("transfer %s from %s refused: %s", info.tid, peer, reason)
            await self._send(peer, Reject(msg.tid, reason))
            return
        info = await self._save(info)
        if peer in self.config.auto_accept:
            await self._start_attempt(info)
        else:
            await self._move(info, Event.HOLD)
            await self._send(peer, Pending(msg.tid))

    async def _answer_known(self, info: TransferInfo) -> None:
        tid = bytes.fromhex(info.tid)
        if info.state is TransferState.COMPLETE:
            await self._send(info.peer, Done(tid))
        elif info.state is TransferState.PENDING:
            await self._send(info.peer, Pending(tid))
        elif info.state is TransferState.ACTIVE:
            await self._start_attempt(info)
        else:
            await self._send(info.peer, Reject(tid, info.error or info.state.value))

    async def accept(self, tid: str | bytes) -> TransferInfo:
        """Accept a pending incoming transfer (``talosd files accept ID``)."""
        info = self.get(tid)
        if info.direction != "in" or info.state is not TransferState.PENDING:
            raise UsageError(f"transfer {info.tid} is not a pending incoming transfer")
        await self._start_attempt(info)
        return self.get(tid)

    async def reject(self, tid: str | bytes, reason: str = "declined") -> TransferInfo:
        """Refuse a pending incoming transfer."""
        info = self.get(tid)
        if info.direction != "in" or info.state is not TransferState.PENDING:
            raise UsageError(f"transfer {info.tid} is not a pending incoming transfer")
        info = await self._move(info, Event.REJECT, error=reason)
        await self._send(info.peer, Reject(bytes.fromhex(info.tid), reason))
        return info

    async def _start_attempt(self, info: TransferInfo) -> None:
        tid = bytes.fromhex(info.tid)
        await self._end_incoming(tid)
        if info.attempts >= MAX_ATTEMPTS:
            await self._fail_in(info, f"gave up after {info.attempts} attempts")
            return
        epoch = info.epoch + 1
        try:
            file = await asyncio.to_thread(
                IncomingFile, self.files_dir, tid, info.size, info.offset
            )
        except StorageError as exc:
            await self._fail_in(info, str(exc))
            return
        attempt = IncomingAttempt(file, bytes.fromhex(info.key), tid, epoch)
        info = await self._move(info, Event.ACCEPT, epoch=epoch, attempts=info.attempts + 1)
        window = self.config.window
        # +1: room for the credit-violation error behind a full window
        inc = _Incoming(file, attempt, asyncio.Queue(maxsize=window + 1), granted=window)
        self._incoming[tid] = inc
        port, token, host = 0, b"", ""
        if self.listener is not None:
            token = os.urandom(32)
            port, host = self.listener.port, self.config.bulk_host
            self.listener.expect(tid, token, lambda s: self._receive_bulk(tid, inc, s))
        inc.task = asyncio.ensure_future(self._receive_fallback(tid, inc))
        accept = Accept(tid, info.offset, epoch, self.config.window, port, token, host)
        await self._send(info.peer, accept)

    async def _end_incoming(self, tid: bytes) -> None:
        inc = self._incoming.pop(tid, None)
        if self.listener is not None:
            self.listener.forget(tid)
        if inc is None:
            return
        if inc.task is not None and inc.task is not asyncio.current_task():
            inc.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await inc.task
        await self._settle_checkpoint(inc)
        inc.file.close()

    def _checkpoint_trigger(self, tid: bytes, inc: _Incoming) -> Callable[[], None]:
        """Per-chunk hook (receiving thread or loop): start a checkpoint when one is due.

        The checkpoint fsyncs in a worker thread while chunks keep arriving and
        being written; the stream never waits for it (ADR 0004). Only the offset
        written before that fsync started is recorded, after it completed.
        """
        loop = asyncio.get_running_loop()
        every = self.config.checkpoint_bytes

        def trigger() -> None:
            if not inc.syncing and inc.file.written - inc.file.synced >= every:
                inc.syncing = True
                loop.call_soon_threadsafe(self._start_checkpoint, tid, inc)

        return trigger

    def _start_checkpoint(self, tid: bytes, inc: _Incoming) -> None:
        inc.sync_task = asyncio.ensure_future(self._checkpoint(tid, inc))

    async def _checkpoint(self, tid: bytes, inc: _Incoming) -> None:
        try:
            offset = await asyncio.to_thread(inc.file.sync)
        except StorageError as exc:  # the next write reports it to the attempt
            log.warning("transfer %s checkpoint failed: %s", tid.hex(), exc)
            return
        finally:
            inc.syncing = False
        self.progress[tid] = offset
        if self._incoming.get(tid) is inc:
            await self._save(replace(self.get(tid), offset=offset))
        if self.on_progress is not None:
            self.on_progress(tid, offset)

    @staticmethod
    async def _settle_checkpoint(inc: _Incoming) -> None:
        """Wait for an in-flight checkpoint before the file is finished or closed."""
        task = inc.sync_task
        if task is not None and task is not asyncio.current_task():
            await asyncio.gather(task, return_exceptions=True)

    async def _receive_bulk(self, tid: bytes, inc: _Incoming, stream: bulk.BulkStream) -> None:
        if inc.task is not None:  # the bulk path won: no fallback chunks for this attempt
            inc.task.cancel()
        inc.task = asyncio.current_task()
        try:
            await bulk.receive_chunks(
                stream,
                inc.attempt.process_into,
                self.config.window,
                self._checkpoint_trigger(tid, inc),
            )
            verified = await self._finish(tid, inc)
            await bulk.send_verdict(stream, verified)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._attempt_failed(tid, inc, exc)
            await bulk.send_verdict(stream, False)
        finally:
            await stream.close()

    async def _receive_fallback(self, tid: bytes, inc: _Incoming) -> None:
        window = self.config.window
        processed = 0
        peer = self.get(tid).peer
        trigger = self._checkpoint_trigger(tid, inc)
        try:
            while True:
                sealed = await inc.queue.get()
                if sealed is None:
                    return
                if isinstance(sealed, Exception):
                    raise sealed
                final = await asyncio.to_thread(inc.attempt.process, sealed)
                processed += 1
                trigger()
                if final:
                    await self._finish(tid, inc)
                    return
                if processed + window - inc.granted >= max(1, window // 4):
                    inc.granted = processed + window
                    await self._send(peer, Credit(tid, inc.attempt.epoch, inc.granted))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._attempt_failed(tid, inc, exc)

    def _on_chunk(self, peer: str, msg: Chunk) -> None:
        """Queue one fallback chunk, within the credit granted (docs/PROTOCOL.md "File transfer").

        A sender that ignores its credit would otherwise grow this queue without
        bound; the first chunk beyond it ends the transfer with a clear error.
        """
        inc = self._incoming.get(msg.tid)
        if inc is None or inc.attempt.epoch != msg.epoch or self.get(msg.tid).peer != peer:
            return
        if inc.received < 0:
            return  # already refused; the worker is failing the transfer
        if msg.index >= inc.granted or inc.received >= inc.granted:
            error = CreditExceededError(
                f"sender exceeded its credit: chunk {max(msg.index, inc.received)} "
                f"sent with credit for {inc.granted} chunks"
            )
            inc.received = -1
            inc.queue.put_nowait(error)
            return
        inc.received += 1
        inc.queue.put_nowait(msg.sealed)

    async def _finish(self, tid: bytes, inc: _Incoming) -> bool:
        """Check the sender's commit (signature, then SHA-256) and make the file visible."""
        await self._settle_checkpoint(inc)
        info = self.get(tid)
        assert inc.attempt.commit is not None  # set with the final chunk
        digest, signature = inc.attempt.commit
        commitment = file_commitment(tid, digest, info.size, info.peer, self.node.did)
        try:
            if not verify_signature(info.peer, commitment, signature):
                raise TransferProtocolError("the sender's commit signature does not verify")
            path = await asyncio.to_thread(inc.file.finish, digest, info.name)
        except (TransferProtocolError, StorageError) as exc:
            await self._fail_in(info, str(exc))
            return False
        self._incoming.pop(tid, None)
        if self.listener is not None:
            self.listener.forget(tid)
        info = await self._move(
            info,
            Event.DONE,
            notify=False,  # not before the block-log record is written
            offset=info.size,
            path=str(path),
            sha256=digest.hex(),
            signature=signature.hex(),
        )
        await self._record(info, sender=info.peer, recipient=self.node.did)
        self._notify(info)
        await self._send(info.peer, Done(tid))
        return True

    async def _attempt_failed(self, tid: bytes, inc: _Incoming, exc: BaseException) -> None:
        info = self.get(tid)
        if isinstance(
            exc, DecryptionError | OSError | ConnectionError | asyncio.IncompleteReadError
        ):
            # The bytes were damaged or cut in transit: keep what is committed, let the sender
            # come back for another attempt from there.
            log.warning("transfer %s attempt %d failed: %r", info.tid, info.epoch, exc)
            if self._incoming.get(tid) is inc:
                await self._end_incoming(tid)
            return
        reason = str(exc) if isinstance(exc, TalosError) else f"internal error: {exc!r}"
        await self._fail_in(info, reason)

    async def _fail_in(self, info: TransferInfo, reason: str) -> None:
        tid = bytes.fromhex(info.tid)
        inc = self._incoming.pop(tid, None)
        if self.listener is not None:
            self.listener.forget(tid)
        if inc is not None:
            await self._settle_checkpoint(inc)
            inc.file.discard()
        else:
            (self.files_dir / ".partial" / f"{info.tid}.part").unlink(missing_ok=True)
        if not is_final(info.state):
            await self._save(replace(info, state=TransferState.FAILED, error=reason))
        await self._send(info.peer, Failed(tid, reason))

    # ------------------------------------------------------------------ both

    async def _record(self, info: TransferInfo, sender: str, recipient: str) -> None:
        """One block-log record per completed transfer: sha256, size, parties.

        Both nodes log the sender's own signature over :func:`file_commitment`,
        so the receiver's record is as non-repudiable as a message record.
        """
        if self.block_log is None:
            return
        from talos.chain.block import Record

        tid = bytes.fromhex(info.tid)
        commitment = file_commitment(tid, bytes.fromhex(info.sha256), info.size, sender, recipient)
        record = Record(
            kind="file",
            record_id=tid,
            sender=sender,
            recipient=recipient,
            commitment=commitment,
            signature=bytes.fromhex(info.signature),
            timestamp_ms=int(time.time() * 1000),
            extra=info.name.encode(),
        )
        try:
            await self.node.writer.write(
                lambda txn: self.block_log.append(record, txn), kind="transfer"
            )
        except TalosError as exc:
            log.error("transfer %s: block log record not written: %s", info.tid, exc)

    async def _on_app(self, peer: str, payload: bytes) -> None:
        try:
            msg = decode_message(payload)
        except ProtocolError as exc:
            log.warning("bad transfer message from %s: %s", peer, exc)
            return
        if isinstance(msg, Offer):
            await self._on_offer(peer, msg)
            return
        if isinstance(msg, Chunk):
            self._on_chunk(peer, msg)
            return
        if isinstance(msg, Credit):
            self._on_credit(msg)
            return
        try:
            info = self.get(msg.tid)
        except UsageError:
            return
        if info.peer != peer:
            return
        try:
            await self._on_control(peer, msg, info)
        except TransferProtocolError as exc:
            log.info("transfer %s: ignored %s: %s", info.tid, type(msg).__name__, exc)

    async def _on_control(self, peer: str, msg: TransferMessage, info: TransferInfo) -> None:
        if isinstance(msg, Accept):
            await self._on_accept(peer, msg, info)
        elif isinstance(msg, Pending) and info.direction == "out":
            if info.state is TransferState.OFFERED:
                await self._move(info, Event.HOLD)
        elif isinstance(msg, Done) and info.direction == "out" and not is_final(info.state):
            # Waiters hear of completion once the block-log record is written too.
            info = await self._move(info, Event.DONE, notify=False, offset=info.size)
            await self._record(info, sender=self.node.did, recipient=peer)
            self._notify(info)
        elif isinstance(msg, Reject) and info.direction == "out":
            await self._move(info, Event.REJECT, error=msg.reason)
        elif isinstance(msg, Failed) and info.direction == "out":
            await self._fail_out(info, msg.reason)
        elif isinstance(msg, Cancel) and not is_final(info.state):
            if info.direction == "in":
                await self._end_incoming(bytes.fromhex(info.tid))
                (self.files_dir / ".partial" / f"{info.tid}.part").unlink(missing_ok=True)
            await self._move(info, Event.CANCEL, error=msg.reason)
