"""Tests for mcp_proxy.peer_pause: PAUSE once per session, RESUME once drained, over a
real FrameSender on the loopback transport pair (the frames the other end decodes)."""

from __future__ import annotations

import asyncio

from mcp_proxy.peer_pause import PeerPause
from mcp_proxy.transport import FrameSender, LoopbackTransport
from mcp_proxy.tunnel_wire import FrameKind, decode_frame


async def _pair() -> tuple[FrameSender, list[tuple[FrameKind, int]]]:
    a, b = LoopbackTransport.pair("did:a", "did:b")
    seen: list[tuple[FrameKind, int]] = []

    def receive(peer: str, payload: bytes) -> None:
        frame = decode_frame(payload)
        seen.append((frame.kind, frame.session))

    b.set_receiver(receive)
    return FrameSender(a, "did:b"), seen


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_pause_once_then_resume_when_drained() -> None:
    sender, seen = await _pair()
    drained = asyncio.get_running_loop().create_future()
    pause = PeerPause(lambda: sender, lambda sid: True)
    for _ in range(3):  # each delivery while the agent is behind asks again
        pause.pause(7, lambda: drained)
    await _settle()
    assert seen == [(FrameKind.PAUSE, 7)]
    drained.set_result(None)
    await _settle()
    assert seen == [(FrameKind.PAUSE, 7), (FrameKind.RESUME, 7)]
    pause.pause(7, lambda: asyncio.sleep(0))  # behind again: a new PAUSE
    await _settle()
    assert seen[2:] == [(FrameKind.PAUSE, 7), (FrameKind.RESUME, 7)]


async def test_a_new_attach_is_paused_again_and_resumed_by_the_running_wait() -> None:
    sender, seen = await _pair()
    drained = asyncio.get_running_loop().create_future()
    current = [1]
    pause = PeerPause(lambda: sender, lambda sid: sid == current[0])
    pause.pause(1, lambda: drained)
    current[0] = 2  # the session attached again under a new id
    pause.pause(2, lambda: drained)
    drained.set_result(None)
    await _settle()
    assert seen == [(FrameKind.PAUSE, 1), (FrameKind.PAUSE, 2), (FrameKind.RESUME, 2)]


async def test_no_resume_for_a_session_that_is_gone_or_cancelled() -> None:
    sender, seen = await _pair()
    gone = PeerPause(lambda: sender, lambda sid: False)
    gone.pause(3, lambda: asyncio.sleep(0))
    cancelled = PeerPause(lambda: sender, lambda sid: True)
    never = asyncio.get_running_loop().create_future()
    cancelled.pause(4, lambda: never)
    cancelled.cancel()
    await _settle()
    assert seen == [(FrameKind.PAUSE, 3), (FrameKind.PAUSE, 4)]
