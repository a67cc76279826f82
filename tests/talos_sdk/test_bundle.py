"""Prekey bundles and their secrets (talos_sdk/bundle.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from talos_sdk.bundle import (
    SUITE_HYBRID,
    SUITE_X25519,
    ByteReader,
    IdentityKey,
    PrekeyBundle,
    x25519_dh,
    x25519_keypair,
)
from talos_sdk.errors import BundleError, EncodingError, MalformedFrameError, UsageError
from talos_sdk.hybrid import HYBRID_SIGNATURE_SIZE
from talos_sdk.hybrid import SUITE_HYBRID as AUTH_HYBRID
from talos_sdk.prekeys import PrekeySecrets
from talos_sdk.wallet import Wallet


def counter_rng(start: int = 1):  # type: ignore[no-untyped-def]
    """Deterministic bytes so bundles reproduce (the SDK takes randomness as a parameter)."""
    state = [start]

    def rng(n: int) -> bytes:
        state[0] += 1
        return bytes((state[0] + i) % 256 for i in range(n))

    return rng


@pytest.fixture(scope="module")
def wallet() -> Wallet:
    return Wallet.from_seed(bytes(range(32)))


@pytest.fixture(scope="module")
def hybrid_secrets(wallet: Wallet) -> PrekeySecrets:
    return PrekeySecrets.generate(wallet, one_time=3, pq=True, rng=counter_rng())


@pytest.mark.parametrize("pq", [False, True])
def test_bundle_round_trip_and_verify(wallet: Wallet, pq: bool) -> None:
    secrets = PrekeySecrets.generate(wallet, one_time=2, pq=pq)
    bundle = secrets.bundle()
    again = PrekeyBundle.from_bytes(bundle.to_bytes())
    assert again == bundle
    assert again.verify() is again
    assert again.did == wallet.did and again.signing_key == wallet.public_key
    assert [i for i, _ in again.one_time] == [1, 2]
    assert again.suites == ((SUITE_X25519, SUITE_HYBRID) if pq else (SUITE_X25519,))
    assert (again.pq_public is not None) is pq


def test_generation_is_reproducible_with_injected_rng(wallet: Wallet) -> None:
    a = PrekeySecrets.generate(wallet, one_time=2, pq=True, rng=counter_rng())
    b = PrekeySecrets.generate(wallet, one_time=2, pq=True, rng=counter_rng())
    assert a.to_bytes() == b.to_bytes()
    assert a.bundle().to_bytes() == b.bundle().to_bytes()


@pytest.mark.parametrize(
    "change",
    [
        {"spk": bytes(32)},
        {"identity_dh": bytes(32)},
        {"spk_id": 7},
        {"suites": (SUITE_X25519,)},
        {"signature": bytes(64)},
    ],
)
def test_tampered_bundle_fails_signature(hybrid_secrets: PrekeySecrets, change: dict) -> None:  # type: ignore[type-arg]
    bad = dataclasses.replace(hybrid_secrets.bundle(), **change)
    with pytest.raises(BundleError, match="signature does not verify"):
        bad.verify()


def test_bundle_signed_by_another_did(hybrid_secrets: PrekeySecrets) -> None:
    other = Wallet.from_seed(bytes(32))
    bad = dataclasses.replace(hybrid_secrets.bundle(), did=other.did)
    with pytest.raises(BundleError, match="signature"):
        bad.verify()


def test_unknown_suite_rejected(wallet: Wallet) -> None:
    secrets = PrekeySecrets.generate(wallet)
    body = dataclasses.replace(secrets.bundle(), suites=("x448-frodo",), signature=b"")
    signed = dataclasses.replace(
        body, signature=wallet.sign(b"Talos_PrekeyBundle_v1\x00" + body.signed_body())
    )
    with pytest.raises(BundleError, match="unknown suite"):
        PrekeyBundle.from_bytes(signed.to_bytes()).verify()


def test_hybrid_suite_without_kem_key_rejected(wallet: Wallet) -> None:
    secrets = PrekeySecrets.generate(wallet)
    body = dataclasses.replace(secrets.bundle(), suites=(SUITE_X25519, SUITE_HYBRID))
    signed = dataclasses.replace(
        body, signature=wallet.sign(b"Talos_PrekeyBundle_v1\x00" + body.signed_body())
    )
    with pytest.raises(BundleError, match="without an ML-KEM-768 prekey"):
        signed.verify()


def test_one_time_prekeys_consumed_once(wallet: Wallet) -> None:
    secrets = PrekeySecrets.generate(wallet, one_time=2)
    first = secrets.one_time_private(1)
    assert secrets.consume_one_time(1) == first
    assert [i for i, _ in secrets.bundle().one_time] == [2]
    with pytest.raises(BundleError, match="one-time prekey 1 was already used"):
        secrets.consume_one_time(1)
    with pytest.raises(BundleError, match="unknown one-time prekey 9"):
        secrets.one_time_private(9)
    # The used set survives persistence: a restart does not reopen a used OPK.
    restored = PrekeySecrets.from_bytes(secrets.to_bytes())
    with pytest.raises(BundleError, match="already used"):
        restored.consume_one_time(1)
    assert secrets.add_one_time(2) == [3, 4]
    assert [i for i, _ in secrets.bundle().one_time] == [2, 3, 4]
    secrets.bundle().verify()  # OPKs are unsigned: adding them keeps the signature valid


def test_secrets_round_trip_dict_and_bytes(hybrid_secrets: PrekeySecrets) -> None:
    d = json.loads(json.dumps(hybrid_secrets.to_dict()))
    from_dict = PrekeySecrets.from_dict(d)
    from_bytes = PrekeySecrets.from_bytes(hybrid_secrets.to_bytes())
    for s in (from_dict, from_bytes):
        assert s.to_bytes() == hybrid_secrets.to_bytes()
        assert s.bundle() == hybrid_secrets.bundle()
        s.bundle().verify()


@pytest.mark.parametrize("garbage", [b"", b"TPKS\x01", b"nonsense" * 10, b"TPKS\x01\x00\x05abc"])
def test_secrets_from_garbage(garbage: bytes) -> None:
    with pytest.raises(EncodingError):
        PrekeySecrets.from_bytes(garbage)


@pytest.mark.parametrize("d", [{}, {"version": 3}, {"version": 1, "did": "did:key:zzz"}])
def test_secrets_from_bad_dict(d: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(EncodingError):
        PrekeySecrets.from_dict(d)


def test_bundle_from_garbage(hybrid_secrets: PrekeySecrets) -> None:
    good = hybrid_secrets.bundle().to_bytes()
    for bad in (b"", good[:-1], good + b"\x00", b"\x02" + good[1:], good[:40]):
        with pytest.raises(MalformedFrameError):
            PrekeyBundle.from_bytes(bad)
    with pytest.raises(MalformedFrameError, match="expected bytes"):
        PrekeyBundle.from_bytes("text")  # type: ignore[arg-type]


def test_bundle_bad_did_and_kem_key(hybrid_secrets: PrekeySecrets) -> None:
    b = hybrid_secrets.bundle()
    with pytest.raises(MalformedFrameError, match="bundle DID"):
        dataclasses.replace(b, did="did:web:example.com")
    with pytest.raises(MalformedFrameError, match="ML-KEM-768 public key"):
        dataclasses.replace(b, pq_key=b"\x00" * 10)


def test_parsed_kem_keys_are_cached_within_a_bound(wallet: Wallet) -> None:
    from talos_sdk import bundle as bundle_module

    with pytest.raises(MalformedFrameError, match="ML-KEM-768 public key is invalid"):
        bundle_module._mlkem_public(b"\xff" * 1184)  # coefficients >= q: refused, not cached
    assert b"\xff" * 1184 not in bundle_module._MLKEM_PUBLIC
    made = [
        PrekeySecrets.generate(wallet, pq=True) for _ in range(bundle_module._MLKEM_PUBLIC_MAX + 6)
    ]
    assert len(bundle_module._MLKEM_PUBLIC) <= bundle_module._MLKEM_PUBLIC_MAX
    for secrets in made[-3:]:
        parsed = PrekeyBundle.from_bytes(secrets.bundle().to_bytes()).pq_public
        assert parsed is not None
        assert parsed.public_bytes_raw() == secrets.bundle().pq_key
    # An evicted key is parsed again, to the same bytes.
    oldest = made[0].bundle()
    assert oldest.pq_public is not None and oldest.pq_public.public_bytes_raw() == oldest.pq_key


def test_low_order_point_is_rejected() -> None:
    private, _ = x25519_keypair()
    with pytest.raises(BundleError, match="low-order"):
        x25519_dh(private, bytes(32))


def test_identity_key_binding(wallet: Wallet) -> None:
    ik = IdentityKey.generate(wallet)
    assert ik.did == wallet.did
    again = IdentityKey.from_private(wallet, ik.private)
    assert again.public == ik.public and again.binding == ik.binding  # Ed25519 is deterministic


def test_usage_errors(wallet: Wallet) -> None:
    with pytest.raises(UsageError, match="one_time"):
        PrekeySecrets.generate(wallet, one_time=-1)
    other = Wallet.from_seed(bytes(32))
    with pytest.raises(UsageError, match="another wallet"):
        PrekeySecrets.generate(wallet, identity=IdentityKey.generate(other))
    with pytest.raises(UsageError, match="32 bytes"):
        IdentityKey.from_private(wallet, b"short")


def test_byte_reader_reports_truncation() -> None:
    r = ByteReader(b"\x00\x05ab", "thing")
    with pytest.raises(MalformedFrameError, match="thing: truncated"):
        r.var16()


# --- hybrid (Ed25519 + ML-DSA-65) bundles: ADR 0005, docs/PROTOCOL.md "Prekey bundles" ---


@pytest.fixture(scope="module")
def hybrid_wallet() -> Wallet:
    return Wallet.from_seed(bytes(range(32)), suite=AUTH_HYBRID)


@pytest.fixture(scope="module")
def pq_auth_secrets(hybrid_wallet: Wallet) -> PrekeySecrets:
    return PrekeySecrets.generate(hybrid_wallet, one_time=2, pq=True, rng=counter_rng())


def test_hybrid_bundle_round_trip(hybrid_wallet: Wallet, pq_auth_secrets: PrekeySecrets) -> None:
    bundle = pq_auth_secrets.bundle()
    raw = bundle.to_bytes()
    assert raw[0] == 2  # version 2 = hybrid-signed
    assert len(bundle.signature) == HYBRID_SIGNATURE_SIZE
    again = PrekeyBundle.from_bytes(raw)
    assert again == bundle and again.verify() is again
    assert again.auth_suite == AUTH_HYBRID
    assert again.mldsa65_public_key == hybrid_wallet.mldsa_public_key
    assert again.hybrid_public_key == hybrid_wallet.hybrid_public_key
    assert again.did == hybrid_wallet.did  # DID unchanged: did:key of the Ed25519 key


def test_classical_bundle_is_still_version_1(wallet: Wallet, hybrid_secrets: PrekeySecrets) -> None:
    bundle = hybrid_secrets.bundle()
    assert bundle.to_bytes()[0] == 1 and len(bundle.signature) == 64
    assert bundle.auth_suite == "ed25519" and bundle.hybrid_public_key is None


def test_hybrid_secrets_round_trip(pq_auth_secrets: PrekeySecrets) -> None:
    raw = pq_auth_secrets.to_bytes()
    assert raw.startswith(b"TPKS\x04")  # hybrid identity, with the rotation block
    d = json.loads(json.dumps(pq_auth_secrets.to_dict()))
    for s in (PrekeySecrets.from_bytes(raw), PrekeySecrets.from_dict(d)):
        assert s.to_bytes() == raw
        assert s.bundle() == pq_auth_secrets.bundle()
        s.bundle().verify()


def test_hybrid_bundle_stripped_of_mldsa_half(pq_auth_secrets: PrekeySecrets) -> None:
    b = pq_auth_secrets.bundle()
    # Only the Ed25519 half left, ML-DSA key kept: wrong length.
    with pytest.raises(BundleError, match="length 64"):
        dataclasses.replace(b, signature=b.signature[:64]).verify()
    # ML-DSA key and half dropped (re-encoded as a classical bundle): the Ed25519
    # half signs the hybrid-labelled bytes, so it is no classical signature.
    stripped = dataclasses.replace(b, signature=b.signature[:64], mldsa65_public_key=None)
    with pytest.raises(BundleError, match="does not verify"):
        PrekeyBundle.from_bytes(stripped.to_bytes()).verify()


def test_hybrid_bundle_with_swapped_halves(
    hybrid_wallet: Wallet, pq_auth_secrets: PrekeySecrets
) -> None:
    b = pq_auth_secrets.bundle()
    other = PrekeySecrets.generate(hybrid_wallet, pq=True, rng=counter_rng(50)).bundle()
    assert other.signed_body() != b.signed_body()
    mixed = b.signature[:64] + other.signature[64:]
    with pytest.raises(BundleError, match="ML-DSA-65 half"):
        dataclasses.replace(b, signature=mixed).verify()
    mixed = other.signature[:64] + b.signature[64:]
    with pytest.raises(BundleError, match="Ed25519 half"):
        dataclasses.replace(b, signature=mixed).verify()


def test_hybrid_bundle_wrong_context_or_key(
    hybrid_wallet: Wallet, pq_auth_secrets: PrekeySecrets
) -> None:
    b = pq_auth_secrets.bundle()
    # A hybrid signature of the body without the bundle domain (another context).
    wrong_ctx = hybrid_wallet.sign_auth(b.signed_body())
    with pytest.raises(BundleError, match="does not verify"):
        dataclasses.replace(b, signature=wrong_ctx).verify()
    # Another identity's ML-DSA key claimed under this DID (key substitution).
    other = Wallet.from_seed(bytes(32), suite=AUTH_HYBRID)
    with pytest.raises(BundleError, match="does not verify"):
        dataclasses.replace(b, mldsa65_public_key=other.mldsa_public_key).verify()


def test_classical_signature_cannot_claim_an_mldsa_key(
    hybrid_wallet: Wallet, pq_auth_secrets: PrekeySecrets
) -> None:
    b = pq_auth_secrets.bundle()
    classical = hybrid_wallet.sign(b"Talos_PrekeyBundle_v1\x00" + b.signed_body())
    with pytest.raises(BundleError, match="length 64"):
        dataclasses.replace(b, signature=classical).verify()


def test_hybrid_bundle_bad_bytes(pq_auth_secrets: PrekeySecrets) -> None:
    good = pq_auth_secrets.bundle().to_bytes()
    for bad in (good[:-1], good + b"\x00", good[:3000], b"\x03" + good[1:]):
        with pytest.raises(MalformedFrameError):
            PrekeyBundle.from_bytes(bad)
    with pytest.raises(MalformedFrameError, match="ML-DSA-65 public key"):
        dataclasses.replace(pq_auth_secrets.bundle(), mldsa65_public_key=b"\x00" * 10)
