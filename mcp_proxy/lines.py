"""Newline-delimited message framing (MCP "Transports: stdio": one JSON-RPC message per line)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["LineCallback", "LineSplitter"]

LineCallback = Callable[[bytes], None]


class LineSplitter:
    """Cuts a byte stream into newline-terminated lines inside the data callback.

    Lines are handed on from ``data_received`` itself: no reader task to wake per
    line, which is one event-loop iteration saved on every message of the hot path.

    A line longer than ``limit`` is refused whole: ``on_overflow`` is called once
    and every byte up to its newline is dropped, so no tail of it is ever taken
    for a message of its own.
    """

    def __init__(self, on_line: LineCallback, on_overflow: Callable[[], None], limit: int) -> None:
        self._on_line = on_line
        self._on_overflow = on_overflow
        self._limit = limit
        self._buf = b""
        self._skipping = False  # inside a refused line: drop up to its newline

    def feed(self, data: bytes) -> None:
        start = 0
        if self._skipping:
            start = data.find(b"\n") + 1
            if not start:
                return
            self._skipping = False
        elif self._buf:
            data = self._buf + data
            self._buf = b""
        limit = self._limit
        while (end := data.find(b"\n", start)) >= 0:
            line = data[start:end].rstrip(b"\r")
            start = end + 1
            if len(line) > limit:
                self._on_overflow()
            elif line:
                self._on_line(line)
        if len(data) - start > limit:
            self._on_overflow()
            self._skipping = True
            self._buf = b""
        else:
            self._buf = data[start:]

    def eof(self) -> None:
        rest, self._buf = self._buf.rstrip(b"\r"), b""
        self._skipping = False
        if rest:
            self._on_line(rest)
