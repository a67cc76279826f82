"""Hybrid link authentication (ADR 0005): talos/link/auth.py with handshake.py and wire.py."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from talos.link import handshake as hs
from talos.link import wire
from talos.link.auth import (
    CLOSE_DOWNGRADE,
    CLOSE_PQ_REQUIRED,
    AuthPolicy,
    check_bundle_auth,
    load_pin,
    store_pin,
)
from talos.store import Store
from talos_sdk.bundle import PrekeySecrets
from talos_sdk.errors import BundleError, MalformedFrameError
from talos_sdk.hybrid import SUITE_ED25519, SUITE_HYBRID, PinnedKeyChangedError
from talos_sdk.wallet import Wallet

H1 = Wallet.from_seed(b"\x11" * 32, suite=SUITE_HYBRID)
H2 = Wallet.from_seed(b"\x12" * 32, suite=SUITE_HYBRID)
C1 = Wallet.from_seed(b"\x13" * 32)
H1_CLASSICAL = Wallet.from_seed(H1.seed)  # same DID as H1, no ML-DSA key
H1_OTHER_KEY = Wallet.from_seed(b"\x14" * 32, suite=SUITE_HYBRID)


class Pins:
    """An in-memory pin table standing in for the node's meta rows."""

    def __init__(self) -> None:
        self.rows: dict[str, bytes] = {}

    def policy(self, require_pq: bool = False) -> AuthPolicy:
        return AuthPolicy(require_pq, self.rows.get, self.rows.__setitem__)


def make(
    a: Wallet, b: Wallet, pa: AuthPolicy | None = None, pb: AuthPolicy | None = None
) -> tuple[hs.LinkHandshake, hs.LinkHandshake]:
    ini = hs.LinkHandshake(a, hs.Role.INITIATOR, os.urandom(32), policy=pa)
    res = hs.LinkHandshake(b, hs.Role.RESPONDER, os.urandom(32), policy=pb)
    return ini, res


def run(ini: hs.LinkHandshake, res: hs.LinkHandshake) -> tuple[hs.Authenticated, hs.Authenticated]:
    res_proof = res.receive_hello(wire.decode(wire.encode(ini.hello())))  # type: ignore[arg-type]
    ini_proof = ini.receive_hello(wire.decode(wire.encode(res.hello())))  # type: ignore[arg-type]
    ini_proof = wire.decode(wire.encode(ini_proof))  # type: ignore[assignment]
    return ini.receive_proof(res_proof), res.receive_proof(ini_proof)


def test_hybrid_to_hybrid_uses_both_and_pins() -> None:
    pins_a, pins_b = Pins(), Pins()
    a, b = run(*make(H1, H2, pins_a.policy(), pins_b.policy()))
    assert (a.auth_suite, b.auth_suite) == (SUITE_HYBRID, SUITE_HYBRID)
    assert a.peer_mldsa65 == H2.mldsa_public_key and b.peer_mldsa65 == H1.mldsa_public_key
    assert pins_a.rows == {H2.did: H2.mldsa_public_key}
    assert pins_b.rows == {H1.did: H1.mldsa_public_key}
    # Second contact: same key, nothing new pinned, still hybrid.
    a2, _ = run(*make(H1, H2, pins_a.policy(), pins_b.policy()))
    assert a2.auth_suite == SUITE_HYBRID


def test_hybrid_proof_is_hybrid_length() -> None:
    ini, res = make(H1, H2)
    proof = res.receive_hello(ini.hello())
    assert len(proof.signature) == 3373
    assert len(wire.encode(ini.hello())) > 1952


@pytest.mark.parametrize(("a", "b"), [(H1, C1), (C1, H1)])
def test_hybrid_and_classical_interoperate(a: Wallet, b: Wallet) -> None:
    pins = Pins()
    x, y = run(*make(a, b, pins.policy(), pins.policy()))
    suites = {x.peer_did: x.auth_suite, y.peer_did: y.auth_suite}
    assert suites == {C1.did: SUITE_ED25519, H1.did: SUITE_HYBRID}
    assert pins.rows == {H1.did: H1.mldsa_public_key}  # only the hybrid side is pinned


def test_classical_peer_refused_under_require_pq() -> None:
    ini, res = make(C1, H1, pb=Pins().policy(require_pq=True))
    with pytest.raises(hs.Refusal, match="requires hybrid") as err:
        res.receive_hello(ini.hello())
    assert err.value.code == CLOSE_PQ_REQUIRED
    # The dialer side applies it too, after hearing the responder's hello.
    ini, res = make(H1, C1, pa=Pins().policy(require_pq=True))
    res_proof = res.receive_hello(ini.hello())
    with pytest.raises(hs.Refusal) as err:
        ini.receive_hello(res.hello())
    assert err.value.code == CLOSE_PQ_REQUIRED
    assert res_proof.signature  # the classical side did nothing wrong


def test_downgrade_after_pinning_is_refused() -> None:
    pins = Pins()
    run(*make(C1, H1, pb=None, pa=pins.policy()))  # C1 pins H1's key
    ini, res = make(C1, H1_CLASSICAL, pa=pins.policy())
    res.receive_hello(ini.hello())
    with pytest.raises(hs.Refusal, match="downgrade refused") as err:
        ini.receive_hello(res.hello())
    assert err.value.code == CLOSE_DOWNGRADE


def test_changed_mldsa_key_is_refused() -> None:
    pins = Pins()
    pins.rows[H1.did] = H1_OTHER_KEY.mldsa_public_key
    ini, res = make(H1, C1, pb=pins.policy())
    with pytest.raises(hs.Refusal, match="is pinned") as err:
        res.receive_hello(ini.hello())
    assert err.value.code == CLOSE_DOWNGRADE


def test_mitm_stripping_the_hybrid_offer_breaks_the_proof() -> None:
    ini, res = make(H1, C1)
    stripped = dataclasses.replace(ini.hello(), mldsa65=b"")
    res_proof = res.receive_hello(stripped)  # C1 thinks H1 is classical
    ini_proof = ini.receive_hello(res.hello())
    with pytest.raises(hs.Refusal, match="does not verify") as err:
        res.receive_proof(ini_proof)
    assert err.value.code == hs.CLOSE_BAD_PROOF
    # and the other direction: the transcripts differ, so C1's proof fails at H1
    with pytest.raises(hs.Refusal, match="does not verify"):
        ini.receive_proof(res_proof)


def test_substituted_mldsa_key_in_hello_fails_the_proof() -> None:
    ini, res = make(H1, H2)
    forged = dataclasses.replace(ini.hello(), mldsa65=H1_OTHER_KEY.mldsa_public_key)
    res.receive_hello(forged)
    ini_proof = ini.receive_hello(res.hello())
    with pytest.raises(hs.Refusal, match="hybrid handshake proof does not verify"):
        res.receive_proof(ini_proof)


@pytest.mark.parametrize("cut", ["ed25519_only", "mldsa_only", "swapped"])
def test_stripped_or_swapped_proof_halves(cut: str) -> None:
    ini, res = make(H1, H2)
    res.receive_hello(ini.hello())
    proof = ini.receive_hello(res.hello()).signature
    other = H1.sign_auth(b"talos/link/v1/proof/\x00" + bytes(32))  # another transcript
    bad = {
        "ed25519_only": proof[:64],
        "mldsa_only": proof[64:],
        "swapped": proof[:64] + other[64:],
    }[cut]
    with pytest.raises(hs.Refusal) as err:
        res.receive_proof(wire.Proof(bad))
    assert err.value.code == hs.CLOSE_BAD_PROOF


def test_classical_proof_from_a_peer_claiming_a_hybrid_key() -> None:
    ini, res = make(H1_CLASSICAL, H2)
    claim = dataclasses.replace(ini.hello(), mldsa65=H1.mldsa_public_key)
    res.receive_hello(claim)
    proof = ini.receive_hello(res.hello())  # a 64-byte Ed25519 proof
    with pytest.raises(hs.Refusal, match="hybrid handshake proof"):
        res.receive_proof(proof)


def test_hello_wire_round_trip_and_bad_key() -> None:
    hello = wire.Hello(H1.did, b"\x01" * 32, ("x25519",), H1.mldsa_public_key)
    assert wire.decode(wire.encode(hello)) == hello
    classical = wire.Hello(C1.did, b"\x01" * 32, ("x25519",))
    assert wire.decode(wire.encode(classical)) == classical
    with pytest.raises(MalformedFrameError, match="ML-DSA-65 key must be 1952"):
        wire.decode(wire.encode(dataclasses.replace(hello, mldsa65=b"\x00" * 10)))


def test_check_bundle_auth() -> None:
    hybrid_bundle = PrekeySecrets.generate(H1).bundle().verify()
    classical_bundle = PrekeySecrets.generate(H1_CLASSICAL).bundle().verify()
    check_bundle_auth(hybrid_bundle, H1.mldsa_public_key)
    check_bundle_auth(classical_bundle, None)
    check_bundle_auth(hybrid_bundle, None)
    with pytest.raises(BundleError, match="downgrade refused"):
        check_bundle_auth(classical_bundle, H1.mldsa_public_key)
    with pytest.raises(BundleError, match="other than its link"):
        check_bundle_auth(hybrid_bundle, H1_OTHER_KEY.mldsa_public_key)


def test_pins_in_a_real_store(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as store:
        with store.write(durable=True) as txn:
            assert load_pin(txn, H1.did) is None
            store_pin(txn, H1.did, H1.mldsa_public_key)
            store_pin(txn, H1.did, H1.mldsa_public_key)  # idempotent
        with store.read() as txn:
            assert load_pin(txn, H1.did) == H1.mldsa_public_key
        with pytest.raises(PinnedKeyChangedError), store.write() as txn:
            store_pin(txn, H1.did, H1_OTHER_KEY.mldsa_public_key)
        with store.read() as txn:
            assert load_pin(txn, H1.did) == H1.mldsa_public_key
