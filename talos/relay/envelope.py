"""Mailbox envelopes: a link frame sealed to the recipient alone (docs/adr/0010-nats-relay.md).

Pure (the ephemeral key can be handed in, so vectors reproduce). What goes into
a relay mailbox is already end-to-end: a MSG link frame whose body is Double
Ratchet ciphertext with the sender's signed commitment inside. The envelope
adds what the relay must not see in the clear: *who* sent it (the recipient
needs the sender's DID to pick the session) and the sequence number::

    envelope  = eph_pub (32) || ChaCha20-Poly1305(key, nonce 0, AD, plaintext)
    plaintext = u8 len || sender DID || signature (64) || link frame bytes
    signature = Ed25519 of the sender's identity key over
                "talos/relay/v2/envelope-sender" || eph_pub || u8 len || recipient DID
                || link frame bytes
    R         = X25519 form of the recipient's Ed25519 identity key (RFC 7748,
                libsodium crypto_sign_ed25519_pk_to_curve25519)
    key       = HKDF-SHA256(X25519(eph, R), salt = eph_pub || R,
                            info = "talos/relay/v2/envelope")
    AD        = "talos/relay/v2/envelope" || recipient DID

The key is fresh per envelope (fresh ephemeral), so the all-zero nonce is never
reused. Anyone can seal an envelope to a DID; only the sender it names can sign
it, and :func:`open_envelope` checks that before anything else is read. Without
the signature a recipient learnt who sent a mail only by opening its ratchet
message, which spends the message's key: mail it must leave with the relay
unopened (a sender it does not let link, or one past its inbox share) could be
forged in any number under a real sender's name, and never acknowledged, it
stopped the mailbox's delivery (docs/PROTOCOL.md "Relay").
"""

from __future__ import annotations

from collections.abc import Callable
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
from talos_sdk.errors import DecryptionError, DIDError, SignatureError, UsageError
from talos_sdk.kdf import hkdf
from talos_sdk.wallet import SIGNATURE_SIZE, verify_with_public_key

__all__ = ["Envelope", "open_envelope", "seal_envelope"]

LABEL: Final = b"talos/relay/v2/envelope"
SIGN_LABEL: Final = b"talos/relay/v2/envelope-sender"
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


def _signed(eph_pub: bytes, recipient: str, frame: bytes) -> bytes:
    return SIGN_LABEL + eph_pub + pack_var8(recipient.encode()) + frame


def seal_envelope(
    recipient: str, sender: str, sign: Callable[[bytes], bytes], frame: bytes, eph_secret: bytes
) -> bytes:
    """Seal ``frame`` from ``sender`` (``sign``: its Ed25519 identity key's) to ``recipient``;
    ``eph_secret`` is 32 fresh random bytes."""
    if len(eph_secret) != 32:
        raise UsageError("the ephemeral secret is 32 bytes")
    recipient_x = crypto_sign_ed25519_pk_to_curve25519(public_key_from_did(recipient))
    eph_pub = crypto_scalarmult_base(eph_secret)
    key = _key(crypto_scalarmult(eph_secret, recipient_x), eph_pub, recipient_x)
    signature = sign(_signed(eph_pub, recipient, frame))
    if len(signature) != SIGNATURE_SIZE:
        raise UsageError("the sender's signature is 64 bytes of Ed25519")
    plaintext = pack_var8(sender.encode()) + signature + frame
    sealed = ChaCha20Poly1305(key).encrypt(_NONCE, plaintext, LABEL + recipient.encode())
    return eph_pub + sealed


def open_envelope(seed: bytes, recipient: str, data: bytes) -> Envelope:
    """Open an envelope with the recipient's Ed25519 seed: DecryptionError for anything
    wrong with the sealing, SignatureError unless the sender it names signed it."""
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
        signature = reader.take(SIGNATURE_SIZE)
    except Exception:
        raise DecryptionError() from None
    frame = reader.rest()
    try:
        key = public_key_from_did(sender)
    except DIDError:
        raise SignatureError("mailbox envelope names no Ed25519 did:key sender") from None
    if not verify_with_public_key(key, _signed(eph_pub, recipient, frame), signature):
        raise SignatureError("mailbox envelope not signed by the sender it names")
    return Envelope(sender, frame)
