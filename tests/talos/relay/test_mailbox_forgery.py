"""Mail under a real sender's name that the sender never signed, from another account on
the same relay (talos/relay/envelope.py, talos/relay/attach.py): refused at the envelope,
before the node decides to leave mail with the relay. Real nats-server, real nodes."""

from __future__ import annotations

import asyncio
import os

from talos.link import wire as link_wire
from talos.node import Node
from talos.relay.client import MAILBOX_CONSUMER
from talos.relay.envelope import seal_envelope
from talos.relay.names import RelayNames
from talos_sdk.wallet import Wallet
from tests.talos.nodes import started, until
from tests.talos.relay.conftest import RelayNet, rogue_connection

#: JetStream's default bound on a consumer's unacknowledged messages.
FORGED = 1000


def _texts(node: Node) -> list[str]:
    return [m.text for m in node.inbox()]


async def test_forged_mail_of_a_held_sender_cannot_stop_the_mailbox(relay_net: RelayNet) -> None:
    # A keeps its session with B but B no longer lets it link: B leaves A's mail with
    # the relay, unacknowledged. A rogue account mailed B a thousand envelopes claiming
    # A; left unacknowledged they filled the consumer's bound and C's mail never came.
    a = await started(*relay_net.home("a"))
    b = await started(*relay_net.home("b"))
    c = await started(*relay_net.home("c"))
    home_b, config_b = relay_net.homes["b"]
    nc = None
    try:
        async with asyncio.timeout(90):
            a.allow(b.did)
            b.allow(a.did)
            b.allow(c.did)
            c.allow(b.did)
            await a.send_message(b.did, "A while allowed", wait=True)
            await c.send_message(b.did, "C linked", wait=True)
            await a.stop()
            await b.stop()
            nc = await rogue_connection(relay_net)
            js = nc.jetstream()
            mailbox = RelayNames.for_did(b.did).mailbox
            rogue_sign = Wallet.generate().sign
            for i in range(FORGED):
                frame = link_wire.encode(link_wire.Msg(i + 2, os.urandom(64)))
                await js.publish(
                    mailbox, seal_envelope(b.did, a.did, rogue_sign, frame, b"\1" * 32)
                )
            await c.send_message(b.did, "from C, by mailbox")
            await until(lambda: c.metrics.counters.get("mailbox_out", 0) >= 1, 30, "mailboxed")
            await c.stop()  # only the mailbox can deliver now
            b = await started(home_b, config_b)
            b.allow(c.did)  # and not A
            await until(lambda: "from C, by mailbox" in _texts(b), 45, "C's mail")
            await until(
                lambda: b.metrics.counters.get("mailbox_rejected", 0) >= FORGED, 30, "refused"
            )
            assert b.metrics.counters.get("mailbox_held", 0) == 0
            assert b.relay is not None
            js_b = b.relay.client._js
            stream = RelayNames.for_did(b.did).stream
            info = await js_b.consumer_info(stream, MAILBOX_CONSUMER)
            assert info.config.max_ack_pending == -1  # genuine held mail cannot block either
            while info.num_ack_pending or info.num_pending:  # every forgery acked, gone
                await asyncio.sleep(0.1)
                info = await js_b.consumer_info(stream, MAILBOX_CONSUMER)
    finally:
        if nc is not None:
            await nc.close()
        for node in (a, b, c):
            await node.stop()


async def test_a_mailbox_consumer_made_with_the_default_bound_is_made_again(
    relay_net: RelayNet,
) -> None:
    # Made by an earlier version with JetStream's default bound (1,000): it is made
    # again with none (mail it had not acknowledged stays in the work-queue stream).
    from nats.js.api import ConsumerConfig

    b = await started(*relay_net.home("b"))
    home_b, config_b = relay_net.homes["b"]
    names = RelayNames.for_did(b.did)
    nc = await rogue_connection(relay_net, b.wallet)  # b's own account, beside the node
    js = nc.jetstream()

    async def bound() -> int | None:
        try:
            info = await js.consumer_info(names.stream, MAILBOX_CONSUMER)
        except Exception:  # not made yet
            return None
        return int(info.config.max_ack_pending)

    try:
        async with asyncio.timeout(60):
            while await bound() is None:
                await asyncio.sleep(0.1)
            await b.stop()
            await js.delete_consumer(names.stream, MAILBOX_CONSUMER)
            old = ConsumerConfig(
                name=MAILBOX_CONSUMER, durable_name=MAILBOX_CONSUMER, filter_subject=names.mailbox
            )
            await js.add_consumer(names.stream, old)
            assert await bound() == 1000
            b = await started(home_b, config_b)
            while await bound() != -1:
                await asyncio.sleep(0.1)
    finally:
        await nc.close()
        await b.stop()
