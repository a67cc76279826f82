"""Prekey rotation, one-time ML-KEM prekeys and bounded bookkeeping (talos_sdk/prekeys.py)."""

from __future__ import annotations

import dataclasses

import pytest

from talos_sdk.bundle import SUITE_HYBRID, SUITE_X25519, PrekeyBundle
from talos_sdk.errors import BundleError
from talos_sdk.prekeys import MAX_USED_REMEMBERED, PQ_OPK_ID_BASE, PrekeySecrets
from talos_sdk.ratchet import Session
from talos_sdk.wallet import HybridWallet, Wallet

ALICE = Wallet.from_seed(b"\x2a" * 32)
BOB = Wallet.from_seed(b"\x2b" * 32)
DAY = 86_400


def _start(bundle: PrekeyBundle, suite: str = SUITE_X25519) -> tuple[Session, bytes]:
    alice = Session.initiate(ALICE, None, bundle, suite=suite)
    return alice, alice.encrypt(b"hello")


@pytest.mark.parametrize("pq", [False, True])
def test_rotation_keeps_the_previous_prekey_for_its_grace_period(pq: bool) -> None:
    secrets = PrekeySecrets.generate(BOB, pq=pq, now=1000)
    old = secrets.bundle()
    suite = SUITE_HYBRID if pq else SUITE_X25519
    assert not secrets.rotation_due(1000 + 7 * DAY - 1, 7 * DAY)
    assert secrets.rotation_due(1000 + 7 * DAY, 7 * DAY)
    new_id = secrets.rotate(BOB, now=1000 + 7 * DAY, grace=2 * DAY)
    new = secrets.bundle().verify()
    assert new.spk_id == new_id != old.spk_id and new.spk != old.spk
    assert new.signature != old.signature
    if pq:
        assert new.pq_id == new_id and new.pq_key != old.pq_key
    # A peer that fetched the old bundle still gets through during the grace period ...
    _, first = _start(old, suite)
    _, text = Session.respond(BOB, secrets, first)
    assert text == b"hello"
    _, first_new = _start(new, suite)
    assert Session.respond(BOB, secrets, first_new)[1] == b"hello"
    # ... and not after it: the old private keys are deleted.
    assert not secrets.expire(1000 + 9 * DAY - 1)
    assert secrets.expire(1000 + 9 * DAY)
    assert secrets.retired_ids == []
    _, late = _start(old, suite)
    with pytest.raises(BundleError, match="unknown signed prekey id"):
        Session.respond(BOB, secrets, late)


def test_rotation_state_survives_persistence() -> None:
    secrets = PrekeySecrets.generate(BOB, pq=True, one_time=2, pq_one_time=2, now=5)
    secrets.rotate(BOB, now=10, grace=100)
    for restored in (
        PrekeySecrets.from_bytes(secrets.to_bytes()),
        PrekeySecrets.from_dict(secrets.to_dict()),
    ):
        assert restored.to_bytes() == secrets.to_bytes()
        assert restored.retired_ids == secrets.retired_ids == [1]
        assert restored.bundle() == secrets.bundle()
        assert restored.created == 10


def test_prekeys_stored_before_rotation_still_load() -> None:
    """Magic TPKS\\x01 (no rotation block), as written by earlier versions."""
    secrets = PrekeySecrets.generate(BOB, one_time=1)
    legacy = b"TPKS\x01" + secrets.to_bytes()[5:-17]  # created u64, 0 retired, 0 PQ OPKs, next
    restored = PrekeySecrets.from_bytes(legacy)
    assert restored.bundle() == secrets.bundle() and restored.retired_ids == []


@pytest.mark.parametrize("wallet", [BOB, HybridWallet.from_seed(b"\x2c" * 32)])
def test_one_time_mlkem_prekeys_are_signed_used_once_and_preferred(wallet: Wallet) -> None:
    secrets = PrekeySecrets.generate(wallet, pq=True, pq_one_time=2)
    bundle = PrekeyBundle.from_bytes(secrets.bundle().to_bytes()).verify()
    assert [i for i, _, _ in bundle.pq_one_time] == [PQ_OPK_ID_BASE, PQ_OPK_ID_BASE + 1]
    alice = Session.initiate(ALICE, None, bundle, suite=SUITE_HYBRID)
    first = alice.encrypt(b"pq")
    _, text = Session.respond(wallet, secrets, first)
    assert text == b"pq"
    assert secrets.pq_one_time_ids == [PQ_OPK_ID_BASE + 1]  # consumed once it decrypted
    with pytest.raises(BundleError, match="already used"):
        Session.respond(wallet, secrets, first)
    # A PQ one-time key whose signature does not verify is refused with the bundle.
    (pq_id, key, sig), *_ = bundle.pq_one_time
    forged = dataclasses.replace(bundle, pq_one_time=((pq_id, key, bytes(len(sig))),))
    with pytest.raises(BundleError, match="not signed"):
        PrekeyBundle.from_bytes(forged.to_bytes()).verify()
    # Without one-time keys left, the last-resort key is used.
    secrets.consume_pq_one_time(PQ_OPK_ID_BASE + 1)
    last = Session.initiate(ALICE, None, secrets.bundle(), suite=SUITE_HYBRID)
    assert Session.respond(wallet, secrets, last.encrypt(b"lr"))[1] == b"lr"


def test_a_bundle_without_mlkem_one_time_keys_keeps_its_bytes() -> None:
    secrets = PrekeySecrets.generate(BOB, pq=True, one_time=1)
    raw = secrets.bundle().to_bytes()
    assert PrekeyBundle.from_bytes(raw).to_bytes() == raw
    secrets.add_pq_one_time(BOB, 1)
    longer = secrets.bundle().to_bytes()
    assert longer.startswith(raw) and len(longer) == len(raw) + 2 + 4 + 1184 + 64


def test_used_prekey_bookkeeping_is_bounded_and_still_refuses_reuse() -> None:
    n = MAX_USED_REMEMBERED + 300
    secrets = PrekeySecrets.generate(BOB, one_time=0)
    ids = secrets.add_one_time(n)
    for i in ids:
        secrets.consume_one_time(i)
    assert len(secrets.to_dict()["used"]) == MAX_USED_REMEMBERED  # not one per session
    assert len(secrets.to_bytes()) < 4 * MAX_USED_REMEMBERED + 1000
    # The first ids fell out of the remembered list and are refused all the same.
    with pytest.raises(BundleError, match="already used"):
        secrets.one_time_private(ids[0])
    with pytest.raises(BundleError, match="unknown one-time prekey"):
        secrets.one_time_private(ids[-1] + 1)
    restored = PrekeySecrets.from_bytes(secrets.to_bytes())
    with pytest.raises(BundleError, match="already used"):
        restored.one_time_private(ids[0])
