"""``talosd mcp`` driven by the official MCP SDK client, on two real ``talosd run`` nodes.

Alice's agent speaks the 2025-11-25 session protocol, Bob's the stateless
2026-07-28 revision; they message each other through their nodes (send, long
poll, subscriptions), and every bad input is a tool error with the node still up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters, types
from mcp.shared.exceptions import MCPDeprecationWarning

from tests.talos.daemons import Daemon, fast_config, talosd

REPO = Path(__file__).resolve().parents[3]
MODERN = "2026-07-28"
TOOLS = {
    "send_message",
    "read_inbox",
    "mark_read",
    "list_peers",
    "add_peer",
    "name_peer",
    "list_outbox",
    "node_status",
    "send_file",
    "list_files",
    "accept_file",
    "prove_message",
}


def mcp_params(home: Path, cwd: Path = REPO) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "talos.cli", "mcp", "--home", str(home)],
        cwd=str(cwd),
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"},
    )


async def raw_mcp(
    home: Path, *, stderr: int = asyncio.subprocess.DEVNULL
) -> asyncio.subprocess.Process:
    """``talosd mcp`` on plain pipes, for what the SDK client would not send or wait for."""
    params = mcp_params(home)
    pipe = asyncio.subprocess.PIPE
    return await asyncio.create_subprocess_exec(
        params.command, *params.args, cwd=REPO, env=params.env,
        stdin=pipe, stdout=pipe, stderr=stderr,
    )  # fmt: skip


def init(home: Path) -> None:
    assert talosd("init", "--home", str(home), "--no-passphrase").returncode == 0
    fast_config(home, listen="127.0.0.1:0")


@contextlib.contextmanager
def two_nodes(tmp_path: Path) -> Any:
    a_home, b_home = tmp_path / "alice", tmp_path / "bob"
    init(a_home)
    init(b_home)
    a, b = Daemon(a_home), Daemon(b_home)
    try:
        assert (
            talosd("peers", "add", b.addr, "--name", "bob", "--home", str(a_home)).returncode == 0
        )
        assert (
            talosd("peers", "add", a.addr, "--name", "alice", "--home", str(b_home)).returncode == 0
        )
        yield a, b
    finally:
        a.stop()
        b.stop()


def data(result: types.CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return result.structured_content


def error_text(result: types.CallToolResult) -> str:
    assert result.is_error
    return " ".join(c.text for c in result.content if isinstance(c, types.TextContent))


@contextlib.asynccontextmanager
async def agent(home: Path, mode: str, **kwargs: Any) -> AsyncIterator[Client]:
    async with Client(mcp_params(home), mode=mode, **kwargs) as client:
        yield client


async def test_two_agents_message_each_other_across_eras(tmp_path: Path) -> None:
    with two_nodes(tmp_path) as (a, b):
        updates: list[str] = []

        async def on_message(message: Any) -> None:
            if isinstance(message, types.ResourceUpdatedNotification):
                updates.append(str(message.params.uri))

        async with (
            agent(a.home, "legacy", message_handler=on_message) as alice,
            agent(b.home, MODERN) as bob,
        ):
            listed = (await alice.list_tools()).tools
            assert {t.name for t in listed} == TOOLS
            assert all(t.input_schema and t.output_schema for t in listed)
            hints = {t.name: t.annotations.read_only_hint for t in listed if t.annotations}
            assert hints["read_inbox"] is True and "send_message" not in hints
            send = next(t for t in listed if t.name == "send_message").input_schema
            assert (
                "timeout_seconds" in send["properties"] and send["properties"]["to"]["description"]
            )
            assert {t.name for t in (await bob.list_tools()).tools} == TOOLS
            status = data(await alice.call_tool("node_status", {}))
            assert status["did"] == a.did and status["mode"] == "attached"

            # Bob long-polls; Alice sends by name and waits for the ack.
            poll = asyncio.ensure_future(bob.call_tool("read_inbox", {"wait_seconds": 60}))
            sent = data(
                await alice.call_tool("send_message", {"to": "bob", "text": "hi", "wait": True})
            )
            assert sent["acked"] is True and sent["to"] == b.did
            got = data(await poll)
            assert [(m["text"], m["from"], m["from_name"]) for m in got["messages"]] == [
                ("hi", a.did, "alice")
            ]
            assert got["messages"][0]["id"] == sent["id"]

            # Alice (legacy) subscribes to her inbox; Bob (modern) listens to his.
            with pytest.warns(MCPDeprecationWarning):  # the 2025-11-25 way, on purpose
                await alice.subscribe_resource("talos://inbox")
                await alice.subscribe_resource(f"talos://inbox/{b.did}")
            async with bob.listen(resource_subscriptions=["talos://inbox"]) as sub:
                reply = data(await bob.call_tool("send_message", {"to": "alice", "text": "yo"}))
                async with asyncio.timeout(30):
                    while len(updates) < 2:
                        await asyncio.sleep(0.02)
                assert sorted(updates) == ["talos://inbox", f"talos://inbox/{b.did}"]
                inbox = await alice.read_resource("talos://inbox")
                assert "yo" in inbox.contents[0].text  # type: ignore[union-attr]
                await alice.call_tool("send_message", {"to": "bob", "text": "ping"})
                async with asyncio.timeout(30):
                    event = await sub.__anext__()
                assert "talos://inbox" in str(event)

            # The read cursor: marked messages are skipped by read_inbox.
            mine = data(await alice.call_tool("read_inbox", {}))
            assert [m["text"] for m in mine["messages"]] == ["yo"]
            assert mine["messages"][0]["id"] == reply["id"]
            data(await alice.call_tool("mark_read", {"through": mine["messages"][0]["n"]}))
            assert data(await alice.call_tool("read_inbox", {}))["messages"] == []

            # Bob proves Alice's message is in his block log (sealed within seal_interval).
            async with asyncio.timeout(30):
                while True:
                    proof = await bob.call_tool("prove_message", {"id": sent["id"]})
                    if not proof.is_error:
                        break
                    await asyncio.sleep(0.05)
            assert data(proof)["size"] >= 1

            peers = data(await alice.call_tool("list_peers", {}))["peers"]
            assert [(p["did"], p["name"], p["connected"]) for p in peers] == [(b.did, "bob", True)]


async def test_bad_input_is_a_tool_error_and_the_node_keeps_running(tmp_path: Path) -> None:
    with two_nodes(tmp_path) as (a, _b):
        async with agent(a.home, "legacy") as alice:
            bad = [
                ({"to": "carol", "text": "x"}, "unknown peer name 'carol'"),
                ({"to": "carol", "text": "x"}, "name_peer"),  # the tool, not only the CLI
                ({"to": "did:key:z1111", "text": "x"}, ""),
                ({"to": "bob", "text": "x" * (2 << 20)}, "above the"),
            ]
            for args, expected in bad:
                text = error_text(await alice.call_tool("send_message", args))
                assert expected in text
            assert "no such file" in error_text(
                await alice.call_tool("send_file", {"to": "bob", "path": "/nonexistent"})
            )
            assert "hex" in error_text(await alice.call_tool("prove_message", {"id": "zz"}))
            assert "peer address" in error_text(
                await alice.call_tool("add_peer", {"address": "http://nope"})
            )
            sent = data(await alice.call_tool("send_message", {"to": "bob", "text": "still up"}))
            assert len(sent["id"]) == 32
        assert a.proc.poll() is None


async def test_client_gone_mid_long_poll_and_node_stopping(tmp_path: Path) -> None:
    with two_nodes(tmp_path) as (a, b):
        async with agent(b.home, "legacy") as bob:
            poll = asyncio.ensure_future(bob.call_tool("read_inbox", {"wait_seconds": 120}))
            await asyncio.sleep(0.3)
        # The agent and its talosd mcp are gone mid-poll; the node serves the next one.
        poll.cancel()
        with contextlib.suppress(BaseException):
            await poll
        async with agent(a.home, "legacy") as alice:
            data(await alice.call_tool("send_message", {"to": "bob", "text": "kept", "wait": True}))
        async with agent(b.home, MODERN) as bob:
            got = data(await bob.call_tool("read_inbox", {}))
            assert [m["text"] for m in got["messages"]] == ["kept"]
            assert b.stop() == 0  # the node stops under an attached agent
            text = error_text(await bob.call_tool("read_inbox", {}))
            assert "stopped" in text


async def test_in_process_node_when_none_runs(tmp_path: Path) -> None:
    home = tmp_path / "solo"
    init(home)
    async with agent(home, "legacy") as solo:
        status = data(await solo.call_tool("node_status", {}))
        assert status["mode"] == "in-process"
        # ... and other local clients attach to it like to talosd run.
        res = await asyncio.to_thread(talosd, "id", "--home", str(home))
        assert res.stdout.strip() == status["did"]


def _sealed_home(tmp_path: Path) -> tuple[Path, Path]:
    """A home whose identity key is sealed under a passphrase kept in a 0600 file."""
    home, secret = tmp_path / "sealed", tmp_path / "passphrase"
    secret.write_text("correct horse battery staple\n")
    secret.chmod(0o600)
    res = talosd("init", "--home", str(home), "--passphrase-file", str(secret))
    assert res.returncode == 0, res.stderr
    fast_config(home, listen="127.0.0.1:0")
    assert b'"ciphertext"' in (home / "identity.key").read_bytes()
    return home, secret


async def test_in_process_node_unlocks_a_sealed_identity(tmp_path: Path) -> None:
    home, secret = _sealed_home(tmp_path)
    params = mcp_params(home)
    # The way an agent's MCP config passes it: TALOS_PASSPHRASE in the server's environment.
    env = {k: v for k, v in (params.env or {}).items() if "PASSPHRASE" not in k}
    params.env = {**env, "TALOS_PASSPHRASE": "correct horse battery staple"}
    async with Client(params, mode="legacy") as solo:
        status = data(await solo.call_tool("node_status", {}))
        assert status["mode"] == "in-process"
        assert (
            status["did"]
            == (await asyncio.to_thread(talosd, "id", "--home", str(home))).stdout.strip()
        )
    # --passphrase-file works the same, through the stateless era this time.
    params = mcp_params(home)
    params.env = env
    params.args = [*params.args, "--passphrase-file", str(secret)]
    async with Client(params, mode=MODERN) as solo:
        assert data(await solo.call_tool("node_status", {}))["mode"] == "in-process"


async def test_sealed_identity_without_its_passphrase_is_a_clear_error(tmp_path: Path) -> None:
    home, _ = _sealed_home(tmp_path)
    wrong = tmp_path / "wrong"
    wrong.write_text("not it\n")
    env = {k: v for k, v in os.environ.items() if "PASSPHRASE" not in k}
    env["PYTHONPATH"] = str(REPO)
    cases = [  # exit codes of talos/exit_codes.py: 2 bad input
        # No passphrase to be had, no terminal to ask on; first why one is needed at all.
        ([], "no node is running on", 2),
        ([], "TALOS_PASSPHRASE", 2),
        (["--passphrase-file", str(wrong)], "passphrase", 2),  # the wrong one
    ]
    for extra, expected, code in cases:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "talos.cli", "mcp", "--home", str(home), *extra,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=REPO, env=env,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == code, err
        assert out == b""  # nothing on the MCP channel
        text = err.decode()
        assert text.startswith("talosd: error:") and expected in text, text
        assert "Traceback" not in text
    # Nothing was started: no node runs, no socket was left behind.
    assert not (home / "talosd.sock").exists()


async def test_agents_share_the_read_cursor_which_stops_at_the_last_message(
    tmp_path: Path,
) -> None:
    with two_nodes(tmp_path) as (a, b):
        async with agent(a.home, "legacy") as alice, agent(b.home, "legacy") as bob1:
            for text in ("one", "two"):
                data(
                    await alice.call_tool("send_message", {"to": "bob", "text": text, "wait": True})
                )
            async with agent(b.home, MODERN) as bob2:
                got = data(await bob1.call_tool("read_inbox", {}))
                first, last = (m["n"] for m in got["messages"])
                # A cursor past the last message would hide all mail still to come: refused.
                text = error_text(await bob1.call_tool("mark_read", {"through": last + 1000}))
                assert "past the last message" in text and f"n={last}" in text
                # Marking is the node's: the other agent's default read skips "one" too.
                data(await bob1.call_tool("mark_read", {"through": first}))
                unread = data(await bob2.call_tool("read_inbox", {}))
                assert [m["text"] for m in unread["messages"]] == ["two"]
                # ... while reading by position (after=0, then next) is each agent's own.
                mine = data(await bob2.call_tool("read_inbox", {"after": 0}))
                assert [m["text"] for m in mine["messages"]] == ["one", "two"]
                data(await alice.call_tool("send_message", {"to": "bob", "text": "three"}))
                follow = data(
                    await bob2.call_tool("read_inbox", {"after": mine["next"], "wait_seconds": 30})
                )
                assert [m["text"] for m in follow["messages"]] == ["three"]


async def test_a_peer_that_dials_in_is_listed_named_and_read_by_name(tmp_path: Path) -> None:
    a_home, b_home = tmp_path / "alice", tmp_path / "bob"
    init(a_home)
    init(b_home)
    a_did = (await asyncio.to_thread(talosd, "id", "--home", str(a_home))).stdout.strip()
    fast_config(b_home, listen="127.0.0.1:0", allow=[a_did])  # bob only accepts alice's link
    b = Daemon(b_home)
    a = Daemon(a_home)
    try:
        assert talosd("peers", "add", b.addr, "--home", str(a_home)).returncode == 0
        async with agent(a_home, "legacy") as alice, agent(b_home, MODERN) as bob:
            data(await alice.call_tool("send_message", {"to": b.did, "text": "hi", "wait": True}))
            # Bob has no address for alice, yet his agent finds her among the peers.
            peers = data(await bob.call_tool("list_peers", {}))["peers"]
            assert [(p["did"], p["addr"], p["connected"]) for p in peers] == [(a_did, None, True)]
            named = data(await bob.call_tool("name_peer", {"peer": a_did, "name": "alice"}))
            assert named == {
                "did": a_did, "name": "alice", "addr": None, "connected": True, "allowed": True
            }  # fmt: skip
            assert data(await bob.call_tool("list_peers", {}))["peers"][0]["name"] == "alice"
            # The per-peer inbox resource takes the name too; a bad peer is an error.
            inbox = await bob.read_resource("talos://inbox/alice")
            assert '"hi"' in inbox.contents[0].text  # type: ignore[union-attr]
            with pytest.raises(Exception, match="not-a-name!"):
                await bob.read_resource("talos://inbox/not-a-name!")
            reply = {"to": "alice", "text": "hello", "wait": True, "timeout_seconds": 30}
            assert data(await bob.call_tool("send_message", reply))["acked"] is True
            # A wait for a peer that can never link (no address, not allowed in) fails at once,
            stranger = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
            start = asyncio.get_running_loop().time()
            text = error_text(
                await bob.call_tool(
                    "send_message",
                    {"to": stranger, "text": "x", "wait": True, "timeout_seconds": 60},
                )
            )
            assert asyncio.get_running_loop().time() - start < 20
            assert "check the DID" in text and "nothing was sent" in text
            # ... and without a wait it is queued: the agent sees it waiting, and why.
            data(await bob.call_tool("send_message", {"to": stranger, "text": "x"}))
            (queue,) = data(await bob.call_tool("list_outbox", {}))["peers"]
            assert queue["did"] == stranger and queue["count"] == 1
            assert queue["state"] == "no_address" and "talosd peers add" in queue["why"]
            assert data(await bob.call_tool("list_outbox", {"peer": "alice"}))["peers"] == []
    finally:
        a.stop()
        b.stop()


async def test_in_process_node_says_so_on_stderr(tmp_path: Path) -> None:
    home = tmp_path / "solo"
    init(home)
    proc = await raw_mcp(home, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None and proc.stdin is not None
    try:
        async with asyncio.timeout(60):
            line = await proc.stderr.readline()
        text = line.decode()
        assert "no node was running" in text and "talosd run --home" in text, text
        # In talosd run's key=value format, so a warning's fields are not lost.
        assert text.startswith("ts=") and " level=warning logger=talos.agent_mcp " in text, text
        assert "127.0.0.1:" in text  # where this in-process node listens
    finally:
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 60)


async def _raw_status(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    """initialize, then node_status, over the raw stdio of one ``talosd mcp``."""
    assert proc.stdin is not None and proc.stdout is not None
    hello = {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"},
    }
    for message in (
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": "node_status", "arguments": {}},
        },
    ):
        proc.stdin.write(json.dumps(message).encode() + b"\n")
    await proc.stdin.drain()
    while True:
        reply = json.loads(await proc.stdout.readline())
        if reply.get("id") == 1:  # serverInfo names the installed release
            assert reply["result"]["serverInfo"]["version"] == version("talos"), reply
        if reply.get("id") == 2:
            return dict(reply["result"]["structuredContent"])


async def test_two_agents_starting_at_once_share_one_node(tmp_path: Path) -> None:
    """Both find no node and race for the home: the loser attaches to the winner's node."""
    home = tmp_path / "raced"
    init(home)
    procs = [await raw_mcp(home) for _ in range(2)]
    try:
        async with asyncio.timeout(60):
            first, second = await asyncio.gather(*(_raw_status(p) for p in procs))
        assert first["did"] == second["did"]
        assert sorted((first["mode"], second["mode"])) == ["attached", "in-process"]
    finally:
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in procs:
            await asyncio.wait_for(proc.wait(), 60)


async def test_a_line_that_is_not_json_rpc_is_answered_with_a_parse_error(tmp_path: Path) -> None:
    home = tmp_path / "solo"
    init(home)
    proc = await raw_mcp(home)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        await _raw_status(proc)  # initialized, and serving
        proc.stdin.write(b'{"jsonrpc":"2.0","id":3,"method":\n')  # cut short
        proc.stdin.write(b'{"jsonrpc":"2.0","id":4,"method":"ping"}\n')
        await proc.stdin.drain()
        async with asyncio.timeout(30):
            first = json.loads(await proc.stdout.readline())
            second = json.loads(await proc.stdout.readline())
        assert first == {
            "jsonrpc": "2.0",
            "id": None,
            "error": {"code": -32700, "message": "Parse error: not JSON"},
        }
        assert second == {"jsonrpc": "2.0", "id": 4, "result": {}}
    finally:
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 60)


async def _status_soon(guest: Client) -> types.CallToolResult:
    """node_status, asked again after a tool error (the node it asked was going away)."""
    async with asyncio.timeout(60):
        while True:
            result = await guest.call_tool("node_status", {})
            if not result.is_error:
                return result
            assert "stopped" in error_text(result), error_text(result)
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_hands_the_node_over_and_ends_at_once(tmp_path: Path, signum: int) -> None:
    """SIGTERM / SIGINT stop it as the end of stdin does, without waiting for a stdin line."""
    home = tmp_path / "signalled"
    init(home)
    host = await raw_mcp(home)
    try:
        async with asyncio.timeout(60):
            assert (await _raw_status(host))["mode"] == "in-process"
        async with agent(home, MODERN) as guest:
            assert data(await guest.call_tool("node_status", {}))["mode"] == "attached"
            host.send_signal(signum)  # its stdin stays open
            assert await asyncio.wait_for(host.wait(), 30) == 128 + signum
            assert data(await _status_soon(guest))["mode"] == "in-process"
    finally:
        if host.returncode is None:
            host.kill()
            await host.wait()


async def test_when_the_agent_running_the_node_leaves_an_attached_agent_takes_it_over(
    tmp_path: Path,
) -> None:
    """The node is handed over: of the two attached agents one runs it, the other attaches."""
    home = tmp_path / "handed"
    init(home)
    host = await raw_mcp(home)
    assert host.stdin is not None
    try:
        async with asyncio.timeout(60):
            assert (await _raw_status(host))["mode"] == "in-process"
        async with agent(home, "legacy") as bob, agent(home, MODERN) as carol:
            for guest in (bob, carol):
                assert data(await guest.call_tool("node_status", {}))["mode"] == "attached"
            host.stdin.close()
            # At once, both, while the host's node is still stopping, as two agents would:
            # a call may meet the node going away (or, before it starts stopping, still
            # answer from it); the next one meets its successor.
            await asyncio.gather(*(_status_soon(guest) for guest in (bob, carol)))
            assert await asyncio.wait_for(host.wait(), 60) == 0
            after = await asyncio.gather(*(_status_soon(guest) for guest in (bob, carol)))
            modes = sorted(data(result)["mode"] for result in after)
            assert modes == ["attached", "in-process"]
            assert len({data(result)["did"] for result in after}) == 1
            for guest in (bob, carol):
                assert data(await guest.call_tool("read_inbox", {}))["messages"] == []
    finally:
        if host.returncode is None:
            host.kill()
            await host.wait()


async def test_a_relative_path_is_the_agents_not_the_nodes(tmp_path: Path) -> None:
    # The node (talosd run) works in another folder than the agent's talosd mcp: a
    # relative name read there would send another file, or none.
    work = tmp_path / "agent-work"
    work.mkdir()
    (work / "notes.txt").write_text("what the agent meant\n")
    with two_nodes(tmp_path) as (a, _b):
        async with Client(mcp_params(a.home, cwd=work), mode="legacy") as alice:
            got = data(await alice.call_tool("send_file", {"to": "bob", "path": "notes.txt"}))
    assert got["path"] == str(work / "notes.txt")


async def test_the_inbox_resource_keeps_text_as_utf8(tmp_path: Path) -> None:
    # Escaped, a 4-byte character took 12 bytes: a page three times its byte bound.
    with two_nodes(tmp_path) as (a, b):
        text = "weather \N{SUN WITH FACE} " * 100
        assert talosd("send", "--wait", "--home", str(b.home), "alice", text).returncode == 0
        async with agent(a.home, "legacy") as alice:
            inbox = await alice.read_resource("talos://inbox")
    body = inbox.contents[0].text  # type: ignore[union-attr]
    assert json.loads(body)["messages"][0]["text"] == text
    assert "\\ud83c" not in body and len(body.encode()) < 2 * len(text.encode())
