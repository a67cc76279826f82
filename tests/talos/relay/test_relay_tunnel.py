"""The MCP tunnel through the relay: real talos-proxy processes, neither with an open port.

mcp SDK client -> ``talos-proxy connect --relay --peer DID`` -> nats-server ->
``talos-proxy serve --relay`` -> a real MCP tool (everything_server).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from mcp import Client, StdioServerParameters

from tests.mcp_proxy.e2e import ENV, EVERYTHING, PROXY, REPO, Serve, did_of
from tests.mcp_proxy.test_e2e import text
from tests.talos.daemons import Daemon
from tests.talos.relay.conftest import RelayNet

TIMEOUT = 90


class RelayServe(Serve):
    """``talos-proxy serve --relay``: ready once it says where it serves."""

    async def _drain(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            decoded = line.decode("utf-8", "replace").rstrip()
            self.lines.append(decoded)
            if "serving on relay" in decoded:
                self.address = "relay"
                self._ready.set()
        self._ready.set()


async def relay_serve(home: Path, relay: str, caller: str) -> RelayServe:
    """``talos-proxy serve --relay`` of the everything tool for ``caller``, started."""
    proc = await asyncio.create_subprocess_exec(
        *PROXY, "serve", "--home", str(home), "--relay", relay, "--allow", caller,
        "--", *EVERYTHING,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        cwd=REPO, env=ENV,
    )  # fmt: skip
    return RelayServe(proc)


async def test_tool_call_through_the_relay(relay_net: RelayNet, tmp_path: Path) -> None:
    server = relay_net.server
    assert server is not None
    serve_home, client_home = tmp_path / "s", tmp_path / "c"
    serve_did, client_did = did_of(serve_home), did_of(client_home)
    server.reload([serve_did, client_did])
    serve = await relay_serve(serve_home, server.url, client_did)
    try:
        await asyncio.wait_for(serve.ready(), TIMEOUT)
        params = StdioServerParameters(
            command=sys.executable,
            args=[
                "-m",
                "mcp_proxy.cli",
                "connect",
                "--home",
                str(client_home),
                "--relay",
                server.url,
                "--peer",
                serve_did,
                "--link-wait",
                "60",
            ],
            cwd=str(REPO),
            env={"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"},
        )
        async with asyncio.timeout(TIMEOUT), Client(params, mode="legacy") as client:
            assert text(await client.call_tool("add", {"a": 2, "b": 3})) == "5"
            results = await asyncio.gather(
                *(client.call_tool("add", {"a": i, "b": 1000}) for i in range(16))
            )
            assert [text(r) for r in results] == [str(i + 1000) for i in range(16)]
    finally:
        await serve.stop()


async def test_an_attached_connect_reaches_a_peer_known_only_by_did(
    relay_net: RelayNet, tmp_path: Path
) -> None:
    """connect attached to a running node names the serve side by DID alone: the node
    links to it through the relay (neither knows the other's address, none is up yet)."""
    server = relay_net.server
    assert server is not None
    serve_home = tmp_path / "s"
    serve_did = did_of(serve_home)
    client_home, _ = relay_net.home("c", listen="127.0.0.1:0", api=True)
    server.reload([serve_did])
    client_did = did_of(client_home)
    serve = await relay_serve(serve_home, server.url, client_did)
    node: Daemon | None = None
    try:
        node = Daemon(client_home)
        await asyncio.wait_for(serve.ready(), TIMEOUT)
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "mcp_proxy.cli", "connect", "--home", str(client_home),
                  "--peer", serve_did, "--link-wait", "60"],
            cwd=str(REPO),
            env={"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"},
        )  # fmt: skip
        async with asyncio.timeout(TIMEOUT), Client(params, mode="legacy") as client:
            assert text(await client.call_tool("add", {"a": 2, "b": 3})) == "5"
    finally:
        if node is not None:
            node.stop()
        await serve.stop()
