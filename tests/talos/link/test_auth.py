"""Hybrid link authentication: talos/link/auth.py with the Noise handshake (ADR 0005)."""

from __future__ import annotations

from pathlib import Path

import pytest

from talos.link import handshake as hs
from talos.link.auth import CLOSE_DOWNGRADE, CLOSE_PQ_REQUIRED, AuthPolicy, check_bundle_auth
from talos.pins import load_pin, store_pin
from talos.store import Store
from talos_sdk.errors import BundleError
from talos_sdk.hybrid import SUITE_ED25519, SUITE_HYBRID, PinnedKeyChangedError
from talos_sdk.prekeys import PrekeySecrets
from talos_sdk.wallet import Wallet
from tests.talos.link.pair import HandshakePair

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
        return AuthPolicy(require_pq, self.rows.get)

    def keep(self, *results: hs.Authenticated) -> None:
        """What the node does with ``new_pin`` (through its writer)."""
        for r in results:
            if r.new_pin is not None:
                self.rows[r.peer_did] = r.new_pin


class _ClaimingSigner:
    """Claims an ML-DSA key it cannot sign with (a key-substitution attempt)."""

    def __init__(self, wallet: Wallet, mldsa: bytes) -> None:
        self.did = wallet.did
        self.sign = wallet.sign
        self.mldsa_public_key = mldsa


def make(
    a: object, b: object, pa: AuthPolicy | None = None, pb: AuthPolicy | None = None
) -> HandshakePair:
    ini = hs.LinkHandshake(a, hs.Role.INITIATOR, policy=pa)  # type: ignore[arg-type]
    res = hs.LinkHandshake(b, hs.Role.RESPONDER, policy=pb)  # type: ignore[arg-type]
    return HandshakePair(ini, res)


def test_hybrid_to_hybrid_uses_both_and_pins() -> None:
    pins_a, pins_b = Pins(), Pins()
    a, b = make(H1, H2, pins_a.policy(), pins_b.policy()).run()
    assert (a.auth_suite, b.auth_suite) == (SUITE_HYBRID, SUITE_HYBRID)
    assert a.peer_mldsa65 == H2.mldsa_public_key and b.peer_mldsa65 == H1.mldsa_public_key
    assert a.new_pin == H2.mldsa_public_key and b.new_pin == H1.mldsa_public_key
    pins_a.keep(a)
    pins_b.keep(b)
    # Second contact: same key, nothing new pinned, still hybrid.
    a2, b2 = make(H1, H2, pins_a.policy(), pins_b.policy()).run()
    assert a2.auth_suite == SUITE_HYBRID and a2.new_pin is None and b2.new_pin is None


def test_hybrid_identity_travels_encrypted() -> None:
    p = make(H1, H2)
    p.run()
    assert len(p.wire[1]) > 1952 + 3309  # ML-DSA-65 key and hybrid signature inside
    for m in p.wire:
        assert H1.mldsa_public_key not in m and H2.mldsa_public_key not in m


@pytest.mark.parametrize(("a", "b"), [(H1, C1), (C1, H1)])
def test_hybrid_and_classical_interoperate(a: Wallet, b: Wallet) -> None:
    x, y = make(a, b, Pins().policy(), Pins().policy()).run()
    suites = {x.peer_did: x.auth_suite, y.peer_did: y.auth_suite}
    assert suites == {C1.did: SUITE_ED25519, H1.did: SUITE_HYBRID}
    pins = {r.peer_did: r.new_pin for r in (x, y) if r.new_pin is not None}
    assert pins == {H1.did: H1.mldsa_public_key}  # only the hybrid side is pinned


def test_classical_peer_refused_under_require_pq() -> None:
    # A classical handshake offer is refused before anything is said.
    with pytest.raises(hs.Refusal, match="requires hybrid") as err:
        make(C1, H1, pb=Pins().policy(require_pq=True)).run()
    assert err.value.code == CLOSE_PQ_REQUIRED
    # A hybrid handshake from a classical identity is refused on the identity.
    ini = hs.LinkHandshake(C1, hs.Role.INITIATOR, pq=True)
    res = hs.LinkHandshake(H1, hs.Role.RESPONDER, policy=Pins().policy(require_pq=True))
    with pytest.raises(hs.Refusal, match="requires hybrid") as err:
        HandshakePair(ini, res).run()
    assert err.value.code == CLOSE_PQ_REQUIRED
    # The dialer applies it too, to the responder's identity.
    with pytest.raises(hs.Refusal) as err:
        make(H1, C1, pa=Pins().policy(require_pq=True)).run()
    assert err.value.code == CLOSE_PQ_REQUIRED


def test_downgrade_after_pinning_is_refused() -> None:
    pins = Pins()
    pins.keep(make(C1, H1, pa=pins.policy()).run()[0])  # C1 pins H1's key
    with pytest.raises(hs.Refusal, match="downgrade refused") as err:
        make(C1, H1_CLASSICAL, pa=pins.policy()).run()
    assert err.value.code == CLOSE_DOWNGRADE


def test_changed_mldsa_key_is_refused() -> None:
    pins = Pins()
    pins.rows[H1.did] = H1_OTHER_KEY.mldsa_public_key
    with pytest.raises(hs.Refusal, match="is pinned") as err:
        make(H1, C1, pb=pins.policy()).run()
    assert err.value.code == CLOSE_DOWNGRADE


def test_claimed_mldsa_key_without_its_signature_fails() -> None:
    """A classical signature under a claimed hybrid key, or another identity's key."""
    for claimed in (H1.mldsa_public_key, H1_OTHER_KEY.mldsa_public_key):
        with pytest.raises(hs.Refusal, match="hybrid identity signature") as err:
            make(_ClaimingSigner(H1_CLASSICAL, claimed), H2).run()
        assert err.value.code == hs.CLOSE_BAD_PROOF


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
