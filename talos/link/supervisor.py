"""Getting and keeping authenticated links (docs/PROTOCOL.md "Link protocol", Admission).

:class:`LinkSupervisor` is everything a node does to *obtain* links, and
nothing it does with them: a dialler per peer it keeps a link to (addresses
from the resolver, the relay when the resolver names it, delay from
:class:`~talos.link.admission.Backoff`), the accepting side (a WebSocket
server and relayed streams, bounded by :class:`~talos.link.admission.Admission`),
the durable pin of a first hybrid contact's key before its link carries
anything (docs/adr/0005-hybrid-signatures.md), and the duplicate-link rule
(:func:`~talos.link.admission.keep_new_link`, pure). Each link that survives
the rule is handed to the node's ``run_link``, which sets up the session and
reads the link until it closes; its result (did the session become ready?)
is what resets the dialler's backoff.

Every failed dial and every refused handshake is kept as the peer's latest
:class:`~talos.link.refusals.LinkProblem` (close code, reason in words, time)
until a link to it reaches a ready session, and handed to ``noted`` so that
waiting senders and local clients hear of it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from websockets.exceptions import ConnectionClosed

from talos.config import PeerAddr
from talos.discovery import SOURCE_DIALLED, Resolver
from talos.link.admission import Admission, Backoff, keep_new_link
from talos.link.auth import CLOSE_DOWNGRADE
from talos.link.handshake import (
    CLOSE_DUPLICATE,
    CLOSE_PINNED_MISMATCH,
    CLOSE_SHUTDOWN,
    CLOSE_UNAUTHORIZED,
    Refusal,
    Signer,
)
from talos.link.peer import (
    FrameStream,
    Link,
    LinkSettings,
    PeerRefused,
    accept_link,
    dial_link,
    listen_links,
)
from talos.link.refusals import (
    BY_PEER,
    BY_US,
    UNREACHABLE,
    LinkProblem,
    LinkProblems,
    our_refusal_text,
    peer_refusal_text,
)
from talos.link.wsconn import WsServer
from talos.logging import Throttle, event
from talos.metrics import Metrics
from talos_sdk.errors import HandshakeError, TalosError

__all__ = ["CLOSE_TRY_AGAIN", "LinkSupervisor"]

_log = logging.getLogger("talos.node")
#: WebSocket close code 1013, "Try Again Later" (IANA registry of RFC 6455 section 11.7).
CLOSE_TRY_AGAIN = 1013

#: ``run_link(link)``: own the link until it closes; True if its session became ready.
RunLink = Callable[[Link], Awaitable[bool]]
#: ``pin(did, key)``: store a first hybrid contact's ML-DSA-65 key durably.
Pin = Callable[[str, bytes], Awaitable[None]]
#: ``noted(did, problem)``: a dial failed or a handshake was refused (kept in ``problems``).
Noted = Callable[[str, LinkProblem], None]


def _ignore(did: str, problem: LinkProblem) -> None:
    pass


@dataclass(slots=True)
class _Current:
    """The link a peer holds now, and an event set once the node let go of it."""

    link: Link
    gone: asyncio.Event = field(default_factory=asyncio.Event)


class LinkSupervisor:
    """Dial, accept, admit and de-duplicate links; hand each survivor to ``run_link``."""

    def __init__(
        self,
        did: str,
        signer: Signer,
        settings: LinkSettings,
        *,
        resolver: Resolver,
        authorize: Callable[[str], bool],
        metrics: Metrics,
        pin: Pin,
        run_link: RunLink,
        reconnect_initial: float,
        reconnect_max: float,
        noted: Noted = _ignore,
        clock: Callable[[], float] = time.time,
        problems: LinkProblems | None = None,
    ) -> None:
        self.did = did
        self.signer = signer
        self.settings = settings
        self.resolver = resolver
        self.metrics = metrics
        self.admission = Admission(settings.max_handshakes, settings.max_handshakes_per_address)
        #: talos.relay.attach.NodeRelay when the node runs with a relay (dials its address).
        self.relay: Any = None
        self.server: WsServer | None = None
        self.stopping = False
        self._authorize = authorize
        self._pin = pin
        self._run_link = run_link
        self._reconnect = (reconnect_initial, reconnect_max)
        self._dialers: dict[str, asyncio.Task[None]] = {}
        self._current: dict[str, _Current] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        #: The latest refusal or failed dial per peer (talos/link/refusals.py).
        self.problems = problems if problems is not None else LinkProblems()
        self._noted = noted
        self._clock = clock
        self._throttle = Throttle()
        #: Peers whose address was said unreachable since they were last reached (the
        #: address said): an offline peer is told once at INFO, then at DEBUG.
        self._unreachable: dict[str, str] = {}

    # --- dialling ------------------------------------------------------------------------------

    def keep(self, addr: PeerAddr, *, changed: bool = False) -> None:
        """Keep a link to ``addr.did``: dial it and redial with backoff while it is down.

        A dialler already running goes on unless the address ``changed``.
        """
        running = self._dialers.get(addr.did)
        if not self.stopping and (changed or running is None or running.done()):
            self._start_dialer(addr)

    def ensure(self, did: str) -> bool:
        """Dial ``did`` at a resolved address unless a link or a dialler exists.

        True if a dialler started.
        """
        running = self._dialers.get(did)
        if self.stopping or (running is not None and not running.done()):
            return False
        if did in self._current:
            return False
        urls = self.resolve(did)
        if urls:
            self._start_dialer(PeerAddr(urls[0], did))
        return bool(urls)

    async def forget(self, did: str) -> None:
        """Stop keeping a link to ``did`` (its dialler ends) and close the one it holds:
        it is no longer allowed (``talosd peers remove``)."""
        dialer = self._dialers.pop(did, None)
        if dialer is not None:
            dialer.cancel()
        self._unreachable.pop(did, None)
        current = self._current.get(did)
        if current is not None:
            with contextlib.suppress(ConnectionClosed):
                await current.link.close(CLOSE_UNAUTHORIZED, "this node removed the peer")
            with contextlib.suppress(TimeoutError):  # the node lets go of it (ends its tasks)
                async with asyncio.timeout(5):
                    await current.gone.wait()

    def dialling(self, did: str) -> bool:
        """True while a dialler keeps a link to ``did``."""
        running = self._dialers.get(did)
        return running is not None and not running.done()

    def resolve(self, did: str) -> list[str]:
        """The resolver's addresses of ``did`` ([] if a discovery source fails)."""
        try:
            return self.resolver.resolve(did)
        except Exception as exc:  # a failing discovery source must not stop dialling
            event(_log, "resolve_failed", level=logging.ERROR, peer=did, error=repr(exc))
            return []

    def _start_dialer(self, addr: PeerAddr) -> None:
        old = self._dialers.get(addr.did)
        if old is not None and not old.done():
            old.cancel()
        self._dialers[addr.did] = asyncio.create_task(
            self._dial_loop(addr), name=f"talos-dial-{addr.did[-8:]}"
        )

    def _next_addr(self, addr: PeerAddr) -> PeerAddr:
        """After a failed dial: the resolver's next address for the DID (cyclic)."""
        urls = self.resolve(addr.did)
        if not urls:
            return addr
        i = urls.index(addr.url) + 1 if addr.url in urls else 0
        return PeerAddr(urls[i % len(urls)], addr.did)

    async def _dial_loop(self, addr: PeerAddr) -> None:
        backoff = Backoff(*self._reconnect)
        while not self.stopping:
            current = self._current.get(addr.did)
            if current is not None:
                await current.gone.wait()
                continue
            try:
                link = await self._dial(addr)
            except Exception as exc:  # any failure to dial is retried, never fatal
                problem = self._dial_failed(addr, exc)
                addr = self._next_addr(addr)
                # Exponential backoff, capped, sleeping a random 0.5-1 x the delay. A
                # refusal for good waits the cap at once: only its operator changes it, and
                # a sender waiting for an answer redials now anyway (redial_now). Not a DID
                # mismatch: that is one address's fault, and the next may answer.
                firm = problem.decisive and problem.code != CLOSE_PINNED_MISMATCH
                delay = self._reconnect[1] if firm else backoff.failed()
                await asyncio.sleep(random.uniform(0.5, 1.0) * delay)
                continue
            if link.via == "direct":
                with contextlib.suppress(TalosError):  # a bad learned address must not drop it
                    self.resolver.learn(addr.did, addr.url, SOURCE_DIALLED)
            ready = await self.adopt(link)
            if link.via != "direct":  # after a relayed link, a direct address goes first again
                urls = self.resolve(addr.did)
                addr = PeerAddr(urls[0], addr.did) if urls else addr
            if ready:
                backoff.ready()
                self._unreachable.pop(addr.did, None)
                await asyncio.sleep(random.uniform(0, self._reconnect[0]))
            else:
                # Authenticated but never ready (session setup failed): keep backing off.
                await asyncio.sleep(random.uniform(0.5, 1.0) * backoff.failed())

    def _dial_failed(self, addr: PeerAddr, exc: Exception) -> LinkProblem:
        """Log a failed dial and keep it as the peer's latest problem, in words."""
        level = logging.DEBUG  # an unreachable peer is normal; a refusal is not
        now = int(self._clock() * 1000)
        if isinstance(exc, PeerRefused):
            level = logging.WARNING
            text = peer_refusal_text(exc.code, exc.reason)
            problem = LinkProblem(BY_PEER, text, now, exc.code)
        elif isinstance(exc, Refusal):
            level = logging.WARNING
            problem = LinkProblem(BY_US, our_refusal_text(exc.code, exc.reason), now, exc.code)
        else:
            if not isinstance(exc, ConnectionError | HandshakeError | OSError):
                level = logging.ERROR
            elif self._unreachable.get(addr.did) != addr.url and len(self._unreachable) < 4096:
                self._unreachable[addr.did] = addr.url
                level = logging.INFO  # said once: a log silent about it left users guessing
            problem = LinkProblem(UNREACHABLE, str(exc) or type(exc).__name__, now)
        event(
            _log,
            "dial_failed",
            level=level,
            peer=addr.did,
            addr=addr.url,
            kind=problem.kind,
            code=problem.code,
            reason=problem.reason,
        )
        self._note(addr.did, problem)
        return problem

    def _note(self, did: str, problem: LinkProblem) -> None:
        self.problems.note(did, problem)
        self._noted(did, problem)

    def redial_now(self, did: str) -> None:
        """Dial ``did`` again at once, skipping the backoff, if it has no link but a problem:
        whoever waits for an answer must not be judged by a stale refusal."""
        if self.stopping or did in self._current:
            return
        if self.problems.get(did) is None:
            self.ensure(did)
            return
        urls = self.resolve(did)
        if urls:
            self._start_dialer(PeerAddr(urls[0], did))

    async def _dial(self, addr: PeerAddr) -> Link:
        """A link to ``addr``: a WebSocket, or a stream through the relay (talos/relay)."""
        if self.relay is not None and addr.url == self.relay.address:
            link: Link = await self.relay.dial(addr.did)
            return link
        return await dial_link(addr.url, addr.did, self.signer, self._authorize, self.settings)

    # --- accepting -----------------------------------------------------------------------------

    async def listen(self, host: str, port: int) -> str:
        """Accept links on ``host:port`` (OSError if it cannot); the ``ws://`` URL bound."""
        self.server = await listen_links(self.accept, host, port, self.settings)
        sock = next(iter(self.server.sockets))
        real_host, real_port = sock.getsockname()[:2]
        return f"ws://{real_host}:{real_port}"

    async def accept(self, ws: FrameStream) -> None:
        """Run the responder handshake on an inbound pipe, within the admission bounds."""
        if self.stopping:
            await ws.close(CLOSE_SHUTDOWN, "node shutting down")
            return
        # A relayed handshake counts against its opener's relay account where the relay
        # names it (talos/relay/client.py), else against the relay as a whole.
        address = ws.source
        if not self.admission.enter(address):
            # Each one may buffer frames before it proves anything: bound them all.
            self.metrics.inc("handshakes_refused")
            dropped = self._throttle.admit(f"busy {address}", self._clock())
            if dropped is not None:
                event(
                    _log,
                    "handshake_refused",
                    level=logging.WARNING,
                    limit=self.admission.total,
                    address=address,
                    **({"suppressed": dropped} if dropped else {}),
                )
            await ws.close(CLOSE_TRY_AGAIN, "too many link handshakes in progress")
            return
        try:
            link = await accept_link(ws, self.signer, self._authorize, self.settings)
        except HandshakeError as exc:
            self.metrics.inc("links_refused")
            # The DID is the one the peer claimed: shown, never trusted (talos/link/refusals.py).
            did = exc.peer_did if isinstance(exc, Refusal) else None
            code = exc.code if isinstance(exc, Refusal | PeerRefused) else None
            # Anyone can cause these (a claimed DID proves nothing yet): bounded lines per address.
            dropped = self._throttle.admit(address, self._clock())
            if dropped is not None:
                event(
                    _log,
                    "link_refused",
                    level=logging.WARNING,
                    peer=did,
                    address=address,
                    code=code,
                    reason=str(exc),
                    **({"suppressed": dropped} if dropped else {}),
                )
            if isinstance(exc, Refusal) and did is not None:
                text = our_refusal_text(exc.code, exc.reason)
                now = int(self._clock() * 1000)
                self._note(did, LinkProblem(BY_US, text, now, exc.code, "accept"))
            return
        finally:
            self.admission.leave(address)
        await self.adopt(link)

    # --- handing links to the node -------------------------------------------------------------

    async def adopt(self, link: Link) -> bool:
        """Pin, apply the duplicate-link rule, and hand ``link`` to ``run_link`` until it closes.

        True if its session became ready.
        """
        did = link.peer_did
        if link.new_pin is not None:
            try:  # first hybrid contact: the pin is durable before the link is used
                await self._pin(did, link.new_pin)
            except TalosError as exc:  # e.g. another link pinned a different key meanwhile
                event(_log, "pin_failed", level=logging.WARNING, peer=did, error=str(exc))
                await link.close(CLOSE_DOWNGRADE, "pinned key could not be stored")
                return False
        old = self._current.get(did)
        if old is not None and old.link.open:
            if not keep_new_link(self.did, link, old.link):
                await link.close(CLOSE_DUPLICATE, "duplicate link")
                return False
            self._spawn(old.link.close(CLOSE_DUPLICATE, "replaced by a newer link"))
        current = self._current[did] = _Current(link)
        try:
            return await self._run_link(link)
        finally:
            if self._current.get(did) is current:
                del self._current[did]
            current.gone.set()

    def adopt_soon(self, link: Link) -> None:
        """:meth:`adopt` in a task of its own (a direct link found while a relayed one runs)."""
        self._spawn(self.adopt(link))

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- stopping ------------------------------------------------------------------------------

    def stop_accepting(self) -> None:
        """No new links from now on: diallers cancelled, the listener closed (links stay)."""
        self.stopping = True
        for task in self._dialers.values():
            task.cancel()
        if self.server is not None:
            self.server.close(close_connections=False)

    async def stop(self) -> None:
        """After :meth:`stop_accepting` and closing the links: wait for every task to end."""
        self.stop_accepting()
        if self.server is not None:
            await self.server.wait_closed()
        tasks = [*self._dialers.values(), *self._tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
