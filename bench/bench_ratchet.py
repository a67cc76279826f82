"""Double Ratchet sessions (docs/DESIGN.md "Performance targets": Session.encrypt,
Session.create_pair).

Rows: ``Session.create_pair`` for both suites (fresh identities, prekeys and
X3DH included) beside the sum of the raw primitive calls it is made of
(:func:`_raw_pair`, the floor: what is left is our own overhead) and one raw
X25519 exchange; ``Session.encrypt`` at 35 B and
10 KB beside the primitives one message needs (the two chain-key HMACs and a
ChaCha20-Poly1305 seal keyed by the message key, ADR 0006); an encrypt + decrypt round
trip, and one with a DH ratchet step (the reply direction) each way; and state
serialisation (``to_dict`` / ``from_dict``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Suite
from cryptography.hazmat.primitives.asymmetric import x25519
from cryptography.hazmat.primitives.asymmetric.mlkem import MLKEM768PrivateKey, MLKEM768PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from nacl.bindings import (
    crypto_scalarmult,
    crypto_scalarmult_base,
    crypto_sign,
    crypto_sign_open,
    crypto_sign_seed_keypair,
)

from talos_sdk.bundle import _BUNDLE_DOMAIN, SUITE_HYBRID, SUITE_X25519
from talos_sdk.prekeys import PrekeySecrets
from talos_sdk.ratchet import Session
from talos_sdk.wallet import Wallet

SIZES = {"35 B": 35, "10 KB": 10 * 1024}
AD = bytes(73)  # an X3DH AD (two 33-byte identity keys) plus a few header bytes


def _raw_message(ck: bytes, plaintext: bytes) -> bytes:
    """The primitives of one ratchet message, with no header, state or checks."""
    mk = hmac.digest(ck, b"\x01", "sha256")
    hmac.digest(ck, b"\x02", "sha256")
    return ChaCha20Poly1305(mk).encrypt(bytes(12), plaintext, AD)


def _hkdf(ikm: bytes, info: bytes, blocks: int = 1) -> bytes:
    """RFC 5869 HKDF-SHA256 on ``hmac.digest``: one extract, ``blocks`` expand steps."""
    prk = hmac.digest(bytes(32), ikm, "sha256")
    out, block = b"", b""
    for i in range(1, blocks + 1):
        block = hmac.digest(prk, block + info + bytes((i,)), "sha256")
        out += block
    return out


def _nacl_keypair() -> tuple[bytes, bytes]:
    private = os.urandom(32)
    return private, crypto_scalarmult_base(private)


def _openssl_keypair() -> tuple[X25519PrivateKey, bytes]:
    private = X25519PrivateKey.generate()
    return private, private.public_key().public_bytes_raw()


def _openssl_dh(private: X25519PrivateKey, public: bytes) -> bytes:
    return private.exchange(X25519PublicKey.from_public_bytes(public))


#: X25519 in each library: (key pair from the OS CSPRNG, DH on a raw public key).
X25519_LIBS: dict[str, tuple[Callable[[], tuple[Any, bytes]], Callable[[Any, bytes], bytes]]] = {
    "libsodium": (_nacl_keypair, crypto_scalarmult),
    "openssl": (_openssl_keypair, _openssl_dh),
}


def _bundle_framing(hybrid: bool) -> bytes:
    """Zero bytes as long as a real signed bundle body minus its keys (X25519
    identity and signed prekey, and the ML-KEM-768 key when hybrid)."""
    wallet = Wallet.from_seed(bytes(32))
    bundle = PrekeySecrets.generate(wallet, pq=hybrid).bundle()
    keys = len(bundle.identity_dh) + len(bundle.spk) + len(bundle.pq_key or b"")
    return bytes(len(_BUNDLE_DOMAIN + bundle.signed_body()) - keys)


_BUNDLE_FRAMING = {False: _bundle_framing(False), True: _bundle_framing(True)}


def _raw_pair(hybrid: bool, x25519_lib: str = "libsodium") -> bytes:
    """Every primitive call ``Session.create_pair`` needs, with no encoding, state or checks.

    Two Ed25519 identities (seed -> key pair); Bob's X25519 identity key and
    signed prekey, Alice's identity, ephemeral and first ratchet key (five
    X25519 key pairs); three Ed25519 signatures (both identity bindings, Bob's
    bundle) and two verifies (the bundle, Alice's binding); X3DH's three DHs on
    each side plus one each for the first ratchet step (eight); X3DH's HKDF on
    each side, KDF_RK (64 bytes) on each side, KDF_CK on each side, and the
    first (empty) message sealed and opened. The hybrid suite adds an
    ML-KEM-768 key from its seed, the public key parsed from the bundle, one
    encapsulation and one decapsulation. ``x25519_lib`` picks the X25519
    library (Ed25519 stays on libsodium, the faster one in bench_crypto): the
    floor is whichever is faster in this run.
    """
    rng = os.urandom
    keypair, dh = X25519_LIBS[x25519_lib]
    a_pk, a_sk = crypto_sign_seed_keypair(rng(32))
    b_pk, b_sk = crypto_sign_seed_keypair(rng(32))
    pairs = [keypair() for _ in range(5)]
    priv = [p for p, _ in pairs]
    b_ik, b_spk, a_ik, a_ek, a_rt = (pub for _, pub in pairs)
    kem_raw = b""
    if hybrid:
        kem = MLKEM768PrivateKey.from_seed_bytes(rng(64))
        kem_raw = kem.public_key().public_bytes_raw()
    crypto_sign(b"Talos_IdentityKey_v1\0" + b_pk + b_ik, b_sk)
    # The bundle signature covers the ML-KEM key (PQXDH §3.2): sign a message as
    # long as the real signed body (framing bytes stand in for DID, suites, ids).
    framing = _BUNDLE_FRAMING[hybrid]
    bundle = crypto_sign(framing + b_ik + b_spk + kem_raw, b_sk)
    a_bind = crypto_sign(b"Talos_IdentityKey_v1\0" + a_pk + a_ik, a_sk)
    crypto_sign_open(bundle, b_pk)
    crypto_sign_open(a_bind, a_pk)
    kem_a = kem_b = b""
    if hybrid:
        public = MLKEM768PublicKey.from_public_bytes(kem_raw)
        kem_a, ct = public.encapsulate()
        kem_b = kem.decapsulate(ct)
    ikm_a = dh(priv[2], b_spk) + dh(priv[3], b_ik) + dh(priv[3], b_spk) + kem_a
    ikm_b = dh(priv[1], a_ik) + dh(priv[0], a_ek) + dh(priv[1], a_ek) + kem_b
    sk_a, sk_b = _hkdf(ikm_a, b"x3dh"), _hkdf(ikm_b, b"x3dh")
    rk_a = _hkdf(sk_a + dh(priv[4], b_spk), b"rk", 2)
    rk_b = _hkdf(sk_b + dh(priv[1], a_rt), b"rk", 2)
    mk_a = hmac.digest(rk_a[32:], b"\x01", "sha256")
    hmac.digest(rk_a[32:], b"\x02", "sha256")
    mk_b = hmac.digest(rk_b[32:], b"\x01", "sha256")
    hmac.digest(rk_b[32:], b"\x02", "sha256")
    sealed = ChaCha20Poly1305(mk_a).encrypt(bytes(12), b"", AD)
    return ChaCha20Poly1305(mk_b).decrypt(bytes(12), sealed, AD) + hashlib.sha256(sealed).digest()


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
    suite.pair(
        "session.create_pair.x25519",
        "Session.create_pair, x25519 (keys included)",
        partial(_raw_pair, False),
        partial(Session.create_pair, SUITE_X25519),
        raw_label="sum of its primitives: 2 Ed25519 keygen, 5 X25519 keygen, 8 DH, "
        "3 sign, 2 verify, HKDF/HMAC, AEAD",
        raw_key="session.create_pair.x25519.primitives",
    )
    suite.floor(
        "session.create_pair.x25519.primitives.openssl",
        "sum of its primitives, X25519 on OpenSSL key objects",
        partial(_raw_pair, False, "openssl"),
    )
    suite.pair(
        "session.create_pair.x25519-mlkem768",
        "Session.create_pair, x25519-mlkem768 (keys included)",
        partial(_raw_pair, True),
        partial(Session.create_pair, SUITE_HYBRID),
        raw_label="sum of its primitives, plus ML-KEM-768 keygen, parse, encaps, decaps",
        raw_key="session.create_pair.x25519-mlkem768.primitives",
    )
    suite.floor(
        "session.create_pair.x25519-mlkem768.primitives.openssl",
        "sum of its primitives (hybrid), X25519 on OpenSSL key objects",
        partial(_raw_pair, True, "openssl"),
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
