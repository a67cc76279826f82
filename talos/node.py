"""The running node (docs/ARCHITECTURE.md "Node contract"; docs/DESIGN.md "Layers").

:class:`Node` is the lifecycle (open the store, restore state, listen, stop
cleanly) and the public contract callers use; it is assembled from the link
part (:mod:`talos.node_links`) and the delivery part
(:mod:`talos.node_delivery`), which share the state of :mod:`talos.node_base`.
Protocol rules live in pure modules (link frames, handshake,
:class:`~talos.peer_pipeline.PeerPipeline`, sessions over the SDK); every LMDB
write runs on the node's one :class:`~talos.writer.StoreWriter` thread.
Crash safety of ratchet state: docs/adr/0001-session-persistence.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from websockets.exceptions import ConnectionClosed

from talos import pipeline as pl
from talos.chain.head_gossip import HeadGossip
from talos.chain.log import BlockLog, run_sealer
from talos.chain.quarantine_watch import watch_quarantine
from talos.config import Home, NodeConfig, PeerAddr, parse_listen, parse_peer_addr
from talos.discovery import (
    ChainResolver,
    LearnedResolver,
    Resolver,
    StaticResolver,
)
from talos.home import init_home
from talos.keys import unlock
from talos.link.auth import AuthPolicy
from talos.link.handshake import CLOSE_SHUTDOWN
from talos.link.peer import LinkSettings
from talos.link.supervisor import CLOSE_TRY_AGAIN, LinkSupervisor
from talos.logging import event
from talos.metrics import Metrics
from talos.node_base import AppHandler, Incoming, LinkCallback, Peer
from talos.node_delivery import NodeDelivery, take
from talos.node_links import NodeLinks
from talos.pins import load_pin, store_pin
from talos.pipeline import MessageTooLargeError, text_limit
from talos.sessions import (
    SessionManager,
)
from talos.store import Store, Txn
from talos.writer import StoreWriter
from talos_sdk.did import public_key_from_did
from talos_sdk.errors import (
    StorageError,
    TalosError,
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
_T = TypeVar("_T")


class NotConnectedError(TalosError, ConnectionError):
    """No authenticated link with a ready session to that peer right now."""


class ConnectTimeoutError(NotConnectedError, TimeoutError):
    """``wait_connected`` gave up."""


class Node(NodeLinks, NodeDelivery):
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
        self._tasks: list[asyncio.Task[Any]] = []
        self._link_tasks: set[asyncio.Task[Any]] = set()
        self._incoming: list[Incoming] = []
        self._outgoing: list[tuple[pl.OutboxEntry, asyncio.Future[None]]] = []
        self._epoch = 0
        self._outbox_busy = False
        self._committing = False
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
        )
        # Opening syncs, closing syncs: both off the loop like every other fsync.
        self.store = await asyncio.to_thread(
            Store, self.home.store_dir, map_size=self.config.map_size
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
                raise UsageError(
                    f"cannot listen on {self.config.listen}: {exc.strerror or exc}"
                ) from None
        if self.config.relays:
            from talos.relay.attach import NodeRelay

            self.relay = self.links.relay = NodeRelay(self, self.config.relays)
            self.relay.start()  # connects in the background: a relay that is down is retried
        for addr in list(self._known.values()):
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
        """One durable txn at start: the running marker and a new boot epoch (ADR 0007)."""
        txn.put("meta", _RUNNING, _U64.pack(os.getpid()))
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
        for _, fut in self._outgoing:
            if not fut.done():
                fut.set_exception(UsageError("the node stopped before the message was queued"))
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

    # --- peers and links -----------------------------------------------------------------------

    def _default_authorizer(self, did: str) -> bool:
        return did in self._known or did in self._allow

    def allow(self, did: str) -> None:
        """Let ``did`` hold a link with us (``--allow``)."""
        self._allow.add(did)

    async def add_peer(self, addr: str) -> PeerAddr:
        """Remember ``ws://HOST:PORT#DID`` in the peers table and keep a link to it."""
        peer = parse_peer_addr(addr)
        if peer.did == self.did:
            raise UsageError("that address is this node's own DID")
        changed = self._known.get(peer.did) != str(peer)
        if changed:
            await self.writer.write(
                lambda txn: txn.put("peers", peer.did.encode(), str(peer).encode()), kind="peers"
            )
            self._known[peer.did] = str(peer)
        self._keep_link(peer, changed=changed)
        return peer

    def _keep_link(self, addr: PeerAddr, *, changed: bool) -> None:
        self._peer(addr.did)  # listed in status() from the first dial on
        self.links.keep(addr, changed=changed)

    def reach(self, did: str) -> None:
        """Keep a link to ``did`` at whatever address the resolver gives (the relay included)."""
        public_key_from_did(did)
        if did == self.did:
            raise UsageError("that is this node's own DID")
        if self.links.ensure(did):
            self._peer(did)  # listed in status() from the first dial on

    async def connect(self, addr: str) -> None:
        """Contract alias of :meth:`add_peer`: dial and keep reconnecting with backoff."""
        await self.add_peer(addr)

    def known_peers(self) -> dict[str, str]:
        return dict(self._known)

    def _peer(self, did: str) -> Peer:
        peer = self._peers.get(did)
        if peer is None:
            with self.store.read() as txn:
                first = next(pl.iter_outbox(txn, did), None)
                assigned = pl.get_u64(txn, "meta", pl.meta_out(did))
                delivered = pl.get_u64(txn, "meta", pl.meta_in(did))
            peer = Peer.restore(
                did,
                first_unacked=first,
                assigned=assigned,
                delivered=delivered,
                own_max_frame=self.config.max_frame,
            )
            self._peers[did] = peer
        return peer

    # --- quarantined records -------------------------------------------------------------------

    def quarantined_count(self) -> int:
        """Records the sealer refused (bad signature, malformed, duplicate id)."""
        with self.store.read() as txn:
            return txn.count("quarantine")

    # --- application channels ------------------------------------------------------------------

    def register_app(self, name: str, handler: AppHandler) -> None:
        """Deliver app frames named ``name`` to ``handler(peer_did, payload)`` in link order."""
        if not name or len(name.encode()) > 255:
            raise UsageError("app channel name must be 1..255 bytes")
        self._apps[name] = handler

    async def send_app(self, did: str, name: str, payload: bytes) -> None:
        """Seal ``payload`` with the peer's session and send it now (ordered, not durable)."""
        peer = self._peers.get(did)
        link = peer.link if peer is not None else None
        if peer is None or link is None or not peer.ready.is_set():
            raise NotConnectedError(f"no link with {did}")
        body = self.sessions.seal_app(did, name, payload)
        if len(body) > self.config.max_frame:
            raise UsageError(f"app payload above the {self.config.max_frame}-byte frame bound")
        try:
            await link.send(b"\x30" + body)
        except ConnectionClosed:
            raise NotConnectedError(f"link with {did} closed") from None

    def max_app_payload(self, did: str | None = None) -> int:
        """The largest payload :meth:`send_app` takes for ``did`` (the smaller of both
        nodes' frame bounds, minus what sealing adds; ours alone for None)."""
        peer = self._peers.get(did) if did is not None else None
        if peer is not None:
            return peer.text_limit()
        return text_limit(self.config.max_frame)

    def try_send_app(self, did: str, name: str, payload: bytes) -> bool:
        """:meth:`send_app` without waiting: False (nothing sealed or sent) if the link is busy.

        For callbacks on the hot path (the MCP tunnel): the frame leaves from the
        caller, no task hop. Raises like :meth:`send_app` when there is no link.
        """
        peer = self._peers.get(did)
        link = peer.link if peer is not None else None
        if peer is None or link is None or not peer.ready.is_set():
            raise NotConnectedError(f"no link with {did}")
        if not link.writable:
            return False
        body = self.sessions.seal_app(did, name, payload)
        if len(body) > self.config.max_frame:
            raise UsageError(f"app payload above the {self.config.max_frame}-byte frame bound")
        try:
            sent = link.send_nowait(b"\x30" + body)
        except ConnectionClosed:
            raise NotConnectedError(f"link with {did} closed") from None
        assert sent  # writable was checked and nothing ran in between
        return True

    def on_link_change(self, callback: LinkCallback) -> None:
        """Call ``callback(did, up)`` whenever a peer's session becomes ready or goes away."""
        self._link_callbacks.append(callback)

    def peer_state(self, did: str) -> Peer:
        """The message pipeline and link of ``did`` (read-only use: status, tests)."""
        return self._peer(did)

    @property
    def epoch(self) -> int:
        """This run's boot epoch, the high half of every sequence number it assigns."""
        return self._epoch

    def is_connected(self, did: str) -> bool:
        peer = self._peers.get(did)
        return peer is not None and peer.ready.is_set()

    def channel_binding(self, did: str) -> bytes:
        """The handshake hash of the current link to ``did`` (b"" without one).

        What a token sent over the link is bound to (docs/PROTOCOL.md "Link handshake").
        """
        peer = self._peers.get(did)
        link = peer.link if peer is not None else None
        return link.transcript_hash if link is not None else b""

    async def wait_connected(self, did: str, timeout: float) -> None:
        """Wait until the link to ``did`` and its session are up."""
        peer = self._peer(did)
        try:
            async with asyncio.timeout(timeout):
                await peer.ready.wait()
        except TimeoutError:
            raise ConnectTimeoutError(f"no link with {did} after {timeout} s") from None

    # --- reading state (API, CLI) --------------------------------------------------------------

    def inbox(self, after: int = 0, limit: int = 1000) -> list[pl.InboxEntry]:
        """Inbox entries with arrival number > ``after``."""
        with self.store.read() as txn:
            return list(take(pl.iter_inbox(txn, after), limit))

    async def wait_inbox(self, after: int, timeout: float) -> list[pl.InboxEntry]:
        """Like :meth:`inbox` but wait up to ``timeout`` for something new."""
        deadline = time.monotonic() + timeout
        while True:
            signal = self._inbox_event
            entries = self.inbox(after)
            left = deadline - time.monotonic()
            if entries or left <= 0 or self._quiescing:
                return entries
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await signal.wait()

    def _outbox_depth(self) -> int:
        with self.store.read() as txn:
            return txn.count("outbox")

    def status(self) -> dict[str, Any]:
        """Links, sessions with their suites, and queue depths."""
        links = []
        sessions = self.sessions.info()
        session_suites = {s["did"]: s["suite"] for s in sessions}
        for did, peer in sorted(self._peers.items()):
            links.append(
                {
                    "did": did,
                    "connected": peer.link is not None,
                    "ready": peer.ready.is_set(),
                    "role": peer.link.role.name.lower() if peer.link is not None else None,
                    "via": peer.link.via if peer.link is not None else None,
                    "auth_suite": peer.link.auth_suite if peer.link is not None else None,
                    "session_suite": session_suites.get(did),
                    "acked": peer.tx.acked,
                    "sent": peer.tx.sent,
                    "delivered": peer.rx.delivered,
                }
            )
        with self.store.read() as txn:
            outbox = txn.count("outbox")
            inbox = txn.count("inbox")
        return {
            "did": self.did,
            "listen": self.listen_url,
            "relay": self.relay.status() if self.relay is not None else None,
            "auth_suite": self.wallet.suite,
            "require_pq": self.config.require_pq,
            "links": links,
            "sessions": sessions,
            "queues": {
                "outbox": outbox,
                "inbox": inbox,
                "incoming_batch": len(self._incoming),
                "log_pending": self.log.pending_count,
            },
            "chain_height": self.log.height,
            "quarantined_records": self.quarantined_count(),
            "equivocations": self.heads.equivocations(),
            "equivocation_counts": self.heads.equivocation_counts(),
        }
