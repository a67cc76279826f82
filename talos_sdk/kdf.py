"""HKDF-SHA256 (RFC 5869) and HMAC-SHA256 (RFC 2104) on ``hmac.digest``.

``hmac.digest`` is one C call into OpenSSL; the ``cryptography`` HKDF class
costs several microseconds of object setup per call, which the Double Ratchet
pays on every message (DESIGN.md "Performance targets", Session.encrypt).
"""

from __future__ import annotations

import hmac

__all__ = ["HASH_LEN", "hkdf", "hkdf_expand", "hkdf_extract", "hmac_sha256"]

HASH_LEN = 32
_ZERO_SALT = bytes(HASH_LEN)


def hmac_sha256(key: bytes, data: bytes) -> bytes:
    """HMAC-SHA256(key, data) (RFC 2104)."""
    return hmac.digest(key, data, "sha256")


def hkdf_extract(salt: bytes, ikm: bytes) -> bytes:
    """HKDF-Extract (RFC 5869 §2.2); an empty salt means HashLen zero bytes."""
    return hmac.digest(salt or _ZERO_SALT, ikm, "sha256")


def hkdf_expand(prk: bytes, info: bytes, length: int) -> bytes:
    """HKDF-Expand (RFC 5869 §2.3) to ``length`` bytes (at most 255 * 32)."""
    if not 0 < length <= 255 * HASH_LEN:
        raise ValueError(f"HKDF-SHA256 output length must be 1..{255 * HASH_LEN}")
    block = hmac.digest(prk, info + b"\x01", "sha256")
    if length <= HASH_LEN:
        return block[:length]
    out = [block]
    counter = 1
    while counter * HASH_LEN < length:
        counter += 1
        block = hmac.digest(prk, block + info + bytes((counter,)), "sha256")
        out.append(block)
    return b"".join(out)[:length]


def hkdf(ikm: bytes, *, salt: bytes = b"", info: bytes, length: int = HASH_LEN) -> bytes:
    """HKDF-SHA256: Extract then Expand (RFC 5869 §2)."""
    return hkdf_expand(hkdf_extract(salt, ikm), info, length)
