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
committed offset; at most :data:`MAX_ATTEMPTS` in a row that break and commit
nothing, not counting attempts ended by a lost link). A size lie, a SHA-256
mismatch, a full disk or the quota end the *transfer*: the partial file is
deleted and the sender is told why.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from talos.aio import uncancelled
from talos.transfer import bulk
from talos.transfer.incoming import CreditExceededError, IncomingTransfers
from talos.transfer.outgoing import OutgoingTransfers
from talos.transfer.protocol import (
    APP_NAME,
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
    file_commitment,
    is_final,
)
from talos.transfer.records import (
    MAX_ATTEMPTS,
    MAX_OPEN_OFFERS,
    AppNode,
    CreditGate,
    IncomingState,
    TransferConfig,
    TransferInfo,
    TransferLock,
    log,
)
from talos_sdk.errors import (
    ProtocolError,
    TalosError,
    UsageError,
)

__all__ = [
    "MAX_ATTEMPTS",
    "MAX_OPEN_OFFERS",
    "CreditExceededError",
    "TransferConfig",
    "TransferInfo",
    "TransferManager",
]

#: Seconds stop() waits for the steps already in a transfer's turn (TransferBase
#: _one_at_a_time) before it stops the attempts under them.
STOP_TURNS_WAIT = 5.0
#: Control messages of one peer waiting to be handled; past this the link's reading
#: waits too, so a peer's flood is held back on its link rather than queued here.
MAX_QUEUED_CONTROL = 64


@dataclass(eq=False)
class PeerControl:
    """One peer's control messages waiting to be handled (TransferManager._handle_control)."""

    waiting: deque[TransferMessage] = field(default_factory=deque)
    #: set while ``waiting`` is below MAX_QUEUED_CONTROL: the link's reading waits on it
    room: asyncio.Event = field(default_factory=asyncio.Event)


class TransferManager(OutgoingTransfers, IncomingTransfers):
    """Sends and receives files for one node."""

    def __init__(
        self,
        node: AppNode,
        files_dir: Path,
        config: TransferConfig | None = None,
        *,
        private_dir: Path | None = None,
    ) -> None:
        self.node = node
        #: No file under it is sent (the node's home: its keys, tokens and store), except
        #: what was received into ``files_dir`` there.
        self.private_dir = None if private_dir is None else Path(private_dir).resolve()
        self.config = config or TransferConfig()
        self.files_dir = Path(files_dir)
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.listener: bulk.BulkListener | None = None
        self.block_log: Any = getattr(node, "log", None)
        self._incoming: dict[bytes, IncomingState] = {}
        self._sending: dict[bytes, asyncio.Task[None]] = {}
        self._credit: dict[bytes, CreditGate] = {}
        self._waiters: dict[bytes, list[asyncio.Future[TransferInfo]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._control: dict[str, PeerControl] = {}
        #: called as ``on_progress(tid, committed_offset)`` after each receiver checkpoint
        self.on_progress: Callable[[bytes, int], None] | None = None
        self.bytes_sent: dict[bytes, int] = {}
        self._stopped = False
        # Rows go to the store through the node's one writer, in order, so an fsync never
        # blocks the loop. Rows queued but not yet committed are in _unwritten too, which
        # rebuilds the kept rows after a write the store refused (TransferBase.rows).
        self._unwritten: dict[bytes, TransferInfo] = {}
        self._rows: dict[bytes, TransferInfo] | None = None  # see TransferBase.rows
        self._turns: dict[bytes, TransferLock] = {}  # see TransferBase._one_at_a_time
        self._disk_turn = asyncio.Lock()  # see IncomingTransfers._open_file
        self._streaming: set[bytes] = set()  # sends on a bulk stream now (_on_link)

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
        for control in self._control.values():
            control.room.set()  # a link waiting for room reads on (what comes is ignored)
        if self.listener is not None:
            await self.listener.close()
        # Steps already in a transfer's turn end first (each sees _stopped and starts
        # nothing), within a bound: one may be waiting on a link that takes nothing.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_TURNS_WAIT):
                for turn in list(self._turns.values()):
                    async with turn.lock:
                        pass
        tasks = [*self._tasks, *self._sending.values()]
        tasks += [i.task for i in self._incoming.values() if i.task is not None]
        # Not the task calling: a step of this manager may stop it (gather would wait on itself).
        tasks = [t for t in tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for inc in list(self._incoming.values()):
            await self._settle_checkpoint(inc)
            inc.file.close()
        self._incoming.clear()
        await self.node.writer.drain()  # every queued row is committed

    async def cancel(self, tid: str | bytes, reason: str = "cancelled by its user") -> TransferInfo:
        """End a transfer in progress, either way (``talosd files cancel ID``): its attempt
        stops, a receiver's partial file is deleted, and the peer hears CANCEL.

        The one way for a receiver to free the disk an accepted transfer holds when
        its sender never sends (the space is preallocated at ACCEPT).
        """
        key = bytes.fromhex(self.get(tid).tid)
        async with self._one_at_a_time(key):
            info = self.get(key)
            if is_final(info.state):
                raise UsageError(f"transfer {info.tid} is {info.state.value}: nothing to cancel")
            if info.direction == "in":
                info = await self._cancel_in(key, reason)
            else:
                sending = self._sending.pop(key, None)
                if sending is not None:
                    sending.cancel()
                    await uncancelled(asyncio.wait({sending}))
                info = await self._move(self.get(key), Event.CANCEL, error=reason)
        await self._send(info.peer, Cancel(key, reason))
        return info

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_link(self, did: str, up: bool) -> None:
        if self._stopped:
            return
        if not up:
            # Sends on the app channel went with the link (a chunk may be lost, no credit
            # will come): end them now, and the next link offers them again from the
            # receiver's checkpoint. A bulk stream has its own connection and goes on.
            # So do attempts not streaming yet (their ACCEPT came on this link): left
            # running, the next link-up would not offer them again, and they would wait
            # out CREDIT_WAIT for credit the receiver never grants.
            for tid, task in list(self._sending.items()):
                if tid not in self._streaming and self.get(tid).peer == did:
                    del self._sending[tid]
                    task.cancel()
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
        if self._stopped:
            return  # the node's links outlive the manager (Daemon stops it first)
        try:
            msg = decode_message(payload)
        except ProtocolError as exc:
            log.warning("bad transfer message from %s: %s", peer, exc)
            return
        if isinstance(msg, Chunk):
            self._on_chunk(peer, msg)
            return
        if isinstance(msg, Credit):
            self._on_credit(msg)
            return
        # The others wait for their transfer's turn and write its row (an fsync): a task
        # handles them, in order per peer, so the link's other traffic (messages, a
        # tunnel) never waits on this node's disk or on a transfer's turn.
        # Appended before any await: a handler task present now sees the message.
        control = self._control.get(peer)
        if control is None:
            control = self._control[peer] = PeerControl()
            self._spawn(self._handle_control(peer, control))
        control.waiting.append(msg)
        if len(control.waiting) >= MAX_QUEUED_CONTROL:
            control.room.clear()
            await control.room.wait()

    async def _handle_control(self, peer: str, control: PeerControl) -> None:
        waiting = control.waiting
        try:
            while waiting and not self._stopped:
                msg = waiting.popleft()
                if len(waiting) < MAX_QUEUED_CONTROL:
                    control.room.set()
                try:
                    await self._on_message(peer, msg)
                except TransferProtocolError as exc:
                    log.info("transfer %s: ignored %s: %s", msg.tid.hex(), type(msg).__name__, exc)
                except Exception as exc:
                    # A row the store refused, or a bug: it costs this message, never the
                    # peer's later ones (the node's read loop treats a frame the same way).
                    name = type(msg).__name__
                    log.error("transfer %s: %s not handled: %r", msg.tid.hex(), name, exc)
        finally:
            # No await since ``waiting`` was seen empty: nothing was appended in between.
            if self._control.get(peer) is control:
                del self._control[peer]
            control.room.set()  # stopped: the link's reading goes on (and is ignored)

    async def _on_message(self, peer: str, msg: TransferMessage) -> None:
        if isinstance(msg, Offer):
            await self._on_offer(peer, msg)
            return
        try:
            info = self.get(msg.tid)
        except UsageError:
            return
        if info.peer == peer:
            await self._on_control(peer, msg, info)

    async def _on_control(self, peer: str, msg: TransferMessage, info: TransferInfo) -> None:
        if isinstance(msg, Accept):
            await self._on_accept(msg)
        elif isinstance(msg, Pending) and info.direction == "out":
            if info.state is TransferState.OFFERED:
                await self._move(info, Event.HOLD)
        elif isinstance(msg, Done) and info.direction == "out" and not is_final(info.state):
            if not info.signature:
                # Only the commit chunk (the hash, signed) lets a receiver have the file.
                raise TransferProtocolError("DONE before this node sent its commit")
            sending = self._sending.pop(bytes.fromhex(info.tid), None)
            if sending is not None:
                sending.cancel()  # its receiver has it all: nothing is left to send
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
                await self._on_cancel_in(msg.tid, msg.reason)
            else:
                await self._move(info, Event.CANCEL, error=msg.reason)
