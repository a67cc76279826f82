"""Tests for talos_sdk.did against the W3C did:key vectors and every malformed form."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nacl.bindings
import pytest
from hypothesis import given
from hypothesis import strategies as st

from talos_sdk.base58 import b58decode, b58encode
from talos_sdk.did import did_from_public_key, public_key_from_did
from talos_sdk.errors import DIDError

VECTORS: list[dict[str, Any]] = json.loads(
    (Path(__file__).parent.parent / "vectors" / "didkey" / "ed25519.json").read_text()
)["vectors"]


@pytest.mark.parametrize("vec", VECTORS, ids=[v["did"][-8:] for v in VECTORS])
def test_w3c_vectors(vec: dict[str, Any]) -> None:
    public_key, _ = nacl.bindings.crypto_sign_seed_keypair(bytes.fromhex(vec["seed"]))
    assert b58encode(public_key) == vec["publicKeyBase58"]
    assert did_from_public_key(public_key) == vec["did"]
    assert public_key_from_did(vec["did"]) == b58decode(vec["publicKeyBase58"])


@given(st.binary(min_size=32, max_size=32))
def test_round_trip(key: bytes) -> None:
    did = did_from_public_key(key)
    assert did.startswith("did:key:z6Mk")
    assert public_key_from_did(did) == key


def test_accepts_bytearray_and_memoryview() -> None:
    key = bytes(range(32))
    assert did_from_public_key(bytearray(key)) == did_from_public_key(memoryview(key))


GOOD = VECTORS[0]["did"]
KEY0 = b58decode(VECTORS[0]["publicKeyBase58"])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("", "not a DID"),
        ("z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp", "not a DID"),
        ("did:web:example.com", "unsupported DID method 'web'"),
        ("did:key:", "empty method-specific identifier"),
        ("did:key:" + "f" + KEY0.hex(), "unsupported multibase prefix 'f'"),
        ("did:key:u7QE", "unsupported multibase prefix 'u'"),
        (GOOD.replace("z6Mk", "z6M0"), "not valid base58btc.*'0'"),
        (GOOD + "l", "not valid base58btc.*'l'"),
        (GOOD + "#" + GOOD[8:], "DID URLs are not accepted"),
        (GOOD + "?versionId=1", "DID URLs are not accepted"),
        ("did:key:z" + b58encode(b"\xec\x01" + KEY0), r"multicodec 0xec \(x25519-pub\)"),
        ("did:key:z" + b58encode(b"\x80\x24" + bytes(33)), r"multicodec 0x1200 \(p256-pub\)"),
        ("did:key:z" + b58encode(b"\x01\x02" + KEY0), r"multicodec 0x1 \(unknown\)"),
        # 0xed written as a non-minimal 3-byte varint is not the canonical prefix.
        ("did:key:z" + b58encode(b"\xed\x81\x00" + KEY0), "multicodec 0xed"),
        ("did:key:z" + b58encode(b"\xff" * 12), "not a valid unsigned varint"),
        ("did:key:z" + b58encode(b"\xed\x01" + KEY0[:31]), "must be 32 bytes, got 31"),
        ("did:key:z" + b58encode(b"\xed\x01" + KEY0 + b"\x00"), "must be 32 bytes, got 33"),
        ("did:key:z", "not a valid unsigned varint"),
        # From the W3C did-key-test-suite: a key too short for Ed25519.
        ("did:key:zTjsVPtY", "must be 32 bytes, got 3"),
        # Refused before decoding: base58 decoding is quadratic in the length.
        ("did:key:z" + "2" * 65_000, "identifier of 65001 characters"),
    ],
)
def test_malformed_dids(bad: str, message: str) -> None:
    with pytest.raises(DIDError, match=message):
        public_key_from_did(bad)


def test_non_string_did() -> None:
    with pytest.raises(DIDError, match="must be a str"):
        public_key_from_did(b"did:key:z6Mk")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [b"", bytes(31), bytes(33)])
def test_bad_public_key_length(bad: bytes) -> None:
    with pytest.raises(DIDError, match="must be 32 bytes"):
        did_from_public_key(bad)


def test_bad_public_key_type() -> None:
    with pytest.raises(DIDError, match="must be bytes"):
        did_from_public_key("00" * 32)  # type: ignore[arg-type]


def test_parse_is_cached_and_equals_a_real_decode() -> None:
    """One table holds what was encoded and what was decoded; a hit equals a decode."""
    import talos_sdk.did as did_mod

    did_mod._KEYS.clear()
    assert public_key_from_did(GOOD) == KEY0
    assert did_mod._KEYS == {GOOD: KEY0}
    assert public_key_from_did(GOOD) is did_mod._KEYS[GOOD]
    key = bytes(range(32))
    did = did_from_public_key(key)
    assert did_mod._KEYS[did] == key
    assert public_key_from_did(did) == key == b58decode(did[len("did:key:z") :])[2:]
    did_mod._KEYS.clear()  # and without the table, the base58 path agrees
    assert public_key_from_did(did) == key


def test_malformed_dids_are_not_cached() -> None:
    import talos_sdk.did as did_mod

    did_mod._KEYS.clear()
    with pytest.raises(DIDError):
        public_key_from_did("did:key:zTjsVPtY")
    assert did_mod._KEYS == {}


def test_the_cache_is_bounded() -> None:
    import talos_sdk.did as did_mod

    for i in range(did_mod._KEYS_MAX + 10):
        did_from_public_key(i.to_bytes(32, "big"))
    assert len(did_mod._KEYS) == did_mod._KEYS_MAX
    assert did_from_public_key(bytes(32)) in did_mod._KEYS
    decoded = public_key_from_did(GOOD)
    assert len(did_mod._KEYS) == did_mod._KEYS_MAX
    assert did_mod._KEYS[GOOD] == decoded
