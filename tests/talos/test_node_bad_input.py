"""A hostile but authenticated peer against a real node: every bad frame is dropped,
counted and logged; the node and its other links keep working.

See docs/DESIGN.md, What "done" means.
"""

from __future__ import annotations

import asyncio
import functools
import os
import struct
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed

from talos.link import wire
from talos.link.handshake import CLOSE_PROTOCOL
from talos.link.peer import Link, LinkSettings, dial_link
from talos.node import Node
from talos.sessions import MSG_FRAME_TYPE, SKIP_BURST, SessionManager
from talos.store import Store
from talos_sdk import ratchet
from talos_sdk.bundle import x25519_keypair
from talos_sdk.frames import Frame, RatchetFrameCrypto
from talos_sdk.ratchet import MAX_SKIP
from talos_sdk.wallet import Wallet
from tests.talos.nodes import link, make_home, started, until


@dataclass
class Rogue:
    """A peer speaking the link protocol by hand, with a real SessionManager."""

    wallet: Wallet
    store: Store
    sessions: SessionManager
    link: Link | None = None

    async def connect(self, node: Node) -> Link:
        link = await dial_link(
            node.listen_url or "", node.did, self.wallet, lambda d: True, LinkSettings()
        )
        self.link = link
        return link

    async def establish(self, node: Node) -> None:
        """Run session setup the way a node does."""
        link = self.link
        assert link is not None
        await link.send(wire.encode(self.sessions.offer(node.did)))
        seen_offer = False
        while not (seen_offer and self.sessions.has(node.did)):
            frame = wire.decode(await link.recv())
            if isinstance(frame, wire.SessionOffer):
                seen_offer = True
                init = self.sessions.on_offer(node.did, frame, link.suites, link.transcript_hash)
                if init is not None:
                    await link.send(wire.encode(init))
            elif isinstance(frame, wire.SessionInit):
                ack = self.sessions.on_init(node.did, frame, link.transcript_hash)
                await link.send(wire.encode(ack))
        await until(lambda: node.is_connected(self.wallet.did), what="node side ready")


@pytest.fixture
async def victim(tmp_path: Path) -> AsyncIterator[Node]:
    node = await started(*make_home(tmp_path, "victim", max_frame=16384))
    yield node
    await node.stop()


@pytest.fixture
def rogue(tmp_path: Path, victim: Node) -> Iterator[Rogue]:
    wallet = Wallet.generate()
    store = Store(tmp_path / "rogue-store", map_size=1 << 22)
    sessions = SessionManager(store, wallet, pq=False, one_time=1, ratchet_every=64)
    with store.write() as txn:
        sessions.load(txn, discard=False)
    victim.allow(wallet.did)
    yield Rogue(wallet, store, sessions)
    store.close()


def rejected(node: Node) -> int:
    return node.metrics.counters.get("frames_rejected", 0)


def _rejected_is(node: Node, n: int) -> bool:
    return rejected(node) == n


async def test_garbage_frames_are_dropped_and_the_link_survives(victim: Node, rogue: Rogue) -> None:
    got: list[bytes] = []
    victim.register_app("t", lambda did, payload: got.append(payload))
    async with asyncio.timeout(20):
        link = await rogue.connect(victim)
        await rogue.establish(victim)
        bad = [
            b"\xffunknown type",
            b"\x21\x00",  # truncated ACK
            b"\x20\x00\x00\x00\x00\x00\x00\x00\x01" + b"not a sealed frame",  # MSG, bad crypto
            b"\x30" + b"\x00" * 80,  # APP that does not decrypt
            wire.encode(wire.Accept()),  # handshake frame, late
            wire.encode(wire.Ack(99)),  # ack for something never sent
        ]
        for i, data in enumerate(bad, 1):
            await link.send(data)
            await until(functools.partial(_rejected_is, victim, i), what=f"rejection {i}")
        # A genuine frame still goes through on the same link ...
        good = rogue.sessions.seal_app(victim.did, "t", b"still here")
        await link.send(b"\x30" + good)
        await until(lambda: got == [b"still here"], what="good frame")
        # ... and replaying it is refused by the ratchet.
        await link.send(b"\x30" + good)
        await until(lambda: rejected(victim) == len(bad) + 1, what="replay rejected")
        assert got == [b"still here"]
        assert link.open


async def test_frames_without_a_session_are_refused(victim: Node, rogue: Rogue) -> None:
    async with asyncio.timeout(20):
        link = await rogue.connect(victim)
        # No SESSION_OFFER sent: the node holds no session with us yet.
        await link.send(b"\x30" + b"\x01" * 64)
        await until(lambda: rejected(victim) == 1, what="rejection")
        assert not victim.is_connected(rogue.wallet.did)


async def test_oversize_frame_closes_only_that_link(victim: Node, rogue: Rogue) -> None:
    async with asyncio.timeout(20):
        link = await rogue.connect(victim)
        await rogue.establish(victim)
        await link.send(b"\x30" + b"x" * 20_000)  # above max_frame=16384
        with pytest.raises(ConnectionClosed):
            while True:  # frames the node sent before closing are still queued
                await link.recv()
        assert link.ws.close_code == 1009  # RFC 6455: message too big
        await until(lambda: not victim.is_connected(rogue.wallet.did), what="link dropped")
        # The node keeps serving: the same peer reconnects and resumes its session.
        await rogue.connect(victim)
        await rogue.establish(victim)


async def test_peer_vanishing_mid_message(victim: Node, rogue: Rogue, tmp_path: Path) -> None:
    async with asyncio.timeout(20):
        link = await rogue.connect(victim)
        await rogue.establish(victim)
        # Half a WebSocket frame (header announces 200 bytes, 3 arrive), then TCP reset.
        link.ws.transport.write(b"\x82\x7e\x00\xc8abc")
        link.ws.transport.abort()
        await until(lambda: not victim.is_connected(rogue.wallet.did), what="cleanup")
        # Other peers are unaffected.
        other = await started(*make_home(tmp_path, "other"))
        try:
            await link_pair(other, victim)
        finally:
            await other.stop()


async def link_pair(a: Node, b: Node) -> None:
    await link(a, b)
    assert a.is_connected(b.did) and b.is_connected(a.did)


def wallet_below(did: str) -> Wallet:
    """A fresh wallet whose DID sorts before ``did`` (so it is the X3DH initiator)."""
    while True:
        w = Wallet.generate()
        if w.did < did:
            return w


async def test_session_init_for_another_did_is_refused(victim: Node, tmp_path: Path) -> None:
    """X3DH initial data must come from the link peer itself, not a third identity."""
    me, third = wallet_below(victim.did), wallet_below(victim.did)
    victim.allow(me.did)
    async with asyncio.timeout(20):
        link = await dial_link(
            victim.listen_url or "", victim.did, me, lambda d: True, LinkSettings()
        )
        with Store(tmp_path / "third", map_size=1 << 22) as store:
            other = SessionManager(store, third, pq=False, one_time=0, ratchet_every=1)
            with store.write() as txn:
                other.load(txn, discard=False)
            offer = wire.decode(await link.recv())
            assert isinstance(offer, wire.SessionOffer)
            # genuine, bound to this very link, but from `third`
            init = other.on_offer(victim.did, offer, ("x25519",), link.transcript_hash)
        assert init is not None
        await link.send(wire.encode(init))
        await until(
            lambda: victim.metrics.counters.get("session_setup_failures", 0) == 1,
            what="rejection",
        )
        # A link whose session setup failed is closed, so the next one starts afresh.
        with pytest.raises(ConnectionClosed):
            await link.recv()
        assert link.ws.close_code == CLOSE_PROTOCOL
        assert not victim.is_connected(me.did)
        assert victim.sessions.has(me.did) is False


async def test_replayed_message_and_forged_signature(victim: Node, rogue: Rogue) -> None:
    import struct

    from talos.pipeline import OutboxEntry
    from talos_sdk.frames import FRAME_AD

    me = rogue.wallet.did
    async with asyncio.timeout(20):
        link = await rogue.connect(victim)
        await rogue.establish(victim)
        body = rogue.sessions.seal_message(victim.did, OutboxEntry(me, 1, b"1" * 16, 5, "once"))[0]
        await link.send(wire.encode(wire.Msg(1, body)))
        await until(lambda: len(victim.inbox()) == 1, what="delivery")
        await link.send(wire.encode(wire.Msg(1, body)))  # byte-for-byte replay
        await until(lambda: rejected(victim) == 1, what="replay rejected")
        # A frame whose commitment signature is garbage: the AEAD says it is from `me`,
        # but a message whose audit record could not be sealed is not taken at all.
        session = rogue.sessions._get(victim.did).session
        sender, recipient = me.encode(), victim.did.encode()
        inner = b"".join(
            (
                struct.pack(">BBHQQ", 1, 1, 1, 2, 6),
                struct.pack(">H", len(sender)),
                sender,
                struct.pack(">H", len(recipient)),
                recipient,
                b"\x00" * 64,  # not a signature by `me`
                b"2" * 16 + struct.pack(">Q", 1) + b"forged signature",
            )
        )
        await link.send(wire.encode(wire.Msg(2, session.encrypt(inner, FRAME_AD))))
        await until(lambda: rejected(victim) == 2, what="forged signature rejected")
        assert victim.metrics.counters["messages_bad_signature"] == 1
        await asyncio.to_thread(victim.log.seal)
        assert victim.log.quarantined() == []
        assert victim.log.find_record(b"1" * 16) is not None
        assert victim.log.find_record(b"2" * 16) is None
        assert [e.text for e in victim.inbox()] == ["once"]
        assert victim.is_connected(me)


async def test_sessions_out_of_step_are_rekeyed(victim: Node, rogue: Rogue) -> None:
    from talos.link.handshake import CLOSE_PROTOCOL

    me = rogue.wallet.did
    async with asyncio.timeout(20):
        link = await rogue.connect(victim)
        await rogue.establish(victim)
        old = victim.sessions.info()[0]["id"]
        for _ in range(16):  # e.g. more frames lost than the ratchet may skip
            await link.send(b"\x30" + b"\x07" * 80)
        with pytest.raises(ConnectionClosed):
            while True:
                await link.recv()
        assert link.ws.close_code == CLOSE_PROTOCOL
        assert victim.metrics.counters["session_resyncs"] == 1
        assert not victim.sessions.has(me)
        await rogue.connect(victim)
        await rogue.establish(victim)
        assert victim.sessions.info()[0]["id"] != old
        got: list[bytes] = []
        victim.register_app("t", lambda did, payload: got.append(payload))
        assert rogue.link is not None
        await rogue.link.send(b"\x30" + rogue.sessions.seal_app(victim.did, "t", b"in step"))
        await until(lambda: got == [b"in step"], what="frame on the new session")


async def test_forged_headers_cost_the_node_a_bounded_number_of_key_derivations(
    victim: Node, rogue: Rogue, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A forged header may ask for MAX_SKIP derivations on each of two chains before its
    # tag is checked (~2.4 ms of CPU for an 82-byte frame). Fifteen of them and one real
    # frame, again and again, never made the 16-in-a-row re-key; the peer's skip budget
    # (talos/sessions.py SKIP_BURST, SKIP_RATE) now pays for them, and is soon empty.
    derived = [0]
    real_kdf_ck = ratchet.kdf_ck

    def counting(ck: bytes) -> tuple[bytes, bytes]:
        derived[0] += 1
        return real_kdf_ck(ck)

    monkeypatch.setattr(ratchet, "kdf_ck", counting)
    got: list[bytes] = []
    victim.register_app("t", lambda did, payload: got.append(payload))
    async with asyncio.timeout(60):
        link = await rogue.connect(victim)
        await rogue.establish(victim)
        for round_ in range(10):
            for _ in range(15):
                _, fresh = x25519_keypair()
                head = struct.pack(">B32sII", 1, fresh, MAX_SKIP, MAX_SKIP)
                await link.send(b"\x30" + head + os.urandom(40))
            await link.send(b"\x30" + rogue.sessions.seal_app(victim.did, "t", b"%d" % round_))
        await until(lambda: len(got) == 10, what="the real frames")
        # 150 forged frames asked for ~300,000; the budget and a little refill paid for
        # fewer than three frames' worth.
        assert derived[0] < SKIP_BURST + 3 * MAX_SKIP, derived[0]
        assert victim.is_connected(rogue.wallet.did)


def first_message(sender: str, recipient: str, text: bytes) -> Frame:
    """Message frame number 1 from ``sender``, its payload a fixed message id and ``text``."""
    return Frame(
        type=MSG_FRAME_TYPE,
        sender=sender,
        recipient=recipient,
        sequence=1,
        timestamp=5,
        payload=b"1" * 16 + (0).to_bytes(8, "big") + text,
    )


async def test_unsigned_message_frame_is_refused(victim: Node, rogue: Rogue) -> None:
    """A MSG frame without the sender's signature never reaches the inbox."""
    me = rogue.wallet.did
    async with asyncio.timeout(20):
        link = await rogue.connect(victim)
        await rogue.establish(victim)
        frame = first_message(me, victim.did, b"unsigned")
        entry = rogue.sessions._get(victim.did)
        body = rogue.sessions._crypto(entry).seal(frame, sign=False)
        await link.send(wire.encode(wire.Msg(1, body)))
        await until(lambda: rejected(victim) == 1, what="unsigned frame rejected")
        assert victim.metrics.counters["messages_unsigned"] == 1
        assert victim.inbox() == []
        assert victim.is_connected(me)  # bad input costs the frame, not the link


class _GarbageSigner:
    """Duck-typed wallet for RatchetFrameCrypto: the signed flag set, the signature garbage."""

    def __init__(self, did: str) -> None:
        self.did = did

    def sign(self, data: bytes) -> bytes:
        return bytes(range(64))


async def test_message_frame_with_a_bad_signature_is_refused(victim: Node, rogue: Rogue) -> None:
    """Refused at open exactly like an unsigned one: not delivered, not acknowledged,
    counted, the link kept; the next genuine message is delivered."""
    from typing import cast

    from talos.pipeline import OutboxEntry

    me = rogue.wallet.did
    async with asyncio.timeout(20):
        link = await rogue.connect(victim)
        await rogue.establish(victim)
        frame = first_message(me, victim.did, b"forged signature")
        session = rogue.sessions._get(victim.did).session
        forger = RatchetFrameCrypto(cast(Wallet, _GarbageSigner(me)), session)
        await link.send(wire.encode(wire.Msg(1, forger.seal(frame, sign=True))))
        await until(lambda: rejected(victim) == 1, what="forged frame rejected")
        assert victim.metrics.counters["messages_bad_signature"] == 1
        assert victim.inbox() == []
        assert victim.is_connected(me)
        # The same sequence number, genuinely signed, is delivered and acknowledged:
        # the forged frame took no place in the pipeline and earned no ack.
        body, _ = rogue.sessions.seal_message(
            victim.did, OutboxEntry(victim.did, 1, b"2" * 16, 6, "genuine")
        )
        await link.send(wire.encode(wire.Msg(1, body)))
        while True:
            got = wire.decode(await link.recv())
            if isinstance(got, wire.Ack):
                break
        assert got.seq == 1
        assert [m.text for m in victim.inbox()] == ["genuine"]


async def test_handshakes_in_progress_are_bounded(victim: Node, rogue: Rogue) -> None:
    """Unauthenticated connections cannot pile up; the excess gets 1013."""
    import dataclasses

    from websockets.asyncio.client import connect

    from talos.node import CLOSE_TRY_AGAIN

    victim.links.admission.max_total = 2
    # The silent connections must outlive the first-message deadline for this test.
    victim.settings = dataclasses.replace(victim.settings, first_message_timeout=60)
    url = victim.listen_url or ""
    async with asyncio.timeout(20):
        silent = [await connect(url), await connect(url)]  # never say HELLO
        await until(lambda: victim.links.admission.total == 2, what="two handshakes waiting")
        async with connect(url) as third:
            with pytest.raises(ConnectionClosed):
                await third.recv()
        assert third.close_code == CLOSE_TRY_AGAIN
        assert third.close_reason == "too many link handshakes in progress"
        assert victim.metrics.counters["handshakes_refused"] == 1
        for ws in silent:
            await ws.close()
        await until(lambda: victim.links.admission.total == 0, what="slots freed")
        await rogue.connect(victim)  # a real peer gets in once there is room
        await rogue.establish(victim)
        assert victim.is_connected(rogue.wallet.did)


async def test_a_quarantined_record_is_counted_and_shown(victim: Node) -> None:
    """Defence in depth behind the check at open: a record the sealer refuses (here
    appended by hand, its signature forged) is counted, logged and in the status."""
    import dataclasses

    from tests.talos.chain import make_record

    forged = dataclasses.replace(make_record(1), signature=bytes(64))
    async with asyncio.timeout(20):
        await asyncio.to_thread(victim.log.append, forged)
        await asyncio.to_thread(victim.log.seal)
        (q,) = victim.log.quarantined()
        assert "signature does not verify" in q.reason
        await until(
            lambda: victim.metrics.counters.get("records_quarantined", 0) == 1,
            what="quarantine noticed",
        )
        assert victim.status()["quarantined_records"] == 1
        assert victim.metrics.gauges["log_quarantined_records"]() == 1


async def test_ack_beyond_what_the_link_carried_deletes_nothing(tmp_path: Path) -> None:
    """A peer's cumulative ACK of an earlier epoch's seq drops no row this link never sent."""
    from talos.config import Home
    from talos.home import offline_send

    home, config = make_home(tmp_path, "victim")
    rogue_wallet = Wallet.generate()
    for i in range(3):
        offline_send(Home(home), rogue_wallet.did, f"queued {i}")
    node = await started(home, config)  # a new epoch: the queued rows are older
    store = Store(tmp_path / "rogue-store", map_size=1 << 22)
    sessions = SessionManager(store, rogue_wallet, pq=False, one_time=1, ratchet_every=64)
    with store.write() as txn:
        sessions.load(txn, discard=False)
    node.allow(rogue_wallet.did)
    rogue = Rogue(rogue_wallet, store, sessions)
    try:
        async with asyncio.timeout(20):
            with node.store.read() as txn:
                seqs = [int.from_bytes(k[-8:], "big") for k, _ in txn.items("outbox")]
            assert len(seqs) == 3
            link = await rogue.connect(node)
            await link.send(wire.encode(wire.Ack(max(seqs))))  # before anything was sent
            await rogue.establish(node)
            texts = []
            while len(texts) < 3:
                frame = wire.decode(await link.recv())
                if isinstance(frame, wire.Msg):
                    texts.append(sessions.open_message(node.did, frame.body).text)
            assert texts == ["queued 0", "queued 1", "queued 2"]
    finally:
        await node.stop()
        store.close()


async def test_a_refusal_after_the_handshake_closes_the_dialled_link(victim: Node) -> None:
    """A peer that seals a REFUSE and then holds the socket open: the node closes its
    end, so redialling such a peer cannot pile up sockets."""
    from websockets.asyncio.server import ServerConnection, serve

    from talos.link.handshake import LinkHandshake, Role

    refuser = Wallet.generate()
    closed: list[int | None] = []

    async def handler(ws: ServerConnection) -> None:
        hs = LinkHandshake(refuser, Role.RESPONDER, authorizer=lambda d: True)
        while not hs.done:
            reply = hs.receive(await ws.recv())
            if reply is not None:
                await ws.send(reply)
        assert hs.channel is not None
        await ws.send(hs.channel.seal(wire.encode(wire.Refuse(4003, "not you"))))
        await ws.wait_closed()  # never closes from this side
        closed.append(ws.close_code)

    async with serve(handler, "127.0.0.1", 0, compression=None, ping_interval=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        await victim.connect(f"ws://127.0.0.1:{port}#{refuser.did}")
        await until(lambda: len(closed) >= 1, what="the node closing the refused link")
    assert closed[0] == 1000
