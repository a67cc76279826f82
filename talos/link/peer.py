"""One authenticated WebSocket link to a peer (docs/DESIGN.md "Peer links").

The asyncio side of :mod:`talos.link.handshake`: it only moves bytes and
enforces time limits. WebSocket settings: compression off (frames are
ciphertext, and compressing before encrypting leaks), ``max_size`` bounded
to the largest link frame, keepalive pings. A refusal is sent as a
:class:`~talos.link.wire.Refuse` frame and then the close code it names.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.connection import Connection
from websockets.exceptions import (
    ConnectionClosed,
    ConnectionClosedError,
    InvalidHandshake,
    InvalidURI,
)
from websockets.protocol import State

from talos.link import wire
from talos.link.auth import AuthPolicy
from talos.link.handshake import (
    CLOSE_PROTOCOL,
    SUITES,
    Authenticated,
    LinkHandshake,
    Refusal,
    Role,
    Signer,
)
from talos_sdk.errors import HandshakeError, MalformedFrameError, OversizeError

__all__ = [
    "MAX_QUEUE",
    "FrameStream",
    "Link",
    "LinkSettings",
    "PeerRefused",
    "accept_link",
    "dial_link",
    "initiate_link",
]

#: Below the asyncio default low-water mark: a send this far under it never blocks.
_SEND_NOW_LIMIT = 16 * 1024
#: Frames websockets buffers per connection before it stops reading the socket:
#: 16 x max_frame (16 MiB at the default), not 256 MiB, per link (docs/PROTOCOL.md "Link protocol").
MAX_QUEUE = 16


class PeerRefused(HandshakeError):
    """The remote side refused us with a Refuse frame / close code."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"peer refused the link ({code}): {reason}")
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class LinkSettings:
    """Bounds and timers for links."""

    max_frame: int = wire.DEFAULT_MAX_FRAME
    ping_interval: float = 20.0
    handshake_timeout: float = 10.0
    suites: tuple[str, ...] = SUITES
    auth: AuthPolicy | None = None  # pins + --require-pq (talos/link/auth.py)
    #: Inbound links still authenticating; more are refused with 1013 (try again later).
    max_handshakes: int = 64

    @property
    def ws_max_size(self) -> int:
        return self.max_frame + 64


class FrameStream(Protocol):
    """A byte pipe other than a WebSocket that a link can run on (talos/relay/stream.py).

    The subset of a websockets connection the link layer uses: one link frame
    per ``send`` / ``recv``, ``close(code, reason)``, and ``ConnectionClosed``
    once closed. ``via`` names it in status ("relay").
    """

    @property
    def via(self) -> str: ...

    @property
    def close_code(self) -> int | None: ...

    async def send(self, data: bytes) -> None: ...

    async def recv(self) -> bytes: ...

    async def close(self, code: int = 1000, reason: str = "") -> None: ...

    def send_nowait(self, data: bytes) -> bool: ...

    @property
    def writable(self) -> bool: ...

    @property
    def can_send_now(self) -> bool: ...


class Link:
    """An authenticated link: raw link-frame bytes in and out."""

    def __init__(self, ws: Connection | FrameStream, auth: Authenticated, role: Role) -> None:
        self.ws = ws
        #: "direct" (a WebSocket) or what carries it otherwise ("relay").
        self.via: str = ws.via if not isinstance(ws, Connection) else "direct"
        self.peer_did = auth.peer_did
        self.suites = auth.suites
        self.auth_suite = auth.auth_suite
        self.peer_mldsa65 = auth.peer_mldsa65
        self.role = role

    async def send(self, data: bytes) -> None:
        """Send one encoded link frame (order of calls is order on the wire)."""
        await self.ws.send(data)

    def send_nowait(self, data: bytes) -> bool:
        """Write one link frame now if that needs no waiting; False (nothing sent) otherwise.

        The synchronous twin of :meth:`send` for callbacks: it writes only when
        :meth:`send` would not have suspended (link open, no fragmented send in
        progress, socket not paused by flow control), so order on the wire is
        the order of calls across both methods. Raises ``ConnectionClosed`` if
        the write itself fails (the link is then aborted).
        """
        ws = self.ws
        if not isinstance(ws, Connection):
            return ws.send_nowait(data)
        if not self.writable:
            return False
        ws.protocol.send_binary(data)
        try:
            ws.send_data()
        except Exception as exc:
            ws.set_connection_exc(exc)
            ws.transport.abort()
            raise ConnectionClosedError(None, None) from exc
        return True

    @property
    def writable(self) -> bool:
        """True when :meth:`send_nowait` would write (check before sealing a frame)."""
        ws = self.ws
        if not isinstance(ws, Connection):
            return ws.writable
        return (
            ws.protocol.state is State.OPEN
            and ws.send_in_progress is None
            and not ws.paused
            and not ws.transport.is_closing()
        )

    @property
    def can_send_now(self) -> bool:
        """True when :meth:`send` would write without waiting for flow control."""
        if not isinstance(self.ws, Connection):
            return self.ws.can_send_now
        transport = self.ws.transport
        return transport.get_write_buffer_size() < _SEND_NOW_LIMIT

    async def recv(self) -> bytes:
        """Next frame; raises ConnectionClosed when the link ends."""
        data = await self.ws.recv()
        if isinstance(data, str):
            raise MalformedFrameError("text frame on a link")
        return data

    async def close(self, code: int = 1000, reason: str = "") -> None:
        await self.ws.close(code, reason[:120])

    @property
    def open(self) -> bool:
        return self.ws.close_code is None


async def _recv_frame(ws: Connection | FrameStream, max_frame: int) -> wire.LinkFrame:
    data = await ws.recv()
    if isinstance(data, str):
        raise Refusal(CLOSE_PROTOCOL, "text frame during handshake")
    try:
        frame = wire.decode(data, max_frame)
    except (MalformedFrameError, OversizeError) as exc:
        raise Refusal(CLOSE_PROTOCOL, f"bad handshake frame: {exc}") from None
    if isinstance(frame, wire.Refuse):
        raise PeerRefused(frame.code, frame.reason)
    return frame


async def _refuse(ws: Connection | FrameStream, refusal: Refusal) -> None:
    try:
        await ws.send(wire.encode(wire.Refuse(refusal.code, refusal.reason)))
        await ws.close(refusal.code, refusal.reason[:120])
    except ConnectionClosed:
        pass


async def _run_handshake(
    ws: Connection | FrameStream, hs: LinkHandshake, role: Role, settings: LinkSettings
) -> Authenticated:
    async def steps() -> Authenticated:
        if role is Role.INITIATOR:
            await ws.send(wire.encode(hs.hello()))
        hello = await _recv_frame(ws, settings.max_frame)
        if not isinstance(hello, wire.Hello):
            raise Refusal(CLOSE_PROTOCOL, "expected hello")
        proof = hs.receive_hello(hello)
        # The responder proves last: its proof doubles as "accepted", so a
        # dialer never believes in a link the responder refused.
        await ws.send(wire.encode(hs.hello() if role is Role.RESPONDER else proof))
        peer_proof = await _recv_frame(ws, settings.max_frame)
        if not isinstance(peer_proof, wire.Proof):
            raise Refusal(CLOSE_PROTOCOL, "expected proof")
        auth = hs.receive_proof(peer_proof)
        if role is Role.RESPONDER:
            await ws.send(wire.encode(proof))
        return auth

    try:
        async with asyncio.timeout(settings.handshake_timeout):
            return await steps()
    except Refusal as refusal:
        await _refuse(ws, refusal)
        raise
    except TimeoutError:
        await ws.close(CLOSE_PROTOCOL, "handshake timeout")
        raise HandshakeError("link handshake timed out") from None
    except ConnectionClosed as exc:
        rcvd = exc.rcvd
        if rcvd is not None and rcvd.code >= 4000:
            raise PeerRefused(rcvd.code, rcvd.reason) from None
        raise HandshakeError("peer closed the link during the handshake") from None


async def accept_link(
    ws: Connection | FrameStream,
    signer: Signer,
    authorizer: Callable[[str], bool],
    settings: LinkSettings,
) -> Link:
    """Server side: run the handshake on an accepted WebSocket."""
    hs = LinkHandshake(
        signer,
        Role.RESPONDER,
        os.urandom(32),
        suites=settings.suites,
        authorizer=authorizer,
        policy=settings.auth,
    )
    auth = await _run_handshake(ws, hs, Role.RESPONDER, settings)
    return Link(ws, auth, Role.RESPONDER)


async def dial_link(
    url: str,
    expected_did: str,
    signer: Signer,
    authorizer: Callable[[str], bool],
    settings: LinkSettings,
) -> Link:
    """Client side: open ``url`` and prove both identities; the peer must be ``expected_did``."""
    try:
        async with asyncio.timeout(settings.handshake_timeout):
            ws: ClientConnection = await connect(
                url,
                compression=None,
                max_size=settings.ws_max_size,
                ping_interval=settings.ping_interval,
                ping_timeout=settings.ping_interval,
                open_timeout=settings.handshake_timeout,
                close_timeout=2,
                max_queue=MAX_QUEUE,
            )
    except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as exc:
        raise ConnectionError(f"cannot reach {url}: {exc or type(exc).__name__}") from None
    return await initiate_link(ws, expected_did, signer, authorizer, settings)


async def initiate_link(
    ws: Connection | FrameStream,
    expected_did: str,
    signer: Signer,
    authorizer: Callable[[str], bool],
    settings: LinkSettings,
) -> Link:
    """Dialler side on an open pipe (a WebSocket, or a relay stream): run the handshake."""
    hs = LinkHandshake(
        signer,
        Role.INITIATOR,
        os.urandom(32),
        suites=settings.suites,
        expected_did=expected_did,
        authorizer=authorizer,
        policy=settings.auth,
    )
    try:
        auth = await _run_handshake(ws, hs, Role.INITIATOR, settings)
    except BaseException:
        await ws.close()
        raise
    return Link(ws, auth, Role.INITIATOR)
