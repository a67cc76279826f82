"""``talos-proxy`` as a user runs it: any stdout/stdin, structured logs, clean stops.

Real ``serve`` and ``connect`` processes on 127.0.0.1, driven with JSON-RPC
lines; their stderr is parsed as log lines (key=value or JSON) for fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pty
import shlex
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.mcp_proxy.e2e import ENV, PROXY, REPO, did_of, proxy, serving

TIMEOUT = 120

INIT: dict[str, Any] = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "test_proxy_cli", "version": "1"},
    },
}
REQUESTS: list[dict[str, Any]] = [
    INIT,
    {"jsonrpc": "2.0", "method": "notifications/initialized"},
    {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
    {
        "jsonrpc": "2.0",
        "id": 3,
        "method": "tools/call",
        "params": {"name": "echo", "arguments": {"text": "through a file"}},
    },
]


def request_lines(requests: list[dict[str, Any]] = REQUESTS) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in requests)


def check_responses(out: bytes) -> None:
    """The three answers of REQUESTS, one JSON object per line, nothing else."""
    replies = {r["id"]: r for r in map(orjson.loads, out.splitlines())}
    assert sorted(replies) == [1, 2, 3], out
    assert replies[1]["result"]["serverInfo"]["name"]
    assert "echo" in {t["name"] for t in replies[2]["result"]["tools"]}
    assert replies[3]["result"]["content"][0]["text"] == "through a file"


# --- log lines -------------------------------------------------------------------------------


def parse_kv(line: str) -> dict[str, str]:
    """One ``key=value`` log line (talos/logging.py KeyValueFormatter) as a dict."""
    lexer = shlex.shlex(line, posix=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    lexer.escapedquotes = '"'
    return dict(token.split("=", 1) for token in lexer)


def log_events(text: str) -> list[dict[str, Any]]:
    """Every log line of a stderr (kv or JSON); banner lines (``talos-proxy: ...``) skipped."""
    events = []
    for line in text.splitlines():
        if line.startswith("{"):
            events.append(json.loads(line))
        elif line.startswith("ts="):
            events.append(parse_kv(line))
    return events


def warnings_of(text: str) -> list[str]:
    """Lines at WARNING or above, in either format or as a bare message."""
    bad = [
        e
        for e in log_events(text)
        if e["level"] in ("warning", "error", "critical") and e["event"] != "identity_unencrypted"
    ]
    bare = [
        ln for ln in text.splitlines() if "Traceback" in ln or ln.startswith(("WARNING", "ERROR"))
    ]
    return [str(e) for e in bad] + bare


# --- connect as a process ----------------------------------------------------------------------


def connect_args(home: Path, address: str, *extra: str) -> list[str]:
    return ["connect", "--home", str(home), "--peer", address, "--no-passphrase", *extra]


def connect_argv(home: Path, address: str, *extra: str) -> list[str]:
    return [*PROXY, *connect_args(home, address, *extra)]


def loop_env(loop: str) -> dict[str, str]:
    return {**ENV, "TALOS_NO_UVLOOP": "1" if loop == "asyncio" else "0"}


def run_connect(argv: list[str], stdin: Any, stdout: Any, env: dict[str, str]) -> str:
    """Run connect to its end (its stdin ends by itself); return its stderr."""
    res = subprocess.run(
        argv, stdin=stdin, stdout=stdout, stderr=subprocess.PIPE, cwd=REPO, env=env, timeout=TIMEOUT
    )
    err = res.stderr.decode("utf-8", "replace")
    assert res.returncode == 0, err
    return err


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_connect_stdin_and_stdout_regular_files(tmp_path: Path, loop: str) -> None:
    """``connect < requests.jsonl > out.jsonl``: every response lands in the file, in full."""
    client_did = did_of(tmp_path / "c")
    (tmp_path / "req.jsonl").write_bytes(request_lines())
    async with asyncio.timeout(TIMEOUT), serving(tmp_path / "s", ["--allow", client_did]) as serve:
        argv = connect_argv(tmp_path / "c", serve.address)
        with (
            (tmp_path / "req.jsonl").open("rb") as fin,
            (tmp_path / "out.jsonl").open("wb") as fout,
        ):
            err = await asyncio.to_thread(run_connect, argv, fin, fout, loop_env(loop))
    check_responses((tmp_path / "out.jsonl").read_bytes())
    assert warnings_of(err) == []


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_connect_stdout_dev_null_and_stdin_dev_null(tmp_path: Path, loop: str) -> None:
    client_did = did_of(tmp_path / "c")
    (tmp_path / "req.jsonl").write_bytes(request_lines())
    async with asyncio.timeout(TIMEOUT), serving(tmp_path / "s", ["--allow", client_did]) as serve:
        argv = connect_argv(tmp_path / "c", serve.address, "--log-level", "debug")
        with (tmp_path / "req.jsonl").open("rb") as fin:
            err = await asyncio.to_thread(
                run_connect, argv, fin, subprocess.DEVNULL, loop_env(loop)
            )
        # The requests went through the tunnel and were answered (into /dev/null).
        assert any(e["event"] == "tunnel_link_up" for e in log_events(err))
        assert warnings_of(err) == []
        # Nothing on stdin at all: a clean, prompt end.
        err = await asyncio.to_thread(
            run_connect, argv, subprocess.DEVNULL, subprocess.DEVNULL, loop_env(loop)
        )
        assert warnings_of(err) == []


@contextlib.contextmanager
def socket_stdout() -> Iterator[tuple[int, socket.socket]]:
    ours, theirs = socket.socketpair()
    try:
        yield theirs.fileno(), ours
    finally:
        ours.close()
        theirs.close()


@contextlib.contextmanager
def terminal_stdout() -> Iterator[tuple[int, int]]:
    reader, writer = pty.openpty()
    try:
        yield writer, reader
    finally:
        os.close(reader)
        os.close(writer)


async def read_replies(read: Any, count: int) -> bytes:
    """``count`` lines from a socket or a terminal's master side (which turns \\n into \\r\\n)."""
    got = b""
    while got.count(b"\n") < count:
        chunk = await asyncio.to_thread(read)
        assert chunk, f"stdout ended early: {got!r}"
        got += chunk
    return got.replace(b"\r\n", b"\n")


@pytest.mark.parametrize("kind", ["socket", "terminal"])
async def test_connect_stdout_socket_or_terminal(tmp_path: Path, kind: str) -> None:
    client_did = did_of(tmp_path / "c")
    async with asyncio.timeout(TIMEOUT), serving(tmp_path / "s", ["--allow", client_did]) as serve:
        with socket_stdout() if kind == "socket" else terminal_stdout() as (fd, ours):
            proc = await proxy(*connect_args(tmp_path / "c", serve.address), stdout=fd)
            assert proc.stdin is not None and proc.stderr is not None
            proc.stdin.write(request_lines())
            await proc.stdin.drain()
            if isinstance(ours, socket.socket):
                out = await read_replies(lambda: ours.recv(65536), 3)
            else:
                out = await read_replies(lambda: os.read(ours, 65536), 3)
            proc.stdin.close()
            err = (await proc.stderr.read()).decode()
            assert await proc.wait() == 0, err
    check_responses(out)
    assert warnings_of(err) == []


# --- refusals in the logs, both sides ----------------------------------------------------------


@contextlib.asynccontextmanager
async def connect_process(
    home: Path, address: str, *extra: str
) -> AsyncIterator[asyncio.subprocess.Process]:
    proc = await proxy(*connect_args(home, address, *extra))
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 30)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize(("serve_format", "connect_format"), [("json", "kv"), ("kv", "json")])
async def test_refusal_names_did_code_and_reason_on_both_sides(
    tmp_path: Path, serve_format: str, connect_format: str
) -> None:
    client_did = did_of(tmp_path / "c")
    someone_else = did_of(tmp_path / "other")
    args = ["--allow", someone_else, "--log-format", serve_format]
    async with asyncio.timeout(TIMEOUT), serving(tmp_path / "s", args) as serve:
        serve_did = serve.address.split("#", 1)[1]
        extra = ("--log-format", connect_format, "--link-wait", "5")
        async with connect_process(tmp_path / "c", serve.address, *extra) as proc:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(request_lines([INIT]))
            await proc.stdin.drain()
            reply = orjson.loads(await proc.stdout.readline())  # an error, never a hang
            assert reply["id"] == 1 and reply["error"]["code"] < 0
            proc.stdin.close()
            assert proc.stderr is not None
            connect_err = (await proc.stderr.read()).decode()
    serve_events = log_events(serve.log)
    connect_events = log_events(connect_err)
    if serve_format == "json":
        assert all(line.startswith(("{", "talos-proxy:")) for line in serve.log.splitlines())
    # The refusing side names the caller's DID, the close code and the reason.
    refused = [e for e in serve_events if e["event"] == "link_refused"]
    assert refused, serve.log
    assert refused[0]["level"] == "warning"
    assert refused[0]["peer"] == client_did
    assert str(refused[0]["code"]) == "4003"
    assert refused[0]["reason"]
    # The refused side names the serve side's DID, the code and the reason it was given.
    told = [e for e in connect_events if e.get("peer") == serve_did and "code" in e]
    assert told, connect_err
    assert str(told[0]["code"]) == "4003" and told[0]["reason"]
    assert told[0]["level"] == "warning"


# --- a clean stop is quiet ---------------------------------------------------------------------


async def test_clean_stop_of_serve_and_connect_logs_no_warning(tmp_path: Path) -> None:
    client_did = did_of(tmp_path / "c")
    async with (
        asyncio.timeout(TIMEOUT),
        serving(tmp_path / "s", ["--allow", client_did, "--log-level", "debug"]) as serve,
    ):
        async with connect_process(tmp_path / "c", serve.address, "--log-level", "debug") as proc:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(request_lines())
            await proc.stdin.drain()
            out = b"".join([await proc.stdout.readline() for _ in range(3)])
            proc.stdin.close()  # how an MCP client ends a stdio server
            assert proc.stderr is not None
            connect_err = (await proc.stderr.read()).decode()
            assert await proc.wait() == 0, connect_err
        check_responses(out)
        # The agent's stop ended its tool session on the serve side, quietly.
    assert await serve.stop() == 0
    assert warnings_of(connect_err) == []
    assert warnings_of(serve.log) == []
    assert any(e["event"] == "tool_exited" for e in log_events(serve.log)), serve.log


async def test_connect_stopped_by_signal_logs_no_warning(tmp_path: Path) -> None:
    client_did = did_of(tmp_path / "c")
    async with (
        asyncio.timeout(TIMEOUT),
        serving(tmp_path / "s", ["--allow", client_did]) as serve,
        connect_process(tmp_path / "c", serve.address) as proc,
    ):
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(request_lines())
        await proc.stdin.drain()
        for _ in range(3):
            await proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        assert proc.stderr is not None
        connect_err = (await proc.stderr.read()).decode()
        assert await proc.wait() == 0, connect_err
    assert warnings_of(connect_err) == []
    assert warnings_of(serve.log) == []


def test_audit_of_a_home_with_no_records_says_where_they_are(tmp_path: Path) -> None:
    home = tmp_path / "agent"
    did_of(home)  # a connect side's home: it keeps no audit of its own
    done = subprocess.run(
        [*PROXY, "audit", "--home", str(home)],
        capture_output=True, text=True, timeout=60, cwd=REPO, env=ENV,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout == ""
    assert "no audit records" in done.stderr and "talos-proxy serve" in done.stderr
