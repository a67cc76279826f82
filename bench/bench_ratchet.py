"""Double Ratchet sessions (docs/DESIGN.md "Performance targets": Session.encrypt,
Session.create_pair).

Rows: ``Session.create_pair`` for both suites (fresh identities, prekeys and
X3DH included) beside one raw X25519 exchange; ``Session.encrypt`` at 35 B and
10 KB beside the primitives one message needs (the two chain-key HMACs and a
ChaCha20-Poly1305 seal keyed by the message key, ADR 0006); an encrypt + decrypt round
trip, and one with a DH ratchet step (the reply direction) each way; and state
serialisation (``to_dict`` / ``from_dict``).
"""

from __future__ import annotations

import hmac
import os
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Suite
from cryptography.hazmat.primitives.asymmetric import x25519
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from talos_sdk.bundle import SUITE_HYBRID, SUITE_X25519
from talos_sdk.ratchet import Session

SIZES = {"35 B": 35, "10 KB": 10 * 1024}
AD = bytes(73)  # an X3DH AD (two 33-byte identity keys) plus a few header bytes


def _raw_message(ck: bytes, plaintext: bytes) -> bytes:
    """The primitives of one ratchet message, with no header, state or checks."""
    mk = hmac.digest(ck, b"\x01", "sha256")
    hmac.digest(ck, b"\x02", "sha256")
    return ChaCha20Poly1305(mk).encrypt(bytes(12), plaintext, AD)


def _round_trip(a: Session, b: Session, plaintext: bytes) -> bytes:
    return b.decrypt(a.encrypt(plaintext))


def _ping_pong(a: Session, b: Session, plaintext: bytes) -> bytes:
    # Each change of direction is a DH ratchet step (ratchet_every=1: Signal's schedule).
    b.decrypt(a.encrypt(plaintext))
    return a.decrypt(b.encrypt(plaintext))


def main() -> None:
    """Register every row, run them, print the table, write the results JSON."""
    suite = Suite.create(__file__)
    a_key = x25519.X25519PrivateKey.generate()
    b_pub = x25519.X25519PrivateKey.generate().public_key()
    suite.floor(
        "ratchet.x25519.floor",
        "OpenSSL X25519 exchange (X3DH unit)",
        partial(a_key.exchange, b_pub),
    )
    suite.single(
        "session.create_pair.x25519",
        "Session.create_pair, x25519 (keys included)",
        partial(Session.create_pair, SUITE_X25519),
    )
    suite.single(
        "session.create_pair.x25519-mlkem768",
        "Session.create_pair, x25519-mlkem768 (keys included)",
        partial(Session.create_pair, SUITE_HYBRID),
    )
    alice, _ = Session.create_pair(SUITE_X25519)
    ck = os.urandom(32)
    for size_label, size in SIZES.items():
        tag = size_label.replace(" ", "")
        pt = os.urandom(size)
        suite.pair(
            f"session.encrypt.{tag}",
            f"Session.encrypt {size_label}",
            partial(_raw_message, ck, pt),
            partial(alice.encrypt, pt),
            raw_label=f"HMAC x2 + ChaCha20-Poly1305 seal {size_label}",
        )
        # Fresh pair per row: the encrypt row above left bob far behind alice.
        a, b = Session.create_pair(SUITE_X25519)
        suite.single(
            f"session.roundtrip.{tag}",
            f"Session encrypt + decrypt {size_label}",
            partial(_round_trip, a, b, pt),
        )
    a, b = Session.create_pair(SUITE_X25519)
    suite.single(
        "session.pingpong.35B",
        "A->B then B->A, 35 B (two DH ratchet steps)",
        partial(_ping_pong, a, b, bytes(35)),
    )
    state = alice.to_dict()
    suite.single("session.to_dict", "Session.to_dict", alice.to_dict)
    suite.single("session.from_dict", "Session.from_dict", partial(Session.from_dict, state))
    suite.finish()


if __name__ == "__main__":
    main()
