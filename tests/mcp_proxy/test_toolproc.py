"""Tests for mcp_proxy.toolproc against real subprocesses."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import orjson
import pytest

from mcp_proxy import toolproc
from mcp_proxy.jsonrpc import INTERNAL_ERROR
from mcp_proxy.policy import ServerSpec
from mcp_proxy.toolproc import EXIT_SPAWN_FAILED, ToolProcess

INIT = orjson.dumps(
    {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "0"},
        },
    }
)


def bad(mode: str) -> ServerSpec:
    return ServerSpec(command=sys.executable, args=("-m", "tests.tools.bad_server", mode))


class Recorder:
    def __init__(self) -> None:
        self.lines: list[dict[str, object]] = []
        self.exits: list[int] = []
        self.got = asyncio.Event()

    def on_line(self, line: bytes) -> None:
        self.lines.append(orjson.loads(line) if line.startswith(b"{") else {"raw": line.decode()})
        self.got.set()

    def on_exit(self, code: int) -> None:
        self.exits.append(code)


async def test_real_server_initialize_then_clean_terminate() -> None:
    rec = Recorder()
    spec = ServerSpec(command=sys.executable, args=("-m", "tests.tools.everything_server"))
    proc = ToolProcess(spec, rec.on_line, rec.on_exit)
    async with asyncio.timeout(20):
        await proc.start()
        proc.send(INIT, 1)
        await rec.got.wait()
        assert rec.lines[0]["id"] == 1 and "result" in rec.lines[0]
        assert proc.settle(1) and not proc.settle(1)
        code = await proc.terminate()
    assert rec.exits == [code]
    assert not proc.alive


async def test_spawn_failure_fails_pending_with_clear_error() -> None:
    rec = Recorder()
    proc = ToolProcess(ServerSpec(command="/nonexistent/tool"), rec.on_line, rec.on_exit)
    async with asyncio.timeout(5):
        await proc.start()
        assert rec.exits == [EXIT_SPAWN_FAILED]
        proc.send(INIT, 1)
    assert rec.lines == [
        {
            "jsonrpc": "2.0",
            "id": 1,
            "error": {"code": INTERNAL_ERROR, "message": "tool process exited (code 127)"},
        }
    ]


async def test_exit_at_start_and_crash_in_initialize() -> None:
    for mode, code in (("exit-at-start", 4), ("crash-in-initialize", 5)):
        rec = Recorder()
        proc = ToolProcess(bad(mode), rec.on_line, rec.on_exit)
        async with asyncio.timeout(10):
            await proc.start()
            proc.send(INIT, 1)
            assert await proc.wait() == code
        assert rec.exits == [code]
        errors = [m for m in rec.lines if "error" in m]
        assert errors == [
            {
                "jsonrpc": "2.0",
                "id": 1,
                "error": {"code": INTERNAL_ERROR, "message": f"tool process exited (code {code})"},
            }
        ]


async def test_garbage_lines_are_passed_up_not_fatal() -> None:
    rec = Recorder()
    proc = ToolProcess(bad("garbage"), rec.on_line, rec.on_exit)
    async with asyncio.timeout(10):
        await proc.start()
        proc.send(INIT, 1)
        while len(rec.lines) < 3:
            rec.got.clear()
            await rec.got.wait()
        assert rec.lines[0] == {"raw": "this is not json {"}
        assert rec.lines[2]["id"] == 1
        assert proc.alive
        await proc.terminate()


async def test_sigkill_after_grace_when_sigterm_ignored() -> None:
    rec = Recorder()
    proc = ToolProcess(bad("hang"), rec.on_line, rec.on_exit, grace=0.3)
    async with asyncio.timeout(10):
        await proc.start()
        await rec.got.wait()  # "ready": its SIGTERM handler is installed
        proc.send(INIT, 7)
        code = await proc.terminate()
    assert code == -9
    assert rec.lines[0] == {"raw": "ready"}
    assert rec.lines[1]["error"] == {
        "code": INTERNAL_ERROR,
        "message": "tool process exited (code -9)",
    }


async def test_held_lines_reach_the_tool_in_order_once_released() -> None:
    rec = Recorder()
    spec = ServerSpec(command=sys.executable, args=("-m", "tests.tools.everything_server"))
    proc = ToolProcess(spec, rec.on_line, rec.on_exit)
    async with asyncio.timeout(20):
        await proc.start()
        proc.send(INIT, 1)
        await rec.got.wait()
        proc.send(orjson.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}))
        proc.hold()
        for i in range(2, 12):
            proc.send(orjson.dumps({"jsonrpc": "2.0", "id": i, "method": "ping"}), i)
        await asyncio.sleep(0.2)
        assert not answered(rec)  # held: nothing written yet, so nothing answered
        proc.release()
        while len(answered(rec)) < 10:
            rec.got.clear()
            await rec.got.wait()
        await proc.terminate()
    assert [m["id"] for m in answered(rec)] == list(range(2, 12))


def answered(rec: Recorder) -> list[dict[str, object]]:
    """The replies to the pings (ids 2..), in arrival order; the tool's notifications aside."""
    return [m for m in rec.lines if m.get("id", 0) not in (0, 1) and "result" in m]


async def test_terminate_while_the_spawn_is_under_way_stops_the_process() -> None:
    """A link lost just after a session opened: the spawn finishes after the terminate began."""
    rec = Recorder()
    spec = ServerSpec(command=sys.executable, args=("-c", "import time; time.sleep(60)"))
    proc = ToolProcess(spec, rec.on_line, rec.on_exit, grace=0.5)
    async with asyncio.timeout(20):
        starting = asyncio.ensure_future(proc.start())
        await asyncio.sleep(0)  # start() is now waiting for the spawn
        code = await proc.terminate()
        await starting
    pid = proc.pid
    assert pid is not None and code != EXIT_SPAWN_FAILED and rec.exits == [code]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        pass  # gone, as it must be
    else:
        os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"the tool process {pid} outlived terminate()")


async def test_a_tool_writing_stderr_without_end_is_logged_a_bounded_number_of_lines(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each stderr line was one log event: 72k a second from one tool, serve at 100%
    # CPU and other peers' calls 47 times slower.
    monkeypatch.setattr(toolproc, "STDERR_LINES", 20)
    rec = Recorder()
    flood = "import sys\nfor i in range(3000): sys.stderr.write(f'noise {i}\\n')\n"
    spec = ServerSpec(command=sys.executable, args=("-c", flood))
    proc = ToolProcess(spec, rec.on_line, rec.on_exit)
    with caplog.at_level(logging.INFO, logger="mcp_proxy"):
        async with asyncio.timeout(20):
            await proc.start()
            while proc.alive:
                await asyncio.sleep(0.05)
    lines = [r for r in caplog.records if r.getMessage() == "tool_stderr"]
    assert 1 <= len(lines) <= 20, len(lines)
