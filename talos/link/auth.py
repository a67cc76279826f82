"""Which signature suite a link peer authenticates with, and the pins that keep it honest.

docs/adr/0005-hybrid-signatures.md, docs/PROTOCOL.md "Link protocol"
(handshake) and "Hybrid signatures" (pinning table). Pure: the node hands in
how to read and store pins, this module decides.

A hybrid node sends its ML-DSA-65 public key in HELLO; both keys go into the
transcript hash, and its PROOF is a hybrid signature (``Wallet.sign_auth``).
:class:`AuthPolicy` applies :func:`talos_sdk.hybrid.decide_peer_pin` to what a
peer presents and turns a :class:`~talos_sdk.hybrid.PeerSuiteError` into a
refusal with its own close code: 4008 (downgrade or changed key), 4009
(post-quantum required). Pins live in the ``meta`` database as
``pin:mldsa65:`` || DID -> raw key (the ``peers`` rows are DID -> address and
are listed as such), written once, on first contact, never overwritten.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from talos_sdk.errors import BundleError
from talos_sdk.hybrid import (
    SUITE_ED25519,
    PeerSuiteError,
    PinDecision,
    PinnedKeyChangedError,
    PostQuantumRequiredError,
    decide_peer_pin,
)

if TYPE_CHECKING:
    from talos.store import Txn
    from talos_sdk.bundle import PrekeyBundle

__all__ = [
    "CLOSE_DOWNGRADE",
    "CLOSE_PQ_REQUIRED",
    "PIN_PREFIX",
    "AuthPolicy",
    "check_bundle_auth",
    "close_code_for",
    "load_pin",
    "store_pin",
]

#: A pinned hybrid peer came back classical, or with another ML-DSA-65 key.
CLOSE_DOWNGRADE: Final = 4008
#: This node requires hybrid authentication (--require-pq); the peer is classical.
CLOSE_PQ_REQUIRED: Final = 4009

PIN_PREFIX: Final = b"pin:mldsa65:"


def close_code_for(error: PeerSuiteError) -> int:
    """The WebSocket close code that names ``error`` to the peer."""
    return CLOSE_PQ_REQUIRED if isinstance(error, PostQuantumRequiredError) else CLOSE_DOWNGRADE


def _no_pins(did: str) -> bytes | None:
    return None


@dataclass(frozen=True, slots=True)
class AuthPolicy:
    """How this node judges a peer's authentication suite.

    ``pinned(did)`` returns the ML-DSA-65 key pinned for ``did`` (None if never
    seen hybrid); ``on_pin(did, key)`` is called once the first hybrid proof of
    ``did`` verified, to store the pin. ``require_pq`` refuses classical peers.
    """

    require_pq: bool = False
    pinned: Callable[[str], bytes | None] = _no_pins
    on_pin: Callable[[str, bytes], None] | None = None

    def decide(self, did: str, presented: bytes | None) -> PinDecision:
        """:func:`decide_peer_pin` against the stored pin; raises PeerSuiteError."""
        return decide_peer_pin(did, self.pinned(did), presented, require_pq=self.require_pq)

    def accept(self, did: str, presented: bytes | None) -> PinDecision:
        """Decide again after the peer's proof verified, and record a new pin."""
        decision = self.decide(did, presented)
        if decision.newly_pinned and decision.pin is not None and self.on_pin is not None:
            self.on_pin(did, decision.pin)
        return decision


def check_bundle_auth(bundle: PrekeyBundle, link_key: bytes | None) -> None:
    """A peer's prekey bundle must be signed in the suite its link proved.

    ``link_key`` is the ML-DSA-65 key the link handshake authenticated (None for a
    classical link). A classical bundle from a hybrid peer is a downgrade, and a
    bundle naming another ML-DSA-65 key a key change: both raise BundleError.
    Call after ``bundle.verify()``.
    """
    presented = bundle.mldsa65_public_key
    if link_key is None:
        return  # classical link: a hybrid bundle is merely more than we need
    if presented is None:
        raise BundleError(
            f"downgrade refused: {bundle.did} authenticated its link with ML-DSA-65 but "
            f"its prekey bundle is signed {SUITE_ED25519} only"
        )
    if bytes(presented) != bytes(link_key):
        raise BundleError(
            f"prekey bundle of {bundle.did} names an ML-DSA-65 key other than its link's"
        )


def load_pin(txn: Txn, did: str) -> bytes | None:
    """The ML-DSA-65 key pinned for ``did``, or None."""
    return txn.get("meta", PIN_PREFIX + did.encode())


def store_pin(txn: Txn, did: str, key: bytes) -> None:
    """Pin ``key`` for ``did``; an existing different pin is never replaced."""
    old = txn.get("meta", PIN_PREFIX + did.encode())
    if old is not None and bytes(old) != bytes(key):
        raise PinnedKeyChangedError(f"refusing to replace the ML-DSA-65 key pinned for {did}")
    txn.put("meta", PIN_PREFIX + did.encode(), bytes(key))
