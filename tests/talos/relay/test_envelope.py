"""Mailbox envelopes open only for their recipient and hide the sender."""

from __future__ import annotations

import pytest

from talos.relay.envelope import open_envelope, seal_envelope
from talos_sdk.errors import DecryptionError
from talos_sdk.wallet import Wallet

ALICE = Wallet.from_seed(bytes([1]) * 32)
BOB = Wallet.from_seed(bytes([2]) * 32)
EVE = Wallet.from_seed(bytes([3]) * 32)
EPH = bytes([9]) * 32


def test_round_trip_and_sender_hidden() -> None:
    sealed = seal_envelope(BOB.did, ALICE.did, b"\x20frame", EPH)
    assert ALICE.did.encode() not in sealed
    opened = open_envelope(BOB.seed, BOB.did, sealed)
    assert (opened.sender, opened.frame) == (ALICE.did, b"\x20frame")
    assert seal_envelope(BOB.did, ALICE.did, b"\x20frame", EPH) == sealed  # deterministic given eph


def test_other_recipient_tamper_and_truncation_are_one_opaque_error() -> None:
    sealed = seal_envelope(BOB.did, ALICE.did, b"frame", EPH)
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
