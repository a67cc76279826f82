"""The node's identity: an Ed25519 signing key and its did:key (docs/DESIGN.md "Identity").

Signatures are plain 64-byte Ed25519 (RFC 8032) made with libsodium through
pynacl, which measured faster here than OpenSSL for both sign and verify. The
expanded secret key and public key are derived once at construction so a call
to :meth:`Wallet.sign` is one libsodium call and a slice.

Key files (persistence) live in :mod:`talos_sdk.keyfile`
(:func:`~talos_sdk.keyfile.save_wallet` / :func:`~talos_sdk.keyfile.load_wallet`),
which imports this module and never the other way round.

Suite ``ed25519-mldsa65`` (ADR 0005, :class:`HybridWallet`) adds an ML-DSA-65 key
derived from the same seed (:mod:`talos_sdk.hybrid`). :meth:`Wallet.sign` stays
plain Ed25519 for per-message frames; :meth:`Wallet.sign_auth` is the hybrid
signature where the suite is hybrid (bundles, link proofs, block and log heads).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import ClassVar, Self, TypeVar

from nacl.bindings import crypto_sign, crypto_sign_open, crypto_sign_seed_keypair
from nacl.exceptions import BadSignatureError

from talos_sdk.did import did_from_public_key, public_key_from_did
from talos_sdk.errors import UsageError
from talos_sdk.hybrid import SUITE_ED25519, SUITE_HYBRID, HybridPublicKey, HybridSigner

__all__ = [
    "SEED_SIZE",
    "SIGNATURE_SIZE",
    "HybridWallet",
    "Wallet",
    "register_suite",
    "suite_wallet_class",
    "verify",
    "verify_auth",
    "verify_with_public_key",
]

SEED_SIZE = 32
SIGNATURE_SIZE = 64

Rng = Callable[[int], bytes]


class Wallet:
    """An Ed25519 identity. Build with :meth:`generate` or :meth:`from_seed`; key files:
    :func:`talos_sdk.keyfile.save_wallet` / :func:`talos_sdk.keyfile.load_wallet`.

    ``suite`` names the signature scheme used by :meth:`sign_auth`; pass
    ``suite="ed25519-mldsa65"`` to :meth:`generate` / :meth:`from_seed` for a
    :class:`HybridWallet`.
    """

    __slots__ = ("_did", "_public_key", "_secret_key", "_seed")
    suite: ClassVar[str] = SUITE_ED25519

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
    def generate(cls, rng: Rng = os.urandom, *, suite: str | None = None) -> Self:
        """A fresh identity from ``rng`` (the OS CSPRNG unless a test hands one in).

        ``suite`` picks the wallet class (``ed25519`` or ``ed25519-mldsa65``);
        None means this class's own suite.
        """
        return _suite_class(cls, suite)(rng(SEED_SIZE))

    @classmethod
    def from_seed(cls, seed: bytes, *, suite: str | None = None) -> Self:
        """The identity for a 32-byte Ed25519 seed (RFC 8032 private key); deterministic.

        The same seed gives the same DID in every suite.
        """
        return _suite_class(cls, suite)(seed)

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

    @property
    def mldsa_public_key(self) -> bytes | None:
        """The raw ML-DSA-65 public key (1952 B) of a hybrid wallet; None when classical."""
        return None

    @property
    def hybrid_public_key(self) -> HybridPublicKey | None:
        """Both public keys, bound (a :class:`HybridPublicKey`); None when classical."""
        return None

    def sign_hybrid(self, data: bytes) -> bytes:
        """The 3373-byte Ed25519 + ML-DSA-65 signature; only a hybrid wallet has one."""
        raise UsageError(
            f"wallet suite {self.suite!r} has no ML-DSA-65 key; sign_hybrid needs {SUITE_HYBRID!r}"
        )

    def sign_auth(self, data: bytes) -> bytes:
        """Sign something that authenticates the identity (bundle, link proof, head):
        hybrid for a hybrid wallet, plain Ed25519 otherwise."""
        return self.sign(data)

    def verify_auth(self, data: bytes, signature: bytes) -> bool:
        """Check a :meth:`sign_auth` signature of this identity."""
        return self.verify(data, signature)

    def key_file_header(self) -> dict[str, str]:
        """Extra clear-text key-file fields that the loader checks against the key."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(suite={self.suite!r}, did={self._did!r})"

    def __reduce__(self) -> tuple[object, ...]:
        # Refuse pickling: it would write the seed somewhere nobody chose to.
        raise TypeError("Wallet objects hold private keys and cannot be pickled")


class HybridWallet(Wallet):
    """Suite ``ed25519-mldsa65``: the Ed25519 identity plus an ML-DSA-65 key from the same seed.

    The DID is the Ed25519 did:key; :meth:`sign` / :meth:`verify` stay Ed25519;
    :meth:`sign_auth` / :meth:`verify_auth` are hybrid (docs/PROTOCOL.md
    "Hybrid signatures").
    """

    __slots__ = ("_signer",)
    suite: ClassVar[str] = SUITE_HYBRID

    def __init__(self, seed: bytes) -> None:
        super().__init__(seed)
        self._signer = HybridSigner(self._seed)

    @property
    def mldsa_public_key(self) -> bytes:
        """The raw 1952-byte ML-DSA-65 public key (FIPS 204)."""
        return self._signer.public_key.mldsa65

    @property
    def hybrid_public_key(self) -> HybridPublicKey:
        """Both public keys, bound; ``.fingerprint`` is what peers pin."""
        return self._signer.public_key

    def sign_hybrid(self, data: bytes) -> bytes:
        """The 3373-byte hybrid signature of ``data`` (:mod:`talos_sdk.hybrid`)."""
        return self._signer.sign(data)

    def sign_auth(self, data: bytes) -> bytes:
        """Hybrid: this identity authenticates with both keys."""
        return self._signer.sign(data)

    def verify_auth(self, data: bytes, signature: bytes) -> bool:
        """True iff both halves of the hybrid ``signature`` verify for ``data``."""
        return self._signer.public_key.verify(data, signature)

    def key_file_header(self) -> dict[str, str]:
        """The hybrid key id, so a key file shows it and a mismatched derivation is caught."""
        return {"key_id": self._signer.public_key.fingerprint}


_W = TypeVar("_W", bound=Wallet)

#: The one registry of wallet suites: Wallet.generate/from_seed and key files use it.
_WALLET_SUITES: dict[str, type[Wallet]] = {SUITE_ED25519: Wallet, SUITE_HYBRID: HybridWallet}


def register_suite(name: str, cls: type[Wallet]) -> None:
    """Make another wallet suite buildable by name and loadable from key files."""
    _WALLET_SUITES[name] = cls


def suite_wallet_class(suite: object) -> type[Wallet] | None:
    """The wallet class registered for ``suite``, or ``None`` (also for a non-string)."""
    return _WALLET_SUITES.get(suite) if isinstance(suite, str) else None


def _suite_class(cls: type[_W], suite: str | None) -> type[_W]:
    if suite is None:
        return cls
    found = _WALLET_SUITES.get(suite) if isinstance(suite, str) else None
    if found is None:
        raise UsageError(
            f"unknown wallet suite {suite!r}; expected one of {sorted(_WALLET_SUITES)}"
        )
    if not issubclass(found, cls):
        raise UsageError(f"{cls.__name__} cannot build a wallet of suite {suite!r}")
    return found


def verify_with_public_key(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """True iff ``signature`` is a valid Ed25519 signature of ``data`` under ``public_key``."""
    try:
        if len(signature) != SIGNATURE_SIZE:
            return False
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


@functools.lru_cache(maxsize=256)
def _hybrid_key(did: str, mldsa_public_key: bytes) -> HybridPublicKey:
    return HybridPublicKey(public_key_from_did(did), mldsa_public_key)


def verify_auth(did: str, mldsa_public_key: bytes | None, data: bytes, signature: bytes) -> bool:
    """Check a :meth:`Wallet.sign_auth` signature by ``did``.

    With ``mldsa_public_key`` (the peer's pinned ML-DSA-65 key) only a hybrid
    signature valid in both halves passes; with None only a classical Ed25519
    one. Choosing which applies is :func:`talos_sdk.hybrid.decide_peer_pin`'s job.
    """
    if mldsa_public_key is None:
        return verify(did, data, signature)
    if not isinstance(mldsa_public_key, bytes | bytearray | memoryview):
        raise UsageError("ML-DSA-65 public key must be bytes or None")
    return _hybrid_key(did, bytes(mldsa_public_key)).verify(data, signature)
