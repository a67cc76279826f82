"""FrameSender over a real NodeTransport between two nodes on 127.0.0.1 (mcp_proxy/transport.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mcp_proxy.transport import (
    MAX_BATCH_BYTES,
    PRESSURE_HIGH,
    FrameSender,
    LinkDownError,
    LoopbackTransport,
    NodeTransport,
)
from mcp_proxy.tunnel_wire import FrameKind, Joiner, TunnelFrame, decode_frame, encode_frame
from talos.node import Node
from talos.pipeline import text_limit
from tests.talos.nodes import link, make_home, started, until

TIMEOUT = 20


class Ends:
    """A's sender to B, and the tunnel frames B received, in order."""

    def __init__(self, a: Node, b: Node) -> None:
        self.a, self.b = a, b
        self.received: list[TunnelFrame] = []
        NodeTransport(b).set_receiver(lambda peer, data: self.received.append(decode_frame(data)))
        self.sender = FrameSender(NodeTransport(a), b.did)

    def messages(self) -> list[bytes]:
        return [m for f in self.received for m in f.messages]


@pytest.fixture
async def ends(tmp_path: Path) -> AsyncIterator[Ends]:
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    try:
        async with asyncio.timeout(TIMEOUT):
            await link(a, b)
        e = Ends(a, b)
        yield e
        await e.sender.close()
    finally:
        await a.stop()
        await b.stop()


async def test_flush_now_sends_one_frame_from_the_call(ends: Ends) -> None:
    async with asyncio.timeout(TIMEOUT):
        for i in range(3):
            ends.sender.message(7, b"m%d" % i)
        ends.sender.flush_now()
        # Sent by the call itself, no loop pass: one frame carrying all three.
        assert ends.sender.frames_sent == 1
        await until(lambda: len(ends.received) == 1, what="one frame")
        assert ends.received[0] == TunnelFrame(FrameKind.MESSAGES, 7, (b"m0", b"m1", b"m2"))


async def test_a_burst_is_one_sealed_link_frame_and_a_replayed_batch_is_refused(
    ends: Ends,
) -> None:
    """One ratchet message and one link frame for a burst; its body replayed or forged opens not."""
    a, b = ends.a, ends.b
    link_ab = a.peer_state(b.did).link
    assert link_ab is not None
    async with asyncio.timeout(TIMEOUT):
        before = b.metrics.counters.get("app_frames_in", 0)
        sealed_before = link_ab.frames_sealed
        burst = [b'{"id":%d}' % i for i in range(200)]
        for line in burst:
            ends.sender.message(4, line)
        ends.sender.flush_now()
        assert link_ab.frames_sealed == sealed_before + 1  # one WebSocket send for the burst
        await until(lambda: len(ends.received) == 1, what="the burst")
        assert ends.received[0] == TunnelFrame(FrameKind.MESSAGES, 4, tuple(burst))
        assert b.metrics.counters.get("app_frames_in", 0) == before + 1
        # The ratchet message of a batch, sent again inside a fresh link frame (which
        # opens: the link is honest), or with one bit flipped: refused, nothing delivered.
        body = a.sessions.seal_app(b.did, "mcp", encode_frame(FrameKind.MESSAGES, 4, [b"once"]))
        await link_ab.send(b"\x30" + body)
        await until(lambda: len(ends.received) == 2, what="the sealed body once")
        assert ends.received[1].messages == (b"once",)
        forged = bytearray(body)
        forged[-1] ^= 1
        for bad in (body, bytes(forged)):
            await link_ab.send(b"\x30" + bad)
        await until(lambda: b.metrics.counters.get("frames_rejected", 0) == 2, what="refusals")
        # The link and the session carry on, in order.
        ends.sender.message(4, b"after")
        ends.sender.flush_now()
        await until(lambda: len(ends.received) == 3, what="the frame after")
        assert ends.received[2].messages == (b"after",)
        assert b.is_connected(a.did)


async def test_without_flush_now_the_queue_leaves_on_the_next_pass(ends: Ends) -> None:
    async with asyncio.timeout(TIMEOUT):
        ends.sender.message(1, b"a")
        ends.sender.control(FrameKind.CLOSE, 2)
        ends.sender.message(1, b"b")
        assert ends.sender.frames_sent == 0
        await ends.sender.flush()
        # Kinds and sessions are never mixed in one frame, and order is kept.
        assert ends.sender.frames_sent == 3
        await until(lambda: len(ends.received) == 3, what="three frames")
        assert [(f.kind, f.session) for f in ends.received] == [
            (FrameKind.MESSAGES, 1),
            (FrameKind.CLOSE, 2),
            (FrameKind.MESSAGES, 1),
        ]


async def test_a_busy_link_hands_over_to_a_task_that_coalesces_the_backlog(ends: Ends) -> None:
    peer_link = ends.a.peer_state(ends.b.did).link
    assert peer_link is not None
    async with asyncio.timeout(TIMEOUT):
        peer_link.ws.pause_writing()  # as the transport does above its high-water mark
        ends.sender.message(1, b"first")
        ends.sender.flush_now()
        assert ends.sender.frames_sent == 0  # refused inline: nothing sealed, a task waits
        await asyncio.sleep(0)
        for i in range(20):
            ends.sender.message(1, b"q%d" % i)
            ends.sender.flush_now()  # a no-op while the task owns the order
        peer_link.ws.resume_writing()
        await ends.sender.flush()
        await until(lambda: len(ends.messages()) == 21, what="21 messages")
        assert ends.messages() == [b"first"] + [b"q%d" % i for i in range(20)]
        # The backlog that built up meanwhile left as one frame behind the first.
        assert ends.sender.frames_sent == 2
        # Idle again: the next message goes out inline.
        ends.sender.message(1, b"after")
        ends.sender.flush_now()
        assert ends.sender.frames_sent == 3


async def test_a_frame_for_a_dropped_link_is_lost_not_raised() -> None:
    a, b = LoopbackTransport.pair("did:a", "did:b")
    got: list[bytes] = []
    b.set_receiver(lambda peer, data: got.extend(decode_frame(data).messages))
    sender = FrameSender(a, "did:b")
    async with asyncio.timeout(TIMEOUT):
        a.set_link(False)
        with pytest.raises(LinkDownError):
            a.send_nowait("did:b", b"x")
        sender.message(1, b"lost")
        sender.flush_now()  # logged, dropped: its session dies with the link
        assert sender.frames_sent == 0
        a.set_link(True)
        sender.message(1, b"kept")
        sender.flush_now()
        await sender.flush()
        await asyncio.sleep(0)
        assert got == [b"kept"]
        await sender.close()


async def test_a_message_above_the_transport_bound_leaves_in_pieces() -> None:
    a, b = LoopbackTransport.pair("did:a", "did:b")
    a.max_payload = 1000
    frames: list[TunnelFrame] = []
    b.set_receiver(lambda peer, data: frames.append(decode_frame(data)))
    sender = FrameSender(a, "did:b")
    big = bytes(range(256)) * 10  # 2560 bytes: three pieces
    async with asyncio.timeout(TIMEOUT):
        sender.message(1, b"before")
        sender.message(1, big)
        sender.message(1, b"after")
        sender.message(2, b"other")
        await sender.flush()
        await asyncio.sleep(0)
    # Every frame fits the bound (send_nowait raises above it); the pieces of session 1's
    # message are consecutive and its last piece travels with the message that followed.
    kinds = [(f.kind, f.session, len(f.messages)) for f in frames]
    assert kinds == [
        (FrameKind.MESSAGES, 1, 1),
        (FrameKind.PART, 1, 1),
        (FrameKind.PART, 1, 1),
        (FrameKind.MESSAGES, 1, 2),
        (FrameKind.MESSAGES, 2, 1),
    ]
    joiner = Joiner()
    for f in frames[1:3]:
        joiner.add_part(f.messages[0])
    assert joiner.messages(frames[3].messages) == (big, b"after")
    await sender.close()


async def test_many_small_messages_never_pass_the_bound_with_their_prefixes() -> None:
    a, b = LoopbackTransport.pair("did:a", "did:b")
    a.max_payload = 1000
    got: list[bytes] = []
    b.set_receiver(lambda peer, data: got.extend(decode_frame(data).messages))
    sender = FrameSender(a, "did:b")
    async with asyncio.timeout(TIMEOUT):
        for i in range(500):
            sender.message(1, b"%d" % i)
        await sender.flush()  # an oversize frame would raise in send_nowait and be lost
        await asyncio.sleep(0)
    assert got == [b"%d" % i for i in range(500)]
    await sender.close()


async def test_node_transport_bound_follows_the_link_frame_bound(ends: Ends) -> None:
    transport = NodeTransport(ends.a, app="other")
    assert ends.a.max_app_payload(ends.b.did) > MAX_BATCH_BYTES  # both 1 MiB: the cap holds
    assert transport.max_payload_for(ends.b.did) == MAX_BATCH_BYTES


async def test_node_transport_bound_is_the_peers_smaller_frame_bound(tmp_path: Path) -> None:
    """B takes 16 KiB frames: A's tunnel frames toward B stay within them, as PART pieces."""
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b", max_frame=16 * 1024))
    try:
        async with asyncio.timeout(TIMEOUT):
            await link(a, b)
            to_b = NodeTransport(a)
            assert to_b.max_payload_for(b.did) == text_limit(16 * 1024)
            joiner = Joiner(1 << 20)
            got: list[bytes] = []
            sizes: list[int] = []

            def receive(peer: str, data: bytes) -> None:
                sizes.append(len(data))
                frame = decode_frame(data)
                if frame.kind is FrameKind.PART:
                    joiner.add_part(frame.messages[0])
                else:
                    got.extend(joiner.messages(frame.messages))

            NodeTransport(b).set_receiver(receive)
            sender = FrameSender(to_b, b.did)
            big = bytes(range(256)) * 400  # 100 KiB: above B's bound, not above A's
            sender.message(3, big)
            await sender.flush()
            await until(lambda: got == [big], what="the message in pieces")
            assert max(sizes) <= text_limit(16 * 1024)
            assert b.metrics.counters.get("frames_rejected", 0) == 0
            await sender.close()
    finally:
        await a.stop()
        await b.stop()


async def test_a_receiver_awaitable_holds_the_node_read_loop(tmp_path: Path) -> None:
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    events: list[str] = []
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def receive(peer: str, data: bytes) -> asyncio.Future[None] | None:
        events.append(decode_frame(data).messages[0].decode())
        return gate if len(events) == 1 else None

    try:
        async with asyncio.timeout(TIMEOUT):
            await link(a, b)
            NodeTransport(b).set_receiver(receive)
            sender = FrameSender(NodeTransport(a), b.did)
            sender.message(1, b"first")
            sender.flush_now()
            sender.message(1, b"second")
            sender.flush_now()
            await until(lambda: events == ["first"], what="the first frame")
            events.append("released")
            gate.set_result(None)
            await until(lambda: len(events) == 3, what="the second frame")
            assert events == ["first", "released", "second"]
            await sender.close()
    finally:
        await a.stop()
        await b.stop()


class _Stalled:
    """A transport whose link takes nothing until ``gate`` opens (a peer not reading)."""

    def __init__(self) -> None:
        self.gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.sent = 0

    def max_payload_for(self, peer: str) -> int:
        return 256 * 1024

    def send_nowait(self, peer: str, payload: bytes) -> bool:
        return False

    async def send(self, peer: str, payload: bytes) -> None:
        await self.gate
        self.sent += 1


async def test_a_link_that_takes_nothing_presses_the_producers_until_it_drains() -> None:
    link = _Stalled()
    sender = FrameSender(link, "did:b")  # type: ignore[arg-type]
    pressure: list[bool] = []
    sender.on_pressure(pressure.append)
    chunk = bytes(64 * 1024)
    async with asyncio.timeout(TIMEOUT):
        for _ in range(PRESSURE_HIGH // len(chunk)):
            sender.message(1, chunk)
        assert pressure == []  # at the mark, not past it
        sender.message(1, chunk)
        assert pressure == [True] and sender.pressed
        sender.message(1, chunk)
        assert pressure == [True]  # told once
        link.gate.set_result(None)
        await sender.flush()
    assert pressure == [True, False] and not sender.pressed
    assert link.sent >= 1
    await sender.close()
