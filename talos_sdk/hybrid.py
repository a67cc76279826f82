"""Hybrid signatures: Ed25519 + ML-DSA-65, valid only if both verify (docs/PROTOCOL.md
"Hybrid signatures", docs/adr/0005-hybrid-signatures.md; RFC 8032, FIPS 204).

Construction, for a message ``M`` and public keys ``pk_ed`` (32 B), ``pk_ml`` (1952 B)::

    key_id  = SHA-256("talos-hybrid-v1/key-id" || pk_ed || pk_ml)
    bound   = key_id || M
    sig_ed  = Ed25519.Sign(sk_ed, "talos-hybrid-v1/ed25519" || bound)          64 B
    sig_ml  = ML-DSA-65.Sign(sk_ml, bound, ctx="talos-hybrid-v1/mldsa65")      3309 B
    sig     = sig_ed || sig_ml                                                 3373 B

Each component carries its own domain label (Ed25519 has no context input, so the
label is a prefix; ML-DSA uses its FIPS 204 context string), so neither half is a
valid signature anywhere else, and ``key_id`` commits each half to the *pair* of
keys, so halves cannot be recombined with another identity's key.

The ML-DSA-65 seed is derived from the 32-byte wallet (Ed25519) seed with HKDF,
so one seed restores both keys and the DID (did:key of the Ed25519 key) is the
same as a classical wallet with that seed. ML-DSA signing in OpenSSL is hedged
(FIPS 204 §3.4): signatures are randomised, verification is deterministic.

:func:`decide_peer_pin` is the pure trust-on-first-use rule the node applies to a
peer's ML-DSA key: pin on first sight, then refuse a change or a downgrade.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.mldsa import MLDSA65PrivateKey, MLDSA65PublicKey
from nacl.bindings import crypto_sign, crypto_sign_open, crypto_sign_seed_keypair
from nacl.exceptions import BadSignatureError

from talos_sdk.did import did_from_public_key
from talos_sdk.errors import HandshakeError, SignatureError, UsageError
from talos_sdk.kdf import hkdf

__all__ = [
    "ED25519_PREFIX",
    "HYBRID_SIGNATURE_SIZE",
    "KEY_ID_PREFIX",
    "MLDSA65_CONTEXT",
    "MLDSA65_PUBLIC_KEY_SIZE",
    "MLDSA65_SEED_INFO",
    "MLDSA65_SIGNATURE_SIZE",
    "SUITE_ED25519",
    "SUITE_HYBRID",
    "DowngradeError",
    "HybridPublicKey",
    "HybridSigner",
    "PeerSuiteError",
    "PinDecision",
    "PinnedKeyChangedError",
    "PostQuantumRequiredError",
    "decide_peer_pin",
    "derive_mldsa65_seed",
]

SUITE_ED25519 = "ed25519"
SUITE_HYBRID = "ed25519-mldsa65"

ED25519_PUBLIC_KEY_SIZE = 32
ED25519_SIGNATURE_SIZE = 64
MLDSA65_PUBLIC_KEY_SIZE = 1952
MLDSA65_SIGNATURE_SIZE = 3309
HYBRID_SIGNATURE_SIZE = ED25519_SIGNATURE_SIZE + MLDSA65_SIGNATURE_SIZE
_SEED_SIZE = 32

# No other Talos signing context may start with "talos-hybrid": that keeps the
# Ed25519 half from ever being a valid classical Talos signature.
KEY_ID_PREFIX = b"talos-hybrid-v1/key-id"
ED25519_PREFIX = b"talos-hybrid-v1/ed25519"
MLDSA65_CONTEXT = b"talos-hybrid-v1/mldsa65"
MLDSA65_SEED_INFO = b"talos-hybrid-v1/mldsa65-seed"


def _require_bytes(name: str, value: object) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise UsageError(f"{name} must be bytes, not {type(value).__name__}")
    return bytes(value)


def derive_mldsa65_seed(seed: bytes) -> bytes:
    """The 32-byte ML-DSA-65 key-generation seed ξ for a wallet seed.

    HKDF-SHA256 (RFC 5869), empty salt, info ``talos-hybrid-v1/mldsa65-seed``: a
    PRF output independent of the Ed25519 key for anyone without the seed.
    """
    seed = _require_bytes("seed", seed)
    if len(seed) != _SEED_SIZE:
        raise UsageError(f"hybrid seed must be {_SEED_SIZE} bytes, got {len(seed)}")
    return hkdf(seed, info=MLDSA65_SEED_INFO, length=_SEED_SIZE)


def hybrid_key_id(ed25519_public_key: bytes, mldsa65_public_key: bytes) -> bytes:
    """SHA-256 commitment to the key pair; bound into both signature halves."""
    return hashlib.sha256(KEY_ID_PREFIX + ed25519_public_key + mldsa65_public_key).digest()


@dataclass(frozen=True, slots=True)
class HybridPublicKey:
    """The public half of a hybrid identity: an Ed25519 and an ML-DSA-65 key, bound.

    ``key_id`` (32 bytes, :attr:`fingerprint` in hex) is what a peer pins and shows.
    """

    ed25519: bytes
    mldsa65: bytes
    key_id: bytes = field(init=False, repr=False, compare=False)
    _mldsa: MLDSA65PublicKey = field(init=False, repr=False, compare=False)
    _did: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ed = _require_bytes("Ed25519 public key", self.ed25519)
        ml = _require_bytes("ML-DSA-65 public key", self.mldsa65)
        if len(ed) != ED25519_PUBLIC_KEY_SIZE:
            raise UsageError(f"Ed25519 public key must be 32 bytes, got {len(ed)}")
        if len(ml) != MLDSA65_PUBLIC_KEY_SIZE:
            raise UsageError(
                f"ML-DSA-65 public key must be {MLDSA65_PUBLIC_KEY_SIZE} bytes, got {len(ml)}"
            )
        # Parsed once here: loading costs ~15 us, a tenth of a verify.
        try:
            mldsa = MLDSA65PublicKey.from_public_bytes(ml)
        except ValueError as exc:
            raise UsageError(f"invalid ML-DSA-65 public key: {exc}") from None
        object.__setattr__(self, "ed25519", ed)
        object.__setattr__(self, "mldsa65", ml)
        object.__setattr__(self, "key_id", hybrid_key_id(ed, ml))
        object.__setattr__(self, "_mldsa", mldsa)
        object.__setattr__(self, "_did", did_from_public_key(ed))

    @classmethod
    def from_bytes(cls, data: bytes) -> HybridPublicKey:
        """Parse ``ed25519 (32) || mldsa65 (1952)`` as written by :meth:`to_bytes`."""
        data = _require_bytes("hybrid public key", data)
        size = ED25519_PUBLIC_KEY_SIZE + MLDSA65_PUBLIC_KEY_SIZE
        if len(data) != size:
            raise UsageError(f"hybrid public key must be {size} bytes, got {len(data)}")
        return cls(data[:ED25519_PUBLIC_KEY_SIZE], data[ED25519_PUBLIC_KEY_SIZE:])

    def to_bytes(self) -> bytes:
        """``ed25519 || mldsa65``, 1984 bytes."""
        return self.ed25519 + self.mldsa65

    @property
    def did(self) -> str:
        """The did:key of the Ed25519 half: the identity's name."""
        return self._did

    @property
    def fingerprint(self) -> str:
        """Hex of :attr:`key_id`, for display and comparison by humans."""
        return self.key_id.hex()

    def verify(self, data: bytes, signature: bytes) -> bool:
        """True iff ``signature`` is a hybrid signature of ``data`` valid in *both* halves."""
        return self._failure(data, signature) is None

    def require_valid(self, data: bytes, signature: bytes) -> None:
        """Like :meth:`verify` but raise :class:`SignatureError` saying which check failed.

        Signatures are public, so naming the failed half leaks nothing.
        """
        failure = self._failure(data, signature)
        if failure is not None:
            raise SignatureError(f"hybrid signature by {self._did} rejected: {failure}")

    def _failure(self, data: bytes, signature: bytes) -> str | None:
        if not isinstance(data, bytes | bytearray | memoryview) or not isinstance(
            signature, bytes | bytearray | memoryview
        ):
            raise UsageError("data and signature must be bytes")
        if len(signature) != HYBRID_SIGNATURE_SIZE:
            kind = " (a classical Ed25519 signature)" if len(signature) == 64 else ""
            return f"length {len(signature)}{kind}, expected {HYBRID_SIGNATURE_SIZE}"
        bound = self.key_id + data
        sig_ed = bytes(signature[:ED25519_SIGNATURE_SIZE])
        # Ed25519 first: it is the cheaper check, so garbage is rejected early.
        try:
            crypto_sign_open(sig_ed + ED25519_PREFIX + bound, self.ed25519)
        except BadSignatureError:
            return "Ed25519 half does not verify"
        try:
            self._mldsa.verify(bytes(signature[ED25519_SIGNATURE_SIZE:]), bound, MLDSA65_CONTEXT)
        except InvalidSignature:
            return "ML-DSA-65 half does not verify"
        return None

    def __repr__(self) -> str:
        return f"HybridPublicKey(did={self._did!r}, fingerprint={self.fingerprint!r})"


class HybridSigner:
    """The private half: signs with both keys. Build with :meth:`from_seed`."""

    __slots__ = ("_ed_secret", "_mldsa", "_public")

    def __init__(self, seed: bytes) -> None:
        seed = _require_bytes("seed", seed)
        mldsa_seed = derive_mldsa65_seed(seed)
        ed_public, self._ed_secret = crypto_sign_seed_keypair(seed)
        self._mldsa = MLDSA65PrivateKey.from_seed_bytes(mldsa_seed)
        self._public = HybridPublicKey(ed_public, self._mldsa.public_key().public_bytes_raw())

    @classmethod
    def from_seed(cls, seed: bytes) -> HybridSigner:
        """Both keys from one 32-byte seed (Ed25519 seed as is, ML-DSA seed via HKDF)."""
        return cls(seed)

    @property
    def public_key(self) -> HybridPublicKey:
        """The bound public keys."""
        return self._public

    def sign(self, data: bytes) -> bytes:
        """The 3373-byte hybrid signature ``sig_ed || sig_ml`` of ``data``."""
        data = _require_bytes("data to sign", data)
        bound = self._public.key_id + data
        sig_ed = crypto_sign(ED25519_PREFIX + bound, self._ed_secret)[:ED25519_SIGNATURE_SIZE]
        return sig_ed + self._mldsa.sign(bound, MLDSA65_CONTEXT)

    def __repr__(self) -> str:
        return f"HybridSigner(did={self._public.did!r})"

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("HybridSigner objects hold private keys and cannot be pickled")


class PeerSuiteError(HandshakeError):
    """A peer's signature suite or hybrid key is not acceptable under our pins / policy."""


class DowngradeError(PeerSuiteError):
    """A peer whose hybrid key we pinned now presents classical Ed25519 only."""


class PinnedKeyChangedError(PeerSuiteError):
    """A peer presents an ML-DSA-65 key other than the one pinned for its DID."""


class PostQuantumRequiredError(PeerSuiteError):
    """Policy requires hybrid authentication (--require-pq) and the peer is classical."""


@dataclass(frozen=True, slots=True)
class PinDecision:
    """What to do with a peer that passed :func:`decide_peer_pin`.

    ``pin`` is the ML-DSA-65 key to keep pinned for the DID (store it when
    ``newly_pinned``); ``suite`` is the suite the peer's signatures must use.
    """

    suite: str
    pin: bytes | None
    newly_pinned: bool


def decide_peer_pin(
    did: str,
    pinned: bytes | None,
    presented: bytes | None,
    *,
    require_pq: bool = False,
) -> PinDecision:
    """Trust-on-first-use for a peer's ML-DSA-65 key (docs/PROTOCOL.md "Hybrid signatures").

    ``pinned``: the key stored for ``did`` (None if never seen); ``presented``: the
    key the peer shows now, already authenticated by a hybrid signature over it
    (None if the peer is classical). Raises :class:`PostQuantumRequiredError`,
    :class:`DowngradeError` or :class:`PinnedKeyChangedError`.
    """
    if presented is None:
        if require_pq:
            raise PostQuantumRequiredError(
                f"peer {did} authenticates with classical Ed25519 only; "
                "this node requires hybrid Ed25519 + ML-DSA-65 (--require-pq)"
            )
        if pinned is not None:
            raise DowngradeError(
                f"downgrade refused: peer {did} has a pinned ML-DSA-65 key but now "
                "presents classical Ed25519 only"
            )
        return PinDecision(SUITE_ED25519, None, False)
    presented = _require_bytes("presented ML-DSA-65 key", presented)
    if pinned is None:
        return PinDecision(SUITE_HYBRID, presented, True)
    if bytes(pinned) != presented:
        raise PinnedKeyChangedError(
            f"peer {did} presents ML-DSA-65 key "
            f"{hashlib.sha256(presented).hexdigest()[:16]} but "
            f"{hashlib.sha256(bytes(pinned)).hexdigest()[:16]} is pinned for it"
        )
    return PinDecision(SUITE_HYBRID, presented, False)
