"""A 2025-11-25 HTTP session's memory: one replay budget for all its streams, a bounded backlog."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest

import mcp_proxy.http_legacy as legacy
import mcp_proxy.http_sse as sse
from mcp_proxy.http_legacy import LegacySession
from mcp_proxy.policy import Policy
from tests.mcp_proxy.loopback import CLIENT_DID, EVERYTHING, Pair


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=EVERYTHING))
    try:
        yield pair
    finally:
        await pair.close()


@pytest.fixture
async def session(pair: Pair) -> LegacySession:
    return LegacySession(pair.client)


def note(i: int, size: int = 100) -> bytes:
    """A notification of about ``size`` bytes."""
    head = orjson.dumps({"jsonrpc": "2.0", "method": "notifications/message", "params": {"i": i}})
    return head[:-2] + b',"pad":"' + b"p" * (size - len(head) - 9) + b'"}}'


async def test_all_streams_of_a_session_share_one_replay_budget(
    monkeypatch: pytest.MonkeyPatch, pair: Pair
) -> None:
    monkeypatch.setattr(sse, "REPLAY_BYTES", 350)
    session = LegacySession(pair.client)
    streams = [session.new_exchange() for _ in range(4)]
    for i, stream in enumerate(streams):
        stream.emit(note(2 * i))
        stream.emit(note(2 * i + 1))  # 800 bytes in all, each stream alone under the bound
    assert session.replay.kept <= 350
    # The oldest streams gave theirs up; the newest keeps both of its events.
    assert [len(s.events) for s in streams] == [0, 0, 1, 2]
    # A forgotten stream gives its bytes back.
    session.forget(streams[3])
    assert session.replay.kept == len(note(5))
    # One message above the whole budget still stays resumable on its own stream.
    big = session.new_exchange()
    big.emit(note(9, size=1000))
    assert [seq for seq, _ in big.events] == [1] and session.replay.kept == 1000


async def test_a_stream_replaced_by_newer_ones_gives_its_bytes_back(session: LegacySession) -> None:
    first = session.new_exchange()
    first.emit(note(1))
    for _ in range(legacy.KEPT_EXCHANGES):
        session.new_exchange()
    assert first.key not in session.exchanges and session.replay.kept == 0


async def test_the_backlog_for_a_get_keeps_the_newest_within_its_bytes(
    monkeypatch: pytest.MonkeyPatch, session: LegacySession
) -> None:
    monkeypatch.setattr(legacy, "BACKLOG_BYTES", 250)
    for i in range(5):
        session.deliver(note(i))  # nobody listens: kept for the next GET
    assert len(session.backlog) == 2 and session.backlog_bytes == 200
    queue, _ = session.attach_get(None)
    got = [orjson.loads(queue.get_nowait()[1])["params"]["i"] for _ in range(2)]  # type: ignore[index]
    assert got == [3, 4] and session.backlog_bytes == 0


async def test_a_stream_replaced_while_still_live_keeps_no_replay(session: LegacySession) -> None:
    live = session.new_exchange()  # a long call, still sending progress
    for _ in range(legacy.KEPT_EXCHANGES):
        session.new_exchange()
    live.emit(note(1))  # evicted, yet live: it keeps nothing, counts nothing
    assert session.replay.kept == 0 and not live.events
    session.forget(live)
    assert session.replay.kept == 0
