"""base58btc encoding with the Bitcoin alphabet (draft-msporny-base58, multibase ``z``).

Used by did:key (docs/DESIGN.md "Identity"). Leading zero bytes map one-to-one to
leading ``1`` characters, so the encoding is a bijection on byte strings.
"""

from __future__ import annotations

from talos_sdk.errors import EncodingError

__all__ = ["ALPHABET", "b58decode", "b58encode"]

ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_INVALID = 0xFF
# Every did:key goes through here on both ends of a session setup: two digits per
# big-number division (a 3364-entry table) and one C-level translate() to map
# characters to digits halve the per-call Python work.
_PAIRS: tuple[str, ...] = tuple(a + b for a in ALPHABET for b in ALPHABET)
_BASE2 = 58 * 58
_DIGITS = bytes(ALPHABET.index(ch) if ch in ALPHABET else _INVALID for ch in map(chr, range(256)))


def b58encode(data: bytes) -> str:
    """Encode ``data`` as base58btc text."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise EncodingError(f"base58 input must be bytes, not {type(data).__name__}")
    raw = bytes(data)
    n = int.from_bytes(raw, "big")
    pairs = _PAIRS
    out: list[str] = []
    while n:
        n, rem = divmod(n, _BASE2)
        out.append(pairs[rem])
    # The top pair may start with a "1" (digit 0) that is padding, not a zero byte.
    body = "".join(reversed(out)).lstrip("1")
    return "1" * (len(raw) - len(raw.lstrip(b"\x00"))) + body


def _bad_character(text: str) -> EncodingError:
    pos, ch = next((i, c) for i, c in enumerate(text) if c not in ALPHABET)
    return EncodingError(f"invalid base58 character {ch!r} at position {pos}")


def b58decode(text: str) -> bytes:
    """Decode base58btc ``text``; any character outside the alphabet is an EncodingError."""
    if not isinstance(text, str):
        raise EncodingError(f"base58 input must be str, not {type(text).__name__}")
    if not text.isascii():
        raise _bad_character(text)
    digits = text.encode("ascii").translate(_DIGITS)
    if _INVALID in digits:
        raise _bad_character(text)
    n = 0
    for d in digits:
        n = n * 58 + d
    zeros = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\x00" * zeros + body
