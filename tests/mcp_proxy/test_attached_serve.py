"""``talos-proxy serve`` attached to a running ``talosd run`` (mcp_proxy/cli.py, ADR 0012).

Real processes throughout: two ``talosd run`` nodes, each with an attached
``talos-proxy serve`` (the everything tool) and two attached ``talos-proxy
connect`` processes toward the other node, driven by the official MCP SDK
client with tool calls in both directions at once; the audit written through
the node and read back by ``talos-proxy audit``; a node stopping under its
attached serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError

from tests.mcp_proxy.e2e import ENV, EVERYTHING, PROXY, REPO, start_serve
from tests.mcp_proxy.test_attach import connect_params, text
from tests.talos.daemons import Daemon, fast_config, talosd


def audit(home: Path, *extra: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [*PROXY, "audit", "--home", str(home), "--json", *extra],
        capture_output=True, text=True, timeout=60, cwd=REPO, env=ENV,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


@contextlib.contextmanager
def two_linked_nodes(tmp_path: Path) -> Iterator[tuple[Daemon, Daemon]]:
    homes = tmp_path / "a", tmp_path / "b"
    for home in homes:
        assert talosd("init", "--home", str(home), "--no-passphrase").returncode == 0
        fast_config(home, listen="127.0.0.1:0")
    a, b = Daemon(homes[0]), Daemon(homes[1])
    try:
        for home, other, name in ((a.home, b, "b"), (b.home, a, "a")):
            res = talosd("peers", "add", other.addr, "--name", name, "--home", str(home))
            assert res.returncode == 0, res.stderr
        yield a, b
    finally:
        for node in (a, b):
            if node.proc.poll() is None:
                node.stop()


async def test_serve_and_connect_attached_on_both_nodes_at_once(tmp_path: Path) -> None:
    with two_linked_nodes(tmp_path) as (a, b):
        serve_a = await start_serve(a.home, "127.0.0.1:0", ["--allow", "b"], EVERYTHING)
        serve_b = await start_serve(b.home, "127.0.0.1:0", ["--allow", "a"], EVERYTHING)
        try:
            # attached: the node's own address and identity, no store of its own
            assert await serve_a.ready() == a.addr and "attached" in serve_a.log
            assert await serve_b.ready() == b.addr
            async with (
                Client(connect_params(a.home, "b"), mode="legacy") as a1,
                Client(connect_params(a.home, "b"), mode="legacy") as a2,
                Client(connect_params(b.home, "a"), mode="legacy") as b1,
                Client(connect_params(b.home, "a"), mode="legacy") as b2,
            ):
                agents = {"a1": a1, "a2": a2, "b1": b1, "b2": b2}
                calls = [
                    (name, i, agent.call_tool("echo", {"text": f"{name}-{i}"}))
                    for i in range(8)
                    for name, agent in agents.items()
                ]
                results = await asyncio.gather(*(c for _, _, c in calls))
                for (name, i, _), result in zip(calls, results, strict=True):
                    assert f"{name}-{i}" in text(result)
                # every agent has its own tool process on the other node's serve
                pids = await asyncio.gather(*(x.call_tool("pid", {}) for x in agents.values()))
                assert len({text(p) for p in pids}) == 4
            # the serves' audit went through their nodes; read while the nodes run,
            # each entry vouched for by the chain the running node verified (and sealed)
            for node, caller in ((a, b.did), (b, a.did)):
                echoes = [
                    e for e in await asyncio.to_thread(
                        audit, node.home, "--tool", "echo", "--verify"
                    )
                    if e["outcome"] == "ok"
                ]  # fmt: skip
                assert len(echoes) == 16 and {e["caller"] for e in echoes} == {caller}
                assert {e["verified"] for e in echoes} == {True}
            # stopping an attached serve leaves its node running
            assert await serve_a.stop() == 0
            assert a.proc.poll() is None
            assert (
                await asyncio.to_thread(talosd, "status", "--home", str(a.home))
            ).returncode == 0
        finally:
            await serve_a.stop()
            await serve_b.stop()
        # with the node stopped, the same records are read from its store
        a.stop()
        assert len(await asyncio.to_thread(audit, a.home, "--tool", "echo")) >= 16


async def test_node_stopping_under_an_attached_serve(tmp_path: Path) -> None:
    with two_linked_nodes(tmp_path) as (a, b):
        serve_b = await start_serve(b.home, "127.0.0.1:0", ["--allow", a.did], EVERYTHING)
        try:
            # The call after B stops waits --link-wait for a link that will not
            # come back (15 s by default) before it answers "down".
            params = connect_params(a.home, "b", "--link-wait", "4")
            async with Client(params, mode="legacy") as agent:
                assert "up" in text(await agent.call_tool("echo", {"text": "up"}))
                assert await asyncio.to_thread(b.stop) == 0
                # the serve exits by itself, saying why
                code = await asyncio.wait_for(serve_b.proc.wait(), 60)
                await serve_b.stop()
                assert code != 0 and "stopped" in serve_b.log and "ends with it" in serve_b.log
                # the caller's next call is a JSON-RPC error naming the link, not a hang
                with pytest.raises(MCPError, match="down"):
                    await agent.call_tool("echo", {"text": "after"})
            assert a.proc.poll() is None
        finally:
            await serve_b.stop()
        # the session that ended with the node was audited through it before it went
        sessions = await asyncio.to_thread(audit, b.home, "--event", "session")
        assert [e["method"] for e in sessions if e["caller"] == a.did][:1] == ["open"]
        assert any(e["method"] == "close" for e in sessions), sessions


async def test_a_second_attached_serve_is_refused(tmp_path: Path) -> None:
    with two_linked_nodes(tmp_path) as (a, _b):
        serve = await start_serve(a.home, "127.0.0.1:0", ["--allow", "b"], EVERYTHING)
        try:
            out = await asyncio.to_thread(
                subprocess.run,
                [*PROXY, "serve", "--home", str(a.home), "--allow", "b", "--", *EVERYTHING],
                capture_output=True, text=True, timeout=60, cwd=REPO, env=ENV,
            )  # fmt: skip
            assert out.returncode == 2
            assert "already claimed" in out.stderr and "Traceback" not in out.stderr
            assert serve.proc.returncode is None and a.proc.poll() is None
        finally:
            await serve.stop()
