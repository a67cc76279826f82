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
:class:`PrekeySecrets` holds the private halves and serialises them for the node.

X25519 runs on libsodium (``nacl.bindings``), keys stay raw 32-byte strings:
nothing to parse per use, and keygen measured faster than OpenSSL here.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.mlkem import (
    MLKEM768PrivateKey,
    MLKEM768PublicKey,
)
from nacl.bindings import crypto_scalarmult, crypto_scalarmult_base
from nacl.exceptions import RuntimeError as NaclRuntimeError

from talos_sdk.binfmt import ByteReader, pack_u8, pack_u16, pack_u32, pack_var8, pack_var16
from talos_sdk.did import public_key_from_did
from talos_sdk.errors import (
    BundleError,
    DIDError,
    EncodingError,
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
    "PrekeySecrets",
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
_SECRETS_MAGIC = b"TPKS\x01"
_SECRETS_MAGIC_HYBRID = b"TPKS\x02"
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

    @property
    def pq_public(self) -> MLKEM768PublicKey | None:
        """The parsed ML-KEM-768 prekey (parsed once, at construction)."""
        return self._pq_public

    def to_bytes(self) -> bytes:
        """signed body || signature (64, or 3373 if version 2) || u16 count || (u32 id || key)*."""
        opks = b"".join(_OPK.pack(i, k) for i, k in self.one_time)
        return self.signed_body() + self.signature + pack_u16(len(self.one_time)) + opks

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
        r.end()
        return cls(did, tuple(suites), ik, spk_id, spk, pq_id, pq_key, sig, opks, mldsa)


class PrekeySecrets:
    """The private side of a bundle. Mutable: one-time prekeys are consumed.

    Serialise with :meth:`to_bytes` / :meth:`to_dict` (secret material: store it
    like a key file) and restore with :meth:`from_bytes` / :meth:`from_dict`.
    """

    __slots__ = (
        "_bundle",
        "_next_opk",
        "_one_time",
        "_pq",
        "_pq_public",
        "_used",
        "identity",
        "mldsa65_public_key",
        "pq_id",
        "pq_seed",
        "signature",
        "spk_id",
        "spk_private",
        "spk_public",
        "suites",
    )

    def __init__(
        self,
        identity: IdentityKey,
        *,
        suites: tuple[str, ...],
        spk_id: int,
        spk_private: bytes,
        pq_id: int | None,
        pq_seed: bytes | None,
        signature: bytes,
        one_time: Mapping[int, bytes],
        used: Iterable[int] = (),
        next_opk: int | None = None,
        spk_public: bytes | None = None,
        mldsa65_public_key: bytes | None = None,
    ) -> None:
        self.identity = identity
        self.mldsa65_public_key = mldsa65_public_key
        self.suites = suites
        self.spk_id = spk_id
        self.spk_private = spk_private
        self.spk_public = spk_public or crypto_scalarmult_base(spk_private)
        self.pq_id = pq_id
        self.pq_seed = pq_seed
        # Parsed once: ML-KEM key expansion from the seed is the costly part.
        self._pq = MLKEM768PrivateKey.from_seed_bytes(pq_seed) if pq_seed is not None else None
        self._pq_public: bytes | None = None
        if self._pq is not None:
            public = self._pq.public_key()
            self._pq_public = public.public_bytes_raw()
            _remember_mlkem(self._pq_public, public)
        self.signature = signature
        self._one_time: dict[int, tuple[bytes, bytes]] = {
            i: (k, crypto_scalarmult_base(k)) for i, k in one_time.items()
        }
        self._used: set[int] = set(used)
        self._next_opk = next_opk if next_opk is not None else max(self._one_time, default=0) + 1
        self._bundle: PrekeyBundle | None = None

    @classmethod
    def generate(
        cls,
        wallet: Wallet,
        *,
        one_time: int = 0,
        pq: bool = False,
        rng: Rng = os.urandom,
        identity: IdentityKey | None = None,
        spk_id: int = 1,
    ) -> PrekeySecrets:
        """Fresh signed prekey (+ ML-KEM-768 prekey if ``pq``) and ``one_time`` OPKs."""
        if not 0 <= one_time <= MAX_ONE_TIME:
            raise UsageError(f"one_time must be 0..{MAX_ONE_TIME}")
        if identity is None:
            identity = IdentityKey.generate(wallet, rng)
        elif identity.did != wallet.did:
            raise UsageError("identity key belongs to another wallet")
        spk_private, spk_public = x25519_keypair(rng)
        pq_seed = rng(MLKEM_SEED_SIZE) if pq else None
        opks = {i: rng(KEY_SIZE) for i in range(1, one_time + 1)}
        secrets = cls(
            identity,
            suites=SUITES if pq else (SUITE_X25519,),
            spk_id=spk_id,
            spk_private=spk_private,
            pq_id=spk_id if pq else None,
            pq_seed=pq_seed,
            signature=b"",
            one_time=opks,
            spk_public=spk_public,
            mldsa65_public_key=wallet.mldsa_public_key,
        )
        # sign_auth: hybrid for a hybrid wallet (bundles authenticate the identity).
        secrets.signature = wallet.sign_auth(
            _BUNDLE_DOMAIN
            + _bundle_body(
                secrets.did,
                secrets.suites,
                identity.public,
                spk_id,
                spk_public,
                secrets.pq_id,
                secrets._pq_public,
                secrets.mldsa65_public_key,
            )
        )
        return secrets

    @property
    def did(self) -> str:
        return self.identity.did

    @property
    def pq_private(self) -> MLKEM768PrivateKey | None:
        return self._pq

    def add_one_time(self, count: int, rng: Rng = os.urandom) -> list[int]:
        """Mint ``count`` more OPKs (unsigned, so no wallet needed); return their ids."""
        if count < 0 or len(self._one_time) + count > MAX_ONE_TIME:
            raise UsageError(f"at most {MAX_ONE_TIME} unused one-time prekeys")
        ids = list(range(self._next_opk, self._next_opk + count))
        for i in ids:
            priv, pub = x25519_keypair(rng)
            self._one_time[i] = (priv, pub)
        self._next_opk += count
        self._bundle = None
        return ids

    def bundle(self) -> PrekeyBundle:
        """The public bundle with the OPKs not yet consumed (cached until they change)."""
        if self._bundle is None:
            opks = tuple((i, pub) for i, (_, pub) in sorted(self._one_time.items()))
            b = PrekeyBundle(
                self.did,
                self.suites,
                self.identity.public,
                self.spk_id,
                self.spk_public,
                self.pq_id,
                self._pq_public,
                self.signature,
                opks,
                self.mldsa65_public_key,
            )
            self._bundle = b
        return self._bundle

    def spk_private_for(self, spk_id: int) -> bytes:
        """The private signed prekey ``spk_id``; BundleError if it is not held."""
        if spk_id != self.spk_id:
            raise BundleError(f"unknown signed prekey id {spk_id}")
        return self.spk_private

    def one_time_private(self, opk_id: int) -> bytes:
        """The private OPK ``opk_id`` without consuming it (responder computes tentatively)."""
        entry = self._one_time.get(opk_id)
        if entry is None:
            if opk_id in self._used:
                raise BundleError(f"one-time prekey {opk_id} was already used")
            raise BundleError(f"unknown one-time prekey {opk_id}")
        return entry[0]

    def consume_one_time(self, opk_id: int) -> bytes:
        """Remove OPK ``opk_id`` for good; a second call raises BundleError."""
        private = self.one_time_private(opk_id)
        del self._one_time[opk_id]
        self._used.add(opk_id)
        self._bundle = None
        return private

    @property
    def one_time_ids(self) -> list[int]:
        return sorted(self._one_time)

    # --- persistence -------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (hex strings). Secret: store it 0600."""
        return {
            "version": _VERSION,
            "did": self.did,
            "identity_private": self.identity.private.hex(),
            "identity_binding": self.identity.binding.hex(),
            "suites": list(self.suites),
            "spk_id": self.spk_id,
            "spk_private": self.spk_private.hex(),
            "pq_id": self.pq_id,
            "pq_seed": self.pq_seed.hex() if self.pq_seed is not None else None,
            "signature": self.signature.hex(),
            "one_time": {str(i): k.hex() for i, (k, _) in sorted(self._one_time.items())},
            "used": sorted(self._used),
            "next_opk": self._next_opk,
            "mldsa65_public_key": (
                None if self.mldsa65_public_key is None else self.mldsa65_public_key.hex()
            ),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PrekeySecrets:
        """Inverse of :meth:`to_dict`; bad input raises EncodingError."""
        try:
            if d["version"] != _VERSION:
                raise EncodingError("prekey secrets: unknown version")
            did = str(d["did"])
            ik_private = bytes.fromhex(d["identity_private"])
            ik = IdentityKey(
                did,
                public_key_from_did(did),
                ik_private,
                crypto_scalarmult_base(ik_private),
                bytes.fromhex(d["identity_binding"]),
            )
            return cls(
                ik,
                suites=tuple(str(s) for s in d["suites"]),
                spk_id=int(d["spk_id"]),
                spk_private=bytes.fromhex(d["spk_private"]),
                pq_id=None if d["pq_id"] is None else int(d["pq_id"]),
                pq_seed=None if d["pq_seed"] is None else bytes.fromhex(d["pq_seed"]),
                signature=bytes.fromhex(d["signature"]),
                one_time={int(i): bytes.fromhex(k) for i, k in d["one_time"].items()},
                used=[int(i) for i in d["used"]],
                next_opk=int(d["next_opk"]),
                mldsa65_public_key=(
                    None
                    if d.get("mldsa65_public_key") is None
                    else bytes.fromhex(d["mldsa65_public_key"])
                ),
            )
        except EncodingError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, NaclRuntimeError) as exc:
            raise EncodingError(f"prekey secrets: malformed dict ({exc})") from None

    def to_bytes(self) -> bytes:
        """Compact binary form; same content as :meth:`to_dict`.

        Magic ``TPKS\\x01`` for a classical identity (64-byte signature), ``TPKS\\x02``
        for a hybrid one (3373-byte signature, ML-DSA-65 public key appended).
        """
        hybrid = self.mldsa65_public_key is not None
        out = [
            _SECRETS_MAGIC_HYBRID if hybrid else _SECRETS_MAGIC,
            pack_var16(self.did.encode()),
            self.identity.private,
            self.identity.binding,
            pack_u8(len(self.suites)),
            *(pack_var8(s.encode()) for s in self.suites),
            pack_u32(self.spk_id),
            self.spk_private,
        ]
        if self.pq_seed is None or self.pq_id is None:
            out.append(b"\x00")
        else:
            out += [b"\x01", pack_u32(self.pq_id), self.pq_seed]
        out.append(self.signature)
        out.append(pack_u32(len(self._one_time)))
        out += [pack_u32(i) + k for i, (k, _) in sorted(self._one_time.items())]
        out.append(pack_u32(len(self._used)))
        out += [pack_u32(i) for i in sorted(self._used)]
        out.append(pack_u32(self._next_opk))
        if self.mldsa65_public_key is not None:
            out.append(self.mldsa65_public_key)
        return b"".join(out)

    @classmethod
    def from_bytes(cls, data: bytes) -> PrekeySecrets:
        """Inverse of :meth:`to_bytes`; garbage raises EncodingError."""
        try:
            r = ByteReader(data, "prekey secrets")
            magic = r.take(len(_SECRETS_MAGIC))
            if magic not in (_SECRETS_MAGIC, _SECRETS_MAGIC_HYBRID):
                raise EncodingError("prekey secrets: bad magic")
            hybrid = magic == _SECRETS_MAGIC_HYBRID
            did = r.text16()
            ik_private, binding = r.take(KEY_SIZE), r.take(SIGNATURE_SIZE)
            suites = tuple(r.var8().decode("ascii") for _ in range(r.u8()))
            spk_id, spk_private = r.u32(), r.take(KEY_SIZE)
            pq_id: int | None = None
            pq_seed: bytes | None = None
            if r.u8():
                pq_id, pq_seed = r.u32(), r.take(MLKEM_SEED_SIZE)
            signature = r.take(HYBRID_SIGNATURE_SIZE if hybrid else SIGNATURE_SIZE)
            opks = {r.u32(): r.take(KEY_SIZE) for _ in range(r.u32())}
            used = [r.u32() for _ in range(r.u32())]
            next_opk = r.u32()
            mldsa = r.take(MLDSA65_PUBLIC_KEY_SIZE) if hybrid else None
            r.end()
            ik = IdentityKey(
                did,
                public_key_from_did(did),
                ik_private,
                crypto_scalarmult_base(ik_private),
                binding,
            )
        except (MalformedFrameError, DIDError, UnicodeDecodeError) as exc:
            raise EncodingError(f"prekey secrets: {exc}") from None
        return cls(
            ik,
            suites=suites,
            spk_id=spk_id,
            spk_private=spk_private,
            pq_id=pq_id,
            pq_seed=pq_seed,
            signature=signature,
            one_time=opks,
            used=used,
            next_opk=next_opk,
            mldsa65_public_key=mldsa,
        )
