"""Crypto primitives: our wrappers beside the raw cryptography / PyNaCl calls
(docs/DESIGN.md "Performance targets").

Run ``python bench/bench_crypto.py`` (any pyperf option works; ``--fast`` for a
smoke run). Rows follow docs/DESIGN.md "Performance targets": Wallet sign/verify
against the faster of libsodium and OpenSSL Ed25519, ChaCha20-Poly1305 on a
35-byte frame, plus the floors the protocol is built on (X25519, SHA-256,
ML-KEM-768, ML-DSA-65); our stream sealer beside ChaCha20-Poly1305; hybrid
Ed25519 + ML-DSA-65 sign/verify beside the sum of its two raw calls (ADR 0005).
"""

from __future__ import annotations

import hashlib
import os
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Suite
from cryptography.hazmat.primitives.asymmetric import ed25519, mldsa, mlkem, x25519
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from nacl.bindings import (
    crypto_aead_chacha20poly1305_ietf_encrypt,
    crypto_scalarmult,
    crypto_scalarmult_base,
    crypto_sign,
    crypto_sign_open,
    crypto_sign_seed_keypair,
)
from nacl.signing import SigningKey

from talos_sdk.aead import StreamSealer
from talos_sdk.did import did_from_public_key
from talos_sdk.hybrid import ED25519_PREFIX, MLDSA65_CONTEXT, derive_mldsa65_seed
from talos_sdk.wallet import HybridWallet, Wallet, verify_auth

SIZES = {"64 B": 64, "10 KB": 10 * 1024}
AEAD_SIZES = {"35 B": 35, "10 KB": 10 * 1024, "1 MiB": 1024 * 1024}


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _nacl_sign(data: bytes, secret_key: bytes) -> bytes:
    return crypto_sign(data, secret_key)[:64]


def _nacl_verify(data: bytes, signature: bytes, public_key: bytes) -> bytes:
    return crypto_sign_open(signature + data, public_key)


def bench_ed25519(suite: Suite) -> None:
    """Wallet sign / verify beside the libsodium call it wraps, with both libraries as floors."""
    seed = bytes(range(32))
    wallet = Wallet.from_seed(seed)
    pk, sk = crypto_sign_seed_keypair(seed)
    nacl_key = SigningKey(seed)
    nacl_vk = nacl_key.verify_key
    ossl_key = ed25519.Ed25519PrivateKey.from_private_bytes(seed)
    ossl_pk = ossl_key.public_key()
    for size_label, size in SIZES.items():
        msg = os.urandom(size)
        tag = size_label.replace(" ", "")
        sig = wallet.sign(msg)
        suite.pair(
            f"wallet.sign.{tag}",
            f"Wallet.sign {size_label}",
            partial(_nacl_sign, msg, sk),
            partial(wallet.sign, msg),
            raw_label=f"nacl.bindings.crypto_sign {size_label}",
        )
        suite.floor(
            f"ed25519.sign.{tag}.nacl",
            f"PyNaCl SigningKey.sign {size_label}",
            partial(nacl_key.sign, msg),
        )
        suite.floor(
            f"ed25519.sign.{tag}.openssl",
            f"OpenSSL Ed25519 sign {size_label}",
            partial(ossl_key.sign, msg),
        )
        suite.pair(
            f"wallet.verify.{tag}",
            f"Wallet.verify {size_label}",
            partial(_nacl_verify, msg, sig, pk),
            partial(wallet.verify, msg, sig),
            raw_label=f"nacl.bindings.crypto_sign_open {size_label}",
        )
        suite.floor(
            f"ed25519.verify.{tag}.nacl",
            f"PyNaCl VerifyKey.verify {size_label}",
            partial(nacl_vk.verify, msg, sig),
        )
        suite.floor(
            f"ed25519.verify.{tag}.openssl",
            f"OpenSSL Ed25519 verify {size_label}",
            partial(ossl_pk.verify, sig, msg),
        )


def _seed_keypair_random() -> tuple[bytes, bytes]:
    return crypto_sign_seed_keypair(os.urandom(32))


def bench_wallet(suite: Suite) -> None:
    """Building an identity and naming it: Wallet.generate / from_seed / to_did."""
    seed = bytes(range(32))
    wallet = Wallet.from_seed(seed)
    suite.pair(
        "wallet.generate",
        "Wallet.generate",
        _seed_keypair_random,
        Wallet.generate,
        raw_label="crypto_sign_seed_keypair(os.urandom(32))",
    )
    suite.pair(
        "wallet.from_seed",
        "Wallet.from_seed",
        partial(crypto_sign_seed_keypair, seed),
        partial(Wallet.from_seed, seed),
        raw_label="crypto_sign_seed_keypair(seed)",
    )
    suite.pair(
        "wallet.to_did",
        "Wallet.to_did (cached)",
        partial(did_from_public_key, wallet.public_key),
        wallet.to_did,
        raw_label="did_from_public_key (computed each time)",
    )


def bench_x25519(suite: Suite) -> None:
    """One X25519 DH and one key pair, in both libraries: the unit costs of X3DH
    and of every DH ratchet step. talos_sdk.bundle runs X25519 on libsodium with
    raw 32-byte keys; these rows show whether that is still the faster choice
    (an OpenSSL DH needs key objects, and parsing a raw private key costs OpenSSL
    a base-point multiplication)."""
    a = x25519.X25519PrivateKey.generate()
    b_pub = x25519.X25519PrivateKey.generate().public_key()
    a_raw, b_raw = a.private_bytes_raw(), b_pub.public_bytes_raw()
    suite.floor("x25519.exchange", "OpenSSL X25519 exchange", lambda: a.exchange(b_pub))
    suite.floor(
        "x25519.exchange.nacl",
        "libsodium X25519 (crypto_scalarmult)",
        partial(crypto_scalarmult, a_raw, b_raw),
    )
    suite.floor("x25519.generate", "OpenSSL X25519 generate", x25519.X25519PrivateKey.generate)
    suite.floor(
        "x25519.generate.nacl",
        "libsodium X25519 key pair (os.urandom + crypto_scalarmult_base)",
        _nacl_x25519_keypair,
    )


def _nacl_x25519_keypair() -> tuple[bytes, bytes]:
    private = os.urandom(32)
    return private, crypto_scalarmult_base(private)


def bench_aead(suite: Suite) -> None:
    """ChaCha20-Poly1305 at the frame sizes the node sends; our stream sealer beside it."""
    aead = ChaCha20Poly1305(bytes(32))
    nonce = bytes(12)
    for size_label, size in AEAD_SIZES.items():
        tag = size_label.replace(" ", "")
        pt = os.urandom(size)
        ct = aead.encrypt(nonce, pt, b"ad")
        # A fresh sealer per size: its counter only grows, as in a real stream.
        sealer = StreamSealer(bytes(32), b"bench-stream-" + tag.encode())
        suite.pair(
            f"stream.seal.{tag}",
            f"talos_sdk.aead.StreamSealer.seal {size_label}",
            partial(aead.encrypt, nonce, pt, b"ad"),
            partial(sealer.seal, pt),
            raw_label=f"OpenSSL ChaCha20-Poly1305 seal {size_label}",
            raw_key=f"chacha20poly1305.seal.{tag}",
        )
        if size < 1 << 20:
            # The other library: at 35 B PyNaCl's argument checks cost more than
            # the cipher, which is why the SDK seals with cryptography's OpenSSL.
            suite.floor(
                f"chacha20poly1305.seal.{tag}.nacl",
                f"libsodium ChaCha20-Poly1305 IETF seal {size_label} (nacl.bindings)",
                partial(crypto_aead_chacha20poly1305_ietf_encrypt, pt, b"ad", nonce, bytes(32)),
            )
        if size >= 1 << 20:
            # seal() on large chunks must cost what sealing into a reused buffer costs.
            out = bytearray(size + 25)
            into = StreamSealer(bytes(32), b"bench-stream-into-" + tag.encode())
            suite.single(
                f"stream.seal_into.{tag}",
                f"talos_sdk.aead.StreamSealer.seal_into {size_label} (reused buffer)",
                partial(into.seal_into, pt, out),
            )
        suite.floor(
            f"chacha20poly1305.open.{tag}",
            f"OpenSSL ChaCha20-Poly1305 open {size_label}",
            partial(aead.decrypt, nonce, ct, b"ad"),
        )


def bench_sha256(suite: Suite) -> None:
    """SHA-256, the hash of commitments, block links and Merkle nodes."""
    for size_label, size in SIZES.items():
        data = os.urandom(size)
        tag = size_label.replace(" ", "")
        suite.floor(
            f"sha256.{tag}",
            f"hashlib SHA-256 {size_label}",
            partial(_sha256, data),
        )


def bench_post_quantum(suite: Suite) -> None:
    """ML-KEM-768 and ML-DSA-65 from OpenSSL: the PQ hybrid's floor."""
    kem = mlkem.MLKEM768PrivateKey.generate()
    kem_pub = kem.public_key()
    _, ct = kem_pub.encapsulate()
    suite.floor(
        "mlkem768.generate", "OpenSSL ML-KEM-768 generate", mlkem.MLKEM768PrivateKey.generate
    )
    suite.floor("mlkem768.encapsulate", "OpenSSL ML-KEM-768 encapsulate", kem_pub.encapsulate)
    suite.floor(
        "mlkem768.decapsulate", "OpenSSL ML-KEM-768 decapsulate", lambda: kem.decapsulate(ct)
    )
    dsa = mldsa.MLDSA65PrivateKey.generate()
    dsa_pub = dsa.public_key()
    msg = os.urandom(64)
    sig = dsa.sign(msg)
    suite.floor("mldsa65.sign.64B", "OpenSSL ML-DSA-65 sign 64 B", lambda: dsa.sign(msg))
    suite.floor(
        "mldsa65.verify.64B", "OpenSSL ML-DSA-65 verify 64 B", lambda: dsa_pub.verify(sig, msg)
    )


def bench_hybrid(suite: Suite) -> None:
    """Hybrid Ed25519 + ML-DSA-65 (ADR 0005) against the sum of its two raw calls.

    The raw side makes exactly the two primitive calls a hybrid signature needs,
    over the same bound bytes and labels, back to back: what is left of the
    ratio is our wrapping (concatenation, length checks, key-id prefix).
    """
    wallet = HybridWallet.from_seed(bytes(range(32)))
    hybrid = wallet.hybrid_public_key
    ed_pk, ed_sk = crypto_sign_seed_keypair(bytes(range(32)))
    dsa = mldsa.MLDSA65PrivateKey.from_seed_bytes(derive_mldsa65_seed(bytes(range(32))))
    dsa_pub = dsa.public_key()
    msg = os.urandom(64)
    bound = hybrid.key_id + msg

    def raw_sign() -> tuple[bytes, bytes]:
        return crypto_sign(ED25519_PREFIX + bound, ed_sk), dsa.sign(bound, MLDSA65_CONTEXT)

    sig = wallet.sign_hybrid(msg)
    sig_ed, sig_ml = sig[:64], sig[64:]

    def raw_verify() -> None:
        crypto_sign_open(sig_ed + ED25519_PREFIX + bound, ed_pk)
        dsa_pub.verify(sig_ml, bound, MLDSA65_CONTEXT)

    suite.pair(
        "hybrid.sign.64B",
        "HybridWallet.sign_auth 64 B (Ed25519 + ML-DSA-65)",
        raw_sign,
        partial(wallet.sign_auth, msg),
        raw_label="libsodium Ed25519 sign + OpenSSL ML-DSA-65 sign, same bytes",
    )
    suite.pair(
        "hybrid.verify.64B",
        "verify_auth 64 B (Ed25519 + ML-DSA-65, pinned key)",
        raw_verify,
        partial(verify_auth, wallet.did, wallet.mldsa_public_key, msg, sig),
        raw_label="libsodium Ed25519 verify + OpenSSL ML-DSA-65 verify, same bytes",
    )


def main() -> None:
    """Register every row, run them, print the table, write the results JSON."""
    suite = Suite.create(__file__)
    bench_ed25519(suite)
    bench_wallet(suite)
    bench_x25519(suite)
    bench_aead(suite)
    bench_sha256(suite)
    bench_post_quantum(suite)
    bench_hybrid(suite)
    suite.finish()


if __name__ == "__main__":
    main()
