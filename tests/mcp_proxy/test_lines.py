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


def test_an_overlong_line_is_refused_whole_tail_included() -> None:
    splitter, lines, overflows = make(limit=8)
    splitter.feed(b"0123456789")
    assert overflows == [1] and lines == []
    # The rest of that line is still the refused line, never a message of its own.
    splitter.feed(b'{"tail":1}\nok\n')
    assert overflows == [1] and lines == [b"ok"]


def test_an_overlong_line_arriving_whole_is_refused() -> None:
    splitter, lines, overflows = make(limit=8)
    splitter.feed(b"short\n" + b"x" * 20 + b"\nnext\n")
    assert lines == [b"short", b"next"] and overflows == [1]


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


@given(
    st.lists(st.integers(0, 30), max_size=15),
    st.integers(1, 50),
)
def test_any_chunking_refuses_exactly_the_overlong_lines(lengths: list[int], size: int) -> None:
    limit = 12
    messages = [bytes([97 + i % 26]) * n for i, n in enumerate(lengths)]
    stream = b"".join(m + b"\n" for m in messages)
    splitter, lines, overflows = make(limit=limit)
    for i in range(0, len(stream), size):
        splitter.feed(stream[i : i + size])
    splitter.eof()
    assert lines == [m for m in messages if 0 < len(m) <= limit]
    assert len(overflows) == sum(len(m) > limit for m in messages)
