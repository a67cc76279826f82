"""Big-endian integers and length-prefixed fields: the one codec of Talos' binary layouts.

docs/DESIGN.md "Canonical encoding": frames and stored records are binary, every
variable field carries its length in front (u8, u16 or u32, big-endian as in
network byte order). Layouts themselves stay in their modules (docs/PROTOCOL.md
documents each); this module only reads and writes the pieces, so a cut-short
or overlong input is refused the same way everywhere.

Writers (``pack_*``) raise :class:`EncodingError` when a value does not fit its
field (a caller's mistake); :class:`ByteReader` raises
:class:`MalformedFrameError` naming the layout when input is truncated, has
trailing bytes, or a text field is not UTF-8 (a peer's or a disk's mistake).
Hot paths that decode a whole fixed header with one precompiled
``struct.Struct`` keep doing so; this is for the variable parts.
"""

from __future__ import annotations

import struct

from talos_sdk.errors import EncodingError, MalformedFrameError

__all__ = [
    "ByteReader",
    "pack_u8",
    "pack_u16",
    "pack_u32",
    "pack_u64",
    "pack_var8",
    "pack_var16",
    "pack_var32",
    "utf8",
]

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
# Each writer checks its own bound inline: records and frames are built per
# message, so no shared helper call or table lookup sits in between.


def _too_big(value: int, bits: int) -> EncodingError:
    return EncodingError(f"{value} does not fit an unsigned {bits}-bit field")


def _too_long(data: bytes, bits: int) -> EncodingError:
    return EncodingError(f"field of {len(data)} bytes longer than a u{bits} length allows")


def pack_u8(value: int) -> bytes:
    """One byte."""
    if not 0 <= value <= 0xFF:
        raise _too_big(value, 8)
    return bytes((value,))


def pack_u16(value: int) -> bytes:
    """Two bytes, big-endian."""
    if not 0 <= value <= 0xFFFF:
        raise _too_big(value, 16)
    return _U16.pack(value)


def pack_u32(value: int) -> bytes:
    """Four bytes, big-endian."""
    if not 0 <= value <= 0xFFFF_FFFF:
        raise _too_big(value, 32)
    return _U32.pack(value)


def pack_u64(value: int) -> bytes:
    """Eight bytes, big-endian."""
    if not 0 <= value <= 0xFFFF_FFFF_FFFF_FFFF:
        raise _too_big(value, 64)
    return _U64.pack(value)


def pack_var8(data: bytes) -> bytes:
    """``u8 len || data`` (at most 255 bytes)."""
    n = len(data)
    if n > 0xFF:
        raise _too_long(data, 8)
    return bytes((n,)) + data


def pack_var16(data: bytes) -> bytes:
    """``u16 len || data`` (at most 65535 bytes)."""
    n = len(data)
    if n > 0xFFFF:
        raise _too_long(data, 16)
    return _U16.pack(n) + data


def pack_var32(data: bytes) -> bytes:
    """``u32 len || data``."""
    n = len(data)
    if n > 0xFFFF_FFFF:
        raise _too_long(data, 32)
    return _U32.pack(n) + data


def utf8(raw: bytes, what: str) -> str:
    """``raw`` decoded as UTF-8; :class:`MalformedFrameError` saying ``what`` is not."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedFrameError(f"{what} is not UTF-8") from None


class ByteReader:
    """Cursor over one encoded value; every error names the layout (``what``).

    Reads never go past the end: a field longer than what is left is
    "truncated". :meth:`end` insists nothing is left over.
    """

    __slots__ = ("_data", "_pos", "_what")

    def __init__(self, data: bytes | bytearray | memoryview, what: str) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise MalformedFrameError(f"{what}: expected bytes, got {type(data).__name__}")
        self._data = bytes(data)
        self._pos = 0
        self._what = what

    @property
    def remaining(self) -> int:
        """Bytes not read yet."""
        return len(self._data) - self._pos

    def take(self, n: int) -> bytes:
        """The next ``n`` bytes."""
        end = self._pos + n
        if end > len(self._data):
            raise MalformedFrameError(f"{self._what}: truncated")
        out = self._data[self._pos : end]
        self._pos = end
        return out

    def u8(self) -> int:
        """One byte as an integer."""
        return self.take(1)[0]

    def u16(self) -> int:
        """Big-endian u16."""
        return int(_U16.unpack(self.take(2))[0])

    def u32(self) -> int:
        """Big-endian u32."""
        return int(_U32.unpack(self.take(4))[0])

    def u64(self) -> int:
        """Big-endian u64."""
        return int(_U64.unpack(self.take(8))[0])

    def var8(self) -> bytes:
        """A ``u8 len || data`` field."""
        return self.take(self.u8())

    def var16(self) -> bytes:
        """A ``u16 len || data`` field."""
        return self.take(self.u16())

    def var32(self) -> bytes:
        """A ``u32 len || data`` field."""
        return self.take(self.u32())

    def text16(self) -> str:
        """A ``u16 len || UTF-8`` field."""
        return utf8(self.var16(), f"{self._what}: text field")

    def rest(self) -> bytes:
        """Everything not read yet (a layout's open-ended tail)."""
        out = self._data[self._pos :]
        self._pos = len(self._data)
        return out

    def end(self) -> None:
        """Refuse trailing bytes."""
        if self._pos != len(self._data):
            raise MalformedFrameError(f"{self._what}: {self.remaining} trailing bytes")
