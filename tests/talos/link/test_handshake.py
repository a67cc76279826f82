"""The Noise link handshake (talos/link/handshake.py): success, channel, every refusal."""

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
from talos.link import wire
from talos_sdk.did import did_from_public_key, public_key_from_did
from talos_sdk.errors import DecryptionError
from tests.talos.link.pair import HandshakePair


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


def pair(a: KeySigner, b: KeySigner, *, pq: bool = False, **kw: object) -> HandshakePair:
    ini = hs.LinkHandshake(a, hs.Role.INITIATOR, verify=ed_verify, pq=pq, **kw)  # type: ignore[arg-type]
    res = hs.LinkHandshake(b, hs.Role.RESPONDER, verify=ed_verify)
    return HandshakePair(ini, res)


@pytest.mark.parametrize("pq", [False, True])
def test_both_sides_authenticate_and_share_a_channel(pq: bool) -> None:
    a, b = signer(), signer()
    p = pair(a, b, pq=pq, expected_did=b.did)
    got_a, got_b = p.run()
    assert got_a.peer_did == b.did and got_b.peer_did == a.did
    assert got_a.transcript_hash == got_b.transcript_hash
    assert got_a.kem == got_b.kem == ("x25519-mlkem768" if pq else "x25519")
    assert got_a.suites == hs.SUITES
    assert len(p.wire) == 4  # e / e,ee,s,es / s,se / sealed ACCEPT
    assert p.wire[0][0] == (hs.SUITE_HYBRID if pq else hs.SUITE_CLASSICAL)
    ca, cb = p.ini.channel, p.res.channel
    assert ca is not None and cb is not None
    for n in range(3):
        assert cb.open(ca.seal(b"a%d" % n)) == b"a%d" % n
        assert ca.open(cb.seal(b"b%d" % n)) == b"b%d" % n


def test_no_did_crosses_in_the_clear() -> None:
    a, b = signer(), signer()
    p = pair(a, b)
    p.run()
    for did in (a.did, b.did):
        assert all(did.encode() not in m for m in p.wire)
        key = public_key_from_did(did)
        assert all(key not in m for m in p.wire)


def test_common_suites_follow_our_preference() -> None:
    a, b = signer(), signer()
    ini = hs.LinkHandshake(a, hs.Role.INITIATOR, verify=ed_verify)
    res = hs.LinkHandshake(b, hs.Role.RESPONDER, verify=ed_verify, suites=("x25519",))
    got_a, got_b = HandshakePair(ini, res).run()
    assert got_a.suites == got_b.suites == ("x25519",)


def test_impostor_claiming_another_did_is_refused() -> None:
    victim, attacker = signer(), signer()
    liar = KeySigner(attacker.key, claim=victim.did)
    p = pair(liar, signer())
    with pytest.raises(hs.Refusal, match="does not verify") as err:
        p.run()
    assert err.value.code == hs.CLOSE_BAD_PROOF
    assert err.value.farewell is not None  # sealed REFUSE for the dialer


def test_impostor_responder_is_refused_by_dialer() -> None:
    real, attacker = signer(), signer()
    liar = KeySigner(attacker.key, claim=real.did)
    p = pair(signer(), liar, expected_did=real.did)
    with pytest.raises(hs.Refusal, match="does not verify") as err:
        p.run()
    assert err.value.code == hs.CLOSE_BAD_PROOF


def test_pinned_did_mismatch_is_refused_without_naming_dids() -> None:
    a, b = signer(), signer()
    p = pair(a, b, expected_did=signer().did)
    with pytest.raises(hs.Refusal) as err:
        p.run()
    assert err.value.code == hs.CLOSE_PINNED_MISMATCH
    assert "did:key" not in err.value.reason and b.did in str(err.value)


def test_unauthorized_peer_gets_a_sealed_refusal() -> None:
    a, b = signer(), signer()
    ini = hs.LinkHandshake(a, hs.Role.INITIATOR, verify=ed_verify)
    res = hs.LinkHandshake(b, hs.Role.RESPONDER, verify=ed_verify, authorizer=lambda d: False)
    p = HandshakePair(ini, res)
    with pytest.raises(hs.Refusal) as err:
        p.run()
    assert err.value.code == hs.CLOSE_UNAUTHORIZED
    assert err.value.farewell is not None
    with pytest.raises(hs.PeerRefused) as refused:
        ini.receive(err.value.farewell)
    assert refused.value.code == hs.CLOSE_UNAUTHORIZED


def test_no_common_suite_is_refused() -> None:
    a, b = signer(), signer()
    ini = hs.LinkHandshake(a, hs.Role.INITIATOR, verify=ed_verify, suites=("x25519",))
    res = hs.LinkHandshake(b, hs.Role.RESPONDER, verify=ed_verify, suites=("other",))
    with pytest.raises(hs.Refusal) as err:
        HandshakePair(ini, res).run()
    assert err.value.code == hs.CLOSE_NO_SUITE


def test_peer_claiming_our_did_is_refused() -> None:
    a = signer()
    with pytest.raises(hs.Refusal, match="our own DID"):
        pair(KeySigner(Ed25519PrivateKey.generate(), claim=a.did), a).run()


def _flip(at: int, where: int) -> object:
    def tamper(index: int, data: bytes) -> bytes:
        if index != at:
            return data
        bad = bytearray(data)
        bad[where] ^= 0x01
        return bytes(bad)

    return tamper


@pytest.mark.parametrize("pq", [False, True])
@pytest.mark.parametrize("at", [0, 1, 2, 3])
@pytest.mark.parametrize("where", [1, -1])
def test_any_flipped_bit_stops_the_handshake(pq: bool, at: int, where: int) -> None:
    p = pair(signer(), signer(), pq=pq)
    p.tamper = _flip(at, where)  # type: ignore[assignment]
    with pytest.raises(hs.Refusal) as err:
        p.run()
    assert err.value.code in (hs.CLOSE_BAD_PROOF, hs.CLOSE_PROTOCOL)


def test_rewritten_suite_byte_is_no_downgrade() -> None:
    """A relay turning a hybrid offer into a classical one breaks message 2."""
    p = pair(signer(), signer(), pq=True)
    p.tamper = lambda i, d: bytes((hs.SUITE_CLASSICAL,)) + d[1:33] if i == 0 else d
    with pytest.raises(hs.Refusal) as err:
        p.run()
    assert err.value.code in (hs.CLOSE_BAD_PROOF, hs.CLOSE_PROTOCOL)


def test_replayed_handshake_cannot_complete() -> None:
    """Recorded messages 1 and 3 replayed to the responder: message 3 fails to open."""
    a, b = signer(), signer()
    first = pair(a, b)
    first.run()
    res = hs.LinkHandshake(b, hs.Role.RESPONDER, verify=ed_verify)
    res.receive(first.wire[0])
    with pytest.raises(hs.Refusal) as err:
        res.receive(first.wire[2])
    assert err.value.code == hs.CLOSE_BAD_PROOF


def test_truncated_and_unknown_messages_are_refused() -> None:
    res = hs.LinkHandshake(signer(), hs.Role.RESPONDER, verify=ed_verify)
    with pytest.raises(hs.Refusal, match="suite") as err:
        res.receive(b"\x07" + bytes(32))
    assert err.value.code == hs.CLOSE_PROTOCOL
    with pytest.raises(hs.Refusal, match="malformed"):
        hs.LinkHandshake(signer(), hs.Role.RESPONDER).receive(b"\x00" + bytes(5))
    with pytest.raises(hs.Refusal, match=r"malformed|suite"):
        hs.LinkHandshake(signer(), hs.Role.RESPONDER).receive(b"")


def test_out_of_order_messages_are_refused() -> None:
    a, b = signer(), signer()
    p = pair(a, b)
    p.run()
    with pytest.raises(hs.Refusal, match="unexpected"):
        p.res.receive(p.wire[2])
    with pytest.raises(hs.Refusal, match="unexpected"):
        p.ini.receive(p.wire[1])


def test_accept_must_come_sealed_from_the_responder() -> None:
    a, b = signer(), signer()
    p = pair(a, b)
    p.tamper = lambda i, d: wire.encode(wire.Accept()) if i == 3 else d
    with pytest.raises(hs.Refusal):
        p.run()


def test_channel_refuses_replay_and_reorder() -> None:
    p = pair(signer(), signer())
    p.run()
    ca, cb = p.ini.channel, p.res.channel
    assert ca is not None and cb is not None
    one, two = ca.seal(b"1"), ca.seal(b"2")
    with pytest.raises(DecryptionError):
        cb.open(two)
    assert cb.open(one) == b"1"
    with pytest.raises(DecryptionError):
        cb.open(one)


def test_randomness_is_injectable() -> None:
    """The same keys give the same handshake bytes (what test vectors need)."""

    def fixed(n: int) -> bytes:
        return bytes(range(n))

    a = KeySigner(Ed25519PrivateKey.from_private_bytes(b"\x01" * 32))
    first = hs.LinkHandshake(a, hs.Role.INITIATOR, random=fixed).start()
    again = hs.LinkHandshake(a, hs.Role.INITIATOR, random=fixed).start()
    assert first == again
    assert first != hs.LinkHandshake(a, hs.Role.INITIATOR, random=os.urandom).start()
