"""An agent whose DID the serving peer does not allow reads a refusal, not an outage.

Real processes: ``talos-proxy serve`` (allowing someone else), ``talos-proxy
connect`` embedded and attached to a running ``talosd run``, the official MCP
SDK client as the agent. The refusal must answer the agent's request long
before ``--link-wait`` (60 s here) would have; the bound asserted is generous.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError

from mcp_proxy.jsonrpc import LINK_DOWN, LINK_REFUSED
from tests.mcp_proxy.e2e import connect_params, did_of, serving
from tests.talos.daemons import Daemon, fast_config, talosd

LINK_WAIT = "60"
GENEROUS = 30.0


def _mcp_error(exc: BaseException) -> MCPError | None:
    """The MCPError inside what the SDK raised (its task group wraps it)."""
    if isinstance(exc, MCPError):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = _mcp_error(inner)
        if found is not None:
            return found
    return None


async def _refused(params: object) -> tuple[MCPError, float]:
    """The agent's first request (initialize) is answered with an error; how long it took."""
    started = time.monotonic()
    with pytest.raises(BaseException) as info:
        async with Client(params, mode="legacy") as client:  # type: ignore[arg-type]
            await client.list_tools()
    error = _mcp_error(info.value)
    assert error is not None, repr(info.value)
    return error, time.monotonic() - started


async def test_embedded_connect_answers_with_the_refusal(tmp_path: Path) -> None:
    did_of(tmp_path / "c")
    someone_else = did_of(tmp_path / "other")
    async with asyncio.timeout(120), serving(tmp_path / "s", ["--allow", someone_else]) as serve:
        params = connect_params(tmp_path / "c", serve.address, "--link-wait", LINK_WAIT)
        error, elapsed = await _refused(params)
        server_did = serve.address.split("#", 1)[1]
        assert error.code == LINK_REFUSED
        assert f"{server_did} refused the link: this node is not on its allow list" in str(error)
        assert "is down" not in str(error)
        assert elapsed < GENEROUS


async def test_attached_connect_answers_with_the_refusal(tmp_path: Path) -> None:
    home = tmp_path / "agents"
    assert talosd("init", "--home", str(home), "--no-passphrase").returncode == 0
    fast_config(home, listen="127.0.0.1:0")
    node = Daemon(home)
    try:
        someone_else = did_of(tmp_path / "other")
        async with (
            asyncio.timeout(120),
            serving(tmp_path / "s", ["--allow", someone_else]) as serve,
        ):
            params = connect_params(home, serve.address, "--link-wait", LINK_WAIT)
            error, elapsed = await _refused(params)
            server_did = serve.address.split("#", 1)[1]
            assert error.code == LINK_REFUSED
            assert f"{server_did} refused the link: this node is not on its allow list" in str(
                error
            )
            assert elapsed < GENEROUS
            # The node the proxy attached to shows the same refusal.
            status = await asyncio.to_thread(talosd, "status", "--home", str(home))
            assert "this node is not on its allow list" in status.stdout
    finally:
        node.stop()


@pytest.mark.parametrize("attached", [False, True], ids=["embedded", "attached"])
async def test_a_serve_side_that_is_down_is_named_with_the_reason(
    tmp_path: Path, attached: bool
) -> None:
    """Nothing listens at the address: after --link-wait the agent reads why, not only that."""
    home = tmp_path / "c"
    absent = did_of(tmp_path / "absent")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    node = None
    if attached:
        assert talosd("init", "--home", str(home), "--no-passphrase").returncode == 0
        fast_config(home, listen="127.0.0.1:0")
        node = Daemon(home)
    else:
        did_of(home)
    try:
        async with asyncio.timeout(120):
            params = connect_params(home, f"ws://127.0.0.1:{port}#{absent}", "--link-wait", "2")
            error, _ = await _refused(params)
        assert error.code == LINK_DOWN
        assert f"tunnel link to {absent} is down: {absent} is unreachable: " in str(error), error
    finally:
        if node is not None:
            node.stop()
