"""Relay trouble: down at start, restarting mid-stream, full, rogue clients, replays.

Each case keeps the nodes running, loses nothing acknowledged and delivers
nothing twice (docs/adr/0010-nats-relay.md "Consequences").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
from typing import Any

import nats.errors
import pytest
from nats.js.errors import NoStreamResponseError

from talos import pipeline as pl
from talos.link import wire as link_wire
from talos.link.handshake import LinkHandshake, Role
from talos.node import Node
from talos.relay import attach as relay_attach
from talos.relay import wire
from talos.relay.envelope import seal_envelope
from talos.relay.names import RelayNames, nkey_seed
from talos_sdk.bundle import x25519_keypair
from talos_sdk.ratchet import MAX_SKIP
from talos_sdk.wallet import Wallet
from tests.talos.nodes import started, until
from tests.talos.relay.conftest import RelayNet, rogue_connection


async def _pair(net: RelayNet, **overrides: object) -> tuple[Node, Node]:
    a = await started(*net.home("a", **overrides))
    b = await started(*net.home("b", **overrides))
    a.allow(b.did)
    b.allow(a.did)
    return a, b


def _texts(node: Node) -> list[str]:
    return [m.text for m in node.inbox()]


async def test_relay_down_at_start_then_up(relay_net: RelayNet) -> None:
    server = relay_net.server
    assert server is not None
    a, b = await _pair(relay_net)
    try:
        server.stop()
        await a.stop()
        await b.stop()
        home_a, config_a = relay_net.homes["a"]
        home_b, config_b = relay_net.homes["b"]
        a = await started(home_a, config_a)  # the relay is down: the node runs anyway
        b = await started(home_b, config_b)
        a.allow(b.did)
        b.allow(a.did)
        assert a.status()["relay"]["connected"] is False
        sending = asyncio.ensure_future(a.send_message(b.did, "waited for the relay", wait=True))
        await asyncio.sleep(0.5)
        assert not sending.done()
        server.start()
        await asyncio.wait_for(sending, 60)
        assert _texts(b) == ["waited for the relay"]
    finally:
        await a.stop()
        await b.stop()


async def test_relay_restart_mid_stream_delivers_each_once(relay_net: RelayNet) -> None:
    server = relay_net.server
    assert server is not None
    a, b = await _pair(relay_net)
    try:
        await a.send_message(b.did, "m0", wait=True)
        texts = [f"m{i}" for i in range(1, 41)]
        sends = []
        for i, text in enumerate(texts):
            sends.append(asyncio.ensure_future(a.send_message(b.did, text, wait=True)))
            if i == 15:
                await asyncio.to_thread(server.restart)
            await asyncio.sleep(0.005)
        await asyncio.wait_for(asyncio.gather(*sends), 90)
        assert _texts(b) == ["m0", *texts]
        await until(lambda: a.status()["queues"]["outbox"] == 0, 20, "acked rows dropped")
    finally:
        await a.stop()
        await b.stop()


async def test_rogue_garbage_and_replayed_mail_change_nothing(relay_net: RelayNet) -> None:
    a, b = await _pair(relay_net)
    home_b, config_b = relay_net.homes["b"]
    sent: list[bytes] = []
    assert a.relay is not None
    client = a.relay.client
    real_put = client.put_mailbox

    async def recording_put(did: str, envelope: bytes) -> None:
        await real_put(did, envelope)
        sent.append(envelope)  # what an operator of the relay could record

    client.put_mailbox = recording_put  # type: ignore[method-assign]
    nc = await rogue_connection(relay_net)
    try:
        await a.send_message(b.did, "before", wait=True)
        await b.stop()
        await a.send_message(b.did, "mailed")
        await until(lambda: len(sent) >= 1, 20, "mailboxed")
        b = await started(home_b, config_b)
        b.allow(a.did)
        await until(lambda: _texts(b) == ["before", "mailed"], 30, "drained")
        names = RelayNames.for_did(b.did)
        js = nc.jetstream()
        for envelope in sent:  # replayed mail
            await js.publish(names.mailbox, envelope)
        await js.publish(names.mailbox, b"garbage" * 10)
        await nc.publish(names.link, b"garbage")
        await nc.publish(names.link, wire.encode(wire.Data(bytes(16), 0, False, b"x")))
        await nc.flush()
        await until(lambda: b.metrics.counters.get("mailbox_rejected", 0) >= 2, 20, "rejected")
        await a.send_message(b.did, "after", wait=True)
        assert _texts(b) == ["before", "mailed", "after"]
        # The link may be between two attempts at the instant the ack lands (seen once
        # in CI on a quiet machine); what must hold is that it is up, not lost for good.
        await until(lambda: b.is_connected(a.did) and a.is_connected(b.did), 20, "linked")
    finally:
        await nc.close()
        await a.stop()
        await b.stop()


async def test_third_party_packets_leave_a_healthy_relayed_link_alone(relay_net: RelayNet) -> None:
    # A third party allowed on the relay can publish to a node's link subject but cannot
    # learn a stream id (16 random bytes, subjects it may not subscribe to): whatever it
    # sends there is refused or dropped by the client and never reaches a running stream.
    a, b = await _pair(relay_net)
    rogue = Wallet.generate()
    nc = await rogue_connection(relay_net, rogue)
    try:
        await a.send_message(b.did, "before", wait=True)
        await until(lambda: b.is_connected(a.did) and a.is_connected(b.did), 20, "linked")
        links = (a._peers[b.did].link, b._peers[a.did].link)
        assert None not in links
        assert b.relay is not None
        counters = b.relay.client.counters
        link_subject = RelayNames.for_did(b.did).link
        forged = [
            b"garbage",  # shorter than any header: rejected
            wire.encode(wire.Open(os.urandom(16), "abc")),  # in another node's name: forged
            # In its own name but with no reply subject: rejected.
            wire.encode(wire.Open(os.urandom(16), RelayNames.for_did(rogue.did).token)),
            wire.encode(wire.Data(os.urandom(16), 0, False, b"x")),  # unknown streams: dropped
            wire.encode(wire.Close(os.urandom(16), 4020, "forged")),
            wire.encode(wire.Accept(os.urandom(16))),
        ]
        for packet in forged:
            await nc.publish(link_subject, packet)
        await nc.flush()
        await until(
            lambda: (
                counters.get("relay_packets_rejected", 0) >= 2
                and counters.get("relay_packets_forged", 0) >= 1
                and counters.get("relay_packets_dropped", 0) >= 3
            ),
            20,
            "forged packets counted",
        )
        await a.send_message(b.did, "after", wait=True)
        assert _texts(b) == ["before", "after"]
        assert a._peers[b.did].link is links[0] and b._peers[a.did].link is links[1]
    finally:
        await nc.close()
        await a.stop()
        await b.stop()


async def test_rogue_cannot_subscribe_to_a_node_subjects(relay_net: RelayNet) -> None:
    a, b = await _pair(relay_net)
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    import nats

    server = relay_net.server
    assert server is not None
    rogue = Wallet.generate()
    server.reload([rogue.did])
    nc = await nats.connect(
        servers=[server.url],
        nkeys_seed_str=nkey_seed(rogue.seed),
        allow_reconnect=False,
        error_cb=on_error,
    )
    try:
        got: list[bytes] = []

        async def cb(msg: Any) -> None:
            got.append(msg.data)

        await nc.subscribe(RelayNames.for_did(b.did).link, cb=cb)
        await nc.flush()
        await a.send_message(b.did, "private", wait=True)
        await until(lambda: bool(errors), 10, "permissions violation reported")
        assert "permissions violation" in str(errors[0]).lower()
        assert got == []
    finally:
        await nc.close()
        await a.stop()
        await b.stop()


async def test_a_rogue_mailbox_stream_cannot_record_other_nodes_traffic(
    relay_net: RelayNet,
) -> None:
    """Permissions cannot bound a stream's subjects; the rogue's own account does."""
    import nats
    from nats.js.api import StorageType, StreamConfig

    a, b = await _pair(relay_net)
    home_b, config_b = relay_net.homes["b"]
    server = relay_net.server
    assert server is not None
    wallet = Wallet.generate()
    server.reload([wallet.did])
    rogue = RelayNames.for_did(wallet.did)
    nc = await nats.connect(
        servers=[server.url],
        nkeys_seed_str=nkey_seed(wallet.seed),
        inbox_prefix=rogue.inbox_prefix,
        allow_reconnect=False,
    )
    try:
        js = nc.jetstream()
        wide = ["talos.link.*", "talos.mbox.*", "_INBOX.>"]
        await js.add_stream(
            StreamConfig(name=rogue.stream, subjects=wide, storage=StorageType.FILE)
        )
        await a.send_message(b.did, "linked", wait=True)  # link packets, OPEN and replies
        await b.stop()
        await a.send_message(b.did, "mailed")  # into B's mailbox
        b = await started(home_b, config_b)
        b.allow(a.did)
        await until(lambda: _texts(b) == ["linked", "mailed"], 30, "drained")
        # What it holds is its own (the JetStream API's answer to its own create, say).
        info = await js.stream_info(rogue.stream, subjects_filter=">")
        subjects = list(info.state.subjects or {})
        others = [RelayNames.for_did(node.did).token for node in (a, b)]
        assert not [s for s in subjects if any(token in s for token in others)], subjects
    finally:
        await nc.close()
        await a.stop()
        await b.stop()


async def test_full_mailbox_keeps_messages_queued(relay_net: RelayNet) -> None:
    a, b = await _pair(relay_net, mailbox_max_bytes=1 << 16)
    home_b, config_b = relay_net.homes["b"]
    try:
        await a.send_message(b.did, "hello", wait=True)
        await b.stop()
        texts = [f"{i:03d} " + "p" * 3000 for i in range(40)]  # ~140 KiB sealed: above 64 KiB
        for text in texts:
            await a.send_message(b.did, text)
        await until(lambda: a.metrics.counters.get("mailbox_full", 0) >= 1, 30, "mailbox full")
        assert a.status()["queues"]["outbox"] == 40  # nothing dropped by the relay's refusal
        b = await started(home_b, config_b)
        b.allow(a.did)
        await until(lambda: a.status()["queues"]["outbox"] == 0, 60, "all acked")
        assert _texts(b) == ["hello", *texts]
    finally:
        await a.stop()
        await b.stop()


async def test_a_message_above_the_relays_bound_waits_for_a_link_and_says_so(
    relay_net: RelayNet, caplog: pytest.LogCaptureFixture
) -> None:
    # 4 MiB frames over a relay whose messages stop at 1 MiB: the big message cannot be
    # mailed (relayed links chunk it, the mailbox cannot). It was reported as "mailbox
    # full" every 30 s and sealed again each time, spending a ratchet key per try.
    a, b = await _pair(relay_net, max_frame=4 << 20)
    home_b, config_b = relay_net.homes["b"]
    try:
        await a.send_message(b.did, "hello", wait=True)
        await b.stop()
        big = "x" * pl.text_limit(4 << 20)
        with caplog.at_level(logging.WARNING, logger="talos.relay"):
            await a.send_message(b.did, big)
            await a.send_message(b.did, "small, behind it")
            await until(lambda: a.metrics.counters.get("mailbox_too_large", 0) >= 1, 30, "said")
        assert a.metrics.counters.get("mailbox_full", 0) == 0
        assert [r.getMessage() for r in caplog.records].count("mailbox_message_too_large") == 1
        b = await started(home_b, config_b)
        b.allow(a.did)
        await until(lambda: a.status()["queues"]["outbox"] == 0, 60, "all acked")
        assert _texts(b) == ["hello", big, "small, behind it"]
    finally:
        await a.stop()
        await b.stop()


async def test_relay_storage_holds_no_message_text(relay_net: RelayNet) -> None:
    server = relay_net.server
    assert server is not None
    a, b = await _pair(relay_net)
    try:
        await a.send_message(b.did, "warm up", wait=True)
        await b.stop()
        secret = "the secret text nobody on the relay may read"
        await a.send_message(b.did, secret)
        await until(lambda: a.metrics.counters.get("mailbox_out", 0) >= 1, 20, "mailboxed")
        stored = server.store_bytes()
        assert len(stored) > 0
        assert secret.encode() not in stored
        assert a.did.encode() not in stored and b.did.encode() not in stored
    finally:
        await a.stop()
        await b.stop()


async def test_packets_another_account_forges_are_dropped(relay_net: RelayNet) -> None:
    # The relay stamps the publisher's account on what crosses to B's account and
    # overwrites a stamp the publisher wrote itself: a rogue that learnt a live stream
    # id still cannot close the link, and cannot open a stream in A's name.
    a, b = await _pair(relay_net)
    nc = await rogue_connection(relay_net)
    try:
        await a.send_message(b.did, "before", wait=True)
        await until(lambda: b.is_connected(a.did) and a.is_connected(b.did), 20, "linked")
        links = (a._peers[b.did].link, b._peers[a.did].link)
        assert b.relay is not None
        client = b.relay.client
        await until(lambda: client.vouched, 10, "B told it has an account of its own")
        (stream_id,) = list(client._streams)
        link_subject = RelayNames.for_did(b.did).link
        as_a = {"Nats-Request-Info": f'{{"acc":"{RelayNames.for_did(a.did).account}"}}'}
        await nc.publish(link_subject, wire.encode(wire.Close(stream_id, 4020, "x")), headers=as_a)
        await nc.publish(link_subject, wire.encode(wire.Data(stream_id, 1, False, b"x")))
        a_token = RelayNames.for_did(a.did).token
        opening = wire.encode(wire.Open(os.urandom(16), a_token))
        with contextlib.suppress(nats.errors.TimeoutError):
            answer = await nc.request(link_subject, opening, timeout=1, headers=as_a)
            raise AssertionError(f"a forged OPEN was answered: {answer.data!r}")
        await until(
            lambda: client.counters.get("relay_packets_forged", 0) >= 3, 20, "forged counted"
        )
        assert list(client._streams) == [stream_id]
        await a.send_message(b.did, "after", wait=True)
        assert _texts(b) == ["before", "after"]
        assert a._peers[b.did].link is links[0] and b._peers[a.did].link is links[1]
    finally:
        await nc.close()
        await a.stop()
        await b.stop()


async def _half_open(nc: Any, rogue: Wallet, peer_link: str) -> None:
    """Open a relay stream as ``rogue`` and send handshake message 1, then nothing more.

    The peer answers message 1 and waits for message 3 for its whole
    ``handshake_timeout``, holding an admission slot all that time.
    """
    stream_id = os.urandom(16)
    opening = wire.encode(wire.Open(stream_id, RelayNames.for_did(rogue.did).token))
    answer = await nc.request(peer_link, opening, timeout=10)
    assert isinstance(wire.decode(answer.data), wire.Accept)
    first = LinkHandshake(rogue, Role.INITIATOR).start()  # type: ignore[arg-type]
    assert first is not None
    for packet in wire.StreamState(stream_id, 1 << 20, 1 << 16).packets(first):
        await nc.publish(peer_link, packet)


async def test_an_open_flood_from_one_account_leaves_other_relayed_links_alone(
    relay_net: RelayNet,
) -> None:
    # Relayed handshakes count against their opener's account: a rogue holding as many
    # half-done handshakes as B admits from one source does not keep A from linking.
    b = await started(*relay_net.home("b", handshake_timeout=60.0))
    rogue = Wallet.generate()
    nc = await rogue_connection(relay_net, rogue)
    a: Node | None = None
    try:
        assert b.relay is not None
        client = b.relay.client
        await until(lambda: client.vouched, 20, "B on the relay, in an account of its own")
        link_subject = RelayNames.for_did(b.did).link
        await asyncio.gather(*(_half_open(nc, rogue, link_subject) for _ in range(12)))
        await until(
            lambda: b.metrics.counters.get("handshakes_refused", 0) >= 4, 20, "flood bounded"
        )
        a = await started(*relay_net.home("a"))
        a.allow(b.did)
        b.allow(a.did)
        # The rogue's eight handshakes hold on for 60 s; A's link does not wait for them.
        await asyncio.wait_for(a.send_message(b.did, "through", wait=True), 20)
        assert _texts(b) == ["through"]
        assert "links_refused" not in b.metrics.counters  # the rogue's are still waiting
    finally:
        await nc.close()
        if a is not None:
            await a.stop()
        await b.stop()


async def test_a_shared_account_relay_trusts_no_account_header(
    shared_relay_net: RelayNet,
) -> None:
    # Where nodes share one account nothing crosses an import and the server writes no
    # header: one a rogue writes must not buy it an admission share per made-up account.
    a, b = await _pair(shared_relay_net)
    nc = await rogue_connection(shared_relay_net)
    try:
        await a.send_message(b.did, "before", wait=True)
        assert b.relay is not None
        client = b.relay.client
        await until(lambda: client.account == "TALOS", 10, "B told its account")
        link_subject = RelayNames.for_did(b.did).link
        for _ in range(12):
            token = RelayNames.for_did(Wallet.generate().did)
            posing = {"Nats-Request-Info": f'{{"acc":"{token.account}"}}'}
            opening = wire.encode(wire.Open(os.urandom(16), token.token))
            await nc.request(link_subject, opening, timeout=10, headers=posing)
        await until(
            lambda: b.metrics.counters.get("handshakes_refused", 0) >= 4, 20, "one shared share"
        )
        assert not client.vouched and "relay_packets_forged" not in client.counters
        await a.send_message(b.did, "after", wait=True)
        assert _texts(b) == ["before", "after"]
    finally:
        await nc.close()
        await a.stop()
        await b.stop()


async def test_an_unanswered_account_question_is_asked_again(relay_net: RelayNet) -> None:
    # A relay configured before nodes were allowed to ask their account (relay-config of
    # an older release) answers nothing: the node goes on unvouched, and asks again, so
    # the relay's operator updating the configuration (a reload, no restart) is enough.
    server = relay_net.server
    assert server is not None
    home, config = relay_net.home("a")
    server.reconfigure(no_account_question=True)
    a = await started(home, config)
    try:
        assert a.relay is not None
        client = a.relay.client
        await until(lambda: client.connected.is_set(), 20, "A on the relay")
        await until(lambda: client.counters.get("relay_account_unanswered", 0) >= 1, 30, "a try")
        assert not client.vouched and client.account is None
        server.reconfigure()
        await until(lambda: client.vouched, 60, "A asked again and told its account")
    finally:
        await a.stop()


async def test_mail_from_a_peer_not_allowed_waits_with_the_relay(
    relay_net: RelayNet, monkeypatch: pytest.MonkeyPatch
) -> None:
    # B restarts without allowing A: its links refuse A, and its mailbox does not take
    # A's mail either, though the session the two made earlier is kept. The mail stays
    # with the relay: once B allows A it is delivered, A offline all the while.
    monkeypatch.setattr(relay_attach, "_NOT_ALLOWED_RETRY", 0.5)
    a, b = await _pair(relay_net)
    home_b, config_b = relay_net.homes["b"]
    try:
        await a.send_message(b.did, "while allowed", wait=True)
        await b.stop()
        await a.send_message(b.did, "after B stopped allowing A")
        await until(lambda: a.metrics.counters.get("mailbox_out", 0) >= 1, 30, "mailboxed")
        await a.stop()
        b = await started(home_b, config_b)
        assert not b.authorizer(a.did)
        await until(lambda: b.metrics.counters.get("mailbox_held", 0) >= 2, 30, "held")
        assert _texts(b) == ["while allowed"]
        b.allow(a.did)
        await until(lambda: len(_texts(b)) == 2, 30, "taken once allowed")
        assert _texts(b) == ["while allowed", "after B stopped allowing A"]
    finally:
        await a.stop()
        await b.stop()


async def test_mail_past_the_senders_inbox_share_waits_with_the_relay(
    relay_net: RelayNet, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Mail the inbox share does not let B take stays with the relay (A mails it only
    # once): once B prunes its inbox, the rest is delivered, in order, A offline.
    monkeypatch.setattr(relay_attach, "_NOT_ALLOWED_RETRY", 0.5)
    a, b = await _pair(relay_net)
    home_b, config_b = relay_net.homes["b"]
    texts = [f"{i} " + "x" * 1000 for i in range(6)]
    try:
        await a.send_message(b.did, "first", wait=True)
        await b.stop()
        for text in texts:
            await a.send_message(b.did, text)
        await until(lambda: a.metrics.counters.get("mailbox_out", 0) >= 6, 30, "mailboxed")
        await a.stop()
        b = await started(home_b, config_b.model_copy(update={"inbox_share": 3000}))
        b.allow(a.did)
        await until(lambda: b.metrics.counters.get("mailbox_held", 0) >= 1, 30, "held")
        got = _texts(b)
        assert got[0] == "first" and 1 < len(got) < 7 and got[1:] == texts[: len(got) - 1]
        while len(got) < 7:
            await b.prune_inbox(b.inbox()[-1].n)
            await until(lambda: b.inbox() != [], 30, "more taken")
            got += _texts(b)
        assert got == ["first", *texts]
    finally:
        await a.stop()
        await b.stop()


async def test_mailbox_garbage_writes_a_bounded_number_of_warnings(
    relay_net: RelayNet, caplog: pytest.LogCaptureFixture
) -> None:
    # Anyone with a relay account may fill a node's mailbox with garbage: every piece is
    # counted, but the warning lines are throttled as the link path's are.
    b = await started(*relay_net.home("b"))
    nc = await rogue_connection(relay_net)
    try:
        assert b.relay is not None
        await until(b.relay.client.connected.is_set, 20, "B on the relay")
        js = nc.jetstream()
        mailbox = RelayNames.for_did(b.did).mailbox
        with caplog.at_level(logging.WARNING, logger="talos.relay"):
            for _ in range(100):  # B makes its mailbox stream just after it connects
                try:
                    await js.publish(mailbox, os.urandom(100))
                    break
                except (nats.errors.NoRespondersError, NoStreamResponseError):
                    await asyncio.sleep(0.1)
            for _ in range(299):
                await js.publish(mailbox, os.urandom(100))
            await until(lambda: b.metrics.counters.get("mailbox_rejected", 0) >= 300, 60, "all")
        lines = [r for r in caplog.records if r.getMessage() == "mailbox_rejected"]
        assert 1 <= len(lines) <= 20, len(lines)
    finally:
        await nc.close()
        await b.stop()


async def test_mail_claiming_a_peer_does_not_spend_that_peers_link_budget(
    relay_net: RelayNet,
) -> None:
    # Anyone on the relay may mail B envelopes claiming to come from A (the envelope
    # proves no sender), with ratchet headers asking for MAX_SKIP skipped keys. Opened
    # with A's session, they were paid from the budget A's own link frames need: an
    # honest frame of A after 100 frames lost on the way was then refused.
    a, b = await _pair(relay_net)
    got: list[bytes] = []
    b.register_app("t", lambda did, payload: got.append(payload))
    nc = await rogue_connection(relay_net)
    try:
        await a.send_message(b.did, "hello", wait=True)
        mailbox, js = RelayNames.for_did(b.did).mailbox, nc.jetstream()
        rogue_sign = Wallet.generate().sign  # the envelope claims A; A never signed it
        sizes = [MAX_SKIP, MAX_SKIP] + [MAX_SKIP >> i for i in range(1, 11)]  # any level
        for n in sizes:
            _, fresh = x25519_keypair()
            body = struct.pack(">B32sII", 1, fresh, 0, n) + os.urandom(40)
            frame = link_wire.encode(link_wire.Msg(1, body))
            forged = seal_envelope(b.did, a.did, rogue_sign, frame, os.urandom(32))
            await js.publish(mailbox, forged)
        await until(lambda: b.metrics.counters.get("mailbox_rejected", 0) >= len(sizes), 20)
        for _ in range(100):  # frames of A lost on the way
            a.sessions.seal_app(b.did, "t", b"lost")
        await a.send_app(b.did, "t", b"after the mail")
        await until(lambda: got == [b"after the mail"], 20, "the honest frame opened")
    finally:
        await nc.close()
        await a.stop()
        await b.stop()
