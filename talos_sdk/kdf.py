"""HKDF-SHA256 (RFC 5869) and the Double Ratchet chain step KDF_CK (Signal DR §5.2).

HMAC-SHA256 (RFC 2104) is computed from precomputed inner/outer SHA-256 states
(CPython's built-in SHA-256, copied per use): the ``cryptography`` HKDF class and
even ``hmac.digest`` cost more per call in setup than the hashing itself, and the
ratchet pays this on every message (docs/DESIGN.md "Performance targets",
row Session.encrypt).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

__all__ = [
    "HASH_LEN",
    "hkdf",
    "hkdf_expand",
    "hkdf_extract",
    "kdf_ck",
]

try:  # CPython's built-in SHA-256: no OpenSSL EVP fetch per object, ~3x cheaper to create
    from _sha256 import sha256 as _sha256  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover - Python >= 3.12 names it _sha2
    try:
        from _sha2 import sha256 as _sha256  # type: ignore[import-not-found,no-redef,unused-ignore]
    except ImportError:
        _sha256 = hashlib.sha256

_new_sha256: Callable[[bytes], Any] = _sha256
_IPAD = bytes.maketrans(bytes(range(256)), bytes(b ^ 0x36 for b in range(256)))
_OPAD = bytes.maketrans(bytes(range(256)), bytes(b ^ 0x5C for b in range(256)))
_IPAD_TAIL = b"\x36" * 32
_OPAD_TAIL = b"\x5c" * 32

HASH_LEN = 32
_BLOCK = 64  # SHA-256 block size
_ZERO_SALT = bytes(HASH_LEN)


def kdf_ck(
    ck: bytes,
    _sha: Callable[[bytes], Any] = _new_sha256,
    _ip: bytes = _IPAD,
    _op: bytes = _OPAD,
    _it: bytes = _IPAD_TAIL,
    _ot: bytes = _OPAD_TAIL,
) -> tuple[bytes, bytes]:
    """Double Ratchet KDF_CK on a 32-byte chain key (Signal DR §5.2): returns
    ``(mk, ck')`` = ``(HMAC(ck, 0x01), HMAC(ck, 0x02))``.

    The per-message hot path: both HMACs share one key schedule (the padded-key
    states are hashed once and copied) and the constants are bound as locals.
    """
    inner = _sha(ck.translate(_ip) + _it)
    outer = _sha(ck.translate(_op) + _ot)
    i1 = inner.copy()
    i1.update(b"\x01")
    o1 = outer.copy()
    o1.update(i1.digest())
    inner.update(b"\x02")
    outer.update(inner.digest())
    return o1.digest(), outer.digest()


def _hmac_states(key: bytes) -> tuple[Any, Any]:
    """RFC 2104 inner and outer hash states after the padded key, ready to copy."""
    if len(key) == HASH_LEN:  # every PRK, root key and salt here: pad with constants
        return _new_sha256(key.translate(_IPAD) + _IPAD_TAIL), _new_sha256(
            key.translate(_OPAD) + _OPAD_TAIL
        )
    if len(key) > _BLOCK:
        key = _new_sha256(key).digest()
    block = key + bytes(_BLOCK - len(key))
    return _new_sha256(block.translate(_IPAD)), _new_sha256(block.translate(_OPAD))


# The empty salt's key schedule, made once: X3DH extracts with it.
_ZERO_SALT_STATES = _hmac_states(_ZERO_SALT)


def hkdf_extract(salt: bytes, ikm: bytes) -> bytes:
    """HKDF-Extract (RFC 5869 §2.2); an empty salt means HashLen zero bytes."""
    if salt:
        inner, outer = _hmac_states(salt)
    else:
        inner, outer = _ZERO_SALT_STATES[0].copy(), _ZERO_SALT_STATES[1].copy()
    inner.update(ikm)
    outer.update(inner.digest())
    prk: bytes = outer.digest()
    return prk


def hkdf_expand(prk: bytes, info: bytes, length: int) -> bytes:
    """HKDF-Expand (RFC 5869 §2.3) to ``length`` bytes (at most 255 * 32).

    One key schedule for all blocks (copied per block): session setup runs
    several of these, so OpenSSL's per-call HMAC setup was a visible cost. A
    one-block output (X3DH's 32 bytes) uses the states without copying; with
    the empty salt's precomputed states that took X3DH's HKDF from 4.9 to
    3.0 us (KDF_RK, 64 bytes: 6.0 to 5.6 us).
    """
    if not 0 < length <= 255 * HASH_LEN:
        raise ValueError(f"HKDF-SHA256 output length must be 1..{255 * HASH_LEN}")
    inner, outer = _hmac_states(prk)
    if length <= HASH_LEN:
        inner.update(info + b"\x01")
        outer.update(inner.digest())
        first: bytes = outer.digest()
        return first[:length]
    out = []
    block = b""
    for counter in range(1, -(-length // HASH_LEN) + 1):
        i = inner.copy()
        i.update(block + info + bytes((counter,)))
        o = outer.copy()
        o.update(i.digest())
        block = o.digest()
        out.append(block)
    return b"".join(out)[:length]


def hkdf(ikm: bytes, *, salt: bytes = b"", info: bytes, length: int = HASH_LEN) -> bytes:
    """HKDF-SHA256: Extract then Expand (RFC 5869 §2)."""
    return hkdf_expand(hkdf_extract(salt, ikm), info, length)
