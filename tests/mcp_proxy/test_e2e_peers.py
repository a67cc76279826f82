"""A peer that speaks the tunnel itself (a real talos Node in this process) against a real
``talos-proxy serve``: frames for a session it does not own, raw LF inside a message, and
the serve node's signed heads it keeps, which ``talosd chain verify --heads`` checks."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import orjson

from mcp_proxy.nodehost import make_node
from mcp_proxy.transport import NodeTransport
from mcp_proxy.tunnel_wire import FrameKind, TunnelFrame, decode_frame, encode_frame
from talos.chain.log import block_key
from talos.chain.record_index import index_db
from talos.config import Home
from talos.store import Store
from tests.mcp_proxy.e2e import ENV, REPO, audit_verify, did_of, serving
from tests.mcp_proxy.test_e2e_bad_input import audit_of, bad_tool, stdio_agent
from tests.talos.nodes import until

TIMEOUT = 120
TALOSD = [sys.executable, "-m", "talos.cli"]


def talosd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TALOSD, *args], capture_output=True, text=True, timeout=120, env=ENV, cwd=REPO
    )


def fast_heads(home: Path) -> None:
    """Seal and announce heads often, so the test waits fractions of a second, not seconds."""
    talos_home = Home(home)
    config = talos_home.load_config().model_copy(update={"seal_interval": 0.05})
    talos_home.save_config(config.model_copy(update={"head_interval": 0.1}))


async def test_a_peer_cannot_reach_another_peers_session_and_lf_is_judged(tmp_path: Path) -> None:
    agent_did = did_of(tmp_path / "c")
    mallory_home = tmp_path / "m"
    mallory_did = did_of(mallory_home)
    serve_home = tmp_path / "s"
    did_of(serve_home)
    fast_heads(serve_home)
    args = ["--allow", agent_did, "--allow", mallory_did, "--tools", "echo"]
    frames: asyncio.Queue[TunnelFrame] = asyncio.Queue()
    node = make_node(mallory_home, listen=None)
    transport = NodeTransport(node)
    transport.set_receiver(lambda _peer, payload: frames.put_nowait(decode_frame(payload)))
    async with (
        asyncio.timeout(TIMEOUT),
        serving(serve_home, args, bad_tool("record")) as serve,
        stdio_agent(tmp_path / "c", serve.address) as agent,
    ):
        serve_did = serve.address.split("#")[1]
        # The agent's connect opens tunnel session 1.
        first = await agent.request(b'{"jsonrpc":"2.0","id":1,"method":"initialize"}')
        assert [m["method"] for m in first["result"]["seen"]] == ["initialize"]
        await node.start()
        try:
            await node.connect(serve.address)
            await until(lambda: transport.is_up(serve_did), timeout=60, what="mallory's link")
            # Session 1 of mallory is not the agent's session 1: refused, never forwarded.
            smuggled = b'{"jsonrpc":"2.0","id":66,"method":"tools/call","params":{"name":"echo"}}'
            await transport.send(serve_did, encode_frame(FrameKind.MESSAGES, 1, [smuggled]))
            refused = await frames.get()
            assert (refused.kind, refused.session) == (FrameKind.ERROR, 1)
            assert refused.messages == (b"unknown session",)
            again = await agent.request(b'{"jsonrpc":"2.0","id":2,"method":"ping"}')
            assert [m["method"] for m in again["result"]["seen"]] == ["initialize", "ping"]

            # In its own session, a raw LF around a hidden call reaches the tool as one message.
            hidden = b'{"jsonrpc":"2.0","id":99,"method":"tools/call","params":{"name":"crash"}}'
            line = b'{"jsonrpc":"2.0","id":7,"method":"tools/list","params":{"x":\n%s\n}}' % hidden
            await transport.send(serve_did, encode_frame(FrameKind.OPEN, 5, [b""]))
            await transport.send(serve_did, encode_frame(FrameKind.MESSAGES, 5, [line]))
            reply_frame = await frames.get()
            assert (reply_frame.kind, reply_frame.session) == (FrameKind.MESSAGES, 5)
            (reply,) = (orjson.loads(m) for m in reply_frame.messages)
            assert b"\n" not in reply_frame.messages[0]
            assert reply["result"]["seen"] == [orjson.loads(line)]
            # Serve's signed head reaches mallory's node, which keeps it.
            await until(
                lambda: serve_did in node.heads.peer_heads(), timeout=60, what="a signed head"
            )
        finally:
            await node.stop()
    refusals = await audit_of(serve_home, "--event", "refusal", "--peer", mallory_did)
    assert [(a["session"], a["outcome"]) for a in refusals] == [(1, "unknown-session")]
    opened = await audit_of(serve_home, "--event", "session", "--outcome", "ok")
    assert {a["caller"] for a in opened if a["method"] == "open"} == {agent_did, mallory_did}

    # The heads mallory kept, exported and checked against serve's log.
    exported = talosd("chain", "heads", "--home", str(mallory_home))
    assert exported.returncode == 0, exported.stderr
    heads = json.loads(exported.stdout)
    held = heads[serve_did]
    heads_file = tmp_path / "heads.json"
    heads_file.write_text(exported.stdout)
    ok = talosd("chain", "verify", "--home", str(serve_home), "--heads", str(heads_file), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["witness"] == {"checked": 1, "skipped": 0, "defects": []}
    vouched = audit_verify(serve_home, "--heads", str(heads_file))
    assert vouched.returncode == 0, vouched.stderr

    truncate_from(serve_home, int(held["height"]))
    alone = talosd("chain", "verify", "--home", str(serve_home))
    assert alone.returncode == 0, alone.stderr  # what is left is still a valid chain
    caught = talosd("chain", "verify", "--home", str(serve_home), "--heads", str(heads_file))
    assert caught.returncode == 1
    assert "DEFECT truncated at block" in caught.stderr
    # talos-proxy audit --verify: what is left verifies alone; the heads catch the cut.
    assert audit_verify(serve_home).returncode == 0
    cut = audit_verify(serve_home, "--heads", str(heads_file))
    assert cut.returncode == 1 and "does NOT verify" in cut.stderr


def truncate_from(home: Path, height: int) -> None:
    """Remove blocks ``height`` and up with their records: the newest history is gone."""
    talos_home = Home(home)
    with Store(talos_home.store_dir) as store, store.write() as txn:
        doomed: list[tuple[str, bytes]] = []
        for key, _ in txn.items("blocks", block_key(height)):
            doomed.append(("blocks", key))
        for key, _ in txn.items("block_records", block_key(height)):
            doomed.append(("block_records", key))
        for key, loc in txn.items(index_db(txn)):
            if int.from_bytes(loc[:8], "big") >= height:
                doomed.append((index_db(txn), key))
        for db, key in doomed:
            txn.delete(db, key)
    assert doomed
