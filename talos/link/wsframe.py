"""The data phase of a WebSocket, sans I/O (RFC 6455 section 5, closing: section 7).

A link's WebSocket carries one sealed link frame per binary message. This
object turns received bytes into events and the messages to send into bytes;
:mod:`talos.link.wsconn` only moves those bytes. The opening handshake (the
HTTP upgrade, RFC 6455 section 4) is not here: :mod:`talos.link.wsconn` runs it
with the websockets library's sans-I/O handshake objects.

Why our own framing: websockets' frame parser and asyncio layer cost ~110 us
per round trip of a 400-byte message on this class of machine (245 us against
a bare asyncio protocol's 134 us, docs/adr/0016-own-websocket-data-phase.md);
a link crosses them twice per tunnel call and once per acked message.

Events from :meth:`WsFrames.receive_data`: ``bytes`` (a binary message),
``str`` (a text message; the link refuses it), :class:`Pong` and
:class:`Closed` (the peer's close frame). Pings are answered here: their pong
is in :meth:`WsFrames.data_to_send`, as is the reply to a peer's close. A
frame RFC 6455 forbids raises :class:`WebSocketError` with the close code to
fail the connection with (section 7.1.7); the frame bytes for that close are
queued first.
"""

from __future__ import annotations

import enum
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from talos_sdk.errors import ProtocolError, UsageError

_c_apply_mask: Callable[[bytes, bytes], bytes] | None
try:  # websockets' C helper: ~11 GB/s against ~180 MB/s for the big-integer XOR below
    from websockets.speedups import apply_mask as _c_apply_mask
except ImportError:  # pragma: no cover - websockets built without its C extension
    _c_apply_mask = None

__all__ = [
    "CLOSE_MESSAGE_TOO_BIG",
    "CLOSE_NO_STATUS",
    "CLOSE_PROTOCOL_ERROR",
    "Closed",
    "Pong",
    "WebSocketError",
    "WsFrames",
    "apply_mask",
]

CLOSE_NORMAL: Final = 1000
CLOSE_PROTOCOL_ERROR: Final = 1002
CLOSE_NO_STATUS: Final = 1005  # a close frame without a code (never sent on the wire)
CLOSE_INVALID_DATA: Final = 1007
CLOSE_MESSAGE_TOO_BIG: Final = 1009

_OP_CONT, _OP_TEXT, _OP_BINARY = 0x0, 0x1, 0x2
_OP_CLOSE, _OP_PING, _OP_PONG = 0x8, 0x9, 0xA
_OPCODES = frozenset((_OP_CONT, _OP_TEXT, _OP_BINARY, _OP_CLOSE, _OP_PING, _OP_PONG))
_FIN = 0x80
_MASK_BIT = 0x80
_U16 = struct.Struct("!H")
_U64 = struct.Struct("!Q")
_MAX_CONTROL = 125
# Close codes a peer may send (section 7.4.1; 1004-1006 and 1015 are reserved).
_SENDABLE = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014})
_MASK_POOL = 4096  # masks come from a pool: one getrandom per 1,024 frames, not one each


class WebSocketError(ProtocolError):
    """The peer sent a frame RFC 6455 forbids; ``code`` is the close code to fail with."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Pong:
    """A pong frame and its application data (section 5.5.3)."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Closed:
    """The peer's close frame: its code (1005 when it gave none) and reason."""

    code: int
    reason: str


Event = bytes | str | Pong | Closed


class _State(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"  # we sent a close frame and wait for the peer's
    CLOSED = "closed"  # both close frames went


def apply_mask(data: bytes, mask: bytes) -> bytes:
    """``data`` XOR the 4-byte ``mask`` repeated (section 5.3); its own inverse."""
    if _c_apply_mask is not None:
        return _c_apply_mask(data, mask)
    n = len(data)
    key = (mask * (n // 4 + 1))[:n]
    return (int.from_bytes(data, "little") ^ int.from_bytes(key, "little")).to_bytes(n, "little")


class WsFrames:
    """One end of a WebSocket after its opening handshake (see the module docstring).

    ``client``: this end masks what it sends and refuses masked frames; a
    server end the reverse (section 5.1). ``max_size`` bounds a message's
    payload, fragments included (1009 past it, before the payload is buffered).
    """

    def __init__(self, *, client: bool, max_size: int) -> None:
        self.client = client
        self.max_size = max_size
        self._state = _State.OPEN
        self._expect_mask = 0 if client else _MASK_BIT
        # Received bytes not yet parsed: chunks, their total, and how many the frame
        # at their head needs (0 = unknown yet), so a large frame is joined once.
        self._chunks: list[bytes] = []
        self._size = 0
        self._need = 0
        # A fragmented message being reassembled: its opcode and bytes so far (one
        # buffer, not a list of parts: empty fragments must not add up in memory).
        self._frag_op: int | None = None
        self._frag = bytearray()
        self._out: list[bytes] = []  # close frames owed
        # The pong owed for the latest ping only (RFC 6455 section 5.5.3 allows it): a
        # peer that pings without reading our pongs cannot make them pile up.
        self._pong = b""
        self._masks = b""
        self._mask_at = 0
        #: The code and reason of the peer's close frame, once received.
        self.close_rcvd: Closed | None = None
        #: The code and reason of the close frame we sent, once sent.
        self.close_sent: Closed | None = None
        #: With both: True if the peer's close frame came before ours.
        self.rcvd_then_sent: bool | None = None

    # --- state ---------------------------------------------------------------------------------

    @property
    def open(self) -> bool:
        """True until a close frame was sent or received."""
        return self._state is _State.OPEN

    @property
    def closed(self) -> bool:
        """True once both close frames went: the TCP connection may close."""
        return self._state is _State.CLOSED

    # --- sending -------------------------------------------------------------------------------

    def send_binary(self, payload: bytes) -> bytes:
        """The frame bytes of one binary message (the caller writes them now)."""
        if self._state is not _State.OPEN:
            raise UsageError("the WebSocket is closing: no more messages")
        return self._frame(_OP_BINARY, payload)

    def send_ping(self, payload: bytes) -> bytes:
        if self._state is not _State.OPEN:
            raise UsageError("the WebSocket is closing: no more pings")
        return self._frame(_OP_PING, payload[:_MAX_CONTROL])

    def send_close(self, code: int = CLOSE_NORMAL, reason: str = "") -> bytes:
        """Our close frame (section 5.5.1); b"" if one was sent already."""
        if self.close_sent is not None:
            return b""
        body = reason.encode()[: _MAX_CONTROL - 2]
        # A reason cut inside a UTF-8 sequence would be invalid text (the peer's 1007).
        body = body.decode(errors="ignore").encode()
        self.close_sent = Closed(code, body.decode())
        self._pong = b""  # nothing after our close frame, a held pong included
        self._state = _State.CLOSED if self.close_rcvd is not None else _State.CLOSING
        payload = b"" if code == CLOSE_NO_STATUS else _U16.pack(code) + body
        return self._frame(_OP_CLOSE, payload)

    def data_to_send(self) -> bytes:
        """Frames this end owes the peer (a pong, the reply to a close); b"" if none."""
        out, self._out = self._out, []
        pong, self._pong = self._pong, b""
        return pong + b"".join(out)

    def _frame(self, opcode: int, payload: bytes) -> bytes:
        n = len(payload)
        mask_bit = _MASK_BIT if self.client else 0
        if n < 126:
            head = bytes((_FIN | opcode, mask_bit | n))
        elif n < 65536:
            head = bytes((_FIN | opcode, mask_bit | 126)) + _U16.pack(n)
        else:
            head = bytes((_FIN | opcode, mask_bit | 127)) + _U64.pack(n)
        if not self.client:
            return head + payload
        mask = self._mask()
        return head + mask + apply_mask(payload, mask)

    def _mask(self) -> bytes:
        # Masks must be unpredictable to intermediaries (section 10.3): urandom, pooled.
        at = self._mask_at
        if at + 4 > len(self._masks):
            self._masks, at = os.urandom(_MASK_POOL), 0
        self._mask_at = at + 4
        return self._masks[at : at + 4]

    # --- receiving -----------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Event]:
        """Parse ``data`` (any cut of the stream); the events of every whole frame in it."""
        if self._state is _State.CLOSED or not data:
            return []
        if self._chunks:
            self._chunks.append(data)
            self._size += len(data)
            if self._size < self._need:
                return []
            buf = b"".join(self._chunks)
            self._chunks = []
        else:
            buf = data
        events: list[Event] = []
        try:
            end = self._parse(buf, events)
        except WebSocketError as exc:
            self._fail(exc)
            raise
        if end < len(buf):
            rest = buf[end:]
            self._chunks = [rest]
            self._size = len(rest)
        else:
            self._size = 0
        return events

    def _parse(self, buf: bytes, events: list[Event]) -> int:
        """Parse whole frames of ``buf`` into ``events``; where the unparsed rest starts."""
        pos, n = 0, len(buf)
        self._need = 0
        while n - pos >= 2 and self._state is not _State.CLOSED:
            b0, b1 = buf[pos], buf[pos + 1]
            if b0 & 0x70:
                raise WebSocketError(CLOSE_PROTOCOL_ERROR, "reserved bits set (no extension)")
            if b1 & _MASK_BIT != self._expect_mask:
                raise WebSocketError(
                    CLOSE_PROTOCOL_ERROR, "masked frame" if self.client else "unmasked frame"
                )
            opcode, length, head = b0 & 0x0F, b1 & 0x7F, 2
            if length == 126:
                if n - pos < 4:
                    break
                length, head = _U16.unpack_from(buf, pos + 2)[0], 4
            elif length == 127:
                if n - pos < 10:
                    break
                length, head = _U64.unpack_from(buf, pos + 2)[0], 10
                if length >> 63:
                    raise WebSocketError(CLOSE_PROTOCOL_ERROR, "frame length above 2^63")
            if opcode not in _OPCODES:
                raise WebSocketError(CLOSE_PROTOCOL_ERROR, f"unknown opcode {opcode:#x}")
            if opcode >= _OP_CLOSE:
                if not b0 & _FIN or length > _MAX_CONTROL:
                    raise WebSocketError(CLOSE_PROTOCOL_ERROR, "fragmented or long control frame")
            elif length + len(self._frag) > self.max_size:
                # Refused on its header: a peer cannot make us buffer past the bound.
                raise WebSocketError(CLOSE_MESSAGE_TOO_BIG, f"message above {self.max_size} bytes")
            if self._expect_mask:
                head += 4
            end = pos + head + length
            if end > n:
                self._need = end - pos
                break
            payload = buf[pos + head : end]
            if self._expect_mask:
                payload = apply_mask(payload, buf[pos + head - 4 : pos + head])
            self._on_frame(b0 & _FIN, opcode, payload, events)
            pos = end
        return pos

    def _on_frame(self, fin: int, opcode: int, payload: bytes, events: list[Event]) -> None:
        if opcode in (_OP_BINARY, _OP_TEXT):
            if self._frag_op is not None:
                raise WebSocketError(CLOSE_PROTOCOL_ERROR, "new message inside a fragmented one")
            if fin:
                self._message(opcode, payload, events)
            else:
                self._frag_op, self._frag = opcode, bytearray(payload)
        elif opcode == _OP_CONT:
            if self._frag_op is None:
                raise WebSocketError(CLOSE_PROTOCOL_ERROR, "continuation without a message")
            self._frag += payload
            if fin:
                op, whole = self._frag_op, bytes(self._frag)
                self._frag_op, self._frag = None, bytearray()
                self._message(op, whole, events)
        elif opcode == _OP_PING:
            if self._state is _State.OPEN:
                self._pong = self._frame(_OP_PONG, payload)
        elif opcode == _OP_PONG:
            events.append(Pong(payload))
        elif opcode == _OP_CLOSE:
            closed = _parse_close(payload)
            self.close_rcvd = closed
            self.rcvd_then_sent = self.close_sent is None
            if self.close_sent is None:
                # Echo the peer's code (section 5.5.1), then the connection is done.
                self._out.append(self.send_close(closed.code))
            self._state = _State.CLOSED
            events.append(closed)

    def _message(self, opcode: int, payload: bytes, events: list[Event]) -> None:
        # Delivered in CLOSING too (we sent our close frame, the peer's is still due):
        # RFC 6455 section 7.1.2 stops our sending, not the peer's messages before its close.
        if opcode == _OP_BINARY:
            events.append(payload)
            return
        try:
            events.append(payload.decode())
        except UnicodeDecodeError:
            raise WebSocketError(CLOSE_INVALID_DATA, "text message is not UTF-8") from None

    def _fail(self, exc: WebSocketError) -> None:
        """Queue our close frame for a forbidden frame; nothing after it is read."""
        if self.close_sent is None:
            self._out.append(self.send_close(exc.code, exc.reason))
        self._state = _State.CLOSED
        self._chunks, self._size, self._need = [], 0, 0
        self._pong = b""


def _parse_close(payload: bytes) -> Closed:
    """A close frame's code and reason (section 5.5.1, codes: section 7.4)."""
    if not payload:
        return Closed(CLOSE_NO_STATUS, "")
    if len(payload) == 1:
        raise WebSocketError(CLOSE_PROTOCOL_ERROR, "close frame of one byte")
    code = _U16.unpack_from(payload)[0]
    if code not in _SENDABLE and not 3000 <= code <= 4999:
        raise WebSocketError(CLOSE_PROTOCOL_ERROR, f"close code {code} may not be sent")
    try:
        reason = payload[2:].decode()
    except UnicodeDecodeError:
        raise WebSocketError(CLOSE_INVALID_DATA, "close reason is not UTF-8") from None
    return Closed(code, reason)
