"""Local socket frames (talos/local/wire.py): round trips, splitting, bad input."""

from __future__ import annotations

import struct

import pytest

from talos.local import wire
from talos_sdk.errors import MalformedFrameError, OversizeError, UsageError


def test_round_trip_every_kind_fed_byte_by_byte() -> None:
    data = (
        wire.encode_json(wire.Kind.CALL, {"id": 1, "op": "send", "args": {"to": "bob"}})
        + wire.encode_app("mcp", "did:key:zX", b"\x00\x01payload")
        + wire.encode_json(wire.Kind.EVENT, {"event": "stopping"})
    )
    reader = wire.FrameReader()
    frames = [f for i in range(len(data)) for f in reader.feed(data[i : i + 1])]
    assert [f.kind for f in frames] == [wire.Kind.CALL, wire.Kind.APP, wire.Kind.EVENT]
    assert frames[0].body == {"id": 1, "op": "send", "args": {"to": "bob"}}
    assert frames[1].body == wire.AppFrame("mcp", "did:key:zX", b"\x00\x01payload")
    assert reader.feed(b"") == []


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (struct.pack(">IB", 3, 9) + b"{}", MalformedFrameError),  # unknown kind
        (struct.pack(">IB", 4, 1) + b"[1]", MalformedFrameError),  # not an object
        (struct.pack(">IB", 3, 1) + b"{x", MalformedFrameError),  # not JSON
        (struct.pack(">IB", 3, 4) + b"\x05a", MalformedFrameError),  # truncated APP
        (struct.pack(">IB", 0, 1), OversizeError),  # empty
        (struct.pack(">IB", wire.MAX_FRAME + 1, 1), OversizeError),  # above the bound
    ],
)
def test_bad_frames_are_refused(raw: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        wire.FrameReader().feed(raw)


def test_app_names_are_bounded() -> None:
    with pytest.raises(MalformedFrameError):
        wire.encode_app("", "did:key:zX", b"")
    with pytest.raises(MalformedFrameError):
        wire.encode_app("mcp", "x" * 256, b"")


def test_big_ints_take_the_slow_path_and_round_trip() -> None:
    frame = wire.encode_json(wire.Kind.CALL, {"id": 1, "op": "inbox", "args": {"after": 2**70}})
    (got,) = wire.FrameReader().feed(frame)
    assert got.body == {"id": 1, "op": "inbox", "args": {"after": 2**70}}


def test_text_that_is_not_utf8_is_a_usage_error() -> None:
    # What a non-UTF-8 command-line argument looks like in Python (surrogateescape).
    path = b"/tmp/caf\xe9.txt".decode("utf-8", "surrogateescape")
    with pytest.raises(UsageError, match="not valid UTF-8"):
        wire.encode_json(wire.Kind.CALL, {"id": 1, "op": "files.send", "args": {"path": path}})
