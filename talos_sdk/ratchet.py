"""The Double Ratchet :class:`Session` (docs/PROTOCOL.md "Double Ratchet"; Signal DR spec §3).

* KDF_RK(rk, dh) = HKDF-SHA256(salt=rk, ikm=dh, info="Talos_DR_Root_v1", 64) -> rk', ck.
* KDF_CK(ck): mk = HMAC-SHA256(ck, 0x01), ck' = HMAC-SHA256(ck, 0x02).
* Message encryption (docs/adr/0006-message-key-as-aead-key.md): ChaCha20-Poly1305
  keyed with mk itself, nonce = 8 zero bytes || N u32, AD = X3DH AD || header bytes ||
  caller AD. mk is a uniform PRF output used for exactly one message, one of the
  nonce options Signal DR §5.2 lists for an AEAD ENCRYPT.
* Header (41 bytes): type u8 (1 = normal, 2 = carries X3DH initial data) | ratchet
  public key(32) | PN u32 | N u32; type 2 adds u16 length || initial data.
* Start (DR spec §3.3): the initiator's first ratchet key is a fresh pair, never the
  X3DH ephemeral; the responder's is its signed prekey.
* Lazy DH ratchet (docs/adr/0002-lazy-dh-ratchet.md): a new peer ratchet key always
  yields a new receiving chain at once; our own new key pair and sending chain are
  made when we next send, and only once ``ratchet_every`` messages went out on the
  current sending chain or it is ``ratchet_max_age`` seconds old (by the injected
  ``clock``). ``ratchet_every=1`` (the default) gives Signal's key schedule exactly.

Decryption is computed on locals and committed only after the AEAD verifies, so a
forged, replayed or truncated message leaves the session exactly as it was.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Mapping
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from talos_sdk.bundle import (
    SUITE_HYBRID,
    SUITE_X25519,
    SUITES,
    IdentityKey,
    PrekeyBundle,
    Rng,
    x25519_dh,
    x25519_keypair,
)
from talos_sdk.errors import (
    BundleError,
    DecryptionError,
    EncodingError,
    MalformedFrameError,
    UsageError,
)
from talos_sdk.kdf import hkdf, kdf_ck
from talos_sdk.prekeys import PrekeySecrets
from talos_sdk.ratchet_state import (
    Skipped,
    state_from_bytes,
    state_from_dict,
    state_to_bytes,
    state_to_dict,
)
from talos_sdk.wallet import Wallet
from talos_sdk.x3dh import InitialData, PeerIdentity
from talos_sdk.x3dh import initiate as x3dh_initiate
from talos_sdk.x3dh import respond as x3dh_respond

__all__ = [
    "HEADER_SIZE",
    "MAX_SKIP",
    "MAX_SKIPPED_KEYS",
    "PeerIdentity",
    "Session",
]

MAX_SKIP = 1000
MAX_SKIPPED_KEYS = 2000
HEADER_SIZE = 41
TAG_SIZE = 16
_MAX_N = 0xFFFFFFFF
_TYPE_NORMAL = 1
_TYPE_INITIAL = 2
_HEADER = struct.Struct(">B32sII")
_ROOT_INFO = b"Talos_DR_Root_v1"
_NONCE = struct.Struct(">8xI")

#: Seconds from any fixed origin (``time.monotonic``); the SDK reads no clock itself.
Clock = Callable[[], float]


def _kdf_rk(rk: bytes, dh_out: bytes) -> tuple[bytes, bytes]:
    out = hkdf(dh_out, salt=rk, info=_ROOT_INFO, length=64)
    return out[:32], out[32:]


def _open(mk: bytes, n: int, ciphertext: bytes, aad: bytes) -> bytes:
    try:
        return ChaCha20Poly1305(mk).decrypt(_NONCE.pack(n), ciphertext, aad)
    except InvalidTag:
        raise DecryptionError() from None


class Session:
    """One Double Ratchet session with one peer. Not thread-safe; persist with
    :meth:`to_bytes` / :meth:`to_dict` after every call that changed it."""

    __slots__ = (
        "_ad",
        "_chain_started",
        "_ckr",
        "_cks",
        "_dhr",
        "_dhs_priv",
        "_dhs_pub",
        "_first_dh",
        "_initial",
        "_nr",
        "_ns",
        "_pending",
        "_pn",
        "_rk",
        "_rng",
        "_skipped",
        "clock",
        "local_did",
        "peer_identity",
        "ratchet_every",
        "ratchet_max_age",
        "skip_budget",
        "suite",
    )

    def __init__(
        self,
        *,
        suite: str,
        local_did: str,
        peer_identity: PeerIdentity,
        ad: bytes,
        rk: bytes,
        dhs: tuple[bytes, bytes],
        dhr: bytes | None,
        cks: bytes | None,
        ckr: bytes | None = None,
        ns: int = 0,
        nr: int = 0,
        pn: int = 0,
        pending: bool = False,
        initial: bytes = b"",
        skipped: Mapping[tuple[bytes, int], bytes] | None = None,
        ratchet_every: int = 1,
        ratchet_max_age: float | None = None,
        clock: Clock | None = None,
        rng: Rng = os.urandom,
    ) -> None:
        if suite not in SUITES:
            raise UsageError(f"unknown suite {suite!r}")
        self.suite = suite
        self.local_did = local_did
        self.peer_identity = peer_identity
        self.ratchet_every = ratchet_every
        self.ratchet_max_age = ratchet_max_age
        self.clock = clock
        self.check_policy()
        #: clock() when the current sending chain began; None = unknown (restored
        #: state), which counts as too old, so a lazy session ratchets at once.
        self._chain_started: float | None = None
        self._ad = ad
        self._rk = rk
        self._dhs_priv, self._dhs_pub = dhs
        self._dhr = dhr
        self._cks = cks
        self._ckr = ckr
        self._ns, self._nr, self._pn = ns, nr, pn
        self._pending = pending
        self._initial = initial
        self._skipped: dict[tuple[bytes, int], bytes] = dict(skipped or {})
        self._rng = rng
        self._first_dh: tuple[bytes, bytes] | None = None
        #: The owner's ``take(n) -> bool`` for n skipped-key derivations, asked before
        #: a message that needs them is tried: a forged header costs them anyway.
        self.skip_budget: Callable[[int], bool] | None = None

    # --- construction ------------------------------------------------------

    @classmethod
    def initiate(
        cls,
        wallet: Wallet,
        identity: IdentityKey | PrekeySecrets | None,
        peer_bundle: PrekeyBundle,
        *,
        suite: str | None = None,
        ratchet_every: int = 1,
        ratchet_max_age: float | None = None,
        clock: Clock | None = None,
        rng: Rng = os.urandom,
    ) -> Session:
        """Start a session with the owner of ``peer_bundle`` (verified here).

        ``identity`` is our X25519 identity key (or the secrets holding it); ``None``
        mints one for ``wallet``. The first messages carry the X3DH initial data
        until the peer's first reply arrives.
        """
        if not isinstance(peer_bundle, PrekeyBundle):
            raise UsageError(
                f"peer_bundle must be a PrekeyBundle, not {type(peer_bundle).__name__} "
                "(parse published bytes with PrekeyBundle.from_bytes)"
            )
        ik = identity.identity if isinstance(identity, PrekeySecrets) else identity
        if ik is None:
            ik = IdentityKey.generate(wallet, rng)
        if ik.did != wallet.did:
            raise UsageError("identity key belongs to another wallet")
        x = x3dh_initiate(ik, peer_bundle, suite=suite, rng=rng)
        # DR §3.3 RatchetInitAlice: a fresh first ratchet key, never X3DH's EK_A,
        # whose private half x3dh_initiate has already dropped.
        dhs = x25519_keypair(rng)
        rk, cks = _kdf_rk(x.shared_secret, x25519_dh(dhs[0], x.responder_spk))
        init = x.initial.to_bytes()
        session = cls(
            suite=x.suite,
            local_did=wallet.did,
            peer_identity=x.peer,
            ad=x.associated_data,
            rk=rk,
            dhs=dhs,
            dhr=x.responder_spk,
            cks=cks,
            initial=struct.pack(">H", len(init)) + init,
            ratchet_every=ratchet_every,
            ratchet_max_age=ratchet_max_age,
            clock=clock,
            rng=rng,
        )
        session._chain_started = session._now()
        return session

    @classmethod
    def respond(
        cls,
        wallet: Wallet,
        prekey_secrets: PrekeySecrets,
        first_message: bytes,
        *,
        ad: bytes = b"",
        ratchet_every: int = 1,
        ratchet_max_age: float | None = None,
        clock: Clock | None = None,
        rng: Rng = os.urandom,
    ) -> tuple[Session, bytes]:
        """Accept an initiator's first message: X3DH, then decrypt it.

        The one-time prekey is consumed only once the message decrypts. Raises
        MalformedFrameError (not an initial message), BundleError (unknown prekey,
        reused OPK, suite not offered), SignatureError (identity binding) or
        DecryptionError.
        """
        if prekey_secrets.did != wallet.did:
            raise UsageError("prekey secrets belong to another wallet")
        initial = _parse_initial(first_message)
        x = x3dh_respond(prekey_secrets, initial)
        # DR §3.3 RatchetInitBob: Bob's first ratchet key pair is the signed prekey.
        # Only the one DH it is needed for is kept (until the message opens), not
        # the SPK's private half, which rotation deletes.
        peer_ratchet = first_message[1:33]
        first_dh = x25519_dh(prekey_secrets.spk_private_for(initial.spk_id), peer_ratchet)
        session = cls(
            suite=x.suite,
            local_did=wallet.did,
            peer_identity=x.peer,
            ad=x.associated_data,
            rk=x.shared_secret,
            dhs=(b"", x.responder_spk),
            dhr=None,
            cks=None,
            ratchet_every=ratchet_every,
            ratchet_max_age=ratchet_max_age,
            clock=clock,
            rng=rng,
        )
        session._first_dh = (peer_ratchet, first_dh)
        plaintext = session.decrypt(first_message, ad)
        if initial.opk_id is not None:
            prekey_secrets.consume_one_time(initial.opk_id)
        if initial.pq_id is not None:
            prekey_secrets.consume_pq_one_time(initial.pq_id)
        return session, plaintext

    @classmethod
    def create_pair(
        cls, suite: str = SUITE_X25519, *, ratchet_every: int = 1, rng: Rng = os.urandom
    ) -> tuple[Session, Session]:
        """Two connected sessions between FRESH identities, through the real X3DH path."""
        if suite not in SUITES:  # the caller's argument, not a peer's bundle
            raise UsageError(f"unknown suite {suite!r}; known: {list(SUITES)}")
        alice_wallet, bob_wallet = Wallet.generate(rng), Wallet.generate(rng)
        bob_secrets = PrekeySecrets.generate(bob_wallet, pq=suite == SUITE_HYBRID, rng=rng)
        alice = cls.initiate(
            alice_wallet,
            None,
            bob_secrets.bundle(),
            suite=suite,
            ratchet_every=ratchet_every,
            rng=rng,
        )
        bob, _ = cls.respond(
            bob_wallet, bob_secrets, alice.encrypt(b""), ratchet_every=ratchet_every, rng=rng
        )
        return alice, bob

    # --- messages ----------------------------------------------------------

    @property
    def peer_did(self) -> str:
        return self.peer_identity.did

    @property
    def associated_data(self) -> bytes:
        """The X3DH AD every message is bound to."""
        return self._ad

    def check_policy(self) -> None:
        """Refuse a ratchet policy that is not one of those ADR 0002 describes."""
        every, age = self.ratchet_every, self.ratchet_max_age
        if not isinstance(every, int) or every < 1:
            raise UsageError("ratchet_every must be an int >= 1")
        if age is not None and not age > 0:
            raise UsageError("ratchet_max_age must be > 0 seconds (or None)")
        if every > 1 and age is not None and self.clock is None:
            raise UsageError("ratchet_max_age needs a clock (seconds, monotonic)")

    def _now(self) -> float | None:
        return None if self.clock is None else self.clock()

    def _owes_step(self) -> bool:
        """Whether the deferred sending step is due (ADR 0002: count, then age)."""
        if self._cks is None or self._ns >= self.ratchet_every:
            return True
        age = self.ratchet_max_age
        if age is None:
            return False
        started = self._chain_started
        now = self._now()
        return started is None or now is None or now - started >= age

    def _ratchet_send(self) -> None:
        assert self._dhr is not None
        private, public = x25519_keypair(self._rng)
        self._rk, self._cks = _kdf_rk(self._rk, x25519_dh(private, self._dhr))
        self._pn, self._ns = self._ns, 0
        self._dhs_priv, self._dhs_pub = private, public
        self._pending = False
        self._chain_started = self._now()

    def prepare_send(self) -> bool:
        """Take the sending step the next :meth:`encrypt` owes now; True if one was taken.

        The same step at the same point of the message stream (ADR 0002), only
        earlier: a caller that has just handed on what it received runs it while
        the peer's reply is being made, so the key pair and DH (about two thirds
        of a turn's ratchet cost) leave the round trip's critical path.
        """
        if self._pending and self._owes_step():
            self._ratchet_send()
            return True
        return False

    def encrypt(self, plaintext: bytes, ad: bytes = b"") -> bytes:
        """Seal ``plaintext`` as the next message (DR spec §3.4 RatchetEncrypt)."""
        if not isinstance(plaintext, bytes):
            plaintext = _as_bytes(plaintext, "plaintext")
        if not isinstance(ad, bytes):
            ad = _as_bytes(ad, "ad")
        if self._pending and self._owes_step():
            self._ratchet_send()
        ck = self._cks
        if ck is None:
            raise UsageError("this session cannot send before it has received a message")
        n = self._ns
        if n >= _MAX_N:
            raise UsageError("sending chain exhausted")
        initial = self._initial
        header = (
            _HEADER.pack(_TYPE_INITIAL if initial else _TYPE_NORMAL, self._dhs_pub, self._pn, n)
            + initial
        )
        mk, next_ck = kdf_ck(ck)
        sealed = ChaCha20Poly1305(mk).encrypt(_NONCE.pack(n), plaintext, self._ad + header + ad)
        self._cks = next_ck
        self._ns = n + 1
        return header + sealed

    def decrypt(self, message: bytes, ad: bytes = b"") -> bytes:
        """Open a message (DR spec §3.5 RatchetDecrypt, with MAX_SKIP and the lazy ratchet).

        Any failure is one opaque :class:`DecryptionError` and changes nothing.
        ``message`` and ``ad`` may be any bytes-like object; another type is the
        caller's mistake (:class:`UsageError`), not a forged message.
        """
        if not isinstance(message, bytes):
            message = _as_bytes(message, "message")
        if not isinstance(ad, bytes):
            ad = _as_bytes(ad, "ad")
        if len(message) < HEADER_SIZE + TAG_SIZE:
            raise DecryptionError()
        kind, dh, pn, n = _HEADER.unpack_from(message)
        if kind == _TYPE_NORMAL:
            end = HEADER_SIZE
        elif kind == _TYPE_INITIAL:
            end = HEADER_SIZE + 2 + int.from_bytes(message[HEADER_SIZE : HEADER_SIZE + 2], "big")
            if len(message) < end + TAG_SIZE:
                raise DecryptionError()
        else:
            raise DecryptionError()
        aad = self._ad + message[:end] + ad
        body = message[end:]

        mk = self._skipped.get((dh, n))
        if mk is not None:
            plaintext = _open(mk, n, body, aad)
            del self._skipped[(dh, n)]
            self._initial = b""
            return plaintext

        new_skipped: list[tuple[tuple[bytes, int], bytes]] = []
        if dh == self._dhr:
            # No receiving chain yet (an initiator that has heard nothing): a header
            # naming the peer's public prekey is forged, not a bug.
            if self._ckr is None or n < self._nr or not self._may_skip(n - self._nr):
                raise DecryptionError()
            ck = self._ckr
            for i in range(self._nr, n):
                mk, ck = kdf_ck(ck)
                new_skipped.append(((dh, i), mk))
            mk, ck = kdf_ck(ck)
            plaintext = _open(mk, n, body, aad)
            self._ckr = ck
            self._nr = n + 1
        else:
            # A new peer ratchet key: finish the old receiving chain up to PN, then
            # step the root chain once (the receiving half of DHRatchet).
            old_ck, dhr = self._ckr, self._dhr
            behind = max(pn - self._nr, 0) if old_ck is not None and dhr is not None else 0
            if behind > MAX_SKIP or not self._may_skip(n, behind):
                raise DecryptionError()
            if old_ck is not None and dhr is not None:
                for i in range(self._nr, pn):
                    mk, old_ck = kdf_ck(old_ck)
                    new_skipped.append(((dhr, i), mk))
            if self._first_dh is not None and self._first_dh[0] == dh:
                dh_out = self._first_dh[1]
            else:
                if not self._dhs_priv:
                    raise DecryptionError()
                try:
                    dh_out = x25519_dh(self._dhs_priv, dh)
                except BundleError:
                    raise DecryptionError() from None
            rk, ck = _kdf_rk(self._rk, dh_out)
            for i in range(n):
                mk, ck = kdf_ck(ck)
                new_skipped.append(((dh, i), mk))
            mk, ck = kdf_ck(ck)
            plaintext = _open(mk, n, body, aad)
            if self._first_dh is not None:
                # The SPK's private half is not needed for sending: drop the DH cache.
                self._first_dh = None
            self._rk, self._dhr = rk, dh
            self._ckr = ck
            self._nr = n + 1
            self._pending = True
        if new_skipped:
            skipped = self._skipped
            skipped.update(new_skipped)
            while len(skipped) > MAX_SKIPPED_KEYS:
                del skipped[next(iter(skipped))]
        self._initial = b""  # the peer has the session: stop resending X3DH data
        return plaintext

    def _may_skip(self, count: int, more: int = 0) -> bool:
        """``count`` <= MAX_SKIP, and the owner's budget pays for ``count + more`` keys."""
        budget, total = self.skip_budget, count + more
        return count <= MAX_SKIP and (total <= 0 or budget is None or budget(total))

    # --- persistence -------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "local_did": self.local_did,
            "peer_did": self.peer_identity.did,
            "peer_signing_key": self.peer_identity.signing_key,
            "peer_identity_dh": self.peer_identity.identity_dh,
            "ad": self._ad,
            "rk": self._rk,
            "dhs_priv": self._dhs_priv,
            "dhs_pub": self._dhs_pub,
            "dhr": self._dhr,
            "cks": self._cks,
            "ckr": self._ckr,
            "ns": self._ns,
            "nr": self._nr,
            "pn": self._pn,
            "pending": self._pending,
            "initial": self._initial,
            "ratchet_every": self.ratchet_every,
            "first_dh": b"".join(self._first_dh) if self._first_dh else None,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe state (bytes as hex). Secret: store it like a key."""
        return state_to_dict(self._state(), self._skipped)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, rng: Rng = os.urandom) -> Session:
        """Inverse of :meth:`to_dict`; malformed input raises EncodingError."""
        try:
            return cls._build(*state_from_dict(d), rng)
        except EncodingError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, UsageError) as exc:
            raise EncodingError(f"session state: malformed ({exc!r})") from None

    @classmethod
    def _build(cls, s: dict[str, Any], skipped: Skipped, rng: Rng) -> Session:
        session = cls(
            suite=s["suite"],
            local_did=s["local_did"],
            peer_identity=PeerIdentity(s["peer_did"], s["peer_signing_key"], s["peer_identity_dh"]),
            ad=s["ad"],
            rk=s["rk"],
            dhs=(s["dhs_priv"], s["dhs_pub"]),
            dhr=s["dhr"],
            cks=s["cks"],
            ckr=s["ckr"],
            ns=s["ns"],
            nr=s["nr"],
            pn=s["pn"],
            pending=s["pending"],
            initial=s["initial"],
            skipped=skipped,
            ratchet_every=s["ratchet_every"],
            rng=rng,
        )
        first = s["first_dh"]
        if first is not None:
            if len(first) != 64:
                raise EncodingError("session state: bad first_dh")
            session._first_dh = (first[:32], first[32:])
        for key in ("rk", "dhs_pub", "peer_signing_key", "peer_identity_dh"):
            if len(s[key]) != 32:
                raise EncodingError(f"session state: {key} must be 32 bytes")
        return session

    def to_bytes(self) -> bytes:
        """Compact binary state (talos_sdk/ratchet_state.py)."""
        return state_to_bytes(self._state(), self._skipped)

    @classmethod
    def from_bytes(cls, data: bytes, *, rng: Rng = os.urandom) -> Session:
        """Inverse of :meth:`to_bytes`; garbage raises EncodingError."""
        try:
            return cls._build(*state_from_bytes(data), rng)
        except (MalformedFrameError, UsageError, TypeError, struct.error) as exc:
            if isinstance(exc, EncodingError):
                raise
            raise EncodingError(f"session state: {exc}") from None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Session):
            return NotImplemented
        return self.to_bytes() == other.to_bytes()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"Session(suite={self.suite!r}, local={self.local_did!r}, peer={self.peer_did!r}, "
            f"ns={self._ns}, nr={self._nr}, skipped={len(self._skipped)})"
        )


def _as_bytes(value: object, what: str) -> bytes:
    """``bytes`` of a bytes-like ``value`` (socket buffers are often bytearray / memoryview)."""
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise UsageError(f"{what} must be bytes, not {type(value).__name__}")


def _parse_initial(message: bytes) -> InitialData:
    if not isinstance(message, bytes) or not message:
        raise MalformedFrameError("first message: empty or not bytes")
    if message[0] != _TYPE_INITIAL:
        raise MalformedFrameError("first message does not carry X3DH initial data")
    if len(message) < HEADER_SIZE + 2 + TAG_SIZE:
        raise MalformedFrameError("first message: too short")
    length = int.from_bytes(message[HEADER_SIZE : HEADER_SIZE + 2], "big")
    data = message[HEADER_SIZE + 2 : HEADER_SIZE + 2 + length]
    if len(data) != length:
        raise MalformedFrameError("first message: initial data truncated")
    return InitialData.from_bytes(data)
