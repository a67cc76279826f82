"""The Talos demo: two nodes, a message, a proxied MCP tool, an audited log.

Everything runs as real processes on 127.0.0.1 in a temporary folder that is
removed at the end:

1. ``talosd init`` two nodes (alice, bob) and run them; bob pins alice's DID.
2. alice sends bob a message and waits for bob's acknowledgement (which bob
   only sends after the message is committed to its LMDB block log).
3. ``talos-proxy serve`` exposes the ``mcp-server-time`` MCP tool to one
   agent identity; the official ``mcp`` client launches ``talos-proxy
   connect`` as its MCP server and calls the tool through the encrypted tunnel.
4. ``talosd chain verify`` re-validates both nodes' block logs.

Run: ``python examples/demo.py`` (add ``--keep`` to keep the homes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

BIN = Path(sys.executable).parent
TALOSD = str(BIN / "talosd")
PROXY = str(BIN / "talos-proxy")
DEADLINE_S = 30.0


def step(text: str) -> None:
    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
    print(f"\n{bold}==> {text}{plain}", flush=True)


def run(*args: str) -> str:
    """Run a CLI command; show it and return its stdout."""
    print("$ " + " ".join(_short(a) for a in args), flush=True)
    # stdin: nothing here is typed (a key prompt must fail fast, not wait for the keyboard).
    out = subprocess.run(
        args,
        check=True,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        stdin=subprocess.DEVNULL,
    )
    return out.stdout.strip()


def _short(arg: str) -> str:
    # Keep the printed commands readable: DIDs and temp paths are long.
    arg = re.sub(r"did:key:z6Mk(\w{6})\w+", r"did:key:z6Mk\1…", arg)
    return arg.replace(str(TMP), "$TMP") if TMP else arg


TMP: Path | None = None


class Daemon:
    """A long-running CLI process whose ready line we wait for."""

    def __init__(self, name: str, args: list[str], ready: str, stream: str) -> None:
        print("$ " + " ".join(_short(a) for a in args) + " &", flush=True)
        self.name = name
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if stream == "stdout" else subprocess.DEVNULL,
            stderr=subprocess.PIPE if stream == "stderr" else subprocess.DEVNULL,
            text=True,
        )
        pipe = self.proc.stdout if stream == "stdout" else self.proc.stderr
        assert pipe is not None
        deadline = time.monotonic() + DEADLINE_S
        pattern = re.compile(ready)
        while time.monotonic() < deadline:
            line = pipe.readline()
            if not line:
                raise SystemExit(f"{name} exited before it was ready (code {self.proc.poll()})")
            match = pattern.search(line)
            if match:
                self.match = match
                return
        raise SystemExit(f"{name} was not ready within {DEADLINE_S:.0f}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def daemons() -> Iterator[list[Daemon]]:
    running: list[Daemon] = []
    try:
        yield running
    finally:
        for d in reversed(running):
            d.stop()


async def call_tool_through_tunnel(agent_home: Path, tool_addr: str) -> None:
    """Use the remote tool exactly as an agent would: launch ``connect`` over stdio."""
    params = StdioServerParameters(
        command=PROXY,
        args=["--log-level", "WARNING", "connect", "--home", str(agent_home), "--peer", tool_addr],
    )
    print(f"$ mcp client -> {_short(PROXY)} connect --home {_short(str(agent_home))} --peer …")
    # connect's stderr (its DID, warnings) goes to a file, shown only if the call fails.
    log = agent_home.parent / "connect.log"
    with log.open("w") as errlog:
        try:
            await _call_tool(params, errlog)
        except BaseException:
            print(log.read_text(), file=sys.stderr, end="")
            raise


async def _call_tool(params: StdioServerParameters, errlog: TextIO) -> None:
    async with (
        asyncio.timeout(DEADLINE_S),
        stdio_client(params, errlog=errlog) as (read, write),
        ClientSession(read, write) as session,
    ):
        init = await session.initialize()
        print(f"   connected to MCP server {init.server_info.name!r} through the tunnel")
        tools = await session.list_tools()
        print(f"   tools: {', '.join(t.name for t in tools.tools)}")
        start = time.perf_counter()
        result = await session.call_tool("get_current_time", {"timezone": "UTC"})
        ms = (time.perf_counter() - start) * 1000
        text = " ".join(" ".join(getattr(c, "text", "").split()) for c in result.content)
        print(f"   get_current_time(UTC) -> {text[:120]}  ({ms:.1f} ms)")
        if result.is_error:
            raise SystemExit("the tool call failed")


def main() -> int:
    global TMP
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary homes")
    args = parser.parse_args()

    TMP = Path(tempfile.mkdtemp(prefix="talos-demo-"))
    alice, bob, tool, agent = (TMP / n for n in ("alice", "bob", "tool", "agent"))
    try:
        with daemons() as running:
            step("Create two node identities")
            did_a = run(TALOSD, "init", "--home", str(alice), "--no-passphrase")
            did_b = run(TALOSD, "init", "--home", str(bob), "--no-passphrase")
            print(f"   alice = {did_a}\n   bob   = {did_b}")

            step("Run both nodes on 127.0.0.1 (every link is a Noise secure channel)")
            node_b = Daemon(
                "bob",
                [TALOSD, "run", "--home", str(bob), "--listen", "127.0.0.1:0", "--allow", did_a],
                r"listening on (ws://\S+)",
                "stdout",
            )
            running.append(node_b)
            addr_b = f"{node_b.match.group(1)}#{did_b}"
            node_a = Daemon(
                "alice",
                [TALOSD, "run", "--home", str(alice), "--listen", "127.0.0.1:0", "--peer", addr_b],
                r"listening on (ws://\S+)",
                "stdout",
            )
            running.append(node_a)

            step("alice -> bob: end-to-end encrypted, acknowledged after bob's durable commit")
            msg_id = run(TALOSD, "send", "--home", str(alice), "--wait", did_b, "hello bob")
            print(f"   message id {msg_id} acknowledged")
            inbox = json.loads(run(TALOSD, "inbox", "--home", str(bob), "--json"))
            for m in inbox:
                print(f"   bob's inbox: from {_short(m['from'])}: {m['text']!r}")

            step("Expose an MCP tool (mcp-server-time) to one authorised agent identity")
            did_agent = run(PROXY, "id", "--home", str(agent), "--no-passphrase")
            print(f"   agent {_short(did_agent)}")
            serve = Daemon(
                "talos-proxy serve",
                [
                    PROXY, "serve", "--home", str(tool), "--no-passphrase",
                    "--listen", "127.0.0.1:0", "--allow", did_agent,
                    "--", sys.executable, "-m", "mcp_server_time",
                ],
                r"serving on (ws://\S+#did:key:\w+)",
                "stderr",
            )  # fmt: skip
            running.append(serve)

            step("The agent calls the remote tool through the tunnel with the official MCP client")
            asyncio.run(call_tool_through_tunnel(agent, serve.match.group(1)))

            step("Audit: re-validate every block, link, Merkle root and signature")
            for home in (alice, bob):
                out = run(TALOSD, "chain", "verify", "--home", str(home))
                print(textwrap.indent(out, "   "))
        step("Done: nodes stopped cleanly")
    finally:
        if args.keep:
            print(f"homes kept in {TMP}")
        else:
            shutil.rmtree(TMP, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
