"""The mutual link handshake (talos/link/handshake.py): success and every refusal."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from talos.link import handshake as hs
from talos.link.wire import Hello, Proof
from talos_sdk.did import did_from_public_key, public_key_from_did


@dataclass
class KeySigner:
    """A raw Ed25519 key as a handshake signer; ``claim`` lets a test lie about its DID."""

    key: Ed25519PrivateKey
    claim: str | None = None

    @property
    def did(self) -> str:
        if self.claim is not None:
            return self.claim
        raw = self.key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return did_from_public_key(raw)

    def sign(self, data: bytes) -> bytes:
        return self.key.sign(data)


def ed_verify(did: str, data: bytes, sig: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key_from_did(did)).verify(sig, data)
    except InvalidSignature:
        return False
    return True


def signer(claim: str | None = None) -> KeySigner:
    return KeySigner(Ed25519PrivateKey.generate(), claim)


def pair(a: KeySigner, b: KeySigner, **kw: object) -> tuple[hs.LinkHandshake, hs.LinkHandshake]:
    ini = hs.LinkHandshake(a, hs.Role.INITIATOR, os.urandom(32), verify=ed_verify, **kw)  # type: ignore[arg-type]
    res = hs.LinkHandshake(b, hs.Role.RESPONDER, os.urandom(32), verify=ed_verify)
    return ini, res


def run(ini: hs.LinkHandshake, res: hs.LinkHandshake) -> tuple[hs.Authenticated, hs.Authenticated]:
    res_proof = res.receive_hello(ini.hello())
    ini_proof = ini.receive_hello(res.hello())
    return ini.receive_proof(res_proof), res.receive_proof(ini_proof)


def test_both_sides_authenticate_each_other() -> None:
    a, b = signer(), signer()
    ini, res = pair(a, b, expected_did=b.did)
    got_a, got_b = run(ini, res)
    assert got_a.peer_did == b.did
    assert got_b.peer_did == a.did
    assert got_a.transcript_hash == got_b.transcript_hash
    assert got_a.suites == hs.SUITES


def test_common_suites_follow_our_preference() -> None:
    a, b = signer(), signer()
    ini = hs.LinkHandshake(a, hs.Role.INITIATOR, os.urandom(32), verify=ed_verify)
    res = hs.LinkHandshake(
        b, hs.Role.RESPONDER, os.urandom(32), verify=ed_verify, suites=("x25519",)
    )
    got_a, got_b = run(ini, res)
    assert got_a.suites == got_b.suites == ("x25519",)


def test_impostor_claiming_another_did_is_refused() -> None:
    victim, real = signer(), signer()
    impostor = signer(claim=victim.did)  # holds a different key
    ini, res = pair(impostor, real)
    res_proof = res.receive_hello(ini.hello())
    ini_proof = ini.receive_hello(res.hello())
    with pytest.raises(hs.Refusal, match="does not verify") as exc:
        res.receive_proof(ini_proof)
    assert exc.value.code == hs.CLOSE_BAD_PROOF
    # The honest side's proof still verifies for the impostor: it learns nothing it can reuse.
    assert ini.receive_proof(res_proof).peer_did == real.did


def test_impostor_responder_is_refused_by_dialer() -> None:
    victim, a = signer(), signer()
    impostor = signer(claim=victim.did)
    ini, res = pair(a, impostor, expected_did=victim.did)
    res_proof = res.receive_hello(ini.hello())
    ini.receive_hello(res.hello())
    with pytest.raises(hs.Refusal) as exc:
        ini.receive_proof(res_proof)
    assert exc.value.code == hs.CLOSE_BAD_PROOF


def test_proof_from_another_session_is_refused() -> None:
    a, b = signer(), signer()
    ini1, res1 = pair(a, b)
    res1.receive_hello(ini1.hello())
    old_proof = ini1.receive_hello(res1.hello())
    ini2, res2 = pair(a, b)
    res2.receive_hello(ini2.hello())
    with pytest.raises(hs.Refusal, match="does not verify"):
        res2.receive_proof(old_proof)


def test_reflected_proof_is_refused() -> None:
    """A responder's own proof sent back to it fails: the role is signed."""
    a, b = signer(), signer()
    ini, res = pair(a, b)
    res_proof = res.receive_hello(ini.hello())
    with pytest.raises(hs.Refusal, match="does not verify"):
        res.receive_proof(res_proof)


def test_pinned_did_mismatch_is_refused() -> None:
    a, b, c = signer(), signer(), signer()
    ini, res = pair(a, b, expected_did=c.did)
    with pytest.raises(hs.Refusal, match="pinned DID mismatch") as exc:
        ini.receive_hello(res.hello())
    assert exc.value.code == hs.CLOSE_PINNED_MISMATCH


def test_unauthorized_peer_is_refused() -> None:
    a, b = signer(), signer()
    ini = hs.LinkHandshake(a, hs.Role.INITIATOR, os.urandom(32), verify=ed_verify)
    res = hs.LinkHandshake(
        b, hs.Role.RESPONDER, os.urandom(32), verify=ed_verify, authorizer=lambda d: False
    )
    with pytest.raises(hs.Refusal, match="unknown peer") as exc:
        res.receive_hello(ini.hello())
    assert exc.value.code == hs.CLOSE_UNAUTHORIZED


def test_no_common_suite_is_refused() -> None:
    a, b = signer(), signer()
    ini = hs.LinkHandshake(a, hs.Role.INITIATOR, os.urandom(32), verify=ed_verify, suites=("x",))
    res = hs.LinkHandshake(b, hs.Role.RESPONDER, os.urandom(32), verify=ed_verify)
    with pytest.raises(hs.Refusal, match="no session suite") as exc:
        res.receive_hello(ini.hello())
    assert exc.value.code == hs.CLOSE_NO_SUITE


def test_peer_claiming_our_did_is_refused() -> None:
    a = signer()
    ini, res = pair(a, signer(claim=a.did))
    with pytest.raises(hs.Refusal, match="our own DID"):
        ini.receive_hello(res.hello())


def test_echoed_nonce_is_refused() -> None:
    a, b = signer(), signer()
    ini, _ = pair(a, b)
    mine = ini.hello()
    with pytest.raises(hs.Refusal, match="echoed"):
        ini.receive_hello(Hello(b.did, mine.nonce, hs.SUITES))


def test_malformed_did_is_refused_not_crashed() -> None:
    a = signer()
    ini, _ = pair(a, signer())
    ini.receive_hello(Hello("did:key:not-a-key", os.urandom(32), hs.SUITES))
    with pytest.raises(hs.Refusal, match="does not verify"):
        ini.receive_proof(Proof(b"\x00" * 64))


def test_out_of_order_frames_are_refused() -> None:
    a, b = signer(), signer()
    ini, res = pair(a, b)
    with pytest.raises(hs.Refusal, match="proof before hello") as exc:
        ini.receive_proof(Proof(b"x"))
    assert exc.value.code == hs.CLOSE_PROTOCOL
    ini.receive_hello(res.hello())
    with pytest.raises(hs.Refusal, match="second hello"):
        ini.receive_hello(res.hello())


def test_nonce_length_is_checked() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        hs.LinkHandshake(signer(), hs.Role.INITIATOR, b"short")
