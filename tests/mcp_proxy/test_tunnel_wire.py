"""Tests for mcp_proxy.tunnel_wire: vectors, round trips, every malformed shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_proxy.tunnel_wire import (
    MAX_FRAME_BYTES,
    FrameKind,
    Joiner,
    TunnelFrame,
    TunnelFrameError,
    decode_frame,
    encode_frame,
)
from talos_sdk.errors import MalformedFrameError, OversizeError

VECTORS = json.loads(
    (Path(__file__).parent.parent / "vectors" / "mcp_proxy" / "tunnel_frames.json").read_text()
)


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: f"{c['kind']}-{c['session']}")
def test_vectors_encode_and_decode(case: dict[str, Any]) -> None:
    kind = FrameKind[case["kind"]]
    messages = tuple(m.encode() for m in case["messages"])
    data = encode_frame(kind, case["session"], messages)
    assert data.hex() == case["hex"]
    assert decode_frame(bytes.fromhex(case["hex"])) == TunnelFrame(kind, case["session"], messages)


@pytest.mark.parametrize("case", VECTORS["invalid"], ids=lambda c: c["why"])
def test_invalid_vectors_rejected(case: dict[str, Any]) -> None:
    with pytest.raises(TunnelFrameError):
        decode_frame(bytes.fromhex(case["hex"]))


def test_frame_error_is_a_malformed_frame_error() -> None:
    assert issubclass(TunnelFrameError, MalformedFrameError)


@given(
    st.sampled_from([FrameKind.MESSAGES]),
    st.integers(0, 0xFFFFFFFF),
    st.lists(st.binary(max_size=300), min_size=1, max_size=20),
)
def test_round_trip_any_messages(kind: FrameKind, session: int, messages: list[bytes]) -> None:
    frame = decode_frame(encode_frame(kind, session, messages))
    assert frame == TunnelFrame(kind, session, tuple(messages))


def test_session_id_out_of_range() -> None:
    with pytest.raises(TunnelFrameError, match="session id out of range"):
        encode_frame(FrameKind.CLOSE, 1 << 32)
    with pytest.raises(TunnelFrameError, match="session id out of range"):
        encode_frame(FrameKind.CLOSE, -1)


def test_oversize_refused_both_ways() -> None:
    with pytest.raises(OversizeError):
        encode_frame(FrameKind.MESSAGES, 1, [b"x" * MAX_FRAME_BYTES])
    with pytest.raises(OversizeError):
        decode_frame(b"\x01" * (MAX_FRAME_BYTES + 1))


def test_huge_count_with_no_body_is_truncated_not_slow() -> None:
    data = bytes([1, 2]) + (1).to_bytes(4, "big") + (0xFFFFFFFF).to_bytes(4, "big")
    with pytest.raises(TunnelFrameError, match="truncated"):
        decode_frame(data)


def test_part_frame_carries_exactly_one_piece_not_empty() -> None:
    frame = encode_frame(FrameKind.PART, 3, (b"abc",))
    assert decode_frame(frame) == TunnelFrame(FrameKind.PART, 3, (b"abc",))
    # An empty piece would cost the joiner a list entry its size bound does not count.
    for pieces in ((), (b"a", b"b"), (b"",)):
        with pytest.raises(TunnelFrameError, match="PART frame must carry exactly one piece"):
            decode_frame(encode_frame(FrameKind.PART, 3, pieces))


@pytest.mark.parametrize("kind", [FrameKind.PAUSE, FrameKind.RESUME])
def test_pause_and_resume_carry_nothing(kind: FrameKind) -> None:
    assert decode_frame(encode_frame(kind, 9, ())) == TunnelFrame(kind, 9, ())
    with pytest.raises(TunnelFrameError, match=f"{kind.name} frame carries a message"):
        decode_frame(encode_frame(kind, 9, (b"x",)))


def test_joiner_rejoins_pieces_with_the_next_messages_frame() -> None:
    joiner = Joiner()
    untouched = (b"a", b"b")
    assert joiner.messages(untouched) is untouched  # nothing split: the tuple as it came
    joiner.add_part(b"he")
    joiner.add_part(b"ll")
    assert joiner.messages((b"o", b"next")) == (b"hello", b"next")
    assert joiner.messages((b"x",)) == (b"x",)  # the pieces were consumed


def test_joiner_refuses_a_message_above_its_limit() -> None:
    joiner = Joiner(limit=10)
    joiner.add_part(b"123456")
    with pytest.raises(OversizeError, match="tunnel message above 10 bytes"):
        joiner.add_part(b"789012")
    joiner.add_part(b"123456")
    with pytest.raises(OversizeError, match="tunnel message above 10 bytes"):
        joiner.messages((b"78901",))
    assert joiner.messages((b"fresh",)) == (b"fresh",)  # nothing kept after a refusal
