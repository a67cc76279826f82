"""Tests for talos_sdk.wallet: RFC 8032 and did:key vectors, sign/verify, bad inputs."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from talos_sdk.did import public_key_from_did
from talos_sdk.errors import DIDError, UsageError
from talos_sdk.wallet import Wallet, verify, verify_with_public_key

VEC = Path(__file__).parent.parent / "vectors"
RFC8032: list[dict[str, Any]] = json.loads((VEC / "wallet" / "rfc8032_ed25519.json").read_text())[
    "vectors"
]
DIDKEY: list[dict[str, Any]] = json.loads((VEC / "didkey" / "ed25519.json").read_text())["vectors"]


@pytest.mark.parametrize("vec", RFC8032, ids=[v["name"] for v in RFC8032])
def test_rfc8032_vectors(vec: dict[str, Any]) -> None:
    w = Wallet.from_seed(bytes.fromhex(vec["seed"]))
    msg, sig = bytes.fromhex(vec["message"]), bytes.fromhex(vec["signature"])
    assert w.public_key.hex() == vec["public_key"]
    assert w.sign(msg) == sig
    assert w.verify(msg, sig)
    assert verify(w.did, msg, sig)


@pytest.mark.parametrize("vec", DIDKEY, ids=[v["did"][-8:] for v in DIDKEY])
def test_did_matches_w3c_vectors(vec: dict[str, Any]) -> None:
    w = Wallet.from_seed(bytes.fromhex(vec["seed"]))
    assert w.did == w.to_did() == vec["did"]
    assert public_key_from_did(w.did) == w.public_key


def test_generate_uses_injected_rng() -> None:
    calls: list[int] = []

    def rng(n: int) -> bytes:
        calls.append(n)
        return bytes(range(n))

    w = Wallet.generate(rng=rng)
    assert calls == [32]
    assert w.seed == w.private_bytes() == bytes(range(32))
    assert Wallet.generate().did != Wallet.generate().did  # OS randomness


def test_wallet_interoperates_with_openssl() -> None:
    w = Wallet.generate()
    other = Ed25519PrivateKey.from_private_bytes(w.seed)
    msg = b"talos interop"
    assert other.sign(msg) == w.sign(msg)  # Ed25519 is deterministic
    other.public_key().verify(w.sign(msg), msg)


@settings(max_examples=25)
@given(st.binary(min_size=32, max_size=32), st.binary(max_size=200))
def test_sign_verify_round_trip(seed: bytes, msg: bytes) -> None:
    w = Wallet.from_seed(seed)
    sig = w.sign(msg)
    assert len(sig) == 64
    assert w.verify(msg, sig)
    assert verify(w.did, msg, sig)
    assert not w.verify(msg + b"x", sig)


def test_tampered_or_foreign_signatures_fail() -> None:
    a, b = Wallet.generate(), Wallet.generate()
    msg = b"hello"
    sig = a.sign(msg)
    flipped = bytes([sig[0] ^ 1]) + sig[1:]
    assert not a.verify(msg, flipped)
    assert not b.verify(msg, sig)
    assert not verify(b.did, msg, sig)
    assert not a.verify(msg, sig[:63])
    assert not a.verify(msg, sig + b"\x00")
    assert not a.verify(msg, b"")
    assert not verify_with_public_key(bytes(31), msg, sig)


@pytest.mark.parametrize("seed", [b"", bytes(31), bytes(33), bytes(64)])
def test_from_seed_wrong_length(seed: bytes) -> None:
    with pytest.raises(UsageError, match=f"must be 32 bytes, got {len(seed)}"):
        Wallet.from_seed(seed)


def test_from_seed_wrong_type() -> None:
    with pytest.raises(UsageError, match="seed must be bytes"):
        Wallet.from_seed("00" * 32)  # type: ignore[arg-type]


def test_generate_with_short_rng() -> None:
    with pytest.raises(UsageError, match="got 16"):
        Wallet.generate(rng=lambda n: bytes(16))


def test_sign_non_bytes() -> None:
    with pytest.raises(UsageError, match="data to sign must be bytes, not str"):
        Wallet.generate().sign("text")  # type: ignore[arg-type]


def test_verify_non_bytes() -> None:
    w = Wallet.generate()
    with pytest.raises(UsageError, match="must be bytes"):
        w.verify("text", w.sign(b"text"))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="must be bytes"):
        verify(w.did, b"text", None)  # type: ignore[arg-type]


def test_module_verify_bad_did() -> None:
    with pytest.raises(DIDError, match="unsupported DID method 'web'"):
        verify("did:web:example.com", b"m", bytes(64))


def test_repr_and_pickle_do_not_leak_the_seed() -> None:
    w = Wallet.from_seed(bytes(range(32)))
    assert bytes(range(32)).hex() not in repr(w)
    assert repr(w) == f"Wallet(suite='ed25519', did={w.did!r})"
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(w)


def test_suite_is_extensible() -> None:
    class Hybrid(Wallet):
        __slots__ = ()
        suite = "ed25519-mldsa65"

    h = Hybrid.from_seed(bytes(32))
    assert isinstance(h, Hybrid) and h.suite == "ed25519-mldsa65"
    assert Wallet.from_seed(bytes(32)).suite == "ed25519"


def test_the_package_lists_its_lazy_names() -> None:
    """help(talos_sdk), dir() and completion show the API, not only the errors."""
    import talos_sdk

    names = dir(talos_sdk)
    for name in ("Wallet", "Session", "RatchetFrameCrypto", "merkle_root", "load_wallet"):
        assert name in names
    assert set(talos_sdk.__all__) <= set(names)
    # Errors drawn in the tree but defined beside their code import from the package too.
    from talos_sdk import PartyMismatchError, PostQuantumRequiredError, ProtocolError

    assert issubclass(PartyMismatchError, ProtocolError)
    assert issubclass(PostQuantumRequiredError, ProtocolError)
