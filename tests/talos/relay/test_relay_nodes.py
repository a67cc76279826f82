"""Two nodes that cannot dial each other (no --listen) talk through a real nats-server."""

from __future__ import annotations

import asyncio
from typing import Any

from talos.node import Node
from talos.views import outbox_json
from tests.talos.nodes import started, until
from tests.talos.relay.conftest import RelayNet


async def _pair(net: RelayNet) -> tuple[Node, Node]:
    a = await started(*net.home("a"))
    b = await started(*net.home("b"))
    a.allow(b.did)
    b.allow(a.did)
    return a, b


async def test_two_nodes_without_listen_exchange_messages(relay_net: RelayNet) -> None:
    a, b = await _pair(relay_net)
    try:
        assert a.listen_url is None and b.listen_url is None
        await a.send_message(b.did, "hello through the relay", wait=True)
        await b.send_message(a.did, "and back", wait=True)
        assert [m.text for m in b.inbox()] == ["hello through the relay"]
        assert [m.text for m in a.inbox()] == ["and back"]
        links = {link["did"]: link for link in a.status()["links"]}
        assert links[b.did]["via"] == "relay"
        assert a.status()["relay"]["connected"] is True
    finally:
        await a.stop()
        await b.stop()


async def test_recipient_offline_then_sender_offline_delivered_once(relay_net: RelayNet) -> None:
    a, b = await _pair(relay_net)
    home_b, config_b = relay_net.homes["b"]
    home_a, config_a = relay_net.homes["a"]
    await a.send_message(b.did, "first, both online", wait=True)  # a session exists now
    await b.stop()
    texts = [f"while b is away {i}" for i in range(5)]
    for text in texts:
        await a.send_message(b.did, text)
    relay = a.relay
    assert relay is not None
    await until(lambda: a.metrics.counters.get("mailbox_out", 0) >= 5, 20, "mailboxed")
    # Status and outbox say where the messages are, not that the peer is at fault.
    assert a.link_state(b.did) == ("mailboxed", "in the peer's relay mailbox until it connects")
    [row] = outbox_json(a, b.did)
    assert row["state"] == "mailboxed"
    assert {m["state"] for m in row["messages"]} == {"sent, awaiting ack"}
    # A send --wait ending now is timed out (exit 5) with that reason, not "unreachable".
    late = a.not_acked(b.did, 1.0)
    assert type(late) is TimeoutError and "relay mailbox" in str(late)
    await a.stop()  # the sender is gone when the recipient returns
    b = await started(home_b, config_b)
    b.allow(a.did)
    try:
        await until(lambda: len(b.inbox()) == 6, 30, "mailbox drained")
        assert [m.text for m in b.inbox()] == ["first, both online", *texts]
        # The sender comes back: its rows are acknowledged end to end, nothing twice.
        a = await started(home_a, config_a)
        a.allow(b.did)
        await until(lambda: a.status()["queues"]["outbox"] == 0, 30, "outbox acked")
        assert [m.text for m in b.inbox()] == ["first, both online", *texts]
    finally:
        await a.stop()
        await b.stop()
    await asyncio.sleep(0)


async def test_the_relay_sees_only_sealed_frames(relay_net: RelayNet) -> None:
    """Every packet either node publishes: no DID, no message text, no subject naming a DID."""
    a, b = await _pair(relay_net)
    seen: list[tuple[str, bytes]] = []
    for node in (a, b):
        assert node.relay is not None
        client = node.relay.client
        real = client._publish

        async def recording(subject: str, data: bytes, real: Any = real) -> None:
            seen.append((subject, data))
            await real(subject, data)

        client._publish = recording  # type: ignore[method-assign]
    try:
        text = "a message only its two ends may read"
        await a.send_message(b.did, text, wait=True)
        await b.send_message(a.did, text + " (reply)", wait=True)
        assert seen
        for subject, data in seen:
            for did in (a.did, b.did):
                assert did.encode() not in data
                assert did.removeprefix("did:key:") not in subject
            assert text.encode() not in data
    finally:
        await a.stop()
        await b.stop()
