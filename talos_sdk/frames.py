"""Frame sealing with the sender's signed commitment inside (docs/PROTOCOL.md "Frames").

docs/DESIGN.md "Signing": the sender signs a :class:`Commitment` to each frame (type,
sender, recipient, sequence, time, SHA-256 of the payload); the signature travels
inside the Double Ratchet ciphertext. The receiver's hot path relies on the AEAD;
:func:`verify_commitment` is a separate call so the node can defer and batch it.

Commitment bytes (what is signed; fixed layout, big-endian)::

    "Talos_Commitment_v1\\0" | type u16 | sequence u64 | timestamp_ms u64 |
    u16 len || sender DID | u16 len || recipient DID | SHA-256(payload) (32)

Sealed plaintext (inside ``Session.encrypt(..., ad="Talos_Frame_v1")``)::

    version u8 = 1 | flags u8 (bit 0: signed) | type u16 | sequence u64 |
    timestamp_ms u64 | u16 len || sender | u16 len || recipient |
    [signature (64) if signed] | payload (the rest)
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import NoReturn

from talos_sdk.binfmt import ByteReader, pack_var16
from talos_sdk.errors import (
    DIDError,
    MalformedFrameError,
    OversizeError,
    ProtocolError,
    UsageError,
)
from talos_sdk.ratchet import Session
from talos_sdk.wallet import SIGNATURE_SIZE, Wallet
from talos_sdk.wallet import verify as did_verify

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "Commitment",
    "Frame",
    "PartyMismatchError",
    "RatchetFrameCrypto",
    "verify_commitment",
]

DEFAULT_MAX_PAYLOAD = 4 * 1024 * 1024
FRAME_AD = b"Talos_Frame_v1"
COMMITMENT_DOMAIN = b"Talos_Commitment_v1\x00"
_VERSION = 1
_SIGNED = 1
_FIXED = struct.Struct(">HQQ")
_INNER = struct.Struct(">BBHQQ")
_MAX_U64 = 2**64 - 1
_MAX_DID = 256
# Ratchet header + X3DH initial data (hybrid) + AEAD tag + our fields: generous bound.
_WIRE_OVERHEAD = 4096


class PartyMismatchError(ProtocolError):
    """A frame names a sender or recipient other than this session's two parties."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One application frame: ``type`` u16, DIDs, ``sequence`` u64, ``timestamp`` ms u64."""

    type: int
    sender: str
    recipient: str
    sequence: int
    timestamp: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class Commitment:
    """What the sender signs for a frame; ``signature`` is empty for unsigned frames."""

    type: int
    sender: str
    recipient: str
    sequence: int
    timestamp: int
    payload_hash: bytes
    signature: bytes = b""

    @property
    def signed(self) -> bool:
        return bool(self.signature)

    def signed_bytes(self) -> bytes:
        """The exact bytes the Ed25519 signature covers (module docstring)."""
        return b"".join(
            (
                COMMITMENT_DOMAIN,
                _FIXED.pack(self.type, self.sequence, self.timestamp),
                _parties(self.sender, self.recipient),
                self.payload_hash,
            )
        )

    def digest(self) -> bytes:
        """SHA-256 of :meth:`signed_bytes`: the commitment hash block-log records keep."""
        return hashlib.sha256(self.signed_bytes()).digest()

    @classmethod
    def for_frame(cls, frame: Frame, signature: bytes = b"") -> Commitment:
        return cls(
            frame.type,
            frame.sender,
            frame.recipient,
            frame.sequence,
            frame.timestamp,
            hashlib.sha256(frame.payload).digest(),
            signature,
        )


def verify_commitment(commitment: Commitment, sender_did: str) -> bool:
    """True iff ``commitment`` is signed by ``sender_did`` and names it as sender."""
    if not commitment.signature or commitment.sender != sender_did:
        return False
    try:
        return did_verify(sender_did, commitment.signed_bytes(), commitment.signature)
    except DIDError:
        return False


def _parties(sender: str, recipient: str) -> bytes:
    """``u16 len || sender || u16 len || recipient``: the same bytes in the commitment
    and in the sealed plaintext."""
    return pack_var16(sender.encode()) + pack_var16(recipient.encode())


def _check_frame(frame: Frame, max_payload: int) -> None:
    if not 0 <= frame.type <= 0xFFFF:
        raise UsageError("frame type must fit in u16")
    if not (0 <= frame.sequence <= _MAX_U64 and 0 <= frame.timestamp <= _MAX_U64):
        raise UsageError("frame sequence and timestamp must fit in u64")
    if not isinstance(frame.payload, bytes):
        raise UsageError("frame payload must be bytes")
    if len(frame.payload) > max_payload:
        raise OversizeError(f"payload of {len(frame.payload)} bytes exceeds {max_payload}")


class RatchetFrameCrypto:
    """Seals and opens :class:`Frame` objects over one :class:`Session`.

    ``seal`` checks the frame is from ``wallet`` to the session's peer; ``open``
    checks the reverse and raises :class:`PartyMismatchError` otherwise.
    """

    __slots__ = (
        "_inbound",
        "_local",
        "_max_payload",
        "_max_wire",
        "_outbound",
        "_peer",
        "session",
        "wallet",
    )

    def __init__(
        self, wallet: Wallet, session: Session, *, max_payload: int = DEFAULT_MAX_PAYLOAD
    ) -> None:
        if session.local_did != wallet.did:
            raise UsageError("session does not belong to this wallet")
        if max_payload < 0:
            raise UsageError("max_payload must be >= 0")
        self.wallet = wallet
        self.session = session
        self._local = wallet.did
        self._peer = session.peer_did
        self._max_payload = max_payload
        self._max_wire = max_payload + _WIRE_OVERHEAD
        # The two parties never change on a session: their encoded fields are built once.
        self._outbound = _parties(self._local, self._peer)
        self._inbound = _parties(self._peer, self._local)

    def seal(self, frame: Frame, sign: bool = True) -> bytes:
        """Encrypt ``frame`` (with its signed commitment unless ``sign=False``)."""
        _check_frame(frame, self._max_payload)
        if frame.sender != self._local or frame.recipient != self._peer:
            raise UsageError("frame must go from this wallet to this session's peer")
        parties = self._outbound
        signature = b""
        if sign:
            signature = self.wallet.sign(
                COMMITMENT_DOMAIN
                + _FIXED.pack(frame.type, frame.sequence, frame.timestamp)
                + parties
                + hashlib.sha256(frame.payload).digest()
            )
        head = _INNER.pack(
            _VERSION, _SIGNED if sign else 0, frame.type, frame.sequence, frame.timestamp
        )
        return self.session.encrypt(b"".join((head, parties, signature, frame.payload)), FRAME_AD)

    def open(self, wire: bytes) -> tuple[Frame, Commitment]:
        """Decrypt and parse; DecryptionError, MalformedFrameError, OversizeError or
        PartyMismatchError. The signature is NOT checked here (see verify_commitment).

        A DecryptionError (or an oversize ``wire``) changes nothing. The errors
        raised after decryption mean the authenticated peer itself sealed a bad
        frame: its message is consumed (the session has moved past it, as for
        any message opened), and the same bytes again are a replay.
        """
        if len(wire) > self._max_wire:
            raise OversizeError(f"sealed frame of {len(wire)} bytes exceeds {self._max_wire}")
        inner = self.session.decrypt(wire, FRAME_AD)
        if len(inner) < _INNER.size:
            raise MalformedFrameError("frame: truncated")
        version, flags, ftype, sequence, timestamp = _INNER.unpack_from(inner)
        if version != _VERSION or flags & ~_SIGNED:
            raise MalformedFrameError("frame: unknown version or flags")
        expected = self._inbound
        if inner.startswith(expected, _INNER.size):
            pos = _INNER.size + len(expected)
        else:
            self._refuse_parties(inner)
        if flags & _SIGNED:
            signature = inner[pos : pos + SIGNATURE_SIZE]
            if len(signature) != SIGNATURE_SIZE:
                raise MalformedFrameError("frame: truncated")
            pos += SIGNATURE_SIZE
        else:
            signature = b""
        payload = inner[pos:]
        if len(payload) > self._max_payload:
            raise OversizeError(f"payload of {len(payload)} bytes exceeds {self._max_payload}")
        peer, local = self._peer, self._local
        frame = Frame(ftype, peer, local, sequence, timestamp, payload)
        digest = hashlib.sha256(payload).digest()
        return frame, Commitment(ftype, peer, local, sequence, timestamp, digest, signature)

    def _refuse_parties(self, inner: bytes) -> NoReturn:
        """The party fields are not (peer, us): say precisely what is wrong with them."""
        r = ByteReader(inner, "frame")
        r.take(_INNER.size)
        sender, recipient = r.text16(), r.text16()
        if len(sender) > _MAX_DID or len(recipient) > _MAX_DID:
            raise MalformedFrameError("frame: DID field too long")
        raise PartyMismatchError(
            f"frame from {sender[:80]!r} to {recipient[:80]!r} on the session "
            f"between {self._peer!r} and {self._local!r}"
        )

    @staticmethod
    def verify_commitment(commitment: Commitment, sender_did: str) -> bool:
        """See :func:`verify_commitment`."""
        return verify_commitment(commitment, sender_did)
