"""mcp_proxy/sse_reader.py: the data of server-sent events (HTML Living Standard section
9.2.6), fed in any split, bounded per event whatever its lines hold."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from mcp_proxy.sse_reader import EventDataReader

STREAM = (
    b": a comment\r\n"
    b"event: message\n"
    b'data: {"a":1}\n'
    b"\n"
    b"id: 7\r\n"
    b"data:  two spaces, one kept\r\n"
    b"data\r\n"
    b"data:last\r\n"
    b"\r\n"
    b"retry: 100\n"
    b"\n"  # an event with no data: nothing
    b"data: unfinished"
)
EVENTS = [b'{"a":1}', b" two spaces, one kept\n\nlast"]


def test_fields_and_line_ends() -> None:
    reader = EventDataReader(1 << 20)
    assert reader.feed(STREAM) == EVENTS
    assert reader.feed(b"\n\n") == [b"unfinished"] and not reader.too_big


@given(st.lists(st.integers(0, len(STREAM)), max_size=8))
def test_any_split_gives_the_same_events(cuts: list[int]) -> None:
    reader = EventDataReader(1 << 20)
    bounds = [0, *sorted(cuts), len(STREAM)]
    got = [e for a, b in itertools.pairwise(bounds) for e in reader.feed(STREAM[a:b])]
    assert got == EVENTS


def test_empty_data_lines_count_towards_the_limit() -> None:
    # Each "data:" line with nothing after it is 6 stream bytes: 100 of them pass 512.
    reader = EventDataReader(512)
    assert reader.feed(b"data: ok\n\n" + b"data:\n" * 100) == [b"ok"]
    assert reader.too_big
    assert reader.feed(b"\n") == []  # nothing more is read from a dropped stream


def test_other_lines_and_an_unended_line_count_too() -> None:
    comments = EventDataReader(512)
    comments.feed(b":\n" * 300)  # no blank line: one event's worth of lines
    assert comments.too_big
    unended = EventDataReader(512)
    assert unended.feed(b"data: " + b"x" * 400) == [] and not unended.too_big
    unended.feed(b"x" * 200)
    assert unended.too_big


def test_the_limit_is_per_event() -> None:
    reader = EventDataReader(64)
    for _ in range(100):
        assert reader.feed(b"data: " + b"x" * 40 + b"\n\n") == [b"x" * 40]
    assert not reader.too_big


def test_a_large_chunk_of_small_events_in_one_pass() -> None:
    # Read from where the last line ended: a 1 MiB chunk is one scan, not one copy per line.
    count = (1 << 20) // 10
    assert len(EventDataReader(16 << 20).feed(b"data: {}\n\n" * count)) == count


def test_a_line_trickled_in_small_chunks_is_searched_once() -> None:
    # 2 MiB of one data line, 256 bytes a read: the part already searched is not searched
    # again (this was quadratic: about 0.5 s at 2 MiB, 20 s at 16 MiB).
    reader = EventDataReader(16 << 20)
    reader.feed(b"data: ")
    for _ in range((2 << 20) // 256):
        assert reader.feed(b"x" * 256) == []
    assert reader._scanned == len(reader._buf) == 6 + (2 << 20)
    assert reader.feed(b"\n\n") == [b"x" * (2 << 20)]
