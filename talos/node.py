"""The running node (docs/ARCHITECTURE.md "Module map and contracts"; docs/DESIGN.md "Layers").

:class:`Node` is the lifecycle (open the store, restore state, listen, stop
cleanly), status and the public contract callers use; it is assembled from
the peers-and-links part (:mod:`talos.node_links`; links themselves come from
:mod:`talos.link.supervisor`), the delivery part (:mod:`talos.node_delivery`)
and the app channels (:mod:`talos.node_apps`), which share the state of
:mod:`talos.node_base`.
Protocol rules live in pure modules (link frames, handshake,
:class:`~talos.peer_pipeline.PeerPipeline`, sessions over the SDK); every LMDB
write runs on the node's one :class:`~talos.writer.StoreWriter` thread.
Crash safety of ratchet state: docs/adr/0001-session-persistence.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from talos import pipeline as pl
from talos.chain.block import Record
from talos.chain.head_gossip import HeadGossip
from talos.chain.log import BlockLog, run_sealer
from talos.chain.quarantine_watch import watch_quarantine
from talos.config import Home, NodeConfig, parse_listen, parse_peer_addr
from talos.discovery import (
    ChainResolver,
    LearnedResolver,
    Resolver,
    StaticResolver,
)
from talos.home import init_home
from talos.keys import hybrid_since, unlock
from talos.link.auth import AuthPolicy
from talos.link.handshake import CLOSE_SHUTDOWN
from talos.link.peer import LinkSettings
from talos.link.refusals import LinkProblems
from talos.link.supervisor import CLOSE_TRY_AGAIN, LinkSupervisor
from talos.logging import event
from talos.metrics import Metrics
from talos.node_apps import ConnectTimeoutError, NodeApps, NotConnectedError
from talos.node_base import AppHandler, Incoming, LinkCallback, OnCommitted, Peer
from talos.node_delivery import NodeDelivery, take
from talos.node_links import NodeLinks, ProblemCallback
from talos.pins import load_pin, store_pin
from talos.pipeline import MessageTooLargeError, text_limit
from talos.sessions import (
    SessionManager,
)
from talos.store import Store, Txn
from talos.writer import StoreWriter
from talos_sdk.errors import (
    StorageError,
    UsageError,
)
from talos_sdk.wallet import Wallet

__all__ = [
    "CLOSE_TRY_AGAIN",
    "ConnectTimeoutError",
    "MessageTooLargeError",
    "Node",
    "NotConnectedError",
    "init_home",
    "text_limit",
]

_log = logging.getLogger("talos.node")
_U64 = struct.Struct(">Q")
_RUNNING = b"running"
#: Seconds a starting node waits for the home's lock, which an offline ``talosd`` command
#: (a send queued while the node was down) holds for a moment; a node holds it for good.
STORE_LOCK_WAIT = 10.0


class Node(NodeLinks, NodeDelivery, NodeApps):
    """A Talos node: identity, store, links, sessions, pipeline, block log."""

    def __init__(
        self,
        home: Path,
        config: NodeConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        resolver: Resolver | None = None,
        wallet: Wallet | None = None,
    ) -> None:
        self.home = Home(Path(home))
        self._unlocked = wallet  # already unlocked by the caller (talos/keys.py)
        self.config = config if config is not None else self.home.load_config()
        self._clock = clock
        self.metrics = Metrics()
        self.authorizer: Callable[[str], bool] = self._default_authorizer
        self._apps: dict[str, AppHandler] = {}
        self._link_callbacks: list[LinkCallback] = []
        self._peers: dict[str, Peer] = {}
        self._known: dict[str, str] = {}  # DID -> address ("" when only allowed)
        # docs/DESIGN.md "Discovery and scale": where a DID without a link is dialled;
        # the relay (if any) comes last, so a direct address is tried first.
        sources: list[Resolver] = [StaticResolver(lambda: self._known), LearnedResolver()]
        if self.config.relays:
            from talos.relay.attach import RelayResolver

            sources.append(RelayResolver(self.config.relays[0]))
        self.resolver: Resolver = resolver if resolver is not None else ChainResolver(*sources)
        self.relay: Any = None  # talos.relay.attach.NodeRelay once started with --relay
        self._allow: set[str] = set(self.config.allow)
        #: Dial the peers the store has addresses for at start. An embedded
        #: ``talos-proxy connect`` turns it off: it talks to its one --peer only.
        self.dial_known = True
        self._tasks: list[asyncio.Task[Any]] = []
        self._link_tasks: set[asyncio.Task[Any]] = set()
        self._problems = LinkProblems()  # read before start() too (a proxy's tunnel client)
        self._problem_callbacks: list[ProblemCallback] = []
        self._incoming: list[Incoming] = []
        self._outgoing: list[tuple[pl.OutboxEntry, OnCommitted, bool]] = []
        self._epoch = 0
        self._outbox_busy = False
        self._acks: dict[str, tuple[int, list[Record]]] = {}  # ack writes not queued yet
        self._write_timer: asyncio.TimerHandle | None = None
        self._committing = False
        self._commit_began = self._quiet_after = 0.0
        self.storage_error: str | None = None
        self._inbox_event = asyncio.Event()
        self._quiescing = False
        self._writer: StoreWriter | None = None
        self._stopping = False
        self.started = False
        self.listen_url: str | None = None
        self.unclean_start = False
        self.settings = LinkSettings(
            max_frame=self.config.max_frame,
            ping_interval=self.config.ping_interval,
            handshake_timeout=self.config.handshake_timeout,
            auth=AuthPolicy(self.config.require_pq, self._pinned),
            pq=self.config.pq,
        )

    @property
    def writer(self) -> StoreWriter:
        """The one thread that writes this node's store (talos/writer.py); set by start()."""
        if self._writer is None:
            raise UsageError("the node is not started")
        return self._writer

    def _pinned(self, did: str) -> bytes | None:
        with self.store.read() as txn:
            return load_pin(txn, did)

    async def pin_peer_key(self, did: str, key: bytes) -> None:
        """Pin ``did``'s ML-DSA-65 key durably, on the writer thread (ADR 0005).

        A first hybrid contact (``Link.new_pin``) is pinned before its link
        carries anything (the link supervisor waits for it).
        """
        await self.writer.write(functools.partial(store_pin, did=did, key=key), kind="pin")
        event(_log, "peer_pinned", peer=did, suite="ed25519-mldsa65")

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the store, restore state, listen, dial configured peers, start the API."""
        if not self.home.exists():
            raise UsageError(f"no identity in {self.home.path}: run `talosd init` first")
        self.wallet = self._unlocked or unlock(self.home.identity)
        self.did = self.wallet.did
        #: The first hybrid height as the key file keeps it (read as it was unlocked).
        self.hybrid_since = (
            hybrid_since(self.home.identity) if self.wallet.hybrid_public_key else None
        )
        #: Dialling, accepting, admission, the duplicate-link rule (talos/link/supervisor.py).
        self.links = LinkSupervisor(
            self.did,
            self.wallet,
            self.settings,
            resolver=self.resolver,
            authorize=lambda did: self.authorizer(did),  # callers may set authorizer later
            metrics=self.metrics,
            pin=self.pin_peer_key,
            run_link=self._run_link,
            reconnect_initial=self.config.reconnect_initial,
            reconnect_max=self.config.reconnect_max,
            noted=self._problem_noted,
            clock=self._clock,
            problems=self._problems,
        )
        # Opening syncs, closing syncs: both off the loop like every other fsync.
        self.store = await asyncio.to_thread(
            Store, self.home.store_dir, map_size=self.config.map_size, lock_wait=STORE_LOCK_WAIT
        )
        try:
            await self._open_state()
        except BaseException:
            if self._writer is not None:
                await asyncio.to_thread(self._writer.close)
            await asyncio.to_thread(self.store.close)
            raise
        self._tasks += [
            asyncio.create_task(run_sealer(self.log), name="talos-sealer"),
            asyncio.create_task(self._flush_loop(), name="talos-session-flush"),
            asyncio.create_task(self._retry_loop(), name="talos-retry"),
            asyncio.create_task(self.heads.run(), name="talos-heads"),
            asyncio.create_task(
                watch_quarantine(self.log, self.metrics, self.config.seal_interval),
                name="talos-quarantine",
            ),
        ]
        self.metrics.gauge(
            "peers_connected", lambda: sum(p.ready.is_set() for p in self._peers.values())
        )
        self.metrics.gauge("outbox_depth", self._outbox_depth)
        self.metrics.gauge("log_pending_records", lambda: self.log.pending_count)
        self.metrics.gauge("log_quarantined_records", self.quarantined_count)
        self.started = True  # from here on, stop() can undo a failed start
        try:
            await self._start_network()
        except BaseException:
            await self.stop()
            raise
        event(
            _log, "node_started", did=self.did, listen=self.listen_url, unclean=self.unclean_start
        )

    async def _start_network(self) -> None:
        if self.config.listen:
            host, port = parse_listen(self.config.listen)
            try:
                self.listen_url = await self.links.listen(host, port)
            except OSError as exc:
                hint = (
                    " (another process listens there: give another port, or 0 for any free one)"
                    if exc.errno == errno.EADDRINUSE
                    else ""
                )
                raise UsageError(
                    f"cannot listen on {self.config.listen}: {exc.strerror or exc}{hint}"
                ) from None
        if self.config.relays:
            from talos.relay.attach import NodeRelay

            self.relay = self.links.relay = NodeRelay(self, self.config.relays)
            self.relay.start()  # connects in the background: a relay that is down is retried
        for addr in list(self._known.values()) if self.dial_known else ():
            if addr:
                self._keep_link(parse_peer_addr(addr), changed=True)
        for addr in self.config.peers:
            await self.add_peer(addr)

    async def _open_state(self) -> None:
        self._writer = StoreWriter(self.store)
        # In a worker thread: a new hybrid log writes its first mark through the writer.
        self.log = await asyncio.to_thread(
            functools.partial(
                BlockLog,
                self.store,
                self.wallet,
                max_records=self.config.seal_count,
                max_delay_ms=int(self.config.seal_interval * 1000),
                writes=self.writer,
            )
        )
        with self.store.read() as txn:
            self.unclean_start = txn.get("meta", _RUNNING) is not None
            self._known = {k.decode(): v.decode() for k, v in txn.items("peers")}
        self.sessions = SessionManager(
            self.store,
            self.wallet,
            pq=self.config.pq,
            one_time=self.config.one_time_prekeys,
            ratchet_every=self.config.ratchet_every,
            ratchet_max_age=self.config.ratchet_max_age,
            pq_one_time=self.config.pq_one_time_prekeys,
            prekey_rotation=self.config.prekey_rotation,
            prekey_grace=self.config.prekey_grace,
        )
        # ADR 0001: after an unclean stop no ratchet state may be reused.
        await self.writer.write(
            lambda txn: self.sessions.load(txn, discard=self.unclean_start), kind="start"
        )
        self._epoch = await self.writer.write(self._mark_running, kind="start")
        self.heads = HeadGossip(self, self.metrics, self._pinned, self.config.head_interval)
        if self.unclean_start:
            event(_log, "unclean_shutdown_detected", level=logging.WARNING, action="sessions reset")

    def _mark_running(self, txn: Txn) -> int:
        """One durable txn at start: the running marker and a new boot epoch (ADR 0007),
        and, on a store's first start, the inbox shares counted from its rows."""
        txn.put("meta", _RUNNING, _U64.pack(os.getpid()))
        pl.count_inbox_shares(txn)
        return pl.bump_epoch(txn)

    async def stop(self) -> None:
        """Clean shutdown: close links, flush sessions, seal the log, clear the running marker."""
        if not self.started or self._stopping:
            return
        self._stopping = True
        self.quiesce()
        self.links.stop_accepting()
        links = [p.link for p in self._peers.values() if p.link is not None]
        await asyncio.gather(
            *(link.close(CLOSE_SHUTDOWN, "node shutting down") for link in links),
            return_exceptions=True,
        )
        if self.relay is not None:
            await self.relay.stop()
        for task in [*self._tasks, *self._link_tasks]:
            task.cancel()
        await asyncio.gather(
            self.links.stop(), *self._tasks, *self._link_tasks, return_exceptions=True
        )
        # A wait without a timeout would never end: its row stays queued, and it hears so.
        for peer in self._peers.values():
            peer.tx.fail_waiters(_stopped_unacked)
        if self._outbox_busy:
            await self.writer.drain()  # the outbox commit in flight settles first
        if self._outgoing:
            # Rows still waiting (deferred wait-sends, rows behind that commit): their
            # frames may have left, so they are committed, as a running node would.
            self._flush_outbox()
        self._submit_acks()
        try:
            await self.writer.write(self._final_flush, kind="stop")
        except StorageError as exc:
            event(_log, "final_flush_failed", level=logging.ERROR, error=str(exc))
        try:
            await asyncio.to_thread(self.log.seal)
        except StorageError as exc:
            event(_log, "final_seal_failed", level=logging.ERROR, error=str(exc))
        await asyncio.to_thread(self.writer.close)
        await asyncio.to_thread(self.store.close)
        self.started = False
        event(_log, "node_stopped", did=self.did)

    def quiesce(self) -> None:
        """Wake every long-poll (:meth:`wait_inbox` returns at once from now on).

        :meth:`stop` does this first; a composition root calls it before closing
        the API that holds those polls (talos/daemon.py).
        """
        self._quiescing = True
        self._inbox_event.set()

    def _final_flush(self, txn: Txn) -> None:
        self.sessions.persist(txn, self.sessions.snapshot_all())
        txn.delete("meta", _RUNNING)

    async def __aenter__(self) -> Node:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- quarantined records -------------------------------------------------------------------

    def quarantined_count(self) -> int:
        """Records the sealer refused (bad signature, malformed, duplicate id)."""
        with self.store.read() as txn:
            return txn.count("quarantine")

    @property
    def epoch(self) -> int:
        """This run's boot epoch, the high half of every sequence number it assigns."""
        return self._epoch

    # --- reading state (API, CLI) --------------------------------------------------------------

    def inbox(self, after: int = 0, limit: int = 1000) -> list[pl.InboxEntry]:
        """Inbox entries with arrival number > ``after``."""
        with self.store.read() as txn:
            return list(take(pl.iter_inbox(txn, after), limit))

    async def wait_inbox(
        self, after: int, timeout: float, limit: int = 1000
    ) -> list[pl.InboxEntry]:
        """Like :meth:`inbox` but wait up to ``timeout`` for something new."""
        deadline = time.monotonic() + timeout
        while True:
            signal = self._inbox_event
            entries = self.inbox(after, limit)
            left = deadline - time.monotonic()
            if entries or left <= 0 or self._quiescing:
                return entries
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await signal.wait()

    async def prune_inbox(self, through: int) -> int:
        """Delete the inbox messages numbered up to ``through``, in transactions of
        ``pipeline.PRUNE_CHUNK``; how many. Each sender's inbox share gets its bytes back."""
        pruned = 0
        while True:
            count, freed, mark = await self.writer.write(
                functools.partial(pl.prune_inbox, through=through, limit=pl.PRUNE_CHUNK),
                kind="prune",
            )
            for did, size in freed.items():
                peer = self._peers.get(did)
                # A peer not loaded reads its share from the store when it is; one loaded
                # after this chunk committed (its mark is this one) has the bytes off.
                if peer is not None and peer.inbox_pruned < mark:
                    peer.inbox_bytes = max(0, peer.inbox_bytes - size)
            pruned += count
            if count < pl.PRUNE_CHUNK:
                return pruned

    async def drop_queued(self, did: str) -> dict[str, Any]:
        """Drop every message queued for ``did`` that it has not acknowledged: ``dropped``,
        how many, of which ``sent`` may have reached the peer (sent in this run, or
        queued by an earlier one, which may have sent them). A ``send --wait`` for one
        of them fails with MessageDroppedError. The next message follows the last
        acknowledged one (docs/adr/0007-epoch-sequence-numbers.md, "Dropping queued
        messages")."""
        if did == self.did:
            raise UsageError("this node queues no messages for itself")
        self._check_recipient(did)
        peer = self._peer(did)
        # Rows of this peer still committing are written first: written after the drop's
        # transaction, before the drop takes effect in memory, they would come back.
        for _ in range(_DROP_ROUNDS):
            if not peer.fresh or self._stopping:
                break
            self.flush_outbox_now()
            await self.writer.write(_nothing, kind="drop")
        if peer.fresh:
            raise UsageError(f"messages to {did} are being queued right now: drop again")
        prev, last = peer.drop_point()
        # The store first: a drop that fails to commit (a full disk) drops nothing, and
        # the caller is told so; one that commits holds after a crash.
        stored = await self.writer.write(
            functools.partial(pl.drop_outbox, peer=did, last=last, prev=prev), kind="drop"
        )
        drop = peer.drop_unacked(prev, last)
        peer.tx.fail_waiters(
            lambda: pl.MessageDroppedError(
                "the message was dropped from the outbox before its ack"
            ),
            upto=last,
        )
        seqs = {*stored, *drop.fresh}
        if seqs:
            event(_log, "outbox_dropped", peer=did, messages=len(seqs))
        # Sent in this run (on a link, or to the relay mailbox), or queued by an earlier
        # one, which may have sent it: either may have reached the peer.
        sent = max(drop.max_sent, self.relay.mailboxed(did) if self.relay is not None else 0)
        may = sum(1 for s in seqs if s <= sent or pl.epoch_of(s) < self._epoch)
        return {"peer": did, "dropped": len(seqs), "sent": may}

    def _outbox_depth(self) -> int:
        with self.store.read() as txn:
            return txn.count("outbox")

    def status(self) -> dict[str, Any]:
        """Links with their state and last refusal, sessions, queues (talos/views.py)."""
        from talos.views import node_status

        return node_status(self)


#: Outbox commits a drop waits for, at most, while messages to its peer keep coming.
_DROP_ROUNDS = 20


def _nothing(txn: Txn) -> None:
    """A write that orders after every write queued before it."""


def _stopped_unacked() -> UsageError:
    return UsageError("the node stopped before the peer acknowledged; the message stays queued")
