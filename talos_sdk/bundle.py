"""Prekey bundles (docs/PROTOCOL.md "Prekey bundles"; Signal X3DH spec §3.2, PQXDH §3.2).

A responder publishes a :class:`PrekeyBundle`: its DID, an X25519 identity key,
a signed prekey, optionally an ML-KEM-768 prekey, the suites it accepts, and
unsigned one-time prekeys (as in Signal: an OPK swapped by an attacker only
makes the handshake fail). One signature by the DID's identity covers the
domain-separated, length-prefixed binary encoding of everything but the OPKs:
plain Ed25519 for a classical identity (bundle version 1), or the hybrid
Ed25519 + ML-DSA-65 signature of :mod:`talos_sdk.hybrid` for a hybrid identity
(version 2, which also carries the ML-DSA-65 public key inside the signed body,
so the key a peer pins is one the identity vouched for; ADR 0005).
:class:`talos_sdk.prekeys.PrekeySecrets` holds the private halves (and rotates them).

X25519 runs on libsodium (``nacl.bindings``), keys stay raw 32-byte strings:
nothing to parse per use. bench_crypto measures both libraries each run: a
libsodium key pair costs about half of OpenSSL's (21 vs 40 us here), a DH the
same (38 us), and an OpenSSL DH would need key objects, whose construction from
raw private bytes costs a base-point multiplication.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.mlkem import (
    MLKEM768PublicKey,
)
from nacl.bindings import crypto_scalarmult, crypto_scalarmult_base
from nacl.exceptions import RuntimeError as NaclRuntimeError

from talos_sdk.binfmt import ByteReader, pack_u8, pack_u16, pack_u32, pack_var8, pack_var16
from talos_sdk.did import public_key_from_did
from talos_sdk.errors import (
    BundleError,
    DIDError,
    MalformedFrameError,
    SignatureError,
    UsageError,
)
from talos_sdk.hybrid import (
    HYBRID_SIGNATURE_SIZE,
    MLDSA65_PUBLIC_KEY_SIZE,
    SUITE_ED25519,
    HybridPublicKey,
)
from talos_sdk.hybrid import SUITE_HYBRID as AUTH_HYBRID
from talos_sdk.wallet import Wallet, verify_with_public_key

__all__ = [
    "MLKEM768_CIPHERTEXT_SIZE",
    "MLKEM768_PUBLIC_SIZE",
    "SUITES",
    "SUITE_HYBRID",
    "SUITE_X25519",
    "IdentityKey",
    "PrekeyBundle",
    "Rng",
    "x25519_dh",
    "x25519_keypair",
]

Rng = Callable[[int], bytes]

SUITE_X25519 = "x25519"
SUITE_HYBRID = "x25519-mlkem768"
SUITES = (SUITE_X25519, SUITE_HYBRID)

KEY_SIZE = 32
SIGNATURE_SIZE = 64
MLKEM768_PUBLIC_SIZE = 1184
MLKEM768_CIPHERTEXT_SIZE = 1088
MLKEM_SEED_SIZE = 64
MAX_ONE_TIME = 10_000

_BUNDLE_DOMAIN = b"Talos_PrekeyBundle_v1\x00"
_BINDING_DOMAIN = b"Talos_IdentityKey_v1\x00"
_PQ_OPK_DOMAIN = b"Talos_PQOneTimePrekey_v1\x00"
_VERSION = 1
# Bundle version 2 = version 1 body + ML-DSA-65 key, hybrid signature. Classical
# bundles stay byte-identical to version 1 (vectors, stored bundles, old peers).
_VERSION_HYBRID = 2
_OPK = struct.Struct(">I32s")


def x25519_keypair(rng: Rng = os.urandom) -> tuple[bytes, bytes]:
    """(private, public) X25519 key pair from ``rng`` (RFC 7748 §5 clamps inside)."""
    private = rng(KEY_SIZE)
    if len(private) != KEY_SIZE:
        raise UsageError("rng returned the wrong number of bytes")
    return private, crypto_scalarmult_base(private)


def x25519_dh(private: bytes, public: bytes) -> bytes:
    """X25519(private, public); a low-order peer key (all-zero output) is a BundleError."""
    try:
        return crypto_scalarmult(private, public)
    except NaclRuntimeError:
        raise BundleError("X25519 with a low-order public key (all-zero shared secret)") from None


def _bundle_body(
    did: str,
    suites: tuple[str, ...],
    identity_dh: bytes,
    spk_id: int,
    spk: bytes,
    pq_id: int | None,
    pq_key: bytes | None,
    mldsa65_key: bytes | None = None,
) -> bytes:
    version = _VERSION if mldsa65_key is None else _VERSION_HYBRID
    out = [pack_u8(version), pack_var16(did.encode()), pack_u8(len(suites))]
    out += [pack_var8(s.encode()) for s in suites]
    out += [identity_dh, pack_u32(spk_id), spk]
    if pq_key is None or pq_id is None:
        out.append(b"\x00")
    else:
        out += [b"\x01", pack_u32(pq_id), pq_key]
    if mldsa65_key is not None:
        out.append(mldsa65_key)
    return b"".join(out)


# Parsed ML-KEM-768 public keys by their bytes (immutable objects, bounded, oldest
# evicted): parsing checks the key (~20 us); a node re-reads the same few bundles
# and rebuilds its own after every consumed OPK, whose key it already holds parsed.
_MLKEM_PUBLIC: dict[bytes, MLKEM768PublicKey] = {}
_MLKEM_PUBLIC_MAX = 64


def _remember_mlkem(raw: bytes, key: MLKEM768PublicKey) -> None:
    if len(_MLKEM_PUBLIC) >= _MLKEM_PUBLIC_MAX:
        del _MLKEM_PUBLIC[next(iter(_MLKEM_PUBLIC))]
    _MLKEM_PUBLIC[raw] = key


def _mlkem_public(raw: bytes) -> MLKEM768PublicKey:
    key = _MLKEM_PUBLIC.get(raw)
    if key is None:
        try:
            key = MLKEM768PublicKey.from_public_bytes(raw)
        except ValueError:
            raise MalformedFrameError("bundle: ML-KEM-768 public key is invalid") from None
        _remember_mlkem(raw, key)
    return key


def _did_key(did: str, what: str) -> bytes:
    try:
        return public_key_from_did(did)
    except DIDError as exc:
        raise MalformedFrameError(f"{what}: {exc}") from None


@dataclass(frozen=True, slots=True)
class IdentityKey:
    """An X25519 identity key bound to an Ed25519 DID by a signature (X3DH IK).

    ``binding`` = Ed25519 signature over ``"Talos_IdentityKey_v1\\0" || Ed25519 pk ||
    X25519 pk``; it is made once and sent in every initial message so the
    responder learns which DID the X25519 key speaks for.
    """

    did: str
    signing_key: bytes
    private: bytes = field(repr=False)
    public: bytes
    binding: bytes

    @classmethod
    def generate(cls, wallet: Wallet, rng: Rng = os.urandom) -> IdentityKey:
        """A fresh X25519 identity key for ``wallet``."""
        private, public = x25519_keypair(rng)
        return cls.from_private(wallet, private, public)

    @classmethod
    def from_private(
        cls, wallet: Wallet, private: bytes, public: bytes | None = None
    ) -> IdentityKey:
        """Rebuild (and re-sign the binding of) a stored X25519 private key."""
        if len(private) != KEY_SIZE:
            raise UsageError("X25519 private key must be 32 bytes")
        public = public if public is not None else crypto_scalarmult_base(private)
        sig = wallet.sign(binding_message(wallet.public_key, public))
        return cls(wallet.did, wallet.public_key, private, public, sig)


def pq_one_time_message(did: str, pq_id: int, key: bytes) -> bytes:
    """The bytes a one-time ML-KEM prekey's signature covers (``sign_auth`` of the DID)."""
    return _PQ_OPK_DOMAIN + pack_var16(did.encode()) + pack_u32(pq_id) + key


def binding_message(signing_key: bytes, x25519_public: bytes) -> bytes:
    """The bytes an identity binding signature covers."""
    return _BINDING_DOMAIN + signing_key + x25519_public


@dataclass(frozen=True, slots=True)
class PrekeyBundle:
    """The public half a responder publishes; call :meth:`verify` before use."""

    did: str
    suites: tuple[str, ...]
    identity_dh: bytes
    spk_id: int
    spk: bytes
    pq_id: int | None
    pq_key: bytes | None
    signature: bytes
    one_time: tuple[tuple[int, bytes], ...] = ()
    mldsa65_public_key: bytes | None = None
    #: Signed one-time ML-KEM-768 prekeys (PQXDH §3.2): (id, public key, signature).
    pq_one_time: tuple[tuple[int, bytes, bytes], ...] = ()
    signing_key: bytes = field(init=False, repr=False, compare=False)
    _pq_public: MLKEM768PublicKey | None = field(init=False, repr=False, compare=False)
    _hybrid: HybridPublicKey | None = field(init=False, repr=False, compare=False)
    _verified: list[bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        signing_key = _did_key(self.did, "bundle DID")
        object.__setattr__(self, "signing_key", signing_key)
        pq = None if self.pq_key is None else _mlkem_public(bytes(self.pq_key))
        object.__setattr__(self, "_pq_public", pq)
        hybrid = None
        if self.mldsa65_public_key is not None:
            try:
                hybrid = HybridPublicKey(signing_key, bytes(self.mldsa65_public_key))
            except UsageError as exc:
                raise MalformedFrameError(f"bundle: {exc}") from None
        object.__setattr__(self, "_hybrid", hybrid)
        object.__setattr__(self, "_verified", [False])

    @property
    def auth_suite(self) -> str:
        """``ed25519-mldsa65`` when hybrid-signed (carries an ML-DSA-65 key), else ``ed25519``."""
        return SUITE_ED25519 if self._hybrid is None else AUTH_HYBRID

    @property
    def hybrid_public_key(self) -> HybridPublicKey | None:
        """The bound Ed25519 + ML-DSA-65 keys of a hybrid bundle (trust it after verify())."""
        return self._hybrid

    def signed_body(self) -> bytes:
        """The binary encoding the signature covers (without the domain prefix)."""
        return _bundle_body(
            self.did,
            self.suites,
            self.identity_dh,
            self.spk_id,
            self.spk,
            self.pq_id,
            self.pq_key,
            self.mldsa65_public_key,
        )

    def verify(self) -> PrekeyBundle:
        """Check the signature and suites once (cached); return self or raise BundleError."""
        if self._verified[0]:
            return self
        unknown = [s for s in self.suites if s not in SUITES]
        if unknown:
            raise BundleError(f"bundle offers unknown suite(s) {unknown}; known: {list(SUITES)}")
        if not self.suites:
            raise BundleError("bundle offers no suite")
        if SUITE_HYBRID in self.suites and self._pq_public is None:
            raise BundleError(f"bundle offers {SUITE_HYBRID!r} without an ML-KEM-768 prekey")
        body = _BUNDLE_DOMAIN + self.signed_body()
        for pq_id, key, sig in self.pq_one_time:
            if not self._verify_sig(pq_one_time_message(self.did, pq_id, key), sig):
                raise BundleError(f"one-time ML-KEM prekey {pq_id} is not signed by {self.did}")
        if self._hybrid is not None:
            # The ML-DSA key is self-certified here; whether it is the key pinned
            # for this DID is the caller's decision (hybrid.decide_peer_pin).
            try:
                self._hybrid.require_valid(body, self.signature)
            except SignatureError as exc:
                raise BundleError(f"bundle signature does not verify: {exc}") from None
        elif not verify_with_public_key(self.signing_key, body, self.signature):
            kind = " (not a classical Ed25519 signature)" if len(self.signature) != 64 else ""
            raise BundleError(f"bundle signature does not verify for {self.did}{kind}")
        self._verified[0] = True
        return self

    def _verify_sig(self, data: bytes, sig: bytes) -> bool:
        if self._hybrid is not None:
            return self._hybrid.verify(data, sig)
        return verify_with_public_key(self.signing_key, data, sig)

    @property
    def pq_public(self) -> MLKEM768PublicKey | None:
        """The parsed ML-KEM-768 prekey (parsed once, at construction)."""
        return self._pq_public

    def to_bytes(self) -> bytes:
        """signed body || signature (64, or 3373 if version 2) || u16 count || (u32 id || key)*
        [|| u16 count || (u32 id || ML-KEM key (1184) || signature)*] (only if any)."""
        opks = b"".join(_OPK.pack(i, k) for i, k in self.one_time)
        out = self.signed_body() + self.signature + pack_u16(len(self.one_time)) + opks
        if self.pq_one_time:
            out += pack_u16(len(self.pq_one_time))
            out += b"".join(pack_u32(i) + k + sig for i, k, sig in self.pq_one_time)
        return out

    @classmethod
    def from_bytes(cls, data: bytes) -> PrekeyBundle:
        """Parse :meth:`to_bytes` output; bad layout raises MalformedFrameError."""
        r = ByteReader(data, "prekey bundle")
        version = r.u8()
        if version not in (_VERSION, _VERSION_HYBRID):
            raise MalformedFrameError("prekey bundle: unknown version")
        did = r.text16()
        suites = []
        for _ in range(r.u8()):
            try:
                suites.append(r.var8().decode("ascii"))
            except UnicodeDecodeError:
                raise MalformedFrameError("prekey bundle: suite name is not ASCII") from None
        ik, spk_id, spk = r.take(KEY_SIZE), r.u32(), r.take(KEY_SIZE)
        pq_id: int | None = None
        pq_key: bytes | None = None
        has_pq = r.u8()
        if has_pq == 1:
            pq_id, pq_key = r.u32(), r.take(MLKEM768_PUBLIC_SIZE)
        elif has_pq != 0:
            raise MalformedFrameError("prekey bundle: bad ML-KEM flag")
        mldsa: bytes | None = None
        if version == _VERSION_HYBRID:
            mldsa, sig = r.take(MLDSA65_PUBLIC_KEY_SIZE), r.take(HYBRID_SIGNATURE_SIZE)
        else:
            sig = r.take(SIGNATURE_SIZE)
        opks = tuple((i, k) for i, k in (_OPK.unpack(r.take(_OPK.size)) for _ in range(r.u16())))
        sig_size = len(sig)
        pq_opks: tuple[tuple[int, bytes, bytes], ...] = ()
        if r.remaining:
            pq_opks = tuple(
                (r.u32(), r.take(MLKEM768_PUBLIC_SIZE), r.take(sig_size)) for _ in range(r.u16())
            )
        r.end()
        return cls(did, tuple(suites), ik, spk_id, spk, pq_id, pq_key, sig, opks, mldsa, pq_opks)
