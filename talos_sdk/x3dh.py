"""X3DH and its PQXDH-style hybrid (docs/PROTOCOL.md "X3DH"; Signal X3DH spec §3, PQXDH §3).

Suites:

* ``x25519``: SK = HKDF(salt = 32 zero bytes, IKM = F || DH1 || DH2 || DH3 [|| DH4],
  info = ``Talos_X3DH_X25519_SHA256_v1``), F = 32 bytes of 0xFF.
* ``x25519-mlkem768``: as above with the ML-KEM-768 shared secret appended after
  DH4 and info = ``Talos_PQXDH_X25519_MLKEM768_SHA256_v1``; the KEM ciphertext
  travels in the initial data.

DH1 = DH(IK_A, SPK_B), DH2 = DH(EK_A, IK_B), DH3 = DH(EK_A, SPK_B), DH4 = DH(EK_A, OPK_B).
AD = IK_A || IK_B || Ed25519_A || Ed25519_B (the X25519 identity keys as in Signal,
then the Ed25519 keys behind both DIDs, so the session is bound to the DIDs).
The initiator's X25519 identity key is tied to its DID by the identity binding
signature in the initial data (:class:`talos_sdk.bundle.IdentityKey`).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

from talos_sdk.binfmt import ByteReader
from talos_sdk.bundle import (
    KEY_SIZE,
    MLKEM768_CIPHERTEXT_SIZE,
    SIGNATURE_SIZE,
    SUITE_HYBRID,
    SUITE_X25519,
    SUITES,
    IdentityKey,
    PrekeyBundle,
    Rng,
    _mlkem_public,
    binding_message,
    x25519_dh,
    x25519_keypair,
)
from talos_sdk.did import public_key_from_did
from talos_sdk.errors import BundleError, DIDError, MalformedFrameError, SignatureError
from talos_sdk.kdf import hkdf
from talos_sdk.prekeys import PrekeySecrets
from talos_sdk.wallet import verify_with_public_key

__all__ = [
    "INFO_HYBRID",
    "INFO_X25519",
    "InitialData",
    "PeerIdentity",
    "X3DHResult",
    "initiate",
    "respond",
]

INFO_X25519 = b"Talos_X3DH_X25519_SHA256_v1"
INFO_HYBRID = b"Talos_PQXDH_X25519_MLKEM768_SHA256_v1"
_F = b"\xff" * 32
_SUITE_CODES = {SUITE_X25519: 0, SUITE_HYBRID: 1}
_SUITE_NAMES = {v: k for k, v in _SUITE_CODES.items()}
_INFO = {SUITE_X25519: INFO_X25519, SUITE_HYBRID: INFO_HYBRID}
_IDS = struct.Struct(">II")
# Parsing: IK_A | binding signature | EK_A | SPK id | OPK id, then (hybrid) PQ
# prekey id | KEM ciphertext, one unpack each instead of a reader call per field
# (the responder parses this on every session start).
_KEYS_AND_IDS = struct.Struct(f">{KEY_SIZE}s{SIGNATURE_SIZE}s{KEY_SIZE}sII")
_PQ_PART = struct.Struct(f">I{MLKEM768_CIPHERTEXT_SIZE}s")


@dataclass(frozen=True, slots=True)
class InitialData:
    """What the initiator's first messages carry so the responder can run X3DH.

    Layout: suite u8 | u16 len || DID | IK_A(32) | binding sig(64) | EK_A(32) |
    SPK id u32 | OPK id u32 (0 = none) | [PQ prekey id u32 | KEM ciphertext(1088)].
    """

    suite: str
    did: str
    identity_dh: bytes
    binding: bytes
    ephemeral: bytes
    spk_id: int
    opk_id: int | None
    pq_id: int | None = None
    kem_ciphertext: bytes | None = field(default=None, repr=False)

    def to_bytes(self) -> bytes:
        did = self.did.encode()
        out = [
            bytes((_SUITE_CODES[self.suite],)),
            struct.pack(">H", len(did)),
            did,
            self.identity_dh,
            self.binding,
            self.ephemeral,
            _IDS.pack(self.spk_id, self.opk_id or 0),
        ]
        if self.suite == SUITE_HYBRID:
            assert self.pq_id is not None and self.kem_ciphertext is not None
            out += [struct.pack(">I", self.pq_id), self.kem_ciphertext]
        return b"".join(out)

    @classmethod
    def from_bytes(cls, data: bytes) -> InitialData:
        r = ByteReader(data, "X3DH initial data")
        suite = _SUITE_NAMES.get(r.u8())
        if suite is None:
            raise MalformedFrameError("X3DH initial data: unknown suite code")
        did = r.text16()
        ik, binding, ek, spk_id, opk_id = _KEYS_AND_IDS.unpack(r.take(_KEYS_AND_IDS.size))
        pq_id = ct = None
        if suite == SUITE_HYBRID:
            pq_id, ct = _PQ_PART.unpack(r.take(_PQ_PART.size))
        r.end()
        return cls(suite, did, ik, binding, ek, spk_id, opk_id or None, pq_id, ct)


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    """Who a session talks to: DID, its Ed25519 key, and its X25519 identity key."""

    did: str
    signing_key: bytes
    identity_dh: bytes


@dataclass(frozen=True, slots=True)
class X3DHResult:
    """The agreed secret plus what the Double Ratchet needs to start.

    It holds no ephemeral private key: the initiator's ``EK_A`` is dropped as soon
    as SK is derived, and its first ratchet key is a fresh pair (Signal DR §3.3),
    so state stolen after the handshake cannot recompute SK (docs/PROTOCOL.md
    "Double Ratchet", "Start").
    """

    suite: str
    shared_secret: bytes = field(repr=False)
    associated_data: bytes
    initial: InitialData
    peer_did: str
    peer_signing_key: bytes
    peer_identity_dh: bytes
    responder_spk: bytes

    @property
    def peer(self) -> PeerIdentity:
        return PeerIdentity(self.peer_did, self.peer_signing_key, self.peer_identity_dh)


def _kdf(suite: str, parts: list[bytes]) -> bytes:
    return hkdf(_F + b"".join(parts), salt=b"", info=_INFO[suite], length=32)


def initiate(
    identity: IdentityKey,
    bundle: PrekeyBundle,
    *,
    suite: str | None = None,
    use_one_time: bool = True,
    rng: Rng = os.urandom,
) -> X3DHResult:
    """Run the initiator's side against a peer bundle (verified here, once)."""
    bundle.verify()
    if suite is None:
        suite = SUITE_HYBRID if SUITE_HYBRID in bundle.suites else SUITE_X25519
    if suite not in SUITES:
        raise BundleError(f"unknown suite {suite!r}; known: {list(SUITES)}")
    if suite not in bundle.suites:
        raise BundleError(f"peer bundle does not offer suite {suite!r} (offers {bundle.suites})")
    ek_private, ek_public = x25519_keypair(rng)
    parts = [
        x25519_dh(identity.private, bundle.spk),
        x25519_dh(ek_private, bundle.identity_dh),
        x25519_dh(ek_private, bundle.spk),
    ]
    opk_id = None
    if use_one_time and bundle.one_time:
        opk_id, opk = bundle.one_time[0]
        parts.append(x25519_dh(ek_private, opk))
    # X3DH §3.3: EK_A's private half is deleted once the DH outputs exist. Python
    # cannot wipe an immutable bytes object; dropping the only reference is what
    # keeps it out of every state this module returns.
    del ek_private
    pq_id = ct = None
    if suite == SUITE_HYBRID:
        # PQXDH §3.3: a signed one-time ML-KEM prekey when offered, else the last-resort one.
        if use_one_time and bundle.pq_one_time:
            pq_id, raw, _ = bundle.pq_one_time[0]
            pq_public = _mlkem_public(raw)
        else:
            assert bundle.pq_public is not None  # verify() checked it
            pq_id, pq_public = bundle.pq_id, bundle.pq_public
        shared, ct = pq_public.encapsulate()
        parts.append(shared)
    initial = InitialData(
        suite,
        identity.did,
        identity.public,
        identity.binding,
        ek_public,
        bundle.spk_id,
        opk_id,
        pq_id,
        ct,
    )
    return X3DHResult(
        suite=suite,
        shared_secret=_kdf(suite, parts),
        associated_data=identity.public
        + bundle.identity_dh
        + identity.signing_key
        + bundle.signing_key,
        initial=initial,
        peer_did=bundle.did,
        peer_signing_key=bundle.signing_key,
        peer_identity_dh=bundle.identity_dh,
        responder_spk=bundle.spk,
    )


def respond(secrets: PrekeySecrets, initial: InitialData) -> X3DHResult:
    """Run the responder's side. Does NOT consume the OPK: the caller does, once the
    first message decrypts (so a forged initial message cannot burn a prekey)."""
    if initial.suite not in secrets.suites:
        raise BundleError(f"suite {initial.suite!r} is not offered by this bundle")
    spk_private = secrets.spk_private_for(initial.spk_id)  # current or in its grace period
    try:
        signing_key = public_key_from_did(initial.did)
    except DIDError as exc:
        raise MalformedFrameError(f"X3DH initial data: {exc}") from None
    if not verify_with_public_key(
        signing_key, binding_message(signing_key, initial.identity_dh), initial.binding
    ):
        raise SignatureError(f"initiator identity key is not signed by {initial.did}")
    parts = [
        x25519_dh(spk_private, initial.identity_dh),
        x25519_dh(secrets.identity.private, initial.ephemeral),
        x25519_dh(spk_private, initial.ephemeral),
    ]
    if initial.opk_id is not None:
        parts.append(x25519_dh(secrets.one_time_private(initial.opk_id), initial.ephemeral))
    if initial.suite == SUITE_HYBRID:
        if initial.kem_ciphertext is None:
            raise BundleError("hybrid initial data without a KEM ciphertext")
        pq = secrets.pq_private_for(initial.pq_id)
        try:
            parts.append(pq.decapsulate(initial.kem_ciphertext))
        except ValueError:
            raise MalformedFrameError("X3DH initial data: bad ML-KEM ciphertext") from None
    return X3DHResult(
        suite=initial.suite,
        shared_secret=_kdf(initial.suite, parts),
        associated_data=initial.identity_dh
        + secrets.identity.public
        + signing_key
        + secrets.identity.signing_key,
        initial=initial,
        peer_did=initial.did,
        peer_signing_key=signing_key,
        peer_identity_dh=initial.identity_dh,
        responder_spk=secrets.spk_public,
    )
