"""The connect side against a serving side that breaks the rules (mcp_proxy/client.py):
it ignores PAUSE, sends an enormous ERROR reason, or floods malformed and unasked
messages. Connect's memory, its agent's output and its log stay bounded. A real
TunnelClient on the loopback transport pair; the agent's stdout a real OS pipe."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator

import orjson
import pytest

from mcp_proxy.client import MAX_AGENT_BACKLOG, MAX_REMOTE_REASON, ClientSession, TunnelClient
from mcp_proxy.stdio import open_stdout
from mcp_proxy.transport import LoopbackTransport
from mcp_proxy.tunnel_wire import FrameKind, decode_frame, encode_frame
from tests.mcp_proxy.loopback import CLIENT_DID, SERVER_DID

TIMEOUT = 30.0


class Serve:
    """The serving end of the pair, played by hand: it sees connect's frames and sends its own."""

    def __init__(self) -> None:
        self.connect_end, self.end = LoopbackTransport.pair(CLIENT_DID, SERVER_DID)
        self.seen: list[tuple[FrameKind, int]] = []
        self.end.set_receiver(self._receive)
        self.end.max_payload = 2 << 20  # a node link carries frames up to its max_frame

    def _receive(self, peer: str, payload: bytes) -> None:
        frame = decode_frame(payload)
        self.seen.append((frame.kind, frame.session))

    def send(self, kind: FrameKind, sid: int, messages: list[bytes]) -> None:
        self.end.send_nowait(CLIENT_DID, encode_frame(kind, sid, messages))


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    yield Serve()


async def _requests(session: ClientSession, count: int) -> None:
    """``count`` tools/call requests of the agent (ids 1 to ``count``), sent to the serving side."""
    for i in range(1, count + 1):
        line = orjson.dumps(
            {"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {"name": "t"}}
        )
        await session.from_agent(line)
    session.client.sender.flush_now()
    await asyncio.sleep(0)


async def test_a_serve_that_ignores_pause_fails_its_session_at_the_bound(serve: Serve) -> None:
    client = TunnelClient(serve.connect_end, SERVER_DID, "tool")
    read_end, write_end = os.pipe()  # the agent's stdout, which the agent never reads
    out = await open_stdout(write_end)
    os.close(write_end)  # the writer holds its own duplicate
    try:
        session = client.open_session(
            lambda line: out.write(line + b"\n"),
            lambda lines: out.write(b"\n".join([*lines, b""])),
            out.backpressure,
            out.buffered,
        )
        await _requests(session, 1)
        sid = session.sid
        note = orjson.dumps(
            {"jsonrpc": "2.0", "method": "notifications/message", "params": {"data": "A" * 200_000}}
        )
        sent = 0
        async with asyncio.timeout(TIMEOUT):
            while (FrameKind.CLOSE, sid) not in serve.seen:
                assert sent < 2 * MAX_AGENT_BACKLOG, "connect took twice its bound"
                serve.send(FrameKind.MESSAGES, sid, [note])  # PAUSE or not
                sent += len(note)
                await asyncio.sleep(0)
        assert serve.seen.index((FrameKind.PAUSE, sid)) < serve.seen.index((FrameKind.CLOSE, sid))
        held = out.buffered()
        assert MAX_AGENT_BACKLOG < held < MAX_AGENT_BACKLOG + 2 * len(note)
        # The session is over: its pending request was answered, and what the serving
        # side goes on sending is not taken any more.
        assert not session.pending and not session.attached
        for _ in range(20):
            serve.send(FrameKind.MESSAGES, sid, [note])
        await asyncio.sleep(0.05)
        assert out.buffered() - held < 4096  # the error reply, nothing more
    finally:
        os.close(read_end)
        await out.aclose()


async def test_an_enormous_error_reason_is_cut_before_it_reaches_every_reply(
    serve: Serve,
) -> None:
    client = TunnelClient(serve.connect_end, SERVER_DID, "tool")
    replies: list[bytes] = []
    session = client.open_session(replies.append)
    await _requests(session, 256)
    serve.send(FrameKind.ERROR, session.sid, ["é".encode() * 500_000])  # 1 MB of reason
    await asyncio.sleep(0.05)
    assert len(replies) == 256
    for reply in replies:
        message = orjson.loads(reply)["error"]["message"]
        assert message.startswith("éé") and message.endswith("… (cut)")
        assert len(message) <= MAX_REMOTE_REASON + 10


@pytest.mark.parametrize(
    "bogus",
    [b"[]", b'{"jsonrpc":"2.0","id":0,"result":0}'],
    ids=["malformed", "unasked-reply"],
)
async def test_a_flood_of_bad_messages_is_logged_a_few_times_only(
    serve: Serve, bogus: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    client = TunnelClient(serve.connect_end, SERVER_DID, "tool")
    delivered: list[bytes] = []
    session = client.open_session(delivered.append)
    await _requests(session, 1)
    caplog.set_level(logging.WARNING, logger="mcp_proxy.client")
    for _ in range(20):
        serve.send(FrameKind.MESSAGES, session.sid, [bogus] * 10_000)
    for _ in range(5):  # and frames that do not decode
        serve.end.send_nowait(CLIENT_DID, b"\xff" * 40)
    await asyncio.sleep(0.05)
    assert not delivered and session.pending  # none of it reached the agent
    assert 2 <= len(caplog.records) <= 20, len(caplog.records)  # of 200,005 bad frames/messages
