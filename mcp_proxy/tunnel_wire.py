"""Tunnel app frames: what the "mcp" app channel of a node link carries (ARCHITECTURE.md).

Pure: no I/O. One frame addresses one MCP client session and carries one or more
JSON-RPC messages as opaque bytes, so the sender can coalesce whatever is queued
into a single frame under load (docs/DESIGN.md "Performance targets")::

    frame    = version:u8 kind:u8 session:u32 count:u32 message*
    message  = length:u32 bytes            (big-endian lengths)

Kinds: OPEN (the session starts; its one message is the server name, may be
empty), MESSAGES (JSON-RPC lines, no trailing newline), CLOSE (the session
ends), ERROR (the session failed; its one message is a UTF-8 reason), PART
(its one message is a non-empty leading piece of a JSON-RPC message too
large for one link frame; the pieces of consecutive PART frames of a session
are joined with the first message of that session's next MESSAGES frame,
which ends it), PAUSE
and RESUME (no message; per-session flow control, either way: from the
caller's side, its agent is not reading, so the serving side stops reading
that session's tool until RESUME; from the serving side, that session's tool is
not reading its input, so the caller's side stops reading that agent until
RESUME; a peer that does not know them drops the frame: a serving side then
does not pause that tool's output, and a caller goes on sending until its
session fails at the serving side's bound on unread input).
Splitting keeps the tunnel transparent for messages above the node's link frame
bound (a 2 MiB resource read); the whole message is bounded by MAX_MESSAGE_BYTES.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from talos_sdk.errors import MalformedFrameError, OversizeError

__all__ = [
    "MAX_FRAME_BYTES",
    "MAX_MESSAGE_BYTES",
    "VERSION",
    "FrameKind",
    "Joiner",
    "TunnelFrame",
    "TunnelFrameError",
    "decode_frame",
    "encode_frame",
]

VERSION = 1
# The node bounds link frames; stay well under any sane bound so a coalesced
# batch is never refused by the link. A single message may still be this large.
MAX_FRAME_BYTES = 8 * 1024 * 1024
# One JSON-RPC message, however many PART frames carry it (the stdio line limit too).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_HEAD = struct.Struct(">BBII")
_LEN = struct.Struct(">I")


class TunnelFrameError(MalformedFrameError):
    """Bytes on the "mcp" app channel that are not a tunnel frame."""


class FrameKind(enum.IntEnum):
    """What a tunnel frame does to its client session."""

    OPEN = 1
    MESSAGES = 2
    CLOSE = 3
    ERROR = 4
    PART = 5
    PAUSE = 6
    RESUME = 7


_KINDS = {int(kind): kind for kind in FrameKind}


@dataclass(frozen=True, slots=True)
class TunnelFrame:
    """One decoded tunnel frame."""

    kind: FrameKind
    session: int
    messages: tuple[bytes, ...]


def encode_frame(kind: FrameKind, session: int, messages: Sequence[bytes] = ()) -> bytes:
    """Encode a frame; raises OversizeError above MAX_FRAME_BYTES."""
    if not 0 <= session <= 0xFFFFFFFF:
        raise TunnelFrameError(f"session id out of range: {session}")
    parts = [_HEAD.pack(VERSION, kind, session, len(messages))]
    size = _HEAD.size
    for message in messages:
        size += _LEN.size + len(message)
        parts.append(_LEN.pack(len(message)))
        parts.append(message)
    if size > MAX_FRAME_BYTES:
        raise OversizeError(f"tunnel frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    return b"".join(parts)


def decode_frame(data: bytes) -> TunnelFrame:
    """Decode a frame, rejecting anything truncated, trailing, or unknown."""
    if type(data) is not bytes:
        data = bytes(data)
    end = len(data)
    if end > MAX_FRAME_BYTES:
        raise OversizeError(f"tunnel frame of {end} bytes exceeds {MAX_FRAME_BYTES}")
    if end < _HEAD.size:
        raise TunnelFrameError("tunnel frame shorter than its header")
    version, raw_kind, session, count = _HEAD.unpack_from(data)
    if version != VERSION:
        raise TunnelFrameError(f"unknown tunnel frame version {version}")
    kind = _KINDS.get(raw_kind)
    if kind is None:
        raise TunnelFrameError(f"unknown tunnel frame kind {raw_kind}")
    # One slice per message straight from the bytes (no memoryview step): this loop
    # runs for every message a batch carries, 2.6 us each before, at 64 per frame.
    messages: list[bytes] = []
    append = messages.append
    unpack = _LEN.unpack_from
    offset = _HEAD.size
    for _ in range(count):
        start = offset + 4
        if start > end:
            raise TunnelFrameError("tunnel frame truncated in a length prefix")
        offset = start + unpack(data, start - 4)[0]
        if offset > end:
            raise TunnelFrameError("tunnel frame truncated in a message")
        append(data[start:offset])
    if offset != end:
        raise TunnelFrameError("trailing bytes after the last message")
    if kind is FrameKind.PART and (count != 1 or not messages[0]):
        # An empty piece would be kept at no cost to the joiner's size bound.
        raise TunnelFrameError("PART frame must carry exactly one piece, not empty")
    if kind in (FrameKind.OPEN, FrameKind.ERROR) and count > 1:
        raise TunnelFrameError(f"{kind.name} frame carries more than one message")
    if kind is FrameKind.MESSAGES and count == 0:
        raise TunnelFrameError("MESSAGES frame carries no message")
    if (kind is FrameKind.PAUSE or kind is FrameKind.RESUME) and count:
        raise TunnelFrameError(f"{kind.name} frame carries a message")
    return TunnelFrame(kind, session, tuple(messages))


class Joiner:
    """Rejoins one session's split messages (PART pieces + the next MESSAGES frame's first)."""

    __slots__ = ("_parts", "_size", "limit")

    def __init__(self, limit: int = MAX_MESSAGE_BYTES) -> None:
        self._parts: list[bytes] = []
        self._size = 0
        self.limit = limit

    def add_part(self, piece: bytes) -> None:
        """Keep a leading piece; OversizeError (and nothing kept) once the message passes limit."""
        self._size += len(piece)
        if self._size > self.limit:
            self._parts.clear()
            self._size = 0
            raise OversizeError(f"tunnel message above {self.limit} bytes")
        self._parts.append(piece)

    def messages(self, messages: tuple[bytes, ...]) -> tuple[bytes, ...]:
        """A MESSAGES frame's messages, the first joined to any pieces kept before it."""
        if not self._parts:
            return messages  # the hot path: nothing was split
        parts = self._parts
        self._parts = []
        size, self._size = self._size + len(messages[0]), 0
        if size > self.limit:
            raise OversizeError(f"tunnel message above {self.limit} bytes")
        parts.append(messages[0])
        return (b"".join(parts), *messages[1:])
