"""Relay packets and the ordered stream they carry (docs/PROTOCOL.md "Relay").

Pure and sans-I/O. A link over the relay is a *stream*: a pair of nodes, a
random 16-byte stream id chosen by the opener, and link frames cut into
numbered DATA packets published to the other node's link subject. NATS keeps
the order of one publisher's messages but may drop them (a slow consumer, a
server restart), and anybody allowed to publish there can inject packets, so a
:class:`StreamState` takes DATA packets only in exact sequence: a gap, a
reordering or a replay breaks the stream (:class:`StreamBroken`), the link on
it closes, and the node links again and resends what was not acknowledged.
Nothing a broken stream carried has taken effect unless the link layer had
already authenticated it.

Layouts (``||`` concatenation, integers big-endian)::

    OPEN   0x01 || stream id (16) || u8 len || opener's token (ASCII)
    ACCEPT 0x04 || stream id (16)                      (reply to OPEN)
    DATA   0x02 || stream id (16) || u64 seq || u8 flags || chunk
             flags bit 0: more chunks of this frame follow;
             flags bit 1: keepalive (empty chunk, no frame; numbered like any DATA)
    CLOSE  0x03 || stream id (16) || u16 code || reason (UTF-8, <= 123 bytes)
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Final

from talos_sdk.errors import MalformedFrameError, ProtocolError

__all__ = [
    "STREAM_ID_LEN",
    "Accept",
    "Close",
    "Data",
    "Open",
    "Packet",
    "StreamBroken",
    "StreamState",
    "decode",
    "encode",
]

STREAM_ID_LEN: Final = 16
T_OPEN: Final = 0x01
T_DATA: Final = 0x02
T_CLOSE: Final = 0x03
T_ACCEPT: Final = 0x04
_MORE: Final = 0x01
_KEEPALIVE: Final = 0x02
_DATA_HEAD = struct.Struct(">B16sQB")
_CLOSE_HEAD = struct.Struct(">B16sH")
_TOKEN = re.compile(r"[a-z2-7]{1,64}")
MAX_REASON: Final = 123


class StreamBroken(ProtocolError):
    """A relay stream lost, reordered or repeated a packet, or overflowed its bound."""


@dataclass(frozen=True, slots=True)
class Open:
    stream_id: bytes
    token: str


@dataclass(frozen=True, slots=True)
class Accept:
    stream_id: bytes


@dataclass(frozen=True, slots=True)
class Data:
    stream_id: bytes
    seq: int
    more: bool
    chunk: bytes
    keepalive: bool = False


@dataclass(frozen=True, slots=True)
class Close:
    stream_id: bytes
    code: int
    reason: str


Packet = Open | Accept | Data | Close


def encode(packet: Packet) -> bytes:
    """The bytes of one NATS message carrying ``packet``."""
    if isinstance(packet, Data):
        flags = (_MORE if packet.more else 0) | (_KEEPALIVE if packet.keepalive else 0)
        return _DATA_HEAD.pack(T_DATA, packet.stream_id, packet.seq, flags) + packet.chunk
    if isinstance(packet, Open):
        token = packet.token.encode()
        return bytes((T_OPEN,)) + packet.stream_id + bytes((len(token),)) + token
    if isinstance(packet, Accept):
        return bytes((T_ACCEPT,)) + packet.stream_id
    if isinstance(packet, Close):
        reason = packet.reason.encode()[:MAX_REASON]
        return _CLOSE_HEAD.pack(T_CLOSE, packet.stream_id, packet.code) + reason
    raise TypeError(f"not a relay packet: {type(packet).__name__}")


def decode(data: bytes) -> Packet:
    """Parse one relay packet; MalformedFrameError for anything else."""
    data = bytes(data)
    if len(data) < 1 + STREAM_ID_LEN:
        raise MalformedFrameError("relay packet shorter than its header")
    kind = data[0]
    sid = data[1 : 1 + STREAM_ID_LEN]
    if kind == T_DATA:
        if len(data) < _DATA_HEAD.size:
            raise MalformedFrameError("truncated relay DATA header")
        _, _, seq, flags = _DATA_HEAD.unpack_from(data)
        if flags & ~(_MORE | _KEEPALIVE) or (flags & _KEEPALIVE and len(data) > _DATA_HEAD.size):
            raise MalformedFrameError("bad relay DATA flags")
        chunk = data[_DATA_HEAD.size :]
        return Data(sid, seq, bool(flags & _MORE), chunk, bool(flags & _KEEPALIVE))
    if kind == T_OPEN:
        rest = data[1 + STREAM_ID_LEN :]
        if not rest or len(rest) != 1 + rest[0]:
            raise MalformedFrameError("relay OPEN token length mismatch")
        token = rest[1:].decode("ascii", "replace")
        if not _TOKEN.fullmatch(token):
            raise MalformedFrameError("relay OPEN token is not a relay token")
        return Open(sid, token)
    if kind == T_ACCEPT:
        if len(data) != 1 + STREAM_ID_LEN:
            raise MalformedFrameError("relay ACCEPT has trailing bytes")
        return Accept(sid)
    if kind == T_CLOSE:
        if len(data) < _CLOSE_HEAD.size:
            raise MalformedFrameError("truncated relay CLOSE")
        _, _, code = _CLOSE_HEAD.unpack_from(data)
        try:
            reason = data[_CLOSE_HEAD.size :].decode()
        except UnicodeDecodeError:
            raise MalformedFrameError("relay CLOSE reason is not UTF-8") from None
        return Close(sid, code, reason)
    raise MalformedFrameError(f"unknown relay packet type 0x{kind:02x}")


class StreamState:
    """One end of a relay stream: numbers outgoing chunks, reassembles incoming frames.

    ``max_frame`` bounds a reassembled frame; ``max_chunk`` is the largest chunk
    put in one packet (the relay's message size bound minus the header).
    """

    def __init__(self, stream_id: bytes, max_frame: int, max_chunk: int) -> None:
        if len(stream_id) != STREAM_ID_LEN:
            raise ValueError("relay stream ids are 16 bytes")
        if max_chunk < 1:
            raise ValueError("max_chunk must be positive")
        self.stream_id = stream_id
        self.max_frame = max_frame
        self.max_chunk = max_chunk
        self._send_seq = 0
        self._recv_seq = 0
        self._parts: list[bytes] = []
        self._size = 0

    def packets(self, frame: bytes) -> list[bytes]:
        """Encoded DATA packets that carry ``frame``, in order (at least one)."""
        step = self.max_chunk
        view = memoryview(frame)
        out: list[bytes] = []
        pos = 0
        while True:
            chunk = bytes(view[pos : pos + step])
            pos += step
            more = pos < len(frame)
            out.append(encode(Data(self.stream_id, self._send_seq, more, chunk)))
            self._send_seq += 1
            if not more:
                return out

    def keepalive(self) -> bytes:
        """An encoded keepalive packet (tells the peer this end and the path are alive)."""
        packet = encode(Data(self.stream_id, self._send_seq, False, b"", keepalive=True))
        self._send_seq += 1
        return packet

    def receive(self, packet: Data) -> bytes | None:
        """A whole frame once its last chunk arrived, else None; StreamBroken on disorder."""
        if packet.seq != self._recv_seq:
            raise StreamBroken(
                f"relay stream packet {packet.seq} where {self._recv_seq} was due"
                " (lost, reordered or replayed)"
            )
        self._recv_seq += 1
        if packet.keepalive:
            if self._parts:
                raise StreamBroken("relay keepalive inside a frame")
            return None
        self._size += len(packet.chunk)
        if self._size > self.max_frame + 64:
            raise StreamBroken(f"relay stream frame above the {self.max_frame}-byte bound")
        if packet.more:
            self._parts.append(packet.chunk)
            return None
        if not self._parts:
            self._size = 0
            return packet.chunk
        self._parts.append(packet.chunk)
        frame = b"".join(self._parts)
        self._parts.clear()
        self._size = 0
        return frame
