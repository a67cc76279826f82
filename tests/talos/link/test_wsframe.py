"""The WebSocket data phase, sans I/O (talos/link/wsframe.py): RFC 6455's own examples,
a connected client/server pair, every frame the RFC forbids, and websockets' sans-I/O
protocol as the independent implementation on the other end."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from websockets.frames import Opcode
from websockets.protocol import Protocol, Side, State

from talos.link.wsframe import (
    CLOSE_MESSAGE_TOO_BIG,
    CLOSE_PROTOCOL_ERROR,
    Closed,
    Pong,
    WebSocketError,
    WsFrames,
    apply_mask,
)
from talos_sdk.errors import UsageError

VECTORS = Path(__file__).parents[2] / "vectors" / "websocket" / "rfc6455_examples.json"
MAX = 1 << 20


def _pair() -> tuple[WsFrames, WsFrames]:
    return WsFrames(client=True, max_size=MAX), WsFrames(client=False, max_size=MAX)


def _frame(b0: int, payload: bytes, *, mask: bytes | None = None) -> bytes:
    """A frame built by hand (its first byte as given, so it may break the rules)."""
    n = len(payload)
    bit = 0x80 if mask is not None else 0
    if n < 126:
        head = bytes((b0, bit | n))
    elif n < 65536:
        head = bytes((b0, bit | 126)) + struct.pack("!H", n)
    else:
        head = bytes((b0, bit | 127)) + struct.pack("!Q", n)
    if mask is None:
        return head + payload
    return head + mask + apply_mask(payload, mask)


def _vectors() -> list[dict[str, Any]]:
    return list(json.loads(VECTORS.read_text())["vectors"])


@pytest.mark.parametrize("case", _vectors(), ids=lambda c: c["name"])
def test_the_rfc_examples_parse_as_the_rfc_says(case: dict[str, Any]) -> None:
    end = WsFrames(client=case["receiver"] == "client", max_size=MAX)
    if "header" in case:
        payload = bytes(range(256)) * (case["binary_length"] // 256)
        assert end.receive_data(bytes.fromhex(case["header"]) + payload) == [payload]
        return
    events = []
    for frame in case["frames"]:
        events += end.receive_data(bytes.fromhex(frame))
    if "text" in case:
        assert events == [case["text"]]
    elif "pong_data" in case:
        assert events == [Pong(bytes.fromhex(case["pong_data"]))]
    else:  # a ping: answered with a pong carrying its data, nothing for the application
        assert events == []
        server = WsFrames(client=False, max_size=MAX)
        assert server.receive_data(end.data_to_send()) == [
            Pong(bytes.fromhex(case["answer_pong_data"]))
        ]


@pytest.mark.parametrize("size", [0, 1, 125, 126, 65535, 65536, 300_000])
def test_binary_messages_cross_both_ways(size: int) -> None:
    client, server = _pair()
    data = os.urandom(size)
    sent = client.send_binary(data)
    assert sent[1] & 0x80  # masked
    assert server.receive_data(sent) == [data]
    back = server.send_binary(data)
    assert not back[1] & 0x80
    assert client.receive_data(back) == [data]


@given(st.lists(st.binary(max_size=300), min_size=1, max_size=8), st.integers(1, 50))
def test_any_cut_of_the_stream_gives_the_same_messages(messages: list[bytes], step: int) -> None:
    client, server = _pair()
    stream = b"".join(client.send_binary(m) for m in messages)
    got: list[object] = []
    for i in range(0, len(stream), step):
        got += server.receive_data(stream[i : i + step])
    assert got == messages


def test_a_fragmented_binary_message_is_reassembled_around_a_ping() -> None:
    client = WsFrames(client=True, max_size=MAX)
    frames = _frame(0x02, b"ab") + _frame(0x89, b"p") + _frame(0x00, b"cd") + _frame(0x80, b"e")
    assert client.receive_data(frames) == [b"abcde"]
    server = WsFrames(client=False, max_size=MAX)
    assert server.receive_data(client.data_to_send()) == [Pong(b"p")]


def test_the_closing_handshake_carries_the_code_both_ways() -> None:
    client, server = _pair()
    assert server.receive_data(client.send_close(4003, "not on the allow list")) == [
        Closed(4003, "not on the allow list")
    ]
    assert server.closed and server.rcvd_then_sent
    assert client.open is False and client.closed is False  # waiting for the echo
    # The echo carries the code (RFC 6455 section 5.5.1), not the reason.
    assert client.receive_data(server.data_to_send()) == [Closed(4003, "")]
    assert client.closed and client.rcvd_then_sent is False
    assert client.send_close() == b""  # once only
    with pytest.raises(UsageError, match="closing"):  # our misuse, not the peer's fault
        client.send_binary(b"late")


def test_messages_sent_before_the_peers_close_are_still_delivered_after_ours() -> None:
    client, server = _pair()
    in_flight = server.send_binary(b"reply")
    client.send_close()
    assert client.receive_data(in_flight + server.send_close()) == [b"reply", Closed(1000, "")]


def test_a_close_without_a_code_is_1005_and_echoed_without_one() -> None:
    client = WsFrames(client=True, max_size=MAX)
    assert client.receive_data(_frame(0x88, b"")) == [Closed(1005, "")]
    server = WsFrames(client=False, max_size=MAX)
    assert server.receive_data(client.data_to_send()) == [Closed(1005, "")]


def test_a_close_reason_is_cut_to_fit_whole_characters() -> None:
    client, server = _pair()
    (closed,) = server.receive_data(client.send_close(1000, "é" * 100))
    assert isinstance(closed, Closed) and closed.reason == "é" * 61


BAD_TO_SERVER = {
    "reserved bit": _frame(0xC2, b"x", mask=b"abcd"),
    "unmasked": _frame(0x82, b"x"),
    "long control frame": _frame(0x89, b"x" * 126, mask=b"abcd"),
    "fragmented control frame": _frame(0x09, b"x", mask=b"abcd"),
    "continuation first": _frame(0x80, b"x", mask=b"abcd"),
    "message inside a fragmented one": _frame(0x02, b"a", mask=b"abcd")
    + _frame(0x82, b"b", mask=b"abcd"),
    "unknown opcode": _frame(0x83, b"x", mask=b"abcd"),
    "close of one byte": _frame(0x88, b"\x03", mask=b"abcd"),
    "close code 1005 on the wire": _frame(0x88, struct.pack("!H", 1005), mask=b"abcd"),
    "close code 999": _frame(0x88, struct.pack("!H", 999), mask=b"abcd"),
    "length above 2^63": bytes((0x82, 0xFF)) + struct.pack("!Q", 1 << 63) + b"abcd",
}


@pytest.mark.parametrize("name", BAD_TO_SERVER)
def test_a_forbidden_frame_fails_with_1002_and_our_close_frame(name: str) -> None:
    server = WsFrames(client=False, max_size=MAX)
    with pytest.raises(WebSocketError) as caught:
        server.receive_data(BAD_TO_SERVER[name])
    assert caught.value.code == CLOSE_PROTOCOL_ERROR
    client = WsFrames(client=True, max_size=MAX)
    assert client.receive_data(server.data_to_send()) == [Closed(1002, caught.value.reason)]
    assert server.closed and server.receive_data(b"\x82\x00") == []


def test_a_masked_frame_to_a_client_fails() -> None:
    client = WsFrames(client=True, max_size=MAX)
    with pytest.raises(WebSocketError, match="masked"):
        client.receive_data(_frame(0x82, b"x", mask=b"abcd"))


@pytest.mark.parametrize(
    "data",
    [_frame(0x81, b"\xff\xfe", mask=b"abcd"), _frame(0x88, b"\x03\xe8\xff", mask=b"abcd")],
    ids=["text", "close reason"],
)
def test_text_that_is_not_utf8_fails_with_1007(data: bytes) -> None:
    with pytest.raises(WebSocketError) as caught:
        WsFrames(client=False, max_size=MAX).receive_data(data)
    assert caught.value.code == 1007


def test_an_oversize_message_is_refused_on_its_header_before_its_payload() -> None:
    server = WsFrames(client=False, max_size=1000)
    header = bytes((0x82, 0xFF)) + struct.pack("!Q", 1 << 40)  # a TiB announced
    with pytest.raises(WebSocketError) as caught:
        server.receive_data(header)
    assert caught.value.code == CLOSE_MESSAGE_TOO_BIG


def test_fragments_count_toward_the_bound_together() -> None:
    server = WsFrames(client=False, max_size=1000)
    assert server.receive_data(_frame(0x02, b"x" * 600, mask=b"abcd")) == []
    with pytest.raises(WebSocketError) as caught:
        server.receive_data(_frame(0x80, b"x" * 600, mask=b"abcd"))
    assert caught.value.code == CLOSE_MESSAGE_TOO_BIG


def test_a_large_frame_in_many_chunks_is_joined_once_it_is_whole() -> None:
    client, server = _pair()
    data = os.urandom(200_000)
    wire = client.send_binary(data)
    got: list[object] = []
    for i in range(0, len(wire), 4096):
        got += server.receive_data(wire[i : i + 4096])
        assert server._chunks == [] or len(server._chunks) * 4096 >= server._size
    assert got == [data]


@pytest.mark.parametrize("size", [0, 5, 300, 70_000])
def test_websockets_sans_io_reads_what_we_write_and_we_read_what_it_writes(size: int) -> None:
    """websockets' protocol objects, an independent implementation, as the other end."""
    data = os.urandom(size)
    ours_client = WsFrames(client=True, max_size=MAX)
    theirs_server = Protocol(Side.SERVER, state=State.OPEN, max_size=MAX)
    theirs_server.receive_data(ours_client.send_binary(data) + ours_client.send_ping(b"hi"))
    events = theirs_server.events_received()
    assert [(e.opcode, e.data) for e in events] == [(Opcode.BINARY, data), (Opcode.PING, b"hi")]
    # Its pong to our ping, then its binary message and its close frame.
    theirs_server.send_binary(data)
    theirs_server.send_close(4010, "sealed frame failed to open")
    got = ours_client.receive_data(b"".join(theirs_server.data_to_send()))
    assert got == [Pong(b"hi"), data, Closed(4010, "sealed frame failed to open")]
    # Our echo of its close completes its closing handshake.
    theirs_server.receive_data(ours_client.data_to_send())
    assert theirs_server.close_rcvd is not None and theirs_server.close_rcvd.code == 4010

    ours_server = WsFrames(client=False, max_size=MAX)
    theirs_client = Protocol(Side.CLIENT, state=State.OPEN, max_size=MAX)
    theirs_client.send_binary(data)
    assert ours_server.receive_data(b"".join(theirs_client.data_to_send())) == [data]
    theirs_client.receive_data(ours_server.send_binary(data))
    assert [e.data for e in theirs_client.events_received()] == [data]


def test_masks_are_fresh_per_frame() -> None:
    client = WsFrames(client=True, max_size=MAX)
    masks = {client.send_binary(b"x")[2:6] for _ in range(3000)}  # crosses a pool refill
    assert len(masks) > 2990


def test_a_ping_flood_owes_one_pong_the_latest() -> None:
    client = WsFrames(client=True, max_size=MAX)
    pings = b"".join(_frame(0x89, str(i).encode()) for i in range(10_000))
    assert client.receive_data(pings) == []
    server = WsFrames(client=False, max_size=MAX)
    assert server.receive_data(client.data_to_send()) == [Pong(b"9999")]
    assert client.data_to_send() == b""


def test_empty_fragments_do_not_pile_up() -> None:
    client = WsFrames(client=True, max_size=MAX)
    frames = _frame(0x02, b"a") + _frame(0x00, b"") * 50_000 + _frame(0x80, b"b")
    assert client.receive_data(frames[:-3]) == []
    assert bytes(client._frag) == b"a"  # one buffer of the bytes so far, no list of parts
    assert client.receive_data(frames[-3:]) == [b"ab"]


def test_nothing_follows_our_close_frame_not_even_a_held_pong() -> None:
    client = WsFrames(client=True, max_size=MAX)
    client.receive_data(_frame(0x89, b"ping"))  # its pong is owed, not yet taken
    close = client.send_close(4006, "replaced")
    assert client.data_to_send() == b""
    server = WsFrames(client=False, max_size=MAX)
    assert server.receive_data(close) == [Closed(4006, "replaced")]


def test_an_unknown_opcode_is_a_protocol_error_whatever_length_it_announces() -> None:
    server = WsFrames(client=False, max_size=1000)
    with pytest.raises(WebSocketError) as caught:
        server.receive_data(bytes((0x83, 0xFF)) + struct.pack("!Q", 1 << 40) + b"abcd")
    assert caught.value.code == CLOSE_PROTOCOL_ERROR
