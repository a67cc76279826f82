"""Frames of the local socket between a running node and its local clients (docs/PROTOCOL.md
"Local clients").

Pure: bytes in, frames out. Every frame is ``length:u32 kind:u8 body`` (the
length counts ``kind`` and ``body``)::

    CALL  (client -> node)  JSON {"id": n, "op": "...", "args": {...}}
    REPLY (node -> client)  JSON {"id": n, "result": ...} or {"id": n, "error": {...}}
    EVENT (node -> client)  JSON {"event": "link", "did": ..., "up": ...} / {"event": "stopping"}
    APP   (both ways)       channel:var8 peer:var8 payload   (an app frame of a peer link)

Control calls are JSON because they are rare and readable; APP frames are
binary because they carry the MCP tunnel's hot path.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any

import orjson

from talos_sdk.errors import MalformedFrameError, OversizeError, UsageError

__all__ = [
    "MAX_FRAME",
    "MAX_LIMIT",
    "MAX_SEND_WAIT",
    "MAX_WAIT",
    "SEND_WAIT",
    "AppFrame",
    "FrameReader",
    "Kind",
    "LocalFrame",
    "encode_app",
    "encode_json",
]

#: Above any app frame a link carries (NodeConfig.max_frame is 1 MiB by default) with room.
MAX_FRAME = 32 * 1024 * 1024

# Bounds of the ops' arguments (talos/local/ops.py), here so that clients can state them
# without importing the node's modules.
#: A long-poll never holds a call longer than this; clients poll again.
MAX_WAIT = 300.0
#: Messages one ``inbox`` call returns at most.
MAX_LIMIT = 1000
#: A ``send`` with ``wait`` waits this long for the ack unless told, and at most MAX_SEND_WAIT.
SEND_WAIT = 30.0
MAX_SEND_WAIT = 3600.0

_HEAD = struct.Struct(">IB")


class Kind(enum.IntEnum):
    CALL = 1
    REPLY = 2
    EVENT = 3
    APP = 4


@dataclass(frozen=True, slots=True)
class AppFrame:
    channel: str
    peer: str
    payload: bytes


@dataclass(frozen=True, slots=True)
class LocalFrame:
    kind: Kind
    #: The decoded JSON object (CALL, REPLY, EVENT) or the app frame (APP).
    body: dict[str, Any] | AppFrame


def _frame(kind: Kind, body: bytes) -> bytes:
    if len(body) + 1 > MAX_FRAME:
        raise OversizeError(f"local frame of {len(body) + 1} bytes above {MAX_FRAME}")
    return _HEAD.pack(len(body) + 1, kind) + body


def encode_json(kind: Kind, obj: dict[str, Any]) -> bytes:
    """A CALL, REPLY or EVENT frame (compact UTF-8 JSON)."""
    try:
        body = orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:  # an int beyond 64 bits, a type orjson does not know: the slow way
        text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
        try:
            body = text.encode()
        except UnicodeEncodeError as exc:
            # Command-line bytes that are not UTF-8 arrive as surrogates (surrogateescape);
            # escaped into the JSON, the node would refuse the whole frame as malformed.
            near = exc.object[max(exc.start - 20, 0) : exc.end + 20]
            raise UsageError(f"an argument is not valid UTF-8 (near {near!r})") from None
    return _frame(kind, body)


def encode_app(channel: str, peer: str, payload: bytes) -> bytes:
    """An APP frame: ``payload`` on app channel ``channel`` to or from ``peer``."""
    ch, pd = channel.encode(), peer.encode()
    if not 0 < len(ch) < 256 or not 0 < len(pd) < 256:
        raise MalformedFrameError("app channel and peer must be 1..255 bytes")
    size = 3 + len(ch) + len(pd) + len(payload)
    if size > MAX_FRAME:
        raise OversizeError(f"local frame of {size} bytes above {MAX_FRAME}")
    return b"".join(
        (_HEAD.pack(size, Kind.APP), bytes((len(ch),)), ch, bytes((len(pd),)), pd, payload)
    )


def _decode(kind_byte: int, body: memoryview) -> LocalFrame:
    try:
        kind = Kind(kind_byte)
    except ValueError:
        raise MalformedFrameError(f"unknown local frame kind {kind_byte}") from None
    if kind is Kind.APP:
        if len(body) < 1:
            raise MalformedFrameError("APP frame without a channel")
        n = body[0]
        if len(body) < 2 + n:
            raise MalformedFrameError("APP frame truncated")
        m = body[1 + n]
        if len(body) < 2 + n + m or n == 0 or m == 0:
            raise MalformedFrameError("APP frame truncated")
        try:
            channel = bytes(body[1 : 1 + n]).decode()
            peer = bytes(body[2 + n : 2 + n + m]).decode()
        except UnicodeDecodeError:
            raise MalformedFrameError("APP frame names are not UTF-8") from None
        return LocalFrame(kind, AppFrame(channel, peer, bytes(body[2 + n + m :])))
    try:
        # orjson: json.loads took 11 % of a sending node's time at 64 sends in flight
        # (most of it guessing the encoding of bytes input); orjson reads UTF-8 directly.
        obj = orjson.loads(body)
    except (UnicodeDecodeError, ValueError):
        raise MalformedFrameError(f"{kind.name} frame is not JSON") from None
    if not isinstance(obj, dict):
        raise MalformedFrameError(f"{kind.name} frame is not a JSON object")
    return LocalFrame(kind, obj)


class FrameReader:
    """Feed bytes as they arrive; take whole frames out (sans-I/O)."""

    __slots__ = ("_buf", "max_frame")

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self.max_frame = max_frame

    @property
    def pending(self) -> int:
        """Bytes of a frame begun and not complete yet (0 between frames)."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[LocalFrame]:
        """Frames completed by ``data``; MalformedFrameError / OversizeError end the stream."""
        buf = self._buf
        buf += data
        out: list[LocalFrame] = []
        start = 0
        view = memoryview(buf)
        try:
            while len(buf) - start >= _HEAD.size:
                size, kind = _HEAD.unpack_from(buf, start)
                if size < 1 or size > self.max_frame:
                    raise OversizeError(f"local frame of {size} bytes (limit {self.max_frame})")
                end = start + 4 + size
                if end > len(buf):
                    break
                out.append(_decode(kind, view[start + _HEAD.size : end]))
                start = end
        finally:
            view.release()
        if start:
            del buf[:start]
        return out
