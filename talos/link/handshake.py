"""The link handshake: Noise XX with identities in its encrypted payloads.

docs/PROTOCOL.md "Link protocol", Link handshake, docs/adr/0011-noise-link-channel.md. Pure and
sans-I/O in the style of websockets' ``protocol.py``: the asyncio link feeds
each received WebSocket message to :meth:`LinkHandshake.receive` and sends
what comes back; the order of messages lives here::

    initiator -> responder   SUITE (1 byte) || Noise message 1   (-> e [, e1])
    responder -> initiator   Noise message 2, payload = responder identity
    initiator -> responder   Noise message 3, payload = initiator identity
    responder -> initiator   sealed ACCEPT (or a sealed REFUSE), first channel frame

SUITE 0 runs ``Noise_XX_25519_ChaChaPoly_SHA256``, SUITE 1 the hybrid
``Noise_XXhfs_25519+MLKEM768_ChaChaPoly_SHA256`` (ML-KEM-768 mixed into the
keys). The prologue is ``LABEL || SUITE``, so a rewritten SUITE byte makes the
two sides' handshake hashes differ and message 2 fails to decrypt: no downgrade.

An identity payload is the did:key, the optional ML-DSA-65 public key, the
session suites and a signature (``Wallet.sign_auth``: Ed25519, or Ed25519 +
ML-DSA-65 for a hybrid identity) over ``LABEL || "/identity/" || role || h ||
SHA-256(fields)``, ``h`` being the Noise handshake hash just before the
payload, which already covers both ephemerals and the sender's static key. So
the signature binds the identity to this handshake and this Noise static key,
and a payload cannot be replayed into another handshake or reflected back. A
passive observer sees ephemeral keys and ciphertext only. Every failure is a
:class:`Refusal` carrying the WebSocket close code; nothing is trusted before it.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Final, Protocol

from talos.link import wire
from talos.link.auth import CLOSE_PQ_REQUIRED, AuthPolicy, close_code_for
from talos.link.channel import LinkChannel
from talos_sdk.errors import DecryptionError, HandshakeError, MalformedFrameError, TalosError
from talos_sdk.hybrid import (
    MLDSA65_PUBLIC_KEY_SIZE,
    SUITE_ED25519,
    PeerSuiteError,
    PinnedKeyChangedError,
)
from talos_sdk.noise import HandshakeState
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
    "SUITE_CLASSICAL",
    "SUITE_HYBRID",
    "Authenticated",
    "LinkHandshake",
    "PeerRefused",
    "Refusal",
    "Role",
]

LABEL: Final = b"talos/link/v2"
#: Session suites in order of preference (hybrid post-quantum first).
SUITES: Final = ("x25519-mlkem768", "x25519")
#: The SUITE byte of handshake message 1 and the Noise pattern it selects.
SUITE_CLASSICAL: Final = 0
SUITE_HYBRID: Final = 1
_PATTERNS: Final = {SUITE_CLASSICAL: "XX", SUITE_HYBRID: "XXhfs"}
_PAYLOAD_VERSION: Final = 1
_MAX_DID: Final = 256

# WebSocket private-use close codes (RFC 6455 section 7.4.2: 4000-4999).
CLOSE_PROTOCOL: Final = 4000
CLOSE_BAD_PROOF: Final = 4001
CLOSE_UNAUTHORIZED: Final = 4003
CLOSE_PINNED_MISMATCH: Final = 4004
CLOSE_NO_SUITE: Final = 4005
CLOSE_DUPLICATE: Final = 4006
CLOSE_SHUTDOWN: Final = 4007

_H = struct.Struct(">H")


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


#: Classical identity check ``verify(did, data, signature)`` (a test hook); hybrid
#: signatures always go through ``talos_sdk.wallet.verify_auth``.
Verifier = Callable[[str, bytes, bytes], bool]


class Role(IntEnum):
    """Who dialled: the initiator opened the WebSocket."""

    INITIATOR = 0
    RESPONDER = 1


class Refusal(HandshakeError):
    """We refuse the link: ``code`` is the close code, ``reason`` goes to the peer.

    ``reason`` never names a DID (a close reason travels in the clear); the
    exception text adds ``detail`` for our own log. ``farewell`` is a sealed
    REFUSE frame to send first when the channel already exists.
    """

    def __init__(self, code: int, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.code = code
        self.reason = reason
        self.farewell: bytes | None = None
        #: The DID the peer claimed, once its identity payload was read (not proven).
        self.peer_did: str | None = None


class PeerRefused(HandshakeError):
    """The remote side refused us (sealed REFUSE frame or close code)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"peer refused the link ({code}): {reason}")
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Authenticated:
    """Outcome of a successful handshake."""

    peer_did: str
    suites: tuple[str, ...]  # session suites both sides support, our preference order
    transcript_hash: bytes  # the Noise handshake hash: the channel binding value
    auth_suite: str = SUITE_ED25519  # what the peer proved with: ed25519 or ed25519-mldsa65
    peer_mldsa65: bytes | None = None  # its ML-DSA-65 key (pinned) when hybrid
    #: The ML-DSA-65 key to pin now (first hybrid contact); the caller stores it.
    new_pin: bytes | None = None
    kem: str = "x25519"  # the handshake's key exchange: x25519 or x25519-mlkem768


@dataclass(frozen=True, slots=True)
class _Identity:
    did: str
    mldsa65: bytes
    suites: tuple[str, ...]
    signature: bytes
    fields: bytes


def _lp(data: bytes) -> bytes:
    return _H.pack(len(data)) + data


def _parse_identity(payload: bytes) -> _Identity:
    pos = 1
    parts: list[bytes] = []
    if not payload or payload[0] != _PAYLOAD_VERSION:
        raise MalformedFrameError("unknown identity payload version")
    for _ in range(4):
        if pos + 2 > len(payload):
            raise MalformedFrameError("truncated identity payload")
        (n,) = _H.unpack_from(payload, pos)
        pos += 2
        if pos + n > len(payload):
            raise MalformedFrameError("identity field longer than payload")
        parts.append(payload[pos : pos + n])
        if len(parts) == 3:
            fields_end = pos + n
        pos += n
    if pos != len(payload):
        raise MalformedFrameError("trailing bytes after identity payload")
    did_raw, mldsa, suites_raw, signature = parts
    if not 0 < len(did_raw) <= _MAX_DID:
        raise MalformedFrameError("identity DID length out of range")
    if mldsa and len(mldsa) != MLDSA65_PUBLIC_KEY_SIZE:
        raise MalformedFrameError(f"ML-DSA-65 key must be {MLDSA65_PUBLIC_KEY_SIZE} bytes")
    try:
        did, suites_text = did_raw.decode(), suites_raw.decode()
    except UnicodeDecodeError:
        raise MalformedFrameError("identity payload is not UTF-8") from None
    suites = tuple(s for s in suites_text.split(",") if s)
    return _Identity(did, mldsa, suites, signature, payload[:fields_end])


def _suite_refusal(exc: PeerSuiteError) -> Refusal:
    # Fixed reasons: a close reason travels in the clear, the DID stays out of it.
    code = close_code_for(exc)
    if code == CLOSE_PQ_REQUIRED:
        return Refusal(code, "this node requires hybrid authentication", str(exc))
    if isinstance(exc, PinnedKeyChangedError):
        return Refusal(code, "another ML-DSA-65 key is pinned for this identity", str(exc))
    return Refusal(code, "downgrade refused: this identity is pinned hybrid", str(exc))


def _default_verify(did: str, data: bytes, sig: bytes) -> bool:
    from talos_sdk.wallet import verify

    return verify(did, data, sig)


def _signed(role: Role, h: bytes, fields: bytes) -> bytes:
    return LABEL + b"/identity/" + bytes((role,)) + h + hashlib.sha256(fields).digest()


class LinkHandshake:
    """One side of the link handshake: :meth:`start`, then :meth:`receive` per message.

    ``pq`` makes an initiator offer the hybrid suite; a responder takes what
    the initiator offers unless ``policy.require_pq`` refuses a classical one.
    ``random`` supplies the Noise static and ephemeral keys (tests inject it).
    """

    def __init__(
        self,
        signer: Signer,
        role: Role,
        *,
        suites: tuple[str, ...] = SUITES,
        expected_did: str | None = None,
        authorizer: Callable[[str], bool] | None = None,
        verify: Verifier = _default_verify,
        policy: AuthPolicy | None = None,
        pq: bool = False,
        random: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self._signer = signer
        self.role = role
        self._suites = suites
        self._expected = expected_did
        self._authorizer = authorizer
        self._verify = verify
        self._policy = policy or AuthPolicy()
        self._random = random
        self._suite = SUITE_HYBRID if pq or self._policy.require_pq else SUITE_CLASSICAL
        self._noise: HandshakeState | None = None
        self._step = 0
        self.channel: LinkChannel | None = None
        self.result: Authenticated | None = None
        self.done = False

    def _new_noise(self, suite: int) -> HandshakeState:
        self._suite = suite
        return HandshakeState(
            _PATTERNS[suite],
            self.role is Role.INITIATOR,
            prologue=LABEL + bytes((suite,)),
            s=self._random(32),
            random=self._random,
        )

    def start(self) -> bytes | None:
        """Message 1 for an initiator; None for a responder (it speaks second)."""
        if self.role is Role.RESPONDER:
            return None
        self._noise = self._new_noise(self._suite)
        self._step = 1
        return bytes((self._suite,)) + self._noise.write_message()

    def receive(self, data: bytes) -> bytes | None:
        """Take the peer's next message; return ours to send, or None.

        Raises :class:`Refusal` (we refuse) or :class:`PeerRefused` (the peer did).
        """
        try:
            if self.role is Role.RESPONDER:
                return self._responder(data)
            return self._initiator(data)
        except MalformedFrameError as exc:
            raise Refusal(CLOSE_PROTOCOL, "malformed handshake message", str(exc)) from None
        except DecryptionError:
            raise Refusal(CLOSE_BAD_PROOF, "handshake message failed to authenticate") from None

    def _responder(self, data: bytes) -> bytes | None:
        if self._step == 0:
            if len(data) < 1 or data[0] not in _PATTERNS:
                raise Refusal(CLOSE_PROTOCOL, "unknown link handshake suite")
            if data[0] == SUITE_CLASSICAL and self._policy.require_pq:
                raise Refusal(CLOSE_PQ_REQUIRED, "this node requires hybrid link handshakes")
            self._noise = self._new_noise(data[0])
            if self._noise.read_message(data[1:]):
                raise Refusal(CLOSE_PROTOCOL, "handshake message 1 carries no payload")
            self._step = 2
            return self._noise.write_message(payload_for=self._identity)
        if self._step == 2 and self._noise is not None:
            payload = self._noise.read_message(data)
            self.channel = LinkChannel(*self._noise.split())
            try:
                try:
                    identity = _parse_identity(payload)
                except MalformedFrameError as exc:
                    raise Refusal(CLOSE_PROTOCOL, "malformed identity payload", str(exc)) from None
                self.result = self._judge(identity)
            except Refusal as refusal:
                # The channel exists now: the refusal travels sealed.
                refusal.farewell = self.channel.seal(
                    wire.encode(wire.Refuse(refusal.code, refusal.reason))
                )
                raise
            self._step = 4
            self.done = True
            return self.channel.seal(wire.encode(wire.Accept()))
        raise Refusal(CLOSE_PROTOCOL, "unexpected handshake message")

    def _initiator(self, data: bytes) -> bytes | None:
        noise = self._noise
        if self._step == 1 and noise is not None:
            peer = _parse_identity(noise.read_message(data))
            result = self._judge(peer)
            message = noise.write_message(payload_for=self._identity)
            self.channel = LinkChannel(*noise.split())
            self.result = replace(result, transcript_hash=noise.handshake_hash)
            self._step = 3
            return message
        if self._step == 3 and self.channel is not None:
            frame = wire.decode(self.channel.open(data))
            if isinstance(frame, wire.Refuse):
                raise PeerRefused(frame.code, frame.reason)
            if not isinstance(frame, wire.Accept):
                raise Refusal(CLOSE_PROTOCOL, "expected the responder's ACCEPT")
            self._step = 4
            self.done = True
            return None
        raise Refusal(CLOSE_PROTOCOL, "unexpected handshake message")

    def _identity(self, h: bytes) -> bytes:
        fields = (
            bytes((_PAYLOAD_VERSION,))
            + _lp(self._signer.did.encode())
            + _lp(_mldsa_key(self._signer))
            + _lp(",".join(self._suites).encode())
        )
        return fields + _lp(_sign_auth(self._signer, _signed(self.role, h, fields)))

    def _judge(self, peer: _Identity) -> Authenticated:
        """Check the peer's identity payload: claim, authorization, suites, signature, pin."""
        try:
            return self._judge_claim(peer)
        except Refusal as refusal:
            refusal.peer_did = peer.did
            raise

    def _judge_claim(self, peer: _Identity) -> Authenticated:
        assert self._noise is not None
        if self._expected is not None and peer.did != self._expected:
            raise Refusal(
                CLOSE_PINNED_MISMATCH,
                "pinned DID mismatch",
                f"expected {self._expected}, peer claims {peer.did}",
            )
        if peer.did == self._signer.did:
            raise Refusal(CLOSE_BAD_PROOF, "peer claims our own DID")
        if self._authorizer is not None and not self._authorizer(peer.did):
            raise Refusal(CLOSE_UNAUTHORIZED, "not on the allow list", peer.did)
        if not set(self._suites) & set(peer.suites):
            raise Refusal(CLOSE_NO_SUITE, "no session suite in common")
        presented = peer.mldsa65 or None
        try:
            self._policy.decide(peer.did, presented)
        except PeerSuiteError as exc:
            raise _suite_refusal(exc) from None
        peer_role = Role.RESPONDER if self.role is Role.INITIATOR else Role.INITIATOR
        signed = _signed(peer_role, self._noise.payload_hash, peer.fields)
        try:
            if presented is None:
                ok = self._verify(peer.did, signed, peer.signature)
            else:
                ok = verify_auth(peer.did, presented, signed, peer.signature)
        except TalosError:
            ok = False  # a malformed DID or ML-DSA key cannot prove anything
        if not ok:
            kind = "hybrid " if presented else ""
            raise Refusal(CLOSE_BAD_PROOF, f"{kind}identity signature does not verify", peer.did)
        # The presented key counts only now that a hybrid signature under it verified.
        try:
            decision = self._policy.decide(peer.did, presented)
        except PeerSuiteError as exc:  # pragma: no cover - same inputs as above
            raise _suite_refusal(exc) from None
        common = tuple(s for s in self._suites if s in peer.suites)
        return Authenticated(
            peer.did,
            common,
            self._noise.handshake_hash,  # final for the responder; the initiator updates it
            decision.suite,
            decision.pin,
            decision.pin if decision.newly_pinned else None,
            "x25519-mlkem768" if self._suite == SUITE_HYBRID else "x25519",
        )
