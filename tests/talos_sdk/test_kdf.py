"""HKDF-SHA256 / HMAC-SHA256 helpers against RFC 5869 and the cryptography package."""

from __future__ import annotations

import hmac

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import given
from hypothesis import strategies as st

from talos_sdk.kdf import (
    hkdf,
    hkdf_expand,
    hkdf_extract,
    kdf_ck,
)

# RFC 5869 Appendix A, test cases 1 and 3 (SHA-256).
RFC5869 = [
    (
        "0b" * 22,
        "000102030405060708090a0b0c",
        "f0f1f2f3f4f5f6f7f8f9",
        42,
        "077709362c2e32df0ddc3f0dc47bba6390b6c73bb50f9c3122ec844ad7c2b3e5",
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865",
    ),
    (
        "0b" * 22,
        "",
        "",
        42,
        "19ef24a32c717b167f33a91d6f648bdf96596776afdb6377ac434c1c293ccb04",
        "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8",
    ),
]


@pytest.mark.parametrize(("ikm", "salt", "info", "length", "prk", "okm"), RFC5869)
def test_rfc5869_vectors(ikm: str, salt: str, info: str, length: int, prk: str, okm: str) -> None:
    assert hkdf_extract(bytes.fromhex(salt), bytes.fromhex(ikm)).hex() == prk
    out = hkdf(
        bytes.fromhex(ikm), salt=bytes.fromhex(salt), info=bytes.fromhex(info), length=length
    )
    assert out.hex() == okm


@given(
    ikm=st.binary(min_size=1, max_size=200),
    salt=st.binary(max_size=150),  # past the 64-byte block: long HMAC keys are hashed first
    info=st.binary(max_size=40),
    length=st.integers(1, 200),
)
def test_matches_cryptography_hkdf(ikm: bytes, salt: bytes, info: bytes, length: int) -> None:
    ref = HKDF(algorithm=hashes.SHA256(), length=length, salt=salt or None, info=info).derive(ikm)
    assert hkdf(ikm, salt=salt, info=info, length=length) == ref


@pytest.mark.parametrize("length", [0, 255 * 32 + 1])
def test_expand_rejects_bad_length(length: int) -> None:
    with pytest.raises(ValueError, match="output length"):
        hkdf_expand(bytes(32), b"", length)


@given(ck=st.binary(min_size=32, max_size=32))
def test_kdf_ck_is_the_two_chain_hmacs(ck: bytes) -> None:
    assert kdf_ck(ck) == (hmac.digest(ck, b"\x01", "sha256"), hmac.digest(ck, b"\x02", "sha256"))


@pytest.mark.parametrize("salt_len", [0, 31, 32, 33, 63, 64, 65, 200])
def test_extract_matches_hmac_for_every_key_length(salt_len: int) -> None:
    salt, ikm = bytes(range(salt_len)), b"input keying material"
    expected = hmac.digest(salt or bytes(32), ikm, "sha256")
    assert hkdf_extract(salt, ikm) == expected


@pytest.mark.parametrize("length", [1, 31, 32, 33, 64])
def test_one_and_two_block_expand_match_cryptography(length: int) -> None:
    # One block takes the uncopied path; the shared empty-salt states must not
    # be consumed by it, so the same call twice gives the same output.
    from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

    prk = hkdf_extract(b"", b"ikm")
    ref = HKDFExpand(algorithm=hashes.SHA256(), length=length, info=b"i").derive(prk)
    assert hkdf_expand(prk, b"i", length) == ref
    assert hkdf(b"ikm", info=b"i", length=length) == ref == hkdf(b"ikm", info=b"i", length=length)
