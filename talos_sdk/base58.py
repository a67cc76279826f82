"""base58btc encoding with the Bitcoin alphabet (draft-msporny-base58, multibase ``z``).

Used by did:key (DESIGN.md "Identity"). Leading zero bytes map one-to-one to
leading ``1`` characters, so the encoding is a bijection on byte strings.
"""

from __future__ import annotations

from talos_sdk.errors import EncodingError

__all__ = ["ALPHABET", "b58decode", "b58encode"]

ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_INDEX: dict[str, int] = {c: i for i, c in enumerate(ALPHABET)}


def b58encode(data: bytes) -> str:
    """Encode ``data`` as base58btc text."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise EncodingError(f"base58 input must be bytes, not {type(data).__name__}")
    raw = bytes(data)
    stripped = raw.lstrip(b"\x00")
    zeros = len(raw) - len(stripped)
    # Python ints do the big-number division in C, far faster than a byte loop.
    n = int.from_bytes(stripped, "big")
    out: list[str] = []
    while n:
        n, rem = divmod(n, 58)
        out.append(ALPHABET[rem])
    return "1" * zeros + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    """Decode base58btc ``text``; any character outside the alphabet is an EncodingError."""
    if not isinstance(text, str):
        raise EncodingError(f"base58 input must be str, not {type(text).__name__}")
    n = 0
    for pos, ch in enumerate(text):
        digit = _INDEX.get(ch)
        if digit is None:
            raise EncodingError(f"invalid base58 character {ch!r} at position {pos}")
        n = n * 58 + digit
    zeros = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\x00" * zeros + body
