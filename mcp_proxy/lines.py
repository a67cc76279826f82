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
        # The unended line, grown in place and copied once its newline comes: joining it
        # to every read copied it again per chunk (quadratic in its length), and a list of
        # the reads held ~20x its bytes when they were tiny.
        self._buf = bytearray()
        self._skipping = False  # inside a refused line: drop up to its newline

    def feed(self, data: bytes) -> None:
        start = 0
        if self._skipping:
            start = data.find(b"\n") + 1
            if not start:
                return
            self._skipping = False
        elif self._buf:
            if b"\n" not in data:
                self._hold(data)
                return
            self._buf += data
            data = bytes(self._buf)
            self._buf = bytearray()
        limit = self._limit
        while (end := data.find(b"\n", start)) >= 0:
            line = data[start:end].rstrip(b"\r")
            start = end + 1
            if len(line) > limit:
                self._on_overflow()
            elif line:
                self._on_line(line)
        if start < len(data):
            self._hold(data[start:])

    def _hold(self, piece: bytes) -> None:
        """Keep a piece of the unended line; past ``limit`` refuse the line (class docstring)."""
        if len(self._buf) + len(piece) > self._limit:
            self._on_overflow()
            self._skipping = True
            self._buf = bytearray()
        else:
            self._buf += piece

    def eof(self) -> None:
        rest = bytes(self._buf).rstrip(b"\r")
        self._buf = bytearray()
        self._skipping = False
        if rest:
            self._on_line(rest)
