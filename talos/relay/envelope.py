"""Mailbox envelopes: a link frame sealed to the recipient alone (docs/adr/0010-nats-relay.md).

Pure (the ephemeral key can be handed in, so vectors reproduce). What goes into
a relay mailbox is already end-to-end: a MSG link frame whose body is Double
Ratchet ciphertext with the sender's signed commitment inside. The envelope
adds what the relay must not see in the clear: *who* sent it (the recipient
needs the sender's DID to pick the session) and the sequence number::

    envelope  = eph_pub (32) || ChaCha20-Poly1305(key, nonce 0, AD, plaintext)
    plaintext = u8 len || sender DID || link frame bytes
    R         = X25519 form of the recipient's Ed25519 identity key (RFC 7748,
                libsodium crypto_sign_ed25519_pk_to_curve25519)
    key       = HKDF-SHA256(X25519(eph, R), salt = eph_pub || R,
                            info = "talos/relay/v1/envelope")
    AD        = "talos/relay/v1/envelope" || recipient DID

The key is fresh per envelope (fresh ephemeral), so the all-zero nonce is never
reused. Anyone can seal an envelope to a DID: the envelope hides the sender
from the relay but does not authenticate it; the ratchet AEAD and signature
inside the frame do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from nacl.bindings import (
    crypto_scalarmult,
    crypto_scalarmult_base,
    crypto_sign_ed25519_pk_to_curve25519,
    crypto_sign_ed25519_sk_to_curve25519,
    crypto_sign_seed_keypair,
)
from nacl.exceptions import RuntimeError as NaclRuntimeError

from talos_sdk.binfmt import ByteReader, pack_var8, utf8
from talos_sdk.did import public_key_from_did
from talos_sdk.errors import DecryptionError, UsageError
from talos_sdk.kdf import hkdf

__all__ = ["Envelope", "open_envelope", "seal_envelope"]

LABEL: Final = b"talos/relay/v1/envelope"
_NONCE: Final = bytes(12)
_TAG: Final = 16


@dataclass(frozen=True, slots=True)
class Envelope:
    """An opened envelope: who claims to have sent it, and the link frame."""

    sender: str
    frame: bytes


def _key(shared: bytes, eph_pub: bytes, recipient_x: bytes) -> bytes:
    if shared == bytes(32):  # a low-order point: no secret was agreed
        raise DecryptionError()
    return hkdf(shared, salt=eph_pub + recipient_x, info=LABEL)


def seal_envelope(recipient: str, sender: str, frame: bytes, eph_secret: bytes) -> bytes:
    """Seal ``frame`` from ``sender`` to ``recipient``; ``eph_secret`` is 32 fresh random bytes."""
    if len(eph_secret) != 32:
        raise UsageError("the ephemeral secret is 32 bytes")
    recipient_x = crypto_sign_ed25519_pk_to_curve25519(public_key_from_did(recipient))
    eph_pub = crypto_scalarmult_base(eph_secret)
    key = _key(crypto_scalarmult(eph_secret, recipient_x), eph_pub, recipient_x)
    plaintext = pack_var8(sender.encode()) + frame
    sealed = ChaCha20Poly1305(key).encrypt(_NONCE, plaintext, LABEL + recipient.encode())
    return eph_pub + sealed


def open_envelope(seed: bytes, recipient: str, data: bytes) -> Envelope:
    """Open an envelope with the recipient's Ed25519 seed; DecryptionError for anything wrong."""
    if len(data) < 32 + _TAG + 1:
        raise DecryptionError()
    public, secret = crypto_sign_seed_keypair(seed)
    recipient_x = crypto_sign_ed25519_pk_to_curve25519(public)
    eph_pub = data[:32]
    try:
        shared = crypto_scalarmult(crypto_sign_ed25519_sk_to_curve25519(secret), eph_pub)
        key = _key(shared, eph_pub, recipient_x)
        plaintext = ChaCha20Poly1305(key).decrypt(_NONCE, data[32:], LABEL + recipient.encode())
    except (InvalidTag, NaclRuntimeError, ValueError):
        raise DecryptionError() from None
    reader = ByteReader(plaintext, "mailbox envelope")
    try:
        sender = utf8(reader.var8(), "mailbox envelope sender")
    except Exception:
        raise DecryptionError() from None
    return Envelope(sender, reader.rest())
