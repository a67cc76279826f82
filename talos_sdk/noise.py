"""The Noise Protocol Framework, revision 34, sans-I/O (docs/adr/0011-noise-link-channel.md).

Suite ``25519_ChaChaPoly_SHA256`` (Noise spec sections 12.1, 12.3, 12.5) on
``cryptography`` primitives; patterns NN, XX and IK (section 7.5), plus the
hybrid-forward-secrecy modifier ``hfs`` (the Noise HFS extension's ``e1`` and
``ekem1`` tokens) with ML-KEM-768 (FIPS 203) as the KEM, which names the
protocol ``Noise_XXhfs_25519+MLKEM768_ChaChaPoly_SHA256``.

The objects are the spec's own: :class:`CipherState` (section 5.1),
:class:`SymmetricState` (5.2) and :class:`HandshakeState` (5.3). Nothing here
touches a socket or the clock; ephemeral keys come from the ``random``
callable the caller hands in (``os.urandom`` by default), so published test
vectors reproduce byte for byte. Every failed decryption raises the one opaque
:class:`~talos_sdk.errors.DecryptionError`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Callable
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.mlkem import MLKEM768PrivateKey, MLKEM768PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from talos_sdk.errors import DecryptionError, MalformedFrameError, UsageError

__all__ = [
    "DHLEN",
    "HASHLEN",
    "MAX_MESSAGE",
    "PATTERNS",
    "TAGLEN",
    "CipherState",
    "HandshakeState",
    "SymmetricState",
    "protocol_name",
]

DHLEN: Final = 32
HASHLEN: Final = 32
TAGLEN: Final = 16
#: Noise messages are at most 65535 bytes (spec section 3).
MAX_MESSAGE: Final = 65535
#: 2^64 - 1 is reserved for Rekey (section 5.1).
_MAX_NONCE: Final = (1 << 64) - 1
_KEM_PUBLIC: Final = 1184
_KEM_CIPHERTEXT: Final = 1088
_NONCE = struct.Struct("<4xQ")

Random = Callable[[int], bytes]

PATTERNS: Final[
    dict[str, tuple[tuple[tuple[str, ...], tuple[str, ...]], tuple[tuple[str, ...], ...]]]
] = {
    "NN": (((), ()), (("e",), ("e", "ee"))),
    "XX": (((), ()), (("e",), ("e", "ee", "s", "es"), ("s", "se"))),
    "IK": (((), ("s",)), (("e", "es", "s", "ss"), ("e", "ee", "se"))),
    "XXhfs": (
        ((), ()),
        (("e", "e1"), ("e", "ee", "ekem1", "s", "es"), ("s", "se")),
    ),
}


def protocol_name(pattern: str) -> bytes:
    """The full protocol name hashed into ``h`` (section 8)."""
    dh = "25519+MLKEM768" if pattern.endswith("hfs") else "25519"
    return f"Noise_{pattern}_{dh}_ChaChaPoly_SHA256".encode()


def _hkdf(ck: bytes, ikm: bytes, outputs: int) -> tuple[bytes, ...]:
    # Noise's HKDF (section 4.3): HMAC-SHA256 chain without info.
    temp = hmac.digest(ck, ikm, "sha256")
    out1 = hmac.digest(temp, b"\x01", "sha256")
    out2 = hmac.digest(temp, out1 + b"\x02", "sha256")
    if outputs == 2:
        return out1, out2
    return out1, out2, hmac.digest(temp, out2 + b"\x03", "sha256")


def _dh(private: X25519PrivateKey, public: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:
        # A low-order point gives an all-zero secret, which cryptography refuses.
        raise DecryptionError() from None


class CipherState:
    """``k`` and ``n`` (section 5.1): ChaCha20-Poly1305 with a 64-bit counter nonce."""

    __slots__ = ("_aead", "k", "n")

    def __init__(self, k: bytes | None = None) -> None:
        self.k: bytes | None = None
        self.n = 0
        self._aead: ChaCha20Poly1305 | None = None
        if k is not None:
            self.initialize_key(k)

    def initialize_key(self, k: bytes | None) -> None:
        self.k = k
        self.n = 0
        self._aead = ChaCha20Poly1305(k) if k is not None else None

    def has_key(self) -> bool:
        return self.k is not None

    def set_nonce(self, n: int) -> None:
        self.n = n

    def encrypt_with_ad(self, ad: bytes, plaintext: bytes) -> bytes:
        aead = self._aead
        if aead is None:
            return plaintext
        n = self.n
        if n >= _MAX_NONCE:
            raise UsageError("Noise nonce exhausted; rekey or start a new handshake")
        out = aead.encrypt(_NONCE.pack(n), plaintext, ad or None)
        self.n = n + 1
        return out

    def decrypt_with_ad(self, ad: bytes, ciphertext: bytes) -> bytes:
        aead = self._aead
        if aead is None:
            return ciphertext
        n = self.n
        if n >= _MAX_NONCE:
            raise DecryptionError()
        try:
            out = aead.decrypt(_NONCE.pack(n), ciphertext, ad or None)
        except InvalidTag:
            raise DecryptionError() from None
        self.n = n + 1  # only a successful decryption advances (section 5.1)
        return out

    def rekey(self) -> None:
        """``k = REKEY(k)`` (sections 4.2, 11.3); ``n`` is left as it is."""
        if self._aead is None:
            raise UsageError("rekey without a key")
        k = self._aead.encrypt(_NONCE.pack(_MAX_NONCE), bytes(32), None)[:32]
        self.k = k
        self._aead = ChaCha20Poly1305(k)


class SymmetricState:
    """``ck``, ``h`` and a CipherState (section 5.2)."""

    __slots__ = ("ck", "cs", "h")

    def __init__(self, name: bytes) -> None:
        self.h = name.ljust(HASHLEN, b"\x00") if len(name) <= HASHLEN else _sha256(name)
        self.ck = self.h
        self.cs = CipherState()

    def mix_key(self, ikm: bytes) -> None:
        self.ck, temp_k = _hkdf(self.ck, ikm, 2)
        self.cs.initialize_key(temp_k)

    def mix_hash(self, data: bytes) -> None:
        self.h = _sha256(self.h + data)

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ciphertext = self.cs.encrypt_with_ad(self.h, plaintext)
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        plaintext = self.cs.decrypt_with_ad(self.h, ciphertext)
        self.mix_hash(ciphertext)
        return plaintext

    def split(self) -> tuple[CipherState, CipherState]:
        k1, k2 = _hkdf(self.ck, b"", 2)
        return CipherState(k1), CipherState(k2)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class HandshakeState:
    """One side of a Noise handshake (section 5.3): messages in, messages out.

    ``s`` / ``e`` are raw 32-byte X25519 private keys (``e`` only for test
    vectors; normally generated from ``random``), ``rs`` the peer's static
    public key for patterns that pre-know it (IK). After the last message,
    :meth:`split` gives ``(send, receive)`` CipherStates for this side and
    :attr:`handshake_hash` the channel-binding value (section 11.2).
    ``payload_hash`` is ``h`` just before the latest payload was encrypted or
    decrypted: a signature over it binds an identity to this very handshake.
    """

    def __init__(
        self,
        pattern: str,
        initiator: bool,
        *,
        prologue: bytes = b"",
        s: bytes | None = None,
        e: bytes | None = None,
        rs: bytes | None = None,
        random: Random = os.urandom,
    ) -> None:
        if pattern not in PATTERNS:
            raise UsageError(f"unsupported Noise pattern {pattern!r}")
        (pre_i, pre_r), self._messages = PATTERNS[pattern]
        self.initiator = initiator
        self._random = random
        self._ss = SymmetricState(protocol_name(pattern))
        self._ss.mix_hash(prologue)
        self._s = X25519PrivateKey.from_private_bytes(s) if s is not None else None
        self._e = X25519PrivateKey.from_private_bytes(e) if e is not None else None
        self._e1: MLKEM768PrivateKey | None = None
        self.rs = rs
        self.re: bytes | None = None
        self._re1: bytes | None = None
        self._index = 0
        self.payload_hash = b""
        for token in pre_i:  # section 7.1: pre-message public keys hash in, initiator's first
            self._ss.mix_hash(self._public(self._s) if initiator else self._need(rs, token))
        for token in pre_r:
            self._ss.mix_hash(self._need(rs, token) if initiator else self._public(self._s))

    @staticmethod
    def _need(key: bytes | None, token: str) -> bytes:
        if key is None:
            raise UsageError(f"pattern needs the peer's pre-message key {token!r}")
        return key

    @staticmethod
    def _public(key: X25519PrivateKey | None) -> bytes:
        if key is None:
            raise UsageError("pattern needs a local static key")
        return key.public_key().public_bytes_raw()

    @property
    def finished(self) -> bool:
        return self._index >= len(self._messages)

    @property
    def writes_next(self) -> bool:
        """True when the next message of the pattern is ours to write."""
        return (self._index % 2 == 0) == self.initiator

    @property
    def handshake_hash(self) -> bytes:
        return self._ss.h

    def _dh_token(self, token: str) -> bytes:
        # "es": initiator's ephemeral with responder's static, and so on (section 7.1).
        mine, theirs = (token[0], token[1]) if self.initiator else (token[1], token[0])
        private = self._e if mine == "e" else self._s
        public = self.re if theirs == "e" else self.rs
        if private is None or public is None:
            raise UsageError(f"token {token!r} before both keys are known")
        return _dh(private, public)

    def write_message(
        self, payload: bytes = b"", *, payload_for: Callable[[bytes], bytes] | None = None
    ) -> bytes:
        """The next handshake message; ``payload_for(h)`` builds a payload bound to ``h``."""
        if self.finished or not self.writes_next:
            raise UsageError("not our turn to write a handshake message")
        ss = self._ss
        out: list[bytes] = []
        for token in self._messages[self._index]:
            if token == "e":
                if self._e is None:
                    self._e = X25519PrivateKey.from_private_bytes(self._random(DHLEN))
                pub = self._public(self._e)
                ss.mix_hash(pub)
                out.append(pub)
            elif token == "s":
                out.append(ss.encrypt_and_hash(self._public(self._s)))
            elif token == "e1":
                self._e1 = MLKEM768PrivateKey.from_seed_bytes(self._random(64))
                out.append(ss.encrypt_and_hash(self._e1.public_key().public_bytes_raw()))
            elif token == "ekem1":
                if self._re1 is None:
                    raise UsageError("ekem1 before the peer's e1")
                secret, kem_ct = MLKEM768PublicKey.from_public_bytes(self._re1).encapsulate()
                out.append(ss.encrypt_and_hash(kem_ct))
                ss.mix_key(secret)
            else:
                ss.mix_key(self._dh_token(token))
        self.payload_hash = ss.h
        if payload_for is not None:
            payload = payload_for(ss.h)
        out.append(ss.encrypt_and_hash(payload))
        self._index += 1
        message = b"".join(out)
        if len(message) > MAX_MESSAGE:
            raise UsageError("Noise handshake message above 65535 bytes")
        return message

    def read_message(self, message: bytes) -> bytes:
        """Process the peer's next message; return its payload.

        Raises :class:`MalformedFrameError` for a message too short for its
        tokens, :class:`DecryptionError` when anything fails to authenticate.
        """
        if self.finished or self.writes_next:
            raise MalformedFrameError("unexpected handshake message")
        if len(message) > MAX_MESSAGE:
            raise MalformedFrameError("Noise handshake message above 65535 bytes")
        ss = self._ss
        view = memoryview(message)
        pos = 0

        def take(n: int) -> bytes:
            nonlocal pos
            if pos + n > len(view):
                raise MalformedFrameError("handshake message too short")
            chunk = bytes(view[pos : pos + n])
            pos += n
            return chunk

        tag = TAGLEN if ss.cs.has_key() else 0
        for token in self._messages[self._index]:
            if token == "e":
                self.re = take(DHLEN)
                ss.mix_hash(self.re)
            elif token == "s":
                self.rs = ss.decrypt_and_hash(take(DHLEN + (TAGLEN if ss.cs.has_key() else 0)))
            elif token == "e1":
                extra = TAGLEN if ss.cs.has_key() else 0
                self._re1 = ss.decrypt_and_hash(take(_KEM_PUBLIC + extra))
                try:
                    MLKEM768PublicKey.from_public_bytes(self._re1)
                except ValueError:
                    raise MalformedFrameError("bad ML-KEM-768 public key") from None
            elif token == "ekem1":
                if self._e1 is None:
                    raise UsageError("ekem1 without our e1")
                extra = TAGLEN if ss.cs.has_key() else 0
                kem_ct = ss.decrypt_and_hash(take(_KEM_CIPHERTEXT + extra))
                ss.mix_key(self._e1.decapsulate(kem_ct))
            else:
                ss.mix_key(self._dh_token(token))
            tag = TAGLEN if ss.cs.has_key() else 0
        rest = bytes(view[pos:])
        if len(rest) < tag:
            raise MalformedFrameError("handshake message too short")
        self.payload_hash = ss.h
        payload = ss.decrypt_and_hash(rest)
        self._index += 1
        return payload

    def split(self) -> tuple[CipherState, CipherState]:
        """``(send, receive)`` transport CipherStates for this side (section 5.2 Split)."""
        if not self.finished:
            raise UsageError("handshake not finished")
        c1, c2 = self._ss.split()
        return (c1, c2) if self.initiator else (c2, c1)
