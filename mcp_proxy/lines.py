"""Newline-delimited message framing (MCP "Transports: stdio": one JSON-RPC message per line)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["LineCallback", "LineSplitter"]

LineCallback = Callable[[bytes], None]


class LineSplitter:
    """Cuts a byte stream into newline-terminated lines inside the data callback.

    Lines are handed on from ``data_received`` itself: no reader task to wake per
    line, which is one event-loop iteration saved on every message of the hot path.
    """

    def __init__(self, on_line: LineCallback, on_overflow: Callable[[], None], limit: int) -> None:
        self._on_line = on_line
        self._on_overflow = on_overflow
        self._limit = limit
        self._buf = b""

    def feed(self, data: bytes) -> None:
        if self._buf:
            data = self._buf + data
            self._buf = b""
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            line = data[start:end].rstrip(b"\r")
            start = end + 1
            if line:
                self._on_line(line)
        rest = data[start:]
        if len(rest) > self._limit:
            self._on_overflow()
            rest = b""
        self._buf = rest

    def eof(self) -> None:
        rest, self._buf = self._buf.rstrip(b"\r"), b""
        if rest:
            self._on_line(rest)
