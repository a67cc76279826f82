"""did:key identifiers for Ed25519 keys (W3C CCG did:key method, docs/DESIGN.md "Identity").

A Talos DID is ``did:key:z`` + base58btc(varint(0xed) || public key), i.e. the
multicodec ``ed25519-pub`` prefix ``0xed 0x01`` followed by the 32 raw key bytes,
the same string any did:key tool computes for that key. Only bare DIDs are
accepted: DID URLs with a path, query or fragment are refused, so one key has
exactly one spelling and string equality is identity equality.
"""

from __future__ import annotations

from collections import OrderedDict

from talos_sdk.base58 import b58decode, b58encode
from talos_sdk.errors import DIDError, EncodingError

__all__ = [
    "DID_KEY_PREFIX",
    "ED25519_MULTICODEC",
    "did_from_public_key",
    "public_key_from_did",
]

DID_KEY_PREFIX = "did:key:"
ED25519_MULTICODEC = b"\xed\x01"  # unsigned varint of 0xed (ed25519-pub)
_ED25519_CODE = 0xED
_KEY_LEN = 32
#: Longest method-specific identifier decoded: base58 decoding is quadratic in the
#: length, so a 65,000-character did:key in a record cost 0.7 s to refuse. An
#: Ed25519 did:key has 48 characters; 128 leaves room to name other key types.
_MAX_ID_CHARS = 128

# Names for codes another did:key tool may hand us, so the error says what it got.
_CODEC_NAMES = {
    0xEC: "x25519-pub",
    0xE7: "secp256k1-pub",
    0xEB: "bls12_381-g2-pub",
    0x1200: "p256-pub",
    0x1201: "p384-pub",
    0x1202: "p521-pub",
    0x1205: "rsa-pub",
}


#: The one cache of DIDs and their keys, bounded (oldest entry evicted first):
#: every DID this process encoded (a wallet's own, both ends of an in-process
#: session) and every DID it decoded (peers are verified over and over). A hit
#: skips base58 decoding, a Python loop over 48 digits, ~1/5 of an X25519 DH.
#: An OrderedDict because evicting the oldest entry of a full plain dict
#: (``del d[next(iter(d))]``) scans past the slots of earlier deletions: it
#: cost 10 us per new DID once the cache was full, two per Session.create_pair;
#: ``popitem(last=False)`` is O(1) (0.3 us).
_KEYS: OrderedDict[str, bytes] = OrderedDict()
_KEYS_MAX = 16384


def _remember(did: str, key: bytes) -> None:
    if len(_KEYS) >= _KEYS_MAX:
        _KEYS.popitem(last=False)
    _KEYS[did] = key


def did_from_public_key(public_key: bytes) -> str:
    """Return the did:key for a raw 32-byte Ed25519 public key."""
    if not isinstance(public_key, bytes | bytearray | memoryview):
        raise DIDError(f"public key must be bytes, not {type(public_key).__name__}")
    raw = bytes(public_key)
    if len(raw) != _KEY_LEN:
        raise DIDError(f"Ed25519 public key must be {_KEY_LEN} bytes, got {len(raw)}")
    did = DID_KEY_PREFIX + "z" + b58encode(ED25519_MULTICODEC + raw)
    _remember(did, raw)
    return did


def _read_varint(data: bytes) -> tuple[int, int]:
    """Decode an unsigned LEB128 varint (multiformats unsigned-varint); return (value, length)."""
    value = 0
    for i, byte in enumerate(data[:9]):  # multiformats caps varints at 9 bytes
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value, i + 1
    raise DIDError("did:key multicodec prefix is not a valid unsigned varint")


def public_key_from_did(did: str) -> bytes:
    """Parse a did:key and return its raw 32-byte Ed25519 public key.

    Cached (``_KEYS``); every malformed input raises :class:`DIDError` naming
    what was wrong (malformed DIDs are not cached).
    """
    if not isinstance(did, str):
        raise DIDError(f"DID must be a str, not {type(did).__name__}")
    known = _KEYS.get(did)
    if known is not None:
        return known
    if not did.startswith("did:"):
        raise DIDError(f"not a DID (expected 'did:key:z...'): {did[:64]!r}")
    if not did.startswith(DID_KEY_PREFIX):
        method = did[4:].split(":", 1)[0]
        raise DIDError(f"unsupported DID method {method!r} (only 'key' is supported)")
    msid = did[len(DID_KEY_PREFIX) :]
    for sep in "#?/":
        if sep in msid:
            raise DIDError(f"DID URLs are not accepted ({sep!r} found); pass the bare did:key")
    if not msid:
        raise DIDError("did:key has an empty method-specific identifier")
    if msid[0] != "z":
        raise DIDError(
            f"unsupported multibase prefix {msid[0]!r} (did:key Ed25519 uses 'z', base58btc)"
        )
    if len(msid) > _MAX_ID_CHARS:
        raise DIDError(f"did:key identifier of {len(msid)} characters (an Ed25519 did:key has 48)")
    try:
        decoded = b58decode(msid[1:])
    except EncodingError as exc:
        raise DIDError(f"did:key is not valid base58btc: {exc}") from None
    code, used = _read_varint(decoded)
    if code != _ED25519_CODE or decoded[:used] != ED25519_MULTICODEC:
        name = _CODEC_NAMES.get(code, "unknown")
        raise DIDError(
            f"unsupported multicodec 0x{code:x} ({name}); Talos DIDs are ed25519-pub (0xed)"
        )
    key = decoded[used:]
    if len(key) != _KEY_LEN:
        raise DIDError(f"did:key Ed25519 key must be {_KEY_LEN} bytes, got {len(key)}")
    _remember(did, key)
    return key
