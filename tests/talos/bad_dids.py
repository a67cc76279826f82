"""Malformed DIDs for the places a person types one, each with what its error must say."""

from __future__ import annotations

from talos_sdk.base58 import b58encode

_KEY = bytes(range(1, 33))

#: (DID, a phrase of the error naming what is wrong)
BAD_DIDS: list[tuple[str, str]] = [
    ("did:key:z6MkTYPO", "invalid base58 character 'O'"),  # the typo a newcomer makes
    ("did:key:z" + b58encode(b"\xed\x01" + _KEY[:31]), "must be 32 bytes, got 31"),
    ("did:key:z" + b58encode(b"\xed\x01" + _KEY + b"\x00"), "must be 32 bytes, got 33"),
    ("did:key:z" + b58encode(b"\xec\x01" + _KEY), "0xec (x25519-pub)"),
    ("did:key:" + "m" + "7QEB", "multibase prefix 'm'"),
    ("did:web:example.com", "unsupported DID method 'web'"),
    ("did:key:", "empty method-specific identifier"),
    ("did:key:z" + b58encode(b"\xed\x01" + _KEY) + "#frag", "DID URLs are not accepted"),
]
