"""Receiving files: offers, quota and row caps, attempts, checkpoints, verification
(docs/PROTOCOL.md "File transfer"; docs/adr/0004-bulk-transfer-path.md).
Part of :class:`~talos.transfer.manager.TransferManager`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from talos.aio import uncancelled
from talos.store import Txn
from talos.transfer import bulk, bulk_data
from talos.transfer.protocol import (
    Accept,
    Chunk,
    Credit,
    Done,
    Event,
    Failed,
    Offer,
    Pending,
    Reject,
    TransferProtocolError,
    TransferState,
    bind_token,
    file_commitment,
    is_final,
    safe_name,
)
from talos.transfer.receiver import PARTIAL_DIR, IncomingAttempt, IncomingFile, NoSpaceError
from talos.transfer.records import (
    _DB,
    _OPEN_IN,
    MAX_ATTEMPTS,
    MAX_OPEN_OFFERS,
    IncomingState,
    TransferBase,
    TransferInfo,
    log,
)
from talos_sdk.errors import (
    DecryptionError,
    StorageError,
    TalosError,
    UsageError,
)
from talos_sdk.wallet import verify as verify_signature

__all__ = ["DISK_RESERVE", "MAX_BULK_RECEIVES", "CreditExceededError", "IncomingTransfers"]

#: Free disk an accepted offer must leave (its file is preallocated whole): the node's
#: store and block log live on that disk too, and a full disk stops them committing.
DISK_RESERVE = 256 << 20
#: Incoming attempts offered the bulk path at once; later ones take the app channel. A
#: bulk stream runs a pipeline of five threads, and the open offers of every peer
#: (MAX_OPEN_OFFERS each) would otherwise all get one.
MAX_BULK_RECEIVES = 8
#: Seconds a bulk place waits for its sender's stream (which dials and proves its token
#: within bulk.HANDSHAKE_TIMEOUT) before it goes to other attempts: a sender that never
#: comes would otherwise hold it for the attempt's whole life.
BULK_DIAL_WAIT = 2 * bulk.HANDSHAKE_TIMEOUT
#: Seconds an app-channel attempt waits for its next chunk (a FALLBACK_CHUNK of 256 KiB
#: takes 64 s at bulk_data.MIN_RATE) before it ends as broken, its checkpoint kept: a
#: sender that never sends would otherwise hold the attempt (task, file, bulk place)
#: for the link's whole life. The sender's side of the same rule is CREDIT_WAIT.
CHUNK_WAIT = 2 * bulk.IDLE_TIMEOUT


class CreditExceededError(TransferProtocolError):
    """The sender sent a fallback chunk beyond the credit the receiver granted."""


class IncomingTransfers(TransferBase):
    """The receiving side of the transfer manager."""

    def _charge(self, size: int) -> int:
        """What a file of ``size`` bytes costs against the quota: tiny and empty files
        still cost a row and an inode, so each counts at least ``min_file_bytes``."""
        return max(size, self.config.min_file_bytes)

    def _over_quota(self, size: int, rows: Iterable[TransferInfo]) -> str:
        """Why a file of ``size`` bytes would pass the quota ("" if it would not).

        Counted: the accepted transfers and the received files. A pending offer takes
        no disk until it is accepted, so it is charged then: counted as it came, one
        peer's offers that nobody accepts would refuse every other peer's.
        """
        held = (TransferState.ACTIVE, TransferState.COMPLETE)
        used = sum(self._charge(i.size) for i in rows if i.direction == "in" and i.state in held)
        if used + self._charge(size) <= self.config.quota_bytes:
            return ""
        return (
            f"quota exceeded: {size} bytes offered (counts as {self._charge(size)}),"
            f" {used} held, quota {self.config.quota_bytes}"
        )

    def _over_quota_of(self, info: TransferInfo) -> str:
        """:meth:`_over_quota` for an offer that has its row already (charged at accept)."""
        return self._over_quota(info.size, [i for i in self.rows().values() if i.tid != info.tid])

    async def _make_room(self, peer: str, rows: Iterable[TransferInfo]) -> bool:
        """Keep ``peer``'s incoming rows under ``max_rows_per_peer`` by forgetting its
        oldest ended transfers that hold no file; False if no room can be made."""
        mine = [i for i in rows if i.peer == peer and i.direction == "in"]
        excess = len(mine) - self.config.max_rows_per_peer + 1
        if excess <= 0:
            return True
        ended = (TransferState.FAILED, TransferState.REJECTED, TransferState.CANCELLED)
        oldest = sorted((i for i in mine if i.state in ended), key=lambda i: (i.created_ms, i.tid))
        drop = [bytes.fromhex(i.tid) for i in oldest[:excess]]
        if len(drop) < excess:
            return False

        def forget(txn: Txn) -> None:
            for key in drop:
                txn.delete(_DB, key)

        await self.node.writer.write(forget, kind="transfer")
        kept = self.rows()
        for key in drop:
            kept.pop(key, None)
        return True

    async def _on_offer(self, peer: str, msg: Offer) -> None:
        async with self._one_at_a_time(msg.tid):
            await self._offered(peer, msg)

    async def _offered(self, peer: str, msg: Offer) -> None:
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
        rows = self.rows().values()
        auto = peer in self.config.auto_accept
        if sum(i.peer == peer and i.direction == "in" and i.state in _OPEN_IN for i in rows) >= (
            MAX_OPEN_OFFERS
        ):
            reason = f"too many open offers from this peer (limit {MAX_OPEN_OFFERS})"
        elif auto and (over := self._over_quota(msg.size, rows)):
            reason = over  # accepted now: charged now (a pending one when it is accepted)
        elif not await self._make_room(peer, rows):
            reason = (
                f"too many transfers kept from this peer "
                f"(limit {self.config.max_rows_per_peer}, none ended without a file)"
            )
        elif shutil.disk_usage(self.files_dir).free < msg.size + DISK_RESERVE:
            reason = (
                f"not enough disk space for {msg.size} bytes "
                f"(with {DISK_RESERVE >> 20} MiB kept free)"
            )
        if reason:
            # No row for a refusal: a peer's offers cannot grow the store without bound.
            log.info("transfer %s from %s refused: %s", info.tid, peer, reason)
            await self._send(peer, Reject(msg.tid, reason))
            return
        info = await self._save(info)
        if auto:
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
        elif info.state is TransferState.OFFERED:
            # Stopped between the offer's row and its first attempt: decided now.
            if info.peer in self.config.auto_accept:
                if over := self._over_quota_of(info):
                    info = await self._move(info, Event.REJECT, error=over)
                    await self._send(info.peer, Reject(tid, over))
                    return
                await self._start_attempt(info)
            else:
                await self._move(info, Event.HOLD)
                await self._send(info.peer, Pending(tid))
        elif info.state is TransferState.ACTIVE:
            inc = self._incoming.get(tid)
            if inc is not None and inc.attempt.commit is not None:
                # The attempt has the whole stream and is finishing: DONE or FAILED comes
                # next. A new attempt would reopen the partial file being placed.
                return
            await self._start_attempt(info)
        else:
            await self._send(info.peer, Reject(tid, info.error or info.state.value))

    async def accept(self, tid: str | bytes) -> TransferInfo:
        """Accept a pending incoming transfer (``talosd files accept ID``)."""
        key = self.get(tid)
        async with self._one_at_a_time(bytes.fromhex(key.tid)):
            info = self._pending_in(tid)
            if over := self._over_quota_of(info):
                raise UsageError(
                    f"cannot accept {info.tid}: {over}; it stays pending (move received"
                    " files out, reject it, or raise transfer quota_bytes in config.json)"
                )
            await self._start_attempt(info)
        return self.get(tid)

    async def reject(self, tid: str | bytes, reason: str = "declined") -> TransferInfo:
        """Refuse a pending incoming transfer."""
        key = self.get(tid)
        async with self._one_at_a_time(bytes.fromhex(key.tid)):
            info = await self._move(self._pending_in(tid), Event.REJECT, error=reason)
            self._drop_partial(info.tid)  # one a cancelled accept preallocated
        await self._send(info.peer, Reject(bytes.fromhex(info.tid), reason))
        return info

    def _pending_in(self, tid: str | bytes) -> TransferInfo:
        info = self.get(tid)
        if info.direction != "in" or info.state is not TransferState.PENDING:
            raise UsageError(f"transfer {info.tid} is not a pending incoming transfer")
        return info

    async def _on_cancel_in(self, tid: bytes, reason: str) -> None:
        """The sender withdrew an incoming transfer: end its attempt, drop the partial."""
        async with self._one_at_a_time(tid):
            await self._cancel_in(tid, reason)

    async def _cancel_in(self, tid: bytes, reason: str) -> TransferInfo:
        """End an incoming transfer's attempt and drop its partial (the caller holds its turn)."""
        await self._end_incoming(tid)
        info = self.get(tid)  # read after the attempt ended: its checkpoint is in
        if not is_final(info.state):
            self._drop_partial(info.tid)
            info = await self._move(info, Event.CANCEL, error=reason)
        return info

    def _drop_partial(self, tid: str) -> None:
        (self.files_dir / PARTIAL_DIR / f"{tid}.part").unlink(missing_ok=True)

    async def _start_attempt(self, info: TransferInfo) -> None:
        """Start attempt ``info.epoch + 1`` (the caller holds the transfer's turn)."""
        tid = bytes.fromhex(info.tid)
        # A live attempt whose link was replaced (lost, or the sender restarted) ends
        # with it: that is not this transfer failing, and a peer whose link drops often
        # must not use up the attempts. Every other attempt counts toward MAX_ATTEMPTS,
        # also one the sender offers again over the same link: a sender failing on its
        # own side (its file gone, a read error) re-offered every retry_delay for ever.
        old = self._incoming.get(tid)
        replaced = old is not None and old.binding != self.node.channel_binding(info.peer)
        await self._end_incoming(tid)
        info = self.get(tid)  # as the ended attempt's last checkpoint left it
        if not self._may_start(info):
            return
        if info.attempts >= MAX_ATTEMPTS:
            await self._fail_in(info, f"gave up after {info.attempts} attempts")
            return
        epoch = info.epoch + 1
        try:
            file = await self._open_file(info)
        except StorageError as exc:
            await self._fail_in(info, str(exc))
            return
        info = self.get(tid)
        if not self._may_start(info):  # ended while the file was opened
            file.close()
            return
        attempt = IncomingAttempt(file, bytes.fromhex(info.key), tid, epoch)
        attempts = info.attempts if replaced and info.attempts else info.attempts + 1
        info = await self._move(info, Event.ACCEPT, epoch=epoch, attempts=attempts)
        if self._stopped:  # stopped while the row was written: nothing may start now
            file.close()
            return
        window = self.config.window
        # +1: room for the credit-violation error behind a full window
        inc = IncomingState(file, attempt, asyncio.Queue(maxsize=window + 1), granted=window)
        inc.binding = self.node.channel_binding(info.peer)
        self._incoming[tid] = inc
        port, token, host = 0, b"", ""
        # A relayed peer has no address to dial the bulk port at (outgoing.py _send_bulk).
        direct = self.node.peer_host(info.peer) is not None
        if (
            self.listener is not None
            and direct
            and sum(i.bulk for i in self._incoming.values()) < MAX_BULK_RECEIVES
        ):
            inc.bulk = True
            token = os.urandom(32)
            port, host = self.listener.port, self.config.bulk_host
            # Bound to the link the ACCEPT travels on (docs/PROTOCOL.md "File transfer").
            bound = bind_token(token, self.node.channel_binding(info.peer))
            self.listener.expect(tid, bound, lambda s: self._receive_bulk(tid, inc, s))
            asyncio.get_running_loop().call_later(BULK_DIAL_WAIT, self._bulk_unclaimed, tid, inc)
        inc.task = asyncio.ensure_future(self._receive_fallback(tid, inc))
        accept = Accept(tid, info.offset, epoch, self.config.window, port, token, host)
        await self._send(info.peer, accept)

    async def _open_file(self, info: TransferInfo) -> IncomingFile:
        """The attempt's partial file, preallocated; NoSpaceError (a StorageError) if the
        first attempt would leave less than DISK_RESERVE free.

        Checked again before the first attempt preallocates: offers accepted by hand
        may have waited while others took the disk. One transfer at a time from the
        check to the preallocation, which runs to its end even if the caller is
        cancelled: two offers checked together would each miss the space the other
        is about to take, and together eat into the reserve.
        """
        async with self._disk_turn:
            if info.epoch == 0 and shutil.disk_usage(self.files_dir).free < (
                info.size + DISK_RESERVE
            ):
                raise NoSpaceError(f"not enough disk space for {info.size} bytes")
            opening = asyncio.ensure_future(
                asyncio.to_thread(
                    IncomingFile, self.files_dir, bytes.fromhex(info.tid), info.size, info.offset
                )
            )
            try:
                return await uncancelled(opening)
            except asyncio.CancelledError:
                if not opening.cancelled() and opening.exception() is None:
                    opening.result().close()  # opened for an attempt that is not starting
                if info.offset == 0:
                    self._drop_partial(info.tid)  # preallocated, holding nothing received
                raise

    def _bulk_unclaimed(self, tid: bytes, inc: IncomingState) -> None:
        """No bulk stream came for this attempt in time: its place goes to others."""
        if inc.bulk and not inc.streaming and self._incoming.get(tid) is inc:
            inc.bulk = False
            if self.listener is not None:
                self.listener.forget(tid)

    def _may_start(self, info: TransferInfo) -> bool:
        return not self._stopped and not is_final(info.state)

    async def _end_incoming(self, tid: bytes) -> None:
        inc = self._incoming.pop(tid, None)
        if self.listener is not None:
            self.listener.forget(tid)
        if inc is None:
            return
        try:
            task = inc.task
            if task is not None and task is not asyncio.current_task():
                task.cancel()
                # Until it has ended, even if this caller is cancelled meanwhile: its
                # worker thread may be writing the file closed below.
                await uncancelled(asyncio.wait({task}))
            await self._settle_checkpoint(inc)
        finally:
            inc.file.close()

    def _checkpoint_trigger(self, tid: bytes, inc: IncomingState) -> Callable[[], None]:
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

    def _start_checkpoint(self, tid: bytes, inc: IncomingState) -> None:
        inc.sync_task = asyncio.ensure_future(self._checkpoint(tid, inc))

    async def _checkpoint(self, tid: bytes, inc: IncomingState) -> None:
        try:
            offset = await asyncio.to_thread(inc.file.sync)
        except StorageError as exc:  # the next write reports it to the attempt
            log.warning("transfer %s checkpoint failed: %s", tid.hex(), exc)
            return
        finally:
            inc.syncing = False
        if self._incoming.get(tid) is inc:
            # Progress committed: MAX_ATTEMPTS counts attempts in a row that commit
            # nothing, so a long transfer over a link that drops now and then goes on.
            await self._save(replace(self.get(tid), offset=offset, attempts=1))
        if self.on_progress is not None:
            self.on_progress(tid, offset)

    @staticmethod
    async def _settle_checkpoint(inc: IncomingState) -> None:
        """Wait for an in-flight checkpoint before the file is finished or closed."""
        task = inc.sync_task
        if task is not None and task is not asyncio.current_task():
            await asyncio.gather(task, return_exceptions=True)

    async def _receive_bulk(self, tid: bytes, inc: IncomingState, stream: bulk.BulkStream) -> None:
        if inc.task is not None:  # the bulk path won: no fallback chunks for this attempt
            inc.task.cancel()
        inc.task = asyncio.current_task()
        inc.streaming = True
        try:
            await bulk_data.receive_chunks(
                stream,
                inc.attempt.stages,
                self.config.window,
                self._checkpoint_trigger(tid, inc),
            )
            verified = await self._finish(tid, inc)
            await bulk_data.send_verdict(stream, verified)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._attempt_failed(tid, inc, exc)
            await bulk_data.send_verdict(stream, False)
        finally:
            await stream.close()

    async def _receive_fallback(self, tid: bytes, inc: IncomingState) -> None:
        window = self.config.window
        processed = 0
        peer = self.get(tid).peer
        trigger = self._checkpoint_trigger(tid, inc)
        try:
            while True:
                try:
                    async with asyncio.timeout(CHUNK_WAIT):
                        sealed = await inc.queue.get()
                except TimeoutError:
                    if inc.streaming:
                        continue  # the bytes come by the bulk stream, under its own timeout
                    idle = f"no chunk from the sender for {CHUNK_WAIT:g} s"
                    raise ConnectionError(idle) from None
                if sealed is None:
                    return
                if isinstance(sealed, Exception):
                    raise sealed
                # Not cut by a cancel: the file must not close under the thread writing it.
                final = await uncancelled(asyncio.to_thread(inc.attempt.process, sealed))
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
        if inc.bulk:  # the sender took the app channel: its bulk place is free again
            inc.bulk = False
            if self.listener is not None:
                self.listener.forget(msg.tid)

    async def _finish(self, tid: bytes, inc: IncomingState) -> bool:
        """Check the sender's commit (signature, then SHA-256) and make the file visible."""
        await self._settle_checkpoint(inc)
        info = self.get(tid)
        assert inc.attempt.commit is not None  # set with the final chunk
        digest, signature = inc.attempt.commit
        commitment = file_commitment(tid, digest, info.size, info.peer, self.node.did)
        if not verify_signature(info.peer, commitment, signature):
            await self._fail_in(info, "the sender's commit signature does not verify")
            return False
        try:
            # Placed and recorded in one go: a cancel (stop, a cancel from the sender) in
            # between left the file visible under its name with its row still ACTIVE.
            info = await uncancelled(self._place(tid, inc, info, digest, signature))
        except StorageError as exc:
            await self._fail_in(info, str(exc))
            return False
        await self._send(info.peer, Done(tid))
        return True

    async def _place(
        self, tid: bytes, inc: IncomingState, info: TransferInfo, digest: bytes, signature: bytes
    ) -> TransferInfo:
        """Check the hash, move the file to its name, and write its row and record."""
        path = await asyncio.to_thread(inc.file.finish, digest, info.name)
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
        return info

    async def _attempt_failed(self, tid: bytes, inc: IncomingState, exc: BaseException) -> None:
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
            self._drop_partial(info.tid)
        if not is_final(info.state):
            await self._move(info, Event.FAIL, error=reason)
        await self._send(info.peer, Failed(tid, reason))
