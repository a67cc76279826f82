"""Link frame layout (docs/PROTOCOL.md "Link protocol"; DESIGN.md "Peer links").

Pure and sans-I/O. One WebSocket binary message carries exactly one link frame:
a type byte followed by that type's fields. Hot-path frames (``MSG``, ``ACK``,
``APP``) use fixed ``struct`` headers and a raw tail so that encoding costs one
``pack`` and one concatenation; control frames use u32 length-prefixed fields.
Nothing here is JSON.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from talos_sdk.binfmt import ByteReader, utf8
from talos_sdk.errors import MalformedFrameError, OversizeError

__all__ = [
    "DEFAULT_MAX_FRAME",
    "DEFER_FAILING",
    "DEFER_FULL",
    "DEFER_REASONS",
    "MIN_MAX_FRAME",
    "Accept",
    "Ack",
    "App",
    "Defer",
    "LinkFrame",
    "Msg",
    "Refuse",
    "SessionAck",
    "SessionInit",
    "SessionOffer",
    "decode",
    "encode",
]

DEFAULT_MAX_FRAME: Final = 1 << 20  # 1 MiB + headers; bounded by websockets max_size too
#: The smallest ``max_frame`` a peer may state: below it, messages could not fit.
MIN_MAX_FRAME: Final = 16 * 1024

T_REFUSE: Final = 0x03
T_ACCEPT: Final = 0x04
T_SESSION_OFFER: Final = 0x10
T_SESSION_INIT: Final = 0x11
T_SESSION_ACK: Final = 0x12
T_MSG: Final = 0x20
T_ACK: Final = 0x21
T_DEFER: Final = 0x22
T_APP: Final = 0x30

_Q = struct.Struct(">Q")
_BQ = struct.Struct(">BQ")
_BQB = struct.Struct(">BQB")
_H = struct.Struct(">H")
_I = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class Accept:
    """The responder's first sealed frame: the initiator's identity was accepted."""


@dataclass(frozen=True, slots=True)
class Refuse:
    """A refusal sent before closing; ``code`` is also the WebSocket close code."""

    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class SessionOffer:
    """Sent by both sides once authenticated: my prekey bundle, my session id, my frame bound.

    ``max_frame`` (optional 3rd field, u32; 0 = not said) is the largest link
    frame this side accepts, so the peer can refuse a message that would never
    fit instead of resending it forever; a stated bound below
    :data:`MIN_MAX_FRAME` is malformed.
    """

    bundle: bytes
    session_id: bytes  # b"" when I hold no session with you
    max_frame: int = 0


@dataclass(frozen=True, slots=True)
class SessionInit:
    """The X3DH initiator's initial message (replaces any older session)."""

    session_id: bytes
    payload: bytes


@dataclass(frozen=True, slots=True)
class SessionAck:
    """The responder's first ratchet message: confirms the session, ends initial data."""

    body: bytes


@dataclass(frozen=True, slots=True)
class Msg:
    """A durable message: per-peer sequence number and the sealed frame."""

    seq: int
    body: bytes


@dataclass(frozen=True, slots=True)
class Ack:
    """Cumulative acknowledgement: every message up to ``seq`` is committed."""

    seq: int


@dataclass(frozen=True, slots=True)
class Defer:
    """The receiver could not store the messages after ``seq``; they stay unacknowledged
    until its storage works again. ``reason``: DEFER_FULL or DEFER_FAILING."""

    seq: int
    reason: int


#: Why a Defer was sent: the receiver's store is full, or failed otherwise.
DEFER_FULL: Final = 1
DEFER_FAILING: Final = 2
DEFER_REASONS: Final = frozenset({DEFER_FULL, DEFER_FAILING})


@dataclass(frozen=True, slots=True)
class App:
    """An application-channel frame; ``body`` is ratchet ciphertext."""

    body: bytes


LinkFrame = Accept | Refuse | SessionOffer | SessionInit | SessionAck | Msg | Ack | Defer | App


def _fields(type_byte: int, *fields: bytes) -> bytes:
    parts = [bytes((type_byte,))]
    for f in fields:
        parts.append(_I.pack(len(f)))
        parts.append(f)
    return b"".join(parts)


def _reader(data: bytes, name: str) -> ByteReader:
    """A reader over the u32-length-prefixed fields after the type byte."""
    return ByteReader(memoryview(data)[1:], f"{name} frame")


def encode(frame: LinkFrame) -> bytes:
    """Encode one link frame to the bytes of one WebSocket binary message."""
    if isinstance(frame, Msg):
        return _BQ.pack(T_MSG, frame.seq) + frame.body
    if isinstance(frame, App):
        return b"\x30" + frame.body
    if isinstance(frame, Ack):
        return _BQ.pack(T_ACK, frame.seq)
    if isinstance(frame, Defer):
        return _BQB.pack(T_DEFER, frame.seq, frame.reason)
    if isinstance(frame, Accept):
        return bytes((T_ACCEPT,))
    if isinstance(frame, Refuse):
        return _fields(T_REFUSE, _H.pack(frame.code), frame.reason.encode())
    if isinstance(frame, SessionOffer):
        if frame.max_frame:
            return _fields(
                T_SESSION_OFFER, frame.bundle, frame.session_id, _I.pack(frame.max_frame)
            )
        return _fields(T_SESSION_OFFER, frame.bundle, frame.session_id)
    if isinstance(frame, SessionInit):
        return _fields(T_SESSION_INIT, frame.session_id, frame.payload)
    if isinstance(frame, SessionAck):
        return bytes((T_SESSION_ACK,)) + frame.body
    raise TypeError(f"not a link frame: {type(frame).__name__}")


def decode(data: bytes, max_size: int = DEFAULT_MAX_FRAME) -> LinkFrame:
    """Parse one link frame; raise MalformedFrameError / OversizeError on bad input."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MalformedFrameError("link frames are binary")
    data = bytes(data)
    if len(data) > max_size + 64:
        raise OversizeError(f"frame of {len(data)} bytes exceeds bound {max_size}")
    if not data:
        raise MalformedFrameError("empty frame")
    t = data[0]
    if t == T_MSG:
        if len(data) < _BQ.size:
            raise MalformedFrameError("truncated MSG header")
        return Msg(_Q.unpack_from(data, 1)[0], data[_BQ.size :])
    if t == T_APP:
        return App(data[1:])
    if t == T_ACK:
        if len(data) != _BQ.size:
            raise MalformedFrameError("ACK must be exactly 9 bytes")
        return Ack(_Q.unpack_from(data, 1)[0])
    if t == T_DEFER:
        if len(data) != _BQB.size:
            raise MalformedFrameError("DEFER must be exactly 10 bytes")
        _, seq, reason = _BQB.unpack(data)
        if reason not in DEFER_REASONS:
            raise MalformedFrameError(f"unknown DEFER reason {reason}")
        return Defer(seq, reason)
    if t == T_ACCEPT:
        if len(data) != 1:
            raise MalformedFrameError("ACCEPT carries no fields")
        return Accept()
    if t == T_REFUSE:
        r = _reader(data, "REFUSE")
        code_raw, reason = r.var32(), r.var32()
        r.end()
        if len(code_raw) != 2:
            raise MalformedFrameError("REFUSE code must be 2 bytes")
        return Refuse(_H.unpack(code_raw)[0], utf8(reason, "reason"))
    if t == T_SESSION_OFFER:
        r = _reader(data, "SESSION_OFFER")
        bundle, sid = r.var32(), r.var32()
        if not r.remaining:
            return SessionOffer(bundle, sid)
        bound = r.var32()
        r.end()
        if len(bound) != _I.size:
            raise MalformedFrameError("SESSION_OFFER max_frame must be 4 bytes")
        (max_frame,) = _I.unpack(bound)
        if max_frame < MIN_MAX_FRAME:
            raise MalformedFrameError(
                f"SESSION_OFFER max_frame {max_frame} is below the {MIN_MAX_FRAME}-byte floor"
            )
        return SessionOffer(bundle, sid, max_frame)
    if t == T_SESSION_INIT:
        r = _reader(data, "SESSION_INIT")
        sid, payload = r.var32(), r.var32()
        r.end()
        if not sid:
            raise MalformedFrameError("SESSION_INIT needs a session id")
        return SessionInit(sid, payload)
    if t == T_SESSION_ACK:
        return SessionAck(data[1:])
    raise MalformedFrameError(f"unknown link frame type 0x{t:02x}")
