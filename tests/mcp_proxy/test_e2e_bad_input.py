"""Bad input through real processes: ``talos-proxy connect`` (stdio and ``--http``) and
``talos-proxy serve`` subprocesses on 127.0.0.1, real tools (tests/tools/bad_server.py reads
lines like the MCP SDK; everything_server is an MCP SDK server), ``talos-proxy audit``.

Each case checks the three promises of ADR 0003: the caller gets exactly one clear
JSON-RPC reply per request, the tool never sees an unjudged message, the audit log says
what happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson

from mcp_proxy.connect_stdio import STDIO_LINE_LIMIT
from mcp_proxy.jsonrpc import INTERNAL_ERROR, INVALID_REQUEST, PARSE_ERROR, TOOL_DENIED
from tests.mcp_proxy.e2e import Serve, did_of, http_connect, proxy, serving

TIMEOUT = 120
BASE = b'{"jsonrpc":"2.0","id":%d,"method":"tools/list","params":{"x":[1,"a"],"y":{"z":null}}}'
HIDDEN = b'{"jsonrpc":"2.0","id":777,"method":"tools/call","params":{"name":"crash"}}'


def bad_tool(mode: str) -> list[str]:
    return [sys.executable, "-m", "tests.tools.bad_server", mode]


class StdioAgent:
    """A raw agent on ``talos-proxy connect``'s stdin/stdout: bytes in, parsed lines out."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.proc, self.stdin, self.stdout = proc, proc.stdin, proc.stdout

    async def send(self, line: bytes) -> None:
        self.stdin.write(line + b"\n")
        await self.stdin.drain()

    async def recv(self) -> dict[str, Any]:
        line = await self.stdout.readline()
        assert line.endswith(b"\n") and b"\r" not in line, line
        reply: dict[str, Any] = orjson.loads(line)
        return reply

    async def request(self, line: bytes) -> dict[str, Any]:
        await self.send(line)
        return await self.recv()


@contextlib.asynccontextmanager
async def stdio_agent(home: Path, address: str) -> AsyncIterator[StdioAgent]:
    proc = await proxy("connect", "--home", str(home), "--peer", address, stderr=subprocess.DEVNULL)
    try:
        yield StdioAgent(proc)
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        with contextlib.suppress(TimeoutError):
            # Read what is left (a test may have stopped reading): connect can then exit,
            # and the pipe reaches its end and closes.
            await asyncio.wait_for(asyncio.gather(proc.stdout.read(), proc.wait()), 20)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def audit_of(home: Path, *filters: str) -> list[dict[str, Any]]:
    proc = await proxy("audit", "--home", str(home), "--json", *filters, stdin=subprocess.DEVNULL)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return [orjson.loads(line) for line in out.splitlines()]


def seen(reply: dict[str, Any]) -> list[Any]:
    return list(reply["result"]["seen"])


async def test_cr_and_lf_at_every_position_over_stdio(tmp_path: Path) -> None:
    client_did = did_of(tmp_path / "c")
    args = ["--allow", client_did, "--tools", "echo"]
    judged: list[Any] = []
    async with (
        asyncio.timeout(TIMEOUT),
        serving(tmp_path / "s", args, bad_tool("record")) as serve,
        stdio_agent(tmp_path / "c", serve.address) as agent,
    ):
        for i in range(1, len(BASE % 1000)):
            rid = 1000 + i
            base = BASE % rid
            line = base[:i] + b"\r" + base[i:]
            reply = await agent.request(line)
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                # Inside a string or a number a raw CR is not JSON: refused, one error.
                assert reply["error"]["code"] == PARSE_ERROR and reply["id"] is None
                continue
            judged.append(obj)
            assert reply["id"] == obj["id"]
            assert seen(reply) == judged  # the tool read exactly the judged messages, in order
        # LF ends a stdio line: each piece is judged on its own, the hidden call is denied.
        await agent.send(b'{"jsonrpc":"2.0","id":5,"method":"tools/list","params":{"x":')
        await agent.send(HIDDEN)
        await agent.send(b"}}")
        # Parse errors are answered by connect itself, the denial by serve: any order.
        replies = [await agent.recv() for _ in range(3)]
        codes = sorted((str(r["id"]), r["error"]["code"]) for r in replies)
        assert codes == [("777", TOOL_DENIED), ("None", PARSE_ERROR), ("None", PARSE_ERROR)]
        last = await agent.request(b'{"jsonrpc":"2.0","id":"end","method":"ping"}')
        assert seen(last)[:-1] == judged  # nothing else reached the tool
    audit = await audit_of(tmp_path / "s", "--tool", "crash")
    assert [(a["event"], a["outcome"], a["id"]) for a in audit] == [("call", "denied", 777)]


async def test_a_line_over_the_stdio_limit_is_refused_whole(tmp_path: Path) -> None:
    """The bytes after the limit are still that line: its tail never runs as a call."""
    client_did = did_of(tmp_path / "c")
    tail = b'{"jsonrpc":"2.0","id":778,"method":"tools/call","params":{"name":"echo"}}'
    async with (
        asyncio.timeout(TIMEOUT),
        serving(tmp_path / "s", ["--allow", client_did], bad_tool("record")) as serve,
        stdio_agent(tmp_path / "c", serve.address) as agent,
    ):
        await agent.send(b" " * (STDIO_LINE_LIMIT + (1 << 20)) + tail)
        refused = await agent.recv()
        assert refused["id"] is None and refused["error"]["code"] == INVALID_REQUEST
        last = await agent.request(b'{"jsonrpc":"2.0","id":"end","method":"ping"}')
        assert last["id"] == "end" and seen(last)[:-1] == []  # the tool saw nothing else


async def test_a_tool_reply_with_raw_cr_reaches_the_agent_as_one_line(tmp_path: Path) -> None:
    client_did = did_of(tmp_path / "c")
    async with (
        asyncio.timeout(TIMEOUT),
        serving(tmp_path / "s", ["--allow", client_did], bad_tool("cr-reply")) as serve,
        stdio_agent(tmp_path / "c", serve.address) as agent,
    ):
        reply = await agent.request(b'{"jsonrpc":"2.0","id":1,"method":"ping"}')
        hidden = reply["result"]["x"]
        assert reply["id"] == 1 and hidden["error"]["message"] == "h"  # nested, not a message
        # Exactly one line came for it: the next request's reply is the next line.
        assert (await agent.request(b'{"jsonrpc":"2.0","id":2,"method":"ping"}'))["id"] == 2


async def test_dying_and_garbled_tools_give_one_clear_error_per_request(tmp_path: Path) -> None:
    client_did = did_of(tmp_path / "c")
    init = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}'
    call = b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"x"}}'
    cases = {
        "crash-mid-call": "tool process exited (code 7)",
        "huge-line": f"tool output line above {16 * 1024 * 1024} bytes",
        "exit-at-start": "tool process exited (code 4)",
        "garbage": "malformed response",
    }
    for mode, reason in cases.items():
        home = tmp_path / mode
        async with (
            asyncio.timeout(TIMEOUT),
            serving(home, ["--allow", client_did], bad_tool(mode)) as serve,
            stdio_agent(tmp_path / "c", serve.address) as agent,
        ):
            first = await agent.request(init)
            if mode == "exit-at-start":
                assert first["id"] == 1 and reason in first["error"]["message"]
                replies = [first]
            else:
                assert first["id"] == 1
                replies = [await agent.request(call)]
                assert replies[0]["id"] == 2 and replies[0]["error"]["code"] == INTERNAL_ERROR
                assert reason in replies[0]["error"]["message"], (mode, replies)
            # Whatever else the tool or the tunnel did, the next line is the next reply.
            after = await agent.request(b'{"jsonrpc":"2.0","id":3,"method":"ping"}')
            assert after["id"] == 3
        audit = await audit_of(home)
        outcomes = {(a["event"], a["method"], a["outcome"]) for a in audit}
        assert ("session", "open", "ok") in outcomes, (mode, outcomes)
        if mode == "garbage":
            assert ("call", "tools/call", "malformed") in outcomes
        else:
            assert ("session", "exit", "exited") in outcomes, (mode, outcomes)
            exited = [a for a in audit if a["outcome"] == "tool-exited"]
            assert exited and all(reason in a["detail"] for a in exited), (mode, audit)


async def test_cr_and_lf_at_every_position_over_http(tmp_path: Path) -> None:
    import httpx2

    client_did = did_of(tmp_path / "c")
    async with (
        asyncio.timeout(TIMEOUT),
        serving(tmp_path / "s", ["--allow", client_did], bad_tool("record")) as serve,
        http_connect(tmp_path / "c", serve.address) as (url, token),
    ):
        headers = {
            "Authorization": f"Bearer {token}",
            "Accept": "application/json, text/event-stream",
            "Content-Type": "application/json",
        }
        async with httpx2.AsyncClient(headers=headers, timeout=60) as http:
            init = await http.post(url, content=b'{"jsonrpc":"2.0","id":0,"method":"initialize"}')
            headers["Mcp-Session-Id"] = init.headers["Mcp-Session-Id"]
            judged: list[Any] = [{"jsonrpc": "2.0", "id": 0, "method": "initialize"}]
            for brk in (b"\r", b"\n", b"\r\n"):
                for i in range(1, len(BASE % 1000)):
                    rid = 1000 + i
                    base = BASE % rid
                    body = base[:i] + brk + base[i:]
                    reply = await http.post(url, content=body, headers=headers)
                    try:
                        obj = orjson.loads(body)
                    except orjson.JSONDecodeError:
                        assert reply.status_code == 400
                        assert reply.json()["error"]["code"] == PARSE_ERROR
                        continue
                    judged.append(obj)
                    (message,) = http_messages(reply)
                    assert message["id"] == rid and seen(message) == judged


def http_messages(reply: Any) -> list[dict[str, Any]]:
    """The JSON-RPC messages of a POST's answer: a JSON body or an SSE stream."""
    if reply.headers["Content-Type"].startswith("application/json"):
        assert b"\r" not in reply.content and b"\n" not in reply.content.rstrip(b"\n")
        return [orjson.loads(reply.content)]
    return sse_messages(reply.content)


def sse_messages(body: bytes) -> list[dict[str, Any]]:
    """The JSON-RPC messages of an SSE body; each event's data is one line (no raw CR/LF)."""
    out = []
    for event in body.split(b"\n\n"):
        lines = [ln for ln in event.split(b"\n") if ln]
        if not lines:
            continue
        assert lines[0] == b"event: message" and lines[1].startswith(b"data: "), event
        assert len(lines) == 2 and b"\r" not in lines[1], event
        out.append(orjson.loads(lines[1][6:]))
    return out


FLOOD_CALL = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x"}}'


async def _stalled(agent: StdioAgent, counter: Path) -> int:
    """Ask the flood tool for its lines and read none: how many it wrote before it stalled."""
    from tests.tools.bad_server import FLOOD_BYTES, FLOOD_LINES

    def written() -> int:
        raw = counter.read_bytes() if counter.exists() else b""
        return int(raw) if raw.strip() else 0

    await agent.send(FLOOD_CALL)
    last, still = -1, 0
    while still < 20 and last < FLOOD_LINES:
        await asyncio.sleep(0.1)
        now = written()
        still = still + 1 if now == last else 0
        last = now
    bound = 24 * 1024 * 1024 // FLOOD_BYTES  # pipes, socket buffers, one sender's queue
    assert 0 < last < bound, f"the tool wrote {last} of {FLOOD_LINES} lines unread"
    return last


@contextlib.asynccontextmanager
async def _flooded(tmp_path: Path) -> AsyncIterator[tuple[Serve, StdioAgent]]:
    """connect, serve and the flood tool on 127.0.0.1, with the agent's call stalled unread."""
    client_did = did_of(tmp_path / "c")
    counter = tmp_path / "written"
    flood = [*bad_tool("flood"), str(counter)]
    async with (
        serving(tmp_path / "s", ["--allow", client_did], flood) as serve,
        stdio_agent(tmp_path / "c", serve.address) as agent,
    ):
        await _stalled(agent, counter)
        yield serve, agent


async def test_an_agent_that_stops_reading_pauses_the_tool_and_loses_nothing(
    tmp_path: Path,
) -> None:
    """Backpressure end to end: connect asks serve to pause the session (PAUSE) while its
    stdout is full, serve stops reading the tool, so nobody buffers what the agent does not
    take; the link itself keeps being read."""
    from tests.tools.bad_server import FLOOD_LINES

    async with asyncio.timeout(TIMEOUT), _flooded(tmp_path) as (_, agent):
        # The agent reads again: every line arrives, then the response.
        notes = 0
        while True:
            reply = await agent.recv()
            if reply.get("id") == 1:
                break
            assert reply["method"] == "notifications/message"
            notes += 1
        assert notes == FLOOD_LINES and reply["result"] == {"lines": FLOOD_LINES}


async def test_serve_stops_cleanly_with_a_paused_tool(tmp_path: Path) -> None:
    """A session whose tool output is paused still ends: serve exits on SIGTERM in time."""
    async with asyncio.timeout(TIMEOUT), _flooded(tmp_path) as (serve, _):
        assert await serve.stop() == 0, serve.log  # not killed after its 15 s grace


async def test_an_agent_faster_than_its_tool_waits_and_loses_nothing(tmp_path: Path) -> None:
    """Flow control the other way: the tool naps while the agent writes 4 MB; serve
    pauses the session (PAUSE), connect stops reading the agent's stdin until RESUME,
    and every line reaches the tool, in order."""
    client_did = did_of(tmp_path / "c")
    async with (
        asyncio.timeout(TIMEOUT),
        serving(tmp_path / "s", ["--allow", client_did], bad_tool("nap")) as serve,
        stdio_agent(tmp_path / "c", serve.address) as agent,
    ):
        nap = b'{"jsonrpc":"2.0","id":1,"method":"nap","params":{"seconds":2}}'
        assert (await agent.request(nap))["result"] == {"read": 1}
        filler = b'{"jsonrpc":"2.0","method":"notifications/f","params":{"t":"%s"}}'
        for _ in range(40):
            await agent.send(filler % (b"f" * 100_000))
        ping = b'{"jsonrpc":"2.0","id":2,"method":"ping"}'
        assert (await agent.request(ping)) == {"jsonrpc": "2.0", "id": 2, "result": {"read": 42}}
