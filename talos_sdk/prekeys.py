"""Prekey secrets: the private side of a bundle, with rotation (docs/PROTOCOL.md
"Prekey bundles"; Signal X3DH spec §3.2: the signed prekey is replaced
periodically and the old private key kept for a while; PQXDH spec §3.2:
signed one-time and last-resort ML-KEM prekeys).

:class:`PrekeySecrets` holds the X25519 identity key, the signed prekey (SPK),
the last-resort ML-KEM-768 prekey (signed with the SPK in the bundle body),
unsigned one-time X25519 prekeys (OPKs) and signed one-time ML-KEM-768 prekeys
(PQ OPKs, PQXDH style). The SDK reads no clock: :meth:`PrekeySecrets.rotate`
and :meth:`PrekeySecrets.expire` take ``now`` (seconds) from the caller.

* **Rotation.** :meth:`~PrekeySecrets.rotate` makes a new SPK and a new
  last-resort ML-KEM key under the next id and re-signs the bundle; the
  replaced pair stays *retired* until ``now + grace`` so sessions a peer began
  from the old bundle still start (at most :data:`MAX_RETIRED` are kept).
* **One-time keys.** OPK and PQ OPK ids are handed out from counters that only
  grow, so an id is never minted twice: an id not held is unknown or used,
  whatever the bookkeeping remembers. Only the last :data:`MAX_USED_REMEMBERED`
  used ids are kept, to name the error; the state no longer grows per session.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.mlkem import MLKEM768PrivateKey
from nacl.bindings import crypto_scalarmult_base
from nacl.exceptions import RuntimeError as NaclRuntimeError

from talos_sdk.binfmt import ByteReader, pack_u8, pack_u32, pack_var8, pack_var16
from talos_sdk.bundle import (
    _BUNDLE_DOMAIN,
    KEY_SIZE,
    MAX_ONE_TIME,
    MLKEM_SEED_SIZE,
    SIGNATURE_SIZE,
    SUITE_X25519,
    SUITES,
    IdentityKey,
    PrekeyBundle,
    Rng,
    _bundle_body,
    _remember_mlkem,
    pq_one_time_message,
    x25519_keypair,
)
from talos_sdk.did import public_key_from_did
from talos_sdk.errors import (
    BundleError,
    DIDError,
    EncodingError,
    MalformedFrameError,
    UsageError,
)
from talos_sdk.hybrid import HYBRID_SIGNATURE_SIZE, MLDSA65_PUBLIC_KEY_SIZE
from talos_sdk.wallet import Wallet

__all__ = ["MAX_PQ_ONE_TIME", "MAX_RETIRED", "MAX_USED_REMEMBERED", "PrekeySecrets"]

MAX_RETIRED = 4
MAX_USED_REMEMBERED = 1024
MAX_PQ_ONE_TIME = 1000
#: PQ OPK ids live above the SPK / last-resort ids (which count up from 1).
PQ_OPK_ID_BASE = 1 << 31

# Magic 1 / 2: the layout before rotation (read only). 3 / 4 add the rotation block.
_MAGIC_V1 = b"TPKS\x01"
_MAGIC_V1_HYBRID = b"TPKS\x02"
_MAGIC = b"TPKS\x03"
_MAGIC_HYBRID = b"TPKS\x04"
_U64 = struct.Struct(">Q")


@dataclass(frozen=True, slots=True)
class _Retired:
    """A replaced SPK (and last-resort ML-KEM key), usable until ``expires``."""

    spk_id: int
    spk_private: bytes
    pq_id: int | None
    pq_seed: bytes | None
    expires: int


def _pq_key(seed: bytes) -> tuple[MLKEM768PrivateKey, bytes]:
    key = MLKEM768PrivateKey.from_seed_bytes(seed)
    public = key.public_key()
    raw = public.public_bytes_raw()
    _remember_mlkem(raw, public)
    return key, raw


class PrekeySecrets:
    """The private side of a bundle. Mutable: one-time prekeys are consumed, keys rotate.

    Serialise with :meth:`to_bytes` / :meth:`to_dict` (secret material: store it
    like a key file) and restore with :meth:`from_bytes` / :meth:`from_dict`.
    """

    __slots__ = (
        "_bundle",
        "_next_opk",
        "_next_pq_opk",
        "_one_time",
        "_pq",
        "_pq_one_time",
        "_pq_public",
        "_retired",
        "_used",
        "created",
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
        created: int = 0,
        retired: Iterable[_Retired] = (),
        pq_one_time: Mapping[int, tuple[bytes, bytes]] | None = None,
        next_pq_opk: int = PQ_OPK_ID_BASE,
    ) -> None:
        self.identity = identity
        self.mldsa65_public_key = mldsa65_public_key
        self.suites = suites
        self.created = created
        self._retired: list[_Retired] = list(retired)
        self._set_current(spk_id, spk_private, pq_id, pq_seed, spk_public)
        self.signature = signature
        self._one_time: dict[int, tuple[bytes, bytes]] = {
            i: (k, crypto_scalarmult_base(k)) for i, k in one_time.items()
        }
        #: id -> (seed, public key, signature); parsed keys are made on use.
        self._pq_one_time: dict[int, tuple[bytes, bytes, bytes]] = {
            i: (seed, _pq_key(seed)[1], sig) for i, (seed, sig) in (pq_one_time or {}).items()
        }
        self._used: dict[int, None] = dict.fromkeys(used)
        self._trim_used()
        self._next_opk = next_opk if next_opk is not None else max(self._one_time, default=0) + 1
        self._next_pq_opk = next_pq_opk
        self._bundle: PrekeyBundle | None = None

    def _set_current(
        self,
        spk_id: int,
        spk_private: bytes,
        pq_id: int | None,
        pq_seed: bytes | None,
        spk_public: bytes | None = None,
    ) -> None:
        self.spk_id = spk_id
        self.spk_private = spk_private
        self.spk_public = spk_public or crypto_scalarmult_base(spk_private)
        self.pq_id = pq_id
        self.pq_seed = pq_seed
        # Parsed once: ML-KEM key expansion from the seed is the costly part.
        self._pq: MLKEM768PrivateKey | None = None
        self._pq_public: bytes | None = None
        if pq_seed is not None:
            self._pq, self._pq_public = _pq_key(pq_seed)

    def _sign_body(self, wallet: Wallet) -> None:
        # sign_auth: hybrid for a hybrid wallet (bundles authenticate the identity).
        self.signature = wallet.sign_auth(
            _BUNDLE_DOMAIN
            + _bundle_body(
                self.did,
                self.suites,
                self.identity.public,
                self.spk_id,
                self.spk_public,
                self.pq_id,
                self._pq_public,
                self.mldsa65_public_key,
            )
        )
        self._bundle = None

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
        now: int = 0,
        pq_one_time: int = 0,
    ) -> PrekeySecrets:
        """Fresh signed prekey (+ ML-KEM-768 prekey if ``pq``), ``one_time`` OPKs and
        ``pq_one_time`` signed ML-KEM OPKs; ``now`` (seconds) dates the SPK."""
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
            created=now,
        )
        secrets._sign_body(wallet)
        if pq_one_time:
            secrets.add_pq_one_time(wallet, pq_one_time, rng)
        return secrets

    @property
    def did(self) -> str:
        return self.identity.did

    @property
    def pq_private(self) -> MLKEM768PrivateKey | None:
        """The current last-resort ML-KEM-768 private key."""
        return self._pq

    # --- rotation ----------------------------------------------------------

    def rotate(self, wallet: Wallet, *, now: int, grace: int, rng: Rng = os.urandom) -> int:
        """Replace the SPK (and the last-resort ML-KEM key) under a new id and re-sign;
        the old pair stays usable until ``now + grace``. Returns the new SPK id."""
        if wallet.did != self.did:
            raise UsageError("wallet does not own these prekeys")
        if grace < 0:
            raise UsageError("grace must be >= 0 seconds")
        self._retired.append(
            _Retired(self.spk_id, self.spk_private, self.pq_id, self.pq_seed, now + grace)
        )
        del self._retired[:-MAX_RETIRED]
        new_id = max([self.spk_id, self.pq_id or 0, *(r.spk_id for r in self._retired)]) + 1
        spk_private, spk_public = x25519_keypair(rng)
        pq_seed = rng(MLKEM_SEED_SIZE) if self.pq_seed is not None else None
        self._set_current(
            new_id, spk_private, new_id if pq_seed else None, pq_seed, spk_public=spk_public
        )
        self.created = now
        self._sign_body(wallet)
        return new_id

    def expire(self, now: int) -> bool:
        """Delete retired prekeys whose grace ended; True if any was."""
        kept = [r for r in self._retired if r.expires > now]
        changed = len(kept) != len(self._retired)
        self._retired = kept
        return changed

    def expire_due(self, now: int) -> bool:
        """Whether :meth:`expire` would delete something."""
        return any(r.expires <= now for r in self._retired)

    def rotation_due(self, now: int, interval: int) -> bool:
        """Whether the current SPK is at least ``interval`` seconds old."""
        return now - self.created >= interval

    @property
    def retired_ids(self) -> list[int]:
        return [r.spk_id for r in self._retired]

    def spk_private_for(self, spk_id: int) -> bytes:
        """The private signed prekey ``spk_id`` (current or retired); BundleError if gone."""
        if spk_id == self.spk_id:
            return self.spk_private
        for r in self._retired:
            if r.spk_id == spk_id:
                return r.spk_private
        raise BundleError(f"unknown signed prekey id {spk_id}")

    def pq_private_for(self, pq_id: int | None) -> MLKEM768PrivateKey:
        """The ML-KEM private key ``pq_id``: a one-time key (not consumed here), the
        current or a retired last-resort key. BundleError if none is held."""
        if pq_id is not None:
            entry = self._pq_one_time.get(pq_id)
            if entry is not None:
                return MLKEM768PrivateKey.from_seed_bytes(entry[0])
            if pq_id == self.pq_id and self._pq is not None:
                return self._pq
            for r in self._retired:
                if r.pq_id == pq_id and r.pq_seed is not None:
                    return MLKEM768PrivateKey.from_seed_bytes(r.pq_seed)
            if pq_id in self._used or PQ_OPK_ID_BASE <= pq_id < self._next_pq_opk:
                raise BundleError(f"one-time ML-KEM prekey {pq_id} was already used")
        raise BundleError(f"unknown ML-KEM prekey id {pq_id}")

    # --- one-time prekeys --------------------------------------------------

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

    def add_pq_one_time(self, wallet: Wallet, count: int, rng: Rng = os.urandom) -> list[int]:
        """Mint ``count`` signed one-time ML-KEM-768 prekeys; return their ids."""
        if wallet.did != self.did:
            raise UsageError("wallet does not own these prekeys")
        if count < 0 or len(self._pq_one_time) + count > MAX_PQ_ONE_TIME:
            raise UsageError(f"at most {MAX_PQ_ONE_TIME} unused one-time ML-KEM prekeys")
        ids = list(range(self._next_pq_opk, self._next_pq_opk + count))
        for i in ids:
            seed = rng(MLKEM_SEED_SIZE)
            public = _pq_key(seed)[1]
            sig = wallet.sign_auth(pq_one_time_message(self.did, i, public))
            self._pq_one_time[i] = (seed, public, sig)
        self._next_pq_opk += count
        self._bundle = None
        return ids

    def bundle(self) -> PrekeyBundle:
        """The public bundle with the one-time keys not yet consumed (cached until they change)."""
        if self._bundle is None:
            opks = tuple((i, pub) for i, (_, pub) in sorted(self._one_time.items()))
            pq_opks = tuple((i, pub, sig) for i, (_, pub, sig) in sorted(self._pq_one_time.items()))
            self._bundle = PrekeyBundle(
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
                pq_opks,
            )
        return self._bundle

    def one_time_private(self, opk_id: int) -> bytes:
        """The private OPK ``opk_id`` without consuming it (responder computes tentatively)."""
        entry = self._one_time.get(opk_id)
        if entry is None:
            if opk_id in self._used or 0 < opk_id < self._next_opk:
                raise BundleError(f"one-time prekey {opk_id} was already used")
            raise BundleError(f"unknown one-time prekey {opk_id}")
        return entry[0]

    def _trim_used(self) -> None:
        while len(self._used) > MAX_USED_REMEMBERED:
            del self._used[next(iter(self._used))]

    def consume_one_time(self, opk_id: int) -> bytes:
        """Remove OPK ``opk_id`` for good; a second call raises BundleError."""
        private = self.one_time_private(opk_id)
        del self._one_time[opk_id]
        self._used[opk_id] = None
        self._trim_used()
        self._bundle = None
        return private

    def consume_pq_one_time(self, pq_id: int) -> None:
        """Remove one-time ML-KEM prekey ``pq_id`` for good (no-op for a last-resort id)."""
        if self._pq_one_time.pop(pq_id, None) is not None:
            self._used[pq_id] = None
            self._trim_used()
            self._bundle = None

    @property
    def one_time_ids(self) -> list[int]:
        return sorted(self._one_time)

    @property
    def pq_one_time_ids(self) -> list[int]:
        return sorted(self._pq_one_time)

    # --- persistence -------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (hex strings). Secret: store it 0600."""

        def h(b: bytes | None) -> str | None:
            return None if b is None else b.hex()

        return {
            "version": 2,
            "did": self.did,
            "identity_private": self.identity.private.hex(),
            "identity_binding": self.identity.binding.hex(),
            "suites": list(self.suites),
            "spk_id": self.spk_id,
            "spk_private": self.spk_private.hex(),
            "pq_id": self.pq_id,
            "pq_seed": h(self.pq_seed),
            "signature": self.signature.hex(),
            "one_time": {str(i): k.hex() for i, (k, _) in sorted(self._one_time.items())},
            "used": list(self._used),
            "next_opk": self._next_opk,
            "mldsa65_public_key": h(self.mldsa65_public_key),
            "created": self.created,
            "retired": [
                [r.spk_id, r.spk_private.hex(), r.pq_id, h(r.pq_seed), r.expires]
                for r in self._retired
            ],
            "pq_one_time": {
                str(i): [seed.hex(), sig.hex()]
                for i, (seed, _, sig) in sorted(self._pq_one_time.items())
            },
            "next_pq_opk": self._next_pq_opk,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PrekeySecrets:
        """Inverse of :meth:`to_dict` (version 1 dicts too); bad input raises EncodingError."""
        try:
            if d["version"] not in (1, 2):
                raise EncodingError("prekey secrets: unknown version")

            def b(v: str | None) -> bytes | None:
                return None if v is None else bytes.fromhex(v)

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
                pq_seed=b(d["pq_seed"]),
                signature=bytes.fromhex(d["signature"]),
                one_time={int(i): bytes.fromhex(k) for i, k in d["one_time"].items()},
                used=[int(i) for i in d["used"]],
                next_opk=int(d["next_opk"]),
                mldsa65_public_key=b(d.get("mldsa65_public_key")),
                created=int(d.get("created", 0)),
                retired=[
                    _Retired(int(i), bytes.fromhex(k), None if p is None else int(p), b(s), int(e))
                    for i, k, p, s, e in d.get("retired", [])
                ],
                pq_one_time={
                    int(i): (bytes.fromhex(seed), bytes.fromhex(sig))
                    for i, (seed, sig) in d.get("pq_one_time", {}).items()
                },
                next_pq_opk=int(d.get("next_pq_opk", PQ_OPK_ID_BASE)),
            )
        except EncodingError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, NaclRuntimeError) as exc:
            raise EncodingError(f"prekey secrets: malformed dict ({exc})") from None

    def to_bytes(self) -> bytes:
        """Compact binary form; same content as :meth:`to_dict`.

        Magic ``TPKS\\x03`` for a classical identity (64-byte signatures), ``TPKS\\x04``
        for a hybrid one (3373-byte signatures, ML-DSA-65 public key), then the
        layout of magic 1 / 2 and the rotation block (docs/PROTOCOL.md).
        """
        hybrid = self.mldsa65_public_key is not None
        out = [
            _MAGIC_HYBRID if hybrid else _MAGIC,
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
        out += [pack_u32(i) for i in self._used]
        out.append(pack_u32(self._next_opk))
        if self.mldsa65_public_key is not None:
            out.append(self.mldsa65_public_key)
        # Rotation block (magic 3 / 4).
        out += [_U64.pack(self.created), pack_u8(len(self._retired))]
        for r in self._retired:
            out += [pack_u32(r.spk_id), r.spk_private]
            if r.pq_id is None or r.pq_seed is None:
                out.append(b"\x00")
            else:
                out += [b"\x01", pack_u32(r.pq_id), r.pq_seed]
            out.append(_U64.pack(r.expires))
        out.append(pack_u32(len(self._pq_one_time)))
        out += [pack_u32(i) + seed + sig for i, (seed, _, sig) in sorted(self._pq_one_time.items())]
        out.append(pack_u32(self._next_pq_opk))
        return b"".join(out)

    @classmethod
    def from_bytes(cls, data: bytes) -> PrekeySecrets:
        """Inverse of :meth:`to_bytes` (and of the magic 1 / 2 layout); garbage raises
        EncodingError."""
        try:
            r = ByteReader(data, "prekey secrets")
            magic = r.take(len(_MAGIC))
            if magic not in (_MAGIC_V1, _MAGIC_V1_HYBRID, _MAGIC, _MAGIC_HYBRID):
                raise EncodingError("prekey secrets: bad magic")
            hybrid = magic in (_MAGIC_V1_HYBRID, _MAGIC_HYBRID)
            sig_size = HYBRID_SIGNATURE_SIZE if hybrid else SIGNATURE_SIZE
            did = r.text16()
            ik_private, binding = r.take(KEY_SIZE), r.take(SIGNATURE_SIZE)
            suites = tuple(r.var8().decode("ascii") for _ in range(r.u8()))
            spk_id, spk_private = r.u32(), r.take(KEY_SIZE)
            pq_id: int | None = None
            pq_seed: bytes | None = None
            if r.u8():
                pq_id, pq_seed = r.u32(), r.take(MLKEM_SEED_SIZE)
            signature = r.take(sig_size)
            opks = {r.u32(): r.take(KEY_SIZE) for _ in range(r.u32())}
            used = [r.u32() for _ in range(r.u32())]
            next_opk = r.u32()
            mldsa = r.take(MLDSA65_PUBLIC_KEY_SIZE) if hybrid else None
            created, retired, pq_opks, next_pq = 0, [], {}, PQ_OPK_ID_BASE
            if magic in (_MAGIC, _MAGIC_HYBRID):
                created = _U64.unpack(r.take(8))[0]
                for _ in range(r.u8()):
                    rid, rpriv = r.u32(), r.take(KEY_SIZE)
                    rpq_id = rpq_seed = None
                    if r.u8():
                        rpq_id, rpq_seed = r.u32(), r.take(MLKEM_SEED_SIZE)
                    retired.append(
                        _Retired(rid, rpriv, rpq_id, rpq_seed, _U64.unpack(r.take(8))[0])
                    )
                pq_opks = {
                    r.u32(): (r.take(MLKEM_SEED_SIZE), r.take(sig_size)) for _ in range(r.u32())
                }
                next_pq = r.u32()
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
            created=created,
            retired=retired,
            pq_one_time=pq_opks,
            next_pq_opk=next_pq,
        )
