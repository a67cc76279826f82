"""The data of server-sent events, read from a Streamable HTTP upstream's ``text/event-stream``.

Sans-I/O: :meth:`EventDataReader.feed` takes the bytes as they come and returns
the data of each event completed by them (HTML Living Standard, "Server-sent
events", section 9.2.6 "Interpreting an event stream": ``data`` fields joined
by a line feed, an event ends at a blank line; ``event``, ``id``, ``retry``
and comment lines carry nothing MCP needs here). A line may end in LF or
CRLF; a lone CR ends no line (the MCP SDKs' servers end lines with LF or
CRLF).

The upstream is not trusted (docs/security.md): each byte is searched for a
line feed once (an unended line is not searched again when more of it comes),
so the stream costs time linear in its size, and an event's size is the stream
bytes its lines took (a ``data:`` line with nothing after it counts its six
bytes): once an event passes ``limit``, whatever its lines hold,
:attr:`EventDataReader.too_big` is set and the reader reads no further (the
events completed before it are returned).
"""

from __future__ import annotations

__all__ = ["EventDataReader"]


class EventDataReader:
    """The ``data`` of each complete event of one event stream, at most ``limit`` bytes each."""

    __slots__ = ("_buf", "_data", "_limit", "_scanned", "_size", "too_big")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._buf = bytearray()  # the last line, not yet ended
        self._scanned = 0  # how much of it holds no line feed (not searched again)
        self._data: list[bytes] = []  # the data lines of the event being read
        self._size = 0  # stream bytes the event being read took so far
        #: An event passed ``limit``: the stream is to be dropped.
        self.too_big = False

    def feed(self, chunk: bytes) -> list[bytes]:
        """The data of the events ``chunk`` completes (none once :attr:`too_big`)."""
        if self.too_big:
            return []
        buf = self._buf
        buf += chunk
        out: list[bytes] = []
        start = 0
        scan = self._scanned
        while (end := buf.find(b"\n", scan)) >= 0:
            line = bytes(buf[start:end])
            start = scan = end + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    out.append(b"\n".join(self._data))
                self._data = []
                self._size = 0
                continue
            self._size += len(line) + 1
            if self._size > self._limit:
                break
            if line.startswith(b"data:"):
                self._data.append(line[5:].removeprefix(b" "))
            elif line == b"data":  # a field name alone: an empty value
                self._data.append(b"")
        del buf[:start]
        self._scanned = len(buf)
        if self._size + len(buf) > self._limit:
            self.too_big = True
            self._buf, self._data = bytearray(), []
        return out
