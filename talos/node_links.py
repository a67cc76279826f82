"""Links and session setup of a running node (docs/PROTOCOL.md "Link protocol").

Dialling with backoff at the addresses the resolver gives, accepting (at most
``max_handshakes`` authenticating at once, ``max_handshakes_per_address`` from
one address: talos/link/admission.py), the duplicate-link rule, one read
loop per link that hands each frame to its handler, and the SESSION_OFFER /
INIT / ACK exchange that makes a link's session ready. Part of
:class:`~talos.node.Node` (see :mod:`talos.node_base`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import time
from collections.abc import Awaitable
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from talos.config import PeerAddr
from talos.discovery import SOURCE_DIALLED
from talos.link import wire
from talos.link.admission import Backoff, prefer_new_link
from talos.link.auth import CLOSE_DOWNGRADE, check_bundle_auth
from talos.link.handshake import CLOSE_DUPLICATE, CLOSE_PROTOCOL, CLOSE_SHUTDOWN, Role
from talos.link.peer import FrameStream, Link, PeerRefused, accept_link, dial_link
from talos.logging import event
from talos.node_base import NodeBase, Peer
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

__all__ = ["CLOSE_TRY_AGAIN", "NodeLinks"]

_log = logging.getLogger("talos.node")
#: WebSocket close code 1013, "Try Again Later" (IANA registry of RFC 6455 section 11.7).
CLOSE_TRY_AGAIN = 1013


class NodeLinks(NodeBase):
    """The node's links: dial, accept, keep one per peer, read, set up sessions."""

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
        backoff = Backoff(self.config.reconnect_initial, self.config.reconnect_max)
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
                await asyncio.sleep(random.uniform(0.5, 1.0) * backoff.failed())
                continue
            if link.via == "direct":
                with contextlib.suppress(TalosError):  # a bad learned address must not drop it
                    self.resolver.learn(addr.did, addr.url, SOURCE_DIALLED)
            ready = await self._run_link(link)
            if link.via != "direct":  # after a relayed link, a direct address goes first again
                urls = self._resolve(addr.did)
                addr = PeerAddr(urls[0], addr.did) if urls else addr
            if ready:
                backoff.ready()
                await asyncio.sleep(random.uniform(0, self.config.reconnect_initial))
            else:
                # Authenticated but never ready (session setup failed): keep backing off.
                await asyncio.sleep(random.uniform(0.5, 1.0) * backoff.failed())

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
        # Relayed handshakes all come from the relay: they share its quota.
        remote = ws.remote_address if isinstance(ws, ServerConnection) else None
        address = str(remote[0]) if remote else getattr(ws, "via", "")
        if not self._admission.enter(address):
            # Each one may buffer frames before it proves anything: bound them all.
            self.metrics.inc("handshakes_refused")
            event(
                _log,
                "handshake_refused",
                level=logging.WARNING,
                limit=self._admission.total,
                address=address,
            )
            await ws.close(CLOSE_TRY_AGAIN, "too many link handshakes in progress")
            return
        try:
            link = await accept_link(ws, self.wallet, self.authorizer, self.settings)
        except HandshakeError as exc:
            self.metrics.inc("links_refused")
            event(_log, "link_refused", level=logging.WARNING, reason=str(exc))
            return
        finally:
            self._admission.leave(address)
        await self._run_link(link)

    def _prefer(self, new: Link, old: Link) -> bool:
        """Which of two links to one peer survives; both sides decide alike."""

        def dialer(link: Link) -> str:
            return self.did if link.role is Role.INITIATOR else link.peer_did

        direct = (new.via == "direct", old.via == "direct")
        return prefer_new_link(self.did, new.peer_did, dialer(new), dialer(old), *direct)

    async def _run_link(self, link: Link) -> bool:
        """Own ``link`` until it closes: session setup, then the read loop.

        True if its session became ready (the dialler's backoff resets only then).
        """
        peer = self._peer(link.peer_did)
        if link.new_pin is not None:
            try:  # first hybrid contact: the pin is durable before the link is used
                await self.pin_peer_key(link.peer_did, link.new_pin)
            except TalosError as exc:  # e.g. another link pinned a different key meanwhile
                event(_log, "pin_failed", level=logging.WARNING, peer=peer.did, error=str(exc))
                await link.close(CLOSE_DOWNGRADE, "pinned key could not be stored")
                return False
        old = peer.link
        if old is not None and old.open:
            if not self._prefer(link, old):
                await link.close(CLOSE_DUPLICATE, "duplicate link")
                return False
            self._spawn(old.close(CLOSE_DUPLICATE, "replaced by a newer link"))
        self._set_down(peer)
        peer.link = link
        peer.down.clear()
        self.metrics.inc("links_up")
        event(_log, "link_up", peer=link.peer_did, role=link.role.name.lower(), kem=link.kem)
        was_ready = False
        task = asyncio.current_task()
        if task is not None:
            self._link_tasks.add(task)
        try:
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
            if link.unauthentic:
                self.metrics.inc("frames_unauthentic")
                event(_log, "link_frame_unauthentic", level=logging.WARNING, peer=peer.did)
            if peer.link is link:
                was_ready = peer.ready.is_set()
                peer.link = None
                self._set_down(peer)
                peer.down.set()
            event(_log, "link_down", peer=peer.did, code=link.ws.close_code)
        return was_ready

    def _set_down(self, peer: Peer) -> None:
        was_up = peer.ready.is_set()
        peer.ready.clear()
        peer.link_down()
        if was_up:
            self._notify_link(peer.did, False)

    def _set_ready(self, peer: Peer) -> None:
        peer.ready.set()
        peer.session_ready(time.monotonic())
        event(_log, "session_ready", peer=peer.did, suite=self.sessions.suite(peer.did))
        self._notify_link(peer.did, True)  # head gossip sends our head from here
        self._kick(peer)

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

    async def _read_loop(self, peer: Peer, link: Link) -> None:
        max_frame = self.config.max_frame
        while True:
            data = await link.recv()
            try:
                frame = wire.decode(data, max_frame)
                if isinstance(frame, wire.Msg):
                    self._on_msg(peer, frame)
                    peer.frame_opened()
                elif isinstance(frame, wire.Ack):
                    self._on_ack(peer, frame.seq)
                elif isinstance(frame, wire.App):
                    await self._on_app(peer, frame)
                    peer.frame_opened()
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
                if isinstance(exc, DecryptionError) and peer.decrypt_failed():
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

    async def _resync(self, peer: Peer, link: Link) -> None:
        """Sessions out of step (e.g. frames lost beyond MAX_SKIP): drop ours, relink.

        With no session on our side the next SESSION_OFFER exchange re-runs X3DH;
        unacknowledged messages are resent, so nothing durable is lost.
        """
        event(_log, "session_resync", level=logging.WARNING, peer=peer.did)
        self.metrics.inc("session_resyncs")
        self.sessions.drop(peer.did)
        await self.writer.write(
            lambda txn: self.sessions.persist_establish(txn, peer.did), kind="session"
        )
        with contextlib.suppress(ConnectionClosed):
            await link.close(CLOSE_PROTOCOL, "session out of sync; re-keying")

    async def _on_offer(self, peer: Peer, link: Link, offer: wire.SessionOffer) -> None:
        try:
            # The bundle must be signed in the suite the link proved (no downgrade).
            check_bundle_auth(PrekeyBundle.from_bytes(offer.bundle).verify(), link.peer_mldsa65)
            init = self.sessions.on_offer(peer.did, offer, link.suites, link.transcript_hash)
        except TalosError as exc:
            await self._setup_failed(peer, link, exc)
            return
        if offer.max_frame:
            peer.peer_max_frame = offer.max_frame
        if init is not None:
            await self.writer.write(
                lambda txn: self.sessions.persist_establish(txn, peer.did), kind="session"
            )
            await link.send(wire.encode(init))
            return  # ready once the peer's SESSION_ACK shows it accepted the init
        if self.sessions.has(peer.did):
            self._set_ready(peer)

    async def _setup_failed(self, peer: Peer, link: Link, exc: TalosError) -> None:
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

    async def _on_session_init(self, peer: Peer, link: Link, init: wire.SessionInit) -> None:
        try:
            ack = self.sessions.on_init(peer.did, init, link.transcript_hash)
        except TalosError as exc:
            await self._setup_failed(peer, link, exc)
            return
        await self.writer.write(
            lambda txn: self.sessions.persist_establish(txn, peer.did), kind="session"
        )
        await link.send(wire.encode(ack))
        peer.link_down()  # anything sealed with a replaced session is lost: resend
        self._set_ready(peer)

    async def _on_session_ack(self, peer: Peer, link: Link, ack: wire.SessionAck) -> None:
        try:
            self.sessions.on_ack(peer.did, ack, link.transcript_hash)
        except TalosError as exc:
            await self._setup_failed(peer, link, exc)
            return
        if not peer.ready.is_set():
            self._set_ready(peer)  # the initiator's session is confirmed now

    async def _on_app(self, peer: Peer, frame: wire.App) -> None:
        name, payload = self.sessions.open_app(peer.did, frame.body)
        handler = self._apps.get(name)
        if handler is None:
            raise ProtocolError(f"no app channel named {name!r}")
        self.metrics.inc("app_frames_in")
        result = handler(peer.did, payload)
        if inspect.isawaitable(result):
            await result
