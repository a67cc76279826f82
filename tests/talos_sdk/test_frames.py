"""Frame sealing with signed commitments (talos_sdk/frames.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from pathlib import Path

import pytest

from talos_sdk.errors import DecryptionError, MalformedFrameError, OversizeError, UsageError
from talos_sdk.frames import (
    FRAME_AD,
    Commitment,
    Frame,
    PartyMismatchError,
    RatchetFrameCrypto,
    verify_commitment,
)
from talos_sdk.prekeys import PrekeySecrets
from talos_sdk.ratchet import Session
from talos_sdk.wallet import Wallet

ALICE = Wallet.from_seed(b"\x21" * 32)
BOB = Wallet.from_seed(b"\x22" * 32)
CAROL = Wallet.from_seed(b"\x23" * 32)


def crypto_pair(max_payload: int = 1024) -> tuple[RatchetFrameCrypto, RatchetFrameCrypto]:
    secrets = PrekeySecrets.generate(BOB)
    alice = Session.initiate(ALICE, None, secrets.bundle())
    bob, _ = Session.respond(BOB, secrets, alice.encrypt(b""))
    return (
        RatchetFrameCrypto(ALICE, alice, max_payload=max_payload),
        RatchetFrameCrypto(BOB, bob, max_payload=max_payload),
    )


def frame(payload: bytes = b"hello", seq: int = 1) -> Frame:
    return Frame(7, ALICE.did, BOB.did, seq, 1_700_000_000_123, payload)


@pytest.mark.parametrize("sign", [True, False])
def test_round_trip(sign: bool) -> None:
    a, b = crypto_pair()
    f = frame()
    opened, commitment = b.open(a.seal(f, sign=sign))
    assert opened == f
    assert commitment.signed is sign
    assert commitment.payload_hash == hashlib.sha256(b"hello").digest()
    assert (commitment.sender, commitment.recipient, commitment.sequence) == (
        ALICE.did,
        BOB.did,
        1,
    )
    assert b.verify_commitment(commitment, ALICE.did) is sign


def test_both_directions_and_many_frames() -> None:
    a, b = crypto_pair()
    for i in range(5):
        assert b.open(a.seal(frame(b"x" * i, seq=i)))[0].sequence == i
        reply = Frame(1, BOB.did, ALICE.did, i, 0, b"ack")
        assert a.open(b.seal(reply))[0] == reply


def test_commitment_signature_checks() -> None:
    a, b = crypto_pair()
    _, c = b.open(a.seal(frame()))
    assert verify_commitment(c, ALICE.did)
    assert not verify_commitment(c, CAROL.did)  # not the named sender
    assert not verify_commitment(c, "did:key:zbroken")
    for change in ({"sequence": 2}, {"timestamp": 5}, {"payload_hash": bytes(32)}, {"type": 8}):
        assert not verify_commitment(dataclasses.replace(c, **change), ALICE.did)  # type: ignore[arg-type]
    assert c.digest() == hashlib.sha256(c.signed_bytes()).digest()


def test_commitment_layout_is_fixed() -> None:
    c = Commitment.for_frame(frame())
    sender, recipient = ALICE.did.encode(), BOB.did.encode()
    expected = (
        b"Talos_Commitment_v1\x00"
        + struct.pack(">HQQ", 7, 1, 1_700_000_000_123)
        + struct.pack(">H", len(sender))
        + sender
        + struct.pack(">H", len(recipient))
        + recipient
        + hashlib.sha256(b"hello").digest()
    )
    assert c.signed_bytes() == expected


def test_seal_usage_errors() -> None:
    a, _ = crypto_pair()
    with pytest.raises(UsageError, match="from this wallet"):
        a.seal(dataclasses.replace(frame(), sender=CAROL.did))
    with pytest.raises(UsageError, match="from this wallet"):
        a.seal(dataclasses.replace(frame(), recipient=CAROL.did))
    with pytest.raises(UsageError, match="u16"):
        a.seal(dataclasses.replace(frame(), type=70000))
    with pytest.raises(UsageError, match="u64"):
        a.seal(dataclasses.replace(frame(), sequence=-1))
    with pytest.raises(UsageError, match="bytes"):
        a.seal(dataclasses.replace(frame(), payload="text"))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="does not belong"):
        RatchetFrameCrypto(CAROL, a.session)


def test_oversize() -> None:
    a, b = crypto_pair(max_payload=16)
    with pytest.raises(OversizeError, match="exceeds 16"):
        a.seal(frame(b"x" * 17))
    with pytest.raises(OversizeError):
        b.open(b"\x01" * (16 + 4097))
    # A peer with a larger bound sends 17 bytes: the receiver refuses them.
    big = RatchetFrameCrypto(ALICE, a.session, max_payload=1024)
    with pytest.raises(OversizeError, match="exceeds 16"):
        b.open(big.seal(frame(b"x" * 17)))


def test_tampered_or_foreign_wire() -> None:
    a, b = crypto_pair()
    wire = bytearray(a.seal(frame()))
    wire[-3] ^= 0x10
    with pytest.raises(DecryptionError):
        b.open(bytes(wire))
    _, other_b = crypto_pair()
    with pytest.raises(DecryptionError):
        other_b.open(a.seal(frame()))
    # A ratchet message sealed without the frame AD is not a frame.
    with pytest.raises(DecryptionError):
        b.open(a.session.encrypt(b"raw"))


def inner(
    sender: str, recipient: str, flags: int = 1, version: int = 1, tail: bytes = b""
) -> bytes:
    s, r = sender.encode(), recipient.encode()
    head = struct.pack(">BBHQQ", version, flags, 1, 2, 3)
    body = struct.pack(">H", len(s)) + s + struct.pack(">H", len(r)) + r
    return head + body + (bytes(64) if flags & 1 else b"") + tail


def test_party_mismatch() -> None:
    a, b = crypto_pair()
    with pytest.raises(PartyMismatchError, match="on the session"):
        b.open(a.session.encrypt(inner(CAROL.did, BOB.did), FRAME_AD))
    with pytest.raises(PartyMismatchError):
        b.open(a.session.encrypt(inner(ALICE.did, CAROL.did), FRAME_AD))


@pytest.mark.parametrize(
    "plaintext",
    [
        b"",
        b"\x01\x01",
        inner(ALICE.did, BOB.did, version=2),
        inner(ALICE.did, BOB.did, flags=4),
        inner(ALICE.did, BOB.did)[:-10],  # signature cut short
        struct.pack(">BBHQQ", 1, 0, 1, 2, 3) + b"\x00\x05ab",
        struct.pack(">BBHQQ", 1, 0, 1, 2, 3) + b"\x00\x02\xff\xfe\x00\x00",
    ],
)
def test_malformed_inner(plaintext: bytes) -> None:
    a, b = crypto_pair()
    with pytest.raises(MalformedFrameError):
        b.open(a.session.encrypt(plaintext, FRAME_AD))


@pytest.mark.parametrize(
    ("plaintext", "message"),
    [
        (inner("did:key:z" + "a" * 300, BOB.did), "DID field too long"),
        (inner(ALICE.did, BOB.did)[:-10], "truncated"),  # right parties, signature cut
        (inner(ALICE.did, BOB.did, flags=0)[:-1], "truncated"),  # recipient cut short
        (struct.pack(">BBHQQ", 1, 0, 1, 2, 3) + b"\x00\x02\xff\xfe\x00\x00", "UTF-8"),
    ],
)
def test_malformed_inner_says_what(plaintext: bytes, message: str) -> None:
    a, b = crypto_pair()
    with pytest.raises(MalformedFrameError, match=message):
        b.open(a.session.encrypt(plaintext, FRAME_AD))


def test_party_fields_must_match_exactly() -> None:
    a, b = crypto_pair()
    # A sender DID that merely starts with the peer's DID is another party.
    with pytest.raises(PartyMismatchError):
        b.open(a.session.encrypt(inner(ALICE.did + "x", BOB.did), FRAME_AD))
    # Our own frame reflected back to us: sender and recipient swapped.
    with pytest.raises(PartyMismatchError):
        b.open(a.session.encrypt(inner(BOB.did, ALICE.did), FRAME_AD))
    # The same bytes with the roles right open, payload and all.
    opened, c = b.open(a.session.encrypt(inner(ALICE.did, BOB.did, tail=b"pay"), FRAME_AD))
    assert (opened.sender, opened.recipient, opened.payload) == (ALICE.did, BOB.did, b"pay")
    assert c.signature == bytes(64) and c.payload_hash == hashlib.sha256(b"pay").digest()


def test_signed_frame_vector() -> None:
    """tests/vectors/frames/signed-frame.json, made by make_session_vectors.py."""
    from tests.talos_sdk.test_ratchet import vector_sessions

    v = json.loads(
        (Path(__file__).parents[1] / "vectors" / "frames" / "signed-frame.json").read_text()
    )
    assert v["source"] and v["note"]
    alice, bob, _ = vector_sessions(1)
    fv = v["frame"]
    f = Frame(
        fv["type"],
        fv["sender"],
        fv["recipient"],
        fv["sequence"],
        fv["timestamp"],
        bytes.fromhex(fv["payload"]),
    )
    seed = hashlib.sha256(b"talos-vector:alice-seed").digest()
    alice_w = Wallet.from_seed(seed)
    bob_w = Wallet.from_seed(hashlib.sha256(b"talos-vector:bob-seed").digest())
    assert RatchetFrameCrypto(alice_w, alice).seal(f).hex() == v["wire"]
    opened, c = RatchetFrameCrypto(bob_w, bob).open(bytes.fromhex(v["wire"]))
    assert opened == f
    assert c.signed_bytes().hex() == v["commitment_bytes"]
    assert c.digest().hex() == v["commitment_digest"]
    assert c.signature.hex() == v["signature"]
    assert verify_commitment(c, alice_w.did)
