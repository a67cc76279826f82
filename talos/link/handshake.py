"""Mutual challenge-response at the start of every link (docs/DESIGN.md "Peer links").

Pure and sans-I/O, in the style of websockets' ``protocol.py``: the asyncio link
feeds decoded frames in and sends what comes back. Both sides send a
:class:`~talos.link.wire.Hello` (DID, fresh 32-byte nonce, supported suites).
Each then signs, with its identity (``Wallet.sign_auth``: Ed25519, or Ed25519 +
ML-DSA-65 for a hybrid identity, docs/adr/0005-hybrid-signatures.md)::

    LABEL || b"/proof/" || role || SHA-256(transcript)
    transcript = LABEL || lp(initiator DID) || lp(responder DID)
                 || initiator nonce || responder nonce
                 || lp(initiator suites) || lp(responder suites)
                 [|| lp(initiator ML-DSA key) || lp(responder ML-DSA key)]

The bracketed part is present when either side sent an ML-DSA-65 key, so a
man in the middle who strips a hybrid offer breaks both proofs; two classical
nodes keep the original transcript. Which suite a peer must prove, and its pin,
are :class:`talos.link.auth.AuthPolicy`'s decision (4008 / 4009 refusals).

On the wire: initiator HELLO, responder HELLO, initiator PROOF, responder
PROOF (sent only once the initiator's proof verified, so it also means
"accepted"). A proof binds both nonces (no replay), both DIDs (no relaying to a third
party) and the signer's role (no reflecting a proof back at its author). The
peer's proof is checked against the key inside the DID it claims: holding
another key and claiming a DID fails here. Every failure is a :class:`Refusal`
carrying the WebSocket close code to use; nothing is trusted before it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Final, Protocol

from talos.link.auth import AuthPolicy, close_code_for
from talos.link.wire import NONCE_LEN, Hello, Proof
from talos_sdk.errors import HandshakeError, TalosError
from talos_sdk.hybrid import SUITE_ED25519, PeerSuiteError
from talos_sdk.wallet import verify_auth

__all__ = [
    "CLOSE_BAD_PROOF",
    "CLOSE_DUPLICATE",
    "CLOSE_NO_SUITE",
    "CLOSE_PINNED_MISMATCH",
    "CLOSE_PROTOCOL",
    "CLOSE_SHUTDOWN",
    "CLOSE_UNAUTHORIZED",
    "LABEL",
    "SUITES",
    "Authenticated",
    "LinkHandshake",
    "Refusal",
    "Role",
]

LABEL: Final = b"talos/link/v1"
#: Session suites in order of preference (hybrid post-quantum first).
SUITES: Final = ("x25519-mlkem768", "x25519")

# WebSocket private-use close codes (RFC 6455 section 7.4.2: 4000-4999).
CLOSE_PROTOCOL: Final = 4000
CLOSE_BAD_PROOF: Final = 4001
CLOSE_UNAUTHORIZED: Final = 4003
CLOSE_PINNED_MISMATCH: Final = 4004
CLOSE_NO_SUITE: Final = 4005
CLOSE_DUPLICATE: Final = 4006
CLOSE_SHUTDOWN: Final = 4007


class Signer(Protocol):
    """What the handshake needs from a wallet."""

    @property
    def did(self) -> str: ...

    def sign(self, data: bytes) -> bytes: ...


def _sign_auth(signer: Signer, data: bytes) -> bytes:
    # A Wallet has sign_auth (hybrid when its suite is); a bare Ed25519 signer does not.
    sign_auth: Callable[[bytes], bytes] = getattr(signer, "sign_auth", signer.sign)
    return sign_auth(data)


def _mldsa_key(signer: Signer) -> bytes:
    key: bytes | None = getattr(signer, "mldsa_public_key", None)
    return key or b""


#: Classical proof check ``verify(did, data, signature)`` (a test hook); hybrid
#: proofs always go through ``talos_sdk.wallet.verify_auth``.
Verifier = Callable[[str, bytes, bytes], bool]


class Role(IntEnum):
    """Who dialled: the initiator opened the WebSocket."""

    INITIATOR = 0
    RESPONDER = 1


class Refusal(HandshakeError):
    """The handshake failed; ``code`` is the close code, ``reason`` goes to the peer."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Authenticated:
    """Outcome of a successful handshake."""

    peer_did: str
    suites: tuple[str, ...]  # suites both sides support, our preference order
    transcript_hash: bytes
    auth_suite: str = SUITE_ED25519  # what the peer proved with: ed25519 or ed25519-mldsa65
    peer_mldsa65: bytes | None = None  # its ML-DSA-65 key (pinned) when hybrid


def _lp(data: bytes) -> bytes:
    return struct.pack(">H", len(data)) + data


def _default_verify(did: str, data: bytes, sig: bytes) -> bool:
    from talos_sdk.wallet import verify

    return verify(did, data, sig)


class LinkHandshake:
    """One side of the link handshake: ``hello()``, ``receive_hello()``, ``receive_proof()``."""

    def __init__(
        self,
        signer: Signer,
        role: Role,
        nonce: bytes,
        *,
        suites: tuple[str, ...] = SUITES,
        expected_did: str | None = None,
        authorizer: Callable[[str], bool] | None = None,
        verify: Verifier = _default_verify,
        policy: AuthPolicy | None = None,
    ) -> None:
        if len(nonce) != NONCE_LEN:
            raise ValueError("handshake nonce must be 32 bytes")
        self._signer = signer
        self._role = role
        self._nonce = nonce
        self._suites = suites
        self._expected = expected_did
        self._authorizer = authorizer
        self._verify = verify
        self._policy = policy or AuthPolicy()
        self._peer: Hello | None = None
        self._hash: bytes | None = None

    def hello(self) -> Hello:
        """Our hello; send it first (initiator) or in reply (responder)."""
        return Hello(self._signer.did, self._nonce, self._suites, _mldsa_key(self._signer))

    def receive_hello(self, peer: Hello) -> Proof:
        """Check the peer's claim (pin, authorizer, suites) and return our proof."""
        if self._peer is not None:
            raise Refusal(CLOSE_PROTOCOL, "unexpected second hello")
        if self._expected is not None and peer.did != self._expected:
            raise Refusal(
                CLOSE_PINNED_MISMATCH,
                f"pinned DID mismatch: expected {self._expected}, peer claims {peer.did}",
            )
        if peer.did == self._signer.did:
            raise Refusal(CLOSE_BAD_PROOF, "peer claims our own DID")
        if peer.nonce == self._nonce:
            raise Refusal(CLOSE_BAD_PROOF, "peer echoed our nonce")
        if self._authorizer is not None and not self._authorizer(peer.did):
            raise Refusal(CLOSE_UNAUTHORIZED, f"unknown peer {peer.did}")
        if not set(self._suites) & set(peer.suites):
            raise Refusal(CLOSE_NO_SUITE, "no session suite in common")
        # Refuse a classical peer under --require-pq, or a downgrade / key change
        # against our pin, before signing anything; re-checked after its proof.
        self._judge(peer)
        self._peer = peer
        self._hash = self._transcript_hash(peer)
        return Proof(_sign_auth(self._signer, self._signed(self._role, self._hash)))

    def _judge(self, peer: Hello, *, accept: bool = False) -> tuple[str, bytes | None]:
        presented = peer.mldsa65 or None
        try:
            if accept:
                decision = self._policy.accept(peer.did, presented)
            else:
                decision = self._policy.decide(peer.did, presented)
        except PeerSuiteError as exc:
            raise Refusal(close_code_for(exc), str(exc)) from None
        return decision.suite, decision.pin

    def receive_proof(self, proof: Proof) -> Authenticated:
        """Verify the peer's proof against the key in its claimed DID."""
        if self._peer is None or self._hash is None:
            raise Refusal(CLOSE_PROTOCOL, "proof before hello")
        peer_role = Role.RESPONDER if self._role is Role.INITIATOR else Role.INITIATOR
        mldsa = self._peer.mldsa65 or None
        signed = self._signed(peer_role, self._hash)
        try:
            if mldsa is None:
                ok = self._verify(self._peer.did, signed, proof.signature)
            else:
                ok = verify_auth(self._peer.did, mldsa, signed, proof.signature)
        except TalosError:
            ok = False  # a malformed DID or ML-DSA key cannot prove anything
        if not ok:
            kind = "hybrid " if mldsa else ""
            raise Refusal(
                CLOSE_BAD_PROOF, f"{kind}handshake proof does not verify for {self._peer.did}"
            )
        # The presented key counts only now that a hybrid proof under it verified.
        auth_suite, pin = self._judge(self._peer, accept=True)
        common = tuple(s for s in self._suites if s in self._peer.suites)
        return Authenticated(self._peer.did, common, self._hash, auth_suite, pin)

    def _transcript_hash(self, peer: Hello) -> bytes:
        mine = self.hello()
        i, r = (mine, peer) if self._role is Role.INITIATOR else (peer, mine)
        pq = _lp(i.mldsa65) + _lp(r.mldsa65) if i.mldsa65 or r.mldsa65 else b""
        return hashlib.sha256(
            LABEL
            + _lp(i.did.encode())
            + _lp(r.did.encode())
            + i.nonce
            + r.nonce
            + _lp(",".join(i.suites).encode())
            + _lp(",".join(r.suites).encode())
            + pq
        ).digest()

    @staticmethod
    def _signed(role: Role, transcript_hash: bytes) -> bytes:
        return LABEL + b"/proof/" + bytes((role,)) + transcript_hash
