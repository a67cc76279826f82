"""serve/connect proxy logic end to end over a loopback link, with the real everything_server."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator

import orjson
import pytest

from mcp_proxy.audit import Auditor
from mcp_proxy.jsonrpc import INTERNAL_ERROR, INVALID_REQUEST, LINK_DOWN, PARSE_ERROR, TOOL_DENIED
from mcp_proxy.policy import Policy
from mcp_proxy.transport import OWN_REPLIES_MAX
from talos_sdk.did import did_from_public_key
from tests.mcp_proxy.loopback import CLIENT_DID, EVERYTHING, Agent, MemorySink, Pair
from tests.talos.nodes import until

TIMEOUT = 30


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    p = Pair(Policy.build(allow=[CLIENT_DID], command=EVERYTHING))
    try:
        yield p
    finally:
        await p.close()


def text_of(reply: dict[str, object]) -> str:
    result = reply["result"]
    assert isinstance(result, dict)
    return str(result["content"][0]["text"])


async def test_initialize_list_call(pair: Pair) -> None:
    agent = Agent(pair.client)
    async with asyncio.timeout(TIMEOUT):
        init = await agent.initialize()
        assert init["result"]["serverInfo"]["name"] == "everything"
        tools = await agent.request("tools/list")
        names = {t["name"] for t in tools["result"]["tools"]}
        assert {"echo", "add", "crash", "sample"} <= names
        assert text_of(await agent.call("add", a=2, b=40)) == "42"
        assert (await agent.request("ping"))["result"] == {}


async def test_64_pipelined_calls_coalesce(pair: Pair) -> None:
    agent = Agent(pair.client)
    async with asyncio.timeout(TIMEOUT):
        await agent.initialize()
        frames_before = pair.client_end.sent_frames
        results = await asyncio.gather(*(agent.call("add", a=i, b=1000) for i in range(64)))
    assert [text_of(r) for r in results] == [str(i + 1000) for i in range(64)]
    # 64 requests left in fewer frames than messages: the sender coalesced the queue.
    assert pair.client_end.sent_frames - frames_before < 64


async def test_denied_tool_and_filtered_list() -> None:
    sink = MemorySink()
    auditor = Auditor(sink)
    await auditor.start()
    pair = Pair(
        Policy.build(allow=[CLIENT_DID], tools=["echo"], command=EVERYTHING), auditor=auditor
    )
    agent = Agent(pair.client)
    try:
        async with asyncio.timeout(TIMEOUT):
            await agent.initialize()
            tools = await agent.request("tools/list")
            assert [t["name"] for t in tools["result"]["tools"]] == ["echo"]
            denied = await agent.call("crash", code=9)
            assert denied["error"]["code"] == TOOL_DENIED
            assert denied["error"]["message"] == f"tool 'crash' not allowed for {CLIENT_DID}"
            # The tool never saw it: the process is still alive and answers.
            assert text_of(await agent.call("echo", text="still here")) == "still here"
            await auditor.stop()
    finally:
        await pair.close()
    outcomes = [(r.method, r.tool, r.outcome) for r in sink.records]
    assert ("tools/call", "crash", "denied") in outcomes
    assert ("tools/call", "echo", "ok") in outcomes
    assert all(r.caller == CLIENT_DID for r in sink.records)
    echo = next(r for r in sink.records if r.tool == "echo")
    assert len(echo.params_hmac) == 32 and len(echo.result_hmac) == 32
    assert echo.plaintext == b""


async def test_malformed_from_agent_gets_errors_and_session_survives(pair: Pair) -> None:
    agent = Agent(pair.client)
    async with asyncio.timeout(TIMEOUT):
        await agent.initialize()
        await agent.send_raw(b"{this is not json")
        assert (await agent.inbox.get())["error"]["code"] == PARSE_ERROR
        await agent.send_raw(b'{"jsonrpc":"2.0","id":5,"method":7}')
        bad = await agent.inbox.get()
        assert (bad["id"], bad["error"]["code"]) == (5, INVALID_REQUEST)
        assert text_of(await agent.call("echo", text="ok")) == "ok"


async def test_tool_crash_errors_pending_and_next_request_gets_fresh_process(pair: Pair) -> None:
    agent = Agent(pair.client)
    async with asyncio.timeout(TIMEOUT):
        await agent.initialize()
        pid1 = text_of(await agent.call("pid"))
        crashed = await agent.call("crash", code=3)
        assert crashed["error"] == {
            "code": INTERNAL_ERROR,
            "message": "tool process exited (code 3)",
        }
        # The next request reopens the session; the agent's initialize is replayed.
        pid2 = text_of(await agent.call("pid"))
    assert pid1 != pid2
    assert pair.server.started_processes == 2


async def test_link_drop_errors_pending_then_reconnects(pair: Pair) -> None:
    agent = Agent(pair.client)
    async with asyncio.timeout(TIMEOUT):
        await agent.initialize()
        pid1 = text_of(await agent.call("pid"))
        rid, fut = agent.start_request("tools/call")
        await agent.send_raw(
            b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":'
            b'{"name":"slow","arguments":{"steps":50,"delay":0.1}}}' % rid
        )
        pair.client_end.set_link(False)
        dropped = await fut
        assert dropped["error"]["code"] == LINK_DOWN
        # The server side ended the session's tool process with the link.
        while pair.server.sessions:
            await asyncio.sleep(0.01)
        pair.client_end.set_link(True)
        pid2 = text_of(await agent.call("pid"))
    assert pid1 != pid2


async def test_link_down_too_long_answers_with_link_error() -> None:
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=EVERYTHING), link_wait=0.05)
    agent = Agent(pair.client)
    try:
        pair.client_end.set_link(False)
        async with asyncio.timeout(TIMEOUT):
            reply = await agent.request("ping")
        assert reply["error"]["code"] == LINK_DOWN
        assert pair.server.started_processes == 0
    finally:
        await pair.close()


async def test_unauthorised_peer_refused_and_tool_never_started() -> None:
    pair = Pair(Policy.build(allow=[did_from_public_key(b"E" * 32)], command=EVERYTHING))
    agent = Agent(pair.client)
    try:
        async with asyncio.timeout(TIMEOUT):
            reply = await agent.request("ping")
        assert reply["error"]["code"] == INTERNAL_ERROR
        assert "not allowed" in reply["error"]["message"]
        assert pair.server.started_processes == 0
    finally:
        await pair.close()


async def test_tool_that_fails_to_start() -> None:
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=["/nonexistent/tool"]))
    agent = Agent(pair.client)
    try:
        async with asyncio.timeout(TIMEOUT):
            reply = await agent.request("ping")
        assert reply["error"]["code"] == INTERNAL_ERROR
        assert "tool process exited (code 127)" in reply["error"]["message"]
    finally:
        await pair.close()


async def test_malformed_tool_output_is_attributed() -> None:
    bad = [sys.executable, "-m", "tests.tools.bad_server", "garbage"]
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=bad))
    agent = Agent(pair.client)
    try:
        async with asyncio.timeout(TIMEOUT):
            reply = await agent.request("ping")
        # The bad server sends garbage, then a response with neither result nor error for
        # the id: that one is attributable and becomes an error for the caller.
        assert reply["error"]["code"] == INTERNAL_ERROR
        assert "malformed response" in reply["error"]["message"]
    finally:
        await pair.close()


async def test_progress_and_sampling_forwarded(pair: Pair) -> None:
    agent = Agent(pair.client)
    async with asyncio.timeout(TIMEOUT):
        await agent.initialize()
        rid, fut = agent.start_request("tools/call")
        await agent.send_raw(
            b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"slow",'
            b'"arguments":{"steps":3,"delay":0.01},"_meta":{"progressToken":"tok-1"}}}' % rid
        )
        reply = await fut
        progress = [m for m in agent.other if m.get("method") == "notifications/progress"]
        assert [p["params"]["progressToken"] for p in progress] == ["tok-1"] * 3
        assert text_of(reply) == "done 3"

        rid, fut = agent.start_request("tools/call")
        await agent.send_raw(
            b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"sample",'
            b'"arguments":{"prompt":"hi"}}}' % rid
        )
        ask = await agent.inbox.get()
        while ask.get("method") != "sampling/createMessage":
            ask = await agent.inbox.get()
        await agent.send_raw(
            b'{"jsonrpc":"2.0","id":%s,"result":{"role":"assistant","model":"m",'
            b'"content":{"type":"text","text":"from the model"}}}'
            % (
                b'"%s"' % ask["id"].encode()
                if isinstance(ask["id"], str)
                else str(ask["id"]).encode()
            )
        )
        assert text_of(await fut) == "from the model"


async def test_cancellation_is_forwarded_and_audited() -> None:
    sink = MemorySink()
    auditor = Auditor(sink)
    await auditor.start()
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=EVERYTHING), auditor=auditor)
    agent = Agent(pair.client)
    try:
        async with asyncio.timeout(TIMEOUT):
            await agent.initialize()
            rid, _fut = agent.start_request("tools/call")
            await agent.send_raw(
                b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":'
                b'{"name":"slow","arguments":{"steps":100,"delay":0.05}}}' % rid
            )
            await agent.notify("notifications/cancelled", {"requestId": rid, "reason": "user"})
            assert rid not in agent.session.pending
            # The tool keeps serving the session after the cancelled call.
            assert text_of(await agent.call("echo", text="after")) == "after"
            await auditor.stop()
    finally:
        await pair.close()
    cancelled = [r for r in sink.records if r.request_id == rid]
    assert [(r.tool, r.outcome) for r in cancelled] == [("slow", "cancelled")]


async def test_split_messages_cross_and_an_oversize_one_fails_the_session() -> None:
    # Small link frames both ways, so ordinary calls already travel in PART pieces.
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=EVERYTHING), max_payload=1000)
    agent = Agent(pair.client)
    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(TIMEOUT):
        stack.push_async_callback(pair.close)
        await agent.initialize()
        long_text = "z" * 5000
        assert text_of(await agent.call("echo", text=long_text)) == long_text
        (session,) = pair.server.sessions.values()
        proc = session.proc
        assert proc is not None
        session.joiner.limit = 3000
        reply = await agent.call("echo", text=long_text)
        assert reply["error"]["code"] == INTERNAL_ERROR
        assert reply["error"]["message"] == "tunnel message above 3000 bytes"
        assert pair.server.sessions == {}
        assert await proc.wait() is not None  # its tool process was stopped
        # The next call opens a fresh session that carries big messages again.
        assert text_of(await agent.call("echo", text=long_text)) == long_text


async def test_tools_call_sent_as_a_notification_never_reaches_the_tool() -> None:
    # Without an id, a tools/call skipped the policy and went straight to the tool.
    sink = MemorySink()
    auditor = Auditor(sink)
    await auditor.start()
    recorder = [sys.executable, "-m", "tests.tools.bad_server", "record"]
    pair = Pair(Policy.build(allow=[CLIENT_DID], tools=["echo"], command=recorder), auditor=auditor)
    agent = Agent(pair.client)
    try:
        async with asyncio.timeout(TIMEOUT):
            await agent.initialize()
            for tool in ("crash", "echo"):  # a denied tool and an allowed one
                await agent.notify("tools/call", {"name": tool, "arguments": {}})
            await agent.notify("notifications/progress", {"progressToken": 1, "progress": 1})
            seen = (await agent.request("ping"))["result"]["seen"]
            await auditor.stop()
    finally:
        await pair.close()
    assert [m["method"] for m in seen] == [
        "initialize",
        "notifications/initialized",
        "notifications/progress",
        "ping",
    ]
    refused = [(r.tool, r.outcome) for r in sink.records if r.method == "tools/call"]
    assert refused == [("crash", "refused-notification"), ("echo", "refused-notification")]


async def test_a_tool_that_stops_reading_pauses_the_link() -> None:
    # The tool's stdin buffer stays bounded; frames wait in the link instead.
    deaf = [sys.executable, "-m", "tests.tools.bad_server", "deaf"]
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=deaf))
    agent = Agent(pair.client)
    filler = "f" * 100_000
    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(TIMEOUT):
        stack.push_async_callback(pair.close)
        await agent.notify("notifications/hello")  # opens the session and starts the tool
        await until(
            lambda: (
                any(s.proc and s.proc.alive for s in pair.server.sessions.values())
                and all(q.empty() for q in pair.server._inbox.values())
            ),
            what="the session to be up",
        )
        for i in range(40):  # 4 MB the tool never reads, on the hot path
            await agent.notify("notifications/filler", {"i": i, "text": filler})
        await until(lambda: pair.server_end.held_frames > 0, what="the link to pause")
        (session,) = pair.server.sessions.values()
        proc = session.proc
        assert proc is not None and not proc.writable
        stdin = proc._stdin
        assert stdin is not None
        # High water (64 KiB by default) plus at most the one frame that crossed it.
        assert stdin.get_write_buffer_size() <= 64 * 1024 + 256 * 1024
        # The tool going away releases the wait, and the held frames are read (and dropped).
        await proc.terminate()
        await until(lambda: pair.server_end.held_frames == 0, what="the link to resume")


async def test_sessions_per_peer_are_capped() -> None:
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=EVERYTHING))
    pair.server.max_sessions = 2
    agents = [Agent(pair.client) for _ in range(3)]
    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(TIMEOUT):
        stack.push_async_callback(pair.close)
        for agent in agents[:2]:
            await agent.initialize()
        refused = await agents[2].request("initialize", {"protocolVersion": "2025-06-18"})
        assert refused["error"]["code"] == INTERNAL_ERROR
        assert refused["error"]["message"] == (f"too many sessions: {CLIENT_DID} holds 2 (limit 2)")
        assert pair.server.started_processes == 2
        # A closed session frees its place.
        agents[0].session.close()
        await until(lambda: len(pair.server.sessions) == 1, what="the session to close")
        assert "result" in await agents[2].initialize()


async def test_a_caller_that_reads_nothing_cannot_queue_denials_without_bound() -> None:
    """Denials are the proxy's own replies: past OWN_REPLIES_MAX unread they are dropped."""
    pair = Pair(Policy.build(allow=[CLIENT_DID], tools=["echo"], command=EVERYTHING))
    agent = Agent(pair.client)
    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(TIMEOUT):
        stack.push_async_callback(pair.close)
        await agent.initialize()
        # From here the caller's end takes nothing: every frame toward it waits in serve.
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        deliver_nowait, deliver = pair.server_end.send_nowait, pair.server_end.send

        async def stalled(peer: str, payload: bytes) -> None:
            await gate
            await deliver(peer, payload)

        pair.server_end.send_nowait = lambda peer, payload: False  # type: ignore[method-assign]
        pair.server_end.send = stalled  # type: ignore[method-assign]
        sender = pair.server.sender_for(CLIENT_DID)
        (session,) = pair.server.sessions.values()
        for _ in range(3):  # 6 MiB of an honest tool's output waiting: no reason to drop
            sender.message(session.sid, b"o" * (2 << 20))
        agent.start_request("tools/call")
        await agent.send_raw(
            b'{"jsonrpc":"2.0","id":9999,"method":"tools/call","params":{"name":"nope"}}'
        )
        await until(lambda: sender._own_backlog > 0, what="the denial to be queued")
        assert sender.pressed and pair.server.own_replies_dropped == 0
        name = "x" * 20_000  # each denial names the tool: about 20 KB a reply
        for i in range(600):  # 12 MB of denials if all were kept
            agent.start_request("tools/call")
            await agent.send_raw(
                orjson.dumps({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                              "params": {"name": name, "arguments": {}}})
            )  # fmt: skip
        await until(lambda: pair.server.own_replies_dropped > 0, what="denials to be dropped")
        assert sender._queued <= 6 * (2 << 20) // 2 + OWN_REPLIES_MAX + 64 * 1024
        # The caller reads again: what was queued arrives, and the session still works.
        pair.server_end.send_nowait, pair.server_end.send = deliver_nowait, deliver  # type: ignore[method-assign]
        gate.set_result(None)
        assert text_of(await agent.call("echo", text="after")) == "after"
