"""``talos-proxy connect`` attached to a running ``talosd run`` (mcp_proxy/attach.py, ADR 0012).

Real processes throughout: a ``talosd run`` node, a ``talos-proxy serve`` with
the everything tool, and two ``talos-proxy connect`` processes on the node's
home at once, each driven by the official MCP SDK client.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from mcp import Client, StdioServerParameters
from mcp.types import TextContent

from mcp_proxy.attach import AttachedTransport
from talos.link.refusals import MAX_PROBLEMS
from tests.mcp_proxy.e2e import ENV, REPO, did_of, proxy, serving
from tests.talos.daemons import Daemon, fast_config, talosd


def connect_params(home: Path, peer: str, *extra: str) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "mcp_proxy.cli", "connect", "--home", str(home), "--peer", peer, *extra],
        cwd=str(REPO),
        env=ENV,
    )


def text(result: object) -> str:
    content = result.content  # type: ignore[attr-defined]
    return "".join(c.text for c in content if isinstance(c, TextContent))


async def test_two_agents_share_one_running_node(tmp_path: Path) -> None:
    home = tmp_path / "agents"
    assert talosd("init", "--home", str(home), "--no-passphrase").returncode == 0
    fast_config(home, listen="127.0.0.1:0")
    node = Daemon(home)
    try:
        async with serving(tmp_path / "tool", ["--allow", node.did]) as serve:
            address = await serve.ready()
            # a peer name works as --peer once the node knows the address
            res = await asyncio.to_thread(
                talosd, "peers", "add", address, "--name", "tools", "--home", str(home)
            )
            assert res.returncode == 0, res.stderr
            async with (
                Client(connect_params(home, address), mode="legacy") as one,
                Client(connect_params(home, "tools"), mode="legacy") as two,
            ):
                a, b = await asyncio.gather(
                    one.call_tool("echo", {"text": "from one"}),
                    two.call_tool("echo", {"text": "from two"}),
                )
                assert "from one" in text(a) and "from two" in text(b)
                # each agent has its own tunnel session, hence its own tool process
                pid_one = text(await one.call_tool("pid", {}))
                pid_two = text(await two.call_tool("pid", {}))
                assert pid_one != pid_two
            # both agents spoke as the node's one identity; the node still runs
            assert node.proc.poll() is None
            assert did_of(home) == node.did
            status = json.loads(
                (await asyncio.to_thread(talosd, "status", "--json", "--home", str(home))).stdout
            )
            assert status["did"] == node.did
    finally:
        node.stop()


async def test_node_stopping_ends_an_attached_proxy_with_a_message(tmp_path: Path) -> None:
    home = tmp_path / "agents"
    assert talosd("init", "--home", str(home), "--no-passphrase").returncode == 0
    fast_config(home, listen="127.0.0.1:0")
    node = Daemon(home)
    try:
        async with serving(tmp_path / "tool", ["--allow", node.did]) as serve:
            address = await serve.ready()
            proc = await proxy("connect", "--home", str(home), "--peer", address)
            assert proc.stdin is not None and proc.stdout is not None
            init = {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-11-25",
                    "capabilities": {},
                    "clientInfo": {"name": "t", "version": "0"},
                },
            }
            proc.stdin.write(json.dumps(init).encode() + b"\n")
            await proc.stdin.drain()
            first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
            assert first["id"] == 1 and "result" in first
            slow = {
                "jsonrpc": "2.0",
                "id": 2,
                "method": "tools/call",
                "params": {"name": "slow", "arguments": {"steps": 100, "delay": 0.5}},
            }
            proc.stdin.write(json.dumps(slow).encode() + b"\n")
            await proc.stdin.drain()
            await asyncio.sleep(0.5)
            assert await asyncio.to_thread(node.stop) == 0
            # the pending request is answered with an error, then the proxy exits saying why
            reply = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
            assert reply["id"] == 2 and "error" in reply
            code = await asyncio.wait_for(proc.wait(), 60)
            assert proc.stderr is not None
            err = (await proc.stderr.read()).decode()
            assert code != 0 and "stopped" in err, err
    finally:
        if node.proc.poll() is None:
            node.stop()


def test_allow_takes_peer_names(tmp_path: Path) -> None:
    from mcp_proxy.attach import resolve_names
    from talos.peer_names import UnknownPeerNameError

    home, other = tmp_path / "tool", tmp_path / "agent"
    for h in (home, other):
        assert talosd("init", "--home", str(h), "--no-passphrase").returncode == 0
    did = talosd("id", "--home", str(other)).stdout.strip()
    res = talosd("peers", "add", f"ws://127.0.0.1:9#{did}", "--name", "agent", "--home", str(home))
    assert res.returncode == 0, res.stderr
    assert resolve_names(home, ["agent", did]) == [did, did]
    try:
        resolve_names(home, ["nobody"])
    except UnknownPeerNameError as exc:
        assert "nobody" in str(exc)
    else:
        raise AssertionError("an unknown name must be refused")
    # the CLI says so in one line
    out = subprocess.run(
        [sys.executable, "-m", "mcp_proxy.cli", "serve", "--home", str(home), "--listen",
         "127.0.0.1:0", "--allow", "nobody", "--", "true"],
        capture_output=True, text=True, timeout=60, cwd=REPO, env=ENV,
    )  # fmt: skip
    assert out.returncode != 0 and "unknown peer name 'nobody'" in out.stderr


async def test_attached_bound_is_the_peers_frame_bound(tmp_path: Path) -> None:
    """The node tells an attached proxy each linked peer's bound (hello, link-up event)."""
    from mcp_proxy.attach import attach
    from mcp_proxy.transport import MAX_BATCH_BYTES
    from talos.daemon import Daemon as InProcess
    from talos.pipeline import text_limit
    from tests.talos.nodes import addr, make_home, started, until

    a = InProcess(*make_home(tmp_path, "a"))
    await a.start()
    small = await started(*make_home(tmp_path, "small", max_frame=16 * 1024))
    big = await started(*make_home(tmp_path, "big"))
    try:
        async with asyncio.timeout(30):
            small.allow(a.node.did)
            big.allow(a.node.did)
            watching = await attach(a.home.path)
            assert watching is not None
            await a.node.add_peer(addr(small))
            await until(lambda: watching.is_up(small.did), what="link-up event")
            assert watching.max_payload_for(small.did) == text_limit(16 * 1024)
            await a.node.add_peer(addr(big))
            await a.node.wait_connected(big.did, 20)
            late = await attach(a.home.path)  # attached after the links came up: hello says
            assert late is not None
            assert late.max_payload_for(small.did) == text_limit(16 * 1024)
            assert late.max_payload_for(big.did) == MAX_BATCH_BYTES
            await watching.close()
            await late.close()
    finally:
        await a.stop()
        await small.stop()
        await big.stop()


class _Socket:
    """What AttachedTransport reads of a LocalClient: its hello and its events."""

    def __init__(self) -> None:
        self.did = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
        self.hello: dict[str, object] = {"max_frame": 1 << 20, "up": [], "refused": {}}

    def on_event(self, listener: object) -> None:
        self.tell = listener

    def set_app_receiver(self, receiver: object) -> None:
        pass


def test_the_reason_a_link_is_down_is_what_this_node_found_dialling_and_bounded() -> None:
    socket = _Socket()
    transport = AttachedTransport(socket)  # type: ignore[arg-type]
    peer = "did:key:z6MkpTHR8VNsBxYAAWHut2Geadd9jSwuBV8xRoAnwWsdvktH"

    def problem(did: str, direction: str, message: str) -> None:
        socket.tell({"event": "link_problem", "did": did, "direction": direction,
                     "message": message, "decisive": False})  # fmt: skip

    problem(peer, "accept", "a stranger's guess under that DID")
    assert transport.problem(peer) is None
    problem(peer, "dial", f"{peer} is unreachable: refused")
    problem(peer, "accept", "another guess")
    assert transport.problem(peer) == f"{peer} is unreachable: refused"
    for i in range(MAX_PROBLEMS + 50):
        problem(f"did:key:z{i}", "dial", "unreachable")
    assert len(transport._problems) == MAX_PROBLEMS
