"""Round-trip every link frame and reject every malformed one (talos/link/wire.py)."""

from __future__ import annotations

import pytest

from talos.link import wire
from talos_sdk.errors import MalformedFrameError, OversizeError

FRAMES: list[wire.LinkFrame] = [
    wire.Accept(),
    wire.Refuse(4003, "unknown peer"),
    wire.SessionOffer(b"bundle-bytes", b""),
    wire.SessionOffer(b"bundle-bytes", b"i" * 16),
    wire.SessionOffer(b"bundle-bytes", b"i" * 16, 1 << 20),
    wire.SessionInit(b"i" * 16, b"x3dh-initial"),
    wire.SessionAck(b"ratchet"),
    wire.Msg(0, b""),
    wire.Msg(2**64 - 1, b"sealed"),
    wire.Ack(7),
    wire.Defer(7, wire.DEFER_FULL),
    wire.Defer(2**64 - 1, wire.DEFER_FAILING),
    wire.App(b"ciphertext"),
]


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_round_trip(frame: wire.LinkFrame) -> None:
    assert wire.decode(wire.encode(frame)) == frame


def test_hot_path_frames_are_compact() -> None:
    assert len(wire.encode(wire.Ack(1))) == 9
    assert wire.encode(wire.Msg(1, b"abc")) == b"\x20" + (1).to_bytes(8, "big") + b"abc"
    assert wire.encode(wire.App(b"abc")) == b"\x30abc"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty"),
        (b"\xff", "unknown link frame type"),
        (b"\x20\x00\x00", "truncated MSG"),
        (b"\x21" + b"\x00" * 7, "ACK must be"),
        (b"\x21" + b"\x00" * 9, "ACK must be"),
        (b"\x22" + b"\x00" * 8, "DEFER must be"),
        (b"\x22" + b"\x00" * 8 + b"\x01\x00", "DEFER must be"),
        (b"\x22" + b"\x00" * 8 + b"\x03", "unknown DEFER reason 3"),
        (b"\x04\x00", "ACCEPT carries no fields"),
        (b"\x01", "unknown link frame type"),  # the old HELLO is gone
        (b"\x03\x00\x00", "REFUSE frame: truncated"),
        (b"\x03\x00\x00\x00\x09abc", "truncated"),
        (b"\x03\x00\x00\x00\x02ab\x00\x00\x00\x00x", "trailing bytes"),
        (b"\x03\x00\x00\x00\x02\x0f\xa0\x00\x00\x00\x02\xff\xfe", "reason is not UTF-8"),
        (b"\x03" + b"\x00\x00\x00\x01x" + b"\x00\x00\x00\x00", "code must be 2"),
        (b"\x11" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x00", "needs a session id"),
        (b"\x10" + b"\x00\x00\x00\x01b" + b"\x00\x00\x00\x00" + b"\0\0\0\x02\0\1", "4 bytes"),
        (
            b"\x10" + b"\x00\x00\x00\x01b" + b"\x00\x00\x00\x00" + b"\0\0\0\x04" + b"\0" * 4,
            "below the 16384-byte floor",
        ),
        (
            b"\x10" + b"\x00\x00\x00\x01b" + b"\x00\x00\x00\x00" + b"\0\0\0\x04\0\0\x3f\xff",
            "below the 16384-byte floor",
        ),
    ],
)
def test_malformed_frames_are_rejected(data: bytes, match: str) -> None:
    with pytest.raises(MalformedFrameError, match=match):
        wire.decode(data)


def test_oversize_frame_is_rejected() -> None:
    with pytest.raises(OversizeError):
        wire.decode(wire.encode(wire.App(b"x" * 2000)), max_size=1000)


def test_text_frames_are_rejected() -> None:
    with pytest.raises(MalformedFrameError, match="binary"):
        wire.decode("hello")  # type: ignore[arg-type]


def test_encode_rejects_non_frames() -> None:
    with pytest.raises(TypeError):
        wire.encode("nope")  # type: ignore[arg-type]
