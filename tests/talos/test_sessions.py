"""Session setup over the link and session persistence (talos/sessions.py), without sockets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from talos.link import wire
from talos.pipeline import OutboxEntry
from talos.sessions import SessionManager, UnknownSessionError, load_secrets
from talos.store import Store
from talos_sdk.bundle import PrekeyBundle
from talos_sdk.errors import BundleError, DecryptionError, MalformedFrameError, ProtocolError
from talos_sdk.wallet import Wallet


class Side:
    def __init__(self, root: Path, name: str, wallet: Wallet, pq: bool = True) -> None:
        self.wallet = wallet
        self.store = Store(root / name, map_size=1 << 22)
        self.pq = pq
        self.sm = self.fresh()

    def fresh(self, discard: bool = False) -> SessionManager:
        sm = SessionManager(self.store, self.wallet, pq=self.pq, one_time=2, ratchet_every=4)
        with self.store.write() as txn:
            sm.load(txn, discard=discard)
        return sm

    def save(self) -> None:
        with self.store.write() as txn:
            self.sm.persist(txn, self.sm.snapshot_all())


@pytest.fixture
def sides(tmp_path: Path) -> Iterator[tuple[Side, Side]]:
    w1, w2 = Wallet.generate(), Wallet.generate()
    lo, hi = sorted((w1, w2), key=lambda w: w.did)
    a, b = Side(tmp_path, "a", lo), Side(tmp_path, "b", hi)  # a initiates (smaller DID)
    yield a, b
    a.store.close()
    b.store.close()


def setup(a: Side, b: Side, suites: tuple[str, ...] = ("x25519-mlkem768", "x25519")) -> None:
    offer_a, offer_b = a.sm.offer(b.wallet.did), b.sm.offer(a.wallet.did)
    assert b.sm.on_offer(a.wallet.did, offer_a, suites) is None  # b waits
    init = a.sm.on_offer(b.wallet.did, offer_b, suites)
    assert init is not None
    ack = b.sm.on_init(a.wallet.did, init)
    a.sm.on_ack(b.wallet.did, ack)


def row(seq: int, text: str) -> OutboxEntry:
    return OutboxEntry("unused", seq, bytes([seq]) * 16, 1000 + seq, text)


def test_setup_then_messages_and_app_frames(sides: tuple[Side, Side]) -> None:
    a, b = sides
    setup(a, b)
    assert a.sm.suite(b.wallet.did) == b.sm.suite(a.wallet.did) == "x25519-mlkem768"
    assert a.sm.info()[0]["id"] == b.sm.info()[0]["id"]
    for i in range(1, 10):
        body, mine = a.sm.seal_message(b.wallet.did, row(i, f"t{i}"))
        opened = b.sm.open_message(a.wallet.did, body)
        assert (opened.seq, opened.prev, opened.text, opened.ts_ms) == (i, i - 1, f"t{i}", 1000 + i)
        assert opened.record.sender == a.wallet.did
        assert a.wallet.verify(opened.record.commitment, opened.record.signature)
        # The sender's own record holds the very commitment and signature B logs.
        assert (mine.commitment, mine.signature) == (
            opened.record.commitment,
            opened.record.signature,
        )
        assert (mine.sender, mine.recipient, mine.record_id) == (
            a.wallet.did,
            b.wallet.did,
            opened.msg_id,
        )
    body = b.sm.seal_app(a.wallet.did, "mcp", b"payload")
    assert a.sm.open_app(b.wallet.did, body) == ("mcp", b"payload")
    with pytest.raises(DecryptionError):
        a.sm.open_app(b.wallet.did, body)  # replay


def test_classical_suite_when_not_offered(sides: tuple[Side, Side]) -> None:
    a, b = sides
    setup(a, b, suites=("x25519",))
    assert a.sm.suite(b.wallet.did) == "x25519"


def test_persisted_sessions_resume_with_the_same_id(sides: tuple[Side, Side]) -> None:
    a, b = sides
    setup(a, b)
    a.save()
    b.save()
    a.sm, b.sm = a.fresh(), b.fresh()
    offer_a, offer_b = a.sm.offer(b.wallet.did), b.sm.offer(a.wallet.did)
    assert offer_a.session_id == offer_b.session_id != b""
    assert a.sm.on_offer(b.wallet.did, offer_b, ("x25519",)) is None
    assert b.sm.on_offer(a.wallet.did, offer_a, ("x25519",)) is None
    msg = a.sm.seal_message(b.wallet.did, row(1, "after restart"))[0]
    assert b.sm.open_message(a.wallet.did, msg).text == "after restart"


def test_discard_after_crash_forces_a_new_session(sides: tuple[Side, Side]) -> None:
    a, b = sides
    setup(a, b)
    old = b.sm.info()[0]["id"]
    a.save()
    b.save()
    b.sm = b.fresh(discard=True)
    assert not b.sm.has(a.wallet.did)
    setup(a, b)
    assert b.sm.info()[0]["id"] != old
    msg = a.sm.seal_message(b.wallet.did, row(1, "rekeyed"))[0]
    assert b.sm.open_message(a.wallet.did, msg).text == "rekeyed"


def test_prekeys_survive_and_one_time_keys_are_replenished(sides: tuple[Side, Side]) -> None:
    a, b = sides
    with b.store.read() as txn:
        stored = load_secrets(txn)
    assert stored is not None and stored.identity.public == b.sm.secrets.identity.public
    first = b.sm.secrets.one_time_ids
    for _ in range(3):
        a.sm.drop(b.wallet.did)  # force a new X3DH each round, each consuming an OPK
        setup(a, b)
    b.sm.offer(a.wallet.did)
    now = b.sm.secrets.one_time_ids
    assert now and not set(now) & set(first)


def test_bad_setup_frames(sides: tuple[Side, Side]) -> None:
    a, b = sides
    offer_b = b.sm.offer(a.wallet.did)
    with pytest.raises(MalformedFrameError):
        a.sm.on_offer(b.wallet.did, wire.SessionOffer(b"junk", b""), ("x25519",))
    with pytest.raises(BundleError, match="another DID"):
        a.sm.on_offer(Wallet.generate().did, offer_b, ("x25519",))
    init = a.sm.on_offer(b.wallet.did, offer_b, ("x25519",))
    assert init is not None
    with pytest.raises(MalformedFrameError, match="session id"):
        b.sm.on_init(a.wallet.did, wire.SessionInit(b"x" * 16, init.payload))
    with pytest.raises(ProtocolError, match="must respond"):
        a.sm.on_init(b.wallet.did, init)
    with pytest.raises(UnknownSessionError):
        b.sm.open_app(Wallet.generate().did, b"x" * 64)
    b.sm.on_init(a.wallet.did, init)
    with pytest.raises(DecryptionError):
        b.sm.open_message(a.wallet.did, b"\x01" * 80)


def test_app_and_message_frames_cannot_be_swapped(sides: tuple[Side, Side]) -> None:
    """Different associated data: an app frame never opens as a message (and back)."""
    a, b = sides
    setup(a, b)
    with pytest.raises(DecryptionError):
        b.sm.open_message(a.wallet.did, a.sm.seal_app(b.wallet.did, "x", b""))
    with pytest.raises(DecryptionError):
        b.sm.open_app(a.wallet.did, a.sm.seal_message(b.wallet.did, row(1, "m"))[0])


def test_each_peer_is_offered_its_own_one_time_prekey(tmp_path: Path) -> None:
    """Two initiators answering offers at once never share an OPK."""
    wallets = sorted((Wallet.generate() for _ in range(3)), key=lambda w: w.did)
    hub = Side(tmp_path, "hub", wallets[2])  # largest DID: responds to both
    b, c = Side(tmp_path, "b", wallets[0]), Side(tmp_path, "c", wallets[1])
    try:
        suites = ("x25519-mlkem768", "x25519")
        to_b, to_c = hub.sm.offer(b.wallet.did), hub.sm.offer(c.wallet.did)
        opk_b = PrekeyBundle.from_bytes(to_b.bundle).one_time
        opk_c = PrekeyBundle.from_bytes(to_c.bundle).one_time
        assert len(opk_b) == len(opk_c) == 1 and opk_b[0][0] != opk_c[0][0]
        # A second offer to the same peer (a new link) repeats its reservation.
        again = PrekeyBundle.from_bytes(hub.sm.offer(b.wallet.did).bundle).one_time
        assert again == opk_b
        init_b = b.sm.on_offer(hub.wallet.did, to_b, suites)
        init_c = c.sm.on_offer(hub.wallet.did, to_c, suites)
        assert init_b is not None and init_c is not None
        b.sm.on_ack(hub.wallet.did, hub.sm.on_init(b.wallet.did, init_b))
        c.sm.on_ack(hub.wallet.did, hub.sm.on_init(c.wallet.did, init_c))
        # Both OPKs are spent; more are minted, so the next offer still carries one.
        left = set(hub.sm.secrets.one_time_ids)
        assert opk_b[0][0] not in left and opk_c[0][0] not in left
        nxt = PrekeyBundle.from_bytes(hub.sm.offer(b.wallet.did).bundle).one_time
        assert len(nxt) == 1 and nxt[0][0] in hub.sm.secrets.one_time_ids
        # Replaying B's init (its OPK is used) is refused with a clear error.
        with pytest.raises(BundleError, match="already used"):
            hub.sm.on_init(b.wallet.did, init_b)
    finally:
        for side in (hub, b, c):
            side.store.close()


def test_no_one_time_prekeys_configured_offers_none(tmp_path: Path) -> None:
    w = Wallet.generate()
    with Store(tmp_path / "s", map_size=1 << 22) as store:
        sm = SessionManager(store, w, pq=False, one_time=0, ratchet_every=1)
        with store.write() as txn:
            sm.load(txn, discard=False)
        assert PrekeyBundle.from_bytes(sm.offer(Wallet.generate().did).bundle).one_time == ()


def test_unsigned_message_frame_is_refused(sides: tuple[Side, Side]) -> None:
    """The receiver logs the sender's signature, so an unsigned MSG is an error."""
    from talos.sessions import MSG_FRAME_TYPE, UnsignedMessageError
    from talos_sdk.frames import Frame

    a, b = sides
    setup(a, b)
    frame = Frame(
        type=MSG_FRAME_TYPE,
        sender=a.wallet.did,
        recipient=b.wallet.did,
        sequence=1,
        timestamp=5,
        payload=b"1" * 16 + (0).to_bytes(8, "big") + b"unsigned",
    )
    body = a.sm._crypto(a.sm._get(b.wallet.did)).seal(frame, sign=False)
    with pytest.raises(UnsignedMessageError, match="unsigned"):
        b.sm.open_message(a.wallet.did, body)


class _GarbageSigner:
    """Duck-typed wallet for RatchetFrameCrypto: sets the signed flag, signs nothing valid."""

    def __init__(self, did: str, signature: bytes) -> None:
        self.did = did
        self.signature = signature

    def sign(self, data: bytes) -> bytes:
        return self.signature


@pytest.mark.parametrize("kind", ["garbage", "other key", "other message"])
def test_message_frame_with_a_bad_signature_is_refused(sides: tuple[Side, Side], kind: str) -> None:
    """A signed flag with a signature that does not verify is refused like no signature."""
    from typing import cast

    from talos.sessions import (
        MSG_FRAME_TYPE,
        BadMessageSignatureError,
        MessageSignatureError,
    )
    from talos_sdk.frames import Frame, RatchetFrameCrypto

    a, b = sides
    setup(a, b)
    payload = b"1" * 16 + (0).to_bytes(8, "big") + b"forged"
    signature = {
        "garbage": bytes(range(64)),
        "other key": Wallet.generate().sign(b"anything"),
        "other message": a.wallet.sign(b"another commitment"),
    }[kind]
    frame = Frame(MSG_FRAME_TYPE, a.wallet.did, b.wallet.did, 1, 5, payload)
    session = a.sm._get(b.wallet.did).session
    forger = RatchetFrameCrypto(cast(Wallet, _GarbageSigner(a.wallet.did, signature)), session)
    body = forger.seal(frame, sign=True)
    with pytest.raises(BadMessageSignatureError, match="does not verify") as info:
        b.sm.open_message(a.wallet.did, body)
    assert isinstance(info.value, MessageSignatureError)
    # The session moved on (the frame decrypted); the next genuine message opens.
    good, _ = a.sm.seal_message(b.wallet.did, row(1, "genuine"))
    assert b.sm.open_message(a.wallet.did, good).text == "genuine"


def test_session_setup_is_bound_to_the_link(sides: tuple[Side, Side]) -> None:
    """An init made for one link's handshake hash does not open on another link."""
    a, b = sides
    link1, link2 = b"\x01" * 32, b"\x02" * 32
    init = a.sm.on_offer(b.wallet.did, b.sm.offer(a.wallet.did), ("x25519",), link1)
    assert init is not None
    with pytest.raises(DecryptionError):
        b.sm.on_init(a.wallet.did, init, link2)
    ack = b.sm.on_init(a.wallet.did, init, link1)
    with pytest.raises(DecryptionError):
        a.sm.on_ack(b.wallet.did, ack, link2)
    a.sm.on_ack(b.wallet.did, ack, link1)
