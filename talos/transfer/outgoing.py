"""Sending files: offers, attempts over the bulk path or the app channel, credits,
resumes (docs/PROTOCOL.md "File transfer"; docs/adr/0004-bulk-transfer-path.md).
Part of :class:`~talos.transfer.manager.TransferManager`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from talos.aio import uncancelled
from talos.transfer import bulk, bulk_data
from talos.transfer.pipeline import Slot
from talos.transfer.protocol import (
    APP_NAME,
    BULK_CHUNK,
    FALLBACK_CHUNK,
    TID_LEN,
    Accept,
    Cancel,
    Chunk,
    Credit,
    Event,
    Offer,
    bind_token,
    encode_message,
    file_commitment,
    is_final,
)
from talos.transfer.records import (
    CreditGate,
    TransferBase,
    TransferInfo,
    log,
)
from talos.transfer.sender import OutgoingAttempt, Signer, SourceChangedError, file_size
from talos_sdk.errors import (
    HandshakeError,
    TalosError,
    UsageError,
)

__all__ = ["CREDIT_WAIT", "OutgoingTransfers"]

#: Seconds a sender on the app-channel path waits for more credit before it takes the
#: attempt for broken and offers the transfer again (the bulk path's IDLE_TIMEOUT).
CREDIT_WAIT = bulk.IDLE_TIMEOUT


class OutgoingTransfers(TransferBase):
    """The sending side of the transfer manager."""

    async def send_file(self, did: str, path: Path | str, name: str | None = None) -> str:
        """Offer ``path`` to ``did`` (as ``name``, default its base name); returns the id (hex).

        The transfer resumes by itself after a link drop or a restart of either node.
        Checked before anything is stored: a row that cannot be offered would be
        offered again, and fail again, on every link-up and restart.
        """
        if name is not None and (not isinstance(name, str) or not name):
            raise UsageError("a file's name must be a non-empty string")
        if did == self.node.did:
            raise UsageError("a node cannot send a file to itself")
        path = Path(path).resolve()
        try:
            st = os.stat(path)
        except OSError:
            st = None  # said below, with the size
        if self._in_home(path) or (st and (st.st_dev, st.st_ino) in self._home_inodes()):
            # An agent talked into sending the node's key (or a typo) must not do it.
            raise UsageError(
                f"{path} is in the node's home, which keeps its keys and store:"
                " no file there is sent (copy it out first if you mean it)"
            )
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

    async def _on_accept(self, msg: Accept) -> None:
        # In the transfer's turn: two ACCEPTs at once (the old link and the new) each
        # passed the epoch check, and the stale one cancelled the newer attempt.
        async with self._one_at_a_time(msg.tid):
            await self._accepted(msg, self.get(msg.tid))

    async def _accepted(self, msg: Accept, info: TransferInfo) -> None:
        if info.direction != "out" or is_final(info.state):
            return
        if not 0 <= msg.offset <= info.size:
            await self._fail_out(info, f"receiver asked to resume at {msg.offset}")
            return
        if msg.tid in self._sending and msg.epoch <= info.epoch:
            return  # an attempt of this epoch, or a later one, is running
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
        except (OSError, ConnectionError, asyncio.IncompleteReadError) as exc:
            # First: a lost link (NotConnectedError) is a TalosError too, and worth a retry.
            log.info("transfer %s attempt %d broke: %s", tid.hex(), msg.epoch, exc)
            await self._retry_later(tid)
        except TalosError as exc:  # source changed, etc.: the transfer cannot go on
            await self._fail_out(self.get(tid), str(exc))
            await self._send(info.peer, Cancel(tid, str(exc)))
        finally:
            # Deregister now, not in a done callback: a link-up handled in between
            # would see a send still "running" and not re-offer.
            if self._sending.get(tid) is asyncio.current_task():
                del self._sending[tid]
            if is_final(self.get(tid).state):  # counted after the row ended (a cancel)
                self.bytes_sent.pop(tid, None)

    async def _retry_later(self, tid: bytes) -> None:
        await asyncio.sleep(self.config.retry_delay)
        info = self.get(tid)
        if not is_final(info.state) and self.node.is_connected(info.peer):
            await self._offer(tid)

    def _count(self, tid: bytes, size: int) -> Callable[[Slot], None]:
        """Note how far into the file the bulk stream has sent (routes.view shows it)."""

        def on_sent(slot: Slot) -> None:
            self.bytes_sent[tid] = min(slot.offset + slot.size, size)  # the commit is no data

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

    def _received(self) -> Path | None:
        """``files_dir`` when it is a folder inside the home, whose files may be sent; None
        when it is the home itself or holds it (the home's own files are not exempt)."""
        private, received = self.private_dir, self.files_dir.resolve()
        if private is None or received == private or not received.is_relative_to(private):
            return None
        return received

    def _in_home(self, path: Path) -> bool:
        """True if ``path`` (resolved) is in the node's home, outside ``files_dir``."""
        private, received = self.private_dir, self._received()
        return (
            private is not None
            and path.is_relative_to(private)
            and not (received is not None and path.is_relative_to(received))
        )

    def _home_inodes(self) -> set[tuple[int, int]]:
        """(device, inode) of every file in the node's home outside ``files_dir``: a file
        opened by any name (a hard link, a symlink, a moved folder) is one of them."""
        private = self.private_dir
        if private is None:
            return set()
        received = self._received()
        found: set[tuple[int, int]] = set()
        for folder, dirs, names in os.walk(private):
            if received is not None and Path(folder).resolve() == received:
                dirs.clear()
                continue
            for name in names:
                with contextlib.suppress(OSError):
                    st = os.lstat(os.path.join(folder, name))
                    found.add((st.st_dev, st.st_ino))
        return found

    def _open_source(self, info: TransferInfo, msg: Accept, chunk: int) -> OutgoingAttempt:
        """The attempt's reader; a file that cannot be opened ends the transfer (it is not
        a broken attempt: offering again would not bring it back).

        The home is checked again on the file as opened, by its inode: the name offered
        may lead elsewhere by now (a symlink or a rename put in its place), or be
        another name of a home file (a hard link), and a check of the name alone
        would then send it.
        """
        try:
            out = OutgoingAttempt(
                Path(info.path), info.size, bytes.fromhex(info.key), msg.tid, msg.epoch,
                msg.offset, chunk, self._signer(info),
            )  # fmt: skip
        except OSError as exc:
            raise SourceChangedError(f"cannot read {info.path}: {exc.strerror}") from None
        if out.identity() in self._home_inodes():
            out.close()
            raise SourceChangedError(f"{info.path} is now a file of the node's home: not sent")
        return out

    async def _send_bulk(self, info: TransferInfo, msg: Accept) -> bool:
        """True if the bulk path carried the attempt to a verdict; False to fall back.

        The bulk port is dialled at the address of the link itself, never at the host
        the ACCEPT names: a hostile receiver could otherwise aim this node's connections
        at any host and port it can reach (the FTP bounce attack, RFC 2577 section 3).
        A peer reached through a relay has no address to dial: its bytes take the app
        channel.
        """
        host = self.node.peer_host(info.peer)
        if host is None:
            return False
        out = self._open_source(info, msg, BULK_CHUNK)
        try:
            try:
                token = bind_token(msg.token, self.node.channel_binding(info.peer))
                stream = await bulk.connect_bulk(host, msg.bulk_port, msg.tid, token)
            except (OSError, TimeoutError, HandshakeError) as exc:
                log.info("bulk path to %s unavailable (%s); using the app channel", info.peer, exc)
                return False
            self._streaming.add(msg.tid)
            try:
                slots = out.slots(bulk_data.PIPELINE_SLOTS)
                verified = await bulk_data.send_chunks(
                    stream, out.stages, slots, msg.window, self._count(msg.tid, info.size)
                )
            finally:
                self._streaming.discard(msg.tid)
                await stream.close()
        finally:
            out.close()
        if not verified:
            await self._retry_later(msg.tid)
        return True

    async def _send_fallback(self, info: TransferInfo, msg: Accept) -> None:
        tid = msg.tid
        out = self._open_source(info, msg, FALLBACK_CHUNK)
        gate = self._credit[tid] = CreditGate(msg.epoch, msg.window)
        try:
            while not out.finished:
                index = out.index
                while index >= gate.upto:
                    gate.event.clear()
                    # A chunk lost with a link (or an attempt the receiver ended) gives
                    # no more credit: past CREDIT_WAIT the attempt counts as broken
                    # (TimeoutError) and the transfer is offered again from its checkpoint.
                    # Not asyncio.wait_for: on 3.11 it swallows a cancel that lands as
                    # the credit arrives, and a link drop then left this attempt running.
                    async with asyncio.timeout(CREDIT_WAIT):
                        await gate.event.wait()
                # Not cut by a cancel: the file must not close under the thread reading it.
                sealed = await uncancelled(asyncio.to_thread(out.next_sealed))
                await self.node.send_app(
                    info.peer, APP_NAME, encode_message(Chunk(tid, msg.epoch, index, sealed))
                )
                self.bytes_sent[tid] = out.offset
        finally:
            # The gate first: a second cancel during the close below would skip it.
            if self._credit.get(tid) is gate:
                del self._credit[tid]
            # In a thread: it joins the whole-file hash, which must not block the loop.
            await asyncio.to_thread(out.close)

    def _on_credit(self, msg: Credit) -> None:
        gate = self._credit.get(msg.tid)
        if gate is not None and msg.epoch == gate.epoch and msg.upto > gate.upto:
            gate.upto = msg.upto
            gate.event.set()

    async def _fail_out(self, info: TransferInfo, reason: str) -> None:
        if not is_final(info.state):
            await self._move(info, Event.FAIL, error=reason)
