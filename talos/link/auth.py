"""Which signature suite a link peer authenticates with, and the pins that keep it honest.

docs/adr/0005-hybrid-signatures.md, docs/PROTOCOL.md "Link protocol"
(handshake) and "Hybrid signatures" (pinning table). Pure: the node hands in
how to read pins, this module decides.

A hybrid node sends its ML-DSA-65 public key in its encrypted identity
payload, signed with a hybrid signature (``Wallet.sign_auth``) over the
handshake hash (talos/link/handshake.py).
:class:`AuthPolicy` applies :func:`talos_sdk.hybrid.decide_peer_pin` to what a
peer presents and turns a :class:`~talos_sdk.hybrid.PeerSuiteError` into a
refusal with its own close code: 4008 (downgrade or changed key), 4009
(post-quantum required). The pins themselves are rows of the node's store
(:mod:`talos.pins`), written through the node's writer, never from here.
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
    PostQuantumRequiredError,
    decide_peer_pin,
)

if TYPE_CHECKING:
    from talos_sdk.bundle import PrekeyBundle

__all__ = [
    "CLOSE_DOWNGRADE",
    "CLOSE_PQ_REQUIRED",
    "AuthPolicy",
    "check_bundle_auth",
    "close_code_for",
]

#: A pinned hybrid peer came back classical, or with another ML-DSA-65 key.
CLOSE_DOWNGRADE: Final = 4008
#: This node requires hybrid authentication (--require-pq); the peer is classical.
CLOSE_PQ_REQUIRED: Final = 4009


def close_code_for(error: PeerSuiteError) -> int:
    """The WebSocket close code that names ``error`` to the peer."""
    return CLOSE_PQ_REQUIRED if isinstance(error, PostQuantumRequiredError) else CLOSE_DOWNGRADE


def _no_pins(did: str) -> bytes | None:
    return None


@dataclass(frozen=True, slots=True)
class AuthPolicy:
    """How this node judges a peer's authentication suite.

    ``pinned(did)`` returns the ML-DSA-65 key pinned for ``did`` (None if never
    seen hybrid); ``require_pq`` refuses classical peers. Storing a new pin is
    the caller's job (``Authenticated.new_pin``): this module touches no store.
    """

    require_pq: bool = False
    pinned: Callable[[str], bytes | None] = _no_pins

    def decide(self, did: str, presented: bytes | None) -> PinDecision:
        """:func:`decide_peer_pin` against the stored pin; raises PeerSuiteError."""
        return decide_peer_pin(did, self.pinned(did), presented, require_pq=self.require_pq)


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
