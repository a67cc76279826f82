"""Tests for talos_sdk/binfmt.py: exact bytes out, every bad input refused by name."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from talos_sdk.binfmt import (
    ByteReader,
    pack_u8,
    pack_u16,
    pack_u32,
    pack_u64,
    pack_var8,
    pack_var16,
    pack_var32,
    utf8,
)
from talos_sdk.errors import EncodingError, MalformedFrameError


def test_integers_are_big_endian_of_fixed_width() -> None:
    assert pack_u8(0xAB) == b"\xab"
    assert pack_u16(0x0102) == b"\x01\x02"
    assert pack_u32(0x01020304) == b"\x01\x02\x03\x04"
    assert pack_u64(0x0102030405060708) == bytes(range(1, 9))
    assert pack_u64(2**64 - 1) == b"\xff" * 8


def test_length_prefixes_are_the_field_length() -> None:
    assert pack_var8(b"abc") == b"\x03abc"
    assert pack_var16(b"abc") == b"\x00\x03abc"
    assert pack_var32(b"abc") == b"\x00\x00\x00\x03abc"
    assert pack_var16(b"") == b"\x00\x00"
    assert pack_var8(b"x" * 255)[:1] == b"\xff"


@pytest.mark.parametrize(
    ("pack", "value", "bits"),
    [(pack_u8, 256, 8), (pack_u16, 1 << 16, 16), (pack_u32, 1 << 32, 32), (pack_u64, 1 << 64, 64)],
)
def test_integer_too_large_is_encoding_error(
    pack: Callable[[int], bytes], value: int, bits: int
) -> None:
    with pytest.raises(EncodingError, match=f"does not fit an unsigned {bits}-bit field"):
        pack(value)


def test_negative_integer_is_encoding_error() -> None:
    with pytest.raises(EncodingError, match="does not fit"):
        pack_u32(-1)


def test_field_too_long_for_its_prefix_is_encoding_error() -> None:
    with pytest.raises(EncodingError, match="256 bytes longer than a u8 length"):
        pack_var8(b"x" * 256)
    with pytest.raises(EncodingError, match="65536 bytes longer than a u16 length"):
        pack_var16(b"x" * 65536)


def test_reader_reads_back_a_mixed_layout() -> None:
    data = b"".join(
        (
            pack_u8(7),
            pack_u16(513),
            pack_u32(70000),
            pack_u64(2**40),
            pack_var8(b"k"),
            pack_var16("dïd".encode()),
            pack_var32(b"payload"),
            b"tail",
        )
    )
    r = ByteReader(data, "thing")
    assert (r.u8(), r.u16(), r.u32(), r.u64()) == (7, 513, 70000, 2**40)
    assert r.var8() == b"k"
    assert r.text16() == "dïd"
    assert r.var32() == b"payload"
    assert r.remaining == 4
    assert r.rest() == b"tail"
    r.end()


@given(st.lists(st.binary(max_size=300), max_size=6))
def test_var_fields_round_trip(fields: list[bytes]) -> None:
    data = b"".join(pack_var16(f) + pack_var32(f) for f in fields)
    r = ByteReader(data, "fields")
    for f in fields:
        assert r.var16() == f
        assert r.var32() == f
    r.end()


@pytest.mark.parametrize(
    ("data", "read"),
    [
        (b"", ByteReader.u8),
        (b"\x01", ByteReader.u16),
        (b"\x00\x00\x01", ByteReader.u32),
        (b"\x00" * 7, ByteReader.u64),
        (b"\x05abcd", ByteReader.var8),  # length says 5, 4 bytes follow
        (b"\x00\x03ab", ByteReader.var16),
        (b"\x00\x00\x00\x09abc", ByteReader.var32),
        (b"\x00", ByteReader.var16),  # the length itself cut short
    ],
)
def test_truncated_input_is_malformed_and_named(
    data: bytes, read: Callable[[ByteReader], object]
) -> None:
    with pytest.raises(MalformedFrameError, match=r"^thing: truncated$"):
        read(ByteReader(data, "thing"))


def test_overlong_input_is_refused_by_end() -> None:
    r = ByteReader(pack_var16(b"ab") + b"xyz", "thing")
    assert r.var16() == b"ab"
    with pytest.raises(MalformedFrameError, match="thing: 3 trailing bytes"):
        r.end()


def test_text_that_is_not_utf8_is_malformed() -> None:
    with pytest.raises(MalformedFrameError, match="thing: text field is not UTF-8"):
        ByteReader(pack_var16(b"\xff\xfe"), "thing").text16()
    with pytest.raises(MalformedFrameError, match="record sender is not UTF-8"):
        utf8(b"\xc3", "record sender")
    assert utf8("é".encode(), "x") == "é"


def test_reader_refuses_non_bytes() -> None:
    with pytest.raises(MalformedFrameError, match="thing: expected bytes, got str"):
        ByteReader("abc", "thing")  # type: ignore[arg-type]


def test_reader_accepts_bytearray_and_memoryview_without_aliasing() -> None:
    buf = bytearray(b"\x00\x02hi")
    r = ByteReader(memoryview(buf), "thing")
    buf[2:4] = b"XX"  # the reader took a copy: later writes do not leak in
    assert r.var16() == b"hi"
