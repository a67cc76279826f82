"""X3DH and the ML-KEM-768 hybrid (talos_sdk/x3dh.py)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.mlkem import MLKEM768PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from talos_sdk.bundle import SUITE_HYBRID, SUITE_X25519, IdentityKey, PrekeyBundle
from talos_sdk.errors import BundleError, MalformedFrameError, SignatureError
from talos_sdk.prekeys import PrekeySecrets
from talos_sdk.wallet import Wallet
from talos_sdk.x3dh import INFO_HYBRID, INFO_X25519, InitialData, initiate, respond

ALICE = Wallet.from_seed(b"\x01" * 32)
BOB = Wallet.from_seed(b"\x02" * 32)


@pytest.fixture(scope="module")
def bob_secrets() -> PrekeySecrets:
    return PrekeySecrets.generate(BOB, one_time=4, pq=True)


@pytest.fixture(scope="module")
def alice_ik() -> IdentityKey:
    return IdentityKey.generate(ALICE)


@pytest.mark.parametrize("suite", [SUITE_X25519, SUITE_HYBRID])
@pytest.mark.parametrize("use_one_time", [True, False])
def test_both_sides_agree(
    bob_secrets: PrekeySecrets, alice_ik: IdentityKey, suite: str, use_one_time: bool
) -> None:
    a = initiate(alice_ik, bob_secrets.bundle(), suite=suite, use_one_time=use_one_time)
    wire = a.initial.to_bytes()
    b = respond(bob_secrets, InitialData.from_bytes(wire))
    assert a.shared_secret == b.shared_secret and len(a.shared_secret) == 32
    assert a.associated_data == b.associated_data
    assert a.associated_data == (
        alice_ik.public + bob_secrets.identity.public + ALICE.public_key + BOB.public_key
    )
    assert a.responder_spk == b.responder_spk == bob_secrets.spk_public
    # The result carries no private key: EK_A is gone once SK exists (X3DH §3.3).
    assert not hasattr(a, "ephemeral_private") and not hasattr(a, "ratchet_dh")
    assert (a.initial.opk_id is not None) is use_one_time
    assert (a.initial.kem_ciphertext is not None) is (suite == SUITE_HYBRID)
    assert a.peer_did == BOB.did and b.peer_did == ALICE.did


def test_suites_give_different_secrets(bob_secrets: PrekeySecrets, alice_ik: IdentityKey) -> None:
    a = initiate(alice_ik, bob_secrets.bundle(), suite=SUITE_HYBRID)
    classical = dataclasses.replace(a.initial, suite=SUITE_X25519, pq_id=None, kem_ciphertext=None)
    assert respond(bob_secrets, classical).shared_secret != a.shared_secret


def test_default_suite_prefers_hybrid(bob_secrets: PrekeySecrets, alice_ik: IdentityKey) -> None:
    assert initiate(alice_ik, bob_secrets.bundle()).suite == SUITE_HYBRID
    classical_only = PrekeySecrets.generate(BOB)
    assert initiate(alice_ik, classical_only.bundle()).suite == SUITE_X25519


def test_suite_errors(alice_ik: IdentityKey) -> None:
    classical_only = PrekeySecrets.generate(BOB)
    with pytest.raises(BundleError, match="does not offer suite 'x25519-mlkem768'"):
        initiate(alice_ik, classical_only.bundle(), suite=SUITE_HYBRID)
    with pytest.raises(BundleError, match="unknown suite 'rot13'"):
        initiate(alice_ik, classical_only.bundle(), suite="rot13")
    hybrid = PrekeySecrets.generate(BOB, pq=True)
    a = initiate(alice_ik, hybrid.bundle(), suite=SUITE_HYBRID)
    with pytest.raises(BundleError, match="not offered"):
        respond(classical_only, a.initial)


def test_forged_bundle_rejected_before_any_dh(
    bob_secrets: PrekeySecrets, alice_ik: IdentityKey
) -> None:
    forged = dataclasses.replace(bob_secrets.bundle(), spk=alice_ik.public)
    with pytest.raises(BundleError, match="signature"):
        initiate(alice_ik, forged)


def test_responder_errors(bob_secrets: PrekeySecrets, alice_ik: IdentityKey) -> None:
    a = initiate(alice_ik, bob_secrets.bundle(), suite=SUITE_HYBRID)
    with pytest.raises(BundleError, match="unknown signed prekey id 99"):
        respond(bob_secrets, dataclasses.replace(a.initial, spk_id=99))
    with pytest.raises(BundleError, match="unknown one-time prekey 77"):
        respond(bob_secrets, dataclasses.replace(a.initial, opk_id=77))
    with pytest.raises(BundleError, match="unknown ML-KEM prekey id 5"):
        respond(bob_secrets, dataclasses.replace(a.initial, pq_id=5))
    # Someone else's DID on Alice's X25519 key: the binding signature does not match.
    with pytest.raises(SignatureError, match="not signed by"):
        respond(bob_secrets, dataclasses.replace(a.initial, did=BOB.did))
    with pytest.raises(MalformedFrameError, match="ML-KEM ciphertext"):
        respond(bob_secrets, dataclasses.replace(a.initial, kem_ciphertext=b"\x00" * 10))
    with pytest.raises(BundleError, match="low-order"):
        respond(bob_secrets, dataclasses.replace(a.initial, ephemeral=bytes(32)))


def test_tampered_kem_ciphertext_changes_secret(
    bob_secrets: PrekeySecrets, alice_ik: IdentityKey
) -> None:
    # ML-KEM decapsulation rejects implicitly: a flipped bit yields another key, and the
    # first message's AEAD then fails (see test_ratchet).
    a = initiate(alice_ik, bob_secrets.bundle(), suite=SUITE_HYBRID)
    assert a.initial.kem_ciphertext is not None
    ct = bytearray(a.initial.kem_ciphertext)
    ct[0] ^= 1
    b = respond(bob_secrets, dataclasses.replace(a.initial, kem_ciphertext=bytes(ct)))
    assert b.shared_secret != a.shared_secret


def test_initial_data_round_trip_and_garbage(
    bob_secrets: PrekeySecrets, alice_ik: IdentityKey
) -> None:
    for suite in (SUITE_X25519, SUITE_HYBRID):
        init = initiate(alice_ik, bob_secrets.bundle(), suite=suite).initial
        wire = init.to_bytes()
        assert InitialData.from_bytes(wire) == init
        for bad in (wire[:-1], wire + b"\x00", b"\x07" + wire[1:], b""):
            with pytest.raises(MalformedFrameError):
                InitialData.from_bytes(bad)
    bad_did = dataclasses.replace(init, did="did:key:zNotBase58!").to_bytes()
    with pytest.raises(MalformedFrameError, match="initial data"):
        respond(bob_secrets, InitialData.from_bytes(bad_did))


# --- known-answer vectors (tests/vectors/x3dh, made by make_session_vectors.py) ---

VECTORS = Path(__file__).parents[1] / "vectors" / "x3dh"


def load(name: str) -> dict[str, Any]:
    return json.loads((VECTORS / name).read_text())  # type: ignore[no-any-return]


def rng_from(keys: dict[str, str], labels: list[str]) -> Callable[[int], bytes]:
    it = iter(labels)
    return lambda n: bytes.fromhex(keys[next(it)])


def independent_sk(v: dict[str, Any], kem_secret: bytes = b"") -> bytes:
    """The Signal-spec formula computed with OpenSSL X25519 and cryptography's HKDF."""
    k = {
        name: X25519PrivateKey.from_private_bytes(bytes.fromhex(h))
        for name, h in v["keys"].items()
        if len(h) == 64
    }

    def pub(name: str) -> X25519PublicKey:
        return k[name].public_key()

    dhs = [
        k["alice-ik"].exchange(pub("bob-spk")),
        k["alice-ek"].exchange(pub("bob-ik")),
        k["alice-ek"].exchange(pub("bob-spk")),
        k["alice-ek"].exchange(pub("bob-opk-1")),
    ]
    info = INFO_HYBRID if kem_secret else INFO_X25519
    return HKDF(hashes.SHA256(), 32, salt=bytes(32), info=info).derive(
        b"\xff" * 32 + b"".join(dhs) + kem_secret
    )


def test_x25519_vector_both_sides() -> None:
    v = load("x25519.json")
    assert v["source"] and v["note"]
    keys = v["keys"]
    alice = Wallet.from_seed(bytes.fromhex(keys["alice-seed"]))
    bob = Wallet.from_seed(bytes.fromhex(keys["bob-seed"]))
    assert (alice.did, bob.did) == (v["alice_did"], v["bob_did"])
    ik = IdentityKey.generate(alice, rng_from(keys, ["alice-ik"]))
    secrets = PrekeySecrets.generate(
        bob, one_time=1, rng=rng_from(keys, ["bob-ik", "bob-spk", "bob-opk-1"])
    )
    assert secrets.bundle().to_bytes().hex() == v["bundle"]
    a = initiate(
        ik, PrekeyBundle.from_bytes(bytes.fromhex(v["bundle"])), rng=rng_from(keys, ["alice-ek"])
    )
    assert a.initial.to_bytes().hex() == v["initial_data"]
    b = respond(secrets, InitialData.from_bytes(bytes.fromhex(v["initial_data"])))
    for r in (a, b):
        assert r.shared_secret.hex() == v["shared_secret"]
        assert r.associated_data.hex() == v["associated_data"]
    assert independent_sk(v).hex() == v["shared_secret"]


def test_hybrid_vector_responder_side() -> None:
    v = load("x25519-mlkem768.json")
    keys = v["keys"]
    bob = Wallet.from_seed(bytes.fromhex(keys["bob-seed"]))
    secrets = PrekeySecrets.generate(
        bob,
        one_time=1,
        pq=True,
        rng=rng_from(keys, ["bob-ik", "bob-spk", "bob-pq-seed", "bob-opk-1"]),
    )
    assert secrets.bundle().to_bytes().hex() == v["bundle"]
    initial = InitialData.from_bytes(bytes.fromhex(v["initial_data"]))
    b = respond(secrets, initial)
    assert b.shared_secret.hex() == v["shared_secret"]
    assert b.associated_data.hex() == v["associated_data"]
    pq = MLKEM768PrivateKey.from_seed_bytes(bytes.fromhex(keys["bob-pq-seed"]))
    assert initial.kem_ciphertext is not None
    assert independent_sk(v, pq.decapsulate(initial.kem_ciphertext)).hex() == v["shared_secret"]
