"""Tests for talos_sdk.base58 (draft-msporny-base58 examples + round trips)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from talos_sdk.base58 import ALPHABET, b58decode, b58encode
from talos_sdk.errors import EncodingError

# Examples from draft-msporny-base58-03 section 5 and the Bitcoin reference tests.
CASES = [
    (b"", ""),
    (b"Hello World!", "2NEpo7TZRRrLZSi2U"),
    (
        b"The quick brown fox jumps over the lazy dog.",
        "USm3fpXnKG5EUBx2ndxBDMPVciP5hGey2Jh4NDv6gmeo1LkMeiKrLJUUBk6Z",
    ),
    (bytes.fromhex("0000287fb4cd"), "11233QC4"),
    (b"\x00", "1"),
    (b"\x00\x00\x00", "111"),
    (bytes.fromhex("61"), "2g"),
    (bytes.fromhex("626262"), "a3gV"),
    (bytes.fromhex("636363"), "aPEr"),
    (
        bytes.fromhex("00eb15231dfceb60925886b67d065299925915aeb172c06647"),
        "1NS17iag9jJgTHD1VXjvLCEnZuQ3rJDE9L",
    ),
]


@pytest.mark.parametrize(("raw", "text"), CASES)
def test_known_values(raw: bytes, text: str) -> None:
    assert b58encode(raw) == text
    assert b58decode(text) == raw


@given(st.binary(max_size=80))
def test_round_trip(data: bytes) -> None:
    assert b58decode(b58encode(data)) == data


@pytest.mark.parametrize("bad", ["0", "O", "I", "l", "abc+", "z z", "é"])
def test_bad_characters(bad: str) -> None:
    with pytest.raises(EncodingError, match="invalid base58 character"):
        b58decode(bad)


def test_wrong_types() -> None:
    with pytest.raises(EncodingError, match="must be str"):
        b58decode(b"abc")  # type: ignore[arg-type]
    with pytest.raises(EncodingError, match="must be bytes"):
        b58encode("abc")  # type: ignore[arg-type]


def _reference_encode(data: bytes) -> str:
    """Textbook base58 (one digit per division), to check the table-driven encoder."""
    n = int.from_bytes(data, "big")
    out = ""
    while n:
        n, rem = divmod(n, 58)
        out = ALPHABET[rem] + out
    return "1" * (len(data) - len(data.lstrip(b"\x00"))) + out


@given(st.integers(0, 4), st.binary(max_size=60))
def test_matches_the_textbook_algorithm(zeros: int, data: bytes) -> None:
    raw = bytes(zeros) + data
    assert b58encode(raw) == _reference_encode(raw)
    assert b58decode(_reference_encode(raw)) == raw


@pytest.mark.parametrize(
    ("bad", "where"), [("z0", "'0' at position 1"), ("abé1", "'é' at position 2")]
)
def test_bad_character_position(bad: str, where: str) -> None:
    with pytest.raises(EncodingError, match=where):
        b58decode(bad)
