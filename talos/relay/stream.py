"""A link's byte pipe over the relay: one :class:`RelayStream` per relayed link.

The asyncio side of :class:`talos.relay.wire.StreamState`. It offers what the
link layer uses of a WebSocket connection (``send``, ``recv``, ``close``,
``close_code``; a closed stream raises websockets' ``ConnectionClosed`` with
the close code, as a WebSocket does), so the link handshake and the link read
loop run over it unchanged (docs/adr/0010-nats-relay.md). The relay sees only
the frames the link layer hands down.

Keepalive: with no traffic for ``ping_interval`` a stream sends a keepalive
packet; with nothing received for ``3 x ping_interval`` it closes (4022), so a
link to a peer that vanished from the relay goes down like a WebSocket whose
pings go unanswered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Final

from websockets.exceptions import ConnectionClosedError, ConnectionClosedOK
from websockets.frames import Close as WsClose

from talos.relay import wire
from talos.relay.names import RelayNames

__all__ = [
    "CLOSE_RELAY_BROKEN",
    "CLOSE_RELAY_LOST",
    "CLOSE_RELAY_SILENT",
    "RelayStream",
]

#: The stream lost, reordered or repeated a packet, or overflowed its buffer.
CLOSE_RELAY_BROKEN: Final = 4020
#: This node's connection to the relay dropped (packets in flight are lost).
CLOSE_RELAY_LOST: Final = 4021
#: Nothing arrived on the stream for three keepalive intervals.
CLOSE_RELAY_SILENT: Final = 4022

Publish = Callable[[str, bytes], Awaitable[None]]
#: CLOSE packets on their way out after an abort (kept so the tasks are not collected).
_telling: set[asyncio.Task[None]] = set()


class RelayStream:
    """One end of a relay stream, shaped like the WebSocket connection a link runs on."""

    @property
    def via(self) -> str:
        return "relay"

    @property
    def source(self) -> str:
        """Who opened it as far as the relay vouches: its account, or just "relay"."""
        return self._source

    @property
    def remote_host(self) -> None:
        """No address to dial: the peer is reachable through the relay only."""
        return None

    def __init__(
        self,
        publish: Publish,
        peer: RelayNames,
        state: wire.StreamState,
        *,
        max_buffer: int,
        ping_interval: float,
        pending: Callable[[], int] = lambda: 0,
        on_closed: Callable[[RelayStream], None] | None = None,
        source: str = "relay",
    ) -> None:
        self._publish = publish
        self.peer_subject = peer.link
        #: The NATS account the peer's packets must come from (talos/relay/serverconf.py).
        self.peer_account = peer.account
        self._source = source
        self.state = state
        self.stream_id = state.stream_id
        self._max_buffer = max_buffer
        self._ping_interval = ping_interval
        self._pending = pending
        self._on_closed = on_closed
        self._frames: deque[bytes] = deque()
        self._buffered = 0
        self._wakeup: asyncio.Event = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self.close_code: int | None = None
        self.close_reason = ""
        self.dropped = 0  # data packets that came after the close
        self._close_sent: bool | None = None  # True: we closed; False: the peer did
        self._last_in = time.monotonic()
        self._last_out = time.monotonic()
        self._keeper = asyncio.ensure_future(self._keepalive())

    # --- what the link layer calls ---------------------------------------------------------------

    async def send(self, data: bytes) -> None:
        """Send one link frame (cut into packets); raises ConnectionClosed once closed."""
        self._raise_if_closed()
        packets = self.state.packets(bytes(data))
        async with self._send_lock:  # a frame's chunks must not interleave with another's
            self._raise_if_closed()
            for packet in packets:
                await self._publish(self.peer_subject, packet)
            self._last_out = time.monotonic()

    def send_nowait(self, data: bytes) -> bool:
        """Never writes synchronously: relayed frames leave from a task (False)."""
        return False

    @property
    def writable(self) -> bool:
        return False

    @property
    def can_send_now(self) -> bool:
        """True while the relay client's outgoing buffer is small."""
        return self.close_code is None and self._pending() < 64 * 1024

    @property
    def queued(self) -> int:
        """Whole link frames received and not yet taken by :meth:`recv`."""
        return len(self._frames)

    async def recv(self) -> bytes:
        """The next whole link frame; raises ConnectionClosed once closed and drained."""
        while not self._frames:
            self._raise_if_closed()
            self._wakeup.clear()
            await self._wakeup.wait()
        frame = self._frames.popleft()
        self._buffered -= len(frame)
        return frame

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Close the stream and tell the peer (best effort: the relay may be gone)."""
        if self.close_code is not None:
            return
        self._closed(code, reason, sent=True)
        await self._tell_closed(code, reason)

    async def _tell_closed(self, code: int, reason: str) -> None:
        packet = wire.encode(wire.Close(self.stream_id, code, reason))
        with contextlib.suppress(Exception):  # a relay that is down cannot carry the close
            await self._publish(self.peer_subject, packet)

    async def wait_closed(self) -> None:
        while self.close_code is None:
            self._wakeup.clear()
            await self._wakeup.wait()

    @property
    def open(self) -> bool:
        return self.close_code is None

    # --- what the relay client calls -------------------------------------------------------------

    def feed(self, packet: wire.Data | wire.Close) -> None:
        """A packet for this stream arrived from the relay."""
        if self.close_code is not None:
            if isinstance(packet, wire.Data):
                self.dropped += 1
            return
        self._last_in = time.monotonic()
        if isinstance(packet, wire.Close):
            self._closed(packet.code, packet.reason, sent=False)
            return
        try:
            frame = self.state.receive(packet)
        except wire.StreamBroken as exc:
            self.abort(CLOSE_RELAY_BROKEN, str(exc))
            return
        if frame is None:
            return
        self._buffered += len(frame)
        if self._buffered > self._max_buffer:
            # NATS has no backpressure: a reader this far behind is treated as a lost stream.
            self.abort(CLOSE_RELAY_BROKEN, "relay stream receive buffer full")
            return
        self._frames.append(frame)
        self._wakeup.set()

    def abort(self, code: int, reason: str) -> None:
        """Close now (from a callback); the peer is told from a task."""
        if self.close_code is not None:
            return
        self._closed(code, reason, sent=True)
        task = asyncio.ensure_future(self._tell_closed(code, reason))
        _telling.add(task)
        task.add_done_callback(_telling.discard)

    # --- internals -------------------------------------------------------------------------------

    def _closed(self, code: int, reason: str, *, sent: bool) -> None:
        self.close_code = code
        self.close_reason = reason
        self._close_sent = sent
        self._keeper.cancel()
        self._wakeup.set()
        if self._on_closed is not None:
            self._on_closed(self)

    def _raise_if_closed(self) -> None:
        if self.close_code is None:
            return
        close = WsClose(self.close_code, self.close_reason)
        rcvd, sent = (None, close) if self._close_sent else (close, None)
        if self.close_code == 1000:
            raise ConnectionClosedOK(rcvd, sent)
        raise ConnectionClosedError(rcvd, sent)

    async def _keepalive(self) -> None:
        interval = self._ping_interval
        while True:
            await asyncio.sleep(interval / 2)
            now = time.monotonic()
            if now - self._last_in > 3 * interval:
                await self.close(CLOSE_RELAY_SILENT, "relay stream silent")
                return
            if now - self._last_out >= interval and not self._send_lock.locked():
                try:
                    async with self._send_lock:
                        await self._publish(self.peer_subject, self.state.keepalive())
                except Exception:
                    self.abort(CLOSE_RELAY_LOST, "relay unreachable")
                    return
                self._last_out = now
