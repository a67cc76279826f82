"""One authenticated, sealed WebSocket link to a peer (docs/PROTOCOL.md "Link protocol").

The asyncio side of :mod:`talos.link.handshake` and :mod:`talos.link.channel`:
it only moves bytes and enforces time limits; the order of handshake messages
and every check live in the pure handshake object. A link runs on a
:class:`FrameStream`: a direct link on :class:`~talos.link.wsconn.WsStream`
(our own WebSocket data phase, docs/adr/0016-own-websocket-data-phase.md), a
relayed one on talos/relay/stream.py. WebSocket settings: no extension (so no
compression: frames are ciphertext, and compressing before encrypting leaks),
a message bound of the largest sealed frame, keepalive pings. After the
handshake every frame is sealed here, so callers send and receive plaintext
link frames; a frame that fails to open closes the link (4010).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, Protocol

from websockets.exceptions import (
    ConnectionClosed,
    ConnectionClosedError,
    InvalidHandshake,
    InvalidURI,
)

from talos.link import wire
from talos.link.auth import AuthPolicy
from talos.link.channel import TAGLEN, LinkChannel
from talos.link.handshake import (
    CLOSE_PROTOCOL,
    SUITES,
    Authenticated,
    LinkHandshake,
    PeerRefused,
    Refusal,
    Role,
    Signer,
)
from talos.link.wsconn import WsOptions, WsServer, WsStream, ws_connect, ws_serve
from talos_sdk.errors import DecryptionError, HandshakeError

__all__ = [
    "CLOSE_UNAUTHENTIC",
    "MAX_QUEUE",
    "FrameStream",
    "Link",
    "LinkSettings",
    "PeerRefused",
    "accept_link",
    "dial_link",
    "initiate_link",
    "listen_links",
]

#: Messages a link's WebSocket buffers unread before it stops reading the socket:
#: 16 x max_frame (16 MiB at the default) per link.
MAX_QUEUE = 16
#: Close code when a sealed frame fails to open (tampered, replayed, reordered, injected).
CLOSE_UNAUTHENTIC: Final = 4010


@dataclass(frozen=True, slots=True)
class LinkSettings:
    """Bounds and timers for links."""

    max_frame: int = wire.DEFAULT_MAX_FRAME
    ping_interval: float = 20.0
    handshake_timeout: float = 10.0
    #: A connection that has not sent handshake message 1 by then is dropped.
    first_message_timeout: float = 3.0
    suites: tuple[str, ...] = SUITES
    auth: AuthPolicy | None = None  # pins + --require-pq (talos/link/auth.py)
    #: Offer the hybrid (ML-KEM-768) handshake when dialling.
    pq: bool = False
    #: Inbound links still authenticating; more are refused with 1013 (try again later).
    max_handshakes: int = 64
    #: Of those, from one source address.
    max_handshakes_per_address: int = 8

    @property
    def ws_max_size(self) -> int:
        # Handshake messages (under 8 KiB, hybrid) fit: max_frame is at least 16 KiB.
        return self.max_frame + 64 + TAGLEN


class FrameStream(Protocol):
    """The byte pipe a link runs on: a WebSocket (talos/link/wsconn.py) or a relay
    stream (talos/relay/stream.py).

    One link frame per ``send`` / ``recv`` (``recv`` may return text, which the
    link refuses), ``close(code, reason)``, and websockets' ``ConnectionClosed``
    once closed. ``via`` names it in status ("direct", "relay"); ``source`` is
    who sent it as far as the carrier vouches, what handshake admission counts
    by (a WebSocket's remote address); ``remote_host`` is the address a bulk
    port may be dialled at (None over a relay). ``send_nowait`` writes only
    when ``writable``; ``can_send_now``: ``send`` would not wait. ``queued``:
    frames already received that ``recv`` returns without waiting. ``dropped``:
    frames that arrived after our close and were dropped unread.
    """

    @property
    def via(self) -> str: ...

    @property
    def source(self) -> str: ...

    @property
    def remote_host(self) -> str | None: ...

    @property
    def close_code(self) -> int | None: ...

    async def send(self, data: bytes) -> None: ...

    async def recv(self) -> bytes | str: ...

    async def close(self, code: int = 1000, reason: str = "") -> None: ...

    def send_nowait(self, data: bytes) -> bool: ...

    @property
    def writable(self) -> bool: ...

    @property
    def can_send_now(self) -> bool: ...

    @property
    def queued(self) -> int: ...

    @property
    def dropped(self) -> int: ...


class Link:
    """An authenticated link: plaintext link-frame bytes in and out, sealed on the wire."""

    def __init__(
        self, ws: FrameStream, auth: Authenticated, role: Role, channel: LinkChannel
    ) -> None:
        self.ws = ws
        #: "direct" (a WebSocket) or what carries it otherwise ("relay").
        self.via: str = ws.via
        self.peer_did = auth.peer_did
        self.suites = auth.suites
        self.auth_suite = auth.auth_suite
        self.peer_mldsa65 = auth.peer_mldsa65
        self.new_pin = auth.new_pin
        self.kem = auth.kem
        #: The Noise handshake hash: channel binding for session setup and bulk tokens.
        self.transcript_hash = auth.transcript_hash
        self.role = role
        self._channel = channel
        #: Set when a received frame failed to open and the link was closed for it.
        self.unauthentic = False
        # Frames sealed as of the last idle_for() call, and since when that count held.
        self._idle_mark = (-1, 0.0)

    def idle_for(self, now: float) -> float:
        """Seconds (as of ``now``) since a frame was last sealed here, as far as the calls
        to this method saw: a timer asks, so the hot path keeps no clock."""
        sent = self._channel.frames_sent
        if sent != self._idle_mark[0]:
            self._idle_mark = (sent, now)
        return now - self._idle_mark[1]

    async def send(self, data: bytes) -> None:
        """Seal and send one encoded link frame (order of calls is order on the wire)."""
        # Both streams write a message before their first suspension (a relay stream
        # numbers its packets at the call), so sealing right here keeps the counter
        # order equal to the wire order.
        await self.ws.send(self._channel.seal(data))

    def send_nowait(self, data: bytes) -> bool:
        """Write one link frame now if that needs no waiting; False (nothing sent) otherwise.

        The synchronous twin of :meth:`send` for callbacks: it writes only when
        the stream can take it at once, so order on the wire is the order of
        calls across both methods. Raises ``ConnectionClosed`` if the stream
        took a sealed frame and then failed (the link is done: its counters
        are out of step).
        """
        ws = self.ws
        if not ws.writable:
            return False
        if not ws.send_nowait(self._channel.seal(data)):
            raise ConnectionClosedError(None, None)
        return True

    @property
    def writable(self) -> bool:
        """True when :meth:`send_nowait` would write (check before sealing a frame)."""
        return self.ws.writable

    @property
    def can_send_now(self) -> bool:
        """True when :meth:`send` would write without waiting for flow control."""
        return self.ws.can_send_now

    @property
    def queued(self) -> int:
        """Frames received and not yet read: :meth:`recv` returns the next one at once."""
        return self.ws.queued

    async def recv(self) -> bytes:
        """Next plaintext frame; raises ConnectionClosed when the link ends.

        A frame that does not open (or a text frame) closes the link with
        :data:`CLOSE_UNAUTHENTIC`: nothing it carried is returned.
        """
        data = await self.ws.recv()
        try:
            if isinstance(data, str):
                raise DecryptionError()
            return self._channel.open(data)
        except DecryptionError:
            self.unauthentic = True
            await self.ws.close(CLOSE_UNAUTHENTIC, "sealed frame failed to open")
            raise ConnectionClosedError(None, None) from None

    async def close(self, code: int = 1000, reason: str = "") -> None:
        await self.ws.close(code, reason[:120])

    @property
    def open(self) -> bool:
        return self.ws.close_code is None

    @property
    def remote_host(self) -> str | None:
        """The peer's IP address on a direct link; None over a relay."""
        return self.ws.remote_host

    @property
    def frames_sealed(self) -> int:
        """Frames sealed toward the peer on this link (each one WebSocket message)."""
        return self._channel.frames_sent


async def _refuse(ws: FrameStream, refusal: Refusal) -> None:
    try:
        if refusal.farewell is not None:
            await ws.send(refusal.farewell)
        await ws.close(refusal.code, refusal.reason[:120])
    except ConnectionClosed:
        pass


async def _run_handshake(
    ws: FrameStream, hs: LinkHandshake, settings: LinkSettings
) -> tuple[Authenticated, LinkChannel]:
    async def steps() -> tuple[Authenticated, LinkChannel]:
        first = hs.start()
        if first is not None:
            await ws.send(first)
        else:
            # An accepted connection that stays silent holds a slot: not for long.
            async with asyncio.timeout(settings.first_message_timeout):
                data = await ws.recv()
            reply = _step(hs, data)
            if reply is not None:
                await ws.send(reply)
        while not hs.done:
            reply = _step(hs, await ws.recv())
            if reply is not None:
                await ws.send(reply)
        assert hs.result is not None and hs.channel is not None
        return hs.result, hs.channel

    try:
        async with asyncio.timeout(settings.handshake_timeout):
            return await steps()
    except Refusal as refusal:
        await _refuse(ws, refusal)
        raise
    except PeerRefused:
        await ws.close()
        raise
    except TimeoutError:
        await ws.close(CLOSE_PROTOCOL, "handshake timeout")
        raise HandshakeError("link handshake timed out") from None
    except ConnectionClosed as exc:
        rcvd = exc.rcvd
        if rcvd is not None and rcvd.code >= 4000:
            raise PeerRefused(rcvd.code, rcvd.reason) from None
        raise HandshakeError("peer closed the link during the handshake") from None


def _step(hs: LinkHandshake, data: str | bytes) -> bytes | None:
    if isinstance(data, str):
        raise Refusal(CLOSE_PROTOCOL, "text frame during handshake")
    return hs.receive(data)


async def accept_link(
    ws: FrameStream,
    signer: Signer,
    authorizer: Callable[[str], bool],
    settings: LinkSettings,
) -> Link:
    """Server side: run the handshake on an accepted WebSocket."""
    hs = LinkHandshake(
        signer,
        Role.RESPONDER,
        suites=settings.suites,
        authorizer=authorizer,
        policy=settings.auth,
    )
    auth, channel = await _run_handshake(ws, hs, settings)
    return Link(ws, auth, Role.RESPONDER, channel)


async def listen_links(
    handler: Callable[[WsStream], Awaitable[None]],
    host: str,
    port: int,
    settings: LinkSettings,
) -> WsServer:
    """A WebSocket server for links on ``host:port``; ``handler`` runs :func:`accept_link`."""
    return await ws_serve(handler, host, port, _ws_options(settings))


def _ws_options(settings: LinkSettings) -> WsOptions:
    """What both ends of a link's WebSocket are opened with (see the module docstring)."""
    return WsOptions(
        max_size=settings.ws_max_size,
        max_queue=MAX_QUEUE,
        ping_interval=settings.ping_interval,
        ping_timeout=settings.ping_interval,
        open_timeout=settings.handshake_timeout,
        close_timeout=2,
    )


async def dial_link(
    url: str,
    expected_did: str,
    signer: Signer,
    authorizer: Callable[[str], bool],
    settings: LinkSettings,
) -> Link:
    """Client side: open ``url`` and prove both identities; the peer must be ``expected_did``."""
    try:
        # Straight to the peer, never through an HTTP proxy named in the environment:
        # the link's address is where a bulk port is dialled (Link.remote_host), and a
        # relay is the way through closed networks.
        ws = await ws_connect(url, _ws_options(settings))
    except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as exc:
        raise ConnectionError(f"cannot reach {url}: {exc or type(exc).__name__}") from None
    return await initiate_link(ws, expected_did, signer, authorizer, settings)


async def initiate_link(
    ws: FrameStream,
    expected_did: str,
    signer: Signer,
    authorizer: Callable[[str], bool],
    settings: LinkSettings,
) -> Link:
    """Dialler side on an open pipe (a WebSocket, or a relay stream): run the handshake.

    The hybrid handshake is offered when ``settings.pq`` says so, when this
    node requires it, or when ``expected_did`` is pinned hybrid.
    """
    policy = settings.auth
    pinned = policy is not None and policy.pinned(expected_did) is not None
    hs = LinkHandshake(
        signer,
        Role.INITIATOR,
        suites=settings.suites,
        expected_did=expected_did,
        authorizer=authorizer,
        policy=policy,
        pq=settings.pq or pinned,
    )
    try:
        auth, channel = await _run_handshake(ws, hs, settings)
    except BaseException:
        await ws.close()
        raise
    return Link(ws, auth, Role.INITIATOR, channel)
