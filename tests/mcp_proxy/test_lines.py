"""Tests for mcp_proxy.lines: line framing across chunk boundaries, CRLF, overflow, EOF."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mcp_proxy.lines import LineSplitter


def make(limit: int = 1000) -> tuple[LineSplitter, list[bytes], list[int]]:
    lines: list[bytes] = []
    overflows: list[int] = []
    return LineSplitter(lines.append, lambda: overflows.append(1), limit), lines, overflows


def test_lines_across_chunks_and_crlf() -> None:
    splitter, lines, _ = make()
    for chunk in (b'{"a":', b"1}\r\n{", b'"b":2}\n\n', b"tail"):
        splitter.feed(chunk)
    assert lines == [b'{"a":1}', b'{"b":2}']
    splitter.eof()
    assert lines[-1] == b"tail"


def test_overflow_drops_the_partial_line_and_reports() -> None:
    splitter, lines, overflows = make(limit=8)
    splitter.feed(b"0123456789")
    assert overflows == [1] and lines == []
    splitter.feed(b"ok\n")
    assert lines == [b"ok"]


@given(
    st.lists(
        st.binary(min_size=1, max_size=40).filter(
            lambda b: b"\n" not in b and not b.endswith(b"\r")
        ),
        max_size=20,
    ),
    st.integers(1, 50),
)
def test_any_chunking_gives_the_same_lines(messages: list[bytes], size: int) -> None:
    stream = b"".join(m + b"\n" for m in messages)
    splitter, lines, _ = make(limit=10_000)
    for i in range(0, len(stream), size):
        splitter.feed(stream[i : i + size])
    splitter.eof()
    assert lines == messages
