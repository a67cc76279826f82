r"""The running node (docs/ARCHITECTURE.md "Node contract"; DESIGN.md layer 2).

Asyncio glue only: protocol rules live in pure modules (link frames, handshake,
pipeline rules, sessions over the SDK). One event loop owns the links, the
sessions and the in-memory pipeline state; every LMDB write runs on ONE writer
thread so that a durable commit (fsync) never blocks the loop and frames keep
arriving while it runs — which is what makes group commit happen under load.

Message path (DESIGN.md "Storage": nothing is acknowledged before it is
committed)::

    send_message -> seq (epoch, n) in memory -> seal (signed commitment) -> MSG frame
                 \-> outbox (durable, group-committed, overlapping the transmission)
    MSG -> open -> batch -> one durable txn (inbox + log record + delivered seq
           + session state) -> ACK (cumulative) -> sender drops outbox rows and
           logs its own records of the acked messages

Why transmitting before the outbox commit is safe: docs/adr/0007-epoch-sequence-numbers.md.

Crash safety of ratchet state is described in docs/adr/0001-session-persistence.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import os
import random
import struct
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from talos import pipeline as pl
from talos.chain.block import Record
from talos.chain.log import BlockLog, run_sealer
from talos.config import Home, NodeConfig, PeerAddr, parse_listen, parse_peer_addr
from talos.discovery import (
    SOURCE_DIALLED,
    ChainResolver,
    LearnedResolver,
    Resolver,
    StaticResolver,
)
from talos.home import init_home
from talos.link import heads as hd
from talos.link import wire
from talos.link.auth import AuthPolicy, check_bundle_auth, load_pin, store_pin
from talos.link.handshake import CLOSE_DUPLICATE, CLOSE_PROTOCOL, CLOSE_SHUTDOWN, Role
from talos.link.peer import (
    MAX_QUEUE,
    FrameStream,
    Link,
    LinkSettings,
    PeerRefused,
    accept_link,
    dial_link,
)
from talos.logging import event
from talos.metrics import Metrics
from talos.pipeline import MessageTooLargeError, text_limit
from talos.sessions import (
    MessageSignatureError,
    Opened,
    SessionManager,
    UnknownSessionError,
    UnsignedMessageError,
)
from talos.store import Store, Txn
from talos.writer import StoreWriter
from talos_sdk.bundle import PrekeyBundle
from talos_sdk.errors import (
    DecryptionError,
    HandshakeError,
    ProtocolError,
    SignatureError,
    StorageError,
    TalosError,
    UsageError,
)
from talos_sdk.keyfile import load_wallet

__all__ = [
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
#: WebSocket close code 1013, "Try Again Later" (IANA registry of RFC 6455 section 11.7).
CLOSE_TRY_AGAIN = 1013
#: Consecutive undecryptable frames after which a session is re-keyed.
_DESYNC_LIMIT = 16
_T = TypeVar("_T")

AppHandler = Callable[[str, bytes], Awaitable[None] | None]
LinkCallback = Callable[[str, bool], None]


class NotConnectedError(TalosError, ConnectionError):
    """No authenticated link with a ready session to that peer right now."""


class ConnectTimeoutError(NotConnectedError, TimeoutError):
    """``wait_connected`` gave up."""


@dataclass(slots=True)
class _Incoming:
    peer: str
    opened: Opened


@dataclass(slots=True)
class _Peer:
    """Everything the node keeps in memory about one peer."""

    did: str
    tx: pl.SenderState
    rx: pl.ReceiverState
    link: Link | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    down: asyncio.Event = field(default_factory=asyncio.Event)
    pumping: bool = False
    dirty: bool = False
    last_progress: float = 0.0
    max_sent: int = 0
    decrypt_failures: int = 0
    sent_at: dict[int, float] = field(default_factory=dict)
    last_assigned: int = 0
    #: Rows with a seq whose outbox commit has not finished (sendable already).
    fresh: list[pl.OutboxEntry] = field(default_factory=list)
    #: Our own audit records of sent, unacknowledged messages, by seq.
    records: dict[int, Record] = field(default_factory=dict)
    head_sent: int = -1
    #: The largest link frame the peer accepts (its SESSION_OFFER); 0 = not said yet.
    max_frame: int = 0
    #: Rows failed as too large for the peer: seq -> their prev, which their successor takes.
    skipped: dict[int, int] = field(default_factory=dict)


class Node:
    """A Talos node: identity, store, links, sessions, pipeline, block log."""

    def __init__(
        self,
        home: Path,
        config: NodeConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        resolver: Resolver | None = None,
    ) -> None:
        self.home = Home(Path(home))
        self.config = config if config is not None else self.home.load_config()
        self._clock = clock
        self.metrics = Metrics()
        self.authorizer: Callable[[str], bool] = self._default_authorizer
        self._apps: dict[str, AppHandler] = {}
        self._link_callbacks: list[LinkCallback] = []
        self._peers: dict[str, _Peer] = {}
        self._known: dict[str, str] = {}  # DID -> address ("" when only allowed)
        # DESIGN.md "Discovery and scale": where a DID without a link is dialled;
        # the relay (if any) comes last, so a direct address is tried first.
        sources: list[Resolver] = [StaticResolver(lambda: self._known), LearnedResolver()]
        if self.config.relays:
            from talos.relay.attach import RelayResolver

            sources.append(RelayResolver(self.config.relays[0]))
        self.resolver: Resolver = resolver if resolver is not None else ChainResolver(*sources)
        self.relay: Any = None  # talos.relay.attach.NodeRelay once started with --relay
        self._allow: set[str] = set(self.config.allow)
        self._dialers: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._link_tasks: set[asyncio.Task[Any]] = set()
        self._incoming: list[_Incoming] = []
        self._outgoing: list[tuple[pl.OutboxEntry, asyncio.Future[None]]] = []
        self._epoch = 0
        self._outbox_busy = False
        self._committing = False
        self._inbox_event = asyncio.Event()
        self._server: Server | None = None
        self._quiescing = False
        self._writer: StoreWriter | None = None
        self._pin_writes: dict[str, asyncio.Future[None]] = {}
        self._stopping = False
        self._handshaking = 0
        self.started = False
        self.listen_url: str | None = None
        self.unclean_start = False
        self.settings = LinkSettings(
            max_frame=self.config.max_frame,
            ping_interval=self.config.ping_interval,
            handshake_timeout=self.config.handshake_timeout,
            auth=AuthPolicy(self.config.require_pq, self._pinned, self._pin),
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

    def _pin(self, did: str, key: bytes) -> None:
        """The link layer's synchronous pin callback: queue the write, do not wait here."""
        self._pin_writes[did] = asyncio.ensure_future(self.pin_peer_key(did, key))

    async def pin_peer_key(self, did: str, key: bytes) -> None:
        """Pin ``did``'s ML-DSA-65 key durably, on the writer thread (ADR 0005).

        The entry point for the link layer: a first hybrid contact is pinned
        before its link carries anything (:meth:`_run_link` waits for it).
        """
        await self.writer.write(functools.partial(store_pin, did=did, key=key), kind="pin")
        event(_log, "peer_pinned", peer=did, suite="ed25519-mldsa65")

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the store, restore state, listen, dial configured peers, start the API."""
        if not self.home.exists():
            raise UsageError(f"no identity in {self.home.path}: run `talosd init` first")
        self.wallet = load_wallet(self.home.identity)
        self.did = self.wallet.did
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
            asyncio.create_task(self._heads_loop(), name="talos-heads"),
            asyncio.create_task(self._quarantine_loop(), name="talos-quarantine"),
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
                self._server = await self._serve(host, port)
            except OSError as exc:
                raise UsageError(
                    f"cannot listen on {self.config.listen}: {exc.strerror or exc}"
                ) from None
            sock = next(iter(self._server.sockets))
            real_host, real_port = sock.getsockname()[:2]
            self.listen_url = f"ws://{real_host}:{real_port}"
        if self.config.relays:
            from talos.relay.attach import NodeRelay

            self.relay = NodeRelay(self, self.config.relays)
            self.relay.start()  # connects in the background: a relay that is down is retried
        for addr in list(self._known.values()):
            if addr:
                self._start_dialer(parse_peer_addr(addr))
        for addr in self.config.peers:
            await self.add_peer(addr)

    async def _serve(self, host: str, port: int) -> Server:
        return await serve(
            self._on_accept,
            host,
            port,
            compression=None,
            max_size=self.settings.ws_max_size,
            ping_interval=self.config.ping_interval,
            ping_timeout=self.config.ping_interval,
            close_timeout=2,
            max_queue=MAX_QUEUE,
        )

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
        )
        # ADR 0001: after an unclean stop no ratchet state may be reused.
        await self.writer.write(
            lambda txn: self.sessions.load(txn, discard=self.unclean_start), kind="start"
        )
        self._epoch = await self.writer.write(self._mark_running, kind="start")
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
        for task in self._dialers.values():
            task.cancel()
        if self._server is not None:
            self._server.close(close_connections=False)
        links = [p.link for p in self._peers.values() if p.link is not None]
        await asyncio.gather(
            *(link.close(CLOSE_SHUTDOWN, "node shutting down") for link in links),
            return_exceptions=True,
        )
        if self.relay is not None:
            await self.relay.stop()
        if self._server is not None:
            await self._server.wait_closed()
        for task in [*self._tasks, *self._dialers.values(), *self._link_tasks]:
            task.cancel()
        await asyncio.gather(
            *self._tasks, *self._dialers.values(), *self._link_tasks, return_exceptions=True
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
        running = self._dialers.get(peer.did)
        if not self._stopping and (changed or running is None or running.done()):
            self._start_dialer(peer)
        return peer

    async def connect(self, addr: str) -> None:
        """Contract alias of :meth:`add_peer`: dial and keep reconnecting with backoff."""
        await self.add_peer(addr)

    def known_peers(self) -> dict[str, str]:
        return dict(self._known)

    def _peer(self, did: str) -> _Peer:
        peer = self._peers.get(did)
        if peer is None:
            with self.store.read() as txn:
                first = next(pl.iter_outbox(txn, did), None)
                assigned = pl.get_u64(txn, "meta", pl.meta_out(did))
                delivered = pl.get_u64(txn, "meta", pl.meta_in(did))
            acked = first.prev if first is not None else assigned
            peer = _Peer(did, pl.SenderState(acked), pl.ReceiverState(delivered))
            peer.last_assigned = assigned
            peer.down.set()
            self._peers[did] = peer
        return peer

    def _start_dialer(self, addr: PeerAddr) -> None:
        old = self._dialers.get(addr.did)
        if old is not None and not old.done():
            old.cancel()
        self._dialers[addr.did] = asyncio.create_task(
            self._dial_loop(addr), name=f"talos-dial-{addr.did[-8:]}"
        )

    def _resolve(self, did: str) -> list[str]:
        try:
            return self.resolver.resolve(did)
        except Exception as exc:  # a failing discovery source must not stop dialling
            event(_log, "resolve_failed", level=logging.ERROR, peer=did, error=repr(exc))
            return []

    def _next_addr(self, addr: PeerAddr) -> PeerAddr:
        """After a failed dial: the resolver's next address for the DID (cyclic)."""
        urls = self._resolve(addr.did)
        if not urls:
            return addr
        i = urls.index(addr.url) + 1 if addr.url in urls else 0
        return PeerAddr(urls[i % len(urls)], addr.did)

    def _ensure_dialer(self, did: str) -> None:
        """Dial ``did`` at a resolved address unless a link or a dialer exists."""
        running = self._dialers.get(did)
        if self._stopping or (running is not None and not running.done()):
            return
        peer = self._peers.get(did)
        if peer is not None and peer.link is not None:
            return
        urls = self._resolve(did)
        if urls:
            self._start_dialer(PeerAddr(urls[0], did))

    async def _dial_loop(self, addr: PeerAddr) -> None:
        delay = self.config.reconnect_initial
        while not self._stopping:
            peer = self._peer(addr.did)
            if peer.link is not None:
                await peer.down.wait()
                continue
            try:
                link = await self._dial(addr)
            except Exception as exc:  # any failure to dial is retried, never fatal
                level = logging.DEBUG  # an unreachable peer is normal; a refusal is not
                if isinstance(exc, PeerRefused):
                    level = logging.WARNING
                elif not isinstance(exc, ConnectionError | HandshakeError | OSError):
                    level = logging.ERROR
                event(_log, "dial_failed", level=level, peer=addr.did, error=repr(exc))
                addr = self._next_addr(addr)
                # Exponential backoff with full jitter, capped (AWS architecture blog).
                await asyncio.sleep(random.uniform(0.5, 1.0) * delay)
                delay = min(delay * 2, self.config.reconnect_max)
                continue
            delay = self.config.reconnect_initial
            if link.via == "direct":
                with contextlib.suppress(TalosError):  # a bad learned address must not drop it
                    self.resolver.learn(addr.did, addr.url, SOURCE_DIALLED)
            await self._run_link(link)
            if link.via != "direct":  # after a relayed link, a direct address goes first again
                urls = self._resolve(addr.did)
                addr = PeerAddr(urls[0], addr.did) if urls else addr
            await asyncio.sleep(random.uniform(0, self.config.reconnect_initial))

    async def _dial(self, addr: PeerAddr) -> Link:
        """A link to ``addr``: a WebSocket, or a stream through the relay (talos/relay)."""
        if self.relay is not None and addr.url == self.relay.address:
            link: Link = await self.relay.dial(addr.did)
            return link
        return await dial_link(addr.url, addr.did, self.wallet, self.authorizer, self.settings)

    def reach(self, did: str) -> None:
        """Keep a link to ``did`` at whatever address the resolver gives (the relay included)."""
        from talos_sdk.did import public_key_from_did

        public_key_from_did(did)
        if did == self.did:
            raise UsageError("that is this node's own DID")
        self._ensure_dialer(did)

    async def _on_accept(self, ws: ServerConnection | FrameStream) -> None:
        if self._stopping:
            await ws.close(CLOSE_SHUTDOWN, "node shutting down")
            return
        if self._handshaking >= self.settings.max_handshakes:
            # Each one may buffer frames before it proves anything: bound them all.
            self.metrics.inc("handshakes_refused")
            event(_log, "handshake_refused", level=logging.WARNING, limit=self._handshaking)
            await ws.close(CLOSE_TRY_AGAIN, "too many link handshakes in progress")
            return
        self._handshaking += 1
        try:
            link = await accept_link(ws, self.wallet, self.authorizer, self.settings)
        except HandshakeError as exc:
            self.metrics.inc("links_refused")
            event(_log, "link_refused", level=logging.WARNING, reason=str(exc))
            return
        finally:
            self._handshaking -= 1
        await self._run_link(link)

    def _prefer(self, new: Link, old: Link) -> bool:
        """Which of two links to one peer survives; both sides decide alike."""

        def dialer(link: Link) -> str:
            return self.did if link.role is Role.INITIATOR else link.peer_did

        if new.via != old.via:
            return new.via == "direct"  # a direct link beats a relayed one, on both sides
        if dialer(new) == dialer(old):
            return True  # a redial replaces a link that died without us noticing
        return dialer(new) == min(self.did, new.peer_did)

    async def _run_link(self, link: Link) -> None:
        """Own ``link`` until it closes: session setup, then the read loop."""
        peer = self._peer(link.peer_did)
        old = peer.link
        if old is not None and old.open:
            if not self._prefer(link, old):
                await link.close(CLOSE_DUPLICATE, "duplicate link")
                return
            self._spawn(old.close(CLOSE_DUPLICATE, "replaced by a newer link"))
        self._set_down(peer)
        peer.link = link
        peer.down.clear()
        self.metrics.inc("links_up")
        event(_log, "link_up", peer=link.peer_did, role=link.role.name.lower())
        task = asyncio.current_task()
        if task is not None:
            self._link_tasks.add(task)
        try:
            pinning = self._pin_writes.pop(link.peer_did, None)
            if pinning is not None:
                await pinning  # first hybrid contact: the pin is durable before use
            offer = self.sessions.offer(link.peer_did)
            offer = wire.SessionOffer(offer.bundle, offer.session_id, self.config.max_frame)
            await link.send(wire.encode(offer))
            await self._read_loop(peer, link)
        except ConnectionClosed:
            pass
        except (ProtocolError, HandshakeError, StorageError) as exc:
            # A protocol fault, or a pin that could not be stored: the link goes.
            event(_log, "link_protocol_error", level=logging.WARNING, peer=peer.did, error=str(exc))
            with contextlib.suppress(ConnectionClosed):
                await link.close(CLOSE_PROTOCOL, str(exc))
        finally:
            if task is not None:
                self._link_tasks.discard(task)
            if peer.link is link:
                peer.link = None
                self._set_down(peer)
                peer.down.set()
            event(_log, "link_down", peer=peer.did, code=link.ws.close_code)

    def _set_down(self, peer: _Peer) -> None:
        was_up = peer.ready.is_set()
        peer.ready.clear()
        peer.tx.rewind()
        if was_up:
            self._notify_link(peer.did, False)

    def _set_ready(self, peer: _Peer) -> None:
        peer.ready.set()
        peer.last_progress = time.monotonic()
        event(_log, "session_ready", peer=peer.did, suite=self.sessions.suite(peer.did))
        self._notify_link(peer.did, True)
        self._kick(peer)
        peer.head_sent = -1
        self._send_head(peer)

    def _notify_link(self, did: str, up: bool) -> None:
        for cb in list(self._link_callbacks):
            try:
                cb(did, up)
            except Exception as exc:
                event(_log, "link_callback_failed", level=logging.ERROR, error=repr(exc))

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._link_tasks.add(task)
        task.add_done_callback(self._link_tasks.discard)

    # --- reading -------------------------------------------------------------------------------

    async def _read_loop(self, peer: _Peer, link: Link) -> None:
        max_frame = self.config.max_frame
        while True:
            data = await link.recv()
            try:
                frame = wire.decode(data, max_frame)
                if isinstance(frame, wire.Msg):
                    self._on_msg(peer, frame)
                    peer.decrypt_failures = 0
                elif isinstance(frame, wire.Ack):
                    self._on_ack(peer, frame.seq)
                elif isinstance(frame, wire.App):
                    await self._on_app(peer, frame)
                    peer.decrypt_failures = 0
                elif isinstance(frame, wire.SessionOffer):
                    await self._on_offer(peer, link, frame)
                elif isinstance(frame, wire.SessionInit):
                    await self._on_session_init(peer, link, frame)
                elif isinstance(frame, wire.SessionAck):
                    await self._on_session_ack(peer, link, frame)
                elif isinstance(frame, wire.Refuse):
                    event(_log, "peer_refused", peer=peer.did, reason=frame.reason)
                    return
                else:
                    raise ProtocolError(f"unexpected {type(frame).__name__} after handshake")
            except (ProtocolError, DecryptionError, SignatureError, UsageError) as exc:
                # Bad input costs the frame, never the node or the link.
                self.metrics.inc("frames_rejected")
                event(
                    _log,
                    "frame_rejected",
                    level=logging.WARNING,
                    peer=peer.did,
                    kind=type(exc).__name__,
                    error=str(exc),
                )
                if isinstance(exc, DecryptionError):
                    peer.decrypt_failures += 1
                    if peer.decrypt_failures >= _DESYNC_LIMIT:
                        await self._resync(peer, link)
                        return
            except (ConnectionClosed, asyncio.CancelledError):
                raise
            except Exception as exc:
                # A bug here must not take the link down with it; say so loudly.
                self.metrics.inc("frames_failed")
                event(
                    _log,
                    "frame_handling_failed",
                    level=logging.ERROR,
                    peer=peer.did,
                    kind=type(exc).__name__,
                    error=str(exc),
                )

    async def _resync(self, peer: _Peer, link: Link) -> None:
        """Sessions out of step (e.g. frames lost beyond MAX_SKIP): drop ours, relink.

        With no session on our side the next SESSION_OFFER exchange re-runs X3DH;
        unacknowledged messages are resent, so nothing durable is lost.
        """
        event(_log, "session_resync", level=logging.WARNING, peer=peer.did)
        self.metrics.inc("session_resyncs")
        peer.decrypt_failures = 0
        self.sessions.drop(peer.did)
        await self.writer.write(
            lambda txn: self.sessions.persist_establish(txn, peer.did), kind="session"
        )
        with contextlib.suppress(ConnectionClosed):
            await link.close(CLOSE_PROTOCOL, "session out of sync; re-keying")

    async def _on_offer(self, peer: _Peer, link: Link, offer: wire.SessionOffer) -> None:
        try:
            # The bundle must be signed in the suite the link proved (no downgrade).
            check_bundle_auth(PrekeyBundle.from_bytes(offer.bundle).verify(), link.peer_mldsa65)
            init = self.sessions.on_offer(peer.did, offer, link.suites)
        except TalosError as exc:
            await self._setup_failed(peer, link, exc)
            return
        if offer.max_frame:
            peer.max_frame = offer.max_frame
        if init is not None:
            await self.writer.write(
                lambda txn: self.sessions.persist_establish(txn, peer.did), kind="session"
            )
            await link.send(wire.encode(init))
            return  # ready once the peer's SESSION_ACK shows it accepted the init
        if self.sessions.has(peer.did):
            self._set_ready(peer)

    async def _setup_failed(self, peer: _Peer, link: Link, exc: TalosError) -> None:
        """A link without a session is useless: close it so the next one sets up afresh."""
        self.metrics.inc("session_setup_failures")
        event(
            _log,
            "session_setup_failed",
            level=logging.WARNING,
            peer=peer.did,
            kind=type(exc).__name__,
            error=str(exc),
        )
        self.sessions.drop(peer.did)
        with contextlib.suppress(ConnectionClosed):
            await link.close(CLOSE_PROTOCOL, f"session setup failed: {exc}")

    async def _on_session_init(self, peer: _Peer, link: Link, init: wire.SessionInit) -> None:
        try:
            ack = self.sessions.on_init(peer.did, init)
        except TalosError as exc:
            await self._setup_failed(peer, link, exc)
            return
        await self.writer.write(
            lambda txn: self.sessions.persist_establish(txn, peer.did), kind="session"
        )
        await link.send(wire.encode(ack))
        peer.tx.rewind()  # anything sealed with a replaced session is lost: resend
        self._set_ready(peer)

    async def _on_session_ack(self, peer: _Peer, link: Link, ack: wire.SessionAck) -> None:
        try:
            self.sessions.on_ack(peer.did, ack)
        except TalosError as exc:
            await self._setup_failed(peer, link, exc)
            return
        if not peer.ready.is_set():
            self._set_ready(peer)  # the initiator's session is confirmed now

    def _on_msg(self, peer: _Peer, frame: wire.Msg) -> None:
        try:
            opened = self.sessions.open_message(peer.did, frame.body)
        except MessageSignatureError as exc:
            unsigned = isinstance(exc, UnsignedMessageError)
            self.metrics.inc("messages_unsigned" if unsigned else "messages_bad_signature")
            raise
        if opened.seq != frame.seq:
            raise ProtocolError("MSG header sequence differs from the sealed one")
        verdict = peer.rx.classify(opened.seq, opened.prev)
        if verdict == pl.Verdict.ACCEPT:
            self._incoming.append(_Incoming(peer.did, opened))
            self._start_commit()
            self.metrics.inc("messages_in")
        elif verdict == pl.Verdict.DUPLICATE:
            self.metrics.inc("messages_duplicate")
            if opened.seq <= peer.rx.delivered:
                self._send_ack(peer)
            # else: it is in the open batch and gets acked with it
        else:
            self.metrics.inc("messages_gap")

    def _send_ack(self, peer: _Peer) -> None:
        link = peer.link
        if link is None:
            return
        data = wire.encode(wire.Ack(peer.rx.delivered))
        # Inline from the commit's done callback: a task would cost the sender a loop pass.
        with contextlib.suppress(ConnectionClosed):
            if link.send_nowait(data):
                return
        self._spawn(self._send_quiet(link, data))

    @staticmethod
    async def _send_quiet(link: Link, data: bytes) -> None:
        with contextlib.suppress(ConnectionClosed):
            await link.send(data)

    def _on_ack(self, peer: _Peer, seq: int) -> None:
        # An ack from an earlier epoch may cover messages a crashed run of ours sent
        # without committing them (ADR 0007); in this epoch we know what we sent.
        # Epoch 0 is never assigned: boots and offline sends start at 1.
        if seq > peer.max_sent and not 0 < pl.epoch_of(seq) < self._epoch:
            raise ProtocolError(f"ack {seq} for a message not sent yet")
        if not peer.tx.on_ack(seq):
            return
        now = time.monotonic()
        peer.last_progress = now
        for s in [s for s in peer.sent_at if s <= seq]:
            self.metrics.ack_latency.observe(now - peer.sent_at.pop(s))
        if peer.fresh and peer.fresh[0].seq <= seq:
            peer.fresh = [r for r in peer.fresh if r.seq > seq]
        records = [peer.records.pop(s) for s in sorted(s for s in peer.records if s <= seq)]
        self._spawn(
            self.writer.write(
                functools.partial(_ack_txn, log=self.log, did=peer.did, seq=seq, records=records),
                durable=False,
                kind="ack",
            )
        )

    async def _on_app(self, peer: _Peer, frame: wire.App) -> None:
        name, payload = self.sessions.open_app(peer.did, frame.body)
        if name == hd.HEAD_CHANNEL:
            pin = self._pinned(peer.did)
            self._on_head(peer, hd.decode_head(payload, peer.did, pin))
            return
        handler = self._apps.get(name)
        if handler is None:
            raise ProtocolError(f"no app channel named {name!r}")
        self.metrics.inc("app_frames_in")
        result = handler(peer.did, payload)
        if inspect.isawaitable(result):
            await result

    # --- committing ----------------------------------------------------------------------------

    def _start_commit(self) -> None:
        """Group commit: everything that arrived since the last commit goes in one txn.

        Started straight from the frame handler when no commit runs (no extra loop
        pass); frames arriving meanwhile wait for the next one.
        """
        if self._committing or not self._incoming or self._stopping:
            return
        batch, self._incoming = self._incoming, []
        peers = {item.peer for item in batch}
        snaps = self.sessions.snapshot(peers)
        self._committing = True
        self.writer.submit(
            functools.partial(self._commit_batch, batch=batch, snaps=snaps),
            then=functools.partial(self._committed, batch, peers),
            kind="receive",
            size=len(batch),
        )

    def _committed(
        self, batch: list[_Incoming], peers: set[str], fut: asyncio.Future[None]
    ) -> None:
        self._committing = False
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.metrics.inc("commit_failures")
            level = logging.ERROR
            event(_log, "commit_failed", level=level, error=repr(exc), count=len(batch))
            for did in peers:
                self._peers[did].rx.rolled_back()
            # Frames queued meanwhile were accepted after the lost ones: committing
            # them would ack past messages never stored. The sender resends them all.
            dropped = [i for i in self._incoming if i.peer in peers]
            if dropped:
                self._incoming = [i for i in self._incoming if i.peer not in peers]
                self.metrics.inc("messages_dropped_after_failure", len(dropped))
        else:
            self.metrics.inc("commits")
            for item in batch:
                self._peers[item.peer].rx.committed(item.opened.seq)
            for did in peers:
                self._send_ack(self._peers[did])
            self._inbox_event.set()
            self._inbox_event = asyncio.Event()
        self._start_commit()

    def _commit_batch(self, txn: Txn, batch: list[_Incoming], snaps: dict[str, bytes]) -> None:
        last = txn.last("inbox")
        n = _U64.unpack(last[0])[0] + 1 if last is not None else 1
        top: dict[str, int] = {}
        for item in batch:
            o = item.opened
            txn.put(
                "inbox", _U64.pack(n), pl.encode_inbox(o.msg_id, item.peer, o.seq, o.ts_ms, o.text)
            )
            self.log.append(o.record, txn)
            top[item.peer] = o.seq
            n += 1
        for did, seq in top.items():
            pl.put_u64(txn, "meta", pl.meta_in(did), seq)
        self.sessions.persist(txn, snaps)

    async def _flush_loop(self) -> None:
        """Session state between message commits, not synced (ADR 0001)."""
        while True:
            await asyncio.sleep(self.config.session_flush_interval)
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

    # --- sending -------------------------------------------------------------------------------

    async def send_message(self, did: str, text: str, wait: bool = False) -> str:
        """Queue ``text`` for ``did`` durably; return the message id (hex).

        With ``wait`` return only once the peer acknowledged its commit.
        """
        if not self.started or self._stopping:
            raise UsageError("the node is not running")
        if did == self.did:
            raise UsageError("cannot send a message to this node itself")
        if not isinstance(text, str):
            raise UsageError("message text must be a string")
        from talos_sdk.did import public_key_from_did

        public_key_from_did(did)  # a clear DIDError for a malformed recipient
        peer = self._peer(did)
        limit = self._text_limit(peer)
        size = len(text.encode())
        if size > limit:
            raise MessageTooLargeError(
                f"message of {size} bytes above the {limit}-byte limit for {did}"
                " (the smaller of both nodes' max_frame, minus frame overhead)"
            )
        # ADR 0007: the number is unique across crashes, so the frame may leave
        # before its outbox row is durable; the caller hears back only after.
        prev = peer.last_assigned
        seq = pl.next_seq(prev, self._epoch)
        peer.last_assigned = seq
        row = pl.OutboxEntry(
            did, seq, os.urandom(pl.MSG_ID_LEN), int(self._clock() * 1000), text, prev
        )
        peer.fresh.append(row)
        committed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._outgoing.append((row, committed))
        waiter = peer.tx.wait_for(seq) if wait else None
        # Frame first, then the commit: the writer thread's Python work would
        # otherwise take the GIL from the seal and the socket write.
        sent = await self._send_now(peer, row)
        if not self._outbox_busy and self._outgoing:
            self._flush_outbox()
        if not sent:
            self._kick(peer)
            self._ensure_dialer(did)
        await committed
        self.metrics.inc("messages_out")
        if waiter is not None:
            await waiter
        return row.msg_id.hex()

    def _flush_outbox(self) -> None:
        """Group commit of the outbox: sends arriving while one commit runs share the next."""
        batch, self._outgoing = self._outgoing, []
        self._outbox_busy = True
        self.writer.submit(
            functools.partial(self._enqueue_batch, rows=[r for r, _ in batch]),
            then=functools.partial(self._outbox_committed, batch),
            kind="outbox",
            size=len(batch),
        )

    def _outbox_committed(
        self, batch: list[tuple[pl.OutboxEntry, asyncio.Future[None]]], fut: asyncio.Future[None]
    ) -> None:
        self._outbox_busy = False
        exc = None if fut.cancelled() else fut.exception()
        for row, waiter in batch:
            if waiter.done():
                continue
            if exc is not None:
                # The rows stay sendable: later numbers name them as prev. The
                # caller gets the error and no id (ADR 0007, "failed commit").
                waiter.set_exception(exc)
                continue
            peer = self._peers[row.peer]
            if peer.fresh and peer.fresh[0].seq <= row.seq:
                peer.fresh = [r for r in peer.fresh if r.seq > row.seq]
            waiter.set_result(None)
        if self._outgoing and not self._stopping:
            self._flush_outbox()

    def _text_limit(self, peer: _Peer) -> int:
        bound = self.config.max_frame
        if peer.max_frame:
            bound = min(bound, peer.max_frame)
        return text_limit(bound)

    def _prev(self, peer: _Peer, prev: int) -> int:
        """``prev`` past any rows failed as too large (their successor names their prev)."""
        while prev in peer.skipped:
            prev = peer.skipped[prev]
        return prev

    def _fits(self, peer: _Peer, row: pl.OutboxEntry) -> bool:
        """False (and the row is failed for good) if the peer can never accept it."""
        if row.seq in peer.skipped:
            return False  # failed already; its outbox row may not be deleted yet
        if not peer.max_frame or len(row.text.encode()) <= text_limit(peer.max_frame):
            return True
        peer.skipped[row.seq] = row.prev
        peer.fresh = [r for r in peer.fresh if r.seq != row.seq]
        self.metrics.inc("messages_failed")
        event(
            _log,
            "message_failed",
            level=logging.WARNING,
            peer=peer.did,
            msg_id=row.msg_id.hex(),
            reason=f"above the peer's {text_limit(peer.max_frame)}-byte message limit",
        )
        exc = MessageTooLargeError(f"message {row.msg_id.hex()} can never fit {peer.did}'s frames")
        for fut in peer.tx.waiters.pop(row.seq, []):
            if not fut.done():
                fut.set_exception(exc)
        self._spawn(
            self.writer.write(
                functools.partial(_skip_row, row=row, prev=self._prev(peer, row.prev)), kind="skip"
            )
        )
        return False

    async def _send_now(self, peer: _Peer, row: pl.OutboxEntry) -> bool:
        """Send ``row`` from the caller's task when it is next and the socket has room."""
        link = peer.link
        if (
            peer.pumping
            or link is None
            or not peer.ready.is_set()
            or self._prev(peer, row.prev) > peer.tx.sent
            or not link.can_send_now
        ):
            return False
        peer.pumping = True
        try:
            await self._send_row(peer, link, row)
        except ConnectionClosed:
            pass
        finally:
            peer.pumping = False
        return True

    async def _send_row(self, peer: _Peer, link: Link, row: pl.OutboxEntry) -> None:
        if not self._fits(peer, row):
            return
        prev = self._prev(peer, row.prev)
        if prev != row.prev:
            row = dataclasses.replace(row, prev=prev)
        body, record = self.sessions.seal_message(peer.did, row)
        peer.records[row.seq] = record
        if peer.tx.sent == peer.tx.acked:
            peer.last_progress = time.monotonic()
        peer.tx.sent = row.seq
        peer.max_sent = max(peer.max_sent, row.seq)
        peer.sent_at.setdefault(row.seq, time.monotonic())
        await link.send(wire.encode(wire.Msg(row.seq, body)))

    def _enqueue_batch(self, txn: Txn, rows: list[pl.OutboxEntry]) -> None:
        """Writer thread: outbox rows, minus those the peer acked already (ack raced us)."""
        for row in rows:
            peer = self._peers.get(row.peer)
            if peer is not None and (row.seq <= peer.tx.acked or row.seq in peer.skipped):
                pl.note_assigned(txn, row.peer, row.seq)
                continue
            if peer is not None and row.prev in peer.skipped:
                row = dataclasses.replace(row, prev=self._prev(peer, row.prev))
            pl.put_row(txn, row)

    def _kick(self, peer: _Peer) -> None:
        peer.dirty = True
        if not peer.pumping and peer.ready.is_set():
            peer.pumping = True
            self._spawn(self._pump(peer))

    async def _pump(self, peer: _Peer) -> None:
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

    def _unsent(self, peer: _Peer) -> list[pl.OutboxEntry]:
        """Rows after ``tx.sent``: committed ones from LMDB, then those still committing."""
        fresh = peer.fresh
        sent = peer.tx.sent
        if fresh and self._prev(peer, fresh[0].prev) <= sent:
            return [r for r in fresh if r.seq > sent]  # nothing committed is pending
        with self.store.read() as txn:
            rows = _take(pl.iter_outbox(txn, peer.did, sent), 256)
        if len(rows) == 256:
            peer.dirty = True
            return rows
        last = rows[-1].seq if rows else sent
        return rows + [r for r in fresh if r.seq > last]

    async def _retry_loop(self) -> None:
        """Resend from the oldest unacked message when a link makes no progress."""
        interval = self.config.retry_interval
        while True:
            await asyncio.sleep(interval / 2)
            now = time.monotonic()
            for peer in self._peers.values():
                if (
                    peer.ready.is_set()
                    and peer.tx.sent > peer.tx.acked
                    and now - peer.last_progress > interval
                ):
                    event(_log, "resend", peer=peer.did, from_seq=peer.tx.acked + 1)
                    peer.tx.rewind()
                    peer.last_progress = now
                    self._kick(peer)
                elif peer.ready.is_set() and peer.tx.sent == peer.tx.acked:
                    self._kick(peer)  # rows queued while the link was coming up
                elif peer.link is None and peer.last_assigned > peer.tx.acked:
                    self._ensure_dialer(peer.did)  # outbox rows for a DID we do not dial

    # --- signed heads ----------------------------------------------------------------------------

    async def _heads_loop(self) -> None:
        """Announce our head to every ready peer when the log has grown."""
        while True:
            await asyncio.sleep(self.config.head_interval)
            for peer in list(self._peers.values()):
                self._send_head(peer)

    def _send_head(self, peer: _Peer) -> None:
        head = self.log.heads()
        if head is None or head.height <= peer.head_sent or not peer.ready.is_set():
            return
        peer.head_sent = head.height
        payload = hd.encode_head(head.statement)
        self._spawn(self._send_head_quiet(peer.did, payload))

    async def _send_head_quiet(self, did: str, payload: bytes) -> None:
        with contextlib.suppress(NotConnectedError, UnknownSessionError):
            await self.send_app(did, hd.HEAD_CHANNEL, payload)

    def _on_head(self, peer: _Peer, presented: hd.PeerHead) -> None:
        """Judge the head on the writer thread, off the read loop (review #13).

        Not synced: a head lost in a crash is sent again by the peer (every
        head_interval while its log grows, and on every new link).
        """
        self.metrics.inc("heads_in")
        self.writer.submit(
            functools.partial(_judge_head, did=peer.did, presented=presented),
            durable=False,
            then=functools.partial(self._head_judged, peer.did),
            kind="head",
        )

    def _head_judged(self, did: str, fut: asyncio.Future[hd.Equivocation | None]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            event(_log, "head_store_failed", level=logging.ERROR, peer=did, error=repr(exc))
            return
        verdict = fut.result()
        if verdict is not None:
            self.metrics.inc("head_equivocations")
            event(
                _log,
                "head_equivocation",
                level=logging.WARNING,
                peer=did,
                reason=verdict.reason,
                kept_height=verdict.kept.height,
                presented_height=verdict.presented.height,
            )

    def peer_heads(self) -> dict[str, dict[str, Any]]:
        """The latest verified head statement kept for each peer."""
        out: dict[str, dict[str, Any]] = {}
        with self.store.read() as txn:
            for key, value in txn.items("meta", b"head:"):
                if not key.startswith(b"head:"):
                    break
                did = key[5:].decode()
                head = hd.load_head(value, did)
                if head is not None:
                    out[did] = head.statement
        return out

    def equivocation_counts(self) -> dict[str, int]:
        """Alerts seen per peer, including those past the stored ones."""
        prefix = hd.equiv_count_key("")
        with self.store.read() as txn:
            return {
                k[len(prefix) :].decode(): _U64.unpack(v)[0]
                for k, v in _prefixed(txn.items("meta", prefix), prefix)
            }

    def equivocations(self) -> list[dict[str, Any]]:
        """Every equivocation alert recorded, oldest first per peer."""
        prefix = hd.equiv_prefix()
        with self.store.read() as txn:
            return [
                json.loads(value) for key, value in _prefixed(txn.items("meta", prefix), prefix)
            ]

    # --- quarantined records -------------------------------------------------------------------

    def quarantined_count(self) -> int:
        """Records the sealer refused (bad signature, malformed, duplicate id)."""
        with self.store.read() as txn:
            return txn.count("quarantine")

    async def _quarantine_loop(self) -> None:
        """Say loudly when the sealer quarantines a record (review #7): nothing else reads it."""
        seen = self.quarantined_count()
        if seen:
            event(_log, "records_quarantined", level=logging.WARNING, total=seen, new=0)
        while True:
            await asyncio.sleep(self.config.seal_interval)
            now = self.quarantined_count()
            if now <= seen:
                continue
            fresh = self.log.quarantined()[seen:]
            self.metrics.inc("records_quarantined", now - seen)
            for q in fresh:
                record = q.record
                event(
                    _log,
                    "record_quarantined",
                    level=logging.WARNING,
                    reason=q.reason,
                    record_id=record.record_id.hex() if record is not None else None,
                    sender=record.sender if record is not None else None,
                )
            seen = now

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

    def is_connected(self, did: str) -> bool:
        peer = self._peers.get(did)
        return peer is not None and peer.ready.is_set()

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
            return list(_take(pl.iter_inbox(txn, after), limit))

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
            "equivocations": self.equivocations(),
            "equivocation_counts": self.equivocation_counts(),
        }


def _judge_head(txn: Txn, did: str, presented: hd.PeerHead) -> hd.Equivocation | None:
    """Writer thread: compare with the kept head, keep the better one, record a conflict."""
    kept = hd.load_head(txn.get("meta", hd.head_key(did)), did)
    keep, conflict = hd.judge(kept, presented)
    if keep is not kept:
        txn.put("meta", hd.head_key(did), hd.encode_head(keep.statement))
    if conflict is not None:
        count_key = hd.equiv_count_key(did)
        raw = txn.get("meta", count_key)
        if raw is not None:
            n = _U64.unpack(raw)[0]
        else:  # a store from before the count: its rows are the count
            prefix = hd.equiv_prefix(did)
            n = sum(1 for _ in _prefixed(txn.items("meta", prefix), prefix))
        if n < hd.MAX_EQUIVOCATIONS_KEPT:
            txn.put("meta", hd.equiv_key(did, n), hd.encode_head(conflict.to_json()))
        txn.put("meta", count_key, _U64.pack(n + 1))
    return conflict


def _skip_row(txn: Txn, row: pl.OutboxEntry, prev: int) -> None:
    """Writer thread: drop a failed row; its successor now follows ``prev`` (review #9)."""
    txn.delete("outbox", pl.outbox_key(row.peer, row.seq))
    nxt = next(pl.iter_outbox(txn, row.peer, row.seq), None)
    if nxt is not None and nxt.prev == row.seq:
        pl.put_row(txn, dataclasses.replace(nxt, prev=prev))


def _prefixed(items: Iterable[tuple[bytes, bytes]], prefix: bytes) -> Iterable[tuple[bytes, bytes]]:
    for key, value in items:
        if not key.startswith(prefix):
            return
        yield key, value


def _ack_txn(txn: Txn, log: BlockLog, did: str, seq: int, records: list[Record]) -> None:
    """Drop acked outbox rows and log our own records of them (DESIGN.md "block log")."""
    pl.drop_acked(txn, did, seq)
    for record in records:
        log.append(record, txn)


def _take(it: Iterable[_T], n: int) -> list[_T]:
    out: list[_T] = []
    for x in it:
        out.append(x)
        if len(out) >= n:
            break
    return out
