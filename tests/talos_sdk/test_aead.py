"""Stream sealer: round trips, ordering, truncation, tampering (talos_sdk/aead.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from talos_sdk.aead import (
    CHUNK_HEADER_SIZE,
    TAG_SIZE,
    StreamOpener,
    StreamSealer,
    derive_stream_key,
)
from talos_sdk.errors import DecryptionError, UsageError

KEY = derive_stream_key(bytes(range(32)), b"file:1")


def pair(stream_id: bytes = b"s1") -> tuple[StreamSealer, StreamOpener]:
    return StreamSealer(KEY, stream_id), StreamOpener(KEY, stream_id)


@given(chunks=st.lists(st.binary(max_size=300), min_size=1, max_size=20))
def test_round_trip_in_order(chunks: list[bytes]) -> None:
    sealer, opener = pair()
    sealed = [sealer.seal(c, final=i == len(chunks) - 1) for i, c in enumerate(chunks)]
    assert [opener.open(s) for s in sealed] == chunks
    assert opener.finished and sealer.finished
    assert all(
        len(s) == len(c) + CHUNK_HEADER_SIZE + TAG_SIZE for s, c in zip(sealed, chunks, strict=True)
    )


def test_replay_and_reorder_rejected() -> None:
    sealer, opener = pair()
    a, b = sealer.seal(b"a"), sealer.seal(b"b")
    with pytest.raises(DecryptionError):
        opener.open(b)
    assert opener.open(a) == b"a"
    with pytest.raises(DecryptionError):
        opener.open(a)
    assert opener.open(b) == b"b"


def test_final_flag_is_authenticated() -> None:
    sealer, opener = pair()
    last = bytearray(sealer.seal(b"end", final=True))
    last[8] = 0  # attacker clears the final bit to hide a truncation point
    with pytest.raises(DecryptionError):
        opener.open(bytes(last))


def test_nothing_after_final() -> None:
    sealer, opener = pair()
    opener.open(sealer.seal(b"x", final=True))
    with pytest.raises(UsageError, match="finished"):
        sealer.seal(b"y")
    other = StreamSealer(KEY, b"s1")
    other.seal(b"x")
    with pytest.raises(DecryptionError):
        opener.open(other.seal(b"y"))


@pytest.mark.parametrize("where", [0, 8, CHUNK_HEADER_SIZE, -1])
def test_tampered_chunk(where: int) -> None:
    sealer, opener = pair()
    sealed = bytearray(sealer.seal(b"payload"))
    sealed[where] ^= 0x01
    with pytest.raises(DecryptionError):
        opener.open(bytes(sealed))
    assert opener.counter == 0


def test_truncated_and_unknown_flags() -> None:
    sealer, opener = pair()
    sealed = sealer.seal(b"")
    with pytest.raises(DecryptionError):
        opener.open(sealed[:-1])
    with pytest.raises(DecryptionError):
        opener.open(sealed[:8] + b"\x02" + sealed[9:])


def test_other_stream_or_key_rejected() -> None:
    sealed = StreamSealer(KEY, b"s1").seal(b"data")
    with pytest.raises(DecryptionError):
        StreamOpener(KEY, b"s2").open(sealed)
    with pytest.raises(DecryptionError):
        StreamOpener(derive_stream_key(bytes(32), b"file:1"), b"s1").open(sealed)


def test_derive_stream_key_separates_labels() -> None:
    secret = bytes(range(32))
    assert derive_stream_key(secret, b"a") != derive_stream_key(secret, b"b")
    assert len(derive_stream_key(secret, b"a")) == 32


def test_bad_arguments() -> None:
    with pytest.raises(UsageError, match="32 bytes"):
        StreamSealer(b"short", b"s")
    with pytest.raises(UsageError, match="stream_id"):
        StreamOpener(KEY, "s")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="at least 16"):
        derive_stream_key(b"tiny", b"x")


@given(chunks=st.lists(st.binary(max_size=200), min_size=1, max_size=10))
def test_into_variants_match_and_interoperate(chunks: list[bytes]) -> None:
    sealer, opener = pair()
    ref_sealer = StreamSealer(KEY, b"s1")
    out = bytearray(256)
    plain = bytearray(256)
    for i, chunk in enumerate(chunks):
        final = i == len(chunks) - 1
        n = sealer.seal_into(chunk, out, final=final)
        assert bytes(out[:n]) == ref_sealer.seal(chunk, final=final)
        m = opener.open_into(memoryview(out)[:n], plain)
        assert bytes(plain[:m]) == chunk
    assert opener.finished


def test_into_errors_leave_position() -> None:
    sealer, opener = pair()
    with pytest.raises(UsageError, match="smaller than"):
        sealer.seal_into(b"x" * 10, bytearray(20))
    assert sealer.counter == 0
    sealed = bytearray(sealer.seal(b"x" * 10))
    with pytest.raises(UsageError, match="smaller than"):
        opener.open_into(bytes(sealed), bytearray(5))
    sealed[-1] ^= 1
    with pytest.raises(DecryptionError):
        opener.open_into(bytes(sealed), bytearray(10))
    with pytest.raises(DecryptionError):
        opener.open_into(b"short", bytearray(10))
    assert opener.counter == 0
    sealed[-1] ^= 1
    assert opener.open_into(bytes(sealed), bytearray(10)) == 10


def test_large_chunks_through_the_scratch_buffer_match_the_layout() -> None:
    # 1 MiB, then a smaller large chunk (the kept buffer is longer than needed),
    # then a small one: every output is exactly header || ChaCha20-Poly1305(...)
    # computed here independently, and a finished stream refuses more.
    import hashlib
    import struct

    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    sealer, opener = pair(b"big")
    aead = ChaCha20Poly1305(KEY)
    prefix = hashlib.sha256(b"big").digest()[:4]
    chunks = [bytes(range(256)) * 4096, b"\x07" * (200 * 1024 + 3), b"tail"]
    for counter, chunk in enumerate(chunks):
        final = counter == len(chunks) - 1
        header = struct.pack(">QB", counter, int(final))
        sealed = sealer.seal(chunk, final=final)
        assert type(sealed) is bytes
        assert sealed == header + aead.encrypt(prefix + header[:8], chunk, b"big" + header)
        assert opener.open(sealed) == chunk
    assert opener.finished
    with pytest.raises(UsageError, match="finished"):
        sealer.seal(chunks[0])


def test_small_chunks_match_libsodium() -> None:
    # The per-chunk fast path (nonce packed in one call) checked against an
    # independent ChaCha20-Poly1305: libsodium's IETF construction (RFC 8439).
    import hashlib
    import struct

    from nacl.bindings import crypto_aead_chacha20poly1305_ietf_encrypt

    sealer, opener = pair(b"small")
    prefix = hashlib.sha256(b"small").digest()[:4]
    chunks = [b"", b"x" * 35, bytes(range(200)), b"last"]
    for counter, chunk in enumerate(chunks):
        final = counter == len(chunks) - 1
        header = struct.pack(">QB", counter, int(final))
        nonce = prefix + counter.to_bytes(8, "big")
        expected = crypto_aead_chacha20poly1305_ietf_encrypt(chunk, b"small" + header, nonce, KEY)
        sealed = sealer.seal(chunk, final=final)
        assert sealed == header + expected
        assert opener.open(sealed) == chunk
