"""Relay packets round-trip; a stream pair delivers frames in order and breaks on disorder."""

from __future__ import annotations

import pytest

from talos.relay import wire
from talos_sdk.errors import MalformedFrameError

SID = bytes(range(16))


@pytest.mark.parametrize(
    "packet",
    [
        wire.Open(SID, "abcdefghijklmnopqrstuvwxyz234567"),
        wire.Accept(SID),
        wire.Data(SID, 7, False, b"frame"),
        wire.Data(SID, 2**64 - 1, True, b""),
        wire.Data(SID, 3, False, b"", keepalive=True),
        wire.Close(SID, 4020, "relay stream broken"),
    ],
)
def test_every_packet_round_trips(packet: wire.Packet) -> None:
    assert wire.decode(wire.encode(packet)) == packet


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x02" + SID,  # DATA without its sequence number
        b"\x09" + SID,  # unknown type
        b"\x01" + SID + b"\x05abc",  # OPEN token length mismatch
        b"\x01" + SID + b"\x03ABC",  # OPEN token outside the base32 alphabet
        b"\x04" + SID + b"x",  # ACCEPT with trailing bytes
        b"\x03" + SID + b"\x0f\xa0\xff",  # CLOSE reason not UTF-8
        wire.encode(wire.Data(SID, 1, False, b""))[:-1] + b"\x04",  # unknown flag
        wire.encode(wire.Data(SID, 1, False, b"", keepalive=True)) + b"x",  # keepalive with data
    ],
)
def test_garbage_is_a_clear_error(data: bytes) -> None:
    with pytest.raises(MalformedFrameError):
        wire.decode(data)


def _pair(max_frame: int = 1000, max_chunk: int = 100) -> tuple[wire.StreamState, wire.StreamState]:
    return wire.StreamState(SID, max_frame, max_chunk), wire.StreamState(SID, max_frame, max_chunk)


def _carry(a: wire.StreamState, b: wire.StreamState, frame: bytes) -> list[bytes | None]:
    out = []
    for raw in a.packets(frame):
        packet = wire.decode(raw)
        assert isinstance(packet, wire.Data)
        out.append(b.receive(packet))
    return out


def test_frames_are_cut_and_joined_in_order() -> None:
    a, b = _pair()
    assert _carry(a, b, b"x" * 250) == [None, None, b"x" * 250]
    assert _carry(a, b, b"") == [b""]
    keep = wire.decode(a.keepalive())
    assert isinstance(keep, wire.Data) and b.receive(keep) is None
    assert _carry(a, b, b"after keepalive") == [b"after keepalive"]


@pytest.mark.parametrize("order", [[1, 0], [0, 0], [0, 2]])
def test_lost_reordered_or_replayed_packets_break_the_stream(order: list[int]) -> None:
    a, b = _pair()
    packets = [wire.decode(p) for p in a.packets(b"y" * 300)]
    with pytest.raises(wire.StreamBroken):
        for i in order:
            packet = packets[i]
            assert isinstance(packet, wire.Data)
            b.receive(packet)


def test_a_frame_above_the_bound_breaks_the_stream() -> None:
    a, _ = _pair(max_frame=10_000)
    _, b = _pair(max_frame=100)
    with pytest.raises(wire.StreamBroken, match="bound"):
        _carry(a, b, b"z" * 1000)
