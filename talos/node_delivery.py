r"""The message pipeline's asyncio side (docs/ARCHITECTURE.md "Message path").

The rules are the sans-I/O :class:`~talos.peer_pipeline.PeerPipeline`; this
part does the waiting and the writing around them. Nothing is acknowledged
before it is committed (docs/DESIGN.md "Storage")::

    send_message -> seq (epoch, n) in memory -> seal (signed commitment) -> MSG frame
                 \-> outbox (durable, group-committed, overlapping the transmission)
    MSG -> open -> batch -> one durable txn (inbox + log record + delivered seq
           + session state) -> ACK (cumulative) -> sender drops outbox rows and
           logs its own records of the acked messages

Why transmitting before the outbox commit is safe:
docs/adr/0007-epoch-sequence-numbers.md. Part of :class:`~talos.node.Node`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import struct
import time
from collections.abc import Iterable
from typing import TypeVar

from websockets.exceptions import ConnectionClosed

from talos import pipeline as pl
from talos.chain.block import Record
from talos.chain.log import BlockLog
from talos.link import wire
from talos.link.peer import Link
from talos.link.refusals import DEFER_WHY
from talos.logging import event
from talos.node_base import Incoming, NodeBase, OnCommitted, Peer
from talos.node_send import Done, Sending, until_done
from talos.peer_pipeline import UNSENT_BATCH, Failed, Received, Retry
from talos.pipeline import MessageTooLargeError
from talos.sessions import MessageSignatureError, UnknownSessionError, UnsignedMessageError
from talos.store import Txn
from talos_sdk.errors import ProtocolError, StorageError, StorageFullError, UsageError

__all__ = ["NodeDelivery", "take"]

_log = logging.getLogger("talos.node")
_U64 = struct.Struct(">Q")
_T = TypeVar("_T")
_Outgoing = tuple[pl.OutboxEntry, OnCommitted, bool]  # as NodeBase._outgoing
#: Longest an ack's store write, or the outbox row of a send whose frame left and
#: whose caller waits for the peer's ack, waits to share a transaction with others.
WRITE_DELAY = 0.02
#: An idle link sends a sealed frame this often (docs/PROTOCOL.md "Link protocol"):
#: a frame lost in transit then fails the next one's open, and the link is redone,
#: within about this long, even when nothing retries it (an MCP call's APP frame).
HEARTBEAT_IDLE = 5.0


class NodeDelivery(NodeBase):
    """Durable messages: receive commits, acks, the outbox, per-link senders, retries."""

    def _on_msg(self, peer: Peer, frame: wire.Msg) -> None:
        try:
            opened = self.sessions.open_message(peer.did, frame.body)
        except MessageSignatureError as exc:
            unsigned = isinstance(exc, UnsignedMessageError)
            self.metrics.inc("messages_unsigned" if unsigned else "messages_bad_signature")
            raise
        if opened.seq != frame.seq:
            raise ProtocolError("MSG header sequence differs from the sealed one")
        before = peer.rx.accepted
        verdict = peer.receive(opened.seq, opened.prev)
        if verdict is Received.ACCEPT:
            o = opened
            row = pl.encode_inbox(o.msg_id, peer.did, o.seq, o.ts_ms, o.text)
            if self.past_share(peer, len(row)):
                peer.rx.not_taken(before)
                self._over_share(peer)
                return
            peer.inbox_bytes += len(row)
            peer.over_share = False
            self._incoming.append(Incoming(peer.did, opened, row))
            self._start_commit()
            self.metrics.inc("messages_in")
        elif verdict is Received.GAP:
            self.metrics.inc("messages_gap")
        else:
            self.metrics.inc("messages_duplicate")
            if verdict is Received.REACK:
                self._send_ack(peer)

    @property
    def _inbox_share(self) -> int:
        return self.config.inbox_share or self.config.map_size // 8

    def past_share(self, peer: Peer, size: int) -> bool:
        """Whether ``size`` more bytes of inbox rows would take ``peer`` past its share
        (one message is taken whatever its size while the peer has none stored)."""
        return bool(peer.inbox_bytes) and peer.inbox_bytes + size > self._inbox_share

    def _over_share(self, peer: Peer) -> None:
        """The peer's stored messages fill its inbox share: this one waits at its end
        (DEFER, as for a full store), so one peer cannot fill the store for all."""
        self.metrics.inc("messages_over_share")
        if not peer.over_share:
            peer.over_share = True
            hint = "talosd inbox --prune-through N frees it"
            event(_log, "inbox_share_full", level=logging.WARNING, peer=peer.did,
                  share=self._inbox_share, hint=hint)  # fmt: skip
        self._send_link(peer, wire.encode(wire.Defer(peer.rx.delivered, wire.DEFER_FULL)))

    def _send_ack(self, peer: Peer) -> None:
        self._send_link(peer, wire.encode(wire.Ack(peer.rx.delivered)))

    def _send_link(self, peer: Peer, data: bytes) -> None:
        link = peer.link
        if link is None:
            return
        # Inline from the commit's done callback: a task would cost the sender a loop pass.
        with contextlib.suppress(ConnectionClosed):
            if link.send_nowait(data):
                return
        self._spawn(self._send_quiet(link, data))

    @staticmethod
    async def _send_quiet(link: Link, data: bytes) -> None:
        with contextlib.suppress(ConnectionClosed):
            await link.send(data)

    def _on_defer(self, peer: Peer, frame: wire.Defer) -> None:
        """The peer could not store what we sent: say so once; the resends go on."""
        if peer.deferred != frame.reason:
            peer.deferred = frame.reason
            event(_log, "peer_cannot_store", level=logging.WARNING, peer=peer.did,
                  why=DEFER_WHY[frame.reason])  # fmt: skip
        self.metrics.inc("defers_received")

    def _on_ack(self, peer: Peer, seq: int) -> None:
        acked = peer.on_ack(seq, self._epoch, time.monotonic())
        if acked is None:
            return
        for latency in acked.latencies:
            self.metrics.ack_latency.observe(latency)
        # The write waits (WRITE_DELAY at most) to be queued with the next outbox
        # commit: the writer's group commit then puts both in one transaction, where
        # a write per ack cost a thread wake-up, a transaction and a loop wake-up.
        pending = self._acks.get(peer.did)
        if pending is None:
            self._acks[peer.did] = (seq, list(acked.records))
        else:
            pending[1].extend(acked.records)
            self._acks[peer.did] = (seq, pending[1])
        self._arm_write_timer()

    def _arm_write_timer(self) -> None:
        if self._write_timer is None:
            self._write_timer = asyncio.get_running_loop().call_later(
                WRITE_DELAY, self._write_deferred
            )

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_deferred(self) -> None:
        """The write timer: deferred outbox rows and ack writes, in one group."""
        self._write_timer = None
        # Written on the loop when the writer is idle and no row needs an fsync
        # (ADR 0017): a few page writes, where the thread's hand-offs were most of
        # a small group's cost (a group per message or two when a peer's acks come slowly).
        here = not any(durable for _, _, durable in self._outgoing)
        with self.writer.together(here=here):
            if self._outgoing and not self._outbox_busy:
                self._flush_outbox()  # submits the acks' writes with it
            else:
                self._submit_acks()

    def flush_outbox_now(self) -> None:
        """Queue the deferred outbox rows at once (a waiting send failed before its commit)."""
        if self._outgoing and not self._outbox_busy and not self._stopping:
            self._flush_outbox()

    def _submit_acks(self) -> None:
        """Queue the acks' writes: drop acked outbox rows, log our records of them."""
        if not self._outgoing:  # else the timer stays, for the rows still waiting
            self._cancel_write_timer()
        acks, self._acks = self._acks, {}
        for did, (seq, records) in acks.items():
            with contextlib.suppress(UsageError):  # writer closed: the rows are resent next run
                self.writer.submit(
                    functools.partial(_ack_txn, log=self.log, did=did, seq=seq, records=records),
                    durable=False,
                    kind="ack",
                    then=_ack_written,
                )

    def _start_commit(self) -> None:
        """Group commit: everything that arrived since the last commit goes in one txn.

        Started straight from the frame handler when no commit runs (no extra loop
        pass); frames arriving meanwhile wait for the next one. A lone message on
        a quiet node is committed on the loop (:meth:`_lone`, ADR 0017).
        """
        if self._committing or not self._incoming or self._stopping:
            return
        batch, self._incoming = self._incoming, []
        peers = {item.peer for item in batch}
        snaps = self.sessions.snapshot(peers)
        self._committing = True
        self._commit_began = time.monotonic()
        fut = self.writer.submit(
            functools.partial(self._commit_batch, batch=batch, snaps=snaps),
            then=functools.partial(self._committed, batch, peers),
            kind="receive",
            size=len(batch),
            here=len(batch) == 1 and self._lone(batch[0].peer),
        )
        if fut.done():
            self.metrics.inc("commits_on_loop")

    def _lone(self, did: str) -> bool:
        """Whether holding the loop for this one message's commit costs nothing else
        (ADR 0017): no receive commit ran in the last stretch as long as the previous
        one took (the node is not receiving back to back, from any link), and no
        further frame of this link has arrived. One message at a time, the writer
        thread's two hand-offs were about a sixth of the round trip."""
        if self._commit_began < self._quiet_after:
            return False
        peer = self._peers.get(did)
        link = peer.link if peer is not None else None
        return link is not None and not link.queued

    def _committed(self, batch: list[Incoming], peers: set[str], fut: asyncio.Future[None]) -> None:
        self._committing = False
        ended = time.monotonic()
        self._quiet_after = ended + (ended - self._commit_began)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.metrics.inc("commit_failures")
            # Until a commit succeeds, status and /healthz say received messages cannot be
            # stored: their senders only see acks that do not come.
            self.storage_error = str(exc) or type(exc).__name__
            level = logging.ERROR
            event(_log, "commit_failed", level=level, error=repr(exc), count=len(batch))
            # Their senders hear it (DEFER), so their outbox says why no ack comes.
            reason = wire.DEFER_FULL if isinstance(exc, StorageFullError) else wire.DEFER_FAILING
            dropped = [i for i in self._incoming if i.peer in peers]
            for item in (*batch, *dropped):
                self._peers[item.peer].inbox_bytes -= len(item.row)
            for did in peers:
                peer = self._peers[did]
                peer.commit_failed()
                self._send_link(peer, wire.encode(wire.Defer(peer.rx.delivered, reason)))
            # Frames queued meanwhile were accepted after the lost ones: committing
            # them would ack past messages never stored. The sender resends them all.
            if dropped:
                self._incoming = [i for i in self._incoming if i.peer not in peers]
                self.metrics.inc("messages_dropped_after_failure", len(dropped))
        else:
            self.storage_error = None
            self.metrics.inc("commits")
            for did in peers:
                self._peers[did].committed(i.opened.seq for i in batch if i.peer == did)
            for did in peers:
                self._send_ack(self._peers[did])
            self._inbox_event.set()
            self._inbox_event = asyncio.Event()
        self._start_commit()

    def _commit_batch(self, txn: Txn, batch: list[Incoming], snaps: dict[str, bytes]) -> None:
        n = pl.last_inbox_n(txn) + 1
        top: dict[str, int] = {}
        size: dict[str, int] = {}
        for item in batch:
            o = item.opened
            txn.put("inbox", _U64.pack(n), item.row)
            self.log.append(o.record, txn, verified=True)  # checked by open_message
            top[item.peer] = o.seq
            size[item.peer] = size.get(item.peer, 0) + len(item.row)
            n += 1
        for did, seq in top.items():
            pl.put_u64(txn, "meta", pl.meta_in(did), seq)
            key = pl.meta_inbox_bytes(did)
            pl.put_u64(txn, "meta", key, pl.get_u64(txn, "meta", key) + size[did])
        self.sessions.persist(txn, snaps)

    async def _flush_loop(self) -> None:
        """Session state between message commits, not synced (ADR 0001)."""
        while True:
            await asyncio.sleep(self.config.session_flush_interval)
            if self.sessions.prekeys_due():  # signed prekey rotation / expiry (cheap check)
                with contextlib.suppress(StorageError):
                    await self.writer.write(self.sessions.maintain_prekeys, kind="prekeys")
            snaps = self.sessions.snapshot_dirty()
            if snaps:
                try:
                    await self.writer.write(
                        functools.partial(self.sessions.persist, snaps=snaps),
                        durable=False,
                        kind="session",
                    )
                except StorageError as exc:
                    event(_log, "session_flush_failed", level=logging.ERROR, error=str(exc))

    async def send_message(
        self, did: str, text: str, wait: bool = False, timeout: float | None = None
    ) -> str:
        """Queue ``text`` for ``did`` durably; return the message id (hex).

        With ``wait`` return only once the peer acknowledged its commit, or raise
        TimeoutError after ``timeout`` seconds without the ack (the message stays queued).
        """
        msg_id: str = await until_done(
            lambda done: self.start_send(did, text, done, wait=wait, timeout=timeout)
        )
        return msg_id

    def start_send(
        self, did: str, text: str, done: Done, *, wait: bool = False, timeout: float | None = None
    ) -> Sending:
        """:meth:`send_message` without a task: ``done(msg_id, None)`` or ``done(None, error)``
        later (talos/node_send.py); bad input raises here, before anything is queued."""
        self._check_recipient(did)
        if not isinstance(text, str):
            raise UsageError("message text must be a string")
        peer = self._peer(did)
        now_ms = int(self._clock() * 1000)
        # ADR 0007: the number is unique across crashes, so the frame may leave
        # before its outbox row is durable; the caller hears back only after.
        row = peer.assign(text, os.urandom(pl.MSG_ID_LEN), now_ms, self._epoch)
        sending = Sending(self, peer, row, done, wait=wait, timeout=timeout, since=now_ms)
        # With ``wait`` the caller hears back only once the peer holds the message
        # durably, so the row needs no fsync of its own (amended ADR 0007); if the
        # wait ends without the ack, the row is synced before the caller hears so.
        self._outgoing.append((row, sending.on_committed, not wait))
        # Frame first, then the commit: the writer thread's Python work would
        # otherwise take the GIL from the seal and the socket write.
        sent = self._send_now(peer, row)
        if not self._outbox_busy and self._outgoing:
            if sent and wait and not any(durable for _, _, durable in self._outgoing):
                # Only waiting sends whose frames left: their rows wait (WRITE_DELAY at
                # most) for the ack, after which a row is only its number (for_outbox),
                # and are written together. A transaction per send was ~105 us of the
                # writer's CPU per message (bench_agents, sequential send --wait).
                self._arm_write_timer()
            else:
                self._flush_outbox()
        if not sent:
            self._kick(peer)
            self.links.ensure(did)
        return sending

    def _check_recipient(self, did: str) -> None:
        """UsageError unless a message to ``did`` may be queued now."""
        if not self.started or self._stopping:
            raise UsageError("the node is not running")
        if did == self.did:
            raise UsageError("cannot send a message to this node itself")
        if did not in self._peers:
            from talos_sdk.did import public_key_from_did

            public_key_from_did(did)  # a clear DIDError for a malformed recipient

    def _flush_outbox(self) -> None:
        """Group commit of the outbox: sends arriving while one commit runs share the next."""
        batch, self._outgoing = self._outgoing, []
        self._outbox_busy = True
        self._cancel_write_timer()
        with self.writer.together():  # one group, one transaction, one wake-up
            if self._acks:
                self._submit_acks()
            self.writer.submit(
                functools.partial(self._enqueue_batch, rows=[r for r, _, _ in batch]),
                durable=any(durable for _, _, durable in batch),
                then=functools.partial(self._outbox_committed, batch),
                kind="outbox",
                size=len(batch),
            )

    def _outbox_committed(self, batch: list[_Outgoing], fut: asyncio.Future[None]) -> None:
        self._outbox_busy = False
        exc = None if fut.cancelled() else fut.exception()
        if exc is None:
            top: dict[str, int] = {}
            for row, _, _ in batch:
                top[row.peer] = max(top.get(row.peer, 0), row.seq)
            for did, seq in top.items():  # once per peer, not per row
                if (peer := self._peers.get(did)) is not None:  # else removed meanwhile
                    peer.outbox_committed(seq)
        else:
            # The callers get the error and no id (ADR 0007, "outbox commit fails"):
            # the rows are not sent again, their successors name their prev.
            by_peer: dict[str, list[pl.OutboxEntry]] = {}
            for row, _, _ in batch:
                by_peer.setdefault(row.peer, []).append(row)
            for did, rows in by_peer.items():
                if (peer := self._peers.get(did)) is not None:
                    peer.outbox_failed(rows)
        for _, committed, _ in batch:
            committed(exc)
        if self._outgoing and not self._stopping:
            self._flush_outbox()

    def prepare_row(self, peer: Peer, row: pl.OutboxEntry) -> pl.OutboxEntry | None:
        """``row`` as it goes on the wire (any link or the relay's mailbox), or None when
        the peer can never accept it: then it is failed for good (counted, logged, its
        waiters told, its outbox row deleted and its successor given its ``prev``)."""
        ready = peer.prepare(row)
        if not isinstance(ready, Failed):
            return ready
        self.metrics.inc("messages_failed")
        event(
            _log,
            "message_failed",
            level=logging.WARNING,
            peer=peer.did,
            msg_id=row.msg_id.hex(),
            reason=f"above the peer's {ready.limit}-byte message limit",
        )
        exc = MessageTooLargeError(f"message {row.msg_id.hex()} can never fit {peer.did}'s frames")
        for fut in peer.tx.waiters.pop(row.seq, []):
            if not fut.done():
                fut.set_exception(exc)
        self._spawn(
            self.writer.write(functools.partial(_skip_row, row=row, prev=ready.prev), kind="skip")
        )
        return None

    def _send_now(self, peer: Peer, row: pl.OutboxEntry) -> bool:
        """Send ``row`` from the caller's callback when it is next and the socket has room."""
        link = peer.link
        if (
            peer.pumping
            or link is None
            or not peer.ready.is_set()
            or not peer.is_next(row)
            or not link.can_send_now
            or not link.writable
        ):
            return False
        ready = self.prepare_row(peer, row)
        if ready is None:
            return True
        try:
            body, record = self.sessions.seal_message(peer.did, ready)
        except UnknownSessionError:
            # The session went while the link was still ready (a resync under way): the
            # row is queued already, so the caller hears nothing here; the next session sends it.
            return False
        peer.on_sent(ready, record, time.monotonic())
        frame = wire.encode(wire.Msg(ready.seq, body))
        try:
            if link.send_nowait(frame):
                return True
        except ConnectionClosed:
            return True  # the link is gone; the retry or the next link resends it
        # Writable a moment ago: keep the pump off until this frame is out, in order.
        peer.pumping = True
        self._spawn(self._send_late(peer, link, frame))
        return True

    async def _send_late(self, peer: Peer, link: Link, frame: bytes) -> None:
        try:
            with contextlib.suppress(ConnectionClosed):
                await link.send(frame)
        finally:
            peer.pumping = False
        if peer.dirty:
            self._kick(peer)

    async def _send_row(self, peer: Peer, link: Link, row: pl.OutboxEntry) -> None:
        ready = self.prepare_row(peer, row)
        if ready is None:
            return
        body, record = self.sessions.seal_message(peer.did, ready)
        peer.on_sent(ready, record, time.monotonic())
        frame = wire.encode(wire.Msg(ready.seq, body))
        # Written from here when the socket has room: the awaited send's context
        # managers and timeout were 17 % of a sending node's GIL time at 64 in flight.
        if not link.send_nowait(frame):
            await link.send(frame)

    def _enqueue_batch(self, txn: Txn, rows: list[pl.OutboxEntry]) -> None:
        """Writer thread: outbox rows, minus those the peer acked already (ack raced us)."""
        for row in rows:
            peer = self._peers.get(row.peer)
            keep = peer.for_outbox(row) if peer is not None else row
            if keep is None:
                pl.note_assigned(txn, row.peer, row.seq)
            else:
                pl.put_row(txn, keep)

    def _kick(self, peer: Peer) -> None:
        peer.dirty = True
        if not peer.pumping and peer.ready.is_set():
            peer.pumping = True
            self._spawn(self._pump(peer))

    async def _pump(self, peer: Peer) -> None:
        """Send every outbox row this link has not sent yet, in order."""
        try:
            while peer.dirty and peer.ready.is_set():
                peer.dirty = False
                link = peer.link
                if link is None:
                    return
                rows = self._unsent(peer)
                for row in rows:
                    if peer.link is not link or not peer.ready.is_set():
                        return
                    if row.seq <= peer.tx.sent:
                        continue
                    await self._send_row(peer, link, row)
        except ConnectionClosed:
            pass
        finally:
            peer.pumping = False

    def _unsent(self, peer: Peer) -> list[pl.OutboxEntry]:
        """Rows after ``tx.sent``: committed ones from LMDB, then those still committing."""
        rows = peer.unsent_from_memory()
        if rows is not None:
            return rows  # nothing committed is pending
        with self.store.read() as txn:
            stored = take(pl.iter_outbox(txn, peer.did, peer.tx.sent), UNSENT_BATCH)
        rows, more = peer.unsent_after_store(stored)
        if more:
            peer.dirty = True
        return rows

    async def _retry_loop(self) -> None:
        """Resend from the oldest unacked message when a link makes no progress."""
        interval = self.config.retry_interval
        # Often enough for the heartbeat too, whatever retry_interval says.
        tick = min(interval, HEARTBEAT_IDLE) / 2
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for peer in self._peers.values():
                ready, linked = peer.ready.is_set(), peer.link is not None
                link = peer.link
                if ready and link is not None and link.idle_for(now) >= HEARTBEAT_IDLE:
                    # The ack we last sent, again: a no-op for the peer, old and new alike.
                    self._send_ack(peer)
                decision = peer.retry(now, interval, ready=ready, linked=linked)
                if decision is Retry.RESEND:
                    event(_log, "resend", peer=peer.did, from_seq=peer.tx.acked + 1)
                    self._kick(peer)
                elif decision is Retry.KICK:
                    self._kick(peer)  # rows queued while the link was coming up
                elif decision is Retry.DIAL:
                    self.links.ensure(peer.did)  # outbox rows for a DID we do not dial


def _ack_written(fut: asyncio.Future[None]) -> None:
    exc = None if fut.cancelled() else fut.exception()
    if exc is not None:  # the rows stay; the next ack or a restart drops them
        event(_log, "ack_write_failed", level=logging.ERROR, error=repr(exc))


def _skip_row(txn: Txn, row: pl.OutboxEntry, prev: int) -> None:
    """Writer thread: drop a failed row; its successor now follows ``prev``
    (docs/PROTOCOL.md "Link protocol", Message size)."""
    txn.delete("outbox", pl.outbox_key(row.peer, row.seq))
    nxt = next(pl.iter_outbox(txn, row.peer, row.seq), None)
    if nxt is not None and nxt.prev == row.seq:
        pl.put_row(txn, dataclasses.replace(nxt, prev=prev))
    elif nxt is None:  # no successor yet: the next run's first message names ``prev``
        pl.note_skipped(txn, row.peer, row.seq, prev)


def _ack_txn(txn: Txn, log: BlockLog, did: str, seq: int, records: list[Record]) -> None:
    """Drop acked outbox rows and log our own records of them (docs/DESIGN.md "Block log")."""
    pl.drop_acked(txn, did, seq)
    for record in records:
        log.append(record, txn, verified=True)  # signed here, by seal_message


def take(it: Iterable[_T], n: int) -> list[_T]:
    out: list[_T] = []
    for x in it:
        out.append(x)
        if len(out) >= n:
            break
    return out
