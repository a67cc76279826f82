"""``talosd mcp``'s stdio bounds (talos/agent_mcp/stdio.py), on a real ``talosd mcp``
process over plain pipes: an oversize line, and a client that reads no answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

from talos.agent_mcp.stdio import MAX_IN_FLIGHT, MAX_LINE
from tests.talos.agent_mcp.test_talosd_mcp import _raw_status, init, raw_mcp


@contextlib.asynccontextmanager
async def _serving(root: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """A fresh home's ``talosd mcp`` on raw pipes, initialized; stdin closed at the end."""
    init(root / "n")
    proc = await raw_mcp(root / "n")
    assert proc.stdin is not None and proc.stdout is not None
    try:
        await _raw_status(proc)
        yield proc
    finally:
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 60)


def _peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def test_a_line_above_the_bound_is_answered_and_never_held(tmp_path: Path) -> None:
    # 64 MiB without a newline, then a ping: the line is read past in pieces (the SDK's
    # own reader held all of it, and more as text), answered -32600, and the ping after it.
    async with _serving(tmp_path) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        before = _peak_rss(proc.pid)
        piece = b"x" * (1 << 20)
        for _ in range(64):
            proc.stdin.write(piece)
            await proc.stdin.drain()
        proc.stdin.write(b'\n{"jsonrpc":"2.0","id":9,"method":"ping"}\n')
        await proc.stdin.drain()
        async with asyncio.timeout(60):
            first = json.loads(await proc.stdout.readline())
            second = json.loads(await proc.stdout.readline())
        assert first["id"] is None and first["error"] == {
            "code": -32600,
            "message": f"message above {MAX_LINE} bytes",
        }
        assert second == {"jsonrpc": "2.0", "id": 9, "result": {}}
        assert _peak_rss(proc.pid) - before < 40 * 1024 * 1024


async def test_a_client_that_reads_no_answers_stops_being_read(tmp_path: Path) -> None:
    # 10,000 requests and no reading: once MAX_IN_FLIGHT wait behind a full stdout (and
    # as many again are held), stdin is not read either (the SDK's reader took 20,000 in
    # 8.7 s here, a task each: peak 258 MB against 95 MB); reading the answers lets
    # every request through, each answered once.
    count = 10_000
    assert count > 10 * MAX_IN_FLIGHT  # far more than are ever read ahead
    async with _serving(tmp_path) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        before = _peak_rss(proc.pid)
        for i in range(count):
            proc.stdin.write(b'{"jsonrpc":"2.0","id":%d,"method":"prompts/list"}\n' % (100 + i))
        writing = asyncio.ensure_future(proc.stdin.drain())
        done, _ = await asyncio.wait([writing], timeout=6)
        assert not done, "stdin was read on although no answer was"
        assert _peak_rss(proc.pid) - before < 40 * 1024 * 1024
        ids: list[int] = []
        async with asyncio.timeout(120):
            while len(ids) < count:
                ids.append(json.loads(await proc.stdout.readline())["id"])
            await writing
        assert sorted(ids) == list(range(100, 100 + count))


async def test_a_request_with_an_id_mcp_does_not_allow_is_answered(tmp_path: Path) -> None:
    # The SDK reads a request whose id is a float, an object, null or a boolean as a
    # notification and never answers it; valid JSON that is no JSON-RPC message is an
    # Invalid Request (-32600), not a Parse error. Each gets one error, id null.
    async with _serving(tmp_path) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        for rid in (b"1.5", b'{"a":1}', b"null", b"true"):
            proc.stdin.write(b'{"jsonrpc":"2.0","id":%s,"method":"ping"}\n' % rid)
        proc.stdin.write(b'{"id":7,"method":"ping"}\n')  # no "jsonrpc"
        proc.stdin.write(b'{"jsonrpc":"2.0","id":8,"method":"ping"}\n')
        await proc.stdin.drain()
        async with asyncio.timeout(30):
            replies = [json.loads(await proc.stdout.readline()) for _ in range(6)]
        for reply in replies[:4]:
            assert reply["id"] is None and reply["error"]["code"] == -32600
            assert "string or an integer" in reply["error"]["message"]
        assert replies[4]["id"] is None and replies[4]["error"] == {
            "code": -32600,
            "message": "Invalid Request: not a JSON-RPC 2.0 message",
        }
        assert replies[5] == {"jsonrpc": "2.0", "id": 8, "result": {}}


def _long_poll(rid: int | str) -> bytes:
    call = {"name": "read_inbox", "arguments": {"wait_seconds": 60}}
    return json.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": call})


async def test_waiting_requests_can_be_cancelled_and_ids_are_not_reused(tmp_path: Path) -> None:
    # 300 long polls: MAX_IN_FLIGHT go to the server, the rest are held. Cancelling them
    # all, by ids written as strings (the SDK takes "7" for 7), still gets through while
    # full and frees every place; a ping is then answered at once. A second request
    # with an id still in use is refused (-32600), whatever the first one's form.
    count = MAX_IN_FLIGHT + 44
    async with _serving(tmp_path) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        for rid in range(1000, 1000 + count):
            proc.stdin.write(_long_poll(rid).encode() + b"\n")
        proc.stdin.write(_long_poll("1000").encode() + b"\n")  # 1000 is in flight
        await proc.stdin.drain()
        async with asyncio.timeout(30):
            refused = json.loads(await proc.stdout.readline())
            assert refused["id"] == "1000" and refused["error"] == {
                "code": -32600,
                "message": "Invalid Request: id already in use",
            }
            for rid in range(1000, 1000 + count):
                params = {"requestId": str(rid), "reason": "no longer needed"}
                note = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": params}
                proc.stdin.write(json.dumps(note).encode() + b"\n")
            proc.stdin.write(b'{"jsonrpc":"2.0","id":"p","method":"ping"}\n')
            await proc.stdin.drain()
            assert json.loads(await proc.stdout.readline()) == {
                "jsonrpc": "2.0",
                "id": "p",
                "result": {},
            }
