"""Transfer rows and what the parts of the transfer manager share
(docs/PROTOCOL.md "File transfer").

:class:`TransferInfo` is one row of the store's ``transfers`` database;
:class:`TransferBase` holds the manager's shared state and its row access
(read, write through the node's one writer, wait for a final state).
Sending is :mod:`talos.transfer.outgoing`, receiving
:mod:`talos.transfer.incoming`, the app channel and lifecycle
:mod:`talos.transfer.manager`, the API routes :mod:`talos.transfer.routes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

import orjson

from talos.apphost import AppHost
from talos.config import TransferConfig  # re-exported: the transfer parts take it from here
from talos.transfer import bulk
from talos.transfer.protocol import (
    APP_NAME,
    Event,
    TransferMessage,
    TransferState,
    encode_message,
    is_final,
    next_state,
)
from talos.transfer.receiver import IncomingAttempt, IncomingFile
from talos_sdk.errors import (
    TalosError,
    UsageError,
)

__all__ = [
    "MAX_ATTEMPTS",
    "MAX_OPEN_OFFERS",
    "AppNode",
    "IncomingState",
    "TransferBase",
    "TransferConfig",
    "TransferInfo",
    "TransferLock",
]

log = logging.getLogger("talos.transfer")

MAX_ATTEMPTS: Final = 5
#: Open incoming offers (offered, pending, active) one peer may hold; more are refused.
MAX_OPEN_OFFERS: Final = 64
_DB: Final = "transfers"
_OPEN_IN: Final = (TransferState.OFFERED, TransferState.PENDING, TransferState.ACTIVE)


class AppNode(AppHost, Protocol):
    """What the manager needs from :class:`talos.node.Node`: an app host that signs."""

    @property
    def wallet(self) -> Any: ...


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
class IncomingState:
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
    #: offered the bulk path (counted against incoming.MAX_BULK_RECEIVES)
    bulk: bool = False
    #: the sender's bulk stream is attached
    streaming: bool = False
    #: the link (its channel binding) the attempt's ACCEPT went out on
    binding: bytes = b""
    #: set by the receiving thread when it asks for a checkpoint, cleared when it is done
    syncing: bool = False
    sync_task: asyncio.Task[None] | None = None


@dataclass(eq=False)
class TransferLock:
    """One transfer's turn (:meth:`TransferBase._one_at_a_time`), kept while in use."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


@dataclass(eq=False)
class CreditGate:
    """One app-channel attempt's credit: chunks with index < ``upto`` may be sent.

    Each attempt has its own gate, so a cancelled attempt still winding down cannot
    take away, or be granted, the credit of the attempt that replaced it.
    """

    epoch: int
    upto: int
    event: asyncio.Event = field(default_factory=asyncio.Event)


class TransferBase:
    """The manager's shared state and row access (see the module docstring)."""

    node: AppNode
    config: TransferConfig
    files_dir: Path
    private_dir: Path | None
    listener: bulk.BulkListener | None
    block_log: Any
    _incoming: dict[bytes, IncomingState]
    _sending: dict[bytes, asyncio.Task[None]]
    _credit: dict[bytes, CreditGate]
    _waiters: dict[bytes, list[asyncio.Future[TransferInfo]]]
    _tasks: set[asyncio.Task[Any]]
    on_progress: Callable[[bytes, int], None] | None
    bytes_sent: dict[bytes, int]
    _stopped: bool
    _unwritten: dict[bytes, TransferInfo]
    _rows: dict[bytes, TransferInfo] | None
    _turns: dict[bytes, TransferLock]
    _disk_turn: asyncio.Lock
    _streaming: set[bytes]

    if TYPE_CHECKING:
        # Defined by another part of the manager.
        def _spawn(self, coro: Awaitable[Any]) -> None: ...

        async def _record(self, info: TransferInfo, sender: str, recipient: str) -> None: ...

        async def _offer(self, tid: bytes) -> None: ...

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, tid: bytes) -> AsyncIterator[None]:
        """Serialise the steps that start or end one transfer's attempts (an offer, an
        accept or reject by hand, a cancel): each reads the row, awaits, then writes it,
        and two at once (an accept and a reject; an offer on the old link and the new)
        wrote stale rows or started two attempts of one epoch."""
        turn = self._turns.get(tid)
        if turn is None:
            turn = self._turns[tid] = TransferLock()
        turn.users += 1
        try:
            async with turn.lock:
                yield
        finally:
            turn.users -= 1
            if turn.users == 0:
                del self._turns[tid]

    def get(self, tid: str | bytes) -> TransferInfo:
        """The transfer with id ``tid`` (hex or bytes); :class:`UsageError` if unknown."""
        key = bytes.fromhex(tid) if isinstance(tid, str) else tid
        info = self.rows().get(key)
        if info is None:
            raise UsageError(f"no transfer with id {key.hex()}")
        return info

    def moving(self, tid: bytes) -> bool:
        """True while an attempt of the transfer runs (bytes may move); an active
        transfer without one waits for its peer to offer or accept again."""
        return tid in self._incoming or tid in self._sending

    def list(self) -> list[TransferInfo]:
        """Every transfer, oldest first."""
        return sorted(self.rows().values(), key=lambda i: (i.created_ms, i.tid))

    def rows(self) -> dict[bytes, TransferInfo]:
        """Every transfer by id, read from the store once and then kept as rows are saved
        or forgotten: an incoming offer checks them all (quota, open offers), and
        decoding 10,000 rows on the loop for each offer cost 115 ms."""
        if self._rows is None:
            with self.node.store.read() as txn:
                rows = {k: TransferInfo.decode(v) for k, v in txn.items(_DB)}
            rows.update(self._unwritten)
            self._rows = rows
        return self._rows

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
        if self._rows is not None:
            self._rows[key] = info

        row = info.encode()
        if is_final(info.state):
            # Live figures only: an ended transfer's row says how far it got.
            self.bytes_sent.pop(key, None)

        def written(done: asyncio.Future[Any]) -> None:
            if self._unwritten.get(key) is info:
                del self._unwritten[key]
                if not done.cancelled() and done.exception() is not None:
                    self._rows = None  # never stored: what is kept is read again

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
