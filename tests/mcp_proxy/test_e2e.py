"""The MCP tunnel (ADR 0003) through the real pieces: mcp SDK client -> talos-proxy connect
-> talos nodes over
WebSocket on 127.0.0.1 -> talos-proxy serve -> a real MCP tool (everything_server, mcp-server-time).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from mcp.shared.exceptions import MCPError

from mcp_proxy.audit_log import record_entries
from mcp_proxy.jsonrpc import INTERNAL_ERROR, LINK_DOWN, PARSE_ERROR, TOOL_DENIED
from tests.mcp_proxy.e2e import (
    Serve,
    did_of,
    http_connect,
    proxy,
    sdk_client,
    serving,
    start_serve,
)
from tests.mcp_proxy.sdk_callbacks import SDK_DEPRECATIONS_ALLOWED, elicitation, sampling, text

TIMEOUT = 60


pytestmark = SDK_DEPRECATIONS_ALLOWED


async def test_everything_through_the_tunnel(tmp_path: Path) -> None:
    client_did = did_of(tmp_path / "c")
    progress: list[float] = []
    logs: list[Any] = []

    async def on_progress(p: float, _t: float | None, _m: str | None) -> None:
        progress.append(p)

    async def on_log(params: Any) -> None:
        logs.append(params.data)

    async with (
        asyncio.timeout(TIMEOUT),
        serving(tmp_path / "s", ["--allow", client_did]) as serve,
        sdk_client(
            tmp_path / "c",
            serve.address,
            sampling_callback=sampling,
            elicitation_callback=elicitation,
            logging_callback=on_log,
        ) as client,
    ):
        assert client.server_info is not None and client.server_info.name == "everything"
        names = {t.name for t in (await client.list_tools()).tools}
        assert {"echo", "add", "slow", "sample", "elicit"} <= names
        assert text(await client.call_tool("add", {"a": 2, "b": 3})) == "5"
        slow = await client.call_tool(
            "slow", {"steps": 3, "delay": 0.01}, progress_callback=on_progress
        )
        assert text(slow) == "done 3"
        assert text(await client.call_tool("sample", {"prompt": "ping"})) == "model saw ping"
        assert text(await client.call_tool("elicit", {"question": "name?"})) == "hello ada"
        assert text(await client.call_tool("log", {"message": "hi"})) == "logged"
        resource = await client.read_resource("res://greeting")
        assert resource.contents[0].text == "hello from a resource"  # type: ignore[union-attr]
        templated = await client.read_resource("res://item/7")
        assert templated.contents[0].text == "item 7"  # type: ignore[union-attr]
        prompt = await client.get_prompt("review", {"code": "x = 1"})
        assert prompt.messages[0].content.text == "Please review: x = 1"  # type: ignore[union-attr]
        await client.send_ping()

        # Cancellation: the SDK sends notifications/cancelled; the session carries on.
        with anyio.move_on_after(0.3):
            await client.call_tool("slow", {"steps": 100, "delay": 0.05})
        results = await asyncio.gather(
            *(client.call_tool("add", {"a": i, "b": 1000}) for i in range(64))
        )
        assert [text(r) for r in results] == [str(i + 1000) for i in range(64)]
    assert progress == [1.0, 2.0, 3.0]
    assert logs == ["hi"]


async def test_mcp_server_time_as_the_tool(tmp_path: Path) -> None:
    client_did = did_of(tmp_path / "c")
    tool = [sys.executable, "-m", "mcp_server_time", "--local-timezone", "UTC"]
    async with (
        asyncio.timeout(TIMEOUT),
        serving(tmp_path / "s", ["--allow", client_did], tool) as serve,
        sdk_client(tmp_path / "c", serve.address) as client,
    ):
        names = {t.name for t in (await client.list_tools()).tools}
        assert "get_current_time" in names
        result = await client.call_tool("get_current_time", {"timezone": "UTC"})
        assert orjson.loads(text(result))["timezone"] == "UTC"


async def test_policy_denied_tool_and_filtered_list(tmp_path: Path) -> None:
    client_did = did_of(tmp_path / "c")
    args = ["--allow", client_did, "--tools", "echo,pid"]
    async with (
        asyncio.timeout(TIMEOUT),
        serving(tmp_path / "s", args) as serve,
        sdk_client(tmp_path / "c", serve.address) as client,
    ):
        assert sorted(t.name for t in (await client.list_tools()).tools) == ["echo", "pid"]
        pid = text(await client.call_tool("pid", {}))
        with pytest.raises(MCPError) as denied:
            await client.call_tool("crash", {"code": 3})
        assert denied.value.code == TOOL_DENIED
        assert f"tool 'crash' not allowed for {client_did}" in str(denied.value)
        # Never reached the tool: the same process still answers.
        assert text(await client.call_tool("pid", {})) == pid


async def test_unauthorised_did_refused_and_tool_never_started(tmp_path: Path) -> None:
    did_of(tmp_path / "c")
    someone_else = did_of(tmp_path / "other")
    async with (
        asyncio.timeout(TIMEOUT),
        serving(tmp_path / "s", ["--allow", someone_else]) as serve,
    ):
        with pytest.raises(Exception) as info:
            async with sdk_client(tmp_path / "c", serve.address, "--link-wait", "2") as client:
                await client.send_ping()
        assert "link" in repr(info.value) or "Connection closed" in repr(info.value)
    assert "event=tool_started" not in serve.log


async def test_tool_crash_then_next_call_gets_a_fresh_process(tmp_path: Path) -> None:
    client_did = did_of(tmp_path / "c")
    async with (
        asyncio.timeout(TIMEOUT),
        serving(tmp_path / "s", ["--allow", client_did]) as serve,
        sdk_client(tmp_path / "c", serve.address) as client,
    ):
        pid1 = text(await client.call_tool("pid", {}))
        with pytest.raises(MCPError) as crashed:
            await client.call_tool("crash", {"code": 3})
        assert crashed.value.code == INTERNAL_ERROR
        assert "tool process exited (code 3)" in str(crashed.value)
        pid2 = text(await client.call_tool("pid", {}))
    assert pid1 != pid2


async def test_link_drop_errors_pending_and_reconnects(tmp_path: Path) -> None:
    client_did = did_of(tmp_path / "c")
    serve = await start_serve(
        tmp_path / "s", "127.0.0.1:0", ["--allow", client_did], EVERYTHING_CMD
    )
    address = serve.address
    listen = address.removeprefix("ws://").split("#")[0]
    try:
        async with asyncio.timeout(TIMEOUT), sdk_client(tmp_path / "c", address) as client:
            pid1 = text(await client.call_tool("pid", {}))
            in_flight = asyncio.Event()

            async def on_progress(_p: float, _t: float | None, _m: str | None) -> None:
                in_flight.set()  # the tool has the call: the kill lands mid-request

            call = asyncio.create_task(
                client.call_tool(
                    "slow", {"steps": 200, "delay": 0.05}, progress_callback=on_progress
                )
            )
            await in_flight.wait()
            await serve.stop(signal.SIGKILL)
            with pytest.raises(MCPError) as dropped:
                await call
            assert dropped.value.code == LINK_DOWN
            serve = await restart_serve(tmp_path / "s", listen, ["--allow", client_did])
            # connect's node redials with backoff; the session is reopened and re-initialised.
            pid2 = text(await client.call_tool("pid", {}))
            assert pid2 != pid1
    finally:
        await serve.stop()


EVERYTHING_CMD = [sys.executable, "-m", "tests.tools.everything_server"]


async def restart_serve(home: Path, listen: str, args: list[str]) -> Serve:
    """Serve again on the port of a killed serve (bound with SO_REUSEADDR by asyncio).

    The old process has been reaped, so its listening socket is closed; a retry only
    covers the kernel still tearing it down.
    """
    for attempt in range(5):
        try:
            return await start_serve(home, listen, args, EVERYTHING_CMD)
        except RuntimeError:
            if attempt == 4:
                raise
            await asyncio.sleep(0.1 * (attempt + 1))
    raise AssertionError("unreachable")


async def test_malformed_json_rpc_both_ways(tmp_path: Path) -> None:
    client_did = did_of(tmp_path / "c")
    bad_tool = [sys.executable, "-m", "tests.tools.bad_server", "garbage"]
    async with (
        asyncio.timeout(TIMEOUT),
        serving(tmp_path / "s", ["--allow", client_did], bad_tool) as serve,
    ):
        proc = await proxy(
            "connect",
            "--home",
            str(tmp_path / "c"),
            "--peer",
            serve.address,
            stderr=subprocess.DEVNULL,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(b"{definitely not json\n")
            proc.stdin.write(b'{"jsonrpc":"2.0","id":1,"method":"ping"}\n')
            await proc.stdin.drain()
            first = orjson.loads(await proc.stdout.readline())
            assert first["id"] is None and first["error"]["code"] == PARSE_ERROR
            # The garbage tool answers with a junk line and then an id-only message: the
            # proxy turns the attributable one into an error for request 1.
            second = orjson.loads(await proc.stdout.readline())
            assert second["id"] == 1 and second["error"]["code"] == INTERNAL_ERROR
            assert "malformed response" in second["error"]["message"]
        finally:
            proc.stdin.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 15)
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0
    assert "event=tool_output_malformed" in serve.log


async def test_streamable_http_through_real_nodes(tmp_path: Path) -> None:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    client_did = did_of(tmp_path / "c")
    async with (
        asyncio.timeout(TIMEOUT),
        serving(tmp_path / "s", ["--allow", client_did]) as serve,
        http_connect(tmp_path / "c", serve.address) as (url, token),
    ):
        token_file = tmp_path / "c" / "proxy-http.token"
        assert os.stat(token_file).st_mode & 0o777 == 0o600
        async with (
            httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=30) as http,
            Client(streamable_http_client(url, http_client=http), mode="legacy") as client,
        ):
            assert text(await client.call_tool("echo", {"text": "over http"})) == "over http"


async def test_policy_file_named_servers_and_strict_audit_in_the_block_log(tmp_path: Path) -> None:
    from talos.chain.log import BlockLog
    from talos.config import Home
    from talos.store import Store
    from talos_sdk.keyfile import load_wallet

    client_did = did_of(tmp_path / "c")
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f"""
[servers.time]
command = "{sys.executable}"
args = ["-m", "mcp_server_time", "--local-timezone", "UTC"]

[servers.everything]
command = "{sys.executable}"
args = ["-m", "tests.tools.everything_server"]

[peers."{client_did}"]
servers = ["time"]
tools = ["get_current_time"]
"""
    )
    serve_home = tmp_path / "s"
    args = ["--policy", str(policy), "--audit", "strict"]
    async with asyncio.timeout(TIMEOUT):
        serve = await start_serve(serve_home, "127.0.0.1:0", args, [])
        try:
            async with sdk_client(tmp_path / "c", serve.address, "--server", "time") as client:
                names = [t.name for t in (await client.list_tools()).tools]
                assert names == ["get_current_time"]
                result = await client.call_tool("get_current_time", {"timezone": "UTC"})
                assert orjson.loads(text(result))["timezone"] == "UTC"
                with pytest.raises(MCPError) as denied:
                    await client.call_tool("convert_time", {})
                assert denied.value.code == TOOL_DENIED
        finally:
            assert await serve.stop() == 0
    # The serve node sealed its log on exit: every call is an "mcp" record, no plaintext.
    home = Home(serve_home)
    store = Store(home.store_dir)
    try:
        log = BlockLog(store, load_wallet(home.identity))
        records = [
            r for h in range(log.height + 1) for r in log.block_records(h) if r.kind == "mcp"
        ]
        audited = [e.body for r in records for e in record_entries(r, None)]
    finally:
        store.close()
    assert all(r.recipient == client_did and r.extra == b"" for r in records)
    calls = {(a["method"], a["tool"], a["outcome"]) for a in audited if a["event"] == "call"}
    assert ("tools/call", "get_current_time", "ok") in calls
    assert ("tools/call", "convert_time", "denied") in calls
    assert ("tools/list", None, "ok") in calls
    assert all(a["server"] == "time" for a in audited)
    ok_call = next(a for a in audited if a["tool"] == "get_current_time")
    assert len(ok_call["params_hmac"]) == 64 and len(ok_call["result_hmac"]) == 64
    sessions = [(a["method"], a["outcome"]) for a in audited if a["event"] == "session"]
    assert sessions[0] == ("open", "ok") and ("close", "ok") in sessions


async def test_messages_above_one_link_frame_cross_intact(tmp_path: Path) -> None:
    # 2 MiB each way: the node's link frames are bounded at 1 MiB (docs/adr/0003-mcp-tunnel.md).
    client_did = did_of(tmp_path / "c")
    size = 2 * 1024 * 1024
    async with (
        asyncio.timeout(TIMEOUT),
        serving(tmp_path / "s", ["--allow", client_did]) as serve,
        sdk_client(tmp_path / "c", serve.address) as client,
    ):
        resource = await client.read_resource(f"res://big/{size}")
        body = resource.contents[0].text  # type: ignore[union-attr]
        assert len(body) == size and body == "x" * size
        sent = "y" * size
        assert text(await client.call_tool("echo", {"text": sent})) == sent
        # The session carries on with ordinary messages afterwards.
        assert text(await client.call_tool("add", {"a": 1, "b": 2})) == "3"
