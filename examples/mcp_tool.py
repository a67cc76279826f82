"""Use an MCP tool on another node through the Talos tunnel, with a tool allow list.

Shows (docs/adr/0003-mcp-tunnel.md):

1. ``talos-proxy serve --allow DID --tools get_current_time -- python -m
   mcp_server_time`` exposes a stdio MCP server to one agent identity, and
   only one of its two tools.
2. The official ``mcp`` client launches ``talos-proxy connect --peer
   ws://HOST:PORT#DID`` as its stdio MCP server, exactly as an agent would.
3. ``tools/list`` is filtered to the allowed tool; calling the other one is
   refused by the serve side (JSON-RPC error -32001) and never reaches the tool.
4. Every call is audited in the serving node's block log (``talosd chain verify``).

Runs on 127.0.0.1 in a temporary folder removed at the end.
Run: ``python examples/mcp_tool.py``
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mcp import ClientSession, MCPError, StdioServerParameters
from mcp.client.stdio import stdio_client

BIN = Path(sys.executable).parent
PROXY, TALOSD = str(BIN / "talos-proxy"), str(BIN / "talosd")
TIMEOUT = 30.0


def start_serve(tool_home: Path, agent_did: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``talos-proxy serve``; return the process and its ``ws://…#DID`` address."""
    cmd = [
        PROXY, "--log-level", "WARNING", "serve", "--home", str(tool_home), "--no-passphrase",
        "--listen", "127.0.0.1:0", "--allow", agent_did, "--tools", "get_current_time",
        "--", sys.executable, "-m", "mcp_server_time",
    ]  # fmt: skip
    print("$ talos-proxy serve --listen 127.0.0.1:0 --allow AGENT_DID --tools get_current_time \\")
    print("      -- python -m mcp_server_time &")
    with log.open("wb") as err:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err
        )
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        found = re.search(r"serving on (ws://\S+#did:key:\w+)", log.read_text())
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"serve exited early:\n{log.read_text()}")
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("serve was not ready in time")


async def agent(agent_home: Path, tool_addr: str) -> None:
    params = StdioServerParameters(
        command=PROXY,
        # ERROR: the "link down" warning at teardown is expected here.
        args=["--log-level", "ERROR", "connect", "--home", str(agent_home), "--peer", tool_addr],
    )
    async with (
        asyncio.timeout(TIMEOUT),
        stdio_client(params) as (read, write),
        ClientSession(read, write) as session,
    ):
        init = await session.initialize()
        print(f"agent: connected to {init.server_info.name!r} through the tunnel")
        tools = await session.list_tools()
        print(f"agent: tools/list -> {[t.name for t in tools.tools]} (filtered by policy)")
        result = await session.call_tool("get_current_time", {"timezone": "Europe/Paris"})
        text = " ".join(" ".join(getattr(c, "text", "").split()) for c in result.content)
        print(f"agent: get_current_time(Europe/Paris) -> {text[:120]}")
        try:
            await session.call_tool(
                "convert_time",
                {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"},
            )
        except MCPError as exc:
            print(f"agent: convert_time -> refused: {exc.error.message} (code {exc.error.code})")
        else:
            raise SystemExit("a tool outside the allow list was called")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="talos-mcp-") as tmp:
        root = Path(tmp)
        agent_home, tool_home = root / "agent", root / "tool"
        agent_did = subprocess.run(
            [PROXY, "id", "--home", str(agent_home), "--no-passphrase"],
            check=True, capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL,
        ).stdout.strip()  # fmt: skip
        print(f"agent identity {agent_did}")
        proc, addr = start_serve(tool_home, agent_did, root / "serve.log")
        try:
            print(f"serving on {addr}")
            asyncio.run(agent(agent_home, addr))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=TIMEOUT)
        # The serve side audited every call (group commit) in its block log.
        out = subprocess.run(
            [TALOSD, "chain", "verify", "--home", str(tool_home)],
            check=True, capture_output=True, text=True, timeout=TIMEOUT,
        )  # fmt: skip
        print(f"tool node audit log: {out.stdout.strip()}")


if __name__ == "__main__":
    main()
