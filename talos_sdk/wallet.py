"""The node's identity: an Ed25519 signing key and its did:key (DESIGN.md "Identity").

Signatures are plain 64-byte Ed25519 (RFC 8032) made with libsodium through
pynacl, which measured faster here than OpenSSL for both sign and verify. The
expanded secret key and public key are derived once at construction so a call
to :meth:`Wallet.sign` is one libsodium call and a slice.

Key files (persistence) live in :mod:`talos_sdk.keyfile`; ``save``/``load`` here
are thin wrappers so the common case stays one call.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from nacl.bindings import crypto_sign, crypto_sign_open, crypto_sign_seed_keypair
from nacl.exceptions import BadSignatureError

from talos_sdk.did import did_from_public_key, public_key_from_did
from talos_sdk.errors import UsageError

__all__ = ["SEED_SIZE", "SIGNATURE_SIZE", "Wallet", "verify", "verify_with_public_key"]

SEED_SIZE = 32
SIGNATURE_SIZE = 64

Rng = Callable[[int], bytes]


class Wallet:
    """An Ed25519 identity. Build with :meth:`generate`, :meth:`from_seed` or :meth:`load`.

    ``suite`` names the signature scheme; a hybrid Ed25519 + ML-DSA suite (issue 8)
    is meant to subclass this and override ``suite``, ``sign`` and ``verify``.
    """

    __slots__ = ("_did", "_public_key", "_secret_key", "_seed")
    suite: ClassVar[str] = "ed25519"

    def __init__(self, seed: bytes) -> None:
        if not isinstance(seed, bytes | bytearray | memoryview):
            raise UsageError(f"seed must be bytes, not {type(seed).__name__}")
        seed = bytes(seed)
        if len(seed) != SEED_SIZE:
            raise UsageError(f"Ed25519 seed must be {SEED_SIZE} bytes, got {len(seed)}")
        public_key, secret_key = crypto_sign_seed_keypair(seed)
        self._seed = seed
        self._public_key: bytes = public_key
        self._secret_key: bytes = secret_key  # libsodium's 64-byte seed||pk form
        self._did = did_from_public_key(public_key)

    @classmethod
    def generate(cls, rng: Rng = os.urandom) -> Wallet:
        """A fresh identity from ``rng`` (the OS CSPRNG unless a test hands one in)."""
        return cls(rng(SEED_SIZE))

    @classmethod
    def from_seed(cls, seed: bytes) -> Wallet:
        """The identity for a 32-byte Ed25519 seed (RFC 8032 private key); deterministic."""
        return cls(seed)

    @property
    def seed(self) -> bytes:
        """The 32-byte private seed, for persistence. Treat as secret."""
        return self._seed

    def private_bytes(self) -> bytes:
        """Alias of :attr:`seed`: the bytes that fully restore this wallet."""
        return self._seed

    @property
    def public_key(self) -> bytes:
        """The raw 32-byte Ed25519 public key."""
        return self._public_key

    @property
    def did(self) -> str:
        """This identity's ``did:key:z6Mk...``."""
        return self._did

    def to_did(self) -> str:
        """Same as :attr:`did`."""
        return self._did

    def sign(self, data: bytes) -> bytes:
        """Return the 64-byte Ed25519 signature of ``data``."""
        try:
            return crypto_sign(data, self._secret_key)[:SIGNATURE_SIZE]
        except TypeError:
            raise UsageError(f"data to sign must be bytes, not {type(data).__name__}") from None

    def verify(self, data: bytes, signature: bytes) -> bool:
        """True iff ``signature`` is this identity's valid signature of ``data``."""
        return verify_with_public_key(self._public_key, data, signature)

    def save(
        self,
        path: str | os.PathLike[str],
        passphrase: str | bytes | None = None,
        *,
        overwrite: bool = False,
        rng: Rng = os.urandom,
    ) -> None:
        """Write this wallet to a 0600 key file (see :mod:`talos_sdk.keyfile`)."""
        from talos_sdk.keyfile import encode_key_file, write_private_file

        write_private_file(
            Path(path), encode_key_file(self, passphrase, rng=rng), overwrite=overwrite
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str], passphrase: str | bytes | None = None) -> Wallet:
        """Read a key file written by :meth:`save`."""
        from talos_sdk.keyfile import decode_key_file, read_private_file

        return decode_key_file(read_private_file(Path(path)), passphrase)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(suite={self.suite!r}, did={self._did!r})"

    def __reduce__(self) -> tuple[object, ...]:
        # Refuse pickling: it would write the seed somewhere nobody chose to.
        raise TypeError("Wallet objects hold private keys and cannot be pickled")


def verify_with_public_key(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """True iff ``signature`` is a valid Ed25519 signature of ``data`` under ``public_key``."""
    if len(signature) != SIGNATURE_SIZE:
        return False
    try:
        crypto_sign_open(signature + data, public_key)
    except BadSignatureError:
        return False
    except (TypeError, ValueError):
        raise UsageError("data, signature and public key must be bytes") from None
    return True


def verify(did: str, data: bytes, signature: bytes) -> bool:
    """True iff ``signature`` by the key behind ``did`` is valid for ``data``.

    The DID is parsed once and cached (:func:`talos_sdk.did.public_key_from_did`);
    a malformed DID raises :class:`~talos_sdk.errors.DIDError`.
    """
    return verify_with_public_key(public_key_from_did(did), data, signature)
