"""Tests for talos_sdk.hybrid and the ed25519-mldsa65 wallet suite: KAT vectors,
stripping, swapping, wrong context, foreign keys, pinning, key files, bad inputs."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.mldsa import MLDSA65PrivateKey, MLDSA65PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from talos_sdk.errors import (
    HandshakeError,
    KeyFileError,
    SignatureError,
    UsageError,
    WrongPassphraseError,
)
from talos_sdk.hybrid import (
    ED25519_PREFIX,
    HYBRID_SIGNATURE_SIZE,
    MLDSA65_CONTEXT,
    SUITE_ED25519,
    SUITE_HYBRID,
    DowngradeError,
    HybridPublicKey,
    HybridSigner,
    PeerSuiteError,
    PinnedKeyChangedError,
    PostQuantumRequiredError,
    decide_peer_pin,
    derive_mldsa65_seed,
)
from talos_sdk.keyfile import decode_key_file, encode_key_file, load_wallet, save_wallet
from talos_sdk.wallet import HybridWallet, Wallet, verify, verify_auth

VECTORS: list[dict[str, Any]] = json.loads(
    (Path(__file__).parent.parent / "vectors" / "hybrid" / "ed25519_mldsa65.json").read_text()
)["vectors"]
FAST_N = 2**10

A = HybridWallet.from_seed(bytes(range(32)))
B = HybridWallet.from_seed(bytes([2]) * 32)
MSG = b"prekey bundle v1"
SIG = A.sign_hybrid(MSG)


def _raw_keys(seed: bytes) -> tuple[Ed25519PrivateKey, MLDSA65PrivateKey]:
    """The two component keys rebuilt with cryptography only (spec, not talos_sdk)."""
    ml_seed = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=None, info=b"talos-hybrid-v1/mldsa65-seed"
    ).derive(seed)
    return Ed25519PrivateKey.from_private_bytes(seed), MLDSA65PrivateKey.from_seed_bytes(ml_seed)


def _forge(
    seed: bytes,
    message: bytes,
    *,
    ed_prefix: bytes = ED25519_PREFIX,
    ctx: bytes = MLDSA65_CONTEXT,
    key_id: bytes | None = None,
) -> bytes:
    """A hybrid-shaped signature made by the right keys with chosen labels / key id."""
    ed, ml = _raw_keys(seed)
    if key_id is None:
        key_id = A.hybrid_public_key.key_id if seed == A.seed else B.hybrid_public_key.key_id
    bound = key_id + message
    return ed.sign(ed_prefix + bound) + ml.sign(bound, ctx)


# --- known answers ---------------------------------------------------------------


@pytest.mark.parametrize("vec", VECTORS, ids=[v["did"][-8:] for v in VECTORS])
def test_known_answer_vectors(vec: dict[str, Any]) -> None:
    seed, msg, sig = (bytes.fromhex(vec[k]) for k in ("seed", "message", "signature"))
    w = Wallet.from_seed(seed, suite=SUITE_HYBRID)
    pk = w.hybrid_public_key
    assert isinstance(w, HybridWallet) and pk is not None
    assert w.did == pk.did == vec["did"]
    assert derive_mldsa65_seed(seed).hex() == vec["mldsa65_seed"]
    assert pk.ed25519.hex() == vec["ed25519_public_key"]
    assert pk.mldsa65.hex() == w.mldsa_public_key.hex() == vec["mldsa65_public_key"]
    assert pk.key_id.hex() == pk.fingerprint == vec["key_id"]
    assert pk.verify(msg, sig) and w.verify_auth(msg, sig)
    assert verify_auth(vec["did"], bytes.fromhex(vec["mldsa65_public_key"]), msg, sig)
    assert HybridPublicKey.from_bytes(pk.to_bytes()) == pk


@pytest.mark.parametrize("vec", VECTORS, ids=[v["did"][-8:] for v in VECTORS])
def test_vectors_follow_the_documented_construction(vec: dict[str, Any]) -> None:
    """Re-derive and re-verify with raw cryptography calls: PROTOCOL.md matches the code."""
    seed, msg, sig = (bytes.fromhex(vec[k]) for k in ("seed", "message", "signature"))
    ed, ml = _raw_keys(seed)
    ed_pk = ed.public_key().public_bytes_raw()
    ml_pk = ml.public_key().public_bytes_raw()
    assert ml_pk.hex() == vec["mldsa65_public_key"]
    key_id = hashlib.sha256(b"talos-hybrid-v1/key-id" + ed_pk + ml_pk).digest()
    assert key_id.hex() == vec["key_id"]
    assert len(sig) == 64 + 3309 == HYBRID_SIGNATURE_SIZE
    Ed25519PublicKey.from_public_bytes(ed_pk).verify(
        sig[:64], b"talos-hybrid-v1/ed25519" + key_id + msg
    )
    MLDSA65PublicKey.from_public_bytes(ml_pk).verify(
        sig[64:], key_id + msg, b"talos-hybrid-v1/mldsa65"
    )


def test_signing_is_hedged_and_both_samples_verify() -> None:
    other = A.sign_hybrid(MSG)
    assert other != SIG  # ML-DSA hedged signing (FIPS 204 §3.4)
    assert other[:64] == SIG[:64]  # Ed25519 half is deterministic
    assert A.verify_auth(MSG, other)


# --- the attacks the construction must stop ----------------------------------------


def test_stripping_either_half_is_rejected() -> None:
    pk = A.hybrid_public_key
    ed_half, ml_half = SIG[:64], SIG[64:]
    assert not pk.verify(MSG, ed_half)
    assert not pk.verify(MSG, ml_half)
    # The Ed25519 half is not a classical signature of the message either.
    assert not verify(A.did, MSG, ed_half)
    assert not verify_auth(A.did, None, MSG, ed_half)
    # Nor is the ML-DSA half a plain ML-DSA signature of M (no key id, no / other context).
    ml_pub = MLDSA65PublicKey.from_public_bytes(pk.mldsa65)
    for args in ((MSG,), (MSG, MLDSA65_CONTEXT), (pk.key_id + MSG,)):
        with pytest.raises(InvalidSignature):
            ml_pub.verify(ml_half, *args)
    with pytest.raises(SignatureError, match=r"length 64 \(a classical Ed25519 signature\)"):
        pk.require_valid(MSG, ed_half)
    with pytest.raises(SignatureError, match="length 3309, expected 3373"):
        pk.require_valid(MSG, ml_half)


def test_a_classical_signature_cannot_be_upgraded() -> None:
    """A plain Ed25519 signature of M, padded with a valid ML-DSA half, is no hybrid one."""
    classical = A.sign(MSG)
    assert len(classical) == 64 and verify(A.did, MSG, classical)
    with pytest.raises(SignatureError, match="Ed25519 half does not verify"):
        A.hybrid_public_key.require_valid(MSG, classical + SIG[64:])


def test_swapping_halves_between_messages_is_rejected() -> None:
    m2 = b"another message"
    sig2 = A.sign_hybrid(m2)
    mixed_a, mixed_b = SIG[:64] + sig2[64:], sig2[:64] + SIG[64:]
    for m in (MSG, m2):
        assert not A.verify_auth(m, mixed_a)
        assert not A.verify_auth(m, mixed_b)
    with pytest.raises(SignatureError, match="ML-DSA-65 half does not verify"):
        A.hybrid_public_key.require_valid(MSG, mixed_a)


@pytest.mark.parametrize(
    ("changes", "failure"),
    [
        ({"ed_prefix": b"talos-hybrid-v1/ed25519x"}, "Ed25519 half"),
        ({"ed_prefix": b""}, "Ed25519 half"),
        ({"ed_prefix": MLDSA65_CONTEXT}, "Ed25519 half"),
        ({"ctx": b""}, "ML-DSA-65 half"),
        ({"ctx": ED25519_PREFIX}, "ML-DSA-65 half"),
        ({"ctx": b"talos-hybrid-v2/mldsa65"}, "ML-DSA-65 half"),
        ({"key_id": bytes(32)}, "Ed25519 half"),
        ({"key_id": b""}, "Ed25519 half"),
    ],
)
def test_wrong_context_or_unbound_keys_are_rejected(changes: dict[str, Any], failure: str) -> None:
    assert A.verify_auth(MSG, _forge(A.seed, MSG))  # the forge helper itself is right
    bad = _forge(A.seed, MSG, **changes)
    with pytest.raises(SignatureError, match=failure):
        A.hybrid_public_key.require_valid(MSG, bad)


def test_halves_cannot_be_recombined_across_identities() -> None:
    a, b = A.hybrid_public_key, B.hybrid_public_key
    sig_b = B.sign_hybrid(MSG)
    assert not b.verify(MSG, SIG)
    for ed_pk, ml_pk in ((a.ed25519, b.mldsa65), (b.ed25519, a.mldsa65)):
        mixed = HybridPublicKey(ed_pk, ml_pk)
        for sig in (SIG, sig_b, SIG[:64] + sig_b[64:], sig_b[:64] + SIG[64:]):
            assert not mixed.verify(MSG, sig)
    # Each half valid for its own key, but over another pair's key id: still rejected.
    mixed = HybridPublicKey(a.ed25519, b.mldsa65)
    ed, _ = _raw_keys(A.seed)
    _, ml = _raw_keys(B.seed)
    assert not mixed.verify(
        MSG,
        ed.sign(ED25519_PREFIX + a.key_id + MSG) + ml.sign(b.key_id + MSG, MLDSA65_CONTEXT),
    )
    # With the pair's own key id both halves check, which is why the pair must be pinned.
    assert mixed.verify(
        MSG,
        ed.sign(ED25519_PREFIX + mixed.key_id + MSG) + ml.sign(mixed.key_id + MSG, MLDSA65_CONTEXT),
    )
    assert not verify_auth(A.did, b.mldsa65, MSG, SIG)


@pytest.mark.parametrize("index", [0, 31, 63, 64, 1000, HYBRID_SIGNATURE_SIZE - 1])
def test_any_bit_flip_is_rejected(index: int) -> None:
    bad = bytearray(SIG)
    bad[index] ^= 0x01
    assert not A.verify_auth(MSG, bytes(bad))


@pytest.mark.parametrize("sig", [b"", SIG[:-1], SIG + b"\x00", bytes(HYBRID_SIGNATURE_SIZE)])
def test_malformed_signatures_are_false(sig: bytes) -> None:
    assert not A.verify_auth(MSG, sig)
    assert not A.verify_auth(MSG + b"!", SIG)


# --- wallet suite ------------------------------------------------------------------


def test_wallet_suites_and_dids() -> None:
    seed = bytes(range(32))
    classical = Wallet.from_seed(seed)
    assert type(classical) is Wallet and classical.suite == SUITE_ED25519
    assert classical.mldsa_public_key is None and classical.hybrid_public_key is None
    assert type(HybridWallet.from_seed(seed)) is HybridWallet
    assert type(Wallet.from_seed(seed, suite=SUITE_ED25519)) is Wallet
    assert A.did == classical.did  # upgrading a seed to hybrid keeps the DID
    # Per-message signatures stay plain Ed25519, identical in both suites.
    assert A.sign(MSG) == classical.sign(MSG) and A.verify(MSG, A.sign(MSG))
    assert classical.sign_auth(MSG) == classical.sign(MSG)
    assert classical.verify_auth(MSG, classical.sign_auth(MSG))
    assert verify_auth(classical.did, None, MSG, classical.sign_auth(MSG))
    assert not verify_auth(A.did, None, MSG, SIG)
    assert repr(A) == f"HybridWallet(suite='ed25519-mldsa65', did={A.did!r})"


def test_generate_hybrid_uses_injected_rng() -> None:
    calls: list[int] = []

    def rng(n: int) -> bytes:
        calls.append(n)
        return bytes(range(n))

    w = Wallet.generate(rng=rng, suite=SUITE_HYBRID)
    assert calls == [32] and w.suite == SUITE_HYBRID
    assert w.mldsa_public_key == A.mldsa_public_key
    fresh = HybridWallet.generate()
    assert fresh.suite == SUITE_HYBRID and fresh.did != w.did


def test_hybrid_objects_do_not_leak_or_pickle() -> None:
    signer = HybridSigner.from_seed(A.seed)
    assert A.seed.hex() not in repr(A) + repr(signer) + repr(A.hybrid_public_key)
    assert signer.public_key == A.hybrid_public_key
    for obj in (A, signer):
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(obj)


def test_hybrid_key_file_round_trips(tmp_path: Path) -> None:
    save_wallet(A, tmp_path / "plain.key")
    save_wallet(A, tmp_path / "sealed.key", "pw")
    doc = json.loads((tmp_path / "plain.key").read_text())
    assert doc["suite"] == SUITE_HYBRID and doc["key_id"] == A.hybrid_public_key.fingerprint
    for loaded in (load_wallet(tmp_path / "plain.key"), load_wallet(tmp_path / "sealed.key", "pw")):
        assert isinstance(loaded, HybridWallet)
        assert loaded.hybrid_public_key == A.hybrid_public_key
        assert loaded.verify_auth(MSG, SIG)


def _edit(data: bytes, **changes: Any) -> bytes:
    doc = json.loads(data)
    for key, value in changes.items():
        if value is ...:
            del doc[key]
        else:
            doc[key] = value
    return json.dumps(doc).encode()


@pytest.mark.parametrize("key_id", ["00" * 32, ..., 7])
def test_hybrid_key_file_key_id_is_checked(key_id: Any) -> None:
    plain = encode_key_file(A)
    with pytest.raises(KeyFileError, match="'key_id' does not match its key"):
        decode_key_file(_edit(plain, key_id=key_id))
    sealed = encode_key_file(A, "pw", scrypt_n=FAST_N)
    with pytest.raises(WrongPassphraseError):  # the header is the AEAD's associated data
        decode_key_file(_edit(sealed, key_id=key_id), "pw")


def test_classical_key_file_relabelled_hybrid_is_rejected() -> None:
    plain = encode_key_file(Wallet.from_seed(A.seed))
    with pytest.raises(KeyFileError, match="'key_id' does not match"):
        decode_key_file(_edit(plain, suite=SUITE_HYBRID))


# --- bad inputs --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ed", "ml", "message"),
    [
        (bytes(31), A.mldsa_public_key, "Ed25519 public key must be 32 bytes, got 31"),
        (
            A.public_key,
            A.mldsa_public_key[:-1],
            "ML-DSA-65 public key must be 1952 bytes, got 1951",
        ),
        (A.public_key, b"", "ML-DSA-65 public key must be 1952 bytes, got 0"),
        ("ab" * 16, A.mldsa_public_key, "Ed25519 public key must be bytes, not str"),
        (A.public_key, None, "ML-DSA-65 public key must be bytes, not NoneType"),
    ],
)
def test_bad_public_keys(ed: Any, ml: Any, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        HybridPublicKey(ed, ml)


def test_other_bad_inputs() -> None:
    pk = A.hybrid_public_key
    with pytest.raises(UsageError, match="hybrid public key must be 1984 bytes, got 1983"):
        HybridPublicKey.from_bytes(pk.to_bytes()[:-1])
    with pytest.raises(UsageError, match="data and signature must be bytes"):
        pk.verify("text", SIG)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="data and signature must be bytes"):
        pk.verify(MSG, None)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="data to sign must be bytes, not str"):
        A.sign_hybrid("text")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="hybrid seed must be 32 bytes, got 16"):
        derive_mldsa65_seed(bytes(16))
    with pytest.raises(UsageError, match="must be 32 bytes, got 33"):
        HybridWallet.from_seed(bytes(33))
    with pytest.raises(UsageError, match="has no ML-DSA-65 key"):
        Wallet.from_seed(A.seed).sign_hybrid(MSG)
    with pytest.raises(UsageError, match="unknown wallet suite 'ed448'"):
        Wallet.generate(suite="ed448")
    with pytest.raises(UsageError, match="unknown wallet suite 'mldsa65'"):
        Wallet.from_seed(A.seed, suite="mldsa65")
    with pytest.raises(UsageError, match="HybridWallet cannot build a wallet of suite 'ed25519'"):
        HybridWallet.from_seed(A.seed, suite=SUITE_ED25519)
    with pytest.raises(UsageError, match="ML-DSA-65 public key must be bytes or None"):
        verify_auth(A.did, "key", MSG, SIG)  # type: ignore[arg-type]


# --- pinning and policy ------------------------------------------------------------

DID = A.did
KEY_A, KEY_B = A.mldsa_public_key, B.mldsa_public_key


def test_pin_first_contact_and_repeat() -> None:
    first = decide_peer_pin(DID, None, KEY_A)
    assert (first.suite, first.pin, first.newly_pinned) == (SUITE_HYBRID, KEY_A, True)
    again = decide_peer_pin(DID, KEY_A, KEY_A, require_pq=True)
    assert (again.suite, again.pin, again.newly_pinned) == (SUITE_HYBRID, KEY_A, False)
    classical = decide_peer_pin(DID, None, None)
    assert (classical.suite, classical.pin, classical.newly_pinned) == (SUITE_ED25519, None, False)


def test_downgrade_after_pinning_is_refused() -> None:
    with pytest.raises(DowngradeError, match=f"downgrade refused: peer {DID}") as info:
        decide_peer_pin(DID, KEY_A, None)
    assert isinstance(info.value, HandshakeError)
    # And at the signature level: a classical proof never passes where a key is pinned.
    assert not verify_auth(DID, KEY_A, MSG, A.sign(MSG))


def test_pinned_key_change_is_refused() -> None:
    with pytest.raises(PinnedKeyChangedError, match=f"peer {DID} presents ML-DSA-65 key"):
        decide_peer_pin(DID, KEY_A, KEY_B)


@pytest.mark.parametrize("pinned", [None, KEY_A])
def test_classical_peer_under_require_pq_is_refused(pinned: bytes | None) -> None:
    with pytest.raises(PostQuantumRequiredError, match=r"requires hybrid .*--require-pq") as info:
        decide_peer_pin(DID, pinned, None, require_pq=True)
    assert isinstance(info.value, PeerSuiteError) and isinstance(info.value, HandshakeError)


def test_pin_bad_input() -> None:
    with pytest.raises(UsageError, match="presented ML-DSA-65 key must be bytes, not str"):
        decide_peer_pin(DID, None, "key")  # type: ignore[arg-type]
