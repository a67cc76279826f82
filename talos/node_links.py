"""A running node's peers and what it does with their links (docs/PROTOCOL.md "Link protocol").

The peers table (addresses we keep a link to, ``--allow``, per-peer state),
and the node's side of each authenticated link: the link supervisor
(talos/link/supervisor.py: dialling, accepting, admission, the duplicate-link
rule) hands each link to :meth:`NodeLinks._run_link`, which runs the
SESSION_OFFER / INIT / ACK exchange that makes its session ready, then one
read loop that hands each frame to its handler. Part of
:class:`~talos.node.Node` (see :mod:`talos.node_base`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from websockets.exceptions import ConnectionClosed

from talos import pipeline as pl
from talos.config import PeerAddr, parse_peer_addr
from talos.link import wire
from talos.link.auth import check_bundle_auth
from talos.link.handshake import CLOSE_PROTOCOL
from talos.link.peer import Link
from talos.link.refusals import DEFER_WHY, UNREACHABLE, LinkProblem
from talos.logging import event
from talos.node_apps import ConnectTimeoutError
from talos.node_base import NodeBase, Peer
from talos.peer_names import forget_peer
from talos.sessions import UnknownSessionError
from talos_sdk.bundle import PrekeyBundle
from talos_sdk.did import public_key_from_did
from talos_sdk.errors import (
    DecryptionError,
    HandshakeError,
    LinkRefusedError,
    PeerUnreachableError,
    ProtocolError,
    SignatureError,
    StorageError,
    TalosError,
    UsageError,
)

__all__ = ["NodeLinks", "ProblemCallback"]

_log = logging.getLogger("talos.node")

#: ``callback(did, problem)``: a link to ``did`` was refused, or a dial failed.
ProblemCallback = Callable[[str, LinkProblem], None]


#: How a send whose wait ended says where its message is.
QUEUED: Final = "the message stays queued (talosd outbox)"


def refused_error(did: str, problem: LinkProblem) -> LinkRefusedError:
    """What a send waiting for ``did``'s ack raises when its link was refused for good."""
    return LinkRefusedError(f"{problem.message(did)}; {QUEUED}")


class NodeLinks(NodeBase):
    """The peers table; the node's side of each link: session setup and the read loop."""

    # --- the peers table -----------------------------------------------------------------------

    def _default_authorizer(self, did: str) -> bool:
        return did in self._known or did in self._allow

    def allow(self, did: str) -> None:
        """Let ``did`` hold a link with us while this node runs (``--allow``)."""
        self._allow.add(did)

    async def allow_peer(self, did: str) -> None:
        """Let ``did`` hold a link with us from now on, across restarts (``talosd peers
        allow``): a peers row without an address until ``peers remove``. A peer known
        already keeps its address."""
        if did == self.did:
            raise UsageError("that is this node's own DID")
        if did not in self._known:
            await self.writer.write(functools.partial(pl.allow_row, did=did), kind="peers")
            self._known.setdefault(did, "")

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

    async def remove_peer(self, did: str) -> int:
        """Forget ``did``: its address, its name, its session and what was learned of it.

        It may no longer link (until a start whose configuration names it again, or
        while a local client's claim lends it the right) and the link it holds
        closes. Messages queued for it stay (``talosd outbox``) and go if it is
        added again; returns how many.
        """
        public_key_from_did(did)
        self._known.pop(did, None)
        self._allow.discard(did)
        forget_learned = getattr(self.resolver, "forget", None)
        if forget_learned is not None:
            forget_learned(did)
        # The link goes before the session: a setup still running on it could otherwise
        # install a session after the drop.
        await self.links.forget(did)
        self.sessions.drop(did)

        queued = await self.writer.write(functools.partial(forget_peer, did=did), kind="peers")
        peer = self._peers.get(did)
        # Listed no more; restored from the store if met again. Not while a row of it
        # is still committing: restored from a store without that row, the peer's
        # state would take its number for acknowledged and drop the row unwritten.
        if peer is None or peer.ready.is_set() or peer.fresh:
            return queued
        # Every row numbered so far is written, failed or acknowledged (their commits
        # came before the forget's, and so did what the loop heard of them). Numbers
        # that live only in memory (a failed commit's) are written first: restored
        # without them, the peer's state would hand one out again, and the peer would
        # take that message for a duplicate of the first (ADR 0007).
        last = peer.last_assigned
        await self.writer.write(
            functools.partial(pl.note_last, peer=did, last=last, follows=peer.prev_of(last)),
            kind="peers",
        )
        if (
            not peer.fresh
            and not peer.ready.is_set()
            and peer.last_assigned == last
            and self._peers.get(did) is peer
        ):
            del self._peers[did]
        return queued

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
                assigned, next_prev = pl.next_prev(txn, did)
                delivered = pl.get_u64(txn, "meta", pl.meta_in(did))
                inbox_bytes = pl.get_u64(txn, "meta", pl.meta_inbox_bytes(did))
                inbox_pruned = pl.get_u64(txn, "meta", pl.META_INBOX_PRUNED)
            peer = Peer.restore(
                did,
                first_unacked=first,
                assigned=assigned,
                delivered=delivered,
                own_max_frame=self.config.max_frame,
                next_prev=next_prev,
            )
            peer.inbox_bytes, peer.inbox_pruned = inbox_bytes, inbox_pruned
            self._peers[did] = peer
        return peer

    def peer_state(self, did: str) -> Peer:
        """The message pipeline and link of ``did`` (read-only use: status, tests)."""
        return self._peer(did)

    async def wait_connected(self, did: str, timeout: float) -> None:
        """Wait until the link to ``did`` and its session are up: LinkRefusedError at once
        when a refusal for good is noted meanwhile (the peer does not allow us, a pin,
        post-quantum policy), else ConnectTimeoutError after ``timeout``."""
        peer = self._peer(did)
        if peer.ready.is_set():
            return
        refused: asyncio.Future[LinkProblem] = asyncio.get_running_loop().create_future()

        def noted(about: str, problem: LinkProblem) -> None:
            if about == did and problem.decisive and not refused.done():
                refused.set_result(problem)

        self._problem_callbacks.append(noted)
        ready = asyncio.ensure_future(peer.ready.wait())
        try:
            await asyncio.wait(
                (ready, refused), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            self._problem_callbacks.remove(noted)
            ready.cancel()
        if peer.ready.is_set():
            return
        if refused.done():
            raise LinkRefusedError(refused.result().message(did))
        problem = self.link_problem(did)
        last = f" (last: {problem.message(did)})" if problem is not None else ""
        raise ConnectTimeoutError(f"no link with {did} after {timeout} s{last}")

    # --- one link ------------------------------------------------------------------------------

    # --- why a peer has no link (talos/link/refusals.py) ------------------------------------------

    def _problem_noted(self, did: str, problem: LinkProblem) -> None:
        """From the supervisor: a decisive problem fails the sends waiting on ``did``; tell
        every listener."""
        peer = self._peers.get(did)
        if problem.decisive and peer is not None:  # sends waiting for an ack hear it now
            peer.tx.fail_waiters(functools.partial(refused_error, did, problem))
        for cb in list(self._problem_callbacks):
            try:
                cb(did, problem)
            except Exception as exc:
                event(_log, "link_callback_failed", level=logging.ERROR, error=repr(exc))

    def on_link_problem(self, callback: ProblemCallback) -> None:
        """Call ``callback(did, problem)`` whenever a link is refused or a dial fails."""
        self._problem_callbacks.append(callback)

    def link_problem(self, did: str) -> LinkProblem | None:
        """The latest refusal or failed dial of ``did`` since its last ready link."""
        return self._problems.get(did)

    def link_problems(self) -> list[tuple[str, LinkProblem]]:
        """Every peer's latest problem (at most MAX_PROBLEMS peers)."""
        return self._problems.items()

    def redial_now(self, did: str) -> None:
        """Dial ``did`` again at once if its last attempt failed (the refusal may be stale)."""
        self.links.redial_now(did)

    def cannot_link(self, did: str) -> bool:
        """True when no link to ``did`` can form as this node stands: none now, no address,
        no relay, and ``did`` may not dial in (a mistyped DID, most often)."""
        peer = self._peers.get(did)
        if peer is not None and peer.link is not None:
            return False
        return self.relay is None and not self.authorizer(did) and not self.links.resolve(did)

    def check_linkable(self, did: str) -> None:
        """PeerUnreachableError when :meth:`cannot_link`: a send that waits for the ack
        could only time out, so the local socket and the control API refuse it at once
        (after the UsageErrors any send to ``did`` gets)."""
        self._check_recipient(did)
        if self.cannot_link(did):
            raise PeerUnreachableError(
                f"{did}: no address known for the peer, no relay, and it may not link to this "
                f"node (not a known or allowed peer); check the DID, or add its address with "
                f"`talosd peers add ws://HOST:PORT#{did}`; nothing was sent"
            )

    def not_acked(self, did: str, timeout: float) -> Exception:
        """What a send whose wait for ``did``'s ack ran out raises: an unreachable or
        refusing peer is not a slow one."""
        state, why = self.link_state(did)
        if state in ("unreachable", "no_address"):
            return PeerUnreachableError(f"{did}: {why}; {QUEUED}")
        if state.startswith("refused"):
            return LinkRefusedError(f"{did}: {why}; {QUEUED}")
        return TimeoutError(
            f"no acknowledgement from {did} within {timeout:g} s"
            + (f" ({why})" if why else "")
            + f"; {QUEUED}"
        )

    def link_state(self, did: str) -> tuple[str, str]:
        """``(state, why)`` of the link to ``did`` for status and the outbox: ready,
        linked (session pending), mailboxed (offline; mail waits in the relay),
        refused_by_peer / refused_by_us / unreachable, connecting, no_address or
        idle; ``why`` says why messages do not move."""
        peer = self._peers.get(did)
        if peer is not None and peer.ready.is_set():
            return "ready", DEFER_WHY[peer.deferred] if peer.deferred else ""
        if peer is not None and peer.link is not None:
            return "linked", "waiting for session"
        problem = self._problems.get(did)
        relay = self.relay
        if (
            relay is not None
            and relay.mailboxed(did)
            and (problem is None or problem.kind == UNREACHABLE)
        ):
            # Not a fault: the messages wait, sealed, where the peer will find them.
            return "mailboxed", "in the peer's relay mailbox until it connects"
        if problem is not None:
            return problem.kind, problem.why()
        if self.links.dialling(did):
            return "connecting", "connecting to the peer"
        if not self.links.resolve(did):
            return (
                "no_address",
                "no address known for the peer (talosd peers add ws://HOST:PORT#DID)",
            )
        return "idle", "not linked"

    async def _run_link(self, link: Link) -> bool:
        """Own an authenticated ``link`` (from talos/link/supervisor.py) until it closes:
        session setup, then the read loop. True if its session became ready."""
        peer = self._peer(link.peer_did)
        self._set_down(peer)
        peer.link = link
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
            # A protocol fault, or session state that could not be stored: the link goes.
            event(_log, "link_protocol_error", level=logging.WARNING, peer=peer.did, error=str(exc))
            with contextlib.suppress(ConnectionClosed):
                await link.close(CLOSE_PROTOCOL, str(exc))
        finally:
            if task is not None:
                self._link_tasks.discard(task)
            if link.ws.dropped:
                self.metrics.inc("frames_dropped_closing", link.ws.dropped)
            if link.unauthentic:
                self.metrics.inc("frames_unauthentic")
                event(_log, "link_frame_unauthentic", level=logging.WARNING, peer=peer.did)
            if peer.link is link:
                was_ready = peer.ready.is_set()
                peer.link = None
                self._set_down(peer)
            event(_log, "link_down", peer=peer.did, code=link.ws.close_code)
        return was_ready

    def _set_down(self, peer: Peer) -> None:
        was_up = peer.ready.is_set()
        peer.ready.clear()
        peer.link_down()
        if was_up:
            self._notify_link(peer.did, False)

    def _set_ready(self, peer: Peer) -> None:
        self._problems.clear(peer.did)
        peer.ready.set()
        peer.session_ready(time.monotonic())
        event(_log, "session_ready", peer=peer.did, suite=self.sessions.suite(peer.did))
        self._notify_link(peer.did, True)  # head gossip sends our head from here
        self._kick(peer)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._link_tasks.add(task)
        task.add_done_callback(self._link_tasks.discard)

    async def _read_loop(self, peer: Peer, link: Link) -> None:
        max_frame = self.config.max_frame
        while True:
            data = await link.recv()
            if peer.link is not link:
                # A link replaced by a newer one is read only until it has closed: what
                # it still carries is stale (an attacker may have held it back, and a
                # late SESSION_OFFER dropped the live session); the live link resends.
                self.metrics.inc("frames_stale")
                continue
            try:
                frame = wire.decode(data, max_frame)
                if isinstance(frame, wire.Msg):
                    self._on_msg(peer, frame)
                    peer.frame_opened()
                elif isinstance(frame, wire.Ack):
                    self._on_ack(peer, frame.seq)
                elif isinstance(frame, wire.Defer):
                    self._on_defer(peer, frame)
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
                    # Close our end too: a dialled link left open here kept its socket
                    # (and its keepalive) for good, one per redial of a refusing peer.
                    await link.close(1000, "refused by the peer")
                    return
                else:
                    raise ProtocolError(f"unexpected {type(frame).__name__} after handshake")
            except (ProtocolError, DecryptionError, SignatureError, UsageError) as exc:
                # Bad input costs the frame, never the node or the link.
                self._frame_lost(peer, "frames_rejected", "frame_rejected", logging.WARNING, exc)
                if isinstance(exc, DecryptionError) and peer.decrypt_failed():
                    await self._resync(peer, link)
                    return
                if isinstance(exc, UnknownSessionError) and peer.ready.is_set():
                    await self._resync(peer, link)  # a ready link without a session: re-key
                    return
            except (ConnectionClosed, asyncio.CancelledError):
                raise
            except Exception as exc:
                # A bug here must not take the link down with it; say so loudly.
                self._frame_lost(peer, "frames_failed", "frame_handling_failed", logging.ERROR, exc)

    def _frame_lost(self, peer: Peer, counter: str, name: str, level: int, exc: Exception) -> None:
        """Count and log a frame the read loop dropped (the exception's type and text only)."""
        self.metrics.inc(counter)
        event(_log, name, level=level, peer=peer.did, kind=type(exc).__name__, error=str(exc))

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
        elif peer.ready.is_set():
            self._set_down(peer)  # the offer replaced the session: ready again with its init

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
        if peer.link is link:
            self._set_down(peer)  # no sends sealed for a session that is gone
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
