"""A refused tunnel link answers the agent at once with -32004 and the reason
(mcp_proxy/client.py), over the in-process loopback pair; the real-process
cases are in tests/mcp_proxy/test_refusals.py."""

from __future__ import annotations

import asyncio

from mcp_proxy.jsonrpc import LINK_DOWN, LINK_REFUSED
from mcp_proxy.policy import Policy
from tests.mcp_proxy.loopback import CLIENT_DID, EVERYTHING, SERVER_DID, Agent, Pair

TIMEOUT = 30
WHY = f"{SERVER_DID} refused the link: this node is not on its allow list (close code 4003)"


async def test_a_waiting_request_is_answered_at_the_refusal_not_after_link_wait() -> None:
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=EVERYTHING), link_wait=TIMEOUT * 10)
    agent = Agent(pair.client)
    try:
        pair.client_end.set_link(False)
        async with asyncio.timeout(TIMEOUT):  # far under link_wait: the refusal ends the wait
            rid, fut = agent.start_request("ping")
            waiting = asyncio.ensure_future(
                agent.send_raw(b'{"jsonrpc":"2.0","id":%d,"method":"ping"}' % rid)
            )
            await asyncio.sleep(0.05)
            assert not fut.done()  # waiting for the link
            pair.client_end.refuse(WHY)
            reply = await fut
            await waiting
        assert reply["error"]["code"] == LINK_REFUSED
        assert reply["error"]["message"] == f"tunnel link refused: {WHY}"
        # A new request redials first: refused again, it is answered the same way.
        redials = pair.client_end.redials
        async with asyncio.timeout(TIMEOUT):
            again = await agent.request("ping")
        assert again["error"]["code"] == LINK_REFUSED
        assert pair.client_end.redials == redials + 1
        assert pair.server.started_processes == 0
    finally:
        await pair.close()


async def test_a_lifted_refusal_is_not_reported_again() -> None:
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=EVERYTHING), link_wait=TIMEOUT * 10)
    agent = Agent(pair.client)
    try:
        pair.client_end.set_link(False)
        pair.client_end.refuse(WHY)
        await asyncio.sleep(0)  # the refusal reaches the client
        assert pair.client.down_error()[0] == LINK_REFUSED
        pair.client_end.set_link(True)  # e.g. the serving side now allows this DID
        assert pair.client.down_error()[0] == LINK_DOWN
        async with asyncio.timeout(TIMEOUT):
            reply = await agent.request("ping")
        assert reply["result"] == {}
    finally:
        await pair.close()
