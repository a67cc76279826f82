"""The tunnel's rules over a loopback link with real tool processes: one line per message,
one response per request, one initialize per tool process, the audit story, tool environment."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator

import orjson
import pytest

from mcp_proxy.audit import Auditor, AuditRecord, Event
from mcp_proxy.jsonrpc import INTERNAL_ERROR, TOOL_DENIED
from mcp_proxy.policy import Policy
from tests.mcp_proxy.loopback import CLIENT_DID, EVERYTHING, Agent, MemorySink, Pair, bad_tool
from tests.talos.nodes import until

TIMEOUT = 60


@pytest.fixture
async def audited() -> AsyncIterator[tuple[Auditor, MemorySink]]:
    sink = MemorySink()
    auditor = Auditor(sink, commit_interval=0.001)
    await auditor.start()
    try:
        yield auditor, sink
    finally:
        await auditor.stop()


def seen_by_tool(reply: dict[str, object]) -> list[dict[str, object]]:
    result = reply["result"]
    assert isinstance(result, dict)
    seen = result["seen"]
    assert isinstance(seen, list)
    return seen


def events(sink: MemorySink, event: Event) -> Iterator[AuditRecord]:
    return (r for r in sink.records if r.event is event)


async def test_raw_cr_lf_never_reach_the_tool_as_line_breaks() -> None:
    pair = Pair(Policy.build(allow=[CLIENT_DID], tools=["echo"], command=bad_tool("record")))
    agent = Agent(pair.client)
    hidden = b'{"jsonrpc":"2.0","id":9001,"method":"tools/call","params":{"name":"crash"}}'
    try:
        async with asyncio.timeout(TIMEOUT):
            for i, brk in enumerate((b"\r", b"\n", b"\r\n")):
                rid, fut = agent.start_request("tools/list")
                await agent.send_raw(
                    b'{"jsonrpc":"2.0","id":%d,"method":"tools/list","params":{"x":%s%s%s}}'
                    % (rid, brk, hidden, brk)
                )
                seen = seen_by_tool(await fut)
                assert len(seen) == i + 1  # one message per message sent, nothing unparsed
                assert seen[-1] == {
                    "jsonrpc": "2.0",
                    "id": rid,
                    "method": "tools/list",
                    "params": {"x": orjson.loads(hidden)},
                }
    finally:
        await pair.close()


async def test_initialize_sent_while_the_link_is_down_reaches_the_tool_once() -> None:
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=bad_tool("record")))
    agent = Agent(pair.client)
    try:
        async with asyncio.timeout(TIMEOUT):
            pair.client_end.set_link(False)
            init = asyncio.create_task(agent.initialize())
            await until(lambda: bool(agent.session.pending), what="initialize to be pending")
            pair.client_end.set_link(True)
            await init
            methods = [m["method"] for m in seen_by_tool(await agent.request("ping"))]
            assert methods == ["initialize", "notifications/initialized", "ping"]
            # After a link loss the fresh tool process gets the handshake once, as a replay.
            pair.client_end.set_link(False)
            await until(lambda: not pair.server.sessions, what="the old session to end")
            pair.client_end.set_link(True)
            methods = [m["method"] for m in seen_by_tool(await agent.request("ping"))]
            assert methods == ["initialize", "notifications/initialized", "ping"]
        # The agent heard exactly one reply per request: none left over, no second initialize.
        assert agent.other == []
    finally:
        await pair.close()


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("huge-line", f"tool output line above {16 * 1024 * 1024} bytes; tool process exited"),
        ("crash-mid-call", "tool process exited (code 7)"),
    ],
)
async def test_a_dying_tool_answers_each_request_once_with_the_real_reason(
    mode: str, reason: str, audited: tuple[Auditor, MemorySink]
) -> None:
    auditor, sink = audited
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=bad_tool(mode)), auditor=auditor)
    agent = Agent(pair.client)
    try:
        async with asyncio.timeout(TIMEOUT):
            await agent.initialize()
            reply = await agent.request("tools/call", {"name": "anything"})
            assert reply["error"]["code"] == INTERNAL_ERROR
            assert reason in reply["error"]["message"]
            # The next request gets a fresh process and its own answer.
            again = await agent.request("tools/call", {"name": "anything"})
            assert reason in again["error"]["message"]
        assert agent.other == []  # no second error for either request
        await until(lambda: len(list(events(sink, Event.SESSION))) >= 6, what="session records")
    finally:
        await pair.close()
    exited = [r for r in events(sink, Event.CALL) if r.outcome == "tool-exited"]
    assert len(exited) == 2 and all(reason in r.detail for r in exited)
    exits = [r for r in events(sink, Event.SESSION) if r.method == "exit"]
    assert exits[0].outcome == "exited" and reason in exits[0].detail
    assert exits[0].pid is not None


async def test_the_audit_tells_the_whole_story(audited: tuple[Auditor, MemorySink]) -> None:
    from tests.mcp_proxy.test_tunnel_loopback import text_of

    auditor, sink = audited
    policy = Policy.build(allow=[CLIENT_DID], tools=["sample", "echo"], command=EVERYTHING)
    pair = Pair(policy, auditor=auditor)
    agent = Agent(pair.client)
    try:
        async with asyncio.timeout(TIMEOUT):
            await agent.initialize()
            rid, fut = agent.start_request("tools/call")
            await agent.send_raw(
                b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":'
                b'{"name":"sample","arguments":{"prompt":"hi"}}}' % rid
            )
            ask = await agent.inbox.get()  # the tool asks the caller's model
            assert ask["method"] == "sampling/createMessage"
            answer = {"role": "assistant", "content": {"type": "text", "text": "yo"}, "model": "m"}
            await agent.send_raw(
                orjson.dumps({"jsonrpc": "2.0", "id": ask["id"], "result": answer})
            )
            assert text_of(await fut) == "yo"
            # A response to nothing the tool asked is not forwarded (and is audited).
            await agent.send_raw(b'{"jsonrpc":"2.0","id":"never-asked","result":{}}')
            assert (await agent.call("crash", code=1))["error"]["code"] == TOOL_DENIED
            assert (await agent.call("echo", text="secret-argument"))["result"]
            agent.session.close()
            await until(lambda: not pair.server.sessions, what="the session to close")
            await until(
                lambda: any(r.method == "exit" for r in sink.records), what="the exit record"
            )
    finally:
        await pair.close()
    records = sink.records
    opened = next(r for r in records if r.event is Event.SESSION and r.method == "open")
    assert opened.caller == CLIENT_DID and opened.server == "default" and opened.pid is not None
    assert opened.detail == os.path.basename(EVERYTHING[0])
    request = next(events(sink, Event.REQUEST))
    assert (request.method, request.outcome) == ("sampling/createMessage", "ok")
    assert len(request.params_hmac) == 32 and len(request.result_hmac) == 32
    refusal = next(events(sink, Event.REFUSAL))
    assert (refusal.request_id, refusal.outcome) == ("never-asked", "unmatched-response")
    calls = {(r.tool, r.outcome) for r in events(sink, Event.CALL)}
    assert {("sample", "ok"), ("crash", "denied"), ("echo", "ok")} <= calls
    closed = [r.method for r in events(sink, Event.SESSION)]
    assert closed[-2:] == ["close", "exit"] or closed[-2:] == ["exit", "close"]
    # Arguments never appear in a commitment, only their keyed digest.
    assert all(b"secret-argument" not in r.commitment() for r in records)


async def test_tools_get_a_clean_environment() -> None:
    environ = {"PATH": os.environ["PATH"], "HOME": "/home/x", "SECRET_TOKEN": "s3", "KEEP": "k"}
    policy_file = None
    from mcp_proxy.policy import PolicyFile

    policy_file = PolicyFile.model_validate(
        {
            "servers": {
                "env": {
                    "command": bad_tool("env")[0],
                    "args": bad_tool("env")[1:],
                    "env": {"FROM_POLICY": "p"},
                    "pass_env": ["KEEP"],
                }
            },
            "peers": {CLIENT_DID: {}},
        }
    )
    for pass_all in (False, True):
        pair = Pair(
            Policy.build(policy_file=policy_file),
            env={"FROM_CLI": "c"},
            pass_environment=pass_all,
            environ=environ,
        )
        agent = Agent(pair.client)
        try:
            async with asyncio.timeout(TIMEOUT):
                env = (await agent.request("ping"))["result"]["env"]
        finally:
            await pair.close()
        env = {k: v for k, v in env.items() if k not in ("LC_CTYPE",)}  # set by the runtime
        expected = {"PATH": environ["PATH"], "HOME": "/home/x", "KEEP": "k"}
        expected |= {"FROM_CLI": "c", "FROM_POLICY": "p"}
        if pass_all:
            expected["SECRET_TOKEN"] = "s3"
        assert env == expected
