"""Helpers to run real ``talos-proxy serve`` / ``connect`` subprocesses on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters

REPO = Path(__file__).resolve().parents[2]
PROXY = [sys.executable, "-m", "mcp_proxy.cli"]
EVERYTHING = [sys.executable, "-m", "tests.tools.everything_server"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}


def did_of(home: Path) -> str:
    """``talos-proxy id --home`` (creates the identity when new)."""
    out = subprocess.run(
        [*PROXY, "id", "--home", str(home)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        cwd=REPO,
        env=ENV,
    )
    return out.stdout.strip()


def audit_verify(home: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``talos-proxy audit --home HOME --verify EXTRA...``, without $TALOS_PASSPHRASE: a
    sealed key is unlocked only when the test gives ``--passphrase-file``."""
    env = {k: v for k, v in ENV.items() if k != "TALOS_PASSPHRASE"}
    return subprocess.run(
        [*PROXY, "audit", "--home", str(home), "--verify", *extra],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env,
    )  # fmt: skip


async def proxy(
    *args: str,
    stdin: int = subprocess.PIPE,
    stdout: int = subprocess.PIPE,
    stderr: int = subprocess.PIPE,
) -> asyncio.subprocess.Process:
    """``talos-proxy ARGS`` from this tree (repo as cwd, the tests' environment)."""
    return await asyncio.create_subprocess_exec(
        *PROXY, *args, stdin=stdin, stdout=stdout, stderr=stderr, cwd=REPO, env=ENV
    )


class Serve:
    """A running ``talos-proxy serve``; its stderr is collected for assertions."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.address = ""
        self._ready = asyncio.Event()
        self._task = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            text = line.decode("utf-8", "replace").rstrip()
            self.lines.append(text)
            match = re.search(r"serving on (ws://\S+)", text)
            if match:
                self.address = match.group(1)
                self._ready.set()
        self._ready.set()

    async def ready(self) -> str:
        await self._ready.wait()
        if not self.address:
            raise RuntimeError("serve exited:\n" + "\n".join(self.lines))
        return self.address

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        try:
            code = await asyncio.wait_for(self.proc.wait(), 15)
        except TimeoutError:
            self.proc.kill()
            code = await self.proc.wait()
        await self._task
        return code


async def start_serve(
    home: Path, listen: str, args: Sequence[str], command: Sequence[str]
) -> Serve:
    proc = await proxy(
        "serve",
        "--home",
        str(home),
        "--listen",
        listen,
        *args,
        "--",
        *command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    serve = Serve(proc)
    await serve.ready()
    return serve


@contextlib.asynccontextmanager
async def serving(
    home: Path,
    args: Sequence[str],
    command: Sequence[str] = EVERYTHING,
    listen: str = "127.0.0.1:0",
) -> AsyncIterator[Serve]:
    serve = await start_serve(home, listen, args, command)
    try:
        yield serve
    finally:
        await serve.stop()


def connect_params(home: Path, address: str, *extra: str) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "mcp_proxy.cli", "connect", "--home", str(home), "--peer", address, *extra],
        cwd=str(REPO),
        env={"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"},
    )


def sdk_client(home: Path, address: str, *extra: str, **kwargs: Any) -> Client:
    """The real MCP SDK client launching ``talos-proxy connect`` as its stdio server."""
    return Client(connect_params(home, address, *extra), mode="legacy", **kwargs)


@contextlib.asynccontextmanager
async def http_connect(home: Path, address: str) -> AsyncIterator[tuple[str, str]]:
    """``talos-proxy connect --http 127.0.0.1:0`` running: (its URL, its bearer token)."""
    proc = await proxy(
        "connect",
        "--home",
        str(home),
        "--peer",
        address,
        "--http",
        "127.0.0.1:0",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    assert proc.stderr is not None
    drain: asyncio.Task[bytes] | None = None
    try:
        url = ""
        while not url:
            line = (await proc.stderr.readline()).decode()
            assert line, "connect --http exited early"
            if match := re.search(r"Streamable HTTP on (\S+)", line):
                url = match.group(1)
        drain = asyncio.create_task(proc.stderr.read())
        yield url, (home / "proxy-http.token").read_text().strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 15)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if drain is not None:
            drain.cancel()
