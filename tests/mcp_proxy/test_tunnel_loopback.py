"""serve/connect proxy logic end to end over a loopback link, with the real everything_server."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
from collections.abc import AsyncIterator

import orjson
import pytest

from mcp_proxy import server as server_module
from mcp_proxy.audit import Auditor
from mcp_proxy.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    LINK_DOWN,
    PARSE_ERROR,
    TOO_MANY_IN_FLIGHT,
    TOOL_DENIED,
)
from mcp_proxy.policy import Policy
from mcp_proxy.transport import OWN_REPLIES_MAX
from mcp_proxy.tunnel_wire import FrameKind, encode_frame
from talos_sdk.did import did_from_public_key
from tests.mcp_proxy.loopback import (
    CLIENT_DID,
    EVERYTHING,
    SERVER_DID,
    Agent,
    MemorySink,
    Pair,
    bad_tool,
)
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


async def test_a_tool_that_falls_behind_pauses_its_own_caller_not_the_link() -> None:
    # Its stdin passing high water sends PAUSE for that session only: the agent's lines
    # wait, while another session of the same peer is served at once (the link keeps
    # being read); the tool reading again sends RESUME, and every line arrives in order.
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=bad_tool("nap")))
    slow, other = Agent(pair.client), Agent(pair.client)
    holds: list[bool] = []
    filler = "f" * 100_000

    async def fill() -> None:
        for i in range(40):  # 4 MB while the tool reads nothing, a line per stdin read
            await slow.notify("notifications/filler", {"i": i, "text": filler})
            await asyncio.sleep(0.01)

    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(TIMEOUT):
        stack.push_async_callback(pair.close)
        assert (await slow.request("nap", {"seconds": 3}))["result"] == {"read": 1}
        slow.session.on_hold = holds.append
        filling = asyncio.ensure_future(fill())
        stack.callback(filling.cancel)
        await until(lambda: slow.session.held, what="the slow session to be paused")
        assert (await other.request("ping"))["result"] == {"read": 1}
        assert not filling.done() and pair.server_end.held_frames == 0
        (busy,) = [s for s in pair.server.sessions.values() if s.sid == slow.session.sid]
        assert busy.proc is not None and busy.proc.backlog < 1024 * 1024
        await filling
        # PAUSE then RESUME, perhaps again while the tool catches up: ending resumed.
        assert holds[0] and not holds[-1] and all(a != b for a, b in itertools.pairwise(holds))
        assert (await slow.request("ping"))["result"] == {"read": 42}


async def test_a_held_line_whose_caller_leaves_is_never_sent() -> None:
    # A request held by PAUSE whose caller gives up (an HTTP client hanging up) frees its
    # id; one held when the session closes neither reopens the session nor starts a tool.
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=bad_tool("nap")))
    agent = Agent(pair.client)
    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(TIMEOUT):
        stack.push_async_callback(pair.close)
        assert (await agent.request("nap", {"seconds": 60}))["result"] == {"read": 1}
        session = agent.session
        filler = orjson.dumps({"jsonrpc": "2.0", "method": "n", "params": {"t": "f" * 100_000}})
        while not session.held:
            await session.from_agent(filler)
            await asyncio.sleep(0.01)
        ping = b'{"jsonrpc":"2.0","id":7,"method":"ping"}'
        waiting = asyncio.ensure_future(session.from_agent(ping))
        await until(lambda: 7 in session.pending, what="the request to be noted")
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        assert 7 not in session.pending  # the same id may be used again
        waiting = asyncio.ensure_future(session.from_agent(ping))
        await until(lambda: 7 in session.pending, what="the request to be noted again")
        session.close()
        await asyncio.wait_for(waiting, 5)
        await until(lambda: not pair.server.sessions, what="the session to end at serve")
        assert pair.server.started_processes == 1 and not session.attached


@pytest.mark.parametrize("bound", ["MAX_TOOL_BACKLOG", "MAX_PEER_BACKLOG"])
async def test_a_caller_that_ignores_pause_fails_its_session_only(
    monkeypatch: pytest.MonkeyPatch, bound: str
) -> None:
    # A caller that goes on sending after PAUSE (an old or a hostile one) gets its session
    # failed once the tool leaves MAX_TOOL_BACKLOG unread (or its peer's tools together
    # MAX_PEER_BACKLOG): bounded memory, a reason, and the next request starts a fresh tool.
    monkeypatch.setattr(server_module, bound, 512 * 1024)
    sink = MemorySink()
    auditor = Auditor(sink)
    await auditor.start()
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=bad_tool("nap")), auditor=auditor)
    agent = Agent(pair.client)
    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(TIMEOUT):
        stack.push_async_callback(pair.close)
        assert (await agent.request("nap", {"seconds": 60}))["result"] == {"read": 1}
        sid, sender = agent.session.sid, pair.client.sender
        filler = orjson.dumps({"jsonrpc": "2.0", "method": "n", "params": {"text": "f" * 100_000}})
        for _ in range(20):  # straight to the link, past the session's PAUSE
            sender.message(sid, filler)
        await until(lambda: not agent.session.attached, what="the session to fail")
        assert (await agent.request("ping"))["result"] == {"read": 1}
        await auditor.stop()
    (overrun,) = [r for r in sink.records if r.outcome == "overrun"]
    assert overrun.session == sid and "bytes of input unread" in overrun.detail


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
        # A closed session frees its place, once its tool has stopped.
        agents[0].session.close()
        await until(lambda: len(pair.server.sessions) == 1, what="the session to close")
        await until(lambda: not pair.server._stopping_of[CLIENT_DID], what="its tool to stop")
        assert "result" in await agents[2].initialize()


async def test_sessions_still_stopping_their_tools_count_against_the_limit() -> None:
    # An OPEN for an id in use replaces its session, whose tool stops in the background:
    # it no longer counted, so a storm of OPENs kept 116 tools that ignore SIGTERM alive
    # under a limit of 16 (a helper's attack run).
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=bad_tool("hang")))
    pair.server.max_sessions = 2
    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(TIMEOUT):
        stack.push_async_callback(pair.close)
        for _ in range(10):
            await pair.client_end.send(SERVER_DID, encode_frame(FrameKind.OPEN, 5, [b""]))
        await until(lambda: pair.server.started_processes == 2, what="two tools started")
        await asyncio.sleep(0.5)  # the others were refused, not started
        assert pair.server.started_processes == 2


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


async def test_requests_kept_in_flight_are_bounded_each_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each request in flight keeps its params for its record until it is answered: a
    # tool sitting on calls it reads, or a caller leaving the tool's sampling requests
    # unanswered, grew serve's memory without end (1.7 GB in 12 s). Past the bound the
    # next one is answered TOO_MANY_IN_FLIGHT, to whichever side sent it, and audited.
    monkeypatch.setattr(server_module, "MAX_IN_FLIGHT", 3)
    sink = MemorySink()
    auditor = Auditor(sink)
    await auditor.start()
    deaf = Pair(Policy.build(allow=[CLIENT_DID], command=bad_tool("deaf")), auditor=auditor)
    asker = Pair(Policy.build(allow=[CLIENT_DID], command=bad_tool("ask-flood")))
    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(TIMEOUT):
        stack.push_async_callback(auditor.stop)
        stack.push_async_callback(deaf.close)
        stack.push_async_callback(asker.close)
        agent = Agent(deaf.client)
        waits = [agent.start_request("ping")[1] for _ in range(5)]
        for rid in range(101, 106):
            await agent.send_raw(orjson.dumps({"jsonrpc": "2.0", "id": rid, "method": "ping"}))
        refused = [await w for w in waits[3:]]  # the tool answers nothing at all
        assert {r["error"]["code"] for r in refused} == {TOO_MANY_IN_FLIGHT}
        assert not any(w.done() for w in waits[:3])
        await until(lambda: [r.outcome for r in sink.records].count("too-many") == 2)
        agent = Agent(asker.client)
        assert "result" in await agent.request("ping")
        await until(lambda: len(agent.other) == 3, what="three of the tool's asks")
        (session,) = asker.server.sessions.values()
        await asyncio.sleep(0.3)  # the other seven were answered to the tool, not kept
        assert len(agent.other) == 3 and len(session.asks) == 3


@pytest.mark.parametrize("mode", ["bad-utf8", "close-stdout"])
async def test_a_tool_whose_answer_cannot_come_fails_the_call(mode: str) -> None:
    # A reply with bytes that are not UTF-8 had no id anyone could read, and a tool that
    # closed its stdout and ran on could answer nothing: either way the call waited for
    # ever. Now the reply's id is read leniently and the call answered "malformed", and
    # a tool whose output closed is killed after STDOUT_CLOSED_WAIT, its calls answered.
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=bad_tool(mode)))
    agent = Agent(pair.client)
    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(TIMEOUT):
        stack.push_async_callback(pair.close)
        reply = await agent.request("ping")
        assert reply["error"]["code"] == INTERNAL_ERROR
        why = "malformed" if mode == "bad-utf8" else "closed its output and kept running"
        assert why in reply["error"]["message"], reply


async def test_the_id_of_a_cancelled_request_is_not_reused_while_the_tool_may_answer() -> None:
    # Cancel id 8, then send a new request as 8: the tool may still answer the first
    # (MCP lets it), and that answer went to the second request, in its audit record too.
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=bad_tool("nap")))
    agent = Agent(pair.client)
    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(TIMEOUT):
        stack.push_async_callback(pair.close)
        assert (await agent.request("nap", {"seconds": 1}))["result"] == {"read": 1}
        ping = orjson.dumps({"jsonrpc": "2.0", "id": 8, "method": "ping"})
        _, again = agent.start_request("ping")  # id 101, not sent: only its future
        agent.waiters[8] = again
        await agent.send_raw(ping)  # waits in the tool's input while it naps
        await agent.notify("notifications/cancelled", {"requestId": 8})
        await agent.send_raw(ping)
        reply = await again
        assert reply["error"]["code"] == INVALID_REQUEST, reply
        assert "already in use" in reply["error"]["message"]
        await asyncio.sleep(1.5)  # the tool wakes and answers the first 8: dropped
        assert all(m.get("id") != 8 for m in agent.other), agent.other


async def test_empty_part_frames_are_refused_and_keep_nothing(pair: Pair) -> None:
    """An empty PART piece is a bad frame: dropped, nothing kept toward the joiner's bound,
    and the session goes on."""
    agent = Agent(pair.client)
    async with asyncio.timeout(TIMEOUT):
        await agent.initialize()
        await agent.request("ping")  # the initialized notification is taken before the frames
        (session,) = pair.server.sessions.values()
        line = orjson.dumps({"jsonrpc": "2.0", "method": "notifications/roots/list_changed"})

        async def frame(kind: FrameKind, piece: bytes) -> None:
            await pair.client_end.send(SERVER_DID, encode_frame(kind, session.sid, [piece]))

        for _ in range(1000):
            await frame(FrameKind.PART, b"")
        await frame(FrameKind.PART, line[:10])
        await until(lambda: session.joiner._parts != [], what="the piece")
        assert session.joiner._parts == [line[:10]]
        await frame(FrameKind.MESSAGES, line[10:])
        await until(lambda: session.joiner._parts == [], what="the message joined")
        assert text_of(await agent.call("echo", text="after")) == "after"
