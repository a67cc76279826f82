"""Mailbox envelopes open only for their recipient, hide the sender, and open only if the
sender they name signed them (talos/relay/envelope.py)."""

from __future__ import annotations

import pytest

from talos.relay.envelope import SIGN_LABEL, open_envelope, seal_envelope
from talos_sdk.errors import DecryptionError, SignatureError
from talos_sdk.wallet import Wallet

ALICE = Wallet.from_seed(bytes([1]) * 32)
BOB = Wallet.from_seed(bytes([2]) * 32)
EVE = Wallet.from_seed(bytes([3]) * 32)
EPH = bytes([9]) * 32


def test_round_trip_and_sender_hidden() -> None:
    sealed = seal_envelope(BOB.did, ALICE.did, ALICE.sign, b"\x20frame", EPH)
    assert ALICE.did.encode() not in sealed
    opened = open_envelope(BOB.seed, BOB.did, sealed)
    assert (opened.sender, opened.frame) == (ALICE.did, b"\x20frame")
    assert (
        seal_envelope(BOB.did, ALICE.did, ALICE.sign, b"\x20frame", EPH) == sealed
    )  # deterministic given eph


def test_other_recipient_tamper_and_truncation_are_one_opaque_error() -> None:
    sealed = seal_envelope(BOB.did, ALICE.did, ALICE.sign, b"frame", EPH)
    flipped = bytearray(sealed)
    flipped[40] ^= 1
    for seed, did, data in [
        (EVE.seed, EVE.did, sealed),
        (BOB.seed, BOB.did, bytes(flipped)),
        (BOB.seed, BOB.did, sealed[:40]),
        (BOB.seed, BOB.did, bytes(32) + sealed[32:]),  # a low-order ephemeral key
    ]:
        with pytest.raises(DecryptionError):
            open_envelope(seed, did, data)


def test_an_envelope_naming_a_sender_that_did_not_sign_it_is_refused() -> None:
    # Anyone can seal to BOB; only ALICE can sign as ALICE.
    for sign in (EVE.sign, lambda data: bytes(64)):
        forged = seal_envelope(BOB.did, ALICE.did, sign, b"frame", EPH)
        with pytest.raises(SignatureError, match="not signed by the sender it names"):
            open_envelope(BOB.seed, BOB.did, forged)


def test_the_senders_signature_covers_the_recipient_and_the_ephemeral_key() -> None:
    signed: list[bytes] = []

    def noting(data: bytes) -> bytes:
        signed.append(data)
        return ALICE.sign(data)

    sealed = seal_envelope(BOB.did, ALICE.did, noting, b"frame", EPH)
    eph_pub = sealed[:32]
    (data,) = signed
    assert data == SIGN_LABEL + eph_pub + bytes([len(BOB.did)]) + BOB.did.encode() + b"frame"


def test_a_sender_that_is_no_did_key_is_refused() -> None:
    sealed = seal_envelope(BOB.did, "did:web:example.com", ALICE.sign, b"frame", EPH)
    with pytest.raises(SignatureError, match="no Ed25519 did:key"):
        open_envelope(BOB.seed, BOB.did, sealed)
