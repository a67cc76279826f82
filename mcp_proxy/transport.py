"""The one interface between the tunnel and what carries its frames (ARCHITECTURE.md, Node).

:class:`TunnelTransport` is all ``serve`` and ``connect`` know about the link:
send an app payload to a peer, receive payloads, hear about links going up and
down. :class:`NodeTransport` implements it over a talos ``Node`` app channel;
:class:`LoopbackTransport` is an in-process connected pair for tests of the
proxy logic (a transport, like h11's connected pair, not a stand-in for the
code under test).

:class:`FrameSender` is the hot path's coalescer: messages are queued without
waiting and leave together as one frame, either when the producer says its
batch is done (:meth:`FrameSender.flush_now`: the stdin / tool-output callback
that produced them, so no loop pass is spent) or at the latest in the next
loop pass. Frames are written from that call when the link can take them at
once (:meth:`TunnelTransport.send_nowait`); only while the link is busy does a
task send them, and whatever accumulates meanwhile leaves as one frame. A
message larger than the peer's bound (:meth:`TunnelTransport.max_payload_for`,
the app host's ``max_app_payload``: the smaller of both nodes' frame bounds) is
split into PART frames (``tunnel_wire``) so it is never refused by either end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from mcp_proxy.tunnel_wire import FrameKind, encode_frame
from talos.apphost import AppHost
from talos.logging import event
from talos_sdk.errors import OversizeError, TalosError

__all__ = [
    "APP_NAME",
    "FrameSender",
    "LinkDownError",
    "LinkListener",
    "LoopbackTransport",
    "NodeTransport",
    "PressureListener",
    "Receiver",
    "RefusalListener",
    "TunnelTransport",
]

log = logging.getLogger(__name__)

APP_NAME = "mcp"
# A frame's cap even when both nodes' frame bounds (1 MiB by default) would take more:
# a big frame holds the link (and the other sessions' frames) while it is sealed and sent.
MAX_BATCH_BYTES = 256 * 1024
# The tunnel frame header and length prefixes, on top of the messages it carries.
_FRAME_SLACK = 64
#: Message bytes a FrameSender may hold for a link that does not take them (a peer that
#: stopped reading) before its producers are told to pause, and the level they resume at.
PRESSURE_HIGH = 1 << 20
PRESSURE_LOW = 256 * 1024
#: Replies the proxy makes itself (a denial, an unknown session, a malformed request) cost
#: the peer one request each; a peer that sends such requests without reading would grow
#: the queue for as long as it went on. Past this many bytes of them queued since the
#: queue was last below PRESSURE_LOW (a link that takes what it is given), more are
#: dropped. Honest callers never get near it: a large tool reply keeps the queue up for
#: seconds, during which they make a few such requests at most.
OWN_REPLIES_MAX = 4 * PRESSURE_HIGH
#: ``listener(pressed)``: True when the queue passed PRESSURE_HIGH, False once below LOW.
PressureListener = Callable[[bool], None]

# A receiver returns an awaitable to make the link stop reading until it is done (backpressure).
Receiver = Callable[[str, bytes], Awaitable[None] | None]
LinkListener = Callable[[str, bool], None]
#: ``listener(peer, message)``: the link to ``peer`` was refused for good (the words say why).
RefusalListener = Callable[[str, str], None]


class LinkDownError(TalosError):
    """No link to the peer right now."""


class TunnelTransport(Protocol):
    """Carries tunnel frames between this proxy and its peers, ordered per peer."""

    def max_payload_for(self, peer: str) -> int:
        """The largest payload ``send`` to ``peer`` accepts (FrameSender splits larger messages)."""
        ...

    async def send(self, peer: str, payload: bytes) -> None: ...

    def send_nowait(self, peer: str, payload: bytes) -> bool:
        """Send now if that needs no waiting; False means nothing was sent (use ``send``)."""
        ...

    def set_receiver(self, receiver: Receiver) -> None: ...

    def add_link_listener(self, listener: LinkListener) -> None: ...

    def is_up(self, peer: str) -> bool: ...

    def add_refusal_listener(self, listener: RefusalListener) -> None:
        """Hear of a link to a peer refused for good (talos/link/refusals.py, decisive)."""
        ...

    def refusal(self, peer: str) -> str | None:
        """Why the last link attempt to ``peer`` was refused for good, if it was."""
        ...

    def problem(self, peer: str) -> str | None:
        """The latest reason there is no link to ``peer`` (a refusal or a failed dial)."""
        ...

    def redial(self, peer: str) -> None:
        """Try the peer again now (a refusal may be stale: its allow list may have changed)."""
        ...


def _refusal_text(did: str, problem: Any) -> str | None:
    return str(problem.message(did)) if problem is not None and problem.decisive else None


class NodeTransport:
    """A :class:`TunnelTransport` over a node's "mcp" app channel (talos/apphost.py)."""

    def __init__(self, node: AppHost, app: str = APP_NAME) -> None:
        self.node = node
        self.app = app
        self._receiver: Receiver | None = None
        node.register_app(app, self._on_app)

    def max_payload_for(self, peer: str) -> int:
        return min(MAX_BATCH_BYTES, self.node.max_app_payload(peer))

    def _on_app(self, peer: str, payload: bytes) -> Awaitable[None] | None:
        # The node awaits what is returned before it reads the link's next frame.
        if self._receiver is not None:
            return self._receiver(peer, payload)
        return None

    async def send(self, peer: str, payload: bytes) -> None:
        await self.node.send_app(peer, self.app, payload)

    def send_nowait(self, peer: str, payload: bytes) -> bool:
        return self.node.try_send_app(peer, self.app, payload)

    def set_receiver(self, receiver: Receiver) -> None:
        self._receiver = receiver

    def add_link_listener(self, listener: LinkListener) -> None:
        self.node.on_link_change(listener)

    def is_up(self, peer: str) -> bool:
        return self.node.is_connected(peer)

    def add_refusal_listener(self, listener: RefusalListener) -> None:
        def on_problem(did: str, problem: Any) -> None:
            text = _refusal_text(did, problem)
            if text is not None:
                listener(did, text)

        self.node.on_link_problem(on_problem)

    def refusal(self, peer: str) -> str | None:
        return _refusal_text(peer, self.node.link_problem(peer))

    def problem(self, peer: str) -> str | None:
        problem = self.node.link_problem(peer)
        return None if problem is None else str(problem.message(peer))

    def redial(self, peer: str) -> None:
        self.node.redial_now(peer)


class LoopbackTransport:
    """One end of an in-process connected pair; frames keep their order."""

    def __init__(self, did: str) -> None:
        self.did = did
        self.other: LoopbackTransport | None = None
        self.up = True
        self._receiver: Receiver | None = None
        self._listeners: list[LinkListener] = []
        self._refusal_listeners: list[RefusalListener] = []
        self.refused: str | None = None
        self.redials = 0
        self.sent_frames = 0
        #: The bound toward the other end (tests lower it to see PART frames).
        self.max_payload = MAX_BATCH_BYTES
        # Like a node's read loop: while a receiver's awaitable runs, later frames wait.
        self._paused: asyncio.Future[None] | None = None
        self._held: deque[tuple[str, bytes]] = deque()

    @classmethod
    def pair(cls, did_a: str, did_b: str) -> tuple[LoopbackTransport, LoopbackTransport]:
        a, b = cls(did_a), cls(did_b)
        a.other, b.other = b, a
        return a, b

    def max_payload_for(self, peer: str) -> int:
        return self.max_payload

    async def send(self, peer: str, payload: bytes) -> None:
        self.send_nowait(peer, payload)

    def send_nowait(self, peer: str, payload: bytes) -> bool:
        if len(payload) > self.max_payload:
            raise OversizeError(f"payload of {len(payload)} bytes above {self.max_payload}")
        other = self.other
        if not self.up or other is None or other.did != peer:
            raise LinkDownError(f"no link to {peer}")
        self.sent_frames += 1
        asyncio.get_running_loop().call_soon(other._deliver, self.did, payload)
        return True

    @property
    def held_frames(self) -> int:
        """Frames delivered to this end but not yet read, because its receiver asked to wait."""
        return len(self._held)

    def _deliver(self, peer: str, payload: bytes) -> None:
        if self._paused is not None:
            self._held.append((peer, payload))
            return
        if self.up and self._receiver is not None:
            wait = self._receiver(peer, payload)
            if wait is not None:
                self._paused = asyncio.ensure_future(wait)
                self._paused.add_done_callback(self._resume)

    def _resume(self, done: asyncio.Future[None]) -> None:
        if not done.cancelled() and done.exception() is not None:
            event(log, "loopback_wait_failed", logging.WARNING, error=repr(done.exception()))
        self._paused = None
        while self._held and self._paused is None:
            self._deliver(*self._held.popleft())

    def set_receiver(self, receiver: Receiver) -> None:
        self._receiver = receiver

    def add_link_listener(self, listener: LinkListener) -> None:
        self._listeners.append(listener)

    def is_up(self, peer: str) -> bool:
        return self.up and self.other is not None and self.other.did == peer

    def add_refusal_listener(self, listener: RefusalListener) -> None:
        self._refusal_listeners.append(listener)

    def refusal(self, peer: str) -> str | None:
        return self.refused

    def problem(self, peer: str) -> str | None:
        return self.refused

    def redial(self, peer: str) -> None:
        self.redials += 1
        if self.refused is not None:  # the other end still refuses: say so again
            self.refuse(self.refused)

    def refuse(self, message: str) -> None:
        """The other end refuses the link (until :meth:`set_link` brings it up)."""
        self.refused = message
        peer = self.other.did if self.other is not None else ""
        for listener in list(self._refusal_listeners):
            asyncio.get_running_loop().call_soon(listener, peer, message)

    def set_link(self, up: bool) -> None:
        """Drop or restore the link; both ends hear about it."""
        assert self.other is not None
        for end in (self, self.other):
            end.up = up
            if up:
                end.refused = None
        for end in (self, self.other):
            peer = end.other.did if end.other is not None else ""
            for listener in list(end._listeners):
                listener(peer, up)


class FrameSender:
    """Queues frames for one peer and sends them, coalescing consecutive messages of a session.

    The queue is bounded by its producers: past ``PRESSURE_HIGH`` bytes waiting
    for a link that does not take them, each pressure listener is told to stop
    reading what feeds it (a tool's stdout, the agent's stdin), and told again
    once the queue is below ``PRESSURE_LOW``. Without it a peer that stops
    reading grew this queue for as long as the tool wrote.
    """

    def __init__(self, transport: TunnelTransport, peer: str) -> None:
        self.transport = transport
        self.peer = peer
        self._items: deque[tuple[FrameKind, int, bytes | None]] = deque()
        self._queued = 0  # payload bytes in _items
        self._own_backlog = 0  # own replies' bytes admitted since the queue was last low
        self.pressed = False
        self._pressure: list[PressureListener] = []
        self._carry: bytes | None = None  # built, refused by send_nowait: the task sends it
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._soon: asyncio.Handle | None = None
        self.frames_sent = 0
        # Cached on first use: asyncio.get_running_loop() costs a getpid() per call on 3.11.
        self._loop: asyncio.AbstractEventLoop | None = None

    def message(self, session: int, line: bytes) -> None:
        self._push(FrameKind.MESSAGES, session, line)

    def control(self, kind: FrameKind, session: int, payload: bytes | None = None) -> None:
        self._push(kind, session, payload)

    def admit_own_reply(self, size: int) -> bool:
        """May a reply of the proxy's own, of ``size`` bytes, be queued? (OWN_REPLIES_MAX)"""
        if self._queued < PRESSURE_LOW:
            self._own_backlog = 0
        if self._own_backlog + size > OWN_REPLIES_MAX:
            return False
        self._own_backlog += size
        return True

    def on_pressure(self, listener: PressureListener) -> None:
        """Call ``listener(True)`` when the queue must stop growing, ``(False)`` when it may."""
        self._pressure.append(listener)

    def _press(self, pressed: bool) -> None:
        self.pressed = pressed
        for listener in list(self._pressure):
            listener(pressed)

    def _push(self, kind: FrameKind, session: int, payload: bytes | None) -> None:
        self._items.append((kind, session, payload))
        if payload is not None:
            self._queued += len(payload)
            if self._queued > PRESSURE_HIGH and not self.pressed:
                self._press(True)
        self._idle.clear()
        if self._soon is None and not self._busy:
            # A producer that knows its batch ended calls flush_now sooner.
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            self._soon = loop.call_soon(self.flush_now)

    @property
    def _busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def flush_now(self) -> None:
        """Send what is queued from this call, in as few frames as possible (a task if busy)."""
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        if self._busy:
            return  # the running task keeps the order and takes the queue with it
        items = self._items
        while items:
            frame = self._next_frame()
            try:
                if not self.transport.send_nowait(self.peer, frame):
                    self._carry = frame
                    self._task = (self._loop or asyncio.get_running_loop()).create_task(
                        self._run(), name=f"mcp-send-{self.peer[-8:]}"
                    )
                    return
                self.frames_sent += 1
            except Exception as exc:
                self._lost(exc)
        self._idle.set()

    async def flush(self) -> None:
        """Wait until everything queued has been handed to the transport."""
        if self._items and not self._busy:
            self.flush_now()
        await self._idle.wait()

    def _taken(self) -> tuple[FrameKind, int, bytes | None]:
        item = self._items.popleft()
        if item[2] is not None:
            self._queued -= len(item[2])
        return item

    def _emptied(self) -> None:
        self._items.clear()
        self._queued = 0
        if self.pressed:
            self._press(False)

    def discard(self) -> None:
        """Drop what is queued (its sessions died with the link)."""
        self._emptied()
        self._carry = None
        if not self._busy:
            self._idle.set()

    async def close(self) -> None:
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._emptied()
        self._carry = None
        self._idle.set()

    def _budget(self) -> int:
        """Message bytes per frame toward the peer; a longer message leaves in PART pieces.

        Asked per frame: the peer's bound is known only once its link is up, and a
        new link may bring another bound.
        """
        return max(_FRAME_SLACK, self.transport.max_payload_for(self.peer) - _FRAME_SLACK)

    def _next_frame(self) -> bytes:
        frame = self._build_frame()
        if self.pressed and self._queued < PRESSURE_LOW:
            self._press(False)
        return frame

    def _build_frame(self) -> bytes:
        items = self._items
        budget = self._budget()
        kind, session, payload = self._taken()
        if kind is FrameKind.MESSAGES and payload is not None and len(payload) > budget:
            self._split(session, payload, budget)
            kind, session, payload = self._taken()
        if kind is not FrameKind.MESSAGES:
            return encode_frame(kind, session, () if payload is None else (payload,))
        assert payload is not None
        batch = [payload]
        size = 4 + len(payload)  # each message costs its u32 length too
        taken = 0
        while items:
            nkind, nsession, npayload = items[0]
            if nkind is not FrameKind.MESSAGES or nsession != session or npayload is None:
                break
            size += 4 + len(npayload)
            if size > budget:
                break
            items.popleft()
            taken += len(npayload)
            batch.append(npayload)
        self._queued -= taken  # once per frame, not per message (the hot path)
        return encode_frame(FrameKind.MESSAGES, session, batch)

    def _split(self, session: int, payload: bytes, step: int) -> None:
        """Put ``payload`` back at the head as PART pieces and a final MESSAGES piece."""
        pieces = [payload[i : i + step] for i in range(0, len(payload), step)]
        items = self._items
        items.appendleft((FrameKind.MESSAGES, session, pieces.pop()))
        for piece in reversed(pieces):
            items.appendleft((FrameKind.PART, session, piece))
        self._queued += len(payload)

    def _lost(self, exc: Exception) -> None:
        # The link listener fails the pending requests; a lost frame is not retried
        # because the sessions it belonged to are torn down with the link.
        event(log, "tunnel_frame_not_sent", logging.WARNING, peer=self.peer, error=str(exc))

    async def _run(self) -> None:
        """The busy-link path: send with waiting until the queue is empty, then end."""
        while True:
            frame, self._carry = self._carry, None
            if frame is None:
                if not self._items:
                    break
                frame = self._next_frame()
            try:
                await self.transport.send(self.peer, frame)
                self.frames_sent += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._lost(exc)
        self._idle.set()
