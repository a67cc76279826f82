"""Flow control through a node's local socket: an attached ``talos-proxy serve`` whose
tool falls behind its caller (mcp_proxy/server.py ``check_input``, talos/local/server.py
``APP_STALL_LIMIT``).

Two real nodes in this process, linked on 127.0.0.1; the serve's TunnelServer is
attached to node A through its socket (mcp_proxy/attach.py) and runs the real
``bad_server nap`` tool; the caller's TunnelClient is embedded in node B.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from mcp_proxy.attach import attach
from mcp_proxy.client import TunnelClient
from mcp_proxy.policy import Policy
from mcp_proxy.server import TunnelServer
from mcp_proxy.transport import NodeTransport
from talos.local import conn as local_conn
from tests.mcp_proxy.loopback import Agent, bad_tool
from tests.talos.local.test_server import started
from tests.talos.nodes import addr, make_home, until

TIMEOUT = 60


async def test_an_attached_serve_with_a_slow_tool_keeps_reading_its_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tool naps for 3 s while its caller sends 4 MB. The serve pauses that session's
    # caller (PAUSE) and goes on reading its node, so the node never takes it for a stuck
    # claimer (APP_STALL_LIMIT, 1 s here) and the link carries a message meanwhile; once
    # the tool reads again, every line reaches it.
    monkeypatch.setattr(local_conn, "APP_STALL_LIMIT", 1.0)
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(TIMEOUT):
        stack.push_async_callback(b.stop)
        stack.push_async_callback(a.stop)
        attached = await attach(a.home.path)
        assert attached is not None
        stack.push_async_callback(attached.close)
        server = TunnelServer(attached, Policy.build(allow=[b.did], command=bad_tool("nap")))
        stack.push_async_callback(server.stop)
        await attached.claim(None, keyed=False, allow=[b.did])
        client = TunnelClient(NodeTransport(b.node), a.did)
        stack.push_async_callback(client.close)
        a.allow(b.did)
        await b.add_peer(addr(a.node))
        agent = Agent(client)
        assert (await agent.request("nap", {"seconds": 3}))["result"] == {"read": 1}

        async def fill() -> None:
            for i in range(40):  # a line per stdin read, as connect's reader hands them on
                await agent.notify("notifications/filler", {"i": i, "text": "f" * 100_000})
                await asyncio.sleep(0.01)

        filling = asyncio.ensure_future(fill())
        stack.callback(filling.cancel)
        await until(lambda: agent.session.held, what="the caller's session to be paused")
        await asyncio.wait_for(b.send_message(a.did, "through the nap", wait=True), 2.5)
        assert not filling.done()  # still napping: the message did not wait for the tool
        await filling
        assert (await agent.request("ping"))["result"] == {"read": 42}
        assert a.metrics.counters.get("local_clients_too_slow", 0) == 0
        assert not attached.gone.done()
